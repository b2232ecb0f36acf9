"""multipart/related through the running gateway (real Envoy, filter workers, the demo backend, which answers a
package with the same package): MTOM and SwA requests and replies pass with their attachments byte for byte on
`xml` and `rsa` routes, SOAP 1.1 and 1.2; a route may have XOP inlined for its backend; a representative set of
MIME threats is refused before the backend (every variant: tests/threats/test_mime_threats.py)."""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import requests
from lxml import etree

from filters.engine.mime import package as mime
from gateway.policy import Attachments
from tests.support import mime as build
from tests.support.harness import GatewayFactory, LiveGateway, fault_code
from tests.support.wss_helpers import DEMO, echo, route_doc

ATTACHMENT = bytes(range(256)) * 4096 + b"\r\n--" + b"not the boundary\r\n"  # 1 MiB of every byte value
ACCEPT = {"accept": True, "max_part_bytes": 2 * 1024 * 1024}
LIMITS = Attachments(**ACCEPT)


def _xml(name: str, **attachments: object) -> dict:
    return {"name": name, "match": {"path_prefix": f"/{name}/"}, "upstream": {"address": "BACKEND"},
            "profile": "xml", "attachments": {**ACCEPT, **attachments}}  # fmt: skip


@pytest.fixture(scope="module")
def gw(module_gateway: GatewayFactory, pki: Path) -> LiveGateway:
    routes = [
        _xml("mtom"),
        _xml("inline", to_backend="inline"),
        {**_xml("action"), "match": {"path_prefix": "/action/", "soap_action": "urn:upload"}},
        {"name": "plain", "match": {"path_prefix": "/plain/"}, "upstream": {"address": "BACKEND"}, "profile": "xml"},
        route_doc(pki, "rsa", name="rsa", attachments=ACCEPT),
        route_doc(pki, "rsa", name="rsa-inline", attachments={**ACCEPT, "to_client": "inline"}),
    ]
    return module_gateway(routes, workers=1)


def _post(gw: LiveGateway, route: str, content_type: str, body: bytes) -> requests.Response:
    return gw.post(route, body, headers={"content-type": content_type}, timeout=60)


def _parts(version: str) -> tuple[mime.Part, ...]:
    """The attachments an MTOM request of `version` travels with (what the client signs the infoset of)."""
    return mime.parse(*build.mtom({"a@test": ATTACHMENT}, version, root=_echo_xop(version)), LIMITS).attachments


def _echo_xop(version: str, cid: str = "a@test") -> bytes:
    return echo(f'<xop:Include xmlns:xop="{build.XOP}" href="cid:{cid}"/>', version)


@pytest.mark.parametrize("version", ["1.1", "1.2"])
def test_mtom_and_swa_pass_byte_for_byte_both_ways_on_an_xml_route(gw: LiveGateway, version: str) -> None:
    for content_type, body in (build.mtom({"a@test": ATTACHMENT}, version, root=_echo_xop(version)),
                               build.swa({"a@test": ATTACHMENT}, version, root=echo("cid:a@test", version))):  # fmt: skip
        gw.clear()
        r = _post(gw, "mtom", content_type, body)
        assert r.status_code == 200, r.text[:300]
        (got,) = gw.received()
        assert got["sha256"] == hashlib.sha256(body).hexdigest() and got["headers"]["content-type"] == content_type
        # The backend's reply (its root an echoResponse, the attachment sent back), through the gateway untouched.
        reply = mime.parse(r.headers["content-type"], r.content, LIMITS)
        assert r.headers["content-type"] == content_type and b"echoResponse" in bytes(reply.root.body)
        assert bytes(reply.attachments[0].body) == ATTACHMENT


def test_a_soap12_mtom_request_reaches_the_route_its_action_names(gw: LiveGateway) -> None:
    # Metro and CXF write the SOAP 1.2 action into start-info, itself a quoted string: action=\"...\"
    content_type, body = build.mtom({"a@test": b"x"}, "1.2", root=_echo_xop("1.2"))
    content_type = content_type.replace('start-info="application/soap+xml"',
                                        'start-info="application/soap+xml; action=\\"urn:upload\\""')  # fmt: skip
    r = _post(gw, "/action/demo", content_type, body)
    assert r.status_code == 200 and gw.received()[-1]["path"] == "/action/demo", r.text[:300]


def test_xop_is_inlined_for_a_backend_that_wants_plain_soap(gw: LiveGateway) -> None:
    content_type, body = build.mtom({"a@test": ATTACHMENT}, "1.2", root=_echo_xop("1.2"))
    r = _post(gw, "inline", content_type, body)
    assert r.status_code == 200, r.text[:300]
    got = gw.received()[-1]
    assert got["headers"]["content-type"].startswith("application/soap+xml; charset=utf-8")
    reply = etree.fromstring(r.content)  # the backend answered plain SOAP: the client gets it as it came
    assert base64.b64decode(reply.findtext(f".//{{{DEMO}}}text")) == ATTACHMENT


@pytest.mark.parametrize("version", ["1.1", "1.2"])
def test_mtom_on_an_rsa_route_verified_and_attachments_intact(gw: LiveGateway, version: str) -> None:
    client = gw.client("rsa")
    secured, pending = client.secure(_echo_xop(version), _parts(version))  # signed over the XOP infoset
    content_type, body = build.mtom({"a@test": ATTACHMENT}, version, root=secured)
    gw.clear()
    r = _post(gw, "rsa", content_type, body)
    assert r.status_code == 200, r.text[:300]
    (got,) = gw.received()
    assert got["length"] < len(body)  # the Security header is gone from the root part
    assert got["headers"]["x-wsgate-subject"]
    # The package written anew goes under a boundary of the gateway's own, every other parameter as sent.
    sent, forwarded = (mime.media_type(t, "message") for t in (content_type, got["headers"]["content-type"]))
    assert forwarded.params.pop("boundary") != sent.params.pop("boundary") and forwarded == sent
    reply = mime.parse(r.headers["content-type"], r.content, LIMITS)
    assert bytes(mime.find(reply, "cid:a@test").body) == ATTACHMENT  # type: ignore[union-attr]
    assert build.XOP.encode() in bytes(reply.root.body)  # MTOM kept
    env = client.open(bytes(reply.root.body), pending, reply.attachments)  # signed by the gateway over the infoset
    assert base64.b64decode(env.body.findtext(f".//{{{DEMO}}}text") or "") == ATTACHMENT


def test_an_mtom_reply_inlined_for_the_client_is_signed_as_inlined(gw: LiveGateway) -> None:
    client = gw.client("rsa-inline")
    secured, pending = client.secure(_echo_xop("1.1"), _parts("1.1"))
    r = _post(gw, "rsa-inline", *build.mtom({"a@test": ATTACHMENT}, root=secured))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/xml"), r.text[:300]
    env = client.open(r.content, pending)  # the signature covers the base64 the client got
    assert base64.b64decode(env.body.findtext(f".//{{{DEMO}}}text") or "") == ATTACHMENT


def test_wsgate_client_sends_mtom_and_swa_and_saves_the_replys_attachments(gw: LiveGateway, tmp_path: Path) -> None:
    doc = tmp_path / "scan.pdf"
    doc.write_bytes(ATTACHMENT)
    for reference, expected in ((f'<xop:Include xmlns:xop="{build.XOP}" href="cid:scan.pdf"/>', "application/xop+xml"),
                                ("cid:scan.pdf", "text/xml")):  # fmt: skip
        request = tmp_path / "request.xml"
        request.write_bytes(echo(reference))
        out = tmp_path / f"out-{expected.split('/')[1]}"
        out.mkdir()
        gw.clear()
        cmd = [sys.executable, "-m", "gateway.control.cli", "client", "--policies", str(gw.opts.policies),
               "--policy", "rsa", "--url", gw.url("rsa"), "--certs", str(gw.pki), "--attach", f"{doc}:application/pdf",
               "--attachments-out", str(out), str(request)]  # fmt: skip
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        assert "<d:echoResponse" in run.stdout and "# reply attachment <scan.pdf> application/pdf" in run.stderr
        assert (out / "scan.pdf").read_bytes() == ATTACHMENT
        (got,) = gw.received()
        assert f'type="{expected}"' in got["headers"]["content-type"]


def test_a_multipart_message_on_a_route_that_takes_none_is_refused(gw: LiveGateway) -> None:
    gw.clear()
    r = _post(gw, "plain", *build.mtom({"a@test": b"x"}))
    assert r.status_code == 500 and fault_code(r) == "Client" and gw.received() == []


@pytest.mark.parametrize(
    "bend",
    [
        pytest.param(lambda b: b.replace(b"<b@test>", b"<a@test>"), id="duplicate Content-ID"),
        pytest.param(lambda b: b.replace(b"cid:b@test", b"cid:c@test"), id="cid to a missing part"),
        pytest.param(lambda b: b.replace(b"cid:b@test", b"cid:root.message@test"), id="cid to the root"),
        pytest.param(lambda b: b.replace(b"BBBB", b"BB--" + build.BOUNDARY.encode() + b"BB"), id="boundary in content"),
        pytest.param(lambda b: b.replace(b"application/octet-stream", b"multipart/mixed; boundary=x", 1), id="nested"),
        pytest.param(lambda b: b.replace(b"Transfer-Encoding: binary\r\nContent-ID: <b",
                                         b"Transfer-Encoding: quoted-printable\r\nContent-ID: <b"), id="encoding"),
        pytest.param(lambda b: b.replace(b"charset=UTF-8", b"charset=UTF-16"), id="charset label"),
    ],
)  # fmt: skip
def test_mime_threats_are_refused_before_the_backend(gw: LiveGateway, bend) -> None:  # type: ignore[no-untyped-def]
    content_type, body = build.mtom({"a@test": b"AAAA", "b@test": b"BBBB"}, "1.2")
    assert bend(body) != body
    gw.clear()
    r = _post(gw, "mtom", content_type, bend(body))
    assert r.status_code == 500 and b"<env:Value>env:Sender</env:Value>" in r.content, r.text[:300]
    assert r.headers["content-type"].startswith("application/soap+xml") and gw.received() == []
