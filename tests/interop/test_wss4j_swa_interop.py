"""SOAP with Attachments secured per the SwA profile 1.1, between a real Apache WSS4J 4.0.1 (its
AttachmentCallbackHandler path: tests/interop/wss4j Attachments.java) and the running gateway, both ways.

WSS4J signs (Attachment-Complete or -Content signature transform) and encrypts (Attachment-Complete or
-Content-Only) a request's attachments; the gateway verifies and decrypts them and the demo backend, which answers
a package with the same package, gets them in the clear. The gateway signs and encrypts the reply's attachments,
and WSS4J's WSSecurityEngine (BSP on) verifies and decrypts them. SOAP 1.1 and 1.2."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterator
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
def wss4j() -> Iterator[Wss4j]:
    harness = Wss4j()
    yield harness
    harness.close()


@pytest.fixture(scope="module")
def gw(module_gateway: GatewayFactory, pki: Path) -> LiveGateway:
    routes = [
        route_doc(pki, "rsa", name="swa", attachments=ACCEPT, attachment_security=ENCRYPTED,
                  encryption={"require_request": True, "encrypt_response": True}),
        route_doc(pki, "rsa", name="swa-content", attachments=ACCEPT, attachment_security=SIGNED_CONTENT),
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
    # What the backend got (in the clear: the document base64 transfer-encoded, as its plaintext holds the
    # delimiter) and echoed, encrypted again by the gateway and decrypted by WSS4J.
    assert _bodies(verified["attachments"]) == _plain(HOLDS_BOUNDARY)
    (received,) = gw.received()
    assert "Content-Transfer-Encoding: base64" in received["body"] and NOTE.decode() in received["body"]


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
