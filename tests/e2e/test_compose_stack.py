"""The Compose stack for real: images built, containers started, scaled, broken and rolled (`make test-compose`).

Runs only with `pytest --compose` (a Docker engine and minutes of image builds); `.ci/run` starts dockerd and runs it
after `make test`. The registry images the files name are local stand-ins (tests/support/compose/standins.py,
docs/compose.md). The stack runs from a copy of the repository so that the policy roll can edit its policies/;
the Compose file and the Dockerfile are used unchanged, under a project name of their own."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import yaml

from gateway.policy import load_dir
from gateway.tools.client import Client, ClientConfig, ClientError
from tests.support.compose import standins
from tests.unit.test_compose import compose_command

pytestmark = pytest.mark.compose

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "wsgatetest"
ECHO = (
    b'<soap:Envelope xmlns:soap="http://schemas.xmlsoap.org/soap/envelope/"><soap:Body>'
    b'<d:echo xmlns:d="urn:wsgate:demo"><d:text>hello</d:text></d:echo></soap:Body></soap:Envelope>'
)
GATEWAY = "http://127.0.0.1:8080"
LONG_RUNNING = ("envoy", "filter", "backend", "redis", "ratelimit", "locust-master", "locust-worker")
WSGATE_IMAGE = "wsgate:local"
WSGATE = Path(sys.executable).parent / "wsgate"  # the CLI of the venv running the tests


def say(line: str) -> None:
    """Progress and measurements on the terminal (make test-compose runs pytest with -s)."""
    print(f"compose: {line}", flush=True)


@dataclass
class Stack:
    src: Path  # the repository copy the project is built from
    pki: Path  # the demo PKI, copied out of the certs volume

    def compose(self, *args: str, timeout: float = 1800) -> str:
        nice = ["nice", "-n", "10"] if args[0] == "build" else []  # the machine is shared: builds yield
        cmd = [*nice, *compose_command(), "--project-directory", str(self.src), "-p", PROJECT]
        run = subprocess.run(
            [*cmd, "-f", str(self.src / "docker-compose.yml"), *args],
            cwd=self.src,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert run.returncode == 0, f"compose {' '.join(args)} failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
        return run.stdout

    def containers(self, service: str, every: bool = False) -> list[str]:
        filters = [f"label=com.docker.compose.project={PROJECT}", f"label=com.docker.compose.service={service}"]
        args = ["ps", "-q", "--no-trunc", *(a for f in filters for a in ("--filter", f))]
        return docker(*args, *(["-a"] if every else [])).split()

    def roll(self) -> None:
        """The policy roll docs/compose.md describes: build the image again, bring the stack up to it."""
        started = time.monotonic()
        self.compose("build")
        self.compose("up", "-d")
        say(f"policy roll (build + up -d): {time.monotonic() - started:.0f} s")


def docker(*args: str, timeout: float = 600) -> str:
    run = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, f"docker {' '.join(args)} failed:\n{run.stderr[-3000:]}"
    return run.stdout


def inspect(container: str) -> dict:
    return json.loads(docker("inspect", container))[0]


def copy_repository(dest: Path) -> Path:
    """The tracked and new (not ignored) files: what a clone plus the change under test holds."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (f.decode() for f in files)):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def wait_for(what: str, check, timeout: float = 120, every: float = 1.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()
            if result:
                return result
        except (AssertionError, requests.RequestException, ClientError) as exc:
            last = exc
        else:
            last = None
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {last}")
        time.sleep(every)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        pytest.fail("no Docker engine answers: start dockerd as root (.ci/run does) before `make test-compose`")
    started = time.monotonic()
    standins.ensure(log=say)
    say(f"stand-in images ready: {time.monotonic() - started:.0f} s")
    s = Stack(copy_repository(tmp_path_factory.mktemp("repo")), tmp_path_factory.mktemp("pki"))
    s.compose("down", "--volumes", "--remove-orphans")  # what a failed earlier run left
    started = time.monotonic()
    s.compose("build")
    say(f"docker compose build: {time.monotonic() - started:.0f} s")
    started = time.monotonic()
    s.compose("up", "-d")  # returns once Envoy is healthy: it waits for every other service
    say(f"docker compose up -d: {time.monotonic() - started:.0f} s")
    certs = s.containers("certs", every=True)[0]
    docker("cp", f"{certs}:/certs/.", str(s.pki))
    # As a user's checkout after `wsgate certs init`: keys in certs/out, in the build context of every later
    # build (the policy roll); test_no_private_key_in_any_image_layer looks for them in the image.
    shutil.copytree(s.pki, s.src / "certs" / "out")
    try:
        yield s
    finally:
        s.compose("down", "--volumes", "--remove-orphans")


def secured_client(stack: Stack, policy: str, **cfg) -> Client:
    route = load_dir(stack.src / "policies").route(policy)
    return Client(route, ClientConfig(certs=stack.pki, **cfg))


def test_the_stack_starts_every_service(stack: Stack) -> None:
    for job in ("certs", "config"):
        (container,) = stack.containers(job, every=True)
        assert inspect(container)["State"]["ExitCode"] == 0, f"{job} failed"
    for service in LONG_RUNNING:
        found = stack.containers(service)
        assert found, f"{service} is not running"
        for c in found:
            state = inspect(c)["State"]
            assert state["Running"], f"{service}: {state}"
            if "Health" in state:
                assert state["Health"]["Status"] == "healthy", f"{service}: {state['Health']}"
    assert len(stack.containers("filter")) == 2  # deploy.replicas


# The README's `wsgate client` calls, one per profile (README "Secured requests", "WS-SecureConversation").
CLIENT_CALLS = {
    "rsa": ["--policy", "rsa", "--url", f"{GATEWAY}/rsa/demo"],
    "rsa-encrypted": ["--policy", "rsa-encrypted", "--url", f"{GATEWAY}/rsa-encrypted/demo", "--show-secured"],
    "hmac": ["--policy", "hmac", "--url", f"{GATEWAY}/hmac/demo"],
    "hmac-psk": ["--policy", "hmac", "--key-name", "demo-client", "--url", f"{GATEWAY}/hmac/demo"],
    "username": [
        "--policy",
        "username",
        "--user",
        "bob",
        "--password",
        "bob-demo-password",
        "--url",
        f"{GATEWAY}/username/demo",
    ],
    "sc": ["--policy", "sc", "--url", f"{GATEWAY}/sc/demo", "--repeat", "2"],
}


def wsgate_client(stack: Stack, args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """`wsgate client` as the README runs it, from the checkout: policies/ and certs/out (the stack's PKI)."""
    request = tmp_path / "echo.xml"
    request.write_bytes(ECHO)
    cmd = [str(WSGATE), "client", *args, str(request)]
    return subprocess.run(cmd, cwd=stack.src, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("call", CLIENT_CALLS)
def test_every_profile_gets_its_verified_reply_through_the_containers(stack: Stack, call: str, tmp_path: Path) -> None:
    run = wsgate_client(stack, CLIENT_CALLS[call], tmp_path)
    assert run.returncode == 0, run.stderr
    replies = re.findall(r"<d:echoResponse [^>]*><d:text>hello</d:text></d:echoResponse>", run.stdout)
    assert len(replies) == (2 if call == "sc" else 1), run.stdout


def test_plain_xml_and_tls_routes_through_the_containers(stack: Stack) -> None:
    headers = {"content-type": "text/xml"}
    for path in ("/plain/", "/xml/"):
        r = requests.post(f"{GATEWAY}{path}", data=ECHO, headers=headers, timeout=10)
        assert r.status_code == 200 and b"echoResponse" in r.content, (path, r.status_code, r.text)
    r = requests.post(
        "https://127.0.0.1:8443/tls/", data=ECHO, headers=headers, timeout=10, verify=str(stack.pki / "ca.pem")
    )
    assert r.status_code == 200 and b"echoResponse" in r.content, r.text
    # the tls profile over plain HTTP is refused: Envoy in the container applies the route's policy
    assert requests.post(f"{GATEWAY}/tls/", data=ECHO, headers=headers, timeout=10).status_code == 426


def replica_requests(container: str) -> float:
    """The exchanges a filter replica has handled, from its own /metrics."""
    script = "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:9102/metrics', timeout=5).read().decode())"
    text = docker("exec", container, "python", "-c", script)
    return sum(float(v) for v in re.findall(r'^wsgate_requests_total\{[^}]*phase="request"[^}]*\} (\S+)$', text, re.M))


def test_scaled_to_three_replicas_the_exchanges_spread_over_all(stack: Stack) -> None:
    stack.compose("up", "-d", "--scale", "filter=3")
    replicas = wait_for("three healthy filter replicas", lambda: len(stack.containers("filter")) == 3)
    replicas = stack.containers("filter")
    for c in replicas:
        wait_for(f"{c[:12]} healthy", lambda c=c: inspect(c)["State"]["Health"]["Status"] == "healthy")
    client = secured_client(stack, "hmac")
    post = exchange_poster(f"{GATEWAY}/hmac/demo")

    # Envoy re-resolves filter:9000 every few seconds; until it sees the third replica, send and wait.
    def third_replica_serves() -> bool:
        for _ in range(30):
            status, reply, pending = post(client)
            assert status == 200, reply
            client.open(reply, pending)
        return all(replica_requests(c) > 0 for c in replicas)

    before = {
        c: replica_requests(c)
        for c in wait_for("the third replica in Envoy's cluster", third_replica_serves, 60) and replicas
    }
    for _ in range(90):
        status, reply, pending = post(client)
        assert status == 200
        client.open(reply, pending)
    served = {c[:12]: replica_requests(c) - before[c] for c in replicas}
    say(f"90 hmac exchanges over three replicas: {served}")
    assert sum(served.values()) == 90, served
    assert all(n > 0 for n in served.values()), served


def exchange_poster(url: str):
    session = requests.Session()

    def post(client: Client):
        secured, pending = client.secure(ECHO)
        r = session.post(url, data=secured, headers={"content-type": pending.content_type}, timeout=30)
        return r.status_code, r.content, pending

    return post


def test_a_replica_killed_under_load_loses_no_exchange_beyond_503s(stack: Stack) -> None:
    """Every exchange gets its verified reply or the documented 503 (README: filter workers down), none else."""
    outcomes: Counter[str] = Counter()
    others: list[str] = []
    timeline: list[tuple[float, str]] = []
    stop = threading.Event()
    lock = threading.Lock()

    def load() -> None:
        client = secured_client(stack, "rsa")
        post = exchange_poster(f"{GATEWAY}/rsa/demo")
        while not stop.is_set():
            try:
                status, reply, pending = post(client)
                if status == 200:
                    opened = client.open(reply, pending).serialize()
                    outcome = "verified" if b"<d:text>hello</d:text>" in opened else f"200 but {opened[:200]!r}"
                elif status == 503 and b"Fault" in reply:
                    outcome = "503"
                else:
                    outcome = f"{status} {reply[:200]!r}"
            except (requests.RequestException, ClientError) as exc:
                outcome = f"{type(exc).__name__}: {exc}"
            with lock:
                kind = outcome if outcome in ("verified", "503") else "other"
                outcomes[kind] += 1
                timeline.append((time.monotonic(), kind))
                if kind == "other":
                    others.append(outcome)

    threads = [threading.Thread(target=load) for _ in range(6)]
    for t in threads:
        t.start()
    time.sleep(5)
    victim = stack.containers("filter")[0]
    killed_at = time.monotonic()
    docker("kill", victim)  # SIGKILL: no drain, in-flight exchanges die with it
    time.sleep(15)
    stop.set()
    for t in threads:
        t.join(60)
    say(f"rsa load, a replica SIGKILLed: {dict(outcomes)}")
    assert not others, others[:5]
    assert outcomes["verified"] > 0
    before_kill = [k for at, k in timeline if at < killed_at]
    assert before_kill and all(k == "verified" for k in before_kill), Counter(before_kill)
    # Envoy drops the dead replica: the last seconds are served in full by the two left
    tail = [k for at, k in timeline if at > killed_at + 10]
    assert tail and all(k == "verified" for k in tail), Counter(tail)


def test_a_policy_change_rolled_as_documented_takes_effect(stack: Stack, tmp_path: Path) -> None:
    """docs/compose.md: a route imported from a WSDL, rolled; its ?wsdl served and its signed call answered; then
    the change removed and rolled again, and the route is gone."""
    wsdl_url = f"{GATEWAY}/demo/echo?wsdl"
    assert requests.get(wsdl_url, timeout=10).status_code == 404
    shutil.copy(ROOT / "tests" / "wsdl" / "demo-asymmetric.wsdl", stack.src / "policies")
    imported = stack.src / "policies" / "imported.yaml"
    subprocess.run(
        [
            str(WSGATE),
            "import",
            "policies/demo-asymmetric.wsdl",
            "--upstream",
            "backend:8081",
            "--validate",
            "-o",
            str(imported),
        ],
        cwd=stack.src,
        check=True,
        capture_output=True,
    )
    stack.roll()
    published = wait_for("the imported route's WSDL", lambda: (r := requests.get(wsdl_url, timeout=10)).ok and r, 90)
    assert "<sp:AsymmetricBinding>" in published.text
    # the address is the gateway's listener (bound to 0.0.0.0 in its container), not the service's demo.internal
    assert '<soap:address location="http://localhost:8080/demo/echo"/>' in published.text

    def signed_call() -> subprocess.CompletedProcess[str]:
        run = wsgate_client(stack, ["--policy", "demoport", "--url", f"{GATEWAY}/demo/echo"], tmp_path)
        assert run.returncode == 0, run.stderr
        return run

    assert "<d:text>hello</d:text>" in wait_for("the imported route's signed call", signed_call, 60).stdout

    imported.unlink()
    (stack.src / "policies" / "demo-asymmetric.wsdl").unlink()
    stack.roll()
    wait_for("the route gone", lambda: requests.get(wsdl_url, timeout=10).status_code == 404, 90)


# docs/quotas.md, "Running it": a route with a client-address quota, rolled in like any policy change.
QUOTA_ROUTE = {
    "name": "quota",
    "match": {"path_prefix": "/quota/"},
    "upstream": {"address": "${BACKEND_ADDR:-127.0.0.1:8081}"},
    "profile": "xml",
    "quotas": {"client_address": {"per_second": 3}},
}


def test_a_flood_over_a_quota_is_refused_by_the_rate_limit_service_in_its_container(stack: Stack) -> None:
    """The rate-limit service counts in the stack's Redis with the limits `config` rendered: a burst over a
    per-second quota gets 429 with the SOAP fault and Retry-After; another route is not limited; a roll that
    raises the limit reaches the running service (it reloads its configuration, no restart)."""
    (stack.src / "policies" / "quota.yaml").write_text(yaml.safe_dump({"routes": [QUOTA_ROUTE]}))
    stack.roll()
    headers = {"content-type": "text/xml"}
    session = requests.Session()

    def burst(path: str, n: int = 12) -> list[requests.Response]:
        return [session.post(f"{GATEWAY}{path}", data=ECHO, headers=headers, timeout=10) for _ in range(n)]

    def refused() -> list[requests.Response]:
        answers = burst("/quota/")
        assert any(r.status_code == 200 for r in answers), [r.status_code for r in answers]
        return [r for r in answers if r.status_code == 429]

    over = wait_for("the quota route and its limit", refused, 90)
    assert {r.status_code for r in burst("/quota/")} <= {200, 429}
    for r in over:
        assert b"<faultstring>Too many requests</faultstring>" in r.content, r.text
        assert r.headers["content-type"].startswith("text/xml") and int(r.headers["retry-after"]) in (0, 1)
    assert {r.status_code for r in burst("/xml/")} == {200}  # no quota there
    started = inspect(stack.containers("ratelimit")[0])["State"]["StartedAt"]

    raised = {**QUOTA_ROUTE, "quotas": {"client_address": {"per_second": 1000}}}
    (stack.src / "policies" / "quota.yaml").write_text(yaml.safe_dump({"routes": [raised]}))
    stack.roll()
    wait_for("the raised limit", lambda: {r.status_code for r in burst("/quota/")} == {200}, 60)
    assert inspect(stack.containers("ratelimit")[0])["State"]["StartedAt"] == started


# A PEM private key with its body (the bare marker is a constant in cryptography's code), headers allowed.
PRIVATE_KEY = re.compile(
    rb"-----BEGIN ((?:[A-Z]+ )?PRIVATE KEY)-----\r?\n(?:[\w-]+: [^\r\n]*\r?\n)*\r?\n?(?:[A-Za-z0-9+/=]{16,}\r?\n)+-----END \1-----"
)


def test_containers_run_as_non_root_on_read_only_root_filesystems(stack: Stack) -> None:
    for service in LONG_RUNNING:
        for c in stack.containers(service):
            uids = docker("top", c, "-eo", "pid,uid,comm").split("\n")[1:]
            running_as = {line.split()[1] for line in uids if line.strip()}
            assert running_as and "0" not in running_as, f"{service} runs a process as root: {uids}"
            assert inspect(c)["HostConfig"]["ReadonlyRootfs"], f"{service}: writable root filesystem"
            probe = subprocess.run(["docker", "exec", c, "touch", "/probe"], capture_output=True, text=True)
            assert probe.returncode != 0 and "Read-only file system" in probe.stderr, (service, probe.stderr)


def test_no_private_key_in_any_image_layer(stack: Stack, tmp_path: Path) -> None:
    """`docker history` and every file of every layer of the image the project builds: none of the stack's own keys
    (from the volume it made) anywhere; no PEM private key in the layers the build adds to its base. The base's
    own layers are the stand-in's, not what a user pulls (Debian's libgnutls carries a self-test key)."""
    assert not PRIVATE_KEY.search(docker("history", "--no-trunc", WSGATE_IMAGE).encode())
    keys = [p.read_bytes().strip() for p in stack.pki.glob("*.key")]
    assert len(keys) > 3, "the PKI has no keys to look for"
    base_layers = json.loads(docker("image", "inspect", "--format", "{{json .RootFS.Layers}}", "python:3.11-slim"))
    archive = tmp_path / "image.tar"
    docker("save", "-o", str(archive), WSGATE_IMAGE)
    found, scanned, ours = [], 0, 0
    with tarfile.open(archive) as image:
        manifest = json.load(image.extractfile("manifest.json"))[0]
        config = json.load(image.extractfile(manifest["Config"]))
        assert config["rootfs"]["diff_ids"][: len(base_layers)] == base_layers, "not built on python:3.11-slim"
        for i, name in enumerate(manifest["Layers"]):
            added = i >= len(base_layers)
            with tarfile.open(fileobj=image.extractfile(name)) as fs:
                for f in (f for f in fs if f.isfile()):
                    data = fs.extractfile(f).read()
                    scanned, ours = scanned + 1, ours + added
                    if any(k in data for k in keys) or (added and PRIVATE_KEY.search(data)):
                        found.append(f"layer {i}: {f.name}")
    say(f"{WSGATE_IMAGE}: {scanned} files scanned for the stack's keys, {ours} in the build's layers for any key")
    assert ours > 1000 and not found, found


def test_image_sizes(stack: Stack) -> None:
    names = [WSGATE_IMAGE, *standins.named_images(), standins.BASE]
    for name, size in standins.sizes(names).items():
        say(f"image {name:32} {size / 1e6:7.1f} MB")
    assert standins.sizes([WSGATE_IMAGE])[WSGATE_IMAGE] < 1_000_000_000


def test_down_leaves_nothing_running(stack: Stack) -> None:
    stack.compose("down", "--volumes")
    label = f"label=com.docker.compose.project={PROJECT}"
    assert docker("ps", "-a", "-q", "--filter", label).split() == []
    assert docker("network", "ls", "-q", "--filter", label).split() == []
    assert docker("volume", "ls", "-q", "--filter", label).split() == []
    for port in (8080, 8443, 9901, 8089):
        with pytest.raises(requests.ConnectionError):
            requests.get(f"http://127.0.0.1:{port}/", timeout=5)
