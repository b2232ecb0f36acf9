"""filters.engine.xml.header_blocks: header blocks the signature does not cover, and SOAPAction against a signed
wsa:Action. End to end in tests/test_signed_content_threats.py."""

from __future__ import annotations

import pytest
from lxml import etree

from filters.engine import faults, ns
from filters.engine.xml import header_blocks
from filters.engine.xml.soap import Envelope
from filters.engine.xml.threat_protection import parse_envelope
from gateway.policy import Limits, UnsignedHeaders

WSA_2004 = "http://schemas.xmlsoap.org/ws/2004/08/addressing"


def env_with(blocks: str, version: str = "1.1") -> Envelope:
    soap = ns.SOAP12 if version == "1.2" else ns.SOAP11
    return parse_envelope(
        f'<s:Envelope xmlns:s="{soap}"><s:Header>{blocks}</s:Header><s:Body><x/></s:Body></s:Envelope>'.encode(),
        Limits(),
    )


def signed(*local: str) -> object:
    return lambda el: isinstance(el.tag, str) and etree.QName(el).localname in local


def names(env: Envelope) -> list[str]:
    return [] if env.header is None else [etree.QName(b).localname for b in env.header]


ACTION = f'<wsa:Action xmlns:wsa="{ns.WSA}">urn:a</wsa:Action>'
TO_2004 = f'<w:To xmlns:w="{WSA_2004}">http://elsewhere</w:To>'
TRACE = '<t:Trace xmlns:t="urn:app">1</t:Trace>'


@pytest.mark.parametrize(
    ("policy", "left"),
    [
        (UnsignedHeaders(), ["Action"]),
        (UnsignedHeaders(default="forward"), ["Action", "Trace"]),
        (UnsignedHeaders(addressing="forward"), ["Action", "To"]),
        (UnsignedHeaders(default="forward", addressing="forward"), ["Action", "To", "Trace"]),
    ],
)
def test_unsigned_blocks_are_stripped_unless_forwarded(policy: UnsignedHeaders, left: list[str]) -> None:
    env = env_with(ACTION + TO_2004 + TRACE)
    header_blocks.enforce(env, signed("Action"), policy, {})
    assert names(env) == left


def test_a_header_left_empty_is_removed() -> None:
    env = env_with(TO_2004 + TRACE)
    header_blocks.enforce(env, signed(), UnsignedHeaders(), {})
    assert env.header is None


@pytest.mark.parametrize("policy", [UnsignedHeaders(addressing="refuse"), UnsignedHeaders(default="refuse")])
def test_unsigned_blocks_refused_where_the_policy_says(policy: UnsignedHeaders) -> None:
    with pytest.raises(faults.Fault, check=lambda f: f.code == "InvalidSecurity"):
        header_blocks.enforce(env_with(TO_2004 + TRACE), signed(), policy, {})


@pytest.mark.parametrize(("version", "value"), [("1.1", "1"), ("1.2", "true"), ("1.2", " 1 ")])
def test_unsigned_must_understand_block_is_never_stripped_silently(version: str, value: str) -> None:
    soap = ns.SOAP12 if version == "1.2" else ns.SOAP11
    block = f'<t:Tx xmlns:t="urn:app" xmlns:e="{soap}" e:mustUnderstand="{value}">1</t:Tx>'
    with pytest.raises(faults.Fault, check=lambda f: "mustUnderstand" in f.reason):
        header_blocks.enforce(env_with(block, version), signed(), UnsignedHeaders(), {})
    forwarded = env_with(block, version)
    header_blocks.enforce(forwarded, signed(), UnsignedHeaders(default="forward"), {})
    assert names(forwarded) == ["Tx"]


@pytest.mark.parametrize(
    ("headers", "actions"),
    [
        ({"soapaction": '"urn:a"'}, ["urn:a"]),
        ({"soapaction": " urn:a "}, ["urn:a"]),
        ({"soapaction": '""'}, [""]),
        ({"content-type": 'application/soap+xml; charset=utf-8; action="urn:a"'}, ["urn:a"]),
        ({"content-type": "application/soap+xml;ACTION=urn:a"}, ["urn:a"]),
        ({"content-type": "text/xml", "soapaction": "urn:b"}, ["urn:b"]),
        ({"content-type": 'application/soap+xml;action="urn:a";action="urn:b"'}, ["urn:a", "urn:b"]),
    ],
)
def test_soap_actions_every_claim_is_read(headers: dict[str, str], actions: list[str]) -> None:
    assert header_blocks.soap_actions(headers) == actions


@pytest.mark.parametrize(
    ("headers", "ok"),
    [
        ({}, True),
        ({"soapaction": '"urn:a"'}, True),
        ({"soapaction": ""}, True),
        ({"soapaction": "urn:b"}, False),
        ({"content-type": 'application/soap+xml;action="urn:a";action="urn:b"'}, False),
    ],
)
def test_soap_action_must_agree_with_a_signed_wsa_action(headers: dict[str, str], ok: bool) -> None:
    env = env_with(ACTION)
    if ok:
        header_blocks.enforce(env, signed("Action"), UnsignedHeaders(), headers)
    else:
        with pytest.raises(faults.Fault, check=lambda f: f.code == "InvalidSecurity"):
            header_blocks.enforce(env, signed("Action"), UnsignedHeaders(), headers)


def test_an_unsigned_wsa_action_constrains_nothing_and_is_stripped() -> None:
    env = env_with(ACTION)
    header_blocks.enforce(env, signed(), UnsignedHeaders(), {"soapaction": "urn:b"})
    assert env.header is None


def test_two_wsa_actions_are_refused_even_when_forwarded() -> None:
    env = env_with(ACTION + f'<w:Action xmlns:w="{WSA_2004}">urn:b</w:Action>')
    with pytest.raises(faults.Fault, check=lambda f: "Action" in f.reason):
        header_blocks.enforce(env, signed(), UnsignedHeaders(addressing="forward"), {})


@pytest.mark.parametrize("where", ["envelope", "header", "between-blocks", "after-body"])
def test_character_data_outside_the_body_and_blocks_is_refused(where: str) -> None:
    blocks = {"header": "pay mallory" + TRACE, "between-blocks": TRACE + "pay mallory" + TRACE}.get(where, TRACE)
    data = etree.tostring(env_with(blocks).root).decode()
    if where == "envelope":
        data = data.replace("<s:Header>", "pay mallory<s:Header>")
    if where == "after-body":
        data = data.replace("</s:Envelope>", "pay mallory</s:Envelope>")
    env = parse_envelope(data.encode(), Limits())
    with pytest.raises(faults.Fault, check=lambda f: "character data" in f.reason):
        header_blocks.enforce(env, signed("Trace"), UnsignedHeaders(), {})


def test_whitespace_between_blocks_is_fine() -> None:
    env = env_with(f"\n  {TRACE}\n  ")
    header_blocks.enforce(env, signed("Trace"), UnsignedHeaders(), {})
    assert names(env) == ["Trace"]
