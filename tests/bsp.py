"""A WS-I Basic Security Profile 1.1 checker for the messages WSGate sends (tests only).

One function per rule, named by its id, its docstring the rule's text (as WSS4J's BSPRule enum words it). Each
takes the parsed message and returns the violations it found. `violations(message)` runs them all; which rules
are here and which are left out (with the reason) is in docs/interop.md's BSP section.

What the checker sees is the message on the wire: an encrypted part's rules are checked on its EncryptedData,
and a Signature sent encrypted is checked on the same message sent with its Signature in the clear (the
Signature is encrypted after it is made, unchanged)."""

from __future__ import annotations

import base64
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from cryptography import x509
from lxml import etree

from filters.engine import ns
from filters.engine.wss import secure_conversation as sc

WSSE, WSU, DS, XENC = ns.WSSE, ns.WSU, ns.DS, ns.XENC
SECURITY = ns.q(WSSE, "Security")
TIMESTAMP = ns.q(WSU, "Timestamp")
CREATED = ns.q(WSU, "Created")
EXPIRES = ns.q(WSU, "Expires")
STR = ns.q(WSSE, "SecurityTokenReference")
REFERENCE = ns.q(WSSE, "Reference")
KEY_IDENTIFIER = ns.q(WSSE, "KeyIdentifier")
BST = ns.q(WSSE, "BinarySecurityToken")
UT = ns.q(WSSE, "UsernameToken")
SIGNATURE = ns.q(DS, "Signature")
KEY_INFO = ns.q(DS, "KeyInfo")
EK = ns.q(XENC, "EncryptedKey")
ED = ns.q(XENC, "EncryptedData")
REFERENCE_LIST = ns.q(XENC, "ReferenceList")
DATA_REFERENCE = ns.q(XENC, "DataReference")
METHOD = ns.q(XENC, "EncryptionMethod")
INCLUSIVE = ns.q(ns.EXC_C14N, "InclusiveNamespaces")
WSU_ID = ns.q(WSU, "Id")
EXC_C14N = "http://www.w3.org/2001/10/xml-exc-c14n#"
TRANSFORMS_ALLOWED = {
    EXC_C14N,
    "http://www.w3.org/2002/06/xmldsig-filter2",
    "http://docs.oasis-open.org/wss/2004/01/oasis-200401-wss-soap-message-security-1.0#STR-Transform",
    "http://www.w3.org/2000/09/xmldsig#enveloped-signature",
}
ENVELOPED = "http://www.w3.org/2000/09/xmldsig#enveloped-signature"
# R5620's list, and the GCM modes BSP 1.1 (2006) predates: WSGate sends AES-GCM unless the route asks for CBC.
BSP_DATA = {XENC + "tripledes-cbc", XENC + "aes128-cbc", XENC + "aes256-cbc"}
GCM_DATA = {ns.XENC11 + "aes128-gcm", ns.XENC11 + "aes256-gcm"}
KEY_TRANSPORT = {XENC + "rsa-1_5", XENC + "rsa-oaep-mgf1p"}
SCT_TYPES = {v.sct_token_type: v for v in sc.VERSIONS}
DKT_TYPES = {v.dk_token_type: v for v in sc.VERSIONS}
UTC_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:(\d\d)(\.\d+)?Z")
SHORTHAND = re.compile(r"#[^\W\d][\w.\-]*")


@dataclass
class Message:
    root: etree._Element
    ids: dict[str, etree._Element] = field(default_factory=dict)
    order: dict[etree._Element, int] = field(default_factory=dict)

    @classmethod
    def parse(cls, xml: bytes) -> Message:
        root = etree.fromstring(xml)
        m = cls(root)
        for i, el in enumerate(root.iter()):
            m.order[el] = i
            for attr in (WSU_ID, "Id"):
                if el.get(attr):
                    m.ids[el.get(attr)] = el
        return m

    def all(self, tag: str) -> list[etree._Element]:
        return list(self.root.iter(tag))

    def headers(self) -> list[etree._Element]:
        return self.all(SECURITY)

    def target(self, ref: etree._Element) -> etree._Element | None:
        uri = ref.get("URI") or ""
        return self.ids.get(uri[1:]) if uri.startswith("#") else None


Rule = Callable[[Message], list[str]]
RULES: list[Rule] = []


def rule(fn: Rule) -> Rule:
    RULES.append(fn)
    return fn


def _children(el: etree._Element) -> list[etree._Element]:
    return [c for c in el if isinstance(c.tag, str)]


def _each(items: Iterator[tuple[bool, str]]) -> list[str]:
    return [what for ok, what in items if not ok]


# --- Timestamp ----------------------------------------------------------------------------------------------


@rule
def r3203_timestamp_has_exactly_one_created(m: Message) -> list[str]:
    """A TIMESTAMP MUST contain exactly one CREATED."""
    return _each((len(ts.findall(CREATED)) == 1, "Timestamp without exactly one Created") for ts in m.all(TIMESTAMP))


@rule
def r3224_timestamp_at_most_one_expires(m: Message) -> list[str]:
    """Any TIMESTAMP MUST NOT contain more than one EXPIRES."""
    return _each((len(ts.findall(EXPIRES)) <= 1, "Timestamp with several Expires") for ts in m.all(TIMESTAMP))


@rule
def r3221_created_precedes_expires(m: Message) -> list[str]:
    """Any TIMESTAMP containing an EXPIRES MUST contain a CREATED that precedes its sibling EXPIRES."""
    out = []
    for ts in m.all(TIMESTAMP):
        tags = [c.tag for c in _children(ts)]
        if EXPIRES in tags and (CREATED not in tags or tags.index(CREATED) > tags.index(EXPIRES)):
            out.append("Expires before Created")
    return out


@rule
def r3222_timestamp_holds_only_created_and_expires(m: Message) -> list[str]:
    """Any TIMESTAMP MUST NOT contain anything other than CREATED or EXPIRES elements."""
    return _each((c.tag in (CREATED, EXPIRES), f"Timestamp child {c.tag}") for ts in m.all(TIMESTAMP) for c in ts)


def _times(m: Message, tag: str) -> list[etree._Element]:
    return [t for ts in m.all(TIMESTAMP) for t in ts.findall(tag)]


@rule
def r3220_r3229_at_most_milliseconds(m: Message) -> list[str]:
    """Any CREATED / EXPIRES SHOULD NOT contain a seconds value with more than three digits to the right of the
    decimal (milliseconds)."""
    out = []
    for t in _times(m, CREATED) + _times(m, EXPIRES):
        got = UTC_TIME.fullmatch(t.text or "")
        if got and got.group(2) and len(got.group(2)) > 4:
            out.append(f"{t.text}: more than milliseconds")
    return out


@rule
def r3213_r3215_seconds_below_60(m: Message) -> list[str]:
    """Any CREATED / EXPIRES containing second values MUST specify seconds values less than 60."""
    out = []
    for t in _times(m, CREATED) + _times(m, EXPIRES):
        got = UTC_TIME.fullmatch(t.text or "")
        if got and int(got.group(1)) >= 60:
            out.append(f"{t.text}: seconds >= 60")
    return out


@rule
def r3225_r3226_no_value_type_on_times(m: Message) -> list[str]:
    """Any CREATED / EXPIRES MUST NOT include a ValueType attribute."""
    return _each((t.get("ValueType") is None, "ValueType on a time") for t in _times(m, CREATED) + _times(m, EXPIRES))


@rule
def r3217_r3223_times_in_utc(m: Message) -> list[str]:
    """Any CREATED / EXPIRES MUST contain time values in UTC format as specified by the XML Schema type
    (dateTime)."""
    return _each(
        (UTC_TIME.fullmatch(t.text or "") is not None, f"{t.text!r} not UTC")
        for t in _times(m, CREATED) + _times(m, EXPIRES)
    )


@rule
def r3227_one_timestamp_per_security_header(m: Message) -> list[str]:
    """A SECURITY_HEADER MUST NOT contain more than one TIMESTAMP."""
    return _each((len(h.findall(TIMESTAMP)) <= 1, "several Timestamps") for h in m.headers())


# --- SecurityTokenReference ---------------------------------------------------------------------------------


@rule
def r3061_str_has_exactly_one_reference(m: Message) -> list[str]:
    """A SECURITY_TOKEN_REFERENCE MUST provide exactly one token reference."""
    return _each((len(_children(s)) == 1, f"STR with {len(_children(s))} references") for s in m.all(STR))


@rule
def r3027_str_holds_no_key_name(m: Message) -> list[str]:
    """Any SECURITY_TOKEN_REFERENCE MUST NOT contain an STR_KEY_NAME."""
    return _each((s.find(ns.q(DS, "KeyName")) is None, "ds:KeyName in an STR") for s in m.all(STR))


@rule
def r3062_r5204_reference_uri(m: Message) -> list[str]:
    """Any STR_REFERENCE MUST specify a URI attribute (R3062); one to an INTERNAL_SECURITY_TOKEN having an ID
    attribute MUST contain a URI attribute with a Shorthand XPointer value (R5204)."""
    out = []
    for ref in m.all(REFERENCE):
        uri = ref.get("URI")
        if not uri:
            out.append("wsse:Reference without URI")
        elif uri.startswith("#") and not SHORTHAND.fullmatch(uri):
            out.append(f"{uri!r} is not a shorthand XPointer")
    return out


def _token_type(el: etree._Element) -> str | None:
    """The ValueType its token profile gives a token element."""
    if el.tag == BST:
        return el.get("ValueType")
    if el.tag == EK:
        return ns.ENCKEY_TOKEN
    for v in sc.VERSIONS:
        if el.tag == ns.q(v.wsc, "SecurityContextToken"):
            return v.sct_token_type
        if el.tag == ns.q(v.wsc, "DerivedKeyToken"):
            return v.dk_token_type
    return None


@rule
def r3059_r3058_reference_value_type(m: Message) -> list[str]:
    """Any STR_REFERENCE MUST specify a ValueType attribute, except to a SAML 2.0, Kerberos or EncryptedKey token
    (R3059); it MUST be the value the referenced token's profile specifies (R3058). A reference to a pre-shared
    key names a token outside the message that no profile covers: WSGate's own ValueType (ns.PRE_SHARED_KEY)."""
    out = []
    for ref in m.all(REFERENCE):
        value_type, target = ref.get("ValueType"), m.target(ref)
        if target is None:
            if value_type not in (ns.PRE_SHARED_KEY, *SCT_TYPES):
                out.append(f"reference to a token outside the message with ValueType {value_type!r}")
            continue
        if value_type is None and target.tag != EK:
            out.append(f"reference to {target.tag} without ValueType")
        elif value_type is not None and value_type != _token_type(target):
            out.append(f"ValueType {value_type} for a {target.tag}")
    return out


@rule
def r3057_r3211_reference_targets_a_token(m: Message) -> list[str]:
    """Any STR_REFERENCE MUST NOT reference a SECURITY_TOKEN_REFERENCE (R3057) nor a ds:KeyInfo (R3211)."""
    out = []
    for ref in m.all(REFERENCE):
        target = m.target(ref)
        if target is not None and target.tag in (STR, KEY_INFO):
            out.append(f"reference to a {target.tag}")
    return out


@rule
def r5205_token_precedes_its_references(m: Message) -> list[str]:
    """Any INTERNAL_SECURITY_TOKEN that is not contained in an STR_EMBEDDED MUST precede all
    SECURITY_TOKEN_REFERENCE elements that reference it in the SOAP_ENVELOPE."""
    out = []
    for ref in m.all(REFERENCE):
        target = m.target(ref)
        if target is not None and m.order[target] > m.order[ref]:
            out.append(f"{target.tag} after a reference to it")
    return out


@rule
def r3054_r3063_r3070_r3071_key_identifier(m: Message) -> list[str]:
    """Any STR_KEY_IDENTIFIER MUST specify a ValueType attribute (R3054) that its token profile specifies (R3063);
    one to a token other than SAML MUST specify an EncodingType (R3070) of Base64Binary (R3071)."""
    known = {ns.X509_SKI, ns.THUMBPRINT_SHA1, ns.ENCKEY_SHA1}
    out = []
    for ki in m.all(KEY_IDENTIFIER):
        if ki.get("ValueType") not in known:
            out.append(f"KeyIdentifier ValueType {ki.get('ValueType')!r}")
        if ki.get("EncodingType") != ns.BASE64:
            out.append(f"KeyIdentifier EncodingType {ki.get('EncodingType')!r}")
    return out


@rule
def r3069_r3072_encrypted_key_references(m: Message) -> list[str]:
    """Any SECURITY_TOKEN_REFERENCE to an ENCRYPTED_KEY_TOKEN MUST contain a wsse11:TokenType of #EncryptedKey
    (R3069); a KeyIdentifier in it MUST have the ValueType #EncryptedKeySHA1 (R3072)."""
    out = []
    token_type = ns.q(ns.WSSE11, "TokenType")
    for s in m.all(STR):
        form = _children(s)[0] if _children(s) else None
        to_ek = form is not None and (
            (form.tag == REFERENCE and (t := m.target(form)) is not None and t.tag == EK)
            or (form.tag == KEY_IDENTIFIER and form.get("ValueType") == ns.ENCKEY_SHA1)
        )
        if to_ek and s.get(token_type) != ns.ENCKEY_TOKEN:
            out.append("STR to an EncryptedKey without wsse11:TokenType")
        if s.get(token_type) == ns.ENCKEY_TOKEN and form is not None and form.tag == KEY_IDENTIFIER:
            if form.get("ValueType") != ns.ENCKEY_SHA1:
                out.append("KeyIdentifier to an EncryptedKey that is not EncryptedKeySHA1")
    return out


@rule
def r3074_token_type_matches(m: Message) -> list[str]:
    """Any wsse11:TokenType attribute in a SECURITY_TOKEN_REFERENCE MUST specify a value that a TokenType specified
    by a security token profile for the referenced SECURITY_TOKEN."""
    out = []
    for s in m.all(STR):
        token_type = s.get(ns.q(ns.WSSE11, "TokenType"))
        ref = s.find(REFERENCE)
        target = m.target(ref) if ref is not None else None
        if token_type is not None and target is not None and _token_type(target) != token_type:
            out.append(f"TokenType {token_type} for a {target.tag}")
    return out


@rule
def r3022_internal_tokens_by_reference(m: Message) -> list[str]:
    """Any SECURITY_TOKEN_REFERENCE that references an INTERNAL_SECURITY_TOKEN which has a wsu:Id attribute MUST
    contain an STR_REFERENCE or STR_EMBEDDED: a KeyIdentifier or IssuerSerial naming a BinarySecurityToken of the
    same message breaks it."""
    tokens = [b for b in m.all(BST)]
    out = []
    for s in m.all(STR):
        form = _children(s)[0] if _children(s) else None
        if form is not None and form.tag != REFERENCE and form.tag != ns.q(WSSE, "Embedded") and tokens:
            if form.get("ValueType") in (ns.X509_SKI, ns.THUMBPRINT_SHA1) or form.tag == ns.q(DS, "X509Data"):
                if _names_a_token_here(form, tokens):
                    out.append("an in-message certificate named by KeyIdentifier/IssuerSerial")
    return out


def _names_a_token_here(form: etree._Element, tokens: list[etree._Element]) -> bool:
    serial = form.findtext(f".//{{{DS}}}X509SerialNumber")
    for bst in tokens:
        cert = x509.load_der_x509_certificate(base64.b64decode(bst.text or ""))
        if serial is not None and int(serial) == cert.serial_number:
            return True
    return False


@rule
def r5218_reference_to_x509_value_type(m: Message) -> list[str]:
    """Any STR_REFERENCE to a X509_TOKEN MUST contain a ValueType attribute with the value #X509v3."""
    out = []
    for ref in m.all(REFERENCE):
        target = m.target(ref)
        if target is not None and target.tag == BST and ref.get("ValueType") != ns.X509V3:
            out.append("reference to an X.509 token without ValueType X509v3")
    return out


@rule
def r5409_issuer_serial_dname(m: Message) -> list[str]:
    """Any STR_ISSUER_SERIAL MUST contain a value following the encoding rules specified in the XML Signature
    specification for DNames (RFC 2253)."""
    out = []
    for name in m.all(ns.q(DS, "X509IssuerName")):
        try:
            x509.Name.from_rfc4514_string(name.text or "")
        except ValueError:
            out.append(f"X509IssuerName {name.text!r} is not an RFC 2253 DName")
    return out


# --- Signature ----------------------------------------------------------------------------------------------


def _references(m: Message) -> Iterator[tuple[etree._Element, etree._Element]]:
    for sig in m.all(SIGNATURE):
        info = sig.find(ns.q(DS, "SignedInfo"))
        for ref in info.findall(ns.q(DS, "Reference")) if info is not None else []:
            yield sig, ref


@rule
def r3102_r5403_not_enveloping_no_manifest(m: Message) -> list[str]:
    """A SIGNATURE MUST NOT be an Enveloping Signature (R3102: no ds:Object) and MUST NOT contain a ds:Manifest
    descendant element (R5403)."""
    out = []
    for sig in m.all(SIGNATURE):
        if sig.find(ns.q(DS, "Object")) is not None:
            out.append("enveloping signature (ds:Object)")
        if next(sig.iter(ns.q(DS, "Manifest")), None) is not None:
            out.append("ds:Manifest")
    return out


@rule
def r3103_r3104_detached(m: Message) -> list[str]:
    """A SIGNATURE SHOULD be a Detached Signature (R3103) and SHOULD NOT be an Enveloped Signature (R3104)."""
    out = []
    for sig, ref in _references(m):
        target = m.target(ref)
        if target is not None and (target is sig or sig in set(target.iter())):
            out.append("enveloped signature")
        if any(t.get("Algorithm") == ENVELOPED for t in ref.iter(ns.q(DS, "Transform"))):
            out.append("enveloped-signature transform")
    return out


@rule
def r3001_r3003_r3004_r3005_shorthand_references(m: Message) -> list[str]:
    """Any SIG_REFERENCE SHOULD contain a URI with a Shorthand XPointer (R3001); to a Signature, to an XML
    Encryption element, to anything else: the Local ID attribute of XML Signature (R3003), of XML Encryption
    (R3004), a wsu:Id (R3005)."""
    out = []
    for _, ref in _references(m):
        uri = ref.get("URI") or ""
        if not SHORTHAND.fullmatch(uri):
            out.append(f"signature reference {uri!r}")
            continue
        target = m.target(ref)
        if target is None:
            continue  # encrypted on the wire
        want = "Id" if etree.QName(target).namespace in (DS, XENC) else WSU_ID
        if target.get(want) != uri[1:]:
            out.append(f"{target.tag} referenced by another attribute than {want}")
    return out


@rule
def r5416_r5411_r5412_r5423_transforms(m: Message) -> list[str]:
    """Any SIG_REFERENCE MUST contain a SIG_TRANSFORMS (R5416) with at least one SIG_TRANSFORM (R5411), each of the
    allowed algorithms (R5423), the last exclusive C14N (or STR-Transform, attachment transforms) (R5412)."""
    out = []
    for _, ref in _references(m):
        transforms = ref.find(ns.q(DS, "Transforms"))
        items = transforms.findall(ns.q(DS, "Transform")) if transforms is not None else []
        if transforms is None or not items:
            out.append("reference without transforms")
            continue
        out += [f"transform {t.get('Algorithm')}" for t in items if t.get("Algorithm") not in TRANSFORMS_ALLOWED]
        if items[-1].get("Algorithm") != EXC_C14N:
            out.append("last transform is not exclusive C14N")
    return out


@rule
def r5404_r5406_canonicalization(m: Message) -> list[str]:
    """Any CANONICALIZATION_METHOD Algorithm MUST be exclusive C14N without comments (R5404); its
    INCLUSIVE_NAMESPACES carries a PrefixList (R5406)."""
    out = []
    for method in m.all(ns.q(DS, "CanonicalizationMethod")):
        if method.get("Algorithm") != EXC_C14N:
            out.append(f"CanonicalizationMethod {method.get('Algorithm')}")
        out += [
            "InclusiveNamespaces without PrefixList" for i in method.findall(INCLUSIVE) if i.get("PrefixList") is None
        ]
    return out


def _expected_prefixes(el: etree._Element) -> set[str]:
    """Prefixes in scope at `el` that `el` does not use visibly (its own name and attributes): what an exclusive
    C14N PrefixList must name to protect them (WSS4J's choice: every such prefix)."""
    parent = el.getparent()
    inherited = dict(parent.nsmap) if parent is not None else {}
    visible = {el.prefix} | {etree.QName(a).namespace for a in el.attrib if a.startswith("{")}
    out = set()
    for prefix, uri in inherited.items():
        if prefix in visible or uri in visible or el.nsmap.get(prefix) != uri:
            continue
        out.add("#default" if prefix is None else prefix)
    return out


@rule
def r5407_r5405_r5408_inclusive_namespaces(m: Message) -> list[str]:
    """Any exclusive C14N SIG_TRANSFORM MUST contain an INCLUSIVE_NAMESPACES with a PrefixList unless the list is
    empty (R5407), naming every prefix in scope and not visibly used (R5405), "#default" for a default namespace
    (R5408)."""
    out = []
    for _, ref in _references(m):
        target = m.target(ref)
        for t in ref.iter(ns.q(DS, "Transform")):
            if t.get("Algorithm") != EXC_C14N or target is None:
                continue
            inclusive = t.find(INCLUSIVE)
            listed = set((inclusive.get("PrefixList") or "").split()) if inclusive is not None else set()
            missing = _expected_prefixes(target) - listed
            if missing:
                out.append(f"PrefixList of {target.tag} misses {sorted(missing)}")
    return out


@rule
def r5401_no_hmac_output_length(m: Message) -> list[str]:
    """Any SIGNATURE_METHOD MUST NOT contain a ds:HMACOutputLength child element."""
    return ["HMACOutputLength" for _ in m.all(ns.q(DS, "HMACOutputLength"))]


def _sig_key_infos(m: Message) -> list[etree._Element]:
    return [ki for sig in m.all(SIGNATURE) for ki in sig.findall(KEY_INFO)]


@rule
def r5402_sig_key_info_one_child(m: Message) -> list[str]:
    """Any SIG_KEY_INFO MUST contain exactly one child element."""
    return _each((len(_children(ki)) == 1, "signature KeyInfo children") for ki in _sig_key_infos(m))


@rule
def r5417_sig_key_info_holds_a_security_token_reference(m: Message) -> list[str]:
    """Any SIG_KEY_INFO MUST contain a SECURITY_TOKEN_REFERENCE child element."""
    return _each(
        (any(c.tag == STR for c in _children(ki)), "signature KeyInfo without STR") for ki in _sig_key_infos(m)
    )


@rule
def r5440_no_encrypted_data_in_a_signature(m: Message) -> list[str]:
    """A SIGNATURE MUST NOT have any xenc:EncryptedData elements amongst its descendants."""
    return ["EncryptedData in a Signature" for sig in m.all(SIGNATURE) if next(sig.iter(ED), None) is not None]


# --- Encryption ---------------------------------------------------------------------------------------------


@rule
def r3228_no_encrypted_data_header_block(m: Message) -> list[str]:
    """A soap:Header element in a SECURE_ENVELOPE MUST NOT contain any child ENCRYPTED_DATA."""
    header = m.root.find(ns.q(etree.QName(m.root).namespace, "Header"))
    return ["EncryptedData as a header block" for c in (header if header is not None else []) if c.tag == ED]


def _reference_lists(m: Message) -> list[tuple[etree._Element, list[str]]]:
    """Every ReferenceList (standalone or in an EncryptedKey) with the ids it names."""
    out = []
    for rl in m.all(REFERENCE_LIST):
        out.append((rl, [(d.get("URI") or "") for d in rl.findall(DATA_REFERENCE)]))
    return out


@rule
def r5608_r3006_data_references(m: Message) -> list[str]:
    """Any ENC_DATA_REFERENCE (R5608) or EK_DATA_REFERENCE (R3006) MUST contain a URI with a Shorthand XPointer to
    the Id of the referenced ENCRYPTED_DATA."""
    out = []
    for _, uris in _reference_lists(m):
        for uri in uris:
            target = m.ids.get(uri[1:]) if SHORTHAND.fullmatch(uri) else None
            if target is None or target.tag != ED or target.get("Id") != uri[1:]:
                out.append(f"DataReference {uri!r} names no EncryptedData by Id")
    return out


@rule
def r3231_r3214_every_encrypted_data_listed(m: Message) -> list[str]:
    """Any ENC_REFERENCE_LIST (R3231) / EK_REFERENCE_LIST (R3214) MUST contain a DataReference for each
    ENCRYPTED_DATA produced in the associated encryption step."""
    listed = {uri[1:] for _, uris in _reference_lists(m) for uri in uris}
    return [f"EncryptedData {ed.get('Id')} in no ReferenceList" for ed in m.all(ED) if ed.get("Id") not in listed]


def _key_name(ed: etree._Element) -> bytes | None:
    ki = ed.find(KEY_INFO)
    return etree.tostring(_children(ki)[0], method="c14n", exclusive=True) if ki is not None and _children(ki) else None


@rule
def r3205_one_key_per_reference_list(m: Message) -> list[str]:
    """Any ENC_REFERENCE_LIST produced as part of an encryption step MUST use a single key."""
    out = []
    for rl, uris in _reference_lists(m):
        if rl.getparent() is not None and rl.getparent().tag == EK:
            continue  # an EncryptedKey's list: its one key by construction
        names = {_key_name(m.ids[u[1:]]) for u in uris if u[1:] in m.ids}
        if len(names) > 1:
            out.append("ReferenceList over EncryptedData under different keys")
    return out


@rule
def r3208_encrypted_key_precedes_its_data(m: Message) -> list[str]:
    """Any ENCRYPTED_KEY MUST precede any ENCRYPTED_DATA in the same SECURITY_HEADER referenced by the associated
    EK_REFERENCE_LIST."""
    out = []
    for ek in m.all(EK):
        for d in ek.iter(DATA_REFERENCE):
            ed = m.ids.get((d.get("URI") or "")[1:])
            if ed is not None and ed.getparent() is ek.getparent() and m.order[ed] < m.order[ek]:
                out.append("EncryptedData before its EncryptedKey")
    return out


@rule
def r3209_r5622_r5623_r5602_r5603_encrypted_key_shape(m: Message) -> list[str]:
    """Any ENCRYPTED_KEY MUST NOT specify a Type (R3209), MimeType (R5622), Encoding (R5623) or Recipient (R5602)
    attribute, and MUST contain an xenc:EncryptionMethod (R5603)."""
    out = []
    for ek in m.all(EK):
        out += [f"EncryptedKey {a}" for a in ("Type", "MimeType", "Encoding", "Recipient") if ek.get(a) is not None]
        if ek.find(METHOD) is None:
            out.append("EncryptedKey without EncryptionMethod")
    return out


@rule
def r5629_unlisted_encrypted_data_has_key_info(m: Message) -> list[str]:
    """An ENCRYPTED_DATA which is not referenced from an ENCRYPTED_KEY MUST contain a ds:KeyInfo."""
    from_ek = {(d.get("URI") or "")[1:] for ek in m.all(EK) for d in ek.iter(DATA_REFERENCE)}
    return [
        f"EncryptedData {ed.get('Id')} without KeyInfo"
        for ed in m.all(ED)
        if ed.get("Id") not in from_ek and ed.find(KEY_INFO) is None
    ]


@rule
def r5601_encrypted_data_method(m: Message) -> list[str]:
    """Any ENCRYPTED_DATA MUST contain an xenc:EncryptionMethod child element."""
    return ["EncryptedData without EncryptionMethod" for ed in m.all(ED) if ed.find(METHOD) is None]


@rule
def r5424_r5426_enc_key_info(m: Message) -> list[str]:
    """Any ENC_KEY_INFO (a ds:KeyInfo of an EncryptedKey or EncryptedData) MUST have exactly one child element
    (R5424), a SECURITY_TOKEN_REFERENCE (R5426)."""
    out = []
    for el in m.all(EK) + m.all(ED):
        ki = el.find(KEY_INFO)
        if ki is not None and [c.tag for c in _children(ki)] != [STR]:
            out.append(f"{el.tag} KeyInfo holds {[c.tag for c in _children(ki)]}")
    return out


@rule
def r5620_data_encryption_algorithm(m: Message) -> list[str]:
    """Any ED_ENCRYPTION_METHOD Algorithm MUST be tripledes-cbc, aes128-cbc or aes256-cbc. AES-GCM (XML Encryption
    1.1, after BSP 1.1) is taken too: WSGate's default, and what WSS4J itself accepts and sends."""
    return [
        f"data algorithm {ed.find(METHOD).get('Algorithm')}"
        for ed in m.all(ED)
        if ed.find(METHOD) is not None and ed.find(METHOD).get("Algorithm") not in BSP_DATA | GCM_DATA
    ]


@rule
def r5621_r5626_key_transport(m: Message) -> list[str]:
    """When used for Key Transport, any EK_ENCRYPTION_METHOD Algorithm MUST be rsa-1_5 or rsa-oaep-mgf1p."""
    return [
        f"key transport {ek.find(METHOD).get('Algorithm')}"
        for ek in m.all(EK)
        if ek.find(METHOD) is not None and ek.find(METHOD).get("Algorithm") not in KEY_TRANSPORT
    ]


# --- Tokens -------------------------------------------------------------------------------------------------


@rule
def r3029_r3030_r3031_r3032_r3033_binary_security_token(m: Message) -> list[str]:
    """Any BINARY_SECURITY_TOKEN MUST specify an EncodingType (R3029) of Base64Binary (R3030) and a ValueType
    (R3031) its profile specifies (R3032); an X509_TOKEN's is #X509v3 (R3033)."""
    out = []
    for bst in m.all(BST):
        if bst.get("EncodingType") != ns.BASE64:
            out.append(f"BST EncodingType {bst.get('EncodingType')!r}")
        if bst.get("ValueType") != ns.X509V3:
            out.append(f"BST ValueType {bst.get('ValueType')!r}")
    return out


def _ut_children(m: Message, local: str) -> list[list[etree._Element]]:
    return [ut.findall(ns.q(WSSE if local != "Created" else WSU, local)) for ut in m.all(UT)]


@rule
def r4222_r4223_r4225_one_password_created_nonce(m: Message) -> list[str]:
    """Any USERNAME_TOKEN MUST NOT have more than one PASSWORD (R4222), CREATED (R4223) or NONCE (R4225)."""
    return [f"UsernameToken with several {local}" for local in ("Password", "Created", "Nonce")
            for found in _ut_children(m, local) if len(found) > 1]  # fmt: skip


@rule
def r4201_password_type(m: Message) -> list[str]:
    """Any PASSWORD MUST specify a Type attribute."""
    return ["Password without Type" for found in _ut_children(m, "Password") for p in found if not p.get("Type")]


@rule
def r4220_r4221_nonce_encoding_type(m: Message) -> list[str]:
    """Any NONCE MUST specify an EncodingType attribute (R4220) of Base64Binary (R4221)."""
    return [
        f"Nonce EncodingType {n.get('EncodingType')!r}"
        for found in _ut_children(m, "Nonce")
        for n in found
        if n.get("EncodingType") != ns.BASE64
    ]


@rule
def r4214_r4215_references_to_username_tokens(m: Message) -> list[str]:
    """Any STR_REFERENCE to a USERNAME_TOKEN MUST have the ValueType #UsernameToken (R4214); an STR to one MUST NOT
    be a KeyIdentifier (R4215)."""
    ut_type = "http://docs.oasis-open.org/wss/2004/01/oasis-200401-wss-username-token-profile-1.0#UsernameToken"
    out = []
    for ref in m.all(REFERENCE):
        target = m.target(ref)
        if target is not None and target.tag == UT and ref.get("ValueType") != ut_type:
            out.append("reference to a UsernameToken with another ValueType")
    return out


def violations(xml: bytes) -> list[str]:
    """Every BSP violation found in `xml`, each "<rule function>: <what>"."""
    m = Message.parse(xml)
    return [f"{r.__name__}: {what}" for r in RULES for what in r(m)]
