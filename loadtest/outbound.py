"""The outbound rows of the benchmark (`make bench`, loadtest/bench.py; docs/outbound.md): the load generator sends
plain SOAP to an outbound listener, the gateway secures each call for its partner and verifies the reply. The
partner is the same gateway's inbound route of the profile (loadtest/policies-outbound/outbound.yaml), so a row's
gateway CPU holds both sides: the report subtracts the inbound row of the same profile and size."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import IO, Any

from loadtest.messages import SIZE_LABELS, Profile

HERE = Path(__file__).parent
POLICIES = HERE / "policies-outbound"
# Row -> the policy route; the inbound row whose route is its partner.
PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile("outbound-hmac", "outbound-hmac"),
        Profile("outbound-hmac-encrypted", "outbound-hmac-encrypted"),
        Profile("outbound-rsa", "outbound-rsa"),
        Profile("outbound-sc", "outbound-sc"),
        Profile("outbound-sc-signed", "outbound-sc-signed"),
        Profile("outbound-sc-direct", "outbound-sc-direct"),
    )
}
# The inbound row whose route is the partner (outbound-sc-signed's, sc-signed, and outbound-sc-direct's, sc-direct,
# have no inbound row of their own).
PARTNER_ROW = {"outbound-hmac": "hmac", "outbound-hmac-encrypted": "hmac-encrypted", "outbound-rsa": "rsa",
               "outbound-sc": "secureconversation", "outbound-sc-signed": "secureconversation-signed",
               "outbound-sc-direct": "secureconversation-direct"}  # fmt: skip
# Issue 24: outbound SecureConversation at steady state costs no more than outbound hmac -- each held to the hmac
# row that protects its messages alike: outbound-sc signs and encrypts both ways, outbound-sc-signed only signs.
SC_TARGETS = (("outbound-sc", "outbound-hmac-encrypted", "like for like: both sign and encrypt"),
              ("outbound-sc-signed", "outbound-hmac", "like for like: both only sign"),
              ("outbound-sc-direct", "outbound-hmac", "both only sign, the context's key not derived"))  # fmt: skip


def policy_dir(policies: Path, out: Path) -> Path:
    """The bench's policies and the outbound routes together, in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    for src in [*policies.glob("*.yaml"), *POLICIES.glob("*.yaml")]:
        shutil.copy(src, out / src.name)
    return out


def report(points: list[Any], out: IO[str]) -> None:
    """Gateway CPU per outbound request beside the inbound row of the same profile (its partner's share)."""
    at = {(p.profile, p.size): p for p in points}
    rows = []
    for (profile, size), p in at.items():
        if profile not in PROFILES:
            continue
        partner = at.get((PARTNER_ROW[profile], size))
        own = f"{p.gateway_cpu_us - partner.gateway_cpu_us:,.0f}" if partner else "-"
        inbound = f"{partner.gateway_cpu_us:,.0f}" if partner else "not measured"
        rows.append(f"  {profile:23} {SIZE_LABELS[size]:9} {p.gateway_cpu_us:>10,.0f} {inbound:>14} {own:>14}")
    if not rows:
        return
    print("\nOutbound: gateway CPU per request, us -- both sides (the partner is the inbound route of the profile on "
          "this gateway), the inbound row, the outbound side (the difference)", file=out)  # fmt: skip
    print(f"  {'profile':23} {'size':9} {'both sides':>10} {'inbound row':>14} {'outbound side':>14}", file=out)
    for row in rows:
        print(row, file=out)
    for sc_row, hmac_row, how in SC_TARGETS:
        for size in SIZE_LABELS:
            sc, hm = at.get((sc_row, size)), at.get((hmac_row, size))
            if sc is None or hm is None:
                continue
            ratio = sc.gateway_cpu_us / hm.gateway_cpu_us
            print(f"  target (issue 24): {sc_row} <= {hmac_row}, {SIZE_LABELS[size]} ({how}): {sc.gateway_cpu_us:,.0f} "
                  f"vs {hm.gateway_cpu_us:,.0f} us both sides, {ratio:.2f}x: {'met' if ratio <= 1 else 'MISSED'}",
                  file=out)  # fmt: skip
