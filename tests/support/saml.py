"""SAML assertions for tests, signed by a library we did not write (signxml), and the routes and messages that
carry them (the gateway's own client, `wsgate client --assertion`)."""

from __future__ import annotations

import base64
import datetime as dt
import uuid
from pathlib import Path
from typing import Any

import xmlsec
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from lxml import etree
from signxml import XMLSigner
from signxml.algorithms import CanonicalizationMethod

from certs import pki as pki_mod
from filters.engine import ns
from gateway.tools.client import Client, ClientConfig
from tests.support.wss_helpers import make_route, route_doc

ISSUER = "https://idp.wsgate.test"
AUDIENCE = "urn:wsgate:demo"
SUBJECT = "alice@example.org"
METHODS = ("bearer", "sender-vouches", "holder-of-key")
METHOD2 = {m: f"urn:oasis:names:tc:SAML:2.0:cm:{m}" for m in METHODS}
METHOD1 = {m: f"urn:oasis:names:tc:SAML:1.0:cm:{m}" for m in METHODS}
ROLE = "urn:oid:1.3.6.1.4.1.5923.1.1.1.7"  # eduPersonEntitlement, as a federation sends it


def idp(pki: Path) -> Path:
    """The demo IdP's signing certificate (issued by the demo CA) and a rogue one, made once per PKI."""
    if not (pki / "saml-idp.pem").exists():
        ca = pki_mod.load_ca(pki)
        pki_mod.write(pki, "saml-idp", pki_mod.issue(ca, "WSGate Demo SAML IdP"))
        pki_mod.write(pki, "saml-rogue-idp", pki_mod.issue(pki_mod.make_ca("Rogue IdP CA"), "WSGate Demo SAML IdP"))
    return pki


def saml_doc(pki: Path, name: str = "saml", saml: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """A `saml` route: the demo IdP by certificate, client2 may vouch, the demo audience, a role header."""
    idp(pki)
    options = {
        "issuers": [{"name": ISSUER, "certificates": [str(pki / "saml-idp.pem")]}],
        "confirmation": ["holder-of-key", "sender-vouches", "bearer"],
        "attesting_certificates": [str(pki / "client2.pem")],
        "audiences": [AUDIENCE],
        "attribute_headers": {ROLE: "x-wsgate-role"},
        **(saml or {}),
    }
    return route_doc(pki, "saml", name=name, saml=options, **extra)


def saml_route(pki: Path, **kw: Any) -> Any:
    doc = saml_doc(pki, **kw)
    doc.pop("name")
    return make_route(pki, "saml", **{k: v for k, v in doc.items() if k not in ("match", "upstream", "profile")})


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _time(when: dt.datetime) -> str:
    return when.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def cert_b64(pki: Path, stem: str) -> str:
    der = x509.load_pem_x509_certificate((pki / f"{stem}.pem").read_bytes()).public_bytes(serialization.Encoding.DER)
    return base64.b64encode(der).decode()


def assertion_xml(
    pki: Path,
    *,
    version: str = "2.0",
    method: str = "sender-vouches",
    holder: str = "client",
    subject: str = SUBJECT,
    issuer: str = ISSUER,
    audience: str = AUDIENCE,
    issued: dt.datetime | None = None,
    valid_s: int = 300,
    not_before: dt.datetime | None = None,
    roles: tuple[str, ...] = ("clerk",),
    one_time_use: bool = False,
    assertion_id: str | None = None,
    proof: str | None = None,
) -> str:
    """An unsigned assertion, as text (tests may edit it before signing). `proof`: holder-of-key, the KeyInfo's
    content (an EncryptedKey: `encrypted_key`) instead of the `holder` certificate."""
    issued = issued or now()
    start = not_before or issued - dt.timedelta(seconds=30)
    aid = assertion_id or f"_{uuid.uuid4().hex}"
    key_info = ""
    if method == "holder-of-key":
        named = proof or (f"<ds:X509Data><ds:X509Certificate>{cert_b64(pki, holder)}</ds:X509Certificate>"
                          "</ds:X509Data>")  # fmt: skip
        key_info = f'<ds:KeyInfo xmlns:ds="{ns.DS}">{named}</ds:KeyInfo>'

    if version == "1.1":
        confirmation = f"<saml:SubjectConfirmation><saml:ConfirmationMethod>{METHOD1[method]}</saml:ConfirmationMethod>{key_info}</saml:SubjectConfirmation>"
        subj = f'<saml:Subject><saml:NameIdentifier Format="urn:oasis:names:tc:SAML:1.1:nameid-format:emailAddress">{subject}</saml:NameIdentifier>{confirmation}</saml:Subject>'
        values = "".join(f"<saml:AttributeValue>{r}</saml:AttributeValue>" for r in roles)
        return (
            f'<saml:Assertion xmlns:saml="{ns.SAML1}" MajorVersion="1" MinorVersion="1" AssertionID="{aid}" '
            f'Issuer="{issuer}" IssueInstant="{_time(issued)}">'
            f'<saml:Conditions NotBefore="{_time(start)}" NotOnOrAfter="{_time(issued + dt.timedelta(seconds=valid_s))}">'
            f"<saml:AudienceRestrictionCondition><saml:Audience>{audience}</saml:Audience></saml:AudienceRestrictionCondition>"
            f"{'<saml:DoNotCacheCondition/>' if one_time_use else ''}</saml:Conditions>"
            f'<saml:AuthenticationStatement AuthenticationMethod="urn:oasis:names:tc:SAML:1.0:am:password" '
            f'AuthenticationInstant="{_time(issued)}">{subj}</saml:AuthenticationStatement>'
            f'<saml:AttributeStatement>{subj}<saml:Attribute AttributeName="{ROLE}" AttributeNamespace="urn:mace">'
            f"{values}</saml:Attribute></saml:AttributeStatement></saml:Assertion>"
        )  # fmt: skip
    data = ""
    if method == "holder-of-key":
        data = (f'<saml:SubjectConfirmationData xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance" '
                f'xsi:type="saml:KeyInfoConfirmationDataType">{key_info}</saml:SubjectConfirmationData>')  # fmt: skip
    values = "".join(f"<saml:AttributeValue>{r}</saml:AttributeValue>" for r in roles)
    return (
        f'<saml:Assertion xmlns:saml="{ns.SAML2}" Version="2.0" ID="{aid}" IssueInstant="{_time(issued)}">'
        f"<saml:Issuer>{issuer}</saml:Issuer>"
        f'<saml:Subject><saml:NameID Format="urn:oasis:names:tc:SAML:1.1:nameid-format:emailAddress">{subject}'
        f'</saml:NameID><saml:SubjectConfirmation Method="{METHOD2[method]}">{data}</saml:SubjectConfirmation></saml:Subject>'
        f'<saml:Conditions NotBefore="{_time(start)}" NotOnOrAfter="{_time(issued + dt.timedelta(seconds=valid_s))}">'
        f"<saml:AudienceRestriction><saml:Audience>{audience}</saml:Audience></saml:AudienceRestriction>"
        f"{'<saml:OneTimeUse/>' if one_time_use else ''}</saml:Conditions>"
        f'<saml:AuthnStatement AuthnInstant="{_time(issued)}"><saml:AuthnContext><saml:AuthnContextClassRef>'
        "urn:oasis:names:tc:SAML:2.0:ac:classes:Password</saml:AuthnContextClassRef></saml:AuthnContext>"
        f'</saml:AuthnStatement><saml:AttributeStatement><saml:Attribute Name="{ROLE}">{values}</saml:Attribute>'
        "</saml:AttributeStatement></saml:Assertion>"
    )  # fmt: skip


def encrypted_key(pki: Path, secret: bytes, to: str = "gateway-enc", transport: str = "rsa-oaep-mgf1p") -> str:
    """An xenc:EncryptedKey holding `secret` for the owner of the `to` certificate, as an IdP or STS puts it in a
    symmetric holder-of-key confirmation (SAML Token Profile 1.1, 3.5): the key wrapped by `cryptography`, the
    certificate named by its SHA-1 thumbprint (WSS X.509 Token Profile 1.1)."""
    cert = x509.load_pem_x509_certificate((pki / f"{to}.pem").read_bytes())
    public = cert.public_key()
    assert isinstance(public, rsa.RSAPublicKey)
    if transport == "rsa-1_5":
        wrapped = public.encrypt(secret, padding.PKCS1v15())
    else:
        wrapped = public.encrypt(secret, padding.OAEP(padding.MGF1(hashes.SHA1()), hashes.SHA1(), None))
    uri = {"rsa-oaep-mgf1p": f"{ns.XENC}rsa-oaep-mgf1p", "rsa-1_5": f"{ns.XENC}rsa-1_5"}[transport]
    thumbprint = base64.b64encode(cert.fingerprint(hashes.SHA1())).decode()
    return (f'<xenc:EncryptedKey xmlns:xenc="{ns.XENC}"><xenc:EncryptionMethod Algorithm="{uri}"/>'
            f'<ds:KeyInfo xmlns:ds="{ns.DS}"><wsse:SecurityTokenReference xmlns:wsse="{ns.WSSE}">'
            f'<wsse:KeyIdentifier ValueType="{ns.THUMBPRINT_SHA1}" EncodingType="{ns.BASE64}">{thumbprint}'
            "</wsse:KeyIdentifier></wsse:SecurityTokenReference></ds:KeyInfo><xenc:CipherData><xenc:CipherValue>"
            f"{base64.b64encode(wrapped).decode()}</xenc:CipherValue></xenc:CipherData></xenc:EncryptedKey>")  # fmt: skip


def xmlsec_encrypted_key(pki: Path, secret: bytes, to: str = "gateway-enc") -> str:
    """The same made by libxmlsec1, as an IdP built on it does: `secret` (16, 24 or 32 bytes) is the session key of
    an EncryptedData template whose KeyInfo asks for an RSA-OAEP EncryptedKey to the `to` certificate; xmlsec wraps
    it there, and the EncryptedKey is taken out (it names no certificate: the gateway has one decryption key)."""
    data = xmlsec.template.encrypted_data_create(etree.Element("holder"), xmlsec.Transform.AES256_GCM, ns="xenc")
    xmlsec.template.encrypted_data_ensure_cipher_value(data)
    key_info = xmlsec.template.encrypted_data_ensure_key_info(data, ns="ds")
    xmlsec.template.encrypted_data_ensure_cipher_value(
        xmlsec.template.add_encrypted_key(key_info, xmlsec.Transform.RSA_OAEP)
    )
    manager = xmlsec.KeysManager()
    manager.add_key(xmlsec.Key.from_file(str(pki / f"{to}.pem"), xmlsec.constants.KeyDataFormatCertPem))
    ctx = xmlsec.EncryptionContext(manager)
    ctx.key = xmlsec.Key.from_binary_data(xmlsec.constants.KeyDataAes, secret)
    encrypted = ctx.encrypt_binary(data, b"unused")
    return etree.tostring(encrypted.find(f".//{{{ns.XENC}}}EncryptedKey")).decode()


def sign(xml: str | bytes, pki: Path, stem: str = "saml-idp") -> etree._Element:
    """Sign an assertion as an IdP does, with signxml: enveloped, exclusive C14N, RSA-SHA256, the certificate in
    KeyInfo; the Signature right after saml:Issuer (SAML 2.0) or last (1.1)."""
    root = etree.fromstring(xml.encode() if isinstance(xml, str) else xml)
    v2 = root.tag == ns.q(ns.SAML2, "Assertion")
    if v2:
        placeholder = etree.Element(ns.q(ns.DS, "Signature"), Id="placeholder", nsmap={"ds": ns.DS})
        root[0].addnext(placeholder)
    signer = XMLSigner(c14n_algorithm=CanonicalizationMethod.EXCLUSIVE_XML_CANONICALIZATION_1_0)
    signer.namespaces = {"ds": ns.DS}
    key = (pki / f"{stem}.key").read_bytes()
    cert = (pki / f"{stem}.pem").read_text()
    aid = root.get("ID" if v2 else "AssertionID")
    return signer.sign(root, key=key, cert=cert, reference_uri=aid, id_attribute="ID" if v2 else "AssertionID")


def sign_sha1(xml: str, pki: Path) -> etree._Element:
    """An assertion signed RSA-SHA1 / SHA-1 (libxmlsec1 directly: signxml no longer signs SHA-1)."""
    root = etree.fromstring(xml.encode())
    v2 = root.tag == ns.q(ns.SAML2, "Assertion")
    attr = "ID" if v2 else "AssertionID"
    tpl = xmlsec.template.create(root, xmlsec.Transform.EXCL_C14N, xmlsec.Transform.RSA_SHA1, ns="ds")
    root[0].addnext(tpl) if v2 else root.append(tpl)
    ref = xmlsec.template.add_reference(tpl, xmlsec.Transform.SHA1, uri=f"#{root.get(attr)}")
    xmlsec.template.add_transform(ref, xmlsec.Transform.ENVELOPED)
    xmlsec.template.add_transform(ref, xmlsec.Transform.EXCL_C14N)
    ctx = xmlsec.SignatureContext()
    ctx.key = xmlsec.Key.from_file(str(pki / "saml-idp.key"), xmlsec.constants.KeyDataFormatPem)
    ctx.register_id(root, attr)
    ctx.sign(tpl)
    return root


def write(tmp: Path, assertion: etree._Element) -> Path:
    path = tmp / f"assertion-{uuid.uuid4().hex}.xml"
    path.write_bytes(etree.tostring(assertion))
    return path


def client(route: Any, pki: Path, assertion_file: Path, signer: str = "client", proof_key: bytes | None = None
           ) -> Client:  # fmt: skip
    """The gateway's client sending `assertion_file` on `route`, signing as `signer` (a PKI stem), or with
    `proof_key` where the assertion confirms a symmetric key."""
    cfg = ClientConfig(certs=pki, key=f"{signer}.key", certificate=f"{signer}.pem", assertion=assertion_file,
                       proof_key=proof_key)  # fmt: skip
    return Client(route, cfg)
