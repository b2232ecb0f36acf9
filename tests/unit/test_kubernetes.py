"""`wsgate render --target kubernetes`: the manifests an operator applies, checked as the cluster would check them.

No cluster runs here: the rendered objects are validated against the Kubernetes API's schemas (kubernetes-validate,
bundled, offline), built by kustomize (`kubectl kustomize`, as `kubectl apply -k` builds them), and read for what a
cluster would only show at run time: routes identical to the local and Compose ones, every reference resolved,
probes on real ports, the NetworkPolicies evaluated pair by pair, pods that drain before they stop. What the pods
start is started here: the filter worker's command line from its Deployment, on only the files its Secret and
ConfigMap hold, and Envoy's validation of its ConfigMap with only its Secret's files."""

from __future__ import annotations

import base64
import ipaddress
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import requests
import yaml

from gateway.control import envoy_config, kubernetes
from gateway.control.cli import build_parser
from gateway.control.ports import free_ports
from gateway.policy import GRACE_SECONDS, PolicyError, load_dir
from tests.support.harness import write_policies
from tests.unit.test_envoy_config import TOPO, assert_envoy_accepts, routes_of

REPO = Path(__file__).resolve().parents[2]
# The oldest Kubernetes these manifests claim (HPA autoscaling/v2, PDB policy/v1, immutable ConfigMaps, the
# kubernetes.io/metadata.name namespace label) and the newest the validator knows.
API_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
Objects = list[dict[str, Any]]


def render(out: Path, *flags: str, policies: Path = REPO / "policies") -> dict[str, Objects]:
    """`wsgate render --target kubernetes --out OUT`, as an operator runs it: manifest file -> its objects."""
    args = build_parser().parse_args(["render", "--target", "kubernetes", "--policies", str(policies),
                                      "--out", str(out), *flags])  # fmt: skip
    with pytest.MonkeyPatch.context() as env:  # the command sets BACKEND_ADDR for the demo backend: not for others
        env.delenv("BACKEND_ADDR", raising=False)
        assert args.func(args) == 0
    kustomization = yaml.safe_load((out / "kustomization.yaml").read_text())
    return {name: list(yaml.safe_load_all((out / name).read_text())) for name in kustomization["resources"]}


def with_keys(out: Path, pki: Path) -> None:
    """What docs/operations.md tells the operator: copy the files keys/.gitignore lists from certs/out into keys/."""
    wanted = (out / "keys" / ".gitignore").read_text().splitlines()[0].split(": ", 1)[1].split()
    for name in wanted:
        shutil.copy(pki / name, out / "keys" / name)


def kustomize(out: Path) -> subprocess.CompletedProcess[str]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is needed (kubectl kustomize builds what kubectl apply -k applies): install kubectl")
    return subprocess.run([kubectl, "kustomize", str(out)], capture_output=True, text=True)


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("k8s")
    render(path)
    return path


@pytest.fixture(scope="module")
def objects(out: Path) -> Objects:
    kustomization = yaml.safe_load((out / "kustomization.yaml").read_text())
    return [o for name in kustomization["resources"] for o in yaml.safe_load_all((out / name).read_text())]


@pytest.fixture(scope="module")
def built(out: Path, pki: Path) -> Objects:
    """`kubectl kustomize` of the render with the keys in place: exactly what `kubectl apply -k` sends."""
    with_keys(out, pki)
    run = kustomize(out)
    assert run.returncode == 0, run.stderr
    return list(yaml.safe_load_all(run.stdout))


def one(objs: Objects, kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"]


def workloads(objs: Objects) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] in ("Deployment", "StatefulSet")]


def envoy_files(objs: Objects) -> dict[str, str]:
    volumes = pod_spec(one(objs, "Deployment", kubernetes.ENVOY))["volumes"]
    name = next(v["configMap"]["name"] for v in volumes if "configMap" in v)
    return one(objs, "ConfigMap", name)["data"]


def validate(obj: dict[str, Any]) -> None:
    for version in API_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            first = str(exc).splitlines()[0]
            pytest.fail(f"{obj['kind']} {obj['metadata']['name']} invalid for Kubernetes {version}: {first}")


def test_every_rendered_manifest_is_valid_for_the_kubernetes_api(objects: Objects) -> None:
    kinds = {o["kind"] for o in objects}
    assert kinds == {"Namespace", "ConfigMap", "Deployment", "StatefulSet", "Service", "HorizontalPodAutoscaler",
                     "PodDisruptionBudget", "NetworkPolicy"}  # fmt: skip
    for obj in objects:
        validate(obj)


def test_what_kubectl_apply_k_sends_is_valid_and_every_reference_resolves(built: Objects) -> None:
    """Secrets and ConfigMaps by the names kustomize gave them (a content hash): a reference kustomize did not
    rewrite would name a Secret that does not exist, and the pod would never start."""
    for obj in built:
        validate(obj)
        assert obj["kind"] == "Namespace" or obj["metadata"]["namespace"] == kubernetes.NAMESPACE
    present = {(o["kind"], o["metadata"]["name"]) for o in built}
    for workload in workloads(built):
        spec = pod_spec(workload)
        refs = [("Secret", v["secret"]["secretName"]) for v in spec["volumes"] if "secret" in v]
        refs += [("ConfigMap", v["configMap"]["name"]) for v in spec["volumes"] if "configMap" in v]
        for c in spec["containers"]:
            refs += [("Secret", e["valueFrom"]["secretKeyRef"]["name"]) for e in c.get("env", []) if "valueFrom" in e]
            mounted = {m["name"] for m in c.get("volumeMounts", [])}
            assert mounted <= {v["name"] for v in spec["volumes"]}
        for ref in refs:
            assert ref in present, f"{workload['metadata']['name']} needs {ref}, which kubectl apply -k does not create"
    generated = {o["metadata"]["name"] for o in built if o["kind"] == "Secret"}
    assert all(n.rsplit("-", 1)[0] in {f"{kubernetes.ENVOY}-tls", f"{kubernetes.FILTER}-keys",
                                       f"{kubernetes.REDIS}-url"} for n in generated)  # fmt: skip
    assert len(generated) == 3


def test_no_key_material_is_rendered(out: Path, pki: Path, tmp_path: Path) -> None:
    """Keys reach the cluster only from keys/ through the secretGenerator, never from the rendered files: rendering
    reads no key, and without the operator's copies kustomize refuses to build."""
    secrets = [p.read_bytes() for p in pki.iterdir() if p.suffix in (".key", ".yaml")]
    bare = tmp_path / "bare"
    render(bare)
    assert kustomize(bare).returncode != 0
    for path in bare.rglob("*"):
        if path.is_file():
            text = path.read_bytes()
            assert b"PRIVATE KEY" not in text and b"-----BEGIN" not in text, path
            assert not any(s in text for s in secrets), path
    assert (bare / "keys" / ".gitignore").read_text().splitlines()[1:] == ["*", "!.gitignore"]


def test_kubernetes_routes_are_the_local_and_compose_routes(objects: Objects) -> None:
    os.environ.pop("BACKEND_ADDR", None)
    ps = load_dir(REPO / "policies")
    k8s = envoy_files(objects)
    assert routes_of(k8s) == routes_of(envoy_config.render(ps, TOPO))
    assert routes_of(k8s) == routes_of(envoy_config.render(ps, envoy_config.compose_topology()))
    clusters = {c["name"]: c for c in yaml.safe_load(k8s["cds.yaml"])["resources"]}
    filt = clusters[envoy_config.FILTER_CLUSTER]
    assert filt["type"] == "STRICT_DNS"  # every ready filter pod behind the headless Service's name
    (endpoint,) = [e["endpoint"]["address"]["socket_address"] for e in filt["load_assignment"]["endpoints"][0]["lb_endpoints"]]  # fmt: skip
    assert endpoint == {"address": kubernetes.FILTER, "port_value": kubernetes.FILTER_PORT}
    assert one(objects, "Service", kubernetes.FILTER)["spec"]["clusterIP"] == "None"
    # The demo backend's Service is where the policies' ${BACKEND_ADDR} points, for Envoy and for the filters.
    for name, c in clusters.items():
        if name.startswith("upstream_"):
            addr = c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
            assert addr == {"address": kubernetes.BACKEND, "port_value": kubernetes.BACKEND_PORT}
    env = pod_spec(one(objects, "Deployment", kubernetes.FILTER))["containers"][0]["env"]
    assert {"name": "BACKEND_ADDR", "value": f"{kubernetes.BACKEND}:{kubernetes.BACKEND_PORT}"} in env


def generated_files(out: Path, secret: str) -> list[str]:
    """The files a secretGenerator of the rendered kustomization reads: the Secret's keys."""
    kustomization = yaml.safe_load((out / "kustomization.yaml").read_text())
    (gen,) = [g for g in kustomization["secretGenerator"] if g["name"] == secret]
    return [Path(f).name for f in gen["files"]]


def only(pki: Path, names: list[str], directory: Path) -> Path:
    directory.mkdir(parents=True)
    for name in names:
        shutil.copy(pki / name, directory / name)
    return directory


def test_envoy_accepts_its_config_map_with_only_its_secrets_files(
    out: Path, objects: Objects, pki: Path, tmp_path: Path
) -> None:
    """The Envoy Secret holds every file Envoy's config reads: a missing one, and Envoy refuses its listener."""
    certs = only(pki, generated_files(out, f"{kubernetes.ENVOY}-tls"), tmp_path / "certs")
    files = {n: t.replace(" /certs/", f" {certs}/") for n, t in envoy_files(objects).items()}
    assert_envoy_accepts(files, tmp_path)


@dataclass
class Pod:
    """One pod template's command, run here on loopback with what its volumes would hold."""

    spec: dict[str, Any]
    container: dict[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        (self.container,) = self.spec["containers"]

    def port(self, name: str) -> int:
        return next(p["containerPort"] for p in self.container["ports"] if p["name"] == name)

    def mount(self, volume: str) -> str:
        return next(m["mountPath"] for m in self.container["volumeMounts"] if m["name"] == volume)


@pytest.fixture
def filter_pod(objects: Objects) -> Pod:
    return Pod(pod_spec(one(objects, "Deployment", kubernetes.FILTER)))


@contextmanager
def start_filter(out: Path, objects: Objects, pki: Path, redis_url: str, tmp_path: Path,
                 leave_out: str | None = None) -> Iterator[tuple[subprocess.Popen[bytes], int]]:  # fmt: skip
    """The filter Deployment's own command line, in a copy of the pod's /app: the policies ConfigMap's files, the
    keys Secret's files, the schema documents at their subPath mounts (but `leave_out`) and nothing else, the
    pod's environment (Redis: a real one on loopback). Yields once the worker is ready."""
    app = tmp_path / "app"
    pod = Pod(pod_spec(one(objects, "Deployment", kubernetes.FILTER)))
    volumes = {v["name"]: v for v in pod.spec["volumes"]}
    policies = one(objects, "ConfigMap", volumes["policies"]["configMap"]["name"])["data"]
    policies_dir = app / pod.mount("policies").removeprefix("/app/")
    policies_dir.mkdir(parents=True)
    for name, text in policies.items():
        (policies_dir / name).write_text(text)
    only(pki, generated_files(out, f"{kubernetes.FILTER}-keys"), app / pod.mount("keys").removeprefix("/app/"))
    if "schemas" in volumes:
        documents = one(objects, "ConfigMap", volumes["schemas"]["configMap"]["name"])["binaryData"]
        for m in (m for m in pod.container["volumeMounts"] if m["name"] == "schemas" and m["subPath"] != leave_out):
            target = app / m["mountPath"].removeprefix("/app/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(base64.b64decode(documents[m["subPath"]]))
    port, metrics = free_ports(2)
    argv = [str(Path(sys.executable).with_name(a)) if a == "wsgate" else a for a in pod.container["command"]]
    argv = [a.replace(pod.mount("policies"), str(policies_dir)) for a in argv]
    argv[argv.index("--listen") + 1] = f"127.0.0.1:{port}"
    argv[argv.index("--metrics-port") + 1] = str(metrics)
    ready = tmp_path / "ready"
    env = {**os.environ, **{e["name"]: e["value"] for e in pod.container["env"] if "value" in e}}
    env[kubernetes.REDIS_URL_ENV] = redis_url
    log = tmp_path / "filter.log"
    proc = subprocess.Popen([*argv, "--ready-file", str(ready)], cwd=app, env=env, stdout=log.open("wb"),
                            stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise FilterDidNotStart(log.read_text()[-3000:])
            time.sleep(0.05)
        yield proc, metrics
    finally:
        proc.terminate()
        proc.wait(10)


class FilterDidNotStart(Exception):
    pass


@pytest.fixture
def started_filter(
    out: Path, objects: Objects, pki: Path, redis_server: str, tmp_path: Path
) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    with start_filter(out, objects, pki, redis_server, tmp_path) as started:
        yield started


@pytest.mark.slow  # seconds: kept out of make test-fast
def test_filter_pod_starts_on_only_its_config_map_and_secret(
    started_filter: tuple[subprocess.Popen[bytes], int],
) -> None:
    """Every key file the demo policies name is in the filter Secret, under the path the policies name it by."""
    proc, metrics = started_filter
    assert proc.poll() is None
    assert requests.get(f"http://127.0.0.1:{metrics}/metrics", timeout=5).status_code == 200  # the liveness probe


@pytest.mark.slow  # seconds: kept out of make test-fast
def test_a_routes_wsdl_and_every_document_it_imports_reach_the_filter_pods(
    pki: Path, redis_server: str, tmp_path: Path
) -> None:
    """A published and validated route: its WSDL, the WSDL it imports and that one's XSD are shipped in a
    ConfigMap and mounted where the policy names them; the filter starts on them, and not without one of them."""
    policies = tmp_path / "policies"
    shutil.copytree(REPO / "policies", policies)
    echo = {"name": "echo", "match": {"path_prefix": "/echo/service"}, "upstream": {"address": "192.0.2.10:8081"},
            "profile": "xml", "wsdl": {"file": "tests/wsdl/publish/echo.wsdl", "publish": True},
            "schema_validation": {"requests": True, "responses": True}}  # fmt: skip
    (policies / "echo.yaml").write_text(yaml.safe_dump({"routes": [echo]}))
    out = tmp_path / "out"
    parts = render(out, policies=policies)
    objs = [o for objs in parts.values() for o in objs]
    for obj in objs:
        validate(obj)
    pod = Pod(pod_spec(one(objs, "Deployment", kubernetes.FILTER)))
    mounts = {m["mountPath"]: m["subPath"] for m in pod.container["volumeMounts"] if m["name"] == "schemas"}
    assert sorted(mounts) == ["/app/tests/wsdl/publish/echo-interface.wsdl", "/app/tests/wsdl/publish/echo.wsdl",
                              "/app/tests/wsdl/publish/types/echo-types.xsd"]  # fmt: skip
    with start_filter(out, objs, pki, redis_server, tmp_path / "whole") as (proc, _):
        assert proc.poll() is None
    xsd = mounts["/app/tests/wsdl/publish/types/echo-types.xsd"]
    with (
        pytest.raises(FilterDidNotStart, match=r"echo-types\.xsd"),
        start_filter(out, objs, pki, redis_server, tmp_path / "part", leave_out=xsd),
    ):
        pass


def test_probes_and_service_ports_name_real_container_ports(objects: Objects) -> None:
    for workload in workloads(objects):
        pod = Pod(pod_spec(workload))
        names = {p["name"] for p in pod.container["ports"]}
        for probe in ("readinessProbe", "livenessProbe"):
            handler = pod.container[probe]
            port = (handler.get("httpGet") or handler.get("tcpSocket") or {}).get("port")
            assert (port is None and "exec" in handler) or port in names, (workload["metadata"]["name"], probe)
    for svc in (o for o in objects if o["kind"] == "Service"):
        (target,) = [
            w for w in workloads(objects) if w["spec"]["template"]["metadata"]["labels"] == svc["spec"]["selector"]
        ]
        ports = {p["name"]: p["containerPort"] for p in Pod(pod_spec(target)).container["ports"]}
        for p in svc["spec"]["ports"]:
            assert ports[p["targetPort"]] == p["port"], svc["metadata"]["name"]
    # The ports the processes listen on are the ones declared.
    envoy = Pod(pod_spec(one(objects, "Deployment", kubernetes.ENVOY)))
    listeners = yaml.safe_load(envoy_files(objects)["lds.yaml"])["resources"]
    assert {ls["address"]["socket_address"]["port_value"] for ls in listeners} == {
        envoy.port("http"),
        envoy.port("https"),
    }
    admin = yaml.safe_load(envoy_files(objects)["envoy.yaml"])["admin"]["address"]["socket_address"]["port_value"]
    assert admin == envoy.port("admin")
    filt = Pod(pod_spec(one(objects, "Deployment", kubernetes.FILTER)))
    command = filt.container["command"]
    assert command[command.index("--listen") + 1] == f"0.0.0.0:{filt.port('grpc')}"
    assert int(command[command.index("--metrics-port") + 1]) == filt.port("metrics")
    backend = Pod(pod_spec(one(objects, "Deployment", kubernetes.BACKEND)))
    assert backend.container["command"][-1] == f"0.0.0.0:{backend.port('http')}"


def test_pods_run_unprivileged_with_bounded_resources(objects: Objects) -> None:
    for workload in workloads(objects):
        spec = pod_spec(workload)
        name = workload["metadata"]["name"]
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] > 0, name
        assert spec["automountServiceAccountToken"] is False, name
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True, name
            assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"], name
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]) and "memory" in c["resources"]["limits"], name
            assert c.get("readinessProbe") and c.get("livenessProbe"), name
        for v in spec["volumes"]:
            assert set(v) & {"configMap", "secret", "emptyDir"}, f"{name}: volume {v['name']} is not pod-local"
    assert (
        one(objects, "Deployment", kubernetes.ENVOY)["spec"]["template"]["spec"]["containers"][0]["image"]
        == kubernetes.ENVOY_IMAGE
    )
    for component in (kubernetes.ENVOY, kubernetes.FILTER):
        hpa = one(objects, "HorizontalPodAutoscaler", component)["spec"]
        assert hpa["minReplicas"] >= 2 and hpa["metrics"][0]["resource"]["name"] == "cpu"
        assert "replicas" not in one(objects, "Deployment", component)["spec"]  # the autoscaler owns the count
        assert one(objects, "PodDisruptionBudget", component)["spec"]["maxUnavailable"] == 1


@dataclass(frozen=True)
class Peer:
    """A pod (namespace and labels) or an address outside the cluster, and the ports it listens on."""

    name: str
    namespace: str | None
    labels: dict[str, str]
    ports: tuple[tuple[str, int], ...]
    ip: str = "10.1.2.3"


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels", "matchExpressions"}, selector
    for e in selector.get("matchExpressions", []):
        assert e["operator"] == "In", e
        if labels.get(e["key"]) not in e["values"]:
            return False
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def peer_matches(rule_peer: dict[str, Any], policy_ns: str, peer: Peer) -> bool:
    if "ipBlock" in rule_peer:
        return peer.namespace is None and ipaddress.ip_address(peer.ip) in ipaddress.ip_network(
            rule_peer["ipBlock"]["cidr"]
        )
    if peer.namespace is None:
        return False
    if "namespaceSelector" in rule_peer:
        ns_ok = selects(rule_peer["namespaceSelector"], {"kubernetes.io/metadata.name": peer.namespace})
    else:
        ns_ok = peer.namespace == policy_ns
    return ns_ok and selects(rule_peer.get("podSelector", {}), peer.labels)


def rule_allows(rule: dict[str, Any], side: str, policy_ns: str, peer: Peer, port: tuple[str, int]) -> bool:
    peers = rule.get(side)
    if peers is not None and not any(peer_matches(p, policy_ns, peer) for p in peers):
        return False
    ports = rule.get("ports")
    return ports is None or any((p.get("protocol", "TCP"), p["port"]) == port for p in ports)


def direction_allows(policies: Objects, pod: Peer, other: Peer, port: tuple[str, int], kind: str) -> bool:
    """Kubernetes' semantics: a pod no policy of this kind selects is open; else some rule must allow."""
    side = "from" if kind == "Ingress" else "to"
    selecting = [p for p in policies if pod.namespace == kubernetes.NAMESPACE
                 and kind in p["spec"]["policyTypes"] and selects(p["spec"]["podSelector"], pod.labels)]  # fmt: skip
    if not selecting:
        return True
    return any(rule_allows(r, side, kubernetes.NAMESPACE, other, port)
               for p in selecting for r in p["spec"].get(kind.lower(), []))  # fmt: skip


def flows(objects: Objects, outsiders: list[Peer]) -> set[tuple[str, str, str, int]]:
    """Every (source, destination, protocol, port) the NetworkPolicies let through, over every listening port."""
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    pods = [Peer(w["metadata"]["name"], kubernetes.NAMESPACE, w["spec"]["template"]["metadata"]["labels"],
                 tuple(("TCP", p["containerPort"]) for c in pod_spec(w)["containers"] for p in c["ports"]))
            for w in workloads(objects)]  # fmt: skip
    intruder = Peer("intruder", kubernetes.NAMESPACE, {"app": "intruder"}, (("TCP", 8080),))
    everyone = [*pods, intruder, *outsiders]
    allowed = set()
    for src in everyone:
        for dst in everyone:
            if src is dst or (src.namespace != kubernetes.NAMESPACE and dst.namespace != kubernetes.NAMESPACE):
                continue
            for port in dst.ports:
                if direction_allows(policies, src, dst, port, "Egress") and direction_allows(
                    policies, dst, src, port, "Ingress"
                ):
                    allowed.add((src.name, dst.name, *port))
    return allowed


DNS = Peer("kube-dns", "kube-system", {"k8s-app": "kube-dns"}, (("UDP", 53), ("TCP", 53)))
OTHER_POD = Peer("other-namespace-pod", "shop", {"app": "shop"}, (("TCP", 8080),))
INTERNET = Peer("internet", None, {}, (("TCP", 443), ("TCP", 8081), ("TCP", 6379)), ip="203.0.113.7")
E, F, R, B = kubernetes.ENVOY, kubernetes.FILTER, kubernetes.REDIS, kubernetes.BACKEND


def clients_to_envoy(*clients: str) -> set[tuple[str, str, str, int]]:
    return {(client, E, "TCP", port) for client in clients for port in (8080, 8443)}


def dns_flows(*pods: str) -> set[tuple[str, str, str, int]]:
    return {(p, "kube-dns", proto, 53) for p in pods for proto in ("UDP", "TCP")}


def test_network_policies_allow_exactly_the_gateways_flows(objects: Objects) -> None:
    """Only Envoy reaches the filters, only the filters reach Redis, the backend is reachable from Envoy only,
    clients reach Envoy's listeners and nothing else (not its admin, not a filter's metrics); the namespace's
    other pods reach nothing."""
    expected = {
        *clients_to_envoy("internet", "other-namespace-pod", "kube-dns"),
        (E, F, "TCP", kubernetes.FILTER_PORT),
        (E, B, "TCP", kubernetes.BACKEND_PORT),
        (F, R, "TCP", kubernetes.REDIS_PORT),
        *dns_flows(E, F),
    }
    assert flows(objects, [DNS, OTHER_POD, INTERNET]) == expected


def test_network_policies_with_an_external_redis_and_backend(tmp_path: Path) -> None:
    """Without the demo parts: Envoy reaches the backend the policies name (an address: only it), the filters
    reach Redis's port outside, still nothing else."""
    policies = write_policies(tmp_path / "policies", [
        {"name": "hmac", "match": {"path_prefix": "/"}, "upstream": {"address": "192.0.2.10:8443"}, "profile": "hmac"}])  # fmt: skip
    objs = [o for f in render(tmp_path / "out", "--no-demo-backend", "--external-redis", policies=policies).values()
            for o in f]  # fmt: skip
    assert not [o for o in objs if o["metadata"]["name"] in (R, B)]
    backend = Peer("backend", None, {}, (("TCP", 8443), ("TCP", 8081)), ip="192.0.2.10")
    expected = {
        *clients_to_envoy("internet", "other-namespace-pod", "kube-dns", "backend"),
        (E, F, "TCP", kubernetes.FILTER_PORT),
        (E, "backend", "TCP", 8443),
        (F, "internet", "TCP", kubernetes.REDIS_PORT),
        (F, "backend", "TCP", kubernetes.REDIS_PORT),  # an external Redis is an address we do not know
        *dns_flows(E, F),
    }
    internet = Peer("internet", None, {}, (("TCP", 8443), ("TCP", 6379)), ip="203.0.113.7")
    assert flows(objs, [DNS, OTHER_POD, internet, replace_ports(backend, 6379)]) == expected
    kustomization = yaml.safe_load((tmp_path / "out" / "kustomization.yaml").read_text())
    (url,) = [g for g in kustomization["secretGenerator"] if g["name"] == f"{R}-url"]
    assert url["files"] == ["url=keys/redis-url"]  # the URL (and its password) never in the render


def replace_ports(peer: Peer, *extra: int) -> Peer:
    return Peer(peer.name, peer.namespace, peer.labels, (*peer.ports, *(("TCP", p) for p in extra)), peer.ip)


def test_memory_stores_are_refused_when_replicas_do_not_share_them(tmp_path: Path) -> None:
    """A replay sent to another filter pod than the original would pass a per-pod replay store; a context issued
    by one pod would be unknown to the others."""
    base = {"match": {"path_prefix": "/"}, "upstream": {"address": "192.0.2.10:8443"}}
    cases = {
        "replay.store": {"name": "r", "profile": "rsa", "replay": {"store": "memory"}},
        "secureconversation.store": {"name": "s", "profile": "secureconversation",
                                     "secureconversation": {"store": "memory"}},
    }  # fmt: skip
    for field_name, route in cases.items():
        ps = load_dir(write_policies(tmp_path / field_name, [{**base, **route}]))
        with pytest.raises(PolicyError, match=field_name):
            kubernetes.render(ps, tmp_path / field_name, kubernetes.Options())


@pytest.mark.parametrize(
    ("route", "refusal"),
    [
        ({"profile": "rsa", "rsa": {"key": "/etc/keys/sign.key"}}, "must be directly in certs/out/"),
        ({"profile": "hmac", "hmac": {"keys_file": "certs/out/site/hmac.yaml"}}, "must be directly in certs/out/"),
        ({"profile": "xml", "upstream": {"address": "192.0.2.10:8443", "tls": True, "ca": "certs/out/b.pem"}},
         "upstream.ca"),
    ],
)  # fmt: skip
def test_files_a_pod_would_not_have_are_refused(route: dict[str, Any], refusal: str, tmp_path: Path) -> None:
    """A key file outside the Secret's mount, or a file no Secret carries: refused at render, never a pod that
    cannot load its policies (or an Envoy that cannot load its cluster)."""
    base = {"name": "r", "match": {"path_prefix": "/"}, "upstream": {"address": "192.0.2.10:8443"}}
    ps = load_dir(write_policies(tmp_path, [{**base, **route}]))
    with pytest.raises(PolicyError, match=refusal):
        kubernetes.render(ps, tmp_path, kubernetes.Options())


def rendered_names(out: Path, component: str) -> dict[str, str]:
    objs = [o for f in yaml.safe_load((out / "kustomization.yaml").read_text())["resources"]
            for o in yaml.safe_load_all((out / f).read_text())]  # fmt: skip
    return {
        o["kind"]: o["metadata"]["name"]
        for o in objs
        if o["metadata"]["labels"].get(kubernetes.COMPONENT) == component and o["kind"] == "ConfigMap"
    }


@pytest.mark.slow  # seconds: kept out of make test-fast
def test_a_policy_change_rolls_the_filters_and_envoy_and_no_change_rolls_nothing(tmp_path: Path) -> None:
    """Content-addressed ConfigMaps: the pod templates change exactly when what the pods read changes."""
    policies = tmp_path / "policies"
    shutil.copytree(REPO / "policies", policies)
    render(tmp_path / "a", policies=policies)
    render(tmp_path / "b", policies=policies)
    text = (policies / "demo.yaml").read_text()
    (policies / "demo.yaml").write_text(text.replace("clock_skew_s: 300", "clock_skew_s: 120"))
    render(tmp_path / "c", policies=policies)  # the filters' policy only: Envoy's config is the same
    (policies / "demo.yaml").write_text(text.replace("path_prefix: /plain/", "path_prefix: /plain2/"))
    render(tmp_path / "d", policies=policies)
    a, b, c, d = (rendered_names(tmp_path / x, "filter") for x in "abcd")
    ea, eb, ec, ed = (rendered_names(tmp_path / x, "envoy") for x in "abcd")
    assert a == b and ea == eb
    assert c != a and ec == ea
    assert d != a and ed != ea


def test_filters_roll_out_before_envoy_and_drain_before_they_stop(objects: Objects, built: Objects) -> None:
    """`kubectl apply -k DIR -l app.kubernetes.io/component=filter` changes the filters and all they read (their
    policies, keys and Redis URL) and no part of Envoy, so new routes are known before Envoy sends them; each pod
    stops only after its exchanges."""
    component = kubernetes.COMPONENT
    filter_part = [o for o in built if o["metadata"]["labels"].get(component) == "filter"]
    assert {o["kind"] for o in filter_part} == {"Deployment", "ConfigMap", "Secret", "Service",
                                                "HorizontalPodAutoscaler", "PodDisruptionBudget", "NetworkPolicy"}  # fmt: skip
    assert {o["metadata"]["name"].rsplit("-", 1)[0] for o in filter_part if o["kind"] == "Secret"} == {
        f"{F}-keys", f"{R}-url"}  # fmt: skip
    envoy_part = [o for o in built if o["metadata"]["name"].startswith(E)]
    assert envoy_part and all(o["metadata"]["labels"][component] == "envoy" for o in envoy_part)
    ps = load_dir(REPO / "policies")
    longest = max(r.upstream.timeout_s for r in ps.routes)
    for component in (E, F):
        deploy = one(objects, "Deployment", component)
        assert deploy["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
        spec = pod_spec(deploy)
        pre_stop = " ".join(spec["containers"][0]["lifecycle"]["preStop"]["exec"]["command"])
        waits = int(pre_stop.rsplit("sleep ", 1)[1])
        assert waits > longest, component  # an exchange started before the pod was dropped ends before SIGTERM
        assert spec["terminationGracePeriodSeconds"] > waits + (GRACE_SECONDS if component == F else 0)
    filt = pod_spec(one(objects, "Deployment", F))["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert int(filt[-1]) >= kubernetes.DNS_SETTLE_S + longest  # Envoy's DNS has dropped the pod first
    envoy = pod_spec(one(objects, "Deployment", E))["containers"][0]
    assert "drain_listeners?graceful" in envoy["lifecycle"]["preStop"]["exec"]["command"][-1]
    assert int(envoy["args"][envoy["args"].index("--drain-time-s") + 1]) > longest


def test_outbound_listener_admits_the_applications_and_reaches_only_the_partner(tmp_path: Path) -> None:
    """An outbound route (docs/outbound.md): its own Service on Envoy's pods; pods labelled as outbound clients
    (any namespace) reach its port, nobody else does (not the internet, not other pods); Envoy reaches the
    partner's address, which no inbound route makes reachable otherwise."""
    inbound = {"name": "hmac", "match": {"path_prefix": "/"}, "upstream": {"address": "192.0.2.10:8443"},
               "profile": "hmac"}  # fmt: skip
    partner = {"name": "partner", "match": {"path_prefix": "/tax/"}, "direction": "outbound", "profile": "rsa",
               "upstream": {"address": "192.0.2.20:443", "tls": True},
               "outbound": {"listen": "127.0.0.1:9300"}}  # fmt: skip
    policies = write_policies(tmp_path / "policies", [inbound, partner])
    objs = [o for f in render(tmp_path / "out", "--no-demo-backend", "--external-redis", policies=policies).values()
            for o in f]  # fmt: skip
    service = one(objs, "Service", kubernetes.OUTBOUND)
    assert [p["port"] for p in service["spec"]["ports"]] == [9300]
    assert 9300 not in [p["port"] for p in one(objs, "Service", E)["spec"]["ports"]]
    app = Peer("app", "shop", {"app": "shop", **kubernetes.OUTBOUND_CLIENT}, (("TCP", 8080),))
    partner_peer = Peer("partner", None, {}, (("TCP", 443),), ip="192.0.2.20")
    internet = Peer("internet", None, {}, (("TCP", 443),), ip="203.0.113.7")
    allowed = flows(objs, [DNS, OTHER_POD, internet, partner_peer, app])
    assert ("app", E, "TCP", 9300) in allowed
    assert {(s, d) for s, d, _, port in allowed if port == 9300} == {("app", E)}
    assert (E, "partner", "TCP", 443) in allowed
    assert (F, "partner", "TCP", 443) not in allowed  # an rsa route: only a secureconversation route asks the STS
    lds = yaml.safe_load(envoy_files(objs)["lds.yaml"])["resources"]
    (listener,) = [r for r in lds if r["name"].startswith("outbound_")]
    assert listener["address"]["socket_address"] == {"address": "0.0.0.0", "port_value": 9300}
