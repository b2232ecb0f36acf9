"""`wsgate render --target kubernetes` with the gateway's keys in a PKCS#11 token (gateway/control/kubernetes_pkcs11.py):
the filter pods get the token's PIN where its pkcs11: URI says (a file at its path, or a variable), the module's
configuration file with the variable naming it, and egress to a network HSM; the PIN and the configuration come
from keys/ through a secretGenerator, never from the rendered files. Checked as tests/unit/test_kubernetes.py checks
the rest: the API's schemas, `kubectl kustomize` with every reference resolved."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.control import kubernetes, kubernetes_pkcs11
from gateway.policy import PolicyError, load_dir
from tests.unit.test_kubernetes import REPO, Objects, kustomize, one, pod_spec, render, validate, workloads

MODULE = "/usr/lib/softhsm/libsofthsm2.so"
PIN_FILE = "/run/secrets/wsgate-hsm/pin"
SIGNING = f"pkcs11:token=gw;object=gateway-sign?module-path={MODULE}&pin-source=file:{PIN_FILE}"
DECRYPTION = f"pkcs11:token=gw;object=gateway-enc?module-path={MODULE}&pin-source=env:WSGATE_HSM_PIN"
SOFTHSM_CONF = f"{kubernetes_pkcs11.CONFIG_MOUNT}/softhsm2.conf"


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Objects]]:
    """The demo policies with both gateway keys in a token (docs/keys.md: WSGATE_SIGNING_KEY and
    WSGATE_DECRYPTION_KEY), rendered with a network HSM's port open."""
    out = tmp_path_factory.mktemp("k8s-token")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WSGATE_SIGNING_KEY", SIGNING)
        env.setenv("WSGATE_DECRYPTION_KEY", DECRYPTION)
        return out, render(out, "--hsm-port", "1792")


def filter_container(objects: Objects) -> dict[str, Any]:
    (container,) = pod_spec(one(objects, "Deployment", kubernetes.FILTER))["containers"]
    return container


def test_filter_pods_get_the_pin_and_module_configuration_as_the_uris_say(
    rendered: tuple[Path, dict[str, Objects]],
) -> None:
    out, parts = rendered
    objects = [o for objs in parts.values() for o in objs]
    for obj in objects:
        validate(obj)
    container = filter_container(objects)
    mounts = {m["mountPath"]: m for m in container["volumeMounts"] if m["name"] == kubernetes_pkcs11.VOLUME}
    assert {p: m["subPath"] for p, m in mounts.items()} == {PIN_FILE: "pin", SOFTHSM_CONF: "softhsm2.conf"}
    assert all(m["readOnly"] for m in mounts.values())
    env = {e["name"]: e for e in container["env"]}
    assert env["SOFTHSM2_CONF"]["value"] == SOFTHSM_CONF
    assert env["WSGATE_HSM_PIN"]["valueFrom"] == {
        "secretKeyRef": {"name": kubernetes_pkcs11.SECRET, "key": "WSGATE_HSM_PIN"}
    }
    assert env["WSGATE_SIGNING_KEY"]["value"] == SIGNING  # the policies read the same URIs in the pod
    volumes = pod_spec(one(objects, "Deployment", kubernetes.FILTER))["volumes"]
    assert {"name": "pkcs11", "secret": {"secretName": kubernetes_pkcs11.SECRET, "defaultMode": 0o440}} in volumes
    kustomization = yaml.safe_load((out / "kustomization.yaml").read_text())
    generators = {g["name"]: g for g in kustomization["secretGenerator"]}
    assert sorted(generators[kubernetes_pkcs11.SECRET]["files"]) == [
        "keys/WSGATE_HSM_PIN", "keys/pin", "keys/softhsm2.conf"
    ]  # fmt: skip
    # The private keys are in the token: the filters' key Secret holds no key file for them.
    assert not any(f.endswith((".key",)) for f in generators[f"{kubernetes.FILTER}-keys"]["files"])
    listed = (out / "keys" / ".gitignore").read_text().splitlines()[0]
    assert all(name in listed.split() for name in ("pin", "softhsm2.conf", "WSGATE_HSM_PIN"))
    # A network HSM on the port given, from the filters only.
    policy = one(objects, "NetworkPolicy", kubernetes.FILTER)
    assert {"ports": [{"protocol": "TCP", "port": 1792}]} in policy["spec"]["egress"]
    assert all("1792" not in str(p["spec"]) for p in objects if p["kind"] == "NetworkPolicy" and p is not policy)


def test_what_kubectl_apply_k_sends_with_a_token_resolves_and_holds_the_pin_only_in_its_secret(
    rendered: tuple[Path, dict[str, Objects]], pki: Path, tmp_path: Path
) -> None:
    out, _ = rendered
    work = tmp_path / "k8s"
    shutil.copytree(out, work)
    pin = "a-pin-seen-only-in-its-secret"
    token_files = {"pin": pin, "WSGATE_HSM_PIN": pin, "softhsm2.conf": "directories.tokendir = /var/lib/t\n"}
    for name, text in token_files.items():
        (work / "keys" / name).write_text(text)
    listed = (work / "keys" / ".gitignore").read_text().splitlines()[0].split(": ", 1)[1].split()
    for name in set(listed) - set(token_files):  # the rest as the operator copies it from certs/out
        shutil.copy(pki / name, work / "keys" / name)
    run = kustomize(work)
    assert run.returncode == 0, run.stderr
    built = list(yaml.safe_load_all(run.stdout))
    present = {(o["kind"], o["metadata"]["name"]) for o in built}
    spec = pod_spec(one(workloads(built), "Deployment", kubernetes.FILTER))
    refs = [v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v]
    refs += [e["valueFrom"]["secretKeyRef"]["name"] for e in spec["containers"][0]["env"] if "valueFrom" in e]
    assert any(r.startswith(f"{kubernetes_pkcs11.SECRET}-") for r in refs)  # renamed with the content hash
    assert all(("Secret", r) in present for r in refs)
    for obj in built:
        validate(obj)
    assert not any(pin in p.read_text() for p in out.rglob("*") if p.is_file())  # never in the rendered files


@pytest.mark.parametrize(
    ("pin_source", "refusal"),
    [
        ("file:pin", "absolute path"),
        ("file:/app/certs/out/hsm-pin", "outside"),
        ("file:/app/policies/pin", "outside"),
        ("file:/run/secrets/two pins", "Secret key"),
    ],
    ids=["relative", "in-the-keys-mount", "in-the-policies-mount", "not-a-secret-key"],
)
def test_pin_files_a_pod_cannot_have_are_refused(
    pin_source: str, refusal: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WSGATE_SIGNING_KEY", SIGNING.replace(f"file:{PIN_FILE}", pin_source))
    monkeypatch.setenv("BACKEND_ADDR", "wsgate-backend:8081")
    with pytest.raises(PolicyError, match=refusal):
        kubernetes.render(load_dir(REPO / "policies"), REPO / "policies", kubernetes.Options())


def test_another_modules_configuration_is_named_by_the_operator(monkeypatch: pytest.MonkeyPatch) -> None:
    luna = "/usr/safenet/lunaclient/lib/libCryptoki2_64.so"
    monkeypatch.setenv("WSGATE_SIGNING_KEY", SIGNING.replace(MODULE, luna))
    monkeypatch.setenv("BACKEND_ADDR", "wsgate-backend:8081")
    opts = kubernetes.Options(pkcs11_config=(("ChrystokiConfigurationPath", "Chrystoki.conf"),))
    files = kubernetes.render(load_dir(REPO / "policies"), REPO / "policies", opts)
    container = filter_container(list(yaml.safe_load_all(files["filter.yaml"])))
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["ChrystokiConfigurationPath"] == f"{kubernetes_pkcs11.CONFIG_MOUNT}/Chrystoki.conf"
    assert "SOFTHSM2_CONF" not in env  # not SoftHSM's module: nothing of SoftHSM's
