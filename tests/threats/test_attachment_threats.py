"""Attachments signed and encrypted per the SwA profile 1.1, and what an attacker does to them after signing.

A real Apache WSS4J 4.0.1 (tests/interop/wss4j, its AttachmentCallbackHandler path) signs and encrypts each
request's attachments; the message travels as multipart/related bytes, is read by the gateway's MIME parser
(filters/engine/mime/package.py) and checked by the engine's Security header processing with the route's
attachment_security policy, in process (the same call the pipeline makes). Each attack is applied to the bytes
WSS4J produced: a swapped, added, reordered, re-labelled or altered attachment, an unsigned or unencrypted one
where the route requires it, a ciphertext changed in transit."""

from __future__ import annotations

import base64
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from lxml import etree

from filters.engine import faults, ns
from filters.engine.mime import package as mime
from filters.engine.pipeline import Exchange
from filters.engine.profiles import SecuredPipeline
from filters.engine.wss import attachments, wssecurity
from filters.engine.xml.threat_protection import parse_envelope
from filters.stores.factory import RouteStores
from tests.support import mime as mime_build
from tests.support.wss4j import WSU, Wss4j, encrypt_to_gateway, part, soap_ns, x509_sign
from tests.support.wss_helpers import echo, make_route

PDF = b"%PDF-1.7\n" + bytes(range(256)) * 64
PNG = b"\x89PNG\r\n\x1a\n" + bytes(reversed(range(256))) * 32
ALL = {"must_sign": ["*/*"]}


def _att(cid: str, mime_type: str, body: bytes, **extra: str) -> dict[str, Any]:
    headers = {"Content-ID": f"<{cid}>", "Content-Type": mime_type, **extra}
    return {"id": cid, "headers": headers, "body": base64.b64encode(body).decode()}


def _secure(
    wss4j: Wss4j,
    pki: Path,
    atts: list[dict[str, Any]],
    sign: str | None = "Element",
    encrypt: str | None = None,
    version: str = "1.1",
    algorithm: str = "aes256-gcm",
) -> tuple[bytes, list[dict[str, Any]]]:
    """WSS4J's request: Timestamp, the Body and (`sign`: Element = complete, Content) the attachments signed, then
    (`encrypt`) the attachments encrypted (sign-then-encrypt, as CXF's default protection order)."""
    parts = [part("Body", soap_ns(version)), part("Timestamp", WSU)]
    step = x509_sign(pki, parts)
    if sign:
        step["attachments"] = sign
    steps: list[dict[str, Any]] = [{"do": "timestamp"}, step]
    if encrypt:
        steps.append({**encrypt_to_gateway(pki, []), "attachments": encrypt, "algorithm": algorithm})
    got = wss4j.secure(echo("with documents", version), steps, attachments=atts)
    return got["xml"].encode(), got["attachments"]


def _package(xml: bytes, atts: list[dict[str, Any]], version: str = "1.1") -> tuple[str, bytes]:
    soap = "application/soap+xml" if version == "1.2" else "text/xml"
    root = mime_build.part([("Content-Type", f"{soap}; charset=utf-8"), ("Content-ID", "<root@test>")], xml)
    rest = [mime_build.part(_headers(a), base64.b64decode(a["body"])) for a in atts]
    content_type = f'multipart/related; type="{soap}"; boundary={mime_build.BOUNDARY}; start="<root@test>"'
    return content_type, mime_build.package([root, *rest])


def _headers(att: dict[str, Any]) -> list[tuple[str, str]]:
    """A part's MIME headers as CXF writes WSS4J's attachment: its headers, the Content-ID from its id and the
    Content-Type from its MIME type where WSS4J took them out (Attachment-Complete encryption moves them inside)."""
    headers = dict(att["headers"])
    headers.setdefault("Content-ID", f"<{att['id']}>")
    headers.setdefault("Content-Type", att.get("mime") or "application/octet-stream")
    return list(headers.items())


def _pipeline(pki: Path, **policy: Any) -> SecuredPipeline:
    extra = {"encryption": policy.pop("encryption")} if "encryption" in policy else {}
    route = make_route(pki, "rsa", attachment_security=policy, attachments={"accept": True}, **extra)
    return SecuredPipeline(route, RouteStores())


def _process(
    pipeline: SecuredPipeline, xml: bytes, atts: list[dict[str, Any]], version: str = "1.1"
) -> tuple[wssecurity.Verified, attachments.Attachments]:
    """What the pipeline does with a multipart request's root and attachments (parse, then the Security header)."""
    content_type, body = _package(xml, atts, version)
    package = mime.parse(content_type, body, pipeline.route.attachments)
    env = parse_envelope(bytes(package.root.body), pipeline.route.limits)
    parts = attachments.from_parts(package.attachments)
    verified = wssecurity.process(env, pipeline.requirements, pipeline.credentials, datetime.now(UTC), parts)
    return verified, parts


def _refused(pipeline: SecuredPipeline, xml: bytes, atts: list[dict[str, Any]], code: str, why: str) -> None:
    with pytest.raises(faults.Fault) as err:
        _process(pipeline, xml, atts)
    assert err.value.code == code, err.value.reason
    assert why in err.value.reason
    assert err.value.message == faults.WSSE_CODES[code]  # the client learns nothing more


# --- what must pass ------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["1.1", "1.2"])
@pytest.mark.parametrize("how", ["Element", "Content"])
def test_wss4j_signed_attachments_accepted(wss4j: Wss4j, pki: Path, how: str, version: str) -> None:
    atts = [_att("doc-1@test", "application/pdf", PDF), _att("img-2@test", "image/png", PNG)]
    xml, out = _secure(wss4j, pki, atts, sign=how, version=version)
    headers_signed = how == "Element"
    verified, parts = _process(_pipeline(pki, **ALL, headers_signed=headers_signed), xml, out, version)
    assert verified.signed_attachments == ["doc-1@test", "img-2@test"]
    assert [p.signed for p in parts] == ["complete" if headers_signed else "content"] * 2
    assert [bytes(p.body) for p in parts] == [PDF, PNG]


def test_wss4j_text_and_xml_attachments_canonicalized(wss4j: Wss4j, pki: Path) -> None:
    """text/* is signed with CRLF line ends and XML content in exclusive C14N (profile 5.4): a relay that
    rewrites LF to CRLF, or re-serializes the XML, does not break the signature."""
    text = b"line one\nline two\rline three\r\n"
    xml_doc = b'<?xml version="1.0"?><d:doc xmlns:d="urn:d"  a="1" ><d:x/></d:doc>'
    atts = [_att("t@test", "text/plain; charset=us-ascii", text), _att("x@test", "application/xml", xml_doc)]
    xml, out = _secure(wss4j, pki, atts)
    out[0]["body"] = base64.b64encode(b"line one\r\nline two\r\nline three\r\n").decode()
    out[1]["body"] = base64.b64encode(b'<d:doc xmlns:d="urn:d" a="1"><d:x></d:x></d:doc>').decode()
    verified, _ = _process(_pipeline(pki, **ALL), xml, out)
    assert verified.signed_attachments == ["t@test", "x@test"]


@pytest.mark.parametrize("how", ["Element", "Content"])
@pytest.mark.parametrize("algorithm", ["aes256-gcm", "aes128-cbc"])
def test_wss4j_encrypted_attachments_decrypted(wss4j: Wss4j, pki: Path, how: str, algorithm: str) -> None:
    atts = [_att("doc-1@test", "application/pdf", PDF, **{"Content-Description": "the contract"})]
    xml, out = _secure(wss4j, pki, atts, encrypt=how, algorithm=algorithm)
    assert base64.b64decode(out[0]["body"]) != PDF
    encryption = {"data_algorithms": ["aes256-gcm", "aes128-gcm", "aes128-cbc"]}
    pipeline = _pipeline(pki, **ALL, encrypted=True, encryption=encryption)
    verified, parts = _process(pipeline, xml, out)
    assert bytes(parts.parts[0].body) == PDF
    assert parts.parts[0].content_type == "application/pdf"
    assert parts.parts[0].header("Content-Description") == "the contract"
    assert verified.signed_attachments == ["doc-1@test"]
    written = attachments.to_package(mime.parse(*_package(xml, out), pipeline.route.attachments), parts)
    assert bytes(written.attachments[0].body) == PDF  # what the backend gets


# --- what must not --------------------------------------------------------------------------------------


def test_unsigned_attachment_refused(wss4j: Wss4j, pki: Path) -> None:
    xml, out = _secure(wss4j, pki, [_att("doc@test", "application/pdf", PDF)], sign=None)
    _refused(_pipeline(pki, **ALL), xml, out, "InvalidSecurity", "'doc@test' is not signed")


def test_unsigned_attachment_of_a_required_type_refused(wss4j: Wss4j, pki: Path) -> None:
    signed = [_att("doc@test", "application/pdf", PDF)]
    xml, out = _secure(wss4j, pki, signed)
    _process(_pipeline(pki, must_sign=["image/*"]), xml, out)  # a PDF need not be signed there, a signed one passes
    xml, out = _secure(wss4j, pki, signed)
    added = [*out, _att("img@test", "image/png", PNG)]
    _refused(_pipeline(pki, must_sign=["image/*"]), xml, added, "InvalidSecurity", "'img@test' is not signed")


def test_attachment_added_after_signing_refused(wss4j: Wss4j, pki: Path) -> None:
    xml, out = _secure(wss4j, pki, [_att("doc@test", "application/pdf", PDF)])
    added = [*out, _att("extra@test", "application/pdf", b"%PDF-1.7 smuggled")]
    _refused(_pipeline(pki, **ALL), xml, added, "InvalidSecurity", "'extra@test' is not signed")


def test_attachments_swapped_after_signing_refused(wss4j: Wss4j, pki: Path) -> None:
    atts = [_att("a@test", "application/pdf", PDF), _att("b@test", "application/pdf", PDF[::-1])]
    xml, out = _secure(wss4j, pki, atts)
    out[0]["body"], out[1]["body"] = out[1]["body"], out[0]["body"]
    _refused(_pipeline(pki, **ALL), xml, out, "FailedCheck", "digest mismatch")


def test_attachments_reordered_after_signing_refused(wss4j: Wss4j, pki: Path) -> None:
    atts = [_att("a@test", "application/pdf", PDF), _att("b@test", "image/png", PNG)]
    xml, out = _secure(wss4j, pki, atts)
    _process(_pipeline(pki, **ALL), xml, out)
    _refused(_pipeline(pki, **ALL), xml, out[::-1], "InvalidSecurity", "not in the order they were signed")


def test_attachment_content_changed_after_signing_refused(wss4j: Wss4j, pki: Path) -> None:
    xml, out = _secure(wss4j, pki, [_att("doc@test", "application/pdf", PDF)], sign="Content")
    out[0]["body"] = base64.b64encode(PDF[:-1] + b"X").decode()
    _refused(_pipeline(pki, **ALL, headers_signed=False), xml, out, "FailedCheck", "digest mismatch")


@pytest.mark.parametrize(
    "header, value",
    [
        ("Content-Type", "application/x-msdownload"),
        ("Content-Type", "APPLICATION/PDF; name=evil.exe"),
        ("Content-Disposition", "attachment; filename=evil.exe"),
    ],
)
def test_attachment_relabelled_after_signing_refused(wss4j: Wss4j, pki: Path, header: str, value: str) -> None:
    atts = [_att("doc@test", "application/pdf", PDF, **{"Content-Disposition": "attachment; filename=doc.pdf"})]
    xml, out = _secure(wss4j, pki, atts)
    out[0]["headers"] = {**out[0]["headers"], header: value}
    _refused(_pipeline(pki, **ALL), xml, out, "FailedCheck", "digest mismatch")


def test_attachment_content_id_relabelled_refused(wss4j: Wss4j, pki: Path) -> None:
    xml, out = _secure(wss4j, pki, [_att("doc@test", "application/pdf", PDF)])
    out[0] = {**out[0], "id": "other@test", "headers": {**out[0]["headers"], "Content-ID": "<other@test>"}}
    _refused(_pipeline(pki, **ALL), xml, out, "InvalidSecurity", "names no attachment")


def test_content_only_signature_refused_where_headers_must_be_signed(wss4j: Wss4j, pki: Path) -> None:
    """Attachment-Content-Signature-Transform leaves the Content-Type unsigned: a re-labelled part would pass."""
    xml, out = _secure(wss4j, pki, [_att("doc@test", "application/pdf", PDF)], sign="Content")
    _refused(_pipeline(pki, **ALL), xml, out, "InvalidSecurity", "its headers are not signed")


def test_unencrypted_attachment_refused_where_encryption_required(wss4j: Wss4j, pki: Path) -> None:
    xml, out = _secure(wss4j, pki, [_att("doc@test", "application/pdf", PDF)])
    _refused(_pipeline(pki, **ALL, encrypted=True), xml, out, "InvalidSecurity", "was not encrypted")


def test_encrypted_attachment_ciphertext_changed_refused(wss4j: Wss4j, pki: Path) -> None:
    xml, out = _secure(wss4j, pki, [_att("doc@test", "application/pdf", PDF)], encrypt="Element")
    body = bytearray(base64.b64decode(out[0]["body"]))
    body[40] ^= 1
    out[0]["body"] = base64.b64encode(bytes(body)).decode()
    _refused(_pipeline(pki, **ALL), xml, out, "FailedCheck", "GCM authentication tag mismatch")


def test_encrypted_unsigned_attachment_refused(wss4j: Wss4j, pki: Path) -> None:
    """An attacker's ciphertext under a key sent to the gateway (CVE-2015-0227 for attachments): decrypted, but
    nothing vouches for it."""
    xml, out = _secure(wss4j, pki, [_att("doc@test", "application/pdf", PDF)], sign=None, encrypt="Content")
    _refused(_pipeline(pki), xml, out, "InvalidSecurity", "decrypted attachment 'doc@test' not signed")


def test_attachment_encrypted_data_moved_into_the_body_refused(wss4j: Wss4j, pki: Path) -> None:
    """An attachment's EncryptedData belongs in the Security header: one in the Body would reach the backend."""
    xml, out = _secure(wss4j, pki, [_att("doc@test", "application/pdf", PDF)], encrypt="Element")
    root = etree.fromstring(xml)
    ed = next(e for e in root.iter(f"{{{ns.XENC}}}EncryptedData") if e.get("Type") == attachments.COMPLETE)
    root.find(f"{{{ns.SOAP11}}}Body").append(ed)
    moved = etree.tostring(root)
    _refused(_pipeline(pki, **ALL), moved, out, "InvalidSecurity", "outside the Security header")


def test_signature_reference_to_attachment_on_plain_message_refused(wss4j: Wss4j, pki: Path) -> None:
    """A cid: reference in a message that came without attachments names nothing the gateway reads."""
    xml, _ = _secure(wss4j, pki, [_att("doc@test", "application/pdf", PDF)])
    pipeline = _pipeline(pki)
    env = parse_envelope(xml, pipeline.route.limits)
    with pytest.raises(faults.Fault) as err:
        wssecurity.process(env, pipeline.requirements, pipeline.credentials, datetime.now(UTC))
    assert "is not a same-document '#id'" in err.value.reason


@pytest.mark.parametrize("href", ["cid:root@test", "cid:gone@test"])
def test_a_cid_reference_in_a_decrypted_header_is_checked_where_the_body_was_not_encrypted(
    wss4j: Wss4j, pki: Path, href: str
) -> None:
    """The pipeline reads the root's cid: references again after the Security header only where something was
    decrypted into the envelope: a header block's content counts, not only the Body's (here an attachment and one
    header block encrypted, the Body signed in the clear)."""
    body = echo("with documents").split(b"<soap:Body>")
    header = f'<soap:Header><h:Ref xmlns:h="urn:refs">{href}</h:Ref></soap:Header><soap:Body>'.encode()
    xml = header.join(body)
    parts = [part("Body", soap_ns("1.1")), part("Timestamp", WSU), part("Ref", "urn:refs")]
    step = {**x509_sign(pki, parts), "attachments": "Element"}
    encrypt = {**encrypt_to_gateway(pki, [part("Ref", "urn:refs", "Content")]), "attachments": "Element"}
    atts = [_att("doc@test", "application/pdf", PDF)]
    got = wss4j.secure(xml, [{"do": "timestamp"}, step, encrypt], attachments=atts)
    assert href not in got["xml"]  # the header's content travels encrypted
    pipeline = _pipeline(pki, **ALL, encrypted=True, encryption={"data_algorithms": ["aes256-gcm"]})
    content_type, message = _package(got["xml"].encode(), got["attachments"])
    with pytest.raises(faults.Fault) as err:
        pipeline.request(message, {"content-type": content_type}, Exchange(pipeline.route))
    assert "reference to" in err.value.reason
