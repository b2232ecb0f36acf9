"""WS-SecurityPolicy 1.1 (2005/07) and 1.2 (200702) assertions -> a route's profile and options.

One policy alternative of an operation's input (and one of its output) becomes the fields of a route
(gateway/policy.py). Whatever the gateway cannot enforce as the policy says is listed in `unmapped`, one line
each; where the gateway enforces something stronger than the policy (GCM for CBC, OAEP for RSA 1.5, an encrypted
UsernameToken for a readable one, a required Timestamp) it says so in `notes`. Nothing is weakened silently."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Protocol

from lxml import etree

from filters.engine import ns

SP = (ns.SP11, ns.SP12)
# Assertions about WS-Addressing use, not security: the gateway passes addressing headers as they are.
ADDRESSING_POLICY = {
    ("http://www.w3.org/2006/05/addressing/wsdl", "UsingAddressing"),
    ("http://www.w3.org/2007/05/addressing/metadata", "Addressing"),
    ("http://schemas.xmlsoap.org/ws/2004/08/addressing/policy", "UsingAddressing"),
    ("http://www.w3.org/2007/02/addressing/metadata", "Addressing"),
}
UNRESOLVED = "{urn:wsgate:import}UnresolvedPolicyReference"

PROFILE_STRENGTH = {"none": 0, "xml": 1, "tls": 2, "hmac": 3, "rsa": 4, "secureconversation": 4, "saml": 4}
DEMO_USERS = "certs/out/users.yaml"

# The suite's parts (WS-SecurityPolicy 1.2 section 6.1): digest, data encryption, key transport.
_SUITE = re.compile(r"^(Basic256|Basic192|Basic128|TripleDes)(Sha256)?(Rsa15)?$")
_GCM_FOR = {"Basic256": "aes256-gcm", "Basic128": "aes128-gcm"}
_IGNORED = {"Layout", "OnlySignEntireHeadersAndBody", "SignBeforeEncrypting"}


@dataclass
class Mapped:
    route: dict[str, object]  # profile and options (no name, match, upstream)
    notes: list[str] = field(default_factory=list)
    unmapped: list[str] = field(default_factory=list)
    usable: bool = True


class Definitions(Protocol):
    """What the mapping reads of a WSDL's policies (wsdl_import.Definitions, which imports this module)."""

    def nested(self, assertion: etree._Element, notes: list[str]) -> list[etree._Element]:
        """The first alternative of an assertion's nested wsp:Policy."""
        ...


@dataclass
class _State:
    defs: Definitions
    notes: list[str] = field(default_factory=list)
    unmapped: list[str] = field(default_factory=list)
    fatal: list[str] = field(default_factory=list)
    profile: str = "xml"
    binding: str = ""
    suite: str | None = None
    timestamp: bool = False
    parts: list[str] = field(default_factory=lambda: ["body"])
    encrypt_request: bool = False
    encrypt_response: bool = False
    username: str | None = None  # None | "plain" | "signed" | "encrypted"
    password_types: list[str] = field(default_factory=lambda: ["digest", "text"])
    client_certificate: bool = False
    bootstrap_asymmetric: bool = False
    encrypt_signature: bool = False
    trust: str | None = None
    encrypt_first: bool = False  # EncryptBeforeSigning: CBC is taken as the gateway takes it (signed ciphertext)
    rsa_sha256: bool = False  # Metro's signatureAlgorithm="SHA256withRSA" on the AlgorithmSuite
    saml: str | None = None  # a SamlToken/IssuedToken: its subject confirmation, as the token's place implies
    saml_versions: list[str] = field(default_factory=list)
    derived_keys: bool = False  # the SecureConversationToken says sp:RequireDerivedKeys


def _sp(el: etree._Element) -> str | None:
    """The assertion's local name when it is WS-SecurityPolicy 1.1 or 1.2, else None."""
    if not isinstance(el.tag, str):
        return None
    q = etree.QName(el)
    return q.localname if q.namespace in SP else None


def _name(el: etree._Element) -> str:
    q = etree.QName(el)
    return q.localname if q.namespace in SP else f"{{{q.namespace}}}{q.localname}"


def map_policy(defs: Definitions, request: list[list[etree._Element]], response: list[list[etree._Element]]) -> Mapped:
    """The first request alternative the gateway can enforce (with the first output alternative), mapped."""
    first: Mapped | None = None
    for index, alternative in enumerate(request):
        got = _map(defs, alternative, response[0] if response else [])
        if got.usable:
            if index:
                got.notes.insert(0, f"policy alternative {index + 1} of {len(request)} taken: the first the gateway "
                                    "can enforce")  # fmt: skip
            elif len(request) > 1:
                got.notes.insert(0, f"policy alternative 1 of {len(request)} taken")
            return got
        first = first or got
    assert first is not None
    return first


def _map(defs: Definitions, alternative: list[etree._Element], output: list[etree._Element]) -> Mapped:
    st = _State(defs)
    for assertion in alternative:
        _assertion(st, assertion, request=True)
    bindings = {"TransportBinding", "AsymmetricBinding", "SymmetricBinding"}
    for assertion in output:
        if _sp(assertion) == "SignedParts":
            continue  # the gateway signs its responses on every WS-Security route
        if _sp(assertion) == "EncryptedParts":
            _encrypted_parts(st, assertion, request=False)
        elif _sp(assertion) not in bindings and assertion not in alternative:
            _assertion(st, assertion, request=False)
    if not alternative and not output:
        st.notes.append("no WS-Policy attached: an `xml` route (well-formed, bounded XML; no WS-Security)")
    elif st.profile == "xml" and not st.fatal and not st.saml:
        st.notes.append("no security binding (Transport, Asymmetric, Symmetric) in the policy: an `xml` route")
        if st.username:
            st.unmapped.append("UsernameToken without a security binding: the gateway checks tokens only on "
                               "hmac, rsa and secureconversation routes; it reaches the backend unchecked")  # fmt: skip
    route = _route(st)
    return Mapped(route, st.notes, st.unmapped + st.fatal, usable=not st.fatal)


def _assertion(st: _State, el: etree._Element, request: bool) -> None:
    name = _sp(el)
    if el.tag == UNRESOLVED:
        st.fatal.append(f"wsp:PolicyReference {el.get('URI')}: {el.get('why')}")
    elif name == "TransportBinding":
        _transport(st, el)
    elif name == "AsymmetricBinding":
        _asymmetric(st, el)
    elif name == "SymmetricBinding":
        _symmetric(st, el)
    elif name == "SignedParts":
        _signed_parts(st, el)
    elif name == "EncryptedParts":
        _encrypted_parts(st, el, request)
    elif name in ("SupportingTokens", "SignedSupportingTokens", "EncryptedSupportingTokens",
                  "SignedEncryptedSupportingTokens", "EndorsingSupportingTokens", "SignedEndorsingSupportingTokens",
                  "EndorsingEncryptedSupportingTokens", "SignedEndorsingEncryptedSupportingTokens"):  # fmt: skip
        _supporting(st, el, name)
    elif name in ("Wss10", "Wss11"):
        for inner in st.defs.nested(el, st.notes):
            if _sp(inner) == "RequireSignatureConfirmation":
                st.unmapped.append(f"{name}/RequireSignatureConfirmation: the gateway's responses carry no "
                                   "SignatureConfirmation")  # fmt: skip
    elif name in ("Trust10", "Trust13"):
        st.trust = name  # meaningful only with a SecureConversationToken (see _route)
    elif (etree.QName(el).namespace, etree.QName(el).localname) in ADDRESSING_POLICY:
        st.notes.append("WS-Addressing is used: its headers pass to the backend (signed ones verified)")
    else:
        st.unmapped.append(f"{_name(el)}: not an assertion the gateway enforces")


def _transport(st: _State, el: etree._Element) -> None:
    st.profile, st.binding = "tls", "TransportBinding"
    for inner in st.defs.nested(el, st.notes):
        name = _sp(inner)
        if name == "TransportToken":
            for token in st.defs.nested(inner, st.notes):
                if _sp(token) != "HttpsToken":
                    st.fatal.append(f"TransportToken {_name(token)}: the gateway's transport is HTTPS")
                    continue
                params = {_sp(p) for p in st.defs.nested(token, st.notes)}
                if token.get("RequireClientCertificate") == "true" or "RequireClientCertificate" in params:
                    st.client_certificate = True
                if params & {"HttpBasicAuthentication", "HttpDigestAuthentication"}:
                    st.unmapped.append("HttpsToken HTTP authentication: not checked by the gateway (the backend's)")
        elif name == "AlgorithmSuite":
            st.notes.append("AlgorithmSuite under TransportBinding: TLS cipher suites are Envoy's, not the policy's")
        elif name == "IncludeTimestamp":
            st.timestamp = True
        elif name not in _IGNORED:
            st.unmapped.append(f"TransportBinding/{_name(inner)}")


def _x509(st: _State, holder: etree._Element, role: str) -> bool:
    """Whether the token assertion under InitiatorToken/RecipientToken/ProtectionToken is an X.509 token."""
    for token in st.defs.nested(holder, st.notes):
        if role == "InitiatorToken" and _saml_token(st, token):
            st.saml = "holder-of-key"  # the message is signed with the key the assertion confirms
            return True
        if _sp(token) == "X509Token":
            if role == "InitiatorToken" and (
                token.get(f"{{{ns.SP12}}}IncludeToken") or token.get(f"{{{ns.SP11}}}IncludeToken") or ""
            ).endswith("/Never"):
                st.notes.append("the client's certificate is referenced, not sent: list it in rsa.known_certificates")
            return True
        st.fatal.append(f"{role} {_name(token)}: the gateway takes X.509 tokens only")
    return False


def _binding_common(st: _State, inner: etree._Element, binding: str) -> None:
    name = _sp(inner)
    if name == "EncryptBeforeSigning":
        st.encrypt_first = True
    elif name == "AlgorithmSuite":
        st.rsa_sha256 = st.rsa_sha256 or inner.get("signatureAlgorithm") == "SHA256withRSA"
        suites = [_name(s) for s in st.defs.nested(inner, st.notes)]
        st.suite = suites[0] if suites else None
        for extra in suites[1:]:
            if extra == "InclusiveC14N":
                st.unmapped.append("AlgorithmSuite/InclusiveC14N: the gateway canonicalizes with exclusive C14N")
            elif extra not in ("STRTransform10", "XPath10", "SOAPNormalization10"):
                st.unmapped.append(f"AlgorithmSuite/{extra}")
    elif name == "IncludeTimestamp":
        st.timestamp = True
    elif name == "EncryptSignature":
        st.encrypt_signature = True
    elif name == "ProtectTokens":
        st.unmapped.append(f"{binding}/ProtectTokens: the gateway does not require the signing token be signed")
    elif name == "Layout":
        for layout in st.defs.nested(inner, st.notes):
            if _sp(layout) != "Lax":
                st.notes.append(f"Layout {_name(layout)}: accepted in any order (the gateway reads headers laxly)")
    elif name not in _IGNORED:
        st.unmapped.append(f"{binding}/{_name(inner)}")


def _asymmetric(st: _State, el: etree._Element) -> None:
    st.profile, st.binding = "rsa", "AsymmetricBinding"
    for inner in st.defs.nested(el, st.notes):
        name = _sp(inner)
        if name in ("InitiatorToken", "InitiatorSignatureToken", "InitiatorEncryptionToken"):
            _x509(st, inner, name)
        elif name in ("RecipientToken", "RecipientSignatureToken", "RecipientEncryptionToken"):
            if _x509(st, inner, name):
                st.notes.append(f"{name}: the gateway's own certificate (rsa.certificate, rsa.decryption_key)")
        else:
            _binding_common(st, inner, "AsymmetricBinding")


def _symmetric(st: _State, el: etree._Element) -> None:
    st.profile, st.binding = "hmac", "SymmetricBinding"
    for inner in st.defs.nested(el, st.notes):
        name = _sp(inner)
        if name in ("ProtectionToken", "SignatureToken", "EncryptionToken"):
            for token in st.defs.nested(inner, st.notes):
                kind = _sp(token)
                if kind == "X509Token":
                    st.notes.append(f"{name} X509Token: the client's key travels in an EncryptedKey to the gateway's "
                                    "certificate (hmac.decryption_key)")  # fmt: skip
                elif kind == "SecureConversationToken":
                    st.profile = "secureconversation"
                    _bootstrap(st, token)
                else:
                    st.fatal.append(f"{name} {_name(token)}: the gateway takes X.509 and SecureConversation tokens")
        else:
            _binding_common(st, inner, "SymmetricBinding")


def _bootstrap(st: _State, token: etree._Element) -> None:
    for param in st.defs.nested(token, st.notes):
        if _sp(param) == "RequireDerivedKeys":
            st.derived_keys = True
        if _sp(param) != "BootstrapPolicy":
            continue  # RequireExternalUriReference...: the gateway names the SCT as the client asks
        inner = _State(st.defs)
        for assertion in st.defs.nested(param, st.notes):
            _assertion(inner, assertion, request=True)
        if inner.profile != "rsa" or inner.fatal:
            reasons = "; ".join(inner.fatal) or f"a {inner.binding or 'missing'} binding"
            st.fatal.append(f"SecureConversationToken BootstrapPolicy: the gateway issues contexts to X.509-signed "
                            f"requests (AsymmetricBinding), this one asks for {reasons}")  # fmt: skip
        st.bootstrap_asymmetric = True
        st.notes.append("the gateway issues the security contexts itself (WS-Trust Issue signed with X.509)")
        st.unmapped.extend(f"BootstrapPolicy: {u}" for u in inner.unmapped)


def _signed_parts(st: _State, el: etree._Element) -> None:
    for part in el:
        name = _sp(part)
        if name == "Body":
            continue
        # One WS-Addressing header or all of them (no Name): the gateway's `addressing` part signs every one.
        if name == "Header" and part.get("Namespace") in ns.ADDRESSING:
            if "addressing" not in st.parts:
                st.parts.append("addressing")
        elif name == "Header":
            header = f"{{{part.get('Namespace')}}}{part.get('Name') or '*'}"
            st.unmapped.append(f"SignedParts/Header {header}: the gateway signs Body, Timestamp, UsernameToken and "
                               "WS-Addressing headers only")  # fmt: skip
        elif name is not None:
            st.unmapped.append(f"SignedParts/{name}")


def _encrypted_parts(st: _State, el: etree._Element, request: bool) -> None:
    for part in el:
        name = _sp(part)
        if name == "Body":
            if request:
                st.encrypt_request = True
            else:
                st.encrypt_response = True
        elif name is not None:
            what = f"Header {{{part.get('Namespace')}}}{part.get('Name')}" if name == "Header" else name
            st.unmapped.append(f"EncryptedParts/{what}: the gateway encrypts the Body only")


def _supporting(st: _State, el: etree._Element, kind: str) -> None:
    for token in st.defs.nested(el, st.notes):
        name = _sp(token)
        if name == "UsernameToken" and "Endorsing" not in kind:
            st.username = "encrypted" if "Encrypted" in kind else "signed" if "Signed" in kind else "plain"
            params = {_sp(p) for p in st.defs.nested(token, st.notes)}
            if "HashPassword" in params:
                st.password_types = ["digest"]
            if "NoPassword" in params:
                st.unmapped.append(f"{kind}/UsernameToken NoPassword: the gateway checks passwords")
        elif _saml_token(st, token):
            if "Endorsing" in kind:
                st.fatal.append(f"{kind}/{_name(token)}: the gateway takes holder-of-key assertions as the message "
                                "signature's key (AsymmetricBinding InitiatorToken), not as a second signature")  # fmt: skip
            st.saml = "sender-vouches" if "Signed" in kind else "bearer"
        elif name in ("AlgorithmSuite", "SignedParts", "EncryptedParts", "SignedElements", "EncryptedElements"):
            st.unmapped.append(f"{kind}/{name}: parts listed under a supporting token")
        else:
            # A caller the policy authenticates by another token would be let in without it: no route.
            st.fatal.append(f"{kind}/{_name(token)}: the gateway takes UsernameTokens and SAML assertions as "
                            "supporting tokens only")  # fmt: skip


_SAML_VERSIONS = {"WssSamlV11Token10": "1.1", "WssSamlV11Token11": "1.1", "WssSamlV20Token11": "2.0"}
_TOKEN_TYPES = {ns.SAML_V2_TOKEN: "2.0", ns.SAML_V11_TOKEN: "1.1",
                "urn:oasis:names:tc:SAML:2.0:assertion": "2.0", "urn:oasis:names:tc:SAML:1.0:assertion": "1.1"}  # fmt: skip


def _saml_token(st: _State, token: etree._Element) -> bool:
    """Whether a token assertion is a SAML assertion (a SamlToken, or an IssuedToken whose template asks for
    one); its versions noted. An IssuedToken of another type is not."""
    name = _sp(token)
    if name == "SamlToken":
        versions = [_SAML_VERSIONS[n] for n in map(_sp, st.defs.nested(token, st.notes)) if n in _SAML_VERSIONS]
    elif name == "IssuedToken":
        template = next((c for c in token if _sp(c) == "RequestSecurityTokenTemplate"), None)
        types = (
            []
            if template is None
            else [(c.text or "").strip() for c in template if etree.QName(c).localname == "TokenType"]
        )
        if any(t not in _TOKEN_TYPES for t in types):
            return False
        versions = [_TOKEN_TYPES[t] for t in types]
        st.notes.append("IssuedToken: its issuer (the STS) is not the assertion's Issuer name: set saml.issuers")
    else:
        return False
    st.saml_versions = sorted({*st.saml_versions, *versions}) or ["2.0", "1.1"]
    return True


def _saml_route(st: _State, route: dict[str, object]) -> dict[str, object]:
    """A route whose policy asks for a SAML assertion: the `saml` profile, or no route where the binding gives the
    confirmation nothing to check (sender-vouches needs the attesting party's message signature)."""
    method = st.saml
    if method != "bearer" and st.binding != "AsymmetricBinding":
        st.fatal.append(f"SamlToken ({method}) under {st.binding or 'no binding'}: the gateway checks sender-vouches "
                        "and holder-of-key through an AsymmetricBinding's message signature")  # fmt: skip
    if st.binding == "TransportBinding" or not st.binding:
        route = {"timestamp": {"required": st.timestamp}}  # a saml route checks a Timestamp where there is one
        st.unmapped = [u for u in st.unmapped if not u.startswith("TransportBinding/IncludeTimestamp")]
        st.notes.append(
            "bearer assertion: taken over TLS, or on a message signed by a party rsa.trust_anchors vouch for"
        )
    st.notes.append("saml.issuers and saml.audiences are placeholders: name the identity provider, its signing "
                    "certificate and this service's audience (docs/saml.md)")  # fmt: skip
    options: dict[str, object] = {
        "issuers": [{"name": "urn:CHANGE-ME:issuer", "certificates": ["certs/out/saml-idp.pem"]}],
        "confirmation": [method], "audiences": ["urn:CHANGE-ME:audience"], "versions": st.saml_versions,
    }  # fmt: skip
    if method == "sender-vouches":
        options["attesting_certificates"] = ["certs/out/client.pem"]
        st.notes.append(
            "sender-vouches: saml.attesting_certificates lists who may vouch (a placeholder: the demo client)"
        )
    if route.get("profile") == "tls" and st.client_certificate:
        st.unmapped.append("RequireClientCertificate with a SAML assertion: the assertion names the caller")
    route = {k: v for k, v in route.items() if k not in ("profile", "tls")}
    return {"profile": "saml", **route, "saml": options}


def _algorithms(st: _State) -> tuple[list[str], list[str], dict[str, object]]:
    """Signature algorithms, digests and encryption options from the AlgorithmSuite."""
    keyed = "hmac" if st.profile in ("hmac", "secureconversation") else "rsa"
    suite = st.suite or "Basic256Sha256"
    if st.suite is None:
        st.notes.append("no AlgorithmSuite: the gateway's SHA-256 and AES-GCM defaults")
    m = _SUITE.match(suite)
    gcm = re.match(r"^(Basic256|Basic128|Basic192)GCM(Sha256)?$", suite)  # CXF's GCM suites
    if not m and not gcm:
        st.fatal.append(f"AlgorithmSuite {suite}: unknown to the gateway")
        return [f"{keyed}-sha256"], ["sha256"], {}
    base, sha256, rsa15 = (m.group(1), m.group(2), m.group(3)) if m else (gcm.group(1), gcm.group(2), None)  # type: ignore[union-attr]
    digest = "sha256" if sha256 else "sha1"
    if digest == "sha1":
        st.notes.append(f"AlgorithmSuite {suite}: SHA-1 signatures and digests, as the policy asks")
    rsa = "rsa-sha256" if st.rsa_sha256 else f"rsa-{digest}"
    # Every SP suite names HMAC-SHA1 for symmetric signatures (Metro signs nothing else); SHA-256 suites keep
    # HMAC-SHA256 first for the clients that sign with it. The reply answers in the algorithm the client used.
    algorithms = [rsa] if keyed == "rsa" else [f"hmac-{digest}", *(["hmac-sha1"] if digest == "sha256" else [])]
    if st.bootstrap_asymmetric:
        algorithms.insert(0, rsa)
    encryption: dict[str, object] = {}
    uses_encryption = st.encrypt_request or st.encrypt_response or st.profile in ("hmac", "secureconversation")
    uses_encryption = uses_encryption or st.encrypt_first
    data = _GCM_FOR.get(base)
    if data is None:
        if st.encrypt_request or st.encrypt_response:
            st.fatal.append(f"AlgorithmSuite {suite}: {base} data encryption is not supported by the gateway")
        else:
            st.unmapped.append(f"AlgorithmSuite {suite}: {base} encryption is not supported (nothing is encrypted)")
        return algorithms, [digest], encryption
    if uses_encryption:
        if not gcm and st.encrypt_first:
            cbc = data.replace("-gcm", "-cbc")
            st.notes.append(f"AlgorithmSuite {suite} with EncryptBeforeSigning: {cbc} taken as the gateway takes CBC "
                            f"(single-use keys, signed ciphertext), {data} too; replies in {cbc}")  # fmt: skip
            encryption = {"data_algorithms": [data, cbc], "response_algorithm": cbc,
                          "key_transport": ["rsa-oaep-mgf1p"]}  # fmt: skip
        else:
            if not gcm:
                st.notes.append(f"AlgorithmSuite {suite}: {base} asks for AES-CBC, the gateway takes {data} (CBC is "
                                "open to padding-oracle attacks); clients must encrypt with GCM")  # fmt: skip
            encryption = {"data_algorithms": [data], "response_algorithm": data, "key_transport": ["rsa-oaep-mgf1p"]}
        if rsa15:
            st.notes.append(f"AlgorithmSuite {suite}: RSA 1.5 key transport refused (Bleichenbacher), RSA-OAEP taken")
    return algorithms, [digest], encryption


def _route(st: _State) -> dict[str, object]:
    route = _security_route(st)
    return _saml_route(st, route) if st.saml else route


def _security_route(st: _State) -> dict[str, object]:
    route: dict[str, object] = {"profile": st.profile}
    if st.profile == "xml":
        return route
    if st.profile == "tls":
        if st.client_certificate:
            route["tls"] = {"require_client_certificate": True}
        if st.timestamp:
            st.unmapped.append("TransportBinding/IncludeTimestamp: tls routes do not check Timestamps")
        if st.username:
            st.unmapped.append("UsernameToken over TransportBinding: tls routes do not check UsernameTokens "
                               "(the backend does)")  # fmt: skip
        return route
    algorithms, digests, encryption = _algorithms(st)
    if not st.timestamp:
        st.notes.append("no IncludeTimestamp: the gateway still requires a signed Timestamp (replay window); "
                        "set timestamp.required: false to accept clients that send none")  # fmt: skip
    parts = list(st.parts)
    parts.insert(1, "timestamp")
    if st.username in ("signed", "encrypted"):
        parts.append("username_token")
    route["timestamp"] = {"required": True}
    route["signature"] = {"algorithms": algorithms, "digests": digests, "parts": parts}
    if st.encrypt_request or st.encrypt_response or encryption:
        enc: dict[str, object] = {"require_request": st.encrypt_request, "encrypt_response": st.encrypt_response}
        route["encryption"] = {**enc, **encryption}
    if st.encrypt_signature and st.encrypt_response:
        route["encryption"]["encrypt_signature"] = True  # type: ignore[index]
        st.notes.append("EncryptSignature: an encrypted request Signature is accepted; the response's Signature is "
                        "encrypted with its Body")  # fmt: skip
    elif st.encrypt_signature:
        st.unmapped.append("EncryptSignature (responses): the response Body is not encrypted, so neither is its "
                           "Signature")  # fmt: skip
    if st.profile in ("rsa", "secureconversation"):  # secureconversation: the Issue request is checked like rsa
        route["rsa"] = {"trust_anchors": ["certs/out/ca.pem"], "key": "certs/out/gateway-sign.key",
                        "certificate": "certs/out/gateway-sign.pem", "decryption_key": "certs/out/gateway-enc.key",
                        "sign_response": True}  # fmt: skip
    if st.profile == "hmac":
        anonymous = st.username is None
        if anonymous:
            st.notes.append("SymmetricBinding with no supporting token names no caller: hmac.allow_anonymous "
                            "(the backend is told `anonymous`)")  # fmt: skip
        route["hmac"] = {"keys_file": None, "allow_anonymous": anonymous, "decryption_key": "certs/out/gateway-enc.key"}
    elif st.profile == "secureconversation":
        if st.trust:
            st.notes.append(f"{st.trust}: the gateway answers WS-Trust Issue/Cancel for its contexts (1.3 and 2005/02)")
        route["secureconversation"] = {"store": "sealed", "master_keys_file": "certs/out/sct-master-keys.yaml",
                                       "derived_keys": st.derived_keys}  # fmt: skip
    if st.trust and st.profile != "secureconversation":
        st.unmapped.append(f"{st.trust}: no token service at the gateway for this route")
    if st.username:
        protection = "encrypted"
        if st.username != "encrypted":
            st.notes.append(f"UsernameToken ({st.username} supporting token): the gateway requires it encrypted "
                            "(a readable token can be captured and re-bound)")  # fmt: skip
        route["username_token"] = {"required": True, "users_file": DEMO_USERS, "password_types": st.password_types,
                                   "protection": protection}  # fmt: skip
    return route


# `wsgate import --outbound`: the partner's files, for the operator to provide (docs/outbound.md).
PARTNER_FILES = {
    "ca": "certs/out/partner-ca.pem",  # the partner's TLS and signing CA
    "certificate": "certs/out/partner.pem",  # what requests are encrypted to
    "credentials": "certs/out/partner-credentials.yaml",  # the UsernameToken the partner expects
}


def as_outbound(route: dict[str, object], listen: str, mapped: Mapped) -> bool:
    """The other side of the mapping: the route a partner's policy asks of its callers, for the gateway calling
    it on the applications' behalf (`direction: outbound`). The same fields, seen from the partner: what it
    requires encrypted the gateway encrypts, what it encrypts the gateway requires so. False: nothing to secure."""
    profile = route["profile"]
    if profile not in ("rsa", "hmac", "secureconversation"):
        mapped.unmapped.append(f"profile {profile}: an outbound route secures rsa, hmac or secureconversation")
        return False
    upstream = route["upstream"]
    assert isinstance(upstream, dict)
    if not upstream.get("tls"):
        mapped.unmapped.append("the partner's address is http: the gateway calls partners over HTTPS only")
    upstream.update(tls=True, ca=PARTNER_FILES["ca"])
    out: dict[str, object] = {"listen": listen, "partner_certificate": PARTNER_FILES["certificate"]}
    route["rsa"] = {"trust_anchors": [PARTNER_FILES["ca"]], "key": "certs/out/gateway-sign.key",
                    "certificate": "certs/out/gateway-sign.pem", "decryption_key": "certs/out/gateway-enc.key"}  # fmt: skip
    mapped.notes.append(f"the partner's files: {', '.join(PARTNER_FILES.values())}; rsa.allowed_subjects may "
                        "name the partner's signing certificate")  # fmt: skip
    if profile == "hmac":
        route["hmac"] = {"keys_file": None, "decryption_key": "certs/out/gateway-enc.key"}
    sc_options = route.pop("secureconversation", None)
    if isinstance(sc_options, dict) and not sc_options["derived_keys"]:
        route["secureconversation"] = {"derived_keys": False}  # the partner's store is its own: only how keys go
    ut = route.pop("username_token", None)
    if isinstance(ut, dict):
        types = ut.get("password_types") or ["digest"]
        out["credentials_file"] = PARTNER_FILES["credentials"]
        out["password_type"] = "digest" if "digest" in types else "text"  # type: ignore[operator]
        route["username_token"] = {"protection": ut.get("protection", "none")}
    route["direction"] = "outbound"
    route["outbound"] = out
    return True
