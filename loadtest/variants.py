"""The benchmark's policies with tracing or quotas on (`python -m loadtest.bench --tracing HOST:PORT`, `--quotas`):
the rows beside a run without, for what each costs (docs/tracing.md, docs/quotas.md). A copy of the policy files,
changed as parsed YAML; `${...}` values stay for the gateway to resolve. With `--hsm`: the gateway's keys in a
SoftHSM2 token (`hsm_policies`, the files' text changed). (`--archive`'s copy is loadtest/archive.py's, which the
soak shares.)"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from certs import hsm
from gateway.policy import XML_PROFILES

# Limits no benchmark reaches: every request is counted (one rate-limit service round trip per stage), none refused.
UNREACHED = {"per_second": 1_000_000_000, "per_day": 4_000_000_000}  # the service's limits are uint32
VERIFIES_CALLER = XML_PROFILES - {"xml"}


def write(policies: Path, out: Path, tracing: str | None, sampling_percent: float, quotas: bool) -> Path:
    """`policies` copied into `out`: `edge.tracing` to the OTLP/HTTP collector `tracing` at `sampling_percent`,
    and/or every route's client_address and backend quotas (plus caller quotas where a caller is verified)."""
    out.mkdir(parents=True, exist_ok=True)
    files = sorted(policies.glob("*.yaml"))
    docs = {p.name: yaml.safe_load(p.read_text()) for p in files}
    if tracing:
        holder = next((d for d in docs.values() if "edge" in d), docs[files[0].name])
        holder["edge"] = {**holder.get("edge", {}), "tracing": {"collector": tracing,
                                                                "sampling_percent": sampling_percent}}  # fmt: skip
    for doc in docs.values():
        for route in doc["routes"] if quotas else []:
            route["quotas"] = {"client_address": UNREACHED, "backend": UNREACHED}
            if route["profile"] in VERIFIES_CALLER:
                route["quotas"]["caller"] = UNREACHED
    for name, doc in docs.items():
        (out / name).write_text(yaml.safe_dump(doc, sort_keys=False, width=200))
    return out


FLOOD_ROUTE = "flood"  # the soak's attacked route (loadtest/soak.py): a copy of `copy_of` with a per-address quota


def add_flood_route(policies: Path, copy_of: str, per_second: int) -> str:
    """A route an attacker floods: `copy_of` at /flood/ with a client-address quota of `per_second`, added to the
    policy file that holds `copy_of`. Its path prefix is returned."""
    for f in sorted(policies.glob("*.yaml")):
        doc = yaml.safe_load(f.read_text())
        route = next((r for r in doc["routes"] if r["name"] == copy_of), None)
        if route is not None:
            prefix = f"/{FLOOD_ROUTE}/"
            doc["routes"].append({**route, "name": FLOOD_ROUTE, "match": {"path_prefix": prefix},
                                  "quotas": {"client_address": {"per_second": per_second}}})  # fmt: skip
            f.write_text(yaml.safe_dump(doc, sort_keys=False, width=200))
            return prefix
    raise ValueError(f"no route {copy_of!r} in {policies}")


def hsm_policies(policies: Path, certs: Path, out: Path) -> Path:
    """`policies` copied into `out` with the gateway's private keys (gateway-sign, gateway-enc) in a SoftHSM2 token
    made from `certs` (certs/hsm.py), SOFTHSM2_CONF set for this process and the gateway it starts: the rsa rows
    then measure the token beside a run without --hsm (the file keys)."""
    os.environ["SOFTHSM2_CONF"] = str(hsm.init(certs, certs))
    out.mkdir(parents=True, exist_ok=True)
    for src in policies.glob("*.yaml"):
        text = src.read_text()
        for label in hsm.KEYS:
            text = text.replace(f'"${{WSGATE_BENCH_CERTS:-certs/out}}/{label}.key"', f'"{hsm.uri(certs, label)}"')
        (out / src.name).write_text(text)
    return out
