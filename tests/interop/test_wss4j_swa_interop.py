"""SOAP with Attachments secured per the SwA profile 1.1, between a real Apache WSS4J 4.0.1 (its
AttachmentCallbackHandler path: tests/interop/wss4j Attachments.java) and the running gateway, both ways.

WSS4J signs (Attachment-Complete or -Content signature transform) and encrypts (Attachment-Complete or
-Content-Only) a request's attachments; the gateway verifies and decrypts them and the demo backend, which answers
a package with the same package, gets them in the clear. The gateway signs and encrypts the reply's attachments,
and WSS4J's WSSecurityEngine (BSP on) verifies and decrypts them. SOAP 1.1 and 1.2."""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path
from typing import Any

import pytest
import requests

from filters.engine.mime import package as mime
from gateway.policy import Attachments
from tests.support import mime as build
from tests.support.harness import GatewayFactory, LiveGateway
from tests.support.wss4j import WSU, Wss4j, encrypt_to_gateway, part, soap_ns, x509_sign
from tests.support.wss_helpers import echo, route_doc

DOC = b"%PDF-1.7\n" + bytes(range(256)) * 512
# Encrypted, a document may hold the package's delimiter; decrypted, the gateway must not let it end the part.
HOLDS_BOUNDARY = DOC + b"\r\n--MIMEBoundary_6b1f\r\n"
NOTE = b"first line\nsecond line\n"
ACCEPT = {"accept": True, "max_part_bytes": 1024 * 1024}
ENCRYPTED = {"must_sign": ["*/*"], "encrypted": True, "sign_response": True, "encrypt_response": True}
SIGNED_CONTENT = {"must_sign": ["*/*"], "headers_signed": False, "sign_response": True}


@pytest.fixture(scope="module")
def gw(module_gateway: GatewayFactory, pki: Path) -> LiveGateway:
    routes = [
        route_doc(pki, "rsa", name="swa", attachments=ACCEPT, attachment_security=ENCRYPTED,
                  encryption={"require_request": True, "encrypt_response": True}),
        route_doc(pki, "rsa", name="swa-content", attachments=ACCEPT, attachment_security=SIGNED_CONTENT),
        route_doc(pki, "rsa", name="mtom", attachments=ACCEPT),
    ]  # fmt: skip
    return module_gateway(routes, workers=1)


def _attachments(doc: bytes = DOC) -> list[dict[str, Any]]:
    return [
        {"id": "doc@wss4j", "headers": {"Content-ID": "<doc@wss4j>", "Content-Type": "application/pdf",
                                        "Content-Disposition": "attachment; filename=contract.pdf"},
         "body": base64.b64encode(doc).decode()},
        {"id": "note@wss4j", "headers": {"Content-ID": "<note@wss4j>", "Content-Type": "text/plain; charset=utf-8"},
         "body": base64.b64encode(NOTE).decode()},
    ]  # fmt: skip


def _request(version: str) -> bytes:
    """An SwA request whose Body names its parts (swaRef style), as an application would."""
    return echo('<d:doc href="cid:doc@wss4j"/><d:note href="cid:note@wss4j"/>', version)


def _headers(att: dict[str, Any]) -> list[tuple[str, str]]:
    """The part's headers as CXF writes a WSS4J attachment (its id and MIME type where WSS4J moved them inside)."""
    headers = dict(att["headers"])
    headers.setdefault("Content-ID", f"<{att['id']}>")
    headers.setdefault("Content-Type", att.get("mime") or "application/octet-stream")
    return list(headers.items())


def _post(gw: LiveGateway, route: str, xml: bytes, atts: list[dict[str, Any]], version: str) -> requests.Response:
    soap = "application/soap+xml" if version == "1.2" else "text/xml"
    root = build.part([("Content-Type", f"{soap}; charset=utf-8"), ("Content-ID", "<root@wss4j>")], xml)
    parts = [build.part(_headers(a), base64.b64decode(a["body"])) for a in atts]
    content_type = f'multipart/related; type="{soap}"; boundary={build.BOUNDARY}; start="<root@wss4j>"'
    return gw.post(route, build.package([root, *parts]), headers={"content-type": content_type}, timeout=60)


def _wss4j_view(reply: mime.Package) -> list[dict[str, Any]]:
    return [{"id": p.content_id, "headers": dict(p.headers), "body": base64.b64encode(bytes(p.body)).decode()}
            for p in reply.attachments]  # fmt: skip


def _verify(wss4j: Wss4j, pki: Path, resp: requests.Response) -> dict[str, Any]:
    """WSS4J's WSSecurityEngine (BSP on) over the gateway's reply package: the demo CA trusted, the client's key
    decrypts; its attachments as WSS4J left them (decrypted)."""
    assert resp.status_code == 200, resp.text[:500]
    reply = mime.parse(resp.headers["content-type"], resp.content, Attachments(**ACCEPT))
    return wss4j.verify(bytes(reply.root.body), trust=[str(pki / "ca.pem")], key=str(pki / "client.key"),
                        cert=str(pki / "client.pem"), bsp=True, attachments=_wss4j_view(reply))  # fmt: skip


def _bodies(atts: list[dict[str, Any]]) -> dict[str, str]:
    return {a["id"]: hashlib.sha256(base64.b64decode(a["body"])).hexdigest() for a in atts}


def _plain(doc: bytes = DOC) -> dict[str, str]:
    return {"doc@wss4j": hashlib.sha256(doc).hexdigest(), "note@wss4j": hashlib.sha256(NOTE).hexdigest()}


@pytest.mark.parametrize("version", ["1.1", "1.2"])
@pytest.mark.parametrize("encrypt", ["Element", "Content"])
def test_wss4j_signed_and_encrypted_attachments_both_ways(
    gw: LiveGateway, pki: Path, wss4j: Wss4j, encrypt: str, version: str
) -> None:
    """Request: WSS4J signs Body, Timestamp and attachments (complete), then encrypts the attachments (`encrypt`:
    Element = Attachment-Complete, Content = Attachment-Content-Only) and the Body. Reply: the gateway signs and
    encrypts the attachments the backend sent back; WSS4J verifies and decrypts them."""
    sign = {**x509_sign(pki, [part("Body", soap_ns(version)), part("Timestamp", WSU)]), "attachments": "Element"}
    enc = {**encrypt_to_gateway(pki, [part("Body", soap_ns(version), "Content")]), "attachments": encrypt}
    atts = _attachments(HOLDS_BOUNDARY)
    secured = wss4j.secure(_request(version), [{"do": "timestamp"}, sign, enc], attachments=atts)
    assert _bodies(secured["attachments"]) != _plain(HOLDS_BOUNDARY)  # encrypted on the wire
    gw.clear()
    resp = _post(gw, "swa", secured["xml"].encode(), secured["attachments"], version)
    verified = _verify(wss4j, pki, resp)
    assert {"cid:doc@wss4j", "cid:note@wss4j"} <= set(verified["signed"]), verified["signed"]
    # What the backend got (in the clear, binary: its plaintext holds the received delimiter, which delimits
    # nothing under the boundary the gateway wrote it with) and echoed, encrypted again, decrypted by WSS4J.
    assert _bodies(verified["attachments"]) == _plain(HOLDS_BOUNDARY)
    (received,) = gw.received()
    boundary = mime.media_type(received["headers"]["content-type"], "message").params["boundary"]
    assert boundary != build.BOUNDARY and f"\r\n--{build.BOUNDARY}\r\n" in received["body"]
    assert received["body"].count(f"--{boundary}\r\n") == 3 and NOTE.decode() in received["body"]
    assert "Content-Transfer-Encoding: base64" not in received["body"]


@pytest.mark.parametrize("version", ["1.1", "1.2"])
def test_wss4j_content_signed_attachments_both_ways(gw: LiveGateway, pki: Path, wss4j: Wss4j, version: str) -> None:
    """Attachment-Content-Signature-Transform on the request (a route that does not require the headers signed);
    the reply's attachments come back signed with the complete transform, which WSS4J verifies."""
    sign = {**x509_sign(pki, [part("Body", soap_ns(version)), part("Timestamp", WSU)]), "attachments": "Content"}
    secured = wss4j.secure(_request(version), [{"do": "timestamp"}, sign], attachments=_attachments())
    resp = _post(gw, "swa-content", secured["xml"].encode(), secured["attachments"], version)
    verified = _verify(wss4j, pki, resp)
    assert {"cid:doc@wss4j", "cid:note@wss4j"} <= set(verified["signed"]), verified["signed"]
    assert _bodies(verified["attachments"]) == _plain()


# ---------------------------------------------------------------------------------------------------------
# MTOM: signatures over the XOP infoset, ciphertext in an attachment


def _mtom_post(gw: LiveGateway, route: str, xml: bytes, atts: list[dict[str, Any]], version: str) -> requests.Response:
    soap = "application/soap+xml" if version == "1.2" else "text/xml"
    root = build.part([("Content-Type", f'application/xop+xml; charset=UTF-8; type="{soap}"'),
                       ("Content-ID", "<root.message@test>")], xml)  # fmt: skip
    parts = [build.part(_headers(a), base64.b64decode(a["body"])) for a in atts]
    content_type = (f'multipart/related; type="application/xop+xml"; boundary={build.BOUNDARY}; '
                    f'start="<root.message@test>"; start-info="{soap}"')  # fmt: skip
    return gw.post(route, build.package([root, *parts]), headers={"content-type": content_type}, timeout=60)


@pytest.mark.parametrize("version", ["1.1", "1.2"])
def test_wss4j_signed_mtom_verified_over_the_infoset_and_reply_kept_mtom(
    gw: LiveGateway, pki: Path, wss4j: Wss4j, version: str
) -> None:
    """WSS4J signs the Body with the document inline (base64), then the sender optimizes it into an xop:Include and
    an attachment (MTOM serializes after WS-Security). The gateway verifies the signature over the infoset, the
    backend gets MTOM (the route keeps it), and the reply, signed over its infoset, stays MTOM for WSS4J, which
    verifies it with its XOP expansion."""
    inline = base64.b64encode(DOC).decode()
    sign = x509_sign(pki, [part("Body", soap_ns(version)), part("Timestamp", WSU)])
    secured = wss4j.secure(echo(inline, version), [{"do": "timestamp"}, sign])["xml"]
    assert secured.count(inline) == 1
    include = f'<xop:Include xmlns:xop="{build.XOP}" href="cid:doc@mtom"/>'
    optimized = secured.replace(inline, include).encode()
    doc = {"id": "doc@mtom", "headers": {"Content-Type": "application/pdf"}, "body": inline}
    gw.clear()
    resp = _mtom_post(gw, "mtom", optimized, [doc], version)
    assert resp.status_code == 200, resp.text[:500]
    (received,) = gw.received()
    assert received["headers"]["content-type"].startswith('multipart/related; type="application/xop+xml"')
    assert "cid:doc@mtom" in received["body"] and inline not in received["body"]  # MTOM kept, not inlined
    reply = mime.parse(resp.headers["content-type"], resp.content, Attachments(**ACCEPT))
    assert b"cid:doc@mtom" in bytes(reply.root.body) and bytes(reply.attachments[0].body) == DOC
    verified = wss4j.verify(bytes(reply.root.body), trust=[str(pki / "ca.pem")], key=str(pki / "client.key"),
                            cert=str(pki / "client.pem"), bsp=True, attachments=_wss4j_view(reply),
                            expand_xop=True)  # fmt: skip
    assert f"{{{soap_ns(version)}}}Body" in verified["signed"]


@pytest.mark.parametrize("version", ["1.1", "1.2"])
def test_wss4j_ciphertext_in_an_attachment_decrypted(gw: LiveGateway, pki: Path, wss4j: Wss4j, version: str) -> None:
    """WSS4J's storeBytesInAttachment: the Body's CipherValue travels as an xop:Include of an attachment holding the
    raw ciphertext. The gateway decrypts it like an inline one; the consumed attachment does not reach the backend."""
    text = f"sealed-mtom-{version}"
    sign = x509_sign(pki, [part("Body", soap_ns(version)), part("Timestamp", WSU)])
    enc = {**encrypt_to_gateway(pki, [part("Body", soap_ns(version), "Content")]), "store_bytes_in_attachment": True}
    secured = wss4j.secure(echo(text, version), [{"do": "timestamp"}, sign, enc], attachments=[])
    assert text not in secured["xml"] and "xop:Include" in secured["xml"] and secured["attachments"]
    gw.clear()
    resp = _mtom_post(gw, "mtom", secured["xml"].encode(), secured["attachments"], version)
    assert resp.status_code == 200, resp.text[:500]
    (received,) = gw.received()
    assert text in received["body"] and "xop:Include" not in received["body"]
    assert not any(f"<{a['id']}>" in received["body"] for a in secured["attachments"])
