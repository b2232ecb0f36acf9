"""The issuer's signature computed without xmlsec (saml._verify_direct, the common shape) agrees with xmlsec's full
verification on every spelling of the same assertion, and never accepts what xmlsec refuses: the enveloped cut
(saml._enveloped) is where a wrong cut would let a changed assertion pass as signed."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
import xmlsec
from cryptography import x509
from lxml import etree

from filters.engine import ns
from filters.engine.wss import saml, saml_issuer, signature
from gateway.policy import SamlTokenService
from tests.support import saml as S

SAML2 = f'xmlns:saml="{ns.SAML2}"'


def _certificate(pki: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate((pki / "saml-idp.pem").read_bytes())


def _xmlsec_verifies(el: etree._Element, cert: x509.Certificate) -> bool:
    """What xmlsec says, as saml._check_signature asks it."""
    id_attr = "ID" if el.tag == saml.ASSERTION2 else "AssertionID"
    digests = [signature.DIGEST_METHODS["sha256"], signature.DIGEST_METHODS["sha1"]]
    ctx = signature._context(signature._certificate_key(cert), xmlsec.Transform.RSA_SHA256, digests)
    ctx.register_id(el, id_attr, None)
    try:
        ctx.verify(el.find(saml.SIGNATURE))
    except xmlsec.Error:
        return False
    return True


def _direct(el: etree._Element, cert: x509.Certificate) -> bool:
    return saml._verify_direct(el, el.find(saml.SIGNATURE), "rsa-sha256", [cert])


def _signed(xml: str, pki: Path, before: str = "", after: str = "", prefixes: tuple[str, ...] = ()) -> etree._Element:
    """An assertion signed by libxmlsec1 (enveloped, exclusive C14N, RSA-SHA256) as another IdP spells it: `before`
    and `after` its Signature (SAML 2.0: after the Issuer; 1.1: last), `prefixes` its transform's PrefixList; in a
    Security header, as the gateway reads it."""
    root = etree.fromstring(xml.encode())
    v2 = root.tag == saml.ASSERTION2
    attr = "ID" if v2 else "AssertionID"
    tpl = xmlsec.template.create(root, xmlsec.Transform.EXCL_C14N, xmlsec.Transform.RSA_SHA256, ns="ds")
    root[0].addnext(tpl) if v2 else root.append(tpl)
    ref = xmlsec.template.add_reference(tpl, xmlsec.Transform.SHA256, uri=f"#{root.get(attr)}")
    xmlsec.template.add_transform(ref, xmlsec.Transform.ENVELOPED)
    c14n = xmlsec.template.add_transform(ref, xmlsec.Transform.EXCL_C14N)
    if prefixes:
        xmlsec.template.transform_add_c14n_inclusive_namespaces(c14n, list(prefixes))
    raw = etree.tostring(root)
    at, end = raw.index(b"<ds:Signature"), raw.index(b"</ds:Signature>") + len(b"</ds:Signature>")
    raw = raw[:at] + before.encode() + raw[at:end] + after.encode() + raw[end:]
    wrapper = etree.fromstring(b'<wsse:Security xmlns:wsse="%s">%s</wsse:Security>' % (ns.WSSE.encode(), raw))
    el = wrapper[0]
    ctx = xmlsec.SignatureContext()
    ctx.key = xmlsec.Key.from_file(str(pki / "saml-idp.key"), xmlsec.constants.KeyDataFormatPem)
    ctx.register_id(el, attr)
    ctx.sign(el.find(saml.SIGNATURE))
    return el


@pytest.mark.parametrize("version", ["2.0", "1.1"])
@pytest.mark.parametrize(
    ("before", "after", "prefixes"),
    [("", "", ()), ("\n  ", "\n  ", ()), ("&amp; text &lt;", " &#xD; more <![CDATA[<x>]]>", ()),
     ("\n", "", ("xsi", "xs")), ("", "", ("saml", "ds", "xsi"))],
    ids=["tight", "indented", "escaped-text", "prefix-list", "long-prefix-list"],
)  # fmt: skip
def test_issuer_signature_direct_path_agrees_with_xmlsec_on_spellings(
    version: str, before: str, after: str, prefixes: tuple[str, ...], pki: Path
) -> None:
    S.idp(pki)
    cert = _certificate(pki)
    xml = S.assertion_xml(pki, version=version, method="holder-of-key")
    el = _signed(xml.replace(SAML2, f'{SAML2} xmlns:xs="http://www.w3.org/2001/XMLSchema"'), pki, before, after,
                 prefixes)  # fmt: skip
    assert _xmlsec_verifies(el, cert)
    assert _direct(el, cert)  # the common shape is verified here, xmlsec not needed
    assert el.find(saml.SIGNATURE).get(saml._ENVELOPED_MARK) is None  # the marker is gone again
    assert next(el.iter(saml.SIGNATURE)).getparent() is el


def test_issuer_signature_direct_path_takes_signxml_assertions(pki: Path) -> None:
    S.idp(pki)
    cert = _certificate(pki)
    for version in ("2.0", "1.1"):
        el = S.sign(S.assertion_xml(pki, version=version), pki)
        assert _xmlsec_verifies(el, cert)
        assert _direct(el, cert)


def test_issuer_signature_text_added_beside_the_signature_is_refused_on_both_paths(pki: Path) -> None:
    """The text around the Signature is signed: the cut must keep it, or a sender could add text there."""
    S.idp(pki)
    cert = _certificate(pki)
    el = _signed(S.assertion_xml(pki), pki, before="\n")
    sig = el.find(saml.SIGNATURE)
    sig.tail = (sig.tail or "") + "added"
    assert not _xmlsec_verifies(el, cert)
    assert not _direct(el, cert)


def test_issuer_signature_nested_signature_name_in_another_namespace_is_cut_whole(pki: Path) -> None:
    """An element spelled ds:Signature in another namespace inside the Signature (its KeyInfo, not signed): the
    cut follows the depth of tags, not the first end tag of that name."""
    S.idp(pki)
    cert = _certificate(pki)
    el = _signed(S.assertion_xml(pki), pki)
    key_info = etree.SubElement(el.find(saml.SIGNATURE), f"{{{ns.DS}}}KeyInfo")
    etree.SubElement(key_info, "{urn:example:other}Signature", nsmap={"ds": "urn:example:other"}).text = "x"
    assert _xmlsec_verifies(el, cert)
    assert _direct(el, cert)


@pytest.mark.parametrize(
    "text",
    [f' {saml._ENVELOPED_MARK}=""', f'&lt;ds:Signature xmlns:ds="{ns.DS}" {saml._ENVELOPED_MARK}=""&gt;'],
    ids=["marker", "start-tag"],
)
def test_issuer_signature_marker_spelled_in_the_assertion_leaves_it_to_xmlsec(text: str, pki: Path) -> None:
    """A sender who writes the marker into a value cannot move the cut: found twice, xmlsec decides."""
    S.idp(pki)
    cert = _certificate(pki)
    xml = S.assertion_xml(pki).replace("<saml:AttributeValue>clerk", f"<saml:AttributeValue>clerk{text}")
    el = _signed(xml, pki)
    assert _xmlsec_verifies(el, cert)
    assert saml._enveloped(el, el.find(saml.SIGNATURE), []) is None
    assert not _direct(el, cert)


def test_issuer_signature_changed_after_signing_is_refused_on_both_paths(pki: Path) -> None:
    S.idp(pki)
    cert = _certificate(pki)
    el = _signed(S.assertion_xml(pki, subject="user@example.org"), pki)
    el.find(f"{{{ns.SAML2}}}Subject/{{{ns.SAML2}}}NameID").text = "admin@example.org"
    assert not _xmlsec_verifies(el, cert)
    assert not _direct(el, cert)


def test_issuer_signature_another_issuers_key_is_refused_on_both_paths(pki: Path) -> None:
    S.idp(pki)
    rogue = x509.load_pem_x509_certificate((pki / "saml-rogue-idp.pem").read_bytes())
    el = _signed(S.assertion_xml(pki), pki)
    assert _xmlsec_verifies(el, _certificate(pki))
    assert not _xmlsec_verifies(el, rogue)
    assert not _direct(el, rogue)


def test_issuer_signature_direct_path_takes_the_gateways_own_assertions(pki: Path) -> None:
    """The gateway's STS assertions (saml_issuer, as the bench's clients reuse them) take the direct path."""

    issuer = saml_issuer.Issuer(
        SamlTokenService(audience="urn:x", key=str(pki / "gateway-sign.key"),
                         certificate=str(pki / "gateway-sign.pem"), lifetime_s=300)
    )  # fmt: skip
    identity = saml_issuer.Identity("CN=x", saml_issuer.NAMEID_X509, saml_issuer.AC_X509, dt.datetime.now(dt.UTC))
    el = issuer.issue(identity, audience="urn:x", now=dt.datetime.now(dt.UTC))
    cert = x509.load_pem_x509_certificate((pki / "gateway-sign.pem").read_bytes())
    assert _xmlsec_verifies(el, cert)
    assert _direct(el, cert)
