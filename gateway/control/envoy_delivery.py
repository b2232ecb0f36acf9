"""A new configuration for a running Envoy, delivered in an order that never names what Envoy lacks.

Envoy watches the xDS files of its directory (gateway/control/envoy_config.py) and applies each one on its own: a listener
whose routes name a cluster Envoy does not have yet is refused ("unknown cluster") and never retried, and a cluster
removed while a draining listener still sends it requests fails them. So a reload goes in steps, each written
atomically and waited for until Envoy reports it applied (the file's version_info as <subscription>.version_text in
the admin stats) and finished warming:

1. the workers' endpoints (eds.yaml), if they changed;
2. the clusters, old and new together (cds.yaml): new upstreams added, changed ones updated, none removed;
3. the listeners and their routes (lds.yaml); then every listener and filter chain the update replaced has drained;
4. the clusters alone (cds.yaml): the ones no route names any more go.

A step Envoy refuses (update_rejected) or does not take in time raises DeliveryError; what Envoy runs then is
the configuration of the last step it took, which never names a cluster it lacks."""

from __future__ import annotations

import os
import re
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

from gateway.control import envoy_config

# Envoy's --drain-time-s (gateway/control/supervisor.py) plus time to close: how long a replaced listener may drain.
DRAIN_TIMEOUT = 20.0
STEP_TIMEOUT = 10.0
CDS = "cluster_manager.cds"
LDS = "listener_manager.lds"
WARMING_CLUSTERS = "cluster_manager.warming_clusters"
WARMING_LISTENERS = "listener_manager.total_listeners_warming"
DRAINING = ("listener_manager.total_listeners_draining", "listener_manager.total_filter_chains_draining")


class DeliveryError(RuntimeError):
    pass


class _Admin:
    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/stats?filter="

    def stats(self, names: tuple[str, ...]) -> dict[str, str]:
        """The current values of these stats (counters, gauges, text readouts), as text."""
        pattern = "^(" + "|".join(re.escape(n) for n in names) + ")$"
        with urllib.request.urlopen(self.url + urllib.parse.quote(pattern), timeout=2) as r:
            lines = r.read().decode().splitlines()
        return {k: v.strip().strip('"') for k, _, v in (line.partition(": ") for line in lines)}

    def wait(self, what: str, names: tuple[str, ...], done: Callable[[dict[str, str]], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not done(stats := self.stats(names)):
            if time.monotonic() > deadline:
                raise DeliveryError(f"envoy did not take {what} within {timeout:.0f}s: {stats}")
            time.sleep(0.02)


def _write(directory: Path, name: str, text: str) -> None:
    tmp = directory / f".{name}.tmp"
    tmp.write_text(text)
    os.replace(tmp, directory / name)  # atomic: the directory watch never reads half a file


def _step(admin: _Admin, directory: Path, name: str, text: str, subscription: str, warming: str) -> None:
    """Write `name`; return once Envoy's `subscription` reports its version and nothing is `warming`."""
    rejected, applied = f"{subscription}.update_rejected", f"{subscription}.version_text"
    before = admin.stats((rejected,)).get(rejected, "0")
    _write(directory, name, text)
    version = envoy_config.version(text)

    def done(stats: dict[str, str]) -> bool:
        if stats.get(rejected, "0") != before:
            raise DeliveryError(f"envoy refused {name} version {version}; see its log")
        return stats.get(applied) == version and stats.get(warming) == "0"

    admin.wait(f"{name} version {version}", (rejected, applied, warming), done, STEP_TIMEOUT)


def check_listeners(directory: Path, admin_port: int) -> None:
    """Once a starting Envoy is ready: raise DeliveryError unless it took lds.yaml. It becomes ready, and runs on,
    even when it refused the file (a listener it could not bind: another process may listen on that port)."""
    rejected, applied = f"{LDS}.update_rejected", f"{LDS}.version_text"
    version = envoy_config.version((directory / "lds.yaml").read_text())

    def done(stats: dict[str, str]) -> bool:
        if stats.get(rejected, "0") != "0":
            raise DeliveryError(f"envoy refused its listeners (lds.yaml version {version}); see its log")
        return stats.get(applied) == version

    _Admin(admin_port).wait(f"lds.yaml version {version}", (rejected, applied), done, STEP_TIMEOUT)


def deliver(files: dict[str, str], directory: Path, admin_port: int) -> None:
    """Bring a running Envoy from the files in `directory` to `files` (envoy_config.render's), in the order above."""
    admin = _Admin(admin_port)
    current = {name: (directory / name).read_text() for name in files if (directory / name).exists()}
    # The bootstrap is read only at start; kept current for the next one.
    if files["envoy.yaml"] != current.get("envoy.yaml"):
        _write(directory, "envoy.yaml", files["envoy.yaml"])
    if "eds.yaml" in files and files["eds.yaml"] != current.get("eds.yaml"):
        _step(
            admin, directory, "eds.yaml", files["eds.yaml"], f"cluster.{envoy_config.FILTER_CLUSTER}", WARMING_CLUSTERS
        )
    clusters = files["cds.yaml"]
    union = envoy_config.cluster_union(current["cds.yaml"], clusters) if "cds.yaml" in current else clusters
    if union != current.get("cds.yaml"):
        _step(admin, directory, "cds.yaml", union, CDS, WARMING_CLUSTERS)
    if files["lds.yaml"] != current.get("lds.yaml"):
        _step(admin, directory, "lds.yaml", files["lds.yaml"], LDS, WARMING_LISTENERS)
    if clusters != union:
        drained = lambda stats: all(stats.get(d) == "0" for d in DRAINING)  # noqa: E731
        admin.wait("the replaced listeners' drain", DRAINING, drained, DRAIN_TIMEOUT)
        _step(admin, directory, "cds.yaml", clusters, CDS, WARMING_CLUSTERS)
