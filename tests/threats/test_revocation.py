"""X.509 revocation through the running gateway: CRL files (made with `cryptography`, and the demo CA's from
`wsgate certs revoke`), a real OCSP responder (`openssl ocsp` over the demo CA's index) and responders in this
file that sign what a forger or a replayer would send; for `rsa` routes and the `secureconversation` bootstrap."""

from __future__ import annotations

import datetime as dt
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509 import ocsp

from certs import pki as pki_mod
from filters.engine.wss import keys
from gateway.control.ports import free_ports
from gateway.policy import Route
from gateway.tools.client import Client, ClientError, http_post
from tests.support.harness import GatewayFactory, LiveGateway, LoopbackHttp, fault_code
from tests.support.wss_helpers import echo, route_doc

NOW = dt.datetime.now(dt.UTC)


def save(out: Path, stem: str, issued: pki_mod.Issued) -> None:
    (out / f"{stem}.pem").write_bytes(issued.cert.public_bytes(serialization.Encoding.PEM))
    (out / f"{stem}.key").write_bytes(
        issued.key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )


def make_crl(
    issuer: pki_mod.Issued,
    revoked: list[int] = [],  # noqa: B006 (never changed)
    *,
    last: dt.timedelta = dt.timedelta(minutes=-1),
    next: dt.timedelta = dt.timedelta(days=1),
    encoding: serialization.Encoding = serialization.Encoding.PEM,
) -> bytes:
    now = dt.datetime.now(dt.UTC)
    builder = x509.CertificateRevocationListBuilder().issuer_name(issuer.cert.subject)
    builder = builder.last_update(now + last).next_update(now + next)
    for serial in revoked:
        entry = x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(now - dt.timedelta(minutes=1))
        builder = builder.add_revoked_certificate(entry.build())
    return builder.sign(issuer.key, hashes.SHA256()).public_bytes(encoding)


def replace_file(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def wait_until_listening(log: Path, proc: subprocess.Popen[bytes]) -> None:
    """openssl ocsp serves one connection at a time, and a probe that connects and says nothing holds it: its
    log says when it listens."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and proc.poll() is None:
        if b"waiting for OCSP client connections" in log.read_bytes():
            return
        time.sleep(0.05)
    raise RuntimeError(f"openssl ocsp did not start: {log.read_text()}")


# --- an OCSP responder that signs what it is told to -----------------------------------------------------


@dataclass
class Forgery:
    """How an answer is made: who signs it, who it names as responder, which certificates ride along, the
    nonce, its validity. The defaults are an honest delegated responder."""

    signer: pki_mod.Issued
    by_name: bool = False  # the responder ID: the signer's name, else the hash of its key
    include: tuple[x509.Certificate, ...] | None = None  # None: the signer's certificate
    nonce: str = "echo"  # echo | wrong | none
    this_update: dt.timedelta = dt.timedelta(minutes=-1)
    next_update: dt.timedelta | None = dt.timedelta(hours=1)
    status: ocsp.OCSPCertStatus = ocsp.OCSPCertStatus.GOOD


class PythonResponder:
    """An OCSP responder on a loopback port (http.server, cryptography's builder); counts the requests."""

    def __init__(self, forgery: Forgery) -> None:
        self.forgery = forgery
        self.http = LoopbackHttp(lambda der: ("application/ocsp-response", self.answer(der)))
        self.url = self.http.url + "/"

    @property
    def hits(self) -> int:
        return len(self.http.paths)

    def answer(self, der: bytes) -> bytes:
        f = self.forgery
        req = ocsp.load_der_ocsp_request(der)
        now = dt.datetime.now(dt.UTC)
        builder = ocsp.OCSPResponseBuilder().add_response_by_hash(
            issuer_name_hash=req.issuer_name_hash, issuer_key_hash=req.issuer_key_hash,
            serial_number=req.serial_number, algorithm=hashes.SHA1(), cert_status=f.status,
            this_update=now + f.this_update, next_update=now + f.next_update if f.next_update else None,
            revocation_time=now if f.status == ocsp.OCSPCertStatus.REVOKED else None, revocation_reason=None,
        )  # fmt: skip
        encoding = ocsp.OCSPResponderEncoding.NAME if f.by_name else ocsp.OCSPResponderEncoding.HASH
        builder = builder.responder_id(encoding, f.signer.cert)
        include = (f.signer.cert,) if f.include is None else f.include
        if include:
            builder = builder.certificates(list(include))
        if f.nonce != "none":
            asked = req.extensions.get_extension_for_class(x509.OCSPNonce).value.nonce
            builder = builder.add_extension(x509.OCSPNonce(asked if f.nonce == "echo" else b"\0" * 16), False)
        return builder.sign(f.signer.key, hashes.SHA256()).public_bytes(serialization.Encoding.DER)

    def close(self) -> None:
        self.http.close()


# --- the PKI, the responders, the gateway -------------------------------------------------------------


@dataclass
class Setup:
    pki: Path
    ca: pki_mod.Issued
    inter: pki_mod.Issued
    rogue: pki_mod.Issued
    openssl_url: str
    forgeries: dict[str, PythonResponder]
    counted: PythonResponder  # answers valid for 3 s
    capped: PythonResponder  # answers valid for a day, on a route that keeps them 1 s
    ahead: PythonResponder  # answers valid for 4 s
    routes: list[dict]


def load(out: Path, stem: str) -> pki_mod.Issued:
    return pki_mod.Issued(keys.load_private_key(out / f"{stem}.key"), keys.load_certificate(out / f"{stem}.pem"))


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    openssl = shutil.which("openssl")
    assert openssl, "the openssl command is needed (Debian: openssl)"
    out = tmp_path_factory.mktemp("revocation-pki")
    port, dead_port = free_ports(2)
    pki_mod.init(out, ocsp_url=f"http://127.0.0.1:{port}/")  # client certificates name the responder (AIA)
    ca = load(out, "ca")
    inter = pki_mod.make_ca("WSGate Issuing CA", parent=ca)
    save(out, "inter", inter)
    pki_mod.record(out, inter.cert)
    save(out, "chained", pki_mod.issue(inter, "Chained Client", client_auth=True))
    for stem in ("revoked", "later", "sc-revoked"):
        issued = pki_mod.issue(ca, f"{stem.title()} Client", client_auth=True, ocsp_url=f"http://127.0.0.1:{port}/")
        save(out, stem, issued)
        pki_mod.record(out, issued.cert)
    pki_mod.revoke(out, "revoked", "keyCompromise")
    pki_mod.revoke(out, "sc-revoked", "keyCompromise")
    (out / "inter.crl").write_bytes(make_crl(inter, encoding=serialization.Encoding.DER))
    (out / "expired.crl").write_bytes(make_crl(ca, last=dt.timedelta(days=-2), next=dt.timedelta(days=-1)))
    (out / "soon.crl").write_bytes(make_crl(ca, last=dt.timedelta(days=-3), next=dt.timedelta(days=-2)))
    log = open(out / "openssl-ocsp.log", "wb")
    proc = subprocess.Popen(
        [openssl, "ocsp", "-index", str(out / "index.txt"), "-port", str(port), "-CA", str(out / "ca.pem"),
         "-rsigner", str(out / "ocsp.pem"), "-rkey", str(out / "ocsp.key"), "-ndays", "1"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    rogue = load(out, "rogue-ca")
    responder = load(out, "ocsp")
    rogue_responder = pki_mod.issue(rogue, "Rogue OCSP Responder", ocsp_signing=True)
    impostor = pki_mod.make_ca("WSGate Demo CA")  # the issuer's name, another key
    forgeries = {
        "honest": PythonResponder(Forgery(responder)),
        "signed-by-another-ca-posing-as-the-issuer": PythonResponder(Forgery(impostor, by_name=True, include=())),
        "delegate-without-ocsp-signing": PythonResponder(Forgery(load(out, "gateway-sign"))),
        "delegate-of-another-ca": PythonResponder(Forgery(rogue_responder)),
        "replayed-with-another-nonce": PythonResponder(Forgery(responder, nonce="wrong")),
        "stale-past-next-update": PythonResponder(
            Forgery(responder, nonce="none", this_update=dt.timedelta(days=-2), next_update=dt.timedelta(days=-1))
        ),
    }
    counted = PythonResponder(Forgery(responder, next_update=dt.timedelta(seconds=3)))
    capped = PythonResponder(Forgery(responder, next_update=dt.timedelta(days=1)))
    ahead = PythonResponder(Forgery(responder, next_update=dt.timedelta(seconds=4)))
    dead = f"http://127.0.0.1:{dead_port}/"

    def rsa(name: str, **revocation: object) -> dict:
        extra = {"intermediates": [str(out / "inter.pem")]} if name == "chain" else {}
        return route_doc(out, "rsa", name=name, rsa={**extra, "revocation": revocation})

    crl = str(out / "ca.crl")
    routes = [
        rsa("crl", mode="crl", crl_files=[crl]),
        rsa("chain", mode="crl", crl_files=[crl, str(out / "inter.crl")]),
        rsa("expired", mode="crl", crl_files=[str(out / "expired.crl")]),
        rsa("soon", mode="crl", crl_files=[str(out / "soon.crl")]),
        rsa("ocsp", mode="ocsp", ocsp_responder=f"http://127.0.0.1:{port}/"),
        rsa("aia", mode="ocsp"),
        rsa("both", mode="both", crl_files=[str(out / "expired.crl")], ocsp_responder=dead),
        rsa("dead", mode="ocsp", ocsp_responder=dead, timeout_s=1),
        rsa("soft", mode="ocsp", ocsp_responder=dead, timeout_s=1, on_unknown="allow"),
        rsa("counted", mode="ocsp", ocsp_responder=counted.url),
        rsa("capped", mode="ocsp", ocsp_responder=capped.url, max_cache_s=1),
        rsa("ahead", mode="ocsp", ocsp_responder=ahead.url),
        *(rsa(name, mode="ocsp", ocsp_responder=r.url) for name, r in forgeries.items()),
    ]
    sc = route_doc(
        out, "secureconversation", name="sc", rsa={"revocation": {"mode": "crl", "crl_files": [crl]}},
        secureconversation={"store": "sealed", "master_keys_file": str(out / "sct-master-keys.yaml")},
    )  # fmt: skip
    routes.append(sc)
    try:
        wait_until_listening(out / "openssl-ocsp.log", proc)
        yield Setup(out, ca, inter, rogue, f"http://127.0.0.1:{port}/", forgeries, counted, capped, ahead, routes)
    finally:
        proc.kill()
        proc.wait(timeout=10)
        log.close()
        for r in [*forgeries.values(), counted, capped, ahead]:
            r.close()


@pytest.fixture(scope="module")
def gw(module_gateway: GatewayFactory, setup: Setup) -> LiveGateway:
    return module_gateway(setup.routes, pki=setup.pki)  # the test's own PKI: its CA revokes


def client(gw: LiveGateway, route: str, stem: str) -> tuple[Client, Callable[[bytes, str], bytes]]:
    return gw.client(route, key=f"{stem}.key", certificate=f"{stem}.pem"), http_post(gw.url(route))


def send(gw: LiveGateway, route: str, stem: str = "client") -> str:
    """'ok' when the gateway let the request through (and its reply opens), else the fault code."""
    c, _ = client(gw, route, stem)
    secured, pending = c.secure(echo("revocation"))
    resp = gw.post(route, secured, headers={"content-type": pending.content_type}, timeout=30)
    if resp.status_code != 200:
        return fault_code(resp)
    c.open(resp.content, pending)
    return "ok"


def eventually(check: Callable[[], bool], timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.25)
    return check()


def log_of(gw: LiveGateway) -> str:
    return (gw.opts.run_dir / "logs" / "filter-0.log").read_text()


# --- CRLs ---------------------------------------------------------------------------------------------


def test_a_revoked_client_certificate_is_refused_from_the_crl(gw: LiveGateway) -> None:
    assert send(gw, "crl") == "ok"
    assert send(gw, "crl", "revoked") == "FailedAuthentication"
    assert "is revoked: CRL" in log_of(gw) and "key_compromise" in log_of(gw)


def test_a_revoked_client_cannot_bootstrap_a_secure_conversation(gw: LiveGateway) -> None:
    c, post = client(gw, "sc", "client")
    assert c.establish(post) is not None
    c, post = client(gw, "sc", "sc-revoked")
    with pytest.raises(ClientError, match="FailedAuthentication"):
        c.establish(post)


def test_a_crl_replaced_on_disk_is_picked_up(gw: LiveGateway, setup: Setup) -> None:
    assert send(gw, "crl", "later") == "ok"  # and now trusted, cached
    pki_mod.revoke(setup.pki, "later")  # what `wsgate certs revoke` does: a new ca.crl
    assert eventually(lambda: send(gw, "crl", "later") == "FailedAuthentication")
    assert send(gw, "crl") == "ok"


def test_a_broken_or_foreign_crl_keeps_the_last_good_one(gw: LiveGateway, setup: Setup) -> None:
    path = setup.pki / "ca.crl"
    good = path.read_bytes()
    try:
        for bad in (b"-----BEGIN X509 CRL-----\ngarbage\n-----END X509 CRL-----\n", make_crl(setup.rogue),
                    make_crl(setup.ca, last=dt.timedelta(days=-3))):  # fmt: skip
            # A forger's empty CRL, a rolled-back one, an unreadable one: revoked stays revoked.
            replace_file(path, bad)
            time.sleep(2.5)  # past the recheck interval
            assert send(gw, "crl", "revoked") == "FailedAuthentication"
            assert send(gw, "crl") == "ok"
        log = log_of(gw)
        assert "not signed by a known CA" in log and "older" in log and "keeping the last good one" in log
    finally:
        replace_file(path, good)


def test_an_expired_crl_is_not_used(gw: LiveGateway) -> None:
    assert send(gw, "expired") == "FailedAuthentication"
    assert "no revocation status" in log_of(gw) and "expired.crl expired" in log_of(gw)


def test_a_crl_past_its_next_update_stops_vouching(gw: LiveGateway, setup: Setup) -> None:
    assert send(gw, "soon") == "FailedAuthentication"
    replace_file(setup.pki / "soon.crl", make_crl(setup.ca, next=dt.timedelta(seconds=6)))
    assert eventually(lambda: send(gw, "soon") == "ok")  # a current CRL, picked up
    assert eventually(lambda: send(gw, "soon") == "FailedAuthentication", timeout=10)  # and past it


def test_a_revoked_intermediate_revokes_its_leaves(gw: LiveGateway, setup: Setup) -> None:
    assert send(gw, "chain", "chained") == "ok"  # root CRL and the intermediate's (DER) both current
    pki_mod.revoke(setup.pki, "inter", "cessationOfOperation")
    assert eventually(lambda: send(gw, "chain", "chained") == "FailedAuthentication")
    assert "'CN=WSGate Issuing CA,O=WSGate Demo'" in log_of(gw)


# --- OCSP ---------------------------------------------------------------------------------------------


def test_the_real_ocsp_responder_refuses_a_revoked_certificate(gw: LiveGateway, setup: Setup) -> None:
    assert send(gw, "ocsp") == "ok"
    assert send(gw, "ocsp", "revoked") == "FailedAuthentication"
    assert f"OCSP {setup.openssl_url}: revoked" in log_of(gw)


def test_the_responder_named_in_the_certificate_is_asked(gw: LiveGateway) -> None:
    assert send(gw, "aia", "client2") == "ok"
    assert send(gw, "aia", "revoked") == "FailedAuthentication"
    # A certificate without AIA, and no responder in the policy: nobody can tell.
    assert send(gw, "aia", "chained") == "FailedAuthentication"


def test_an_unreachable_ocsp_responder_fails_closed_by_default(gw: LiveGateway) -> None:
    assert send(gw, "dead") == "FailedAuthentication"
    assert "no revocation status: certificate 'CN=Demo Client,O=WSGate Demo'" in log_of(gw)


def test_soft_fail_accepts_and_logs_when_no_status(gw: LiveGateway) -> None:
    assert send(gw, "soft") == "ok"
    assert "accepted without revocation status (on_unknown: allow)" in log_of(gw)


def test_either_source_may_answer_and_neither_here_is_refused(gw: LiveGateway) -> None:
    assert send(gw, "both") == "FailedAuthentication"  # expired CRL, dead responder


@pytest.mark.parametrize(
    "forgery",
    [
        "signed-by-another-ca-posing-as-the-issuer",
        "delegate-without-ocsp-signing",
        "delegate-of-another-ca",
        "replayed-with-another-nonce",
        "stale-past-next-update",
    ],
)
def test_a_forged_ocsp_response_is_not_believed(gw: LiveGateway, setup: Setup, forgery: str) -> None:
    assert send(gw, "honest") == "ok"  # the same answer, honestly signed, is believed
    assert send(gw, forgery) == "FailedAuthentication"
    assert setup.forgeries[forgery].hits >= 1
    reasons = {
        "signed-by-another-ca-posing-as-the-issuer": "bad signature",
        "delegate-without-ocsp-signing": "lacks the OCSPSigning extended key usage",
        "delegate-of-another-ca": "is not certified by",
        "replayed-with-another-nonce": "nonce does not match",
        "stale-past-next-update": "stale: nextUpdate",
    }
    assert reasons[forgery] in log_of(gw)


def test_ocsp_answers_are_cached_for_their_validity(gw: LiveGateway, setup: Setup) -> None:
    for _ in range(3):
        assert send(gw, "counted") == "ok"
    assert setup.counted.hits == 1  # one answer, three messages
    time.sleep(3.2)  # past the answer's nextUpdate
    assert send(gw, "counted") == "ok"
    assert setup.counted.hits == 2


def test_the_policy_caps_how_long_an_answer_is_kept(gw: LiveGateway, setup: Setup) -> None:
    assert send(gw, "capped") == "ok"
    assert send(gw, "capped") == "ok"
    assert setup.capped.hits == 1
    time.sleep(1.2)  # max_cache_s: 1, though the answer is good for a day
    assert send(gw, "capped") == "ok"
    assert setup.capped.hits == 2


# --- policy and the demo PKI's tools ------------------------------------------------------------------


@pytest.mark.parametrize(
    "revocation, error",
    [
        ({"mode": "crl"}, "mode crl needs crl_files"),
        ({"mode": "both", "ocsp_responder": "http://ocsp.example/"}, "mode both needs crl_files"),
        ({"mode": "ocsp", "crl_files": ["ca.crl"]}, "crl_files are not read with mode ocsp"),
        ({"mode": "ocsp", "ocsp_responder": "ldap://ocsp.example/"}, "should match pattern"),
        ({"mode": "ocsp", "timeout_s": 5}, "less than or equal to 2"),  # Envoy gives the filter 3 s
        ({"mode": "ocsp", "on_unknown": "ignore"}, "'fail' or 'allow'"),
    ],
)
def test_a_revocation_policy_that_cannot_work_is_refused(pki: Path, revocation: dict, error: str) -> None:
    doc = route_doc(pki, "rsa", rsa={"revocation": revocation})
    doc["upstream"] = {"address": "127.0.0.1:1"}
    with pytest.raises(ValueError, match=error):
        Route.model_validate(doc)


def test_wsgate_certs_revoke_publishes_the_crl_and_the_openssl_index(tmp_path: Path) -> None:
    from gateway.control import cli

    out = pki_mod.init(tmp_path / "pki")
    client_cert = keys.load_certificate(out / "client.pem")
    assert not x509.load_pem_x509_crl((out / "ca.crl").read_bytes()).get_revoked_certificate_by_serial_number(
        client_cert.serial_number
    )
    run = cli.build_parser().parse_args
    assert cli.cmd_revoke(run(["certs", "revoke", "demo-client", "--out", str(out), "--reason", "keyCompromise"])) == 0
    crl = x509.load_pem_x509_crl((out / "ca.crl").read_bytes())
    assert crl.is_signature_valid(keys.load_certificate(out / "ca.pem").public_key())  # type: ignore[arg-type]
    entry = crl.get_revoked_certificate_by_serial_number(client_cert.serial_number)
    assert entry is not None and entry.extensions.get_extension_for_class(x509.CRLReason).value.reason.name == (
        "key_compromise"
    )
    rows = [r.split("\t") for r in (out / "index.txt").read_text().splitlines()]
    revoked = [r for r in rows if r[0] == "R"]
    assert len(revoked) == 1
    # As openssl writes and looks serials up: upper-case hex in whole bytes.
    serial = revoked[0][3]
    assert int(serial, 16) == client_cert.serial_number and serial == serial.upper() and len(serial) % 2 == 0
    assert revoked[0][2].endswith(",keyCompromise") and revoked[0][5] == "/O=WSGate Demo/CN=Demo Client"
    assert cli.cmd_revoke(run(["certs", "revoke", "nobody", "--out", str(out)])) == 1
    assert cli.cmd_revoke(run(["certs", "revoke", "rogue", "--out", str(out)])) == 1  # not the demo CA's


def test_certs_init_gives_a_kept_pki_what_revocation_needs(tmp_path: Path) -> None:
    out = pki_mod.init(tmp_path / "pki")
    ca = load(out, "ca")
    for name in ("index.txt", "ocsp.pem", "ocsp.key", "crlnumber"):
        (out / name).unlink()
    (out / "ca.crl").write_bytes(make_crl(ca, next=dt.timedelta(hours=12)))  # near its nextUpdate
    pki_mod.init(out)
    crl = x509.load_pem_x509_crl((out / "ca.crl").read_bytes())
    assert crl.next_update_utc and crl.next_update_utc > NOW + dt.timedelta(days=pki_mod.CRL_DAYS - 1)
    responder = keys.load_certificate(out / "ocsp.pem")
    assert (
        x509.ExtendedKeyUsageOID.OCSP_SIGNING
        in responder.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    )
    stems = {r.split("\t")[5].rsplit("=", 1)[1] for r in (out / "index.txt").read_text().splitlines()}
    assert {"Demo Client", "Demo Client Two", "WSGate Gateway Signing"} <= stems
    assert "Rogue" not in " ".join(stems)


def test_answers_in_use_are_refreshed_before_they_expire(gw: LiveGateway, setup: Setup) -> None:
    start = time.monotonic()
    assert send(gw, "ahead") == "ok"
    assert setup.ahead.hits == 1
    time.sleep(max(0.0, start + 3.2 - time.monotonic()))  # in the answer's last quarter
    assert send(gw, "ahead") == "ok"  # the cached answer; a new one is fetched beside
    assert eventually(lambda: setup.ahead.hits == 2, timeout=3)
    time.sleep(max(0.0, start + 4.5 - time.monotonic()))  # past the first answer's nextUpdate
    assert send(gw, "ahead") == "ok"
    assert setup.ahead.hits == 2  # no message waited for the responder
