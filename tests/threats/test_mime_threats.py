"""MIME threats (issue 21): a multipart/related message that two readers could split, label or resolve
differently, or that costs more than its route allows, is refused with a SOAP fault and never reaches the backend.
In process, every variant; through the running gateway, a representative set (tests/e2e/test_attachments_e2e.py
for what passes)."""

from __future__ import annotations

import email.parser
import email.policy
from pathlib import Path

import pytest

from filters.engine import faults
from filters.engine.engine import Exchange, RoutePipeline, build_pipeline
from filters.engine.mime import package as mime
from filters.engine.pipeline import Outcome
from filters.stores.factory import RouteStores
from gateway.policy import Route
from gateway.tools.client import Client, ClientConfig
from tests.support import mime as build
from tests.support.wss_helpers import echo, route_doc

XOP = build.XOP
B = build.BOUNDARY
OCTETS = bytes(range(256)) * 4


def _route(**attachments: object) -> Route:
    return Route.model_validate({
        "name": "mtom", "match": {"path_prefix": "/mtom/"}, "upstream": {"address": "127.0.0.1:1"}, "profile": "xml",
        "attachments": {"accept": True, **attachments},
    })  # fmt: skip


def _request(content_type: str, body: bytes, **attachments: object) -> Outcome:
    return RoutePipeline(_route(**attachments)).request(body, {"content-type": content_type}, Exchange(_route()))


def _refused(content_type: str, body: bytes, **attachments: object) -> str:
    with pytest.raises(faults.Fault) as caught:
        _request(content_type, body, **attachments)
    fault = caught.value
    assert fault.sender and faults.metric_reason(fault) == "mime", fault.reason
    return fault.reason


def _xop_part(root: bytes, ct: str = 'application/xop+xml; charset=UTF-8; type="text/xml"') -> bytes:
    return build.part([("Content-Type", ct), ("Content-ID", "<root.message@test>")], root)


def _att(cid: str = "a@test", body: bytes = OCTETS, ct: str = "application/octet-stream", **more: str) -> bytes:
    headers = [("Content-Type", ct), ("Content-ID", f"<{cid}>"), *((k.replace("_", "-"), v) for k, v in more.items())]
    return build.part(headers, body)


MTOM_TYPE = (
    f'multipart/related; type="application/xop+xml"; boundary="{B}"; start="<root.message@test>"; start-info="text/xml"'
)


def _mtom(*parts: bytes, cids: tuple[str, ...] = ("a@test",), content_type: str = MTOM_TYPE) -> tuple[str, bytes]:
    root = _xop_part(build.mtom_envelope(list(cids)))
    return content_type, build.package([root, *parts])


def test_a_well_formed_mtom_request_passes_untouched() -> None:
    # The reference for every refusal below: the same message without its one bent detail.
    out = _request(*_mtom(_att()))
    assert out.body is None and out.set_headers["content-type"] == MTOM_TYPE


# --- limits ------------------------------------------------------------------------------------------------------


def test_too_many_parts_are_refused() -> None:
    cids = tuple(f"p{i}@test" for i in range(8))
    assert "more than 8 parts" in _refused(*_mtom(*(_att(c) for c in cids), cids=cids))
    _request(*_mtom(*(_att(c) for c in cids[:7]), cids=cids[:7]))  # 8 with the root: within


def test_part_headers_over_their_size_are_refused() -> None:
    reason = _refused(*_mtom(_att(x_padding="p" * 3000)))
    assert "longer than 2048 bytes" in reason


def test_a_boundary_longer_than_allowed_is_refused() -> None:
    for boundary, limit in (("b" * 71, 70), ("b" * 41, 40)):
        ct, body = build.mtom({"a@test": OCTETS}, boundary=boundary)
        assert "boundary" in _refused(ct, body, max_boundary_length=limit)


def test_an_attachment_over_its_size_is_refused() -> None:
    assert "part larger than 1000" in _refused(*_mtom(_att(body=b"x" * 1001)), max_part_bytes=1000)


def test_a_nested_multipart_is_refused() -> None:
    for ct in ('multipart/mixed; boundary="inner"', "Multipart/Related; boundary=x", "message/rfc822"):
        assert "nested" in _refused(*_mtom(_att(ct=ct)))


# --- Content-IDs and cid: references -------------------------------------------------------------------------------


def test_duplicate_content_ids_are_refused() -> None:
    assert "duplicate Content-ID" in _refused(*_mtom(_att(), _att()))
    assert "duplicate Content-ID" in _refused(*_mtom(_att(), _att("A@TEST")))  # a reader that ignores case
    root = build.part([("Content-Type", 'application/xop+xml; type="text/xml"'), ("Content-ID", "<a@test>")],
                      build.mtom_envelope(["a@test"]))  # fmt: skip
    assert "duplicate Content-ID" in _refused(MTOM_TYPE.replace("root.message@test", "a@test"),
                                              build.package([root, _att()]))  # fmt: skip


def test_an_attachment_without_a_content_id_is_refused() -> None:
    part = build.part([("Content-Type", "application/octet-stream")], OCTETS)
    assert "without a Content-ID" in _refused(*_mtom(_att(), part))
    assert "malformed Content-ID" in _refused(*_mtom(_att("a b@test")))


@pytest.mark.parametrize("href", ["cid:missing@test", "cid:a%40other", "cid:a@test%00", "cid:%61@test.x"])
def test_a_cid_reference_to_a_missing_part_is_refused(href: str) -> None:
    root = _xop_part(build.envelope(f'<d:Doc xmlns:d="urn:d"><xop:Include xmlns:xop="{XOP}" href="{href}"/></d:Doc>'))
    assert "naming no attachment" in _refused(MTOM_TYPE, build.package([root, _att()]))
    # The same URL where a signature or a swaRef names an attachment, beside a good xop:Include.
    for named in (f'<d:R xmlns:d="urn:d" URI="{href}"/>', f'<d:R xmlns:d="urn:d"> {href}\n</d:R>'):
        doc = f'<d:Doc xmlns:d="urn:d"><xop:Include xmlns:xop="{XOP}" href="cid:a@test"/></d:Doc>{named}'
        assert "reference to no part" in _refused(MTOM_TYPE, build.package([_xop_part(build.envelope(doc)), _att()]))


@pytest.mark.parametrize("href", ["cid:root.message@test", "CID:root.message%40test", "cid:root%2Emessage@test"])
def test_a_cid_reference_to_the_root_part_is_refused(href: str) -> None:
    doc = f'<d:Doc xmlns:d="urn:d" href="{href}"><xop:Include xmlns:xop="{XOP}" href="cid:a@test"/></d:Doc>'
    assert "reference to the root" in _refused(MTOM_TYPE, build.package([_xop_part(build.envelope(doc)), _att()]))


@pytest.mark.parametrize(
    "named",
    [
        '<d:R xmlns:d="urn:d">ci<!-- split -->d:missing@test</d:R>',  # a reader joins the text nodes
        '<d:R xmlns:d="urn:d"><![CDATA[cid:missing@test]]></d:R>',
        '<d:R xmlns:d="urn:d" href="  cid:missing@test"/>',  # a reader trims the attribute
        '<d:R xmlns:d="urn:d" href="CiD:missing@test"/>',
    ],
)
def test_a_cid_reference_in_another_spelling_is_still_checked(named: str) -> None:
    doc = f'<d:Doc xmlns:d="urn:d"><xop:Include xmlns:xop="{XOP}" href="cid:a@test"/></d:Doc>{named}'
    assert "reference to no part" in _refused(MTOM_TYPE, build.package([_xop_part(build.envelope(doc)), _att()]))


_SPLIT_URLS = [
    "cid&#58;missing@test",  # the colon a character reference
    "ci&#x64;:missing@test",  # the letter before it one
    "CI&#68;&#x3A;missing@test",
    "cid<!---->:missing@test",  # markup between the letter and the colon
    "cid<![CDATA[:missing@test]]>",
    "<![CDATA[cid]]>:missing@test",
]


@pytest.mark.parametrize(
    "doc",
    [f'<R xmlns="urn:r">{url}</R>' for url in _SPLIT_URLS]
    + [f'<R xmlns="urn:r" href="{url}"/>' for url in _SPLIT_URLS if "<" not in url],
)
def test_a_cid_reference_spelled_without_cid_colon_bytes_is_still_checked(doc: str) -> None:
    """A URL whose "cid:" is nowhere in the root's bytes as such (a character reference, text split by markup)
    names a part all the same: checked like any other."""
    root = build.envelope(doc)
    assert b"cid:" not in root.lower()
    ct, body = build.swa({"a@test": OCTETS}, root=root)
    assert "reference to no part" in _refused(ct, body, unreferenced="forward")


def test_a_part_named_by_content_location_is_refused() -> None:
    assert "Content-Location" in _refused(*_mtom(_att(Content_Location="doc.pdf")))


@pytest.mark.parametrize("packaging", ["swa", "mtom"])
def test_a_cid_reference_hidden_in_encrypted_content_is_checked_once_decrypted(pki: Path, packaging: str) -> None:
    doc = route_doc(pki, "rsa", attachments={"accept": True, "unreferenced": "forward"},
                    encryption={"require_request": True})  # fmt: skip
    route = Route.model_validate({**doc, "upstream": {"address": "127.0.0.1:1"}})
    pipeline = build_pipeline(route, RouteStores())
    client = Client(route, ClientConfig(certs=pki))
    package, root_id = (build.swa, "root@test") if packaging == "swa" else (build.mtom, "root.message@test")
    for href, reason in ((f"cid:{root_id}", "reference to the root"), ("cid:gone@test", "reference to no part")):
        secured, _ = client.secure(echo(f"<d:R href='{href}'/>"))
        assert href.encode() not in secured  # the Body travels encrypted
        ct, body = package({"a@test": OCTETS}, root=secured)
        with pytest.raises(faults.Fault) as caught:
            pipeline.request(body, {"content-type": ct}, Exchange(route))
        assert reason in caught.value.reason


def _lenient_parts(content_type: str, body: bytes) -> list[str | None]:
    """The Content-IDs of the parts Python's email package finds (a lenient reader: a delimiter after a bare LF)."""
    msg = email.parser.BytesParser(policy=email.policy.compat32).parsebytes(
        f"Content-Type: {content_type}\r\n\r\n".encode() + body
    )
    return [p["Content-ID"] for p in msg.get_payload()]


@pytest.mark.parametrize("spelling", [b"&#45;&#45;", b"&#x2D;-", b"-&#45;"])
def test_the_received_boundary_spelled_in_character_references_adds_no_part_downstream(
    pki: Path, spelling: bytes
) -> None:
    """The strict parser sees no delimiter in `&#45;&#45;boundary`; a secured profile re-serializes the root, and
    lxml writes the characters back. Under the received boundary a lenient backend would read parts the gateway
    never checked: a package the gateway writes anew goes under a boundary of its own."""
    doc = route_doc(pki, "rsa", attachments={"accept": True, "unreferenced": "forward"})
    route = Route.model_validate({**doc, "upstream": {"address": "127.0.0.1:1"}})
    smuggled = f"&#10;--{B}&#10;Content-Type: text/plain&#10;Content-ID: evil@test&#10;&#10;UNCHECKED&#10;"
    secured, _ = Client(route, ClientConfig(certs=pki)).secure(echo(f"<d:note>{smuggled}--{B}--&#10;</d:note>"))
    # The client writes the signed text's dashes and line ends as references: the same infoset, the same digest.
    root = secured.replace(f"--{B}".encode(), spelling + B.encode()).replace(b"\n", b"&#10;")
    ct, body = build.swa({"a@test": OCTETS}, root=root)
    out = build_pipeline(route, RouteStores()).request(body, {"content-type": ct}, Exchange(route))
    assert out.body is not None and not isinstance(out.body, bytes)
    forwarded, forwarded_type = b"".join(out.body), out.set_headers["content-type"]
    assert f"\n--{B}\n".encode() in forwarded  # written back as characters: under B, a delimiter
    boundary = mime.media_type(forwarded_type, "message").params["boundary"]
    assert boundary != B
    assert len(mime.parse(forwarded_type, forwarded, route.attachments).attachments) == 1
    assert _lenient_parts(forwarded_type, forwarded) == ["<root@test>", "<a@test>"]
    # The same bytes under the received boundary: a part the gateway never saw, where the attachment was.
    assert _lenient_parts(ct, forwarded.replace(f"--{boundary}".encode(), f"--{B}".encode())) == [
        "<root@test>",
        "evil@test",
    ]


def test_unreferenced_attachments_are_refused_stripped_or_forwarded_as_the_route_says() -> None:
    ct, body = _mtom(_att(), _att("extra@test", b"smuggled"))
    assert "no cid: reference names" in _refused(ct, body)
    stripped = _request(ct, body, unreferenced="strip")
    assert stripped.body is not None and b"smuggled" not in stripped.body and OCTETS in stripped.body
    assert _request(ct, body, unreferenced="forward").body is None


# --- transfer encodings and charsets -------------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", ["quoted-printable", "x-uuencode", "base-64", "binary, base64"])
def test_transfer_encodings_other_than_binary_8bit_base64_are_refused(encoding: str) -> None:
    assert "transfer encoding" in _refused(*_mtom(_att(Content_Transfer_Encoding=encoding)))


def test_a_root_part_in_a_transfer_encoding_is_refused() -> None:
    root = build.part([("Content-Type", 'application/xop+xml; type="text/xml"'), ("Content-ID", "<root.message@test>"),
                       ("Content-Transfer-Encoding", "base64")], b"PHM6RW52ZWxvcGUvPg==")  # fmt: skip
    assert "root part transfer encoding" in _refused(MTOM_TYPE, build.package([root, _att()]))


@pytest.mark.parametrize(
    ("label", "root"),
    [
        ("utf-7", build.mtom_envelope(["a@test"])),
        ("iso-8859-1", build.mtom_envelope(["a@test"])),
        ("utf-16", build.mtom_envelope(["a@test"])),  # labelled UTF-16, the bytes are UTF-8
        ("utf-8", build.mtom_envelope(["a@test"]).decode().encode("utf-16")),  # and the reverse
    ],
)
def test_a_root_part_whose_charset_label_is_not_its_encoding_is_refused(label: str, root: bytes) -> None:
    part = _xop_part(root, f'application/xop+xml; charset={label}; type="text/xml"')
    reason = _refused(MTOM_TYPE, build.package([part, _att()]))
    assert "root part charset" in reason or "root part labelled" in reason


def test_a_charset_on_the_multipart_itself_is_refused() -> None:
    assert "charset" in _refused(*_mtom(_att(), content_type=MTOM_TYPE + "; charset=utf-16"))


# --- splitting the package -----------------------------------------------------------------------------------------


def test_the_boundary_inside_content_is_refused() -> None:
    # A reader that takes "--boundary" anywhere (not only after CRLF) would find a part the gateway did not.
    assert "boundary string inside content" in _refused(*_mtom(_att(body=b"data--" + B.encode() + b"\r\nmore")))
    assert "boundary string inside content" in _refused(*_mtom(_att(body=b"x\r\n--" + B.encode() + b"X\r\n")))


@pytest.mark.parametrize("across", [0, 1, 9, len(B) + 1, len(B) + 2])
def test_the_boundary_inside_content_across_the_search_window_edge_is_refused(across: int) -> None:
    # The delimiter search reads the body in windows (mime/package.py): a boundary string split between two must
    # be found as surely as one inside a window, in content and as a real delimiter.
    dash = b"--" + B.encode()
    _, probe = _mtom(_att(body=b"@" * 10))
    content_at = probe.index(b"@" * 10)
    # The search for the attachment's end starts right after its opening delimiter; its first window ends here.
    edge = probe.index(dash, probe.index(dash) + 1) + len(dash) + mime._SEARCH_WINDOW
    at = edge - len(dash) + across  # where the boundary string starts: `across` bytes of it past the edge
    body = b"x" * (at - content_at) + dash + b"X\r\nmore"
    assert _mtom(_att(body=body))[1].index(dash, content_at) == at
    assert "boundary string inside content" in _refused(*_mtom(_att(body=body)))
    delimiter_at = at - 2  # the real delimiter's CRLF and dashes straddle the edge
    out = _request(*_mtom(_att(body=b"y" * (delimiter_at - content_at))))
    assert out.body is None


def test_delimiters_with_bare_lf_are_refused() -> None:
    ct, body = _mtom(_att())
    assert "boundary" in _refused(ct, body.replace(b"\r\n--" + B.encode(), b"\n--" + B.encode()))
    for bent in (b"Content-ID: <a@test>\n", b"Content-ID: <a@test>\r"):
        assert "bare CR or LF" in _refused(ct, body.replace(b"Content-ID: <a@test>\r\n", bent + b"X-A: 1\r\n"))
    assert "unterminated" in _refused(ct, body.replace(b"Content-ID: <a@test>\r\n", b"Content-ID: <a@test>\n"))


def test_transport_padding_and_text_around_the_package_are_refused() -> None:
    ct, body = _mtom(_att())
    dash = b"--" + B.encode()
    assert "followed by other than CRLF" in _refused(ct, body.replace(dash + b"\r\n", dash + b" \r\n", 1))
    assert "does not start with the boundary" in _refused(ct, b"preamble text\r\n" + body)
    assert "after the close delimiter" in _refused(ct, body + b"epilogue")
    assert "no close delimiter" in _refused(ct, body[: body.rindex(dash)])
    _request(ct, b"\r\n" + body + b"\r\n")  # blank lines around it: as senders write them


def test_folded_repeated_and_non_ascii_part_headers_are_refused() -> None:
    assert "folded" in _refused(*_mtom(_att(X_Note="a\r\n b")))
    assert "repeated" in _refused(*_mtom(_att(content_type="text/plain")))
    assert "non-ASCII" in _refused(*_mtom(_att(X_Note="caf\u00e9".encode().decode("latin-1"))))


def test_ambiguous_content_type_parameters_are_refused() -> None:
    twice = MTOM_TYPE + '; boundary="other"'
    assert "repeats parameter boundary" in _refused(*_mtom(_att(), content_type=twice))
    assert "do not parse" in _refused(*_mtom(_att(), content_type=MTOM_TYPE + ", text/xml"))


def test_a_root_whose_type_does_not_match_the_message_is_refused() -> None:
    ct, body = _mtom(_att())
    assert "the type parameter says" in _refused(ct.replace('type="application/xop+xml"', 'type="text/xml"'), body)
    assert "start-info" in _refused(ct.replace('start-info="text/xml"', 'start-info="application/soap+xml"'), body)
    assert "not a SOAP or XOP type" in _refused(ct.replace('type="application/xop+xml"', 'type="text/html"'), body)
    soap12 = build.mtom({"a@test": OCTETS}, version="1.2")[1].replace(
        b'type="application/soap+xml"', b'type="text/xml"'
    )
    assert "declared SOAP 1.1" in _refused(ct, soap12)


def test_a_start_naming_no_part_is_refused() -> None:
    assert "start parameter names no part" in _refused(
        *_mtom(_att(), content_type=MTOM_TYPE.replace("root.message", "x"))
    )


# --- XOP -----------------------------------------------------------------------------------------------------------


def test_an_xop_include_outside_an_xop_package_is_refused() -> None:
    ct, body = build.swa({"a@test": OCTETS})
    body = body.replace(
        b'<d:Doc href="cid:a@test"/>', f'<d:Doc><xop:Include xmlns:xop="{XOP}" href="cid:a@test"/></d:Doc>'.encode()
    )
    assert "outside an XOP package" in _refused(ct, body)


@pytest.mark.parametrize(
    "doc",
    [
        f'<d:Doc xmlns:d="urn:d">AAAA<xop:Include xmlns:xop="{XOP}" href="cid:a@test"/></d:Doc>',
        f'<d:Doc xmlns:d="urn:d"><xop:Include xmlns:xop="{XOP}" href="cid:a@test"/><d:x/></d:Doc>',
        f'<d:Doc xmlns:d="urn:d"><xop:Include xmlns:xop="{XOP}" href="cid:a@test">AAAA</xop:Include></d:Doc>',
    ],
)
def test_an_xop_include_beside_other_content_is_refused(doc: str) -> None:
    assert "xop:Include" in _refused(MTOM_TYPE, build.package([_xop_part(build.envelope(doc)), _att()]))


def test_a_multipart_message_on_a_route_that_takes_none_is_refused() -> None:
    route = Route.model_validate(
        {"name": "x", "match": {"path_prefix": "/"}, "upstream": {"address": "h:1"}, "profile": "xml"}
    )
    ct, body = _mtom(_att())
    with pytest.raises(faults.Fault, match="takes no attachments"):
        RoutePipeline(route).request(body, {"content-type": ct}, Exchange(route))


def test_a_backend_reply_that_bends_mime_is_refused_as_the_backends_fault() -> None:
    route = _route()
    ex = Exchange(route)
    ex.response_type = MTOM_TYPE
    _, body = _mtom(_att(), _att())  # a duplicate Content-ID
    with pytest.raises(faults.Fault) as caught:
        RoutePipeline(route).response(body, ex)
    assert caught.value.http_status == 502 and not caught.value.sender
    assert caught.value.reason.startswith("backend response refused: mime: duplicate Content-ID")
