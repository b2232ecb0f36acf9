"""Quotas (route.quotas) -> Envoy's rate-limit filters and the configuration of the Envoy rate-limit service
(github.com/envoyproxy/ratelimit, built from gateway/tools/ratelimit), which counts in the shared Redis so every
gateway replica draws on the same limits (docs/quotas.md).

Two filter instances call the service. Stage 0 runs before ext_proc: client-address limits, so a flood is shaped
before any XML work. Stage 1 runs after it: the filter worker has verified the credential by then and set the
identity header (and the operation header), so only verified requests count against a caller's quota; a forged
message is refused by the worker and never reaches the count. Clients cannot send either header: x-wsgate-* and
every route's identity_header are stripped on arrival (envoy_config._early_header_mutation)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from gateway.policy import OPERATION_HEADER, PolicySet, Rate, Route

DOMAIN = "wsgate"
CLUSTER = "wsgate_ratelimit"
FILTER = "envoy.filters.http.ratelimit"
ADDRESS_STAGE, CALLER_STAGE = 0, 1
STAGE_NAMES = {ADDRESS_STAGE: "quota_address", CALLER_STAGE: "quota_caller"}  # the stats' bounded label
CONFIG_FILE = "config/wsgate.yaml"  # under the service's RUNTIME_ROOT
TIMEOUT_S = 1  # one Redis round trip; over it the request fails closed (503)
GO_MODULE = Path(__file__).resolve().parents[1] / "tools" / "ratelimit"
BINARY_ENV = "WSGATE_RATELIMIT_BIN"


def enabled(policies: PolicySet) -> bool:
    return any(r.quotas.enabled for r in policies.routes)


def version() -> str:
    """The pinned module version (gateway/tools/ratelimit/go.mod)."""
    found = re.search(r"^require github\.com/envoyproxy/ratelimit (\S+)$", (GO_MODULE / "go.mod").read_text(), re.M)
    assert found, "gateway/tools/ratelimit/go.mod names no ratelimit version"
    return found.group(1)


def image() -> str:
    """The official image of the pinned commit (Compose and Kubernetes): envoyproxy/ratelimit tags its images by the
    commit's first 8 hex digits."""
    commit = version().rsplit("-", 1)[1]
    return f"envoyproxy/ratelimit:{commit[:8]}"


def binary() -> Path:
    """Where `make ratelimit` builds the service (the Makefile uses the same path), or WSGATE_RATELIMIT_BIN."""
    if BINARY_ENV in os.environ:
        return Path(os.environ[BINARY_ENV])
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "wsgate" / f"ratelimit-{version()}" / "ratelimit"


def _entry(route: Route, quota: str, unit: str, stage: int, *actions: dict[str, Any]) -> dict[str, Any]:
    return {
        "stage": stage,
        "actions": [
            {"generic_key": {"descriptor_key": "route", "descriptor_value": route.name}},
            {"generic_key": {"descriptor_key": "quota", "descriptor_value": f"{quota}-{unit}"}},
            *actions,
        ],
    }


def route_rate_limits(route: Route) -> list[dict[str, Any]]:
    """The descriptors an Envoy route entry sends: (route, quota-unit[, the counted value...]) per limit."""
    q = route.quotas
    out = [_entry(route, "client_address", u, ADDRESS_STAGE, {"remote_address": {}})
           for u, _ in (q.client_address.units() if q.client_address else [])]  # fmt: skip
    if route.identity_header:
        caller = {"request_headers": {"header_name": route.identity_header, "descriptor_key": "caller"}}
        out += [_entry(route, "caller", u, CALLER_STAGE, caller) for u, _ in (q.caller.units() if q.caller else [])]
        operation = {"request_headers": {"header_name": OPERATION_HEADER, "descriptor_key": "operation"}}
        units = sorted({u for rate in q.operations.values() for u, _ in rate.units()}, reverse=True)
        out += [_entry(route, "operation", u, CALLER_STAGE, operation, caller) for u in units]
    out += [_entry(route, "backend", u, CALLER_STAGE) for u, _ in (q.backend.units() if q.backend else [])]
    return out


def _limit(unit: str, n: int) -> dict[str, Any]:
    return {"rate_limit": {"unit": unit, "requests_per_unit": n}}


def _per_value(quota: str, rate: Rate | None, key: str) -> list[dict[str, Any]]:
    """One bucket per distinct value of `key` (a descriptor without a value: the service counts each value)."""
    if rate is None:
        return []
    return [{"key": "quota", "value": f"{quota}-{u}", "descriptors": [{"key": key, **_limit(u, n)}]}
            for u, n in rate.units()]  # fmt: skip


def _route_descriptors(route: Route) -> list[dict[str, Any]]:
    q = route.quotas
    out = _per_value("client_address", q.client_address, "remote_address") + _per_value("caller", q.caller, "caller")
    for unit in ("second", "day"):
        ops = [{"key": "operation", "value": op, "descriptors": [{"key": "caller", **_limit(unit, n)}]}
               for op, rate in sorted(q.operations.items()) for u, n in rate.units() if u == unit]  # fmt: skip
        if ops:
            out.append({"key": "quota", "value": f"operation-{unit}", "descriptors": ops})
    if q.backend:
        out += [{"key": "quota", "value": f"backend-{u}", **_limit(u, n)} for u, n in q.backend.units()]
    return out


def service_config(policies: PolicySet) -> str:
    """The rate-limit service's configuration file (one domain, one descriptor tree per route with quotas)."""
    descriptors = [{"key": "route", "value": r.name, "descriptors": _route_descriptors(r)}
                   for r in policies.routes if r.quotas.enabled]  # fmt: skip
    return yaml.safe_dump({"domain": DOMAIN, "descriptors": descriptors}, sort_keys=False, width=200)


def http_filter(stage: int) -> dict[str, Any]:
    return {
        "name": f"{FILTER}.{STAGE_NAMES[stage]}",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit",
            "domain": DOMAIN,
            "stage": stage,
            "stat_prefix": STAGE_NAMES[stage],
            "timeout": f"{TIMEOUT_S}s",
            "failure_mode_deny": True,  # no answer from the service: refused (503), never unmetered
            "status_on_error": {"code": "ServiceUnavailable"},
            # x-ratelimit-limit/-remaining/-reset on answers: Retry-After on a 429 is taken from -reset.
            "enable_x_ratelimit_headers": "DRAFT_VERSION_03",
            "disable_x_envoy_ratelimited_header": True,  # x-envoy-*: Envoy's own, never shown to clients
            "rate_limit_service": {
                "grpc_service": {"envoy_grpc": {"cluster_name": CLUSTER}},
                "transport_api_version": "V3",
            },
        },
    }


def environment(grpc: str, runtime_root: Path, redis_url: str, health: str = "127.0.0.1:0") -> dict[str, str]:
    """The service's settings (it reads only its environment): gRPC on `grpc` (host:port), its configuration
    under `runtime_root`, counters in `redis_url` (redis://host:port[/db] or unix:///path), its HTTP listener
    (GET /healthcheck: the containers' health checks) on `health`."""
    host, port = grpc.rsplit(":", 1)
    http_host, http_port = health.rsplit(":", 1)
    url = urlsplit(redis_url)
    if url.scheme == "unix":
        redis = {"REDIS_SOCKET_TYPE": "unix", "REDIS_URL": url.path}
    else:
        redis = {"REDIS_SOCKET_TYPE": "tcp", "REDIS_URL": f"{url.hostname}:{url.port or 6379}"}
    if url.password:
        redis["REDIS_AUTH"] = url.password
    return {
        "GRPC_HOST": host.strip("[]"),
        "GRPC_PORT": port,
        # Its debug listener is not used: loopback, any free port.
        "HOST": http_host,
        "PORT": http_port,
        "DEBUG_HOST": "127.0.0.1",
        "DEBUG_PORT": "0",
        "USE_STATSD": "false",
        # Its own stats would go to its log, every counter at each flush (Envoy's ratelimit stats are the ones read).
        "DISABLE_STATS": "true",
        "LOG_LEVEL": "warn",
        "RUNTIME_ROOT": str(runtime_root),
        "RUNTIME_SUBDIRECTORY": "",
        "RUNTIME_WATCH_ROOT": "false",
        "RUNTIME_IGNOREDOTFILES": "true",
        "BACKEND_TYPE": "redis",
        "REDIS_TYPE": "SINGLE",
        **redis,
        "CACHE_KEY_PREFIX": "wsgate-quota:",
    }


def write(policies: PolicySet, runtime_root: Path) -> None:
    """The service's configuration, atomically: it reloads the file when the directory changes."""
    target = runtime_root / CONFIG_FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp"
    tmp.write_text(service_config(policies))
    os.replace(tmp, target)
