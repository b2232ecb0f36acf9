"""docker-compose.yml: valid for Compose itself, and the topology the gateway's Compose target assumes.

Compose normalizes the file (`config`), so the assertions read what Compose will run, not what the YAML
looks like. No Docker engine is needed. Both Compose v1 (`docker-compose`, the Debian package) and the v2
plugin (`docker compose`) are accepted; they print volumes and ports in different shapes."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from certs import pki
from filters.stores import replay
from gateway.control import envoy_config, rate_limit

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
PYTHON_SERVICES = {"certs", "config", "filter", "backend", "locust-master", "locust-worker"}


def compose_command() -> list[str]:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    pytest.fail(
        "neither docker-compose nor the docker compose plugin is installed; "
        "install it with: apt-get update && apt-get install -y docker-compose"
    )


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """The normalized Compose model (`docker-compose config`)."""
    run = subprocess.run(
        [*compose_command(), "--project-directory", str(ROOT), "-f", str(COMPOSE_FILE), "config"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert run.returncode == 0, f"docker-compose config refused the file:\n{run.stderr}"
    return yaml.safe_load(run.stdout)


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def mounts(service: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """Container path -> (named volume, read-only)."""
    out = {}
    for v in service.get("volumes", []):
        if isinstance(v, str):  # v1: "source:target[:mode]"
            source, target, *mode = v.split(":")
            out[target] = (source, mode == ["ro"])
        else:  # v2: long syntax
            out[v["target"]] = (v["source"], bool(v.get("read_only")))
    return out


def ports(service: dict[str, Any]) -> set[tuple[str, int, int]]:
    """(host ip, published port, container port)."""
    out = set()
    for p in service.get("ports", []):
        if isinstance(p, str):  # v1: "ip:published:target/proto"
            ip, published, target = p.split("/")[0].rsplit(":", 2)
            out.add((ip, int(published), int(target)))
        else:
            out.add((p.get("host_ip", ""), int(p["published"]), int(p["target"])))
    return out


def depends(service: dict[str, Any]) -> dict[str, str]:
    """Dependency -> condition."""
    deps = service.get("depends_on", {})
    if isinstance(deps, list):
        return dict.fromkeys(deps, "service_started")
    return {name: d.get("condition", "service_started") for name, d in deps.items()}


def option(command: list[str], flag: str) -> str:
    assert flag in command, f"{flag} missing from {command}"
    return command[command.index(flag) + 1]


def test_services_are_the_topology(services: dict[str, dict[str, Any]]) -> None:
    assert set(services) == PYTHON_SERVICES | {"envoy", "redis", "ratelimit"}
    assert services["redis"]["image"] == "redis:7-alpine"


def test_python_services_share_one_image_built_from_the_project(services: dict[str, dict[str, Any]]) -> None:
    images = {services[name]["image"] for name in PYTHON_SERVICES}
    assert len(images) == 1
    for name in PYTHON_SERVICES:
        assert Path(services[name]["build"]["context"]).resolve() == ROOT
        assert services[name]["build"]["dockerfile"] == "gateway/Dockerfile"
    dockerfile = (ROOT / "gateway" / "Dockerfile").read_text()
    # The filter workers' compiled frame is built in a builder stage with a Rust toolchain; only its wheel ships.
    assert re.findall(r"^FROM\s+(\S+)(?:\s+AS\s+(\S+))?", dockerfile, re.M) == [
        ("python:3.11-slim", "frame"),
        ("python:3.11-slim", ""),
    ]
    assert "COPY --from=rust:1.95-slim" in dockerfile and "COPY --from=frame /wheels /wheels" in dockerfile
    assert "pyproject.toml" in dockerfile


def test_envoy_is_the_official_image_and_waits_for_its_config(services: dict[str, dict[str, Any]]) -> None:
    envoy = services["envoy"]
    assert envoy["image"] == "envoyproxy/envoy:v1.40.0"
    assert "build" not in envoy
    deps = depends(envoy)
    assert deps["config"] == "service_completed_successfully"
    assert deps["certs"] == "service_completed_successfully"
    assert envoy["command"] == ["envoy", "-c", "/config/envoy.yaml", "--concurrency", "1"]


def test_envoy_reads_what_the_config_and_certs_jobs_write(services: dict[str, dict[str, Any]]) -> None:
    """Same volume, same paths: the bootstrap the renderer writes is the one Envoy loads."""
    topo = envoy_config.compose_topology()
    envoy, config, certs = services["envoy"], services["config"], services["certs"]
    out_dir = option(config["command"], "--out")
    assert out_dir == topo.config_dir
    assert option(envoy["command"], "-c") == f"{out_dir}/envoy.yaml"
    assert mounts(config)[out_dir] == ("config", False)
    assert mounts(envoy)[topo.config_dir] == ("config", True)
    assert config["command"][:2] == ["wsgate", "render"]
    assert option(config["command"], "--target") == "compose"
    assert option(config["command"], "--policies") == "/app/policies"

    assert certs["command"][:3] == ["wsgate", "certs", "init"]
    certs_dir = option(certs["command"], "--out")
    assert mounts(certs)[certs_dir] == ("certs", False)
    assert mounts(envoy)[topo.certs_dir] == ("certs", True)


def test_config_job_reads_the_pki_a_published_wsdl_carries(services: dict[str, dict[str, Any]]) -> None:
    """A route's ?wsdl is rendered with its signing certificate (pc:SigningCertificates), named relative to the
    working directory as the filter's keys are: without the certs volume there, a roll that adds such a route
    failed to render and Envoy kept the old routes (the Compose stack test's policy roll)."""
    config = services["config"]
    assert mounts(config)[f"/app/{pki.DEFAULT_DIR}"] == ("certs", True)
    assert depends(config)["certs"] == "service_completed_successfully"


def test_the_rate_limit_service_reads_what_config_renders_and_counts_in_the_shared_redis(
    services: dict[str, dict[str, Any]],
) -> None:
    """The pinned commit's image; the settings rate_limit.environment() gives (as `wsgate up` runs it), with its
    configuration where the config job writes it (`render --out DIR`: DIR/ratelimit), its counts in the Redis the
    filters share, its gRPC where Envoy's cluster points; Envoy waits for it to be healthy."""
    rls, config, envoy = services["ratelimit"], services["config"], services["envoy"]
    assert rls["image"] == rate_limit.image() and "build" not in rls
    assert rls["command"] == ["/bin/ratelimit"]
    host, port = envoy_config.compose_topology().ratelimit.rsplit(":", 1)
    assert host == "ratelimit"
    out_dir = option(config["command"], "--out")
    redis_url = services["filter"]["environment"]["WSGATE_REDIS_URL"]
    health = f"127.0.0.1:{rls['environment']['PORT']}"
    expected = rate_limit.environment(f"0.0.0.0:{port}", Path(out_dir) / "ratelimit", redis_url, health=health)
    assert {k: str(v) for k, v in rls["environment"].items()} == expected
    assert mounts(rls)[out_dir] == ("config", True)
    assert depends(rls) == {"config": "service_completed_successfully", "redis": "service_healthy"}
    assert depends(envoy)["ratelimit"] == "service_healthy"
    assert rls["healthcheck"]["test"][-1] == f"http://{health}/healthcheck"
    assert rls["user"] != "0" and not rls["user"].startswith("0:")


def test_envoy_ports_are_on_loopback_only(services: dict[str, dict[str, Any]]) -> None:
    topo = envoy_config.compose_topology()
    assert ports(services["envoy"]) == {("127.0.0.1", p, p) for p in (topo.http_port, topo.https_port, topo.admin_port)}


def test_filter_replicas_are_reached_by_dns(services: dict[str, dict[str, Any]]) -> None:
    filt = services["filter"]
    assert filt["deploy"]["replicas"] >= 2
    assert not filt.get("ports"), "replicas cannot share host ports; Envoy reaches them on the Compose network"
    assert filt["command"][:2] == ["wsgate", "filter"]
    assert option(filt["command"], "--policies") == "/app/policies"
    listen_port = option(filt["command"], "--listen").rsplit(":", 1)[1]
    assert envoy_config.compose_topology().filter_endpoints == (f"filter:{listen_port}",)
    # Policies name their keys relative to the working directory (certs/out/...): the PKI volume is there.
    assert mounts(filt)[f"/app/{pki.DEFAULT_DIR}"] == ("certs", True)
    assert depends(filt)["certs"] == "service_completed_successfully"


def test_backend_is_where_the_policies_point(services: dict[str, dict[str, Any]]) -> None:
    backend = services["backend"]
    assert backend["command"][:2] == ["wsgate", "backend"]
    host, port = option(backend["command"], "--listen").rsplit(":", 1)
    assert host == "0.0.0.0"
    for name in ("config", "filter"):
        assert services[name]["environment"]["BACKEND_ADDR"] == f"backend:{port}"
    assert not backend.get("ports")


def test_locust_master_and_workers(services: dict[str, dict[str, Any]]) -> None:
    master, worker = services["locust-master"], services["locust-worker"]
    for svc in (master, worker):
        assert svc["command"][:3] == ["locust", "-f", "/app/loadtest/locustfile.py"]
    assert "--master" in master["command"]
    assert ports(master) == {("127.0.0.1", 8089, 8089)}
    assert "--worker" in worker["command"]
    assert option(worker["command"], "--master-host") == "locust-master"


def test_health_conditions_have_healthchecks(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in services.items():
        for dep, condition in depends(svc).items():
            assert dep in services, f"{name} depends on unknown service {dep}"
            if condition == "service_healthy":
                assert services[dep].get("healthcheck", {}).get("test"), f"{name} waits for {dep}'s health"
    for name in ("envoy", "backend", "filter", "redis"):
        assert services[name].get("healthcheck", {}).get("test"), f"{name} has no healthcheck"


def test_named_volumes_only(compose: dict[str, Any], services: dict[str, dict[str, Any]]) -> None:
    """Everything shared between containers lives in declared named volumes, never in the host's tree."""
    assert set(compose["volumes"]) == {"certs", "config"}
    for name, svc in services.items():
        for target, (source, _) in mounts(svc).items():
            assert source in compose["volumes"], f"{name}: {target} is mounted from {source}, not a named volume"


def test_every_service_has_a_read_only_root_filesystem(services: dict[str, dict[str, Any]]) -> None:
    for name in (
        "envoy",
        "filter",
        "backend",
        "redis",
        "ratelimit",
        "locust-master",
        "locust-worker",
        "certs",
        "config",
    ):
        assert services[name].get("read_only") is True, f"{name}: writable root filesystem"


def test_filter_replicas_export_metrics_inside_the_network(services: dict[str, dict[str, Any]]) -> None:
    filt = services["filter"]
    port = option(filt["command"], "--metrics-port")
    assert port in {str(p) for p in filt["expose"]}
    assert not filt.get("ports")


def test_redis_healthcheck_starts_the_replay_epoch(services: dict[str, dict[str, Any]]) -> None:
    """The filters wait for Redis's health: the epoch must exist before their first message (docs/compose.md)."""
    test = services["redis"]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "redis-cli", "EVAL"]
    assert "'NX'" in test[3] and "redis.call('TIME')" in test[3]
    assert test[4:] == ["1", replay.EPOCH_KEY.decode()]
    assert depends(services["filter"])["redis"] == "service_healthy"
