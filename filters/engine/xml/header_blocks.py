"""SOAP header blocks after verification: only what the signature covers reaches the backend as it came.

The wsse:Security header is gone by then (wssecurity.process). Every other header block the request's signature
does not cover (the block itself, by element identity) is forwarded, stripped or refused as the route's
`unsigned_headers` says; WS-Addressing blocks have their own rule (`addressing`, strip by default), as an unsigned
wsa:Action or wsa:To beside a signed Body would tell the backend where a verified message was meant to go. A
mustUnderstand block is never stripped silently: the request is refused instead. When the signature covers a
wsa:Action, the SOAPAction the HTTP request names (SOAP 1.1 header, SOAP 1.2 `action` parameter; Envoy routes on
it) must be the same action. Character data between the Envelope's and the Header's elements, which no
signature covers either, is refused."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from lxml import etree

from filters.engine import faults, ns
from filters.engine.xml import values
from filters.engine.xml.soap import Envelope
from gateway.policy import UnsignedHeaders

_ACTIONS = {ns.q(a, "Action") for a in ns.ADDRESSING}
_TRUE = {"1", "true"}


def enforce(
    env: Envelope, covers: Callable[[etree._Element], bool], policy: UnsignedHeaders, headers: Mapping[str, str]
) -> None:
    """Apply `policy` to the header blocks `covers` says are unsigned, then check SOAPAction against a signed
    wsa:Action. Raises InvalidSecurity on a refusal."""
    _no_character_data(env)
    header = env.header
    if header is None:
        return
    must_understand = ns.q(env.soap_ns, "mustUnderstand")
    for block in [b for b in header if isinstance(b.tag, str)]:
        if covers(block):
            continue
        name = block.tag[:120]
        rule = policy.addressing if etree.QName(block).namespace in ns.ADDRESSING else policy.default
        if rule == "refuse":
            raise faults.security("InvalidSecurity", f"header block {name} is not signed")
        if rule == "strip":
            if (block.get(must_understand) or "").strip() in _TRUE:
                raise faults.security("InvalidSecurity", f"unsigned mustUnderstand header block {name}")
            header.remove(block)  # its tail is whitespace: a Header holds no character data
    if not any(isinstance(c.tag, str) for c in header):
        env.root.remove(header)
    _check_action(env, covers, headers)


def _no_character_data(env: Envelope) -> None:
    """The Envelope and the Header hold elements only (SOAP 1.1 and 1.2): text between them is in no signed part,
    and nothing the backend should read."""
    holders = [env.root, *([env.header] if env.header is not None else [])]
    texts = [h.text for h in holders] + [c.tail for h in holders for c in h]
    if any(t and t.strip(" \t\r\n") for t in texts):
        raise faults.security("InvalidSecurity", "character data outside the SOAP Body and header blocks")


def _check_action(env: Envelope, covers: Callable[[etree._Element], bool], headers: Mapping[str, str]) -> None:
    header = env.header
    actions = [] if header is None else [b for b in header if b.tag in _ACTIONS]
    if len(actions) > 1:
        raise faults.security("InvalidSecurity", f"{len(actions)} wsa:Action header blocks")
    if not actions or not covers(actions[0]):
        return
    signed = values.text(actions[0], "wsa:Action").strip()
    for claimed in soap_actions(headers):
        if claimed and claimed != signed:
            raise faults.security("InvalidSecurity", f"SOAPAction {claimed[:120]!r} is not the signed wsa:Action")


def operation(env: Envelope, covers: Callable[[etree._Element], bool], headers: Mapping[str, str]) -> str | None:
    """The operation a verified request asks for (per-operation quotas): its signed wsa:Action, else the action
    its HTTP request names (after `enforce`, the two agree). None when neither is a plain header value."""
    signed = [b for b in (env.header if env.header is not None else []) if b.tag in _ACTIONS and covers(b)]
    found = values.text(signed[0], "wsa:Action").strip() if signed else next(filter(None, soap_actions(headers)), "")
    return found if found and len(found) <= 512 and found.isprintable() and found.isascii() else None


def soap_actions(headers: Mapping[str, str]) -> list[str]:
    """Every action the HTTP request names: the SOAPAction header (quoted or not) and the content type's `action`
    parameters (SOAP 1.2), unquoted; an empty one names nothing (SOAP 1.1: the intent is the request URI)."""
    found = []
    if "soapaction" in headers:
        found.append(_unquote(headers["soapaction"]))
    for param in headers.get("content-type", "").split(";")[1:]:
        key, _, value = param.partition("=")
        if key.strip().lower() == "action":
            found.append(_unquote(value))
    return found


def _unquote(value: str) -> str:
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] == '"':
        return value[1:-1].strip()
    return value
