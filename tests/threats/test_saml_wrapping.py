"""Issue #22: the eight XML Signature Wrapping variants of "On Breaking SAML" (Somorovsky et al., 2012), against
the issuer's signature on the assertion and against the message's own signature.

Each variant keeps the signed original somewhere a reference can still reach (so its digest still matches) and
puts an evil copy where the processor reads: the name `admin@example.org` instead of the IdP's, or a Body that
asks for something else. The gateway reads only the element it verified, by identity: one carrier of an ID in the
whole document, a signature that is the assertion's own child referencing the assertion's own ID, enveloped and
exclusive C14N only, nothing unknown inside an assertion, signed message parts only where they may live."""

from __future__ import annotations

from collections.abc import Callable
from copy import deepcopy
from pathlib import Path

import pytest
from lxml import etree

from filters.engine import faults, ns
from filters.engine.engine import Exchange
from filters.engine.profiles import SamlPipeline
from gateway.policy import Route
from tests.support import saml as S
from tests.support.harness import GatewayFactory, LiveGateway
from tests.support.wss_helpers import echo

EVIL = "admin@example.org"
DS_SIG = ns.q(ns.DS, "Signature")
ASSERTION = ns.q(ns.SAML2, "Assertion")
NAME_ID = ns.q(ns.SAML2, "NameID")
WSU_ID = ns.q(ns.WSU, "Id")


def message(route: Route, pki: Path, tmp: Path) -> etree._Element:
    """An honest sender-vouches message: the IdP's assertion, client2 vouching."""
    data, _ = S.client(route, pki, S.write(tmp, S.sign(S.assertion_xml(pki), pki)), signer="client2").secure(echo())
    return etree.fromstring(data)


def _object(sig: etree._Element, content: etree._Element) -> None:
    etree.SubElement(sig, ns.q(ns.DS, "Object")).append(content)


def _unsigned(el: etree._Element) -> etree._Element:
    copy = deepcopy(el)
    for sig in copy.findall(DS_SIG):
        copy.remove(sig)
    return copy


def _evil_assertion(a: etree._Element, new_id: bool, keep_signature: bool) -> etree._Element:
    evil = deepcopy(a) if keep_signature else _unsigned(a)
    evil.find(f".//{NAME_ID}").text = EVIL
    if new_id:
        evil.set("ID", "_evil")
    return evil


# Against the assertion's signature: (the original `a`, the message root) -> the assertion is wrapped.
def xsw1(a: etree._Element, root: etree._Element) -> None:
    """The evil assertion with the same ID carries the signature; the original, unsigned, in its ds:Object."""
    evil = _evil_assertion(a, new_id=False, keep_signature=True)
    _object(evil.find(DS_SIG), _unsigned(a))
    a.getparent().replace(a, evil)


def xsw2(a: etree._Element, root: etree._Element) -> None:
    """The evil assertion (new ID) with the signature; the original detached, right before the signature."""
    evil = _evil_assertion(a, new_id=True, keep_signature=True)
    evil.find(DS_SIG).addprevious(_unsigned(a))
    a.getparent().replace(a, evil)


def xsw3(a: etree._Element, root: etree._Element) -> None:
    """An unsigned evil assertion with the same ID before the original, which stays as it was."""
    a.addprevious(_evil_assertion(a, new_id=False, keep_signature=False))


def xsw4(a: etree._Element, root: etree._Element) -> None:
    """The evil assertion (same ID, unsigned) in its place, the original inside it."""
    evil = _evil_assertion(a, new_id=False, keep_signature=False)
    a.getparent().replace(a, evil)
    evil.append(a)


def xsw5(a: etree._Element, root: etree._Element) -> None:
    """The evil assertion (new ID) keeps the signature; the original, unsigned, at the end of the header."""
    evil = _evil_assertion(a, new_id=True, keep_signature=True)
    header = a.getparent().getparent()
    a.getparent().replace(a, evil)
    header.append(_unsigned(a))


def xsw6(a: etree._Element, root: etree._Element) -> None:
    """The evil assertion (new ID) keeps the signature; the original, signature and all, in its ds:Object."""
    evil = _evil_assertion(a, new_id=True, keep_signature=True)
    a.getparent().replace(a, evil)
    _object(evil.find(DS_SIG), a)


def xsw7(a: etree._Element, root: etree._Element) -> None:
    """The evil assertion (new ID, unsigned) holds the original in an Extensions element."""
    evil = _evil_assertion(a, new_id=True, keep_signature=False)
    a.getparent().replace(a, evil)
    etree.SubElement(evil, ns.q(ns.SAML2, "Extensions")).append(a)


def xsw8(a: etree._Element, root: etree._Element) -> None:
    """The evil assertion (new ID) keeps the signature; the original, unsigned, in a ds:Object of it."""
    evil = _evil_assertion(a, new_id=True, keep_signature=True)
    a.getparent().replace(a, evil)
    _object(evil.find(DS_SIG), _unsigned(a))


ASSERTION_WRAPPING: dict[str, Callable[[etree._Element, etree._Element], None]] = {
    f.__name__: f for f in (xsw1, xsw2, xsw3, xsw4, xsw5, xsw6, xsw7, xsw8)
}


# Against the message signature: a signed part `t` (the Body, or the STR that binds the assertion to the message)
# kept where a reference reaches it, an evil one read. `evil(t, new_id)` makes the evil one.
Evil = Callable[[etree._Element, bool], etree._Element]


def _message_signature(root: etree._Element) -> etree._Element:
    return next(s for s in root.iter(DS_SIG) if s.getparent().tag == ns.q(ns.WSSE, "Security"))


def _header(root: etree._Element) -> etree._Element:
    return root.find(ns.q(ns.SOAP11, "Header"))


def msw1(t: etree._Element, root: etree._Element, evil: Evil) -> None:
    _object(_message_signature(root), deepcopy(t))
    t.getparent().replace(t, evil(t, True))


def msw2(t: etree._Element, root: etree._Element, evil: Evil) -> None:
    t.getparent().replace(t, evil(t, True))
    _message_signature(root).addprevious(t)


def msw3(t: etree._Element, root: etree._Element, evil: Evil) -> None:
    t.addprevious(evil(t, False))


def msw4(t: etree._Element, root: etree._Element, evil: Evil) -> None:
    bad = evil(t, False)
    t.getparent().replace(t, bad)
    bad.append(t)


def msw5(t: etree._Element, root: etree._Element, evil: Evil) -> None:
    t.getparent().replace(t, evil(t, True))
    _header(root).append(t)


def msw6(t: etree._Element, root: etree._Element, evil: Evil) -> None:
    t.getparent().replace(t, evil(t, True))
    etree.SubElement(_header(root), "{urn:attacker}Wrapper").append(t)


def msw7(t: etree._Element, root: etree._Element, evil: Evil) -> None:
    t.getparent().replace(t, evil(t, True))
    etree.SubElement(next(root.iter(ASSERTION)), ns.q(ns.SAML2, "Extensions")).append(t)


def msw8(t: etree._Element, root: etree._Element, evil: Evil) -> None:
    t.getparent().replace(t, evil(t, True))
    _object(next(root.iter(ASSERTION)).find(DS_SIG), t)


MESSAGE_WRAPPING: dict[str, Callable[[etree._Element, etree._Element, Evil], None]] = {
    f.__name__.replace("msw", "xsw"): f for f in (msw1, msw2, msw3, msw4, msw5, msw6, msw7, msw8)
}


def _evil_body(b: etree._Element, new_id: bool) -> etree._Element:
    evil = deepcopy(b)
    next(evil.iter("{urn:wsgate:demo}text")).text = "transfer everything"
    if new_id:
        evil.set(WSU_ID, "evil-body")
    return evil


def wrapped_assertion(route: Route, pki: Path, tmp: Path, variant: str) -> bytes:
    root = message(route, pki, tmp)
    ASSERTION_WRAPPING[variant](next(root.iter(ASSERTION)), root)
    return etree.tostring(root)


def wrapped_body(route: Route, pki: Path, tmp: Path, variant: str) -> bytes:
    root = message(route, pki, tmp)
    MESSAGE_WRAPPING[variant](root.find(ns.q(ns.SOAP11, "Body")), root, _evil_body)
    return etree.tostring(root)


def wrapped_reference(route: Route, pki: Path, tmp: Path, variant: str) -> bytes:
    """The STR client2 signed names alice's assertion; the attacker swaps in an assertion about admin (as validly
    issued: captured elsewhere) and an STR naming it, keeping the signed STR where the signature reaches it."""
    root = message(route, pki, tmp)
    captured = S.sign(S.assertion_xml(pki, subject=EVIL), pki)
    honest = next(root.iter(ASSERTION))
    honest.getparent().replace(honest, captured)

    def evil(t: etree._Element, new_id: bool) -> etree._Element:
        bad = deepcopy(t)
        bad.find(ns.q(ns.WSSE, "KeyIdentifier")).text = captured.get("ID")
        if new_id:
            bad.set(WSU_ID, "evil-str")
        return bad

    MESSAGE_WRAPPING[variant](next(root.iter(ns.q(ns.WSSE, "SecurityTokenReference"))), root, evil)
    return etree.tostring(root)


def test_the_unwrapped_message_gets_through(route: Route, pipeline: SamlPipeline, pki: Path, tmp_path: Path) -> None:
    """The control for every variant below: the same message, unwrapped, is accepted."""
    out = pipeline.request(etree.tostring(message(route, pki, tmp_path)), {}, Exchange(route=route))
    assert out.set_headers["x-wsgate-subject"] == S.SUBJECT


@pytest.mark.parametrize("variant", ASSERTION_WRAPPING)
def test_signature_wrapping_of_the_assertion_is_refused(variant: str, route: Route, pipeline: SamlPipeline,
                                                        pki: Path, tmp_path: Path) -> None:  # fmt: skip
    with pytest.raises(faults.Fault) as info:
        pipeline.request(wrapped_assertion(route, pki, tmp_path, variant), {}, Exchange(route=route))
    assert info.value.code in ("InvalidSecurity", "FailedCheck"), info.value.reason


@pytest.mark.parametrize("variant", MESSAGE_WRAPPING)
@pytest.mark.parametrize("target", ["body", "assertion_reference"])
def test_signature_wrapping_of_the_message_is_refused(variant: str, target: str, route: Route,
                                                      pipeline: SamlPipeline, pki: Path, tmp_path: Path) -> None:  # fmt: skip
    wrap = wrapped_body if target == "body" else wrapped_reference
    with pytest.raises(faults.Fault) as info:
        pipeline.request(wrap(route, pki, tmp_path, variant), {}, Exchange(route=route))
    # threat protection refuses a Body out of place before any signature is read (a plain Client fault)
    assert info.value.code in ("InvalidSecurity", "FailedCheck", "FailedAuthentication", ""), info.value.reason


@pytest.fixture(scope="module")
def gw(module_gateway: GatewayFactory, pki: Path) -> LiveGateway:
    return module_gateway([S.saml_doc(pki, replay={"store": "auto"})])


@pytest.mark.parametrize("variant", ["xsw3", "xsw4", "xsw7", "xsw8"])
def test_signature_wrapping_never_reaches_the_backend(variant: str, gw: LiveGateway, pki: Path,
                                                      tmp_path: Path) -> None:  # fmt: skip
    route = gw.route("saml")
    gw.clear()
    for wrap in (wrapped_assertion, wrapped_body, wrapped_reference):
        data = wrap(route, pki, tmp_path, variant)
        resp = gw.post("saml", data)
        assert resp.status_code in (400, 500) and b"Fault" in resp.content
    assert gw.received() == []
    assert gw.post("saml", etree.tostring(message(route, pki, tmp_path))).status_code == 200
