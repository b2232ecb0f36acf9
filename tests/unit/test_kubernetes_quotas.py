"""Quotas in the Kubernetes render (docs/quotas.md): the Envoy rate-limit service as a Deployment, its Service, its
configuration in a ConfigMap and a NetworkPolicy (Envoy's pods -> the service -> Redis, nothing else), Envoy's
cluster pointing at it. Validated as tests/unit/test_kubernetes.py validates the rest of the render: the API's
schemas, `kubectl kustomize` with the keys in place, the NetworkPolicies' flows."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.control import kubernetes, rate_limit
from gateway.policy import load_dir
from tests.unit.test_kubernetes import (
    DNS,
    INTERNET,
    OTHER_POD,
    REPO,
    B,
    E,
    F,
    Objects,
    Peer,
    R,
    clients_to_envoy,
    dns_flows,
    envoy_files,
    flows,
    kustomize,
    one,
    pod_spec,
    render,
    validate,
    with_keys,
)

RL = kubernetes.RATELIMIT
QUOTA_ROUTE = {
    "name": "quota",
    "match": {"path_prefix": "/quota/"},
    "upstream": {"address": "${BACKEND_ADDR:-127.0.0.1:8081}"},
    "profile": "xml",
    "quotas": {"client_address": {"per_second": 2}, "backend": {"per_day": 100000}},
}


def quota_policies(directory: Path) -> Path:
    """The demo policies and a route with quotas."""
    shutil.copytree(REPO / "policies", directory)
    (directory / "quota.yaml").write_text(yaml.safe_dump({"routes": [QUOTA_ROUTE]}))
    return directory


@pytest.fixture(scope="module")
def policies_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return quota_policies(tmp_path_factory.mktemp("quota") / "policies")


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory, policies_dir: Path) -> Path:
    path = tmp_path_factory.mktemp("k8s-quota")
    render(path, policies=policies_dir)
    return path


@pytest.fixture(scope="module")
def objects(out: Path) -> Objects:
    kustomization = yaml.safe_load((out / "kustomization.yaml").read_text())
    return [o for name in kustomization["resources"] for o in yaml.safe_load_all((out / name).read_text())]


def container(objs: Objects) -> dict[str, Any]:
    (c,) = pod_spec(one(objs, "Deployment", RL))["containers"]
    return c


def test_quotas_deploy_the_rate_limit_service_with_the_rendered_limits(objects: Objects, policies_dir: Path) -> None:
    for obj in objects:
        validate(obj)
    deployment = one(objects, "Deployment", RL)
    assert deployment["spec"]["replicas"] >= 2  # stateless: the counts are in Redis, shared by every replica
    c = container(objects)
    assert c["image"] == rate_limit.image() and c["command"] == ["/bin/ratelimit"]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env == rate_limit.environment(
        f"0.0.0.0:{kubernetes.RATELIMIT_PORT}", Path(kubernetes.RATELIMIT_ROOT),
        f"redis://{R}:{kubernetes.REDIS_PORT}/0", health=f"0.0.0.0:{kubernetes.RATELIMIT_HEALTH_PORT}",
    )  # fmt: skip
    # Its configuration: the file the gateway renders from the policies, where the service reads it
    # (RUNTIME_ROOT/config/), in a ConfigMap named by its content (a changed limit rolls the pods).
    (mount,) = c["volumeMounts"]
    assert mount["mountPath"] == f"{env['RUNTIME_ROOT']}/{Path(rate_limit.CONFIG_FILE).parent}" and mount["readOnly"]
    (volume,) = pod_spec(deployment)["volumes"]
    config = one(objects, "ConfigMap", volume["configMap"]["name"])
    assert config["immutable"] and config["data"] == {
        Path(rate_limit.CONFIG_FILE).name: rate_limit.service_config(load_dir(policies_dir))
    }
    # Healthy when its HTTP listener says so; the Service publishes the gRPC port Envoy's cluster names.
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": int(env["GRPC_PORT"]), "health": int(env["PORT"])}
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthcheck", "port": "health"}
    service = one(objects, "Service", RL)
    assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(kubernetes.RATELIMIT_PORT, "grpc")]
    clusters = {c["name"]: c for c in yaml.safe_load(envoy_files(objects)["cds.yaml"])["resources"]}
    (endpoint,) = clusters[rate_limit.CLUSTER]["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert endpoint["endpoint"]["address"]["socket_address"] == {"address": RL, "port_value": kubernetes.RATELIMIT_PORT}


def test_what_kubectl_apply_k_sends_holds_the_rate_limit_service(out: Path, pki: Path) -> None:
    with_keys(out, pki)
    run = kustomize(out)
    assert run.returncode == 0, run.stderr
    built = list(yaml.safe_load_all(run.stdout))
    for obj in built:
        validate(obj)
    (volume,) = pod_spec(one(built, "Deployment", RL))["volumes"]
    assert one(built, "ConfigMap", volume["configMap"]["name"])["metadata"]["namespace"] == kubernetes.NAMESPACE


def test_network_policies_let_envoy_reach_the_rate_limit_service_and_it_redis_only(objects: Objects) -> None:
    """Envoy -> the service's gRPC port, the service -> Redis: nothing else reaches the service (not the filters,
    not the namespace's other pods, not its health port) and it reaches nothing else."""
    expected = {
        *clients_to_envoy("internet", "other-namespace-pod", "kube-dns"),
        (E, F, "TCP", kubernetes.FILTER_PORT),
        (E, B, "TCP", kubernetes.BACKEND_PORT),
        (E, RL, "TCP", kubernetes.RATELIMIT_PORT),
        (F, R, "TCP", kubernetes.REDIS_PORT),
        (RL, R, "TCP", kubernetes.REDIS_PORT),
        *dns_flows(E, F, RL),
    }
    assert flows(objects, [DNS, OTHER_POD, INTERNET]) == expected


def test_an_external_redis_address_for_the_rate_limit_service_comes_from_keys(tmp_path: Path) -> None:
    """Like the filters' Redis URL, never rendered: the service takes host:port (keys/ratelimit-redis-address)."""
    policies = quota_policies(tmp_path / "policies")
    files = render(tmp_path / "out", "--external-redis", policies=policies)
    objs = [o for f in files.values() for o in f]
    (redis,) = [e for e in container(objs)["env"] if e["name"] == "REDIS_URL"]
    assert redis == {"name": "REDIS_URL", "valueFrom": {"secretKeyRef": {"name": f"{RL}-redis", "key": "address"}}}
    kustomization = yaml.safe_load((tmp_path / "out" / "kustomization.yaml").read_text())
    (generator,) = [g for g in kustomization["secretGenerator"] if g["name"] == f"{RL}-redis"]
    assert generator["files"] == [f"address=keys/{kubernetes.RATELIMIT_REDIS_FILE}"]
    assert kubernetes.RATELIMIT_REDIS_FILE in (tmp_path / "out" / "keys" / ".gitignore").read_text().split()
    internet = Peer("internet", None, {}, (("TCP", 6379),), ip="203.0.113.7")
    assert (RL, "internet", "TCP", kubernetes.REDIS_PORT) in flows(objs, [DNS, internet])


def test_no_quota_no_rate_limit_service(tmp_path: Path) -> None:
    files = render(tmp_path / "out")
    assert "ratelimit.yaml" not in files
    assert not [o for f in files.values() for o in f if o["metadata"]["name"] == RL]
