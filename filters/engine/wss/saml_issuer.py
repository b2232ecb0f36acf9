"""SAML 2.0 assertions the gateway issues (docs/saml.md): for the backend, sender-vouches by the gateway (who
called, how and when they were authenticated, for the backend's audience, valid briefly), and from the WS-Trust
endpoint (bearer, or holder-of-key for the caller's certificate).

Each assertion is signed by itself: an enveloped ds:Signature after the Issuer, exclusive C14N, RSA-SHA256 with
the issuer's key (a PEM file or a PKCS#11 token key: the canonical SignedInfo is signed through `key.sign`, so a
token key never leaves its token). The verifier needs the issuer's certificate, also sent in the KeyInfo."""

from __future__ import annotations

import base64
import hashlib
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timedelta

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from lxml import etree

from filters.engine import faults, ns
from filters.engine.wss import keys
from filters.engine.wss.timestamp import format_datetime, parse_datetime
from filters.engine.wss.wssecurity import ANONYMOUS, Verified
from filters.engine.xml.soap import Envelope
from gateway.policy import BackendAssertion, SamlIssuing

NAMEID_X509 = "urn:oasis:names:tc:SAML:1.1:nameid-format:X509SubjectName"
NAMEID_UNSPECIFIED = "urn:oasis:names:tc:SAML:1.1:nameid-format:unspecified"
AC_X509 = "urn:oasis:names:tc:SAML:2.0:ac:classes:X509"
AC_PASSWORD = "urn:oasis:names:tc:SAML:2.0:ac:classes:Password"
AC_UNSPECIFIED = "urn:oasis:names:tc:SAML:2.0:ac:classes:unspecified"
ATTRIBUTE_NAME_FORMAT = "urn:oasis:names:tc:SAML:2.0:attrname-format:unspecified"  # 1.1 names are not URIs

_EXC_C14N = "http://www.w3.org/2001/10/xml-exc-c14n#"
_ENVELOPED = "http://www.w3.org/2000/09/xmldsig#enveloped-signature"
_RSA_SHA256 = "http://www.w3.org/2001/04/xmldsig-more#rsa-sha256"
_SHA256 = "http://www.w3.org/2001/04/xmlenc#sha256"


def _saml(local: str) -> str:
    return ns.q(ns.SAML2, local)


def _ds(local: str) -> str:
    return ns.q(ns.DS, local)


@dataclass(frozen=True)
class Identity:
    """Who the gateway vouches for: the subject (NameID and its format), how and when it was authenticated, and
    verified attributes (name -> values)."""

    subject: str
    name_format: str
    authn_context: str
    authn_instant: datetime
    attributes: tuple[tuple[str, tuple[str, ...]], ...] = ()


def identity_of(verified: Verified, now: datetime, attribute_names: Collection[str] = ()) -> Identity:
    """The identity a request's Security header established: a SAML assertion's subject (`saml` routes), the
    context's bootstrap signer (authenticated when the context was issued), the X.509 signer, the UsernameToken's
    user, a pre-shared key's name. An anonymous request has none (the route model refuses the combination; this
    is the last line). `attribute_names`: the assertion attributes the route takes (saml.attribute_headers)."""
    if verified.assertion is not None:
        return _asserted(verified.assertion.element, verified.assertion.issue_instant, attribute_names)
    subject = verified.subject
    if subject is None or subject == ANONYMOUS:
        raise faults.server("no verified caller to vouch for in the backend's assertion")
    if verified.context is not None:
        return Identity(subject, NAMEID_X509, AC_X509, verified.context.created)
    if verified.signer_certificate is not None:
        return Identity(subject, NAMEID_X509, AC_X509, now)
    if verified.username is not None and subject == verified.username:
        return Identity(subject, NAMEID_UNSPECIFIED, AC_PASSWORD, now)
    return Identity(subject, NAMEID_UNSPECIFIED, AC_UNSPECIFIED, now)  # "key:<name>": a pre-shared key


# Where a SAML 2.0 and a SAML 1.1 assertion say who, how, when and what: (NameID, its Format attribute, the
# authentication method, the authentication instant attribute, Attribute, the attribute's name attribute).
_SAML_PATHS = {
    ns.SAML2: ("saml2:Subject/saml2:NameID", "Format", "saml2:AuthnStatement/saml2:AuthnContext/saml2:AuthnContextClassRef",
               "saml2:AuthnStatement", "AuthnInstant", "saml2:AttributeStatement/saml2:Attribute", "Name"),
    ns.SAML1: ("saml1:*/saml1:Subject/saml1:NameIdentifier", "Format", None, "saml1:AuthenticationStatement",
               "AuthenticationInstant", "saml1:AttributeStatement/saml1:Attribute", "AttributeName"),
}  # fmt: skip
_PREFIXES = {"saml2": ns.SAML2, "saml1": ns.SAML1}


def _asserted(el: etree._Element, issued: datetime, attribute_names: Collection[str]) -> Identity:
    """The identity an assertion the route verified states, read from that very element: its subject and format,
    the issuer's authentication method and instant (the assertion's IssueInstant when it has none), and the
    attributes the route takes."""
    name_path, format_attr, method_path, statement_path, instant_attr, attr_path, attr_name = _SAML_PATHS[
        etree.QName(el).namespace
    ]
    name_id = el.find(name_path, _PREFIXES)
    statement = el.find(statement_path, _PREFIXES)
    if name_id is None or not (name_id.text or "").strip():
        raise faults.server("the verified assertion has no subject to vouch for")
    if method_path is not None:
        method = el.findtext(method_path, namespaces=_PREFIXES)
    else:
        method = statement.get("AuthenticationMethod") if statement is not None else None
    try:
        instant = parse_datetime(statement.get(instant_attr, "")) if statement is not None else issued
    except ValueError:
        instant = issued
    attributes = tuple(
        (a.get(attr_name, ""), tuple((v.text or "").strip() for v in a if etree.QName(v).localname == "AttributeValue"))
        for a in el.iterfind(attr_path, _PREFIXES)
        if a.get(attr_name) in attribute_names
    )
    return Identity(name_id.text.strip(), name_id.get(format_attr) or NAMEID_UNSPECIFIED,
                    (method or AC_UNSPECIFIED).strip(), instant, attributes)  # fmt: skip


class Issuer:
    """Issues assertions signed with one key; built once per route (the key parsed or its token opened once)."""

    def __init__(self, policy: SamlIssuing) -> None:
        self.name = policy.issuer
        self.lifetime = timedelta(seconds=policy.lifetime_s)
        self.key = keys.load_private_key(policy.key)
        certificate = keys.load_certificate(policy.certificate)
        public = certificate.public_key()  # of another kind (an EdDSA one has no numbers): not the key's either
        if (
            not isinstance(public, rsa.RSAPublicKey)
            or public.public_numbers() != self.key.public_key().public_numbers()
        ):
            raise faults.server(f"SAML issuer: certificate {policy.certificate} is not the key's")
        self.certificate_b64 = base64.b64encode(certificate.public_bytes(serialization.Encoding.DER)).decode()

    def issue(
        self,
        identity: Identity,
        *,
        audience: str,
        now: datetime,
        confirmation: str = ns.SAML2_SENDER_VOUCHES,
        holder: x509.Certificate | None = None,
    ) -> etree._Element:
        """A signed assertion (a standalone element: append it where it goes). `holder`: the certificate a
        holder-of-key assertion confirms."""
        if (confirmation == ns.SAML2_HOLDER_OF_KEY) != (holder is not None):
            raise ValueError("a holder-of-key assertion, and only one, names the holder's certificate")
        expires = format_datetime(now + self.lifetime)
        assertion_id = f"_{uuid.uuid4().hex}"
        root = etree.Element(_saml("Assertion"), nsmap={"saml2": ns.SAML2})
        root.set("ID", assertion_id)
        root.set("IssueInstant", format_datetime(now))
        root.set("Version", "2.0")
        etree.SubElement(root, _saml("Issuer")).text = self.name
        subject = etree.SubElement(root, _saml("Subject"))
        name_id = etree.SubElement(subject, _saml("NameID"), Format=identity.name_format)
        name_id.text = identity.subject
        sc = etree.SubElement(subject, _saml("SubjectConfirmation"), Method=confirmation)
        if confirmation == ns.SAML2_SENDER_VOUCHES:  # the attesting entity: the gateway
            etree.SubElement(sc, _saml("NameID"), Format=NAMEID_UNSPECIFIED).text = self.name
        data = etree.SubElement(sc, _saml("SubjectConfirmationData"), NotOnOrAfter=expires)
        if holder is not None:
            data.set(ns.q(ns.XSI, "type"), "saml2:KeyInfoConfirmationDataType")
            der = base64.b64encode(holder.public_bytes(serialization.Encoding.DER)).decode()
            info = etree.SubElement(data, _ds("KeyInfo"), nsmap={"ds": ns.DS})
            etree.SubElement(etree.SubElement(info, _ds("X509Data")), _ds("X509Certificate")).text = der
        conditions = etree.SubElement(root, _saml("Conditions"), NotBefore=format_datetime(now), NotOnOrAfter=expires)
        restriction = etree.SubElement(conditions, _saml("AudienceRestriction"))
        etree.SubElement(restriction, _saml("Audience")).text = audience
        authn = etree.SubElement(root, _saml("AuthnStatement"), AuthnInstant=format_datetime(identity.authn_instant))
        context = etree.SubElement(authn, _saml("AuthnContext"))
        etree.SubElement(context, _saml("AuthnContextClassRef")).text = identity.authn_context
        if identity.attributes:
            statement = etree.SubElement(root, _saml("AttributeStatement"))
            for name, values in identity.attributes:
                attribute = etree.SubElement(statement, _saml("Attribute"), Name=name, NameFormat=ATTRIBUTE_NAME_FORMAT)
                for value in values:
                    etree.SubElement(attribute, _saml("AttributeValue")).text = value
        self._sign(root, assertion_id)
        return root

    def _sign(self, assertion: etree._Element, assertion_id: str) -> None:
        """Enveloped signature: the digest of the assertion as it is now is the digest of the signed assertion
        without its Signature (the enveloped-signature transform), both in exclusive C14N."""
        digest = hashlib.sha256(etree.tostring(assertion, method="c14n", exclusive=True)).digest()
        sig = etree.Element(_ds("Signature"), nsmap={"ds": ns.DS})
        info = etree.SubElement(sig, _ds("SignedInfo"))
        etree.SubElement(info, _ds("CanonicalizationMethod"), Algorithm=_EXC_C14N)
        etree.SubElement(info, _ds("SignatureMethod"), Algorithm=_RSA_SHA256)
        ref = etree.SubElement(info, _ds("Reference"), URI=f"#{assertion_id}")
        transforms = etree.SubElement(ref, _ds("Transforms"))
        etree.SubElement(transforms, _ds("Transform"), Algorithm=_ENVELOPED)
        etree.SubElement(transforms, _ds("Transform"), Algorithm=_EXC_C14N)
        etree.SubElement(ref, _ds("DigestMethod"), Algorithm=_SHA256)
        etree.SubElement(ref, _ds("DigestValue")).text = base64.b64encode(digest).decode()
        assertion.insert(1, sig)  # after the Issuer (the SAML schema's order)
        signed_info = etree.tostring(info, method="c14n", exclusive=True)
        value = self.key.sign(signed_info, padding.PKCS1v15(), hashes.SHA256())
        etree.SubElement(sig, _ds("SignatureValue")).text = base64.b64encode(value).decode()
        x509_data = etree.SubElement(etree.SubElement(sig, _ds("KeyInfo")), _ds("X509Data"))
        etree.SubElement(x509_data, _ds("X509Certificate")).text = self.certificate_b64


def saml_id_reference(assertion: etree._Element) -> etree._Element:
    """A wsse:SecurityTokenReference to an assertion by its ID (the SAML Token Profile's KeyIdentifier)."""
    ref = etree.Element(ns.q(ns.WSSE, "SecurityTokenReference"), nsmap={"wsse": ns.WSSE, "wsse11": ns.WSSE11})
    ref.set(ns.q(ns.WSSE11, "TokenType"), ns.SAML_V2_TOKEN)
    ident = etree.SubElement(ref, ns.q(ns.WSSE, "KeyIdentifier"), ValueType=ns.SAML_ID)
    ident.text = assertion.get("ID")
    return ref


# What a backend could take for the gateway's assertion, in any namespace: none of the client's may reach it.
_LOOKALIKES = {"Security", "Assertion", "EncryptedAssertion"}


def for_backend(
    env: Envelope,
    issuer: Issuer,
    policy: BackendAssertion,
    verified: Verified,
    now: datetime,
    attribute_names: Collection[str] = (),
) -> dict[str, str]:
    """Put a fresh sender-vouches assertion of the verified caller into what the backend gets: a wsse:Security
    header block of `env`, or the HTTP header returned. The request is refused when its forwarded header blocks
    still hold a Security header or an assertion (signed, or forwarded unsigned by the route's rules): the
    backend must find the gateway's and no other."""
    header = env.header
    if header is not None:
        for el in header.iter(etree.Element):
            if etree.QName(el).localname in _LOOKALIKES and el is not header:
                raise faults.security("InvalidSecurity", f"a forwarded header holds {str(el.tag)[:120]}")
    assertion = issuer.issue(identity_of(verified, now, attribute_names), audience=policy.audience, now=now)
    if policy.placement == "http_header":
        return {policy.header: base64.b64encode(etree.tostring(assertion)).decode()}
    if header is None:
        header = etree.Element(ns.q(env.soap_ns, "Header"))
        env.root.insert(0, header)
    security = etree.SubElement(header, ns.q(ns.WSSE, "Security"), nsmap={"wsse": ns.WSSE})
    security.append(assertion)
    return {}
