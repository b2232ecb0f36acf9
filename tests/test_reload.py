"""Policy reloads under traffic (issue 19 item 4): a route added with a new upstream is reachable as soon as the
reload returns, a removed route goes (its cluster after it), a changed upstream takes over; nothing in flight is
dropped. Real Envoy, workers and HTTP backends on loopback; traffic runs in threads during each reload.

Before the fix the cluster and listener files were written back to back and Envoy could read the listener first:
routes naming a cluster it lacked were refused ("unknown cluster") and never retried (gateway/control/envoy_delivery.py)."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import requests
import yaml

from filters.worker import Worker
from gateway.control import envoy_config
from gateway.control.supervisor import Gateway
from tests.harness import LoopbackHttp, content_type, envelope, running_gateway

DEMO = "urn:wsgate:demo"
ECHO = envelope(f'<d:echo xmlns:d="{DEMO}"><d:text>hello</d:text></d:echo>')
HEADERS = {"content-type": content_type("1.1")}


def route(name: str, prefix: str, address: str = "BACKEND") -> dict[str, Any]:
    return {"name": name, "match": {"path_prefix": prefix}, "upstream": {"address": address}, "profile": "xml"}


def backend() -> LoopbackHttp:
    """A second upstream: answers every POST with a SOAP envelope, records the paths."""
    return LoopbackHttp(lambda body: ("text/xml; charset=utf-8", ECHO))


def address(http: LoopbackHttp) -> str:
    return http.url.removeprefix("http://")


def post(gw: Gateway, path: str, session: requests.Session | None = None) -> int:
    s = session or requests
    return s.post(f"http://127.0.0.1:{gw.opts.http_port}{path}", data=ECHO, headers=HEADERS, timeout=10).status_code


@contextmanager
def traffic(gw: Gateway, paths: list[str]) -> Iterator[dict[str, list[int]]]:
    """One keep-alive client per path, posting in a loop until the block ends: every status, per path."""
    statuses: dict[str, list[int]] = {p: [] for p in paths}
    stop = threading.Event()

    def load(path: str) -> None:
        with requests.Session() as s:
            while not stop.is_set():
                statuses[path].append(post(gw, path, s))

    threads = [threading.Thread(target=load, args=(p,)) for p in paths]
    for t in threads:
        t.start()
    time.sleep(0.3)  # connections open and in use when the reload comes
    try:
        yield statuses
    finally:
        time.sleep(0.3)
        stop.set()
        for t in threads:
            t.join()


def rewrite(gw: Gateway, routes: list[dict[str, Any]]) -> None:
    """New policy files; the running gateway's own address for BACKEND. Returns once the new policies are live."""
    backend_addr = gw.backend_addr  # type: ignore[attr-defined]
    text = yaml.safe_dump({"routes": routes}, sort_keys=False).replace("BACKEND", backend_addr)
    (gw.opts.policies / "routes.yaml").write_text(text)
    assert gw.reload_if_changed() is True


def envoy_clusters(gw: Gateway) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{gw.opts.admin_port}/clusters", timeout=5) as r:
        return r.read().decode()


def test_route_added_with_a_new_upstream_is_reachable_when_the_reload_returns(tmp_path: Path, pki: Path) -> None:
    new = backend()
    try:
        with running_gateway(tmp_path, [route("stable", "/s/")], pki) as gw:
            assert post(gw, "/n/x") == 404
            with traffic(gw, ["/s/x"]) as statuses:
                rewrite(gw, [route("stable", "/s/"), route("new", "/n/", address(new))])
                # No waiting, no retry: the reload returned, so Envoy has the cluster, the route and the workers.
                assert post(gw, "/n/x") == 200
                assert new.paths == ["/n/x"]
            assert len(statuses["/s/x"]) > 5 and set(statuses["/s/x"]) == {200}
            assert "upstream_new::" in envoy_clusters(gw)
    finally:
        new.close()


def test_removed_route_goes_with_its_cluster_and_nothing_else_drops(tmp_path: Path, pki: Path) -> None:
    old = backend()
    try:
        routes = [route("stable", "/s/"), route("old", "/o/", address(old))]
        with running_gateway(tmp_path, routes, pki) as gw:
            assert post(gw, "/o/x") == 200
            with traffic(gw, ["/s/x", "/o/x"]) as statuses:
                rewrite(gw, [route("stable", "/s/")])
                assert post(gw, "/o/x") == 404
            assert len(statuses["/s/x"]) > 5 and set(statuses["/s/x"]) == {200}
            # The removed route answers as it was until Envoy stops routing it, then 404: never an error.
            removed = statuses["/o/x"]
            assert set(removed) <= {200, 404} and removed[-1] == 404, removed
            assert "upstream_old::" not in envoy_clusters(gw)
    finally:
        old.close()


def test_changed_upstream_takes_over_without_dropping_a_request(tmp_path: Path, pki: Path) -> None:
    first, second = backend(), backend()
    try:
        with running_gateway(tmp_path, [route("moving", "/m/", address(first))], pki) as gw:
            with traffic(gw, ["/m/x"]) as statuses:
                rewrite(gw, [route("moving", "/m/", address(second))])
                assert post(gw, "/m/after") == 200  # the next request goes to the new upstream
                assert "/m/after" in second.paths and "/m/after" not in first.paths
            assert len(statuses["/m/x"]) > 5 and set(statuses["/m/x"]) == {200}
            assert first.paths and address(second) in envoy_clusters(gw)
            assert address(first) not in envoy_clusters(gw)
    finally:
        first.close()
        second.close()


def test_a_route_envoy_may_still_send_stays_in_the_workers_until_the_next_reload(tmp_path: Path) -> None:
    """Workers reload before Envoy: a dropped route is kept one reload longer, so Envoy's draining listeners never
    meet a worker that does not know it (a Server fault instead of the answer)."""
    policies = tmp_path / "policies"
    policies.mkdir()
    write = lambda routes: (policies / "routes.yaml").write_text(yaml.safe_dump({"routes": routes}))  # noqa: E731
    write([route("stable", "/s/", "127.0.0.1:1"), route("old", "/o/", "127.0.0.1:1")])
    worker = Worker(policies, 64 * 1024 * 1024, tmp_path / "ready")
    write([route("stable", "/s/", "127.0.0.1:1")])
    table = worker.reload()
    assert table is not None and set(worker.engine.pipelines) == {"stable", "old"}
    assert worker.engine.pipeline("old").route.name == "old"
    write([route("stable", "/s/", "127.0.0.1:2")])
    table = worker.reload()
    assert table is not None and set(worker.engine.pipelines) == {"stable"}
    worker.ready()
    assert (tmp_path / "ready").read_text().split()[1] == "2"  # what the supervisor waits for


def test_cluster_union_adds_and_updates_but_removes_nothing() -> None:
    def cds(*clusters: tuple[str, str]) -> str:
        return envoy_config._resources([{"name": n, "type": t} for n, t in clusters])

    old = cds(("a", "STATIC"), ("b", "STATIC"))
    new = cds(("b", "STRICT_DNS"), ("c", "STATIC"))
    union = yaml.safe_load(envoy_config.cluster_union(old, new))
    assert union["resources"] == [{"name": "b", "type": "STRICT_DNS"}, {"name": "c", "type": "STATIC"},
                                  {"name": "a", "type": "STATIC"}]  # fmt: skip
    assert envoy_config.version(envoy_config.cluster_union(old, new)) not in (envoy_config.version(old),
                                                                               envoy_config.version(new))  # fmt: skip
    assert envoy_config.cluster_union(new, new) == new
