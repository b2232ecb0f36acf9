"""Threat protection's two parses (whole with XPath checks, incremental with early abort) refuse alike."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from lxml import etree

from filters.engine import faults, ns
from filters.engine.xml import threat_protection
from filters.engine.xml.soap import Envelope
from filters.engine.xml.threat_protection import parse_envelope
from tests.support.harness import envelope


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 1_000_000
    max_depth: int = 20
    max_elements: int = 500
    max_attributes: int = 5
    max_text_length: int = 100_000
    max_namespace_declarations: int = 8
    max_namespaces_in_scope: int = 12


LIMITS = Limits()
DEEP = "<a>" * 18 + "</a>" * 18  # with Envelope and Body: depth 20, the limit
CASES = {
    "plain": (envelope("<a>hi</a>"), None),
    "soap 1.2 with header": (envelope("<a/>", "1.2", header_xml="<h:x xmlns:h='urn:h'/>"), None),
    "at depth limit": (envelope(DEEP), None),
    "over depth limit": (envelope("<b>" + DEEP + "</b>"), "nesting depth over 20"),
    "at attribute limit": (envelope('<a b="1" c="2" d="3" e="4" f="5"/>'), None),
    "over attribute limit": (envelope('<a b="1" c="2" d="3" e="4" f="5" g="6"/>'), "attribute count over 5"),
    "namespace declarations are not attributes": (
        envelope('<a xmlns:p="urn:1" xmlns:q="urn:2" xmlns:r="urn:3" xmlns:s="urn:4" xmlns:t="urn:5" b="1"/>'),
        None,
    ),
    "pi in body": (envelope("<?evil thing?><a/>"), "processing instruction in message"),
    "pi before envelope": (b"<?evil thing?>" + envelope("<a/>"), "processing instruction in message"),
    "pi after envelope": (envelope("<a/>") + b"<?evil thing?>", "processing instruction in message"),
    "xml declaration is no pi": (b'<?xml version="1.0" encoding="utf-8"?>' + envelope("<a/>"), None),
    "comment": (envelope("<!-- note --><a/>"), None),
    "cdata": (envelope("<a><![CDATA[<not an element>]]></a>"), None),
    "malformed": (b"<soap:Envelope xmlns:soap='http://schemas.xmlsoap.org/soap/envelope/'><soap:Body>", "malformed"),
    "not soap": (b"<hello/>", "document element is not a SOAP Envelope"),
    "two bodies": (envelope("<a/>").replace(b"</soap:Envelope>", b"<soap:Body/></soap:Envelope>"), "Body elements"),
    "body below": (envelope("<a><soap:Body/></a>"), "a Body element appears below the envelope"),
    "undefined entity": (envelope("<a>&nope;</a>"), "malformed"),
    "character references": (envelope("<a>&#60;&lt;&#x41;</a>"), None),
}


def _outcome(parse, data: bytes) -> str | None:
    try:
        parse(data, LIMITS)
    except faults.Fault as fault:
        return fault.reason
    return None


@pytest.mark.parametrize("case", sorted(CASES))
def test_both_parses_agree(case: str) -> None:
    data, refused = CASES[case]
    whole = _outcome(threat_protection._parse_whole, data)
    incremental = _outcome(threat_protection._parse_incremental, data)
    if refused is None:
        assert whole is None and incremental is None
    else:
        assert whole is not None and refused in whole
        assert incremental is not None and refused in incremental


def test_whole_parse_only_where_the_bytes_bound_the_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(threat_protection, "_parse_whole", lambda d, lim: calls.append("whole") or SimpleNamespace())
    monkeypatch.setattr(
        threat_protection, "_parse_incremental", lambda d, lim, **kw: calls.append("incremental") or SimpleNamespace()
    )
    parse_envelope(envelope("<a/>" * 10), LIMITS)
    parse_envelope(envelope("<a/>" * 600), LIMITS)  # could be over max_elements: counted as it parses
    parse_envelope(envelope("<a>" + "x" * 100_001 + "</a>"), LIMITS)  # a text node could be over the limit
    assert calls == ["whole", "incremental", "incremental"]


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ("<a/>" * 600, "element count over 500"),
        ("<a>" + "x" * 100_001 + "</a>", "text node longer than 100000"),
        ("<a>" + "x" * 60_000 + "<![CDATA[" + "y" * 60_000 + "]]></a>", "text node longer than 100000"),
    ],
)
def test_limits_the_bytes_cannot_rule_out_are_counted(body: str, reason: str) -> None:
    with pytest.raises(faults.Fault) as got:
        parse_envelope(envelope(body), LIMITS)
    assert reason in got.value.reason


def _declarations(n: int, start: int = 0) -> str:
    return "".join(f' xmlns:p{i}="urn:n{i}"' for i in range(start, start + n))


BIG = 100_001  # over LIMITS.max_text_length
NAMESPACES_AND_VALUES = {
    "namespace declarations at the per-element limit": (envelope(f"<a{_declarations(8)}/>"), None),
    "namespace flood on one element": (envelope(f"<a{_declarations(9)}/>"), "namespace declarations on one element"),
    "namespace flood on the envelope": (
        envelope("<a/>").replace(b"<soap:Envelope", f"<soap:Envelope{_declarations(9)}".encode()),
        "namespace declarations on one element",
    ),
    "namespaces in scope over the limit, a few per level": (
        envelope(f"<a{_declarations(4)}><b{_declarations(4, 4)}><c{_declarations(4, 8)}/></b></a>"),
        "namespace declarations in scope over 12",
    ),
    "the same prefix redeclared at every level": (
        envelope("".join(f'<a xmlns:p="urn:{i}">' for i in range(12)) + "</a>" * 12),
        "namespace declarations in scope over 12",
    ),
    "namespaces of siblings are not in each other's scope": (
        envelope("".join(f"<a{_declarations(8)}/>" for _ in range(3))),
        None,
    ),
    "attribute value over the text limit": (envelope(f'<a b="{"x" * BIG}"/>'), "attribute value longer than"),
    "attribute value on the envelope": (
        envelope("<a/>").replace(b"<soap:Envelope", f'<soap:Envelope b="{"x" * BIG}"'.encode()),
        "attribute value longer than",
    ),
    "attribute value on a header block": (
        envelope("<a/>", header_xml=f'<h:x xmlns:h="urn:h" h:v="{"x" * BIG}"/>'),
        "attribute value longer than",
    ),
    "many large attribute values, each under the limit": (
        envelope(f'<a b="{"x" * 40_000}" c="{"y" * 40_000}" d="{"z" * 40_000}"/>'),
        None,
    ),
    "namespace name over the text limit": (envelope(f'<a xmlns:p="urn:{"x" * BIG}"/>'), "namespace name longer than"),
    "default namespace name over the text limit": (envelope(f'<a xmlns="urn:{"x" * BIG}"/>'), "longer than"),
    "comment over the text limit": (envelope(f"<a><!--{'x' * BIG}--></a>"), "longer than"),
    "text after a comment over the text limit": (envelope(f"<a><!--c-->{'x' * BIG}</a>"), "text node longer than"),
    "text between elements over the text limit": (envelope(f"<a><b/>{'x' * BIG}<c/></a>"), "text node longer than"),
}


@pytest.mark.parametrize("case", sorted(NAMESPACES_AND_VALUES))
def test_namespace_floods_and_long_values_are_refused_by_both_parses(case: str) -> None:
    data, refused = NAMESPACES_AND_VALUES[case]
    got = _outcome(parse_envelope, data)
    if refused is None:
        assert got is None
        assert _outcome(threat_protection._parse_whole, data) is None
    else:
        assert got is not None and refused in got
    # The incremental parse checks each limit itself; the whole parse only runs where the bytes rule them out.
    incremental = _outcome(threat_protection._parse_incremental, data)
    assert incremental == got


def test_an_eight_megabyte_attribute_is_refused_under_the_default_limits() -> None:
    from gateway.policy import Limits as PolicyLimits

    with pytest.raises(faults.Fault) as got:
        parse_envelope(envelope(f'<a b="{"x" * 8 * 1024 * 1024}"/>'), PolicyLimits())
    assert "attribute value longer than" in got.value.reason


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        ("\ufeff".encode("utf-32") + envelope("<a/>").decode().encode("utf-32-le"), "UTF-32"),
        (envelope("<a/>").decode().encode("utf-32-be"), "unsupported encoding"),
        (b'<?xml version="1.0" encoding="ISO-8859-1"?>' + envelope("<a/>"), "names encoding"),
        (b'<?xml version="1.0" encoding="UTF-16"?>' + envelope("<a/>"), "names encoding"),
        (b"\xff\xfe" + '<?xml version="1.0" encoding="UTF-8"?>'.encode("utf-16-le"), "names encoding"),
        (b'<?xml version="1.0" encoding="UTF-8" junk?>' + envelope("<a/>"), "malformed XML declaration"),
        (b"\xff\xfe" + b"<\x00\x00\xd8", "not utf-16"),  # a lone surrogate
    ],
)
def test_encodings_other_than_utf8_and_utf16_are_refused(data: bytes, reason: str) -> None:
    with pytest.raises(faults.Fault) as got:
        parse_envelope(data, LIMITS)
    assert reason in got.value.reason


@pytest.mark.parametrize(
    ("data", "encoding"),
    [
        (envelope("<a>\u00e9</a>"), "utf-8"),
        (b"\xef\xbb\xbf" + envelope("<a>\u00e9</a>"), "utf-8"),
        (b"\xff\xfe" + envelope("<a>\u00e9</a>").decode().encode("utf-16-le"), "utf-16"),
        (b"\xfe\xff" + envelope("<a>\u00e9</a>").decode().encode("utf-16-be"), "utf-16"),
        (
            ('<?xml version="1.0" encoding="utf-16"?>' + envelope("<a>\u00e9</a>").decode()).encode("utf-16-le"),
            "utf-16le",
        ),
        (
            ('<?xml version="1.0" encoding="UTF-16"?>' + envelope("<a>\u00e9</a>").decode()).encode("utf-16-be"),
            "utf-16be",
        ),
    ],
)
def test_utf16_is_read_as_the_same_document_and_its_encoding_kept(data: bytes, encoding: str) -> None:
    for limits in (LIMITS, Limits(max_elements=3)):  # whole and incremental (more "<" than elements)
        env = parse_envelope(data, limits)
        assert env.encoding == encoding
        assert env.body[0].text == "\u00e9"


@pytest.mark.parametrize(
    "doctype",
    ['<!DOCTYPE x SYSTEM "file:///etc/passwd">', '<!DOCTYPE x [<!ENTITY % p SYSTEM "file:///etc/passwd"> %p;]>'],
)
@pytest.mark.parametrize("codec", ["utf-16-le", "utf-16-be"])
@pytest.mark.parametrize("bom", [True, False])
def test_a_doctype_in_utf16_is_refused_before_any_parser_sees_it(
    doctype: str, codec: str, bom: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(threat_protection, "_parse_whole", lambda *a: pytest.fail("parsed"))
    monkeypatch.setattr(threat_protection, "_parse_incremental", lambda *a, **kw: pytest.fail("parsed"))
    text = '<?xml version="1.0" encoding="UTF-16"?>' + doctype + envelope("<a/>").decode()
    data = ("\ufeff" + text if bom else text).encode(codec)
    with pytest.raises(faults.Fault) as got:
        parse_envelope(data, LIMITS)
    assert "DTD" in got.value.reason


EVEN = Limits(max_namespace_declarations=12)  # as many on one element as in scope: the whole parse counts them
MANY_NAMESPACES = {
    "eight on each of many siblings": (envelope("".join(f"<a{_declarations(8)}/>" for _ in range(40))), None),
    "twelve in scope on a chain (with the Envelope's)": (
        envelope(f"<a{_declarations(6)}><b{_declarations(5, 6)}/></a>" * 5),
        None,
    ),
    "thirteen in scope on a chain": (
        envelope(f"<a{_declarations(6)}><b{_declarations(6, 6)}><c xmlns:z='urn:z'/></b></a>" * 5),
        "namespace declarations in scope over 12",
    ),
    "the same prefix redeclared at every level": (
        envelope("".join(f'<a xmlns:p="urn:{i}">' for i in range(13)) + "</a>" * 13),
        "namespace declarations in scope over 12",
    ),
    "default namespace undeclared at every level": (
        envelope("".join(f'<a xmlns="urn:{i}"><b xmlns="">' for i in range(7)) + "</b></a>" * 7),
        "namespace declarations in scope over 12",
    ),
    "the xml prefix declared at every level (never counted)": (
        envelope('<a xmlns:xml="http://www.w3.org/XML/1998/namespace">' * 14 + "</a>" * 14),
        None,
    ),
    "thirteen on one element": (envelope("<a/>" * 20 + f"<a{_declarations(13)}/>"), "namespace declarations on one"),
    "flood on the envelope": (
        envelope("<a/>").replace(b"<soap:Envelope", f"<soap:Envelope{_declarations(400)}".encode()),
        "namespace declarations on one element",
    ),
}


@pytest.mark.parametrize("case", sorted(MANY_NAMESPACES))
def test_namespace_heavy_bodies_are_parsed_whole_and_refused_as_the_incremental_parse_refuses(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    data, refused = MANY_NAMESPACES[case]
    assert data.count(b"xmlns") > 12  # the bytes alone do not prove the namespace limits
    incremental = threat_protection._parse_incremental
    strategies: list[str] = []
    monkeypatch.setattr(
        threat_protection,
        "_parse_incremental",
        lambda *a, **kw: strategies.append("incremental") or incremental(*a, **kw),
    )
    try:
        parse_envelope(data, EVEN)
        got = None
    except faults.Fault as fault:
        got = fault.reason
    expected = _outcome(lambda d, _: incremental(d, EVEN), data)
    assert (got is None) == (expected is None) == (refused is None)
    if refused is not None:  # the same document refused; the whole parse names the scope (a flood on one element
        assert refused in expected and "namespace declarations in scope over 12" in got  # is in its scope)
    assert strategies == []  # without a Python event per element or declaration


# --- decrypted content (parse_fragment): parsed whole where the bytes bound it, else incrementally; the same
# refusals either way, the depth limit counted from where the content lands.

FRAGMENT_NS = {"soap": "http://schemas.xmlsoap.org/soap/envelope/", "wsu": "urn:wsu"}
FRAGMENT_DEPTH = 2  # a decrypted Body's content: the wrapper stands in for the Body, at depth 2
FRAGMENTS = {
    "plain": ("<a>hi</a> tail <b/>", None),
    "text only": ("just text", None),
    "prefix in scope where it lands": ("<soap:x wsu:y='1'/>", None),
    "at depth limit": ("<a>" * 18 + "</a>" * 18, None),  # Body at 2: its content reaches 20
    "over depth limit": ("<a>" * 19 + "</a>" * 19, "nesting depth over 20"),
    "at attribute limit": ('<a b="1" c="2" d="3" e="4" f="5"/>', None),
    "over attribute limit": ('<a b="1" c="2" d="3" e="4" f="5" g="6"/>', "attribute count over 5"),
    "pi": ("<a/><?evil thing?>", "processing instruction in message"),
    "pi inside": ("<a><?evil thing?></a>", "processing instruction in message"),
    "comment": ("<!-- note --><a/>", None),
    "cdata": ("<a><![CDATA[<not an element>]]></a>", None),
    "malformed": ("<a><b></a>", "malformed XML"),
    "closes the wrapper": ("</wsgate-fragment><x/>", "malformed XML"),
    "doctype": ('<!DOCTYPE a [<!ENTITY e "x">]><a>&e;</a>', "malformed XML"),
    "undefined entity": ("<a>&nope;</a>", "malformed XML"),
    "unbound prefix": ("<q:a/>", "malformed XML"),
    "declarations per element": (
        "<a " + " ".join(f'xmlns:p{i}="urn:{i}"' for i in range(9)) + "/>",
        "namespace declarations on one element over 8",
    ),
    "declarations in scope": (
        "<a " + " ".join(f'xmlns:p{i}="urn:{i}"' for i in range(6)) + "><b "
        + " ".join(f'xmlns:q{i}="urn:{i}"' for i in range(6)) + "/></a>",
        "namespace declarations in scope over 12",
    ),
}  # fmt: skip


def _fragment_outcomes(text: str, depth: int = FRAGMENT_DEPTH) -> tuple[str | None, str | None]:
    """What the whole parse (with its checks) and the incremental one make of the same content."""
    wrapper = f"<wsgate-fragment{''.join(f' xmlns:{p}={u!r}' for p, u in FRAGMENT_NS.items())}>".encode()
    parts = [wrapper, text.encode(), b"</wsgate-fragment>"]
    outcomes: list[str | None] = []
    for parse in (lambda: threat_protection._fragment_whole(b"".join(parts), LIMITS, depth),
                  lambda: threat_protection._fragment_incremental(parts, LIMITS, depth)):  # fmt: skip
        try:
            parse()
            outcomes.append(None)
        except faults.Fault as fault:
            outcomes.append(fault.reason)
        except etree.XMLSyntaxError:  # parse_fragment turns it into a Client fault
            outcomes.append("malformed XML")
    return outcomes[0], outcomes[1]


@pytest.mark.parametrize("case", sorted(FRAGMENTS))
def test_decrypted_content_parsed_whole_or_incrementally_refused_alike(case: str) -> None:
    text, refused = FRAGMENTS[case]
    whole, incremental = _fragment_outcomes(text)
    if refused is None:
        root = threat_protection.parse_fragment([text.encode()], FRAGMENT_NS, LIMITS, FRAGMENT_DEPTH)
        assert root.tag == "wsgate-fragment" and whole is None and incremental is None
        return
    with pytest.raises(faults.Fault) as got:
        threat_protection.parse_fragment([text.encode()], FRAGMENT_NS, LIMITS, FRAGMENT_DEPTH)
    assert refused in got.value.reason and incremental is not None and refused in incremental
    if "declarations" not in case:  # content the bytes do not bound so is never parsed whole
        assert whole is not None and refused in whole


def test_decrypted_content_parsed_whole_only_where_the_bytes_bound_it(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    whole, incremental = threat_protection._fragment_whole, threat_protection._fragment_incremental
    monkeypatch.setattr(threat_protection, "_fragment_whole", lambda *a: calls.append("whole") or whole(*a))
    monkeypatch.setattr(
        threat_protection, "_fragment_incremental", lambda *a: calls.append("incremental") or incremental(*a)
    )

    def parse(text: str, depth: int = FRAGMENT_DEPTH) -> None:
        threat_protection.parse_fragment([text.encode()], FRAGMENT_NS, LIMITS, depth)

    parse("<a/>" * 10)
    parse("<a/>" * 500)  # with the wrapper's own two '<': 502 in the bytes, 500 elements at most
    with pytest.raises(faults.Fault, match="element count over 500"):
        parse("<a/>" * 501)
    with pytest.raises(faults.Fault, match="text node longer than 100000"):
        parse("<a>" + "x" * 100_001 + "</a>")  # a text node could be over the limit: counted
    parse("<a " + " ".join(f'xmlns:p{i}="urn:{i}"' for i in range(7)) + "/>")  # 2 + 7 declarations: over 8
    with pytest.raises(faults.Fault, match="nesting depth over 20"):
        parse("<a/>", depth=21)  # the wrapper's own place is too deep: the incremental parse says so
    assert calls == ["whole", "whole", "incremental", "incremental", "incremental", "incremental"]


@pytest.mark.parametrize("version", ["1.1", "1.2"])
def test_header_and_body_are_the_envelopes_own_children_never_a_nested_or_foreign_copy(version: str) -> None:
    """Envelope.header and .body look among the envelope's own children (the first two, then the rest), in its
    version's namespace: a Header or Body nested in a header block, or in the other SOAP version's namespace, is
    never it; in any order and place, the first one is."""
    soap, other = (ns.SOAP11, ns.SOAP12) if version == "1.1" else (ns.SOAP12, ns.SOAP11)
    root = etree.fromstring(
        f'<s:Envelope xmlns:s="{soap}" xmlns:o="{other}"><!-- c --><o:Header/><o:Body/>'
        "<s:Header><x:h xmlns:x='urn:x'><s:Header/><s:Body/></x:h></s:Header><s:Body><y/></s:Body></s:Envelope>"
    )
    env = Envelope(root=root, version=version)
    assert env.header is root[3] and env.body is root[4]
    del root[3]
    assert env.header is None
    made = env.ensure_header()
    assert made is root[0] and made.tag == f"{{{soap}}}Header" and env.header is made
    for order in ("<s:Body/><s:Header/>", "<!-- c --><s:Body/><s:Header/>", "<s:Body/><!-- c --><s:Header/>"):
        swapped = Envelope(root=etree.fromstring(f'<s:Envelope xmlns:s="{soap}">{order}<s:Body/></s:Envelope>'),
                           version=version)  # fmt: skip
        kids = [c for c in swapped.root if isinstance(c.tag, str)]
        assert swapped.body is kids[0] and swapped.header is kids[1]
