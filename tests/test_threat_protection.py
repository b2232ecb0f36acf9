"""Threat protection's two parses (whole with XPath checks, incremental with early abort) refuse alike."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from filters import faults, threat_protection
from filters.threat_protection import parse_envelope
from tests.harness import envelope


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
