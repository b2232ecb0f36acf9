"""The MIME package parser and serializer (filters/engine/mime/package.py): what parses, byte-exact output; XOP
inlined as the route says (filters/engine/mime/related.py). The refusals: tests/threats/test_mime_threats.py."""

from __future__ import annotations

import base64

import pytest
from lxml import etree

from filters.engine import faults
from filters.engine.engine import Exchange, RoutePipeline
from filters.engine.mime import package as mime
from filters.engine.mime import xop
from filters.engine.xml import xmlsupport
from gateway.policy import Attachments, Route
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
    assert mime.find(pkg, "cid:root.message@test") is None and mime.cid("cid:root.message@test") == pkg.root.content_id


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


def _route(**attachments: object) -> Route:
    return Route.model_validate({"name": "m", "match": {"path_prefix": "/m/"}, "upstream": {"address": "h:1"},
                                 "profile": "xml", "attachments": {"accept": True, **attachments}})  # fmt: skip


@pytest.mark.parametrize("version", ["1.1", "1.2"])
def test_xop_inlined_for_the_backend_and_for_the_client_as_the_route_says(version: str) -> None:
    data = bytes(range(256)) * 10
    ct, body = build.mtom({"a@test": data}, version)
    route = _route(to_backend="inline", to_client="inline")
    pipeline, ex = RoutePipeline(route), Exchange(route)
    out = pipeline.request(body, {"content-type": ct}, ex)
    assert out.body is not None and out.set_headers["content-type"] == faults.content_type(version)
    doc = etree.fromstring(out.body)
    assert base64.b64decode(doc.findtext(".//{urn:docs}Doc") or "") == data
    assert doc.find(f".//{{{build.XOP}}}Include") is None
    ex.response_type = ct  # the reply an MTOM package too: the client gets it inlined
    back = pipeline.response(body, ex)
    assert (
        back.body is not None
        and base64.b64decode(etree.fromstring(back.body).findtext(".//{urn:docs}Doc") or "") == data
    )


def test_a_base64_attachment_is_inlined_as_its_octets() -> None:
    data = b"\x00\xff" * 100
    encoded = base64.encodebytes(data).replace(b"\n", b"\r\n")  # MIME lines of 76
    ct, body = build.mtom({"a@test": encoded})
    body = body.replace(b"Content-Transfer-Encoding: binary\r\nContent-ID: <a@test>",
                        b"Content-Transfer-Encoding: base64\r\nContent-ID: <a@test>")  # fmt: skip
    route = _route(to_backend="inline")
    out = RoutePipeline(route).request(body, {"content-type": ct}, Exchange(route))
    assert (
        out.body is not None and base64.b64decode(etree.fromstring(out.body).findtext(".//{urn:docs}Doc") or "") == data
    )


def test_an_attachment_deciphered_here_is_inlined_as_its_octets_not_an_internal_error() -> None:
    """A part the SwA profile decrypted holds a bytearray (attachments.to_package), which has no `tobytes`: an
    MTOM request whose xop:Include names such a part, on a route that inlines, made a 500 of an internal error."""
    ct, body = build.mtom({"a@test": b"ciphertext"})
    pkg = mime.parse(ct, body, LIMITS)
    part = pkg.attachments[0]
    plain = bytearray(b"\x00plain\xff")
    deciphered = mime.Part(part.headers, part.content_id, part.content_type, plain)
    root = etree.fromstring(bytes(pkg.root.body))
    includes = xop.includes(root)
    assert xop.inline(includes, pkg.with_attachments((deciphered,))) == {"a@test"}
    assert base64.b64decode(root.findtext(".//{urn:docs}Doc") or "") == plain


def test_a_package_whose_root_a_secured_profile_changes_keeps_its_attachments_as_they_came() -> None:
    ct, body = build.swa({"img@test": b"\x89PNG..."})
    pkg = mime.parse(ct, body, LIMITS)
    new_root = mime.with_content(pkg.root, b"<changed/>")
    out = mime.serialize(mime.Package(new_root, pkg.attachments, pkg.start, pkg.boundary, pkg.content_type))
    assert out.endswith(
        bytes(pkg.attachments[0].raw_headers or b"") + b"\r\n\x89PNG...\r\n--" + build.BOUNDARY.encode() + b"--\r\n"
    )


def _lent(body: bytes) -> memoryview:
    """A body as the frame lends it: a read-only view of memory that is not a `bytes` object (mmap stands in for the
    frame's `Body`), so a copy into `bytes` anywhere in the parser would show as a slice of another object."""
    import mmap

    m = mmap.mmap(-1, len(body))
    m.write(body)
    return memoryview(m).toreadonly()


def test_copy_of_a_lent_body_none_attachments_are_slices_of_it_and_segments_keep_them() -> None:
    ct, body = build.mtom({"a@test": b"\x00\x01" * 5000 + b"\r\n--not-the-boundary", "b@test": b"B" * 1000})
    lent = _lent(body)
    pkg = mime.parse(ct, lent, LIMITS)
    assert all(isinstance(p.body, memoryview) and p.body.obj is lent.obj for p in pkg.parts)
    segments = mime.segments(pkg.boundary, pkg.parts)
    assert b"".join(segments) == body == mime.serialize(pkg)
    assert [s for s in segments if isinstance(s, memoryview) and s.obj is lent.obj and len(s) > 1000]


@pytest.mark.parametrize("second", ["<a@test>", "<A@TEST>"])
def test_duplicate_content_ids_in_a_lent_body_are_still_refused(second: str) -> None:
    ct, body = build.mtom({"a@test": b"one", "b@test": b"two"})
    body = body.replace(b"<b@test>", second.encode())
    with pytest.raises(faults.Fault, match="duplicate Content-ID"):
        mime.parse(ct, _lent(body), LIMITS)


@pytest.mark.parametrize("tail", [b"junk", b"\r\n--" + b"x" * 10])
def test_content_after_the_close_delimiter_of_a_lent_body_is_refused(tail: bytes) -> None:
    ct, body = build.mtom({"a@test": b"one"})
    if tail.startswith(b"\r\n--"):
        tail = b"\r\n--" + ct.split('boundary="')[1].split('"')[0].encode() + b"\r\n"
    with pytest.raises(faults.Fault, match="after the close delimiter"):
        mime.parse(ct, _lent(body + tail), LIMITS)


# The XPath that `xop.cid_urls` walks by hand (the reading every reader of a cid: URL must not get past).
_CID_XPATH = etree.XPath(
    "//@*[starts-with(translate(normalize-space(.), 'CID', 'cid'), 'cid:')]"
    " | //*[not(*)][starts-with(translate(normalize-space(.), 'CID', 'cid'), 'cid:')]"
)


@pytest.mark.parametrize(
    "body",
    [
        '<a href="cid:x@t"/>',
        '<a href=" \t\r\nCiD:x@t "/>',  # XML whitespace before, any case of "cid"
        '<a href="&#160;cid:x@t"/>',  # a no-break space is not XML whitespace: no URL to XPath either
        '<a href="xcid:x@t" b="c:d"/>',
        "<a>cid:x@t</a>",
        "<a>\n  CID:x@t\n</a>",
        "<a>ci<!-- split -->d:x@t</a>",  # a comment cannot split a URL out of sight
        "<a>c<?pi id:no?>id:x@t</a>",
        "<a><![CDATA[cid:]]>x@t</a>",
        "<a>cid:x@t<b/></a>",  # text beside an element child: not a leaf's text
        "<a><b>cid:x@t</b><c d='CID:y@t'>cid:z@t</c></a>",
        "<a><!--cid:no@t--></a>",
        # Colons before the URL's, fewer and more than _may_name_a_part reads one by one, in texts and attributes
        *(f"<t>{'0:' * n}</t><a>ci<!---->d:x@t</a>" for n in (15, 16, 17, 40)),
        *(f"<t b='{'0:' * n}'>{'0:' * n}</t><a c='{'p:' * n}cid:y@t'/>" for n in (16, 40)),
        f"<t>{'0:' * 40}</t>",
    ],
)
def test_cid_url_hidden_by_spelling_is_found_as_xpath_reads_it(body: str) -> None:
    root = etree.fromstring(f"<r xmlns:x='urn:x' x:id='cid:r@t'>{body}</r>")
    expected = sorted((v if isinstance(v, str) else "".join(v.itertext())).strip() for v in _CID_XPATH(root))
    assert sorted(xop.cid_urls(root)) == expected
    assert "cid:r@t" in expected


@pytest.mark.parametrize("strip_cdata", [True, False])
@pytest.mark.parametrize("split", ["<!---->", "<?pi?>", "<![CDATA[]]>"])
def test_cid_url_split_anywhere_is_found_as_xpath_reads_it(split: str, strip_cdata: bool) -> None:
    """Leaf texts are read one by one only where a text node starts as a URL's colon could: a URL split at any
    point (before its colon, in "cid", in the leading space) is still found."""
    url = " \r\n\tCiD:x@t "
    for at in range(len(url) + 1):
        for second in range(at, len(url) + 1):
            text = url[:at] + split + url[at:second] + split + url[second:]
            root = etree.fromstring(f"<r><a>{text}</a><b>ci</b></r>", xmlsupport.parser(strip_cdata=strip_cdata))
            assert xop.cid_urls(root) == ["CiD:x@t"], text


def test_quoted_parameter_values_are_unquoted_once() -> None:
    parsed = mime.media_type('Multipart/Related; a="x\\"y\\\\z"; B=tok; c=""; d="\\\\\\""', "message")
    assert parsed == ("multipart/related", {"a": 'x"y\\z', "b": "tok", "c": "", "d": '\\"'})
    for broken in ('a/b; c="x', 'a/b; c="x\\"', 'a/b; c="x"y"'):
        with pytest.raises(faults.Fault, match="parameters do not parse"):
            mime.media_type(broken, "message")


@pytest.mark.parametrize("href", ["cid:cid%3Aa@test", "cid:cid:a@test", "cid:a%2540test", "cid:root@test%00"])
def test_cid_url_decoded_once_names_no_other_part(href: str) -> None:
    """A URL is decoded once and its Content-ID looked up as it is: one that decodes to another URL, or to an
    id with an escape or a control character in it, names no part."""
    ct, body = build.swa({"a@test": b"A"})
    pkg = mime.parse(ct, body, LIMITS)
    root = etree.fromstring(f'<r href="{href}"/>')
    with pytest.raises(faults.Fault, match="reference to no part"):
        xop.references(root, pkg)
    assert xop.references(etree.fromstring('<r href=" CID:a%40test"/>'), pkg) == {"a@test"}


def test_new_content_keeps_the_header_block_as_received_unless_a_header_changes() -> None:
    ct, body = build.swa({"img@test": b"PNG"})
    pkg = mime.parse(ct, body, LIMITS)
    same = mime.with_content(pkg.root, b"<same/>", {"content-TYPE": pkg.root.content_type})
    assert same.raw_headers is pkg.root.raw_headers and same.body == b"<same/>" and same.media == pkg.root.media
    changed = mime.with_content(pkg.root, b"<x/>", {"Content-Type": "text/xml; charset=utf-16"})
    assert changed.raw_headers is None and changed.header("content-type") == "text/xml; charset=utf-16"
    assert changed.media.params == {"charset": "utf-16"}  # parsed from the new value, not the one parse read
    out = mime.serialize(mime.Package(changed, pkg.attachments, pkg.start, pkg.boundary, pkg.content_type))
    assert mime.parse(ct, out, LIMITS).root.content_type == "text/xml; charset=utf-16"


def test_a_package_written_anew_goes_under_a_boundary_of_its_own() -> None:
    """`rebound`: a fresh boundary each time (none the sender could know), every other parameter kept, quoted where
    it must be; the package reads back the same under it."""
    content_type, body = build.mtom({"a@test": b"\x00--" + build.BOUNDARY.encode()[:4]})
    content_type += '; x-note="a \\"quoted\\" \\\\ value"'
    pkg = mime.parse(content_type, body, LIMITS)
    (first, first_type), (second, _) = mime.rebound(pkg), mime.rebound(pkg)
    assert len({pkg.boundary, first, second}) == 3
    params = mime.media_type(first_type, "message").params
    assert params == {**mime.media_type(content_type, "message").params, "boundary": first}
    again = mime.parse(first_type, b"".join(mime.segments(first, pkg.parts)), LIMITS)
    assert [(p.content_id, bytes(p.body)) for p in again.parts] == [(p.content_id, bytes(p.body)) for p in pkg.parts]
