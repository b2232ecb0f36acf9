"""The SwA profile's pieces in process (filters/engine/wss/attachments.py): the canonical MIME headers (profile
5.4.1, as WSS4J's AttachmentUtils writes them), content forms, cid: URIs, attachment encryption both ways, the
package written back, XOP expansion. WSS4J's own outputs are checked against these through the gateway
(tests/interop/test_wss4j_swa_interop.py) and in tests/threats/test_attachment_threats.py."""

from __future__ import annotations

import hashlib
import os

import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from lxml import etree

from filters.engine import faults, ns
from filters.engine.mime import package as mime
from filters.engine.wss import attachments as swa
from gateway.policy import Attachments, AttachmentSecurity
from tests.support import mime as build

LIMITS = Attachments(accept=True)


def _canonical(*headers: tuple[str, str]) -> str:
    return swa.canonical_headers(list(headers)).decode()


def test_canonical_headers_keep_the_listed_five_in_order_with_their_canonical_names() -> None:
    got = _canonical(
        ("content-type", "application/pdf"),
        ("X-Other", "dropped"),
        ("Content-Transfer-Encoding", "binary"),
        ("CONTENT-ID", "<a@b>"),
        ("Content-Location", "doc.pdf"),
        ("Content-Description", "the contract"),
        ("Content-Disposition", "attachment"),
    )
    assert got == (
        "Content-Description:the contract\r\nContent-Disposition:attachment\r\nContent-ID:<a@b>\r\n"
        "Content-Location:doc.pdf\r\nContent-Type:application/pdf\r\n"
    )


def test_canonical_content_type_defaults_to_us_ascii_text() -> None:
    assert _canonical(("Content-ID", "<a@b>")) == 'Content-ID:<a@b>\r\nContent-Type:text/plain;charset="us-ascii"\r\n'


def test_canonical_parameters_sorted_lowercased_quoted_and_comments_removed() -> None:
    got = _canonical(("Content-Type", ' Text/Plain; Name="Doc.TXT" (a comment);CHARSET=ISO-8859-1'))
    assert got == 'Content-Type:text/plain;charset="iso-8859-1";name="Doc.TXT"\r\n'


def test_canonical_value_unfolded_and_its_leading_space_dropped() -> None:
    assert (
        _canonical(("Content-ID", " \t<a@b>\r\n (x)"))
        == 'Content-ID:<a@b> \r\nContent-Type:text/plain;charset="us-ascii"\r\n'
    )


def test_canonical_description_decodes_encoded_words() -> None:
    got = _canonical(("Content-Description", "=?utf-8?q?Gr=C3=BC=C3=9Fe?="), ("Content-Type", "text/plain"))
    assert got.startswith("Content-Description:Grüße\r\n")


@pytest.mark.parametrize(
    "headers",
    [
        [("Content-Type", "text/plain"), ("content-type", "image/png")],  # which one was signed?
        [("Content-Type", "text/plain; title*=us-ascii'en'x")],  # RFC 2231: refused, not guessed
        [("Content-Type", "text/plain; title*0=a; title*1=b")],
        [("Content-Type", "text/plain; noequals")],
    ],
)
def test_header_spellings_that_cannot_be_canonicalized_one_way_are_refused(headers: list[tuple[str, str]]) -> None:
    with pytest.raises(faults.Fault):
        swa.canonical_headers(headers)


def _part(mime_type: str, body: bytes, cid: str = "a@b") -> swa.Attachment:
    return swa.Attachment(cid, [("Content-ID", f"<{cid}>"), ("Content-Type", mime_type)], body)


def test_text_line_ends_are_crlf_across_chunk_boundaries() -> None:
    """A CR at the end of one chunk and its LF at the start of the next are one line end, not two."""
    body = b"a" * (swa.CHUNK - 1) + b"\r\nb\nc\rd"
    got = swa.digest(_part("text/plain", body), swa.CONTENT_SIGNATURE, "sha256")
    assert got == hashlib.sha256(b"a" * (swa.CHUNK - 1) + b"\r\nb\r\nc\r\nd").digest()


def test_binary_content_is_digested_as_it_travels() -> None:
    body = os.urandom(3 * swa.CHUNK + 5)
    assert swa.digest(_part("image/png", body), swa.CONTENT_SIGNATURE, "sha256") == hashlib.sha256(body).digest()


def test_complete_digest_covers_the_canonical_headers_then_the_content() -> None:
    part = _part("application/octet-stream", b"data")
    head = b"Content-ID:<a@b>\r\nContent-Type:application/octet-stream\r\n"
    assert swa.digest(part, swa.COMPLETE_SIGNATURE, "sha1") == hashlib.sha1(head + b"data").digest()


def test_xml_content_digested_in_exclusive_c14n() -> None:
    a = swa.digest(_part("application/soap+xml", b'<a  x="1" ><b/></a>'), swa.CONTENT_SIGNATURE, "sha256")
    assert a == hashlib.sha256(b'<a x="1"><b></b></a>').digest()


def test_xml_attachment_with_a_dtd_entity_refused() -> None:
    body = b'<!DOCTYPE a [<!ENTITY e SYSTEM "file:///etc/passwd">]><a>&e;</a>'
    with pytest.raises(faults.Fault):
        swa.digest(_part("text/xml", body), swa.CONTENT_SIGNATURE, "sha256")


@pytest.mark.parametrize(
    "uri, cid", [("cid:a@b", "a@b"), ("cid:a%40b", "a@b"), ("cid:%E2%82%AC@x", "€@x")]
)  # fmt: skip
def test_cid_uris_are_percent_decoded(uri: str, cid: str) -> None:
    assert swa.content_id(uri) == cid
    assert swa.content_id(swa.cid_uri(cid)) == cid
    assert swa.cid_uri(cid) == ("cid:%E2%82%AC@x" if cid == "€@x" else "cid:a@b")  # escaped where RFC 2392 says


@pytest.mark.parametrize("uri", ["#a", "http://x/a", "cid:a%4", "cid:%ff%fe"])
def test_malformed_or_foreign_attachment_uris_refused(uri: str) -> None:
    with pytest.raises(faults.Fault):
        swa.content_id(uri)


def test_two_parts_with_one_content_id_refused() -> None:
    with pytest.raises(faults.Fault):
        swa.Attachments([_part("a/b", b"1"), _part("a/b", b"2")])


@pytest.mark.parametrize("size", [0, 1000, swa.CHUNK, 2 * swa.CHUNK + 7])  # GCM: one call up to CHUNK, then streamed
@pytest.mark.parametrize("complete", [True, False])
@pytest.mark.parametrize("algorithm", ["aes256-gcm", "aes128-gcm", "aes256-cbc", "aes128-cbc"])
def test_attachment_encryption_round_trip(size: int, complete: bool, algorithm: str) -> None:
    body = os.urandom(size)
    key = os.urandom(32 if algorithm.startswith("aes256") else 16)
    part = swa.Attachment("a@b", [("Content-ID", "<a@b>"), ("Content-Type", "application/pdf"),
                                  ("Content-Disposition", "attachment; filename=x.pdf")], body)  # fmt: skip
    ed = swa.encrypt(part, key, algorithm, complete, "ED-1")
    assert part.content_type == "application/octet-stream" and bytes(part.body[16:]) != body
    assert (part.header("Content-Disposition") is None) == complete  # Attachment-Complete moves it inside
    parts = swa.Attachments([part])
    swa.decrypt(ed, key, [algorithm], parts)
    assert bytes(part.body) == body and part.content_type == "application/pdf"
    assert part.header("Content-Disposition") == "attachment; filename=x.pdf"


@pytest.mark.parametrize("last", [0, 17, 255])
def test_attachment_cbc_padding_out_of_range_refused(last: int) -> None:
    """A CBC plaintext whose last byte is no pad length (1..16) is one FailedCheck, like XML Encryption's."""
    key, iv = os.urandom(32), os.urandom(16)
    encryptor = Cipher(algorithms.AES(key), modes.CBC(iv)).encryptor()
    cipher = iv + encryptor.update(os.urandom(2 * swa.CHUNK + 15) + bytes([last])) + encryptor.finalize()
    part = swa.Attachment("a@b", [("Content-ID", "<a@b>"), ("Content-Type", "application/pdf")], b"x")
    ed = swa.encrypt(part, key, "aes256-cbc", False, "ED-1")
    part.body = bytearray(cipher)
    with pytest.raises(faults.Fault) as err:
        swa.decrypt(ed, key, ["aes256-cbc"], swa.Attachments([part]))
    assert err.value.code == "FailedCheck" and "padding" in err.value.reason


@pytest.mark.parametrize("where", [0, swa.CHUNK, -1])
def test_attachment_gcm_ciphertext_or_tag_changed_refused(where: int) -> None:
    """One bit changed anywhere (IV, content, tag): the tag check fails and no plaintext becomes the body."""
    key, body = os.urandom(32), os.urandom(2 * swa.CHUNK)
    part = swa.Attachment("a@b", [("Content-ID", "<a@b>"), ("Content-Type", "application/pdf")], body)
    ed = swa.encrypt(part, key, "aes256-gcm", False, "ED-1")
    part.body[where] ^= 1
    sent = bytes(part.body)
    with pytest.raises(faults.Fault) as err:
        swa.decrypt(ed, key, ["aes256-gcm"], swa.Attachments([part]))
    assert err.value.code == "FailedCheck" and bytes(part.body) == sent and not part.decrypted


def test_cbc_attachment_the_oracle_rules_refuse_stays_undecrypted() -> None:
    """The caller's CBC rules (wssecurity._check_cbc, given the algorithm read once) refuse before a byte is
    decrypted: no padding or parse error can answer for a ciphertext they turned away."""
    part = swa.Attachment("a@b", [("Content-ID", "<a@b>"), ("Content-Type", "application/pdf")], os.urandom(100))
    ed = swa.encrypt(part, os.urandom(32), "aes256-cbc", True, "ED-1")
    sent, seen = bytes(part.body), []

    def refuse(algorithm: str) -> None:
        seen.append(algorithm)
        raise faults.security("FailedCheck", "CBC key reused")

    with pytest.raises(faults.Fault) as err:  # another key: decrypted first, its padding or headers would fail
        swa.decrypt(ed, os.urandom(32), ["aes256-cbc"], swa.Attachments([part]), refuse)
    assert err.value.reason == "CBC key reused" and seen == ["aes256-cbc"]
    assert bytes(part.body) == sent and not part.decrypted


def _sealed(plain: bytes) -> tuple[etree._Element, swa.Attachments, bytes]:
    """An Attachment-Complete EncryptedData over exactly `plain` (headers and content as given)."""
    key = os.urandom(32)
    part = swa.Attachment("a@b", [("Content-ID", "<a@b>"), ("Content-Type", "application/octet-stream")], plain)
    ed = swa.encrypt(part, key, "aes256-gcm", False, "ED-1")
    ed.set("Type", swa.COMPLETE)
    return ed, swa.Attachments([part]), key


@pytest.mark.parametrize(
    "plain",
    [
        b"X-Injected: 1\r\n\r\ncontent",  # a header the profile does not encrypt
        b"Content-Type: a/b\r\nContent-Type: c/d\r\n\r\ncontent",  # twice
        b"Content-ID: <other@b>\r\n\r\ncontent",  # another part's identity
        b"Content-Type: a/b\r\ncontent without a blank line",
    ],
)
def test_attachment_complete_plaintext_headers_checked(plain: bytes) -> None:
    ed, parts, key = _sealed(plain)
    with pytest.raises(faults.Fault) as err:
        swa.decrypt(ed, key, ["aes256-gcm"], parts)
    assert err.value.code == "FailedCheck"  # one failure for every decryption problem (oracles)


def test_attachment_ciphertext_algorithm_checked_before_decryption() -> None:
    ed, parts, key = _sealed(b"\r\ncontent")
    with pytest.raises(faults.Fault) as err:
        swa.decrypt(ed, key, ["aes128-gcm"], parts)
    assert err.value.code == "UnsupportedAlgorithm"


def test_cipher_reference_must_carry_the_one_ciphertext_transform() -> None:
    ed, parts, key = _sealed(b"\r\ncontent")
    ed.find(f".//{{{ns.DS}}}Transform").set("Algorithm", "http://www.w3.org/2000/09/xmldsig#base64")
    with pytest.raises(faults.Fault):
        swa.decrypt(ed, key, ["aes256-gcm"], parts)


@pytest.mark.parametrize("boundary", ["b", "short_b_15bytes", build.BOUNDARY])
def test_a_plaintext_holding_the_received_boundary_stays_one_part(boundary: str) -> None:
    """A decrypted plaintext is its sender's choice, who knew the boundary: the package written anew goes under a
    boundary of the gateway's own (`mime.rebound`), so the part stays one part, binary, byte for byte."""
    content_type = f'multipart/related; type="text/xml"; boundary={boundary}; start="<root@test>"'
    root = build.part([("Content-Type", "text/xml"), ("Content-ID", "<root@test>")], build.envelope(""))
    att = build.part([("Content-Type", "image/png"), ("Content-ID", "<a@test>")], b"x")
    package = mime.parse(content_type, build.package([root, att], boundary), LIMITS)
    parts = swa.from_parts(package.attachments)
    body = os.urandom(1000) + f"\r\n--{boundary}\r\nContent-ID: <b@test>\r\n\r\n".encode() + os.urandom(1000)
    parts.parts[0].body, parts.parts[0].changed = bytearray(body), True
    boundary, written_type = mime.rebound(package)
    again = mime.parse(written_type, b"".join(mime.segments(boundary, swa.to_package(package, parts).parts)), LIMITS)
    assert [p.content_id for p in again.attachments] == ["a@test"]
    assert again.attachments[0].transfer_encoding == "binary" and bytes(again.attachments[0].body) == body
    # Under the received boundary the same bytes would not even parse (the strict reader's refusal).
    with pytest.raises(faults.Fault):
        mime.parse(content_type, mime.serialize(swa.to_package(package, parts)), LIMITS)


def test_xop_expanded_for_the_security_header_then_restored() -> None:
    content_type, body = build.mtom({"a@test": b"\x00\x01binary"})
    package = mime.parse(content_type, body, LIMITS)
    root = etree.fromstring(bytes(package.root.body))
    includes = root.findall(f".//{{{build.XOP}}}Include")
    expanded = swa.expand_xop(includes, package.attachments)
    assert root.findtext(".//{urn:docs}Doc") == "AAFiaW5hcnk="
    again, gone = swa.restore_xop(expanded, root)
    assert [i.get("href") for i in again] == ["cid:a@test"] and gone == set()


def test_policy_media_ranges() -> None:
    policy = AttachmentSecurity(must_sign=["image/*", "application/pdf"])
    assert policy.must_sign_type("IMAGE/PNG; name=x") and policy.must_sign_type("application/pdf")
    assert not policy.must_sign_type("application/octet-stream")
    assert AttachmentSecurity(must_sign=["*/*"]).must_sign_type("x/y")
    with pytest.raises(ValueError):
        AttachmentSecurity(must_sign=["pdf"])
