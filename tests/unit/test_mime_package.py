"""The MIME package parser and serializer (filters/engine/mime/package.py): what parses, byte-exact output."""

from __future__ import annotations

from filters.engine.mime import package as mime
from gateway.policy import Attachments
from tests.support import mime as build

LIMITS = Attachments(accept=True)


def test_mtom_package_parses_into_root_and_attachments() -> None:
    ct, body = build.mtom({"a@test": b"\x00\x01binary\r\n--not-the-boundary", "b@test": b"B" * 1000})
    pkg = mime.parse(ct, body, LIMITS)
    assert pkg.root.content_id == "root.message@test" and pkg.start == "root.message@test"
    assert [p.content_id for p in pkg.attachments] == ["a@test", "b@test"]
    assert bytes(pkg.attachments[0].body) == b"\x00\x01binary\r\n--not-the-boundary"
    assert isinstance(pkg.attachments[1].body, memoryview)  # a slice of the body, not a copy
    assert mime.find(pkg, "cid:b%40test") is pkg.attachments[1]
    assert mime.find(pkg, "cid:root.message@test") is None and mime.names_root(pkg, "cid:root.message@test")


def test_serialize_is_byte_exact_for_untouched_parts() -> None:
    ct, body = build.mtom({"a@test": b"x" * 10}, version="1.2")
    pkg = mime.parse(ct, body, LIMITS)
    assert mime.serialize(pkg) == body
    changed = mime.with_content(pkg.root, b"<new/>", {"content-type": "text/xml"})
    out = mime.serialize(mime.Package(changed, pkg.attachments, pkg.start, pkg.boundary, pkg.content_type))
    again = mime.parse(ct.replace('"application/xop+xml"', '"text/xml"', 1), out, LIMITS)
    assert bytes(again.root.body) == b"<new/>" and again.root.content_type == "text/xml"
    assert again.attachments[0].raw_headers == pkg.attachments[0].raw_headers


def test_root_is_the_first_part_without_start() -> None:
    ct, body = build.swa({"img@test": b"PNG"})
    pkg = mime.parse(ct.replace('; start="<root@test>"', ""), body, LIMITS)
    assert pkg.start is None and pkg.root.content_id == "root@test"
