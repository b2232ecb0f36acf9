"""WS-SecurityPolicy 1.2 (WS-Policy 1.5) for a published WSDL: what the gateway enforces towards clients.

The `hmac`, `rsa` and `secureconversation` profiles take the WS-Security header off before the backend sees the
message, so whatever policy the backend's WSDL states describes a hop clients never talk to: it is removed and the
route's own policy put in its place, referenced from every SOAP binding. `tls` adds a TransportBinding when the
WSDL states no policy (the message itself reaches the backend as sent, so a policy it states still holds);
`none` and `xml` publish the WSDL's policy as it is.

Modest on purpose (docs/interop.md "The published WSDL"): the bindings, tokens, timestamp, signed and
encrypted Body (one EncryptedParts for both directions), supporting UsernameTokens, an algorithm suite with
Metro's signatureAlgorithm attribute, EncryptBeforeSigning where CBC is taken, wsam:Addressing, and for
secureconversation derived keys and a bootstrap policy. Left out: AES-GCM (no SP suite names it: the suite named
is the CBC one of the same key size and digest), pre-shared keys named by ds:KeyName (no SP token describes
them), the accepted algorithm lists beyond the first and per-operation policies. `gaps` names what a route takes
differently from what its policy can say (`wsgate check` prints it)."""

from __future__ import annotations

from lxml import etree

from filters.engine import ns
from gateway.policy import Route

SOAP_BINDINGS = (ns.q(ns.WSDL_SOAP11, "binding"), ns.q(ns.WSDL_SOAP12, "binding"))
_INCLUDE = f"{ns.SP12}/IncludeToken/"
_REPLACED = ("hmac", "rsa", "secureconversation")
# Metro's (WSIT's) unqualified attribute on sp:AlgorithmSuite naming the asymmetric signature algorithm.
METRO_SIGNATURE_ALGORITHM = "signatureAlgorithm"


def rewrite(definitions: etree._Element, route: Route) -> None:
    """Put the route's client-facing policy into a WSDL document (a copy: it is changed in place). An outbound
    route's applications send plain SOAP: the partner's policy is removed and none put in its place."""
    if route.is_outbound:
        _strip(definitions)
        return
    if route.profile in _REPLACED:
        _strip(definitions)
    elif route.profile != "tls" or _has_policy(definitions):
        return
    bindings = [b for b in definitions.iterfind(f"{{{ns.WSDL}}}binding") if _soap_binding(b)]
    if not bindings:
        return
    policy_id = f"WSGate-{route.name}"
    policy = etree.Element(
        f"{{{ns.WSP}}}Policy", {f"{{{ns.WSU}}}Id": policy_id}, nsmap={"wsp": ns.WSP, "sp": ns.SP12, "wsu": ns.WSU}
    )
    policy.append(_element("wsp:ExactlyOne", {}, [_all(route)]))
    etree.cleanup_namespaces(policy)
    documentation = definitions.find(f"{{{ns.WSDL}}}documentation")
    definitions.insert(0 if documentation is None else definitions.index(documentation) + 1, policy)
    for binding in bindings:
        doc = binding.find(f"{{{ns.WSDL}}}documentation")
        binding.insert(
            0 if doc is None else binding.index(doc) + 1, _element("wsp:PolicyReference", {"URI": f"#{policy_id}"})
        )


def gaps(route: Route) -> list[str]:
    """What the route's published policy cannot say, or says differently from what the route takes (`wsgate
    check` prints them): WS-SecurityPolicy's suites name RSA-SHA1, HMAC-SHA1 and AES-CBC, whatever the digest."""
    if route.profile not in _REPLACED:
        return []
    sig, enc = route.signature, route.encryption
    notes = []
    if route.profile != "hmac" and "rsa-sha1" not in sig.algorithms:
        notes.append(
            "X.509 signatures: the SP suite names RSA-SHA1, which this route refuses; RSA-SHA256 is asked "
            "for in Metro's signatureAlgorithm attribute only (CXF and WSS4J clients are configured for it)"
        )
    if route.profile != "rsa" and "hmac-sha1" not in sig.algorithms:
        notes.append(
            "symmetric signatures: every SP suite names HMAC-SHA1, the only one Metro signs with, and this "
            "route refuses it (list hmac-sha1 in signature.algorithms for such clients)"
        )
    encrypts = enc.require_request or enc.encrypt_response or route.profile == "secureconversation"
    if encrypts and not accepts_cbc(route):
        notes.append(
            "encryption: the SP suite names AES-CBC and this route takes GCM only: clients are configured "
            "for GCM (CXF's cxf:Basic256GCM suite names SHA-1 digests); Metro 4 has no GCM"
        )
    if enc.require_request != enc.encrypt_response and route.profile != "secureconversation":
        notes.append(
            "encryption: EncryptedParts is stated for requests and replies alike; this route requires "
            + ("requests encrypted, replies not" if enc.require_request else "replies encrypted only")
        )
    if "rsa-oaep-mgf1p" not in enc.key_transport:
        notes.append("key transport: the SP suites name RSA-OAEP with MGF1-SHA1 (rsa-oaep-mgf1p), not listed here")
    if route.accepts_username_tokens and route.username_token.required and "username_token" not in sig.parts:
        notes.append(
            "UsernameToken: published unsigned; Metro encrypts it anyway, which is taken only signed "
            "(list username_token in signature.parts)"
        )
    return notes  # fmt: skip


def _has_policy(root: etree._Element) -> bool:
    return any(
        el.tag.startswith((f"{{{ns.WSP}}}", f"{{{ns.WSP_2004}}}")) for el in root.iter() if isinstance(el.tag, str)
    )


def _strip(root: etree._Element) -> None:
    """Every WS-Policy element and PolicyURIs attribute, both WS-Policy versions."""
    for el in [
        e for e in root.iter() if isinstance(e.tag, str) and e.tag.startswith((f"{{{ns.WSP}}}", f"{{{ns.WSP_2004}}}"))
    ]:
        parent = el.getparent()
        if parent is not None:
            parent.remove(el)
    for el in root.iter():
        for name in [a for a in el.attrib if a in (f"{{{ns.WSP}}}PolicyURIs", f"{{{ns.WSP_2004}}}PolicyURIs")]:
            del el.attrib[name]


def _soap_binding(binding: etree._Element) -> bool:
    return any(binding.find(tag) is not None for tag in SOAP_BINDINGS)


def _all(route: Route) -> etree._Element:
    """The one alternative the route accepts."""
    if route.profile == "tls":
        https = _nested(
            "sp:HttpsToken", [_element("sp:RequireClientCertificate")] if route.tls.require_client_certificate else []
        )
        binding = _nested("sp:TransportBinding", [_nested("sp:TransportToken", [https]), _suite(route), _layout()])
        return _element("wsp:All", {}, [binding])
    parts = [_binding(route), _wss(route), *_protected_parts(route), *_supporting(route), *_addressing(route)]
    return _element("wsp:All", {}, parts)


def _addressing(route: Route) -> list[etree._Element]:
    """wsam:Addressing where the route uses WS-Addressing: WS-Trust exchanges (secureconversation) need it, and a
    route that signs the addressing headers needs them sent. Optional: the backend's replies carry addressing
    headers only if the backend writes them (the gateway's own WS-Trust replies always do)."""
    if route.profile != "secureconversation" and "addressing" not in route.signature.parts:
        return []
    return [_element("wsam:Addressing", {f"{{{ns.WSP}}}Optional": "true"}, [_element("wsp:Policy")])]


def _binding(route: Route) -> etree._Element:
    timestamp = [_element("sp:IncludeTimestamp")] if route.timestamp.required else []
    # CBC is taken only as signed ciphertext (filters/engine/wss/wssecurity._check_cbc), and answered so.
    order = [_element("sp:EncryptBeforeSigning")] if accepts_cbc(route) else []
    suite = _suite(route, asymmetric=route.profile == "rsa")
    common = [suite, _layout(), *timestamp, *order, _element("sp:OnlySignEntireHeadersAndBody")]
    if route.profile == "rsa":
        return _nested("sp:AsymmetricBinding", [
            _nested("sp:InitiatorToken", [_x509("AlwaysToRecipient")]),
            _nested("sp:RecipientToken", [_x509("Never")]),
            *common,
        ])  # fmt: skip
    if route.profile == "hmac":
        return _nested("sp:SymmetricBinding", [_nested("sp:ProtectionToken", [_x509("Never")]), *common])
    bootstrap = _nested("sp:BootstrapPolicy", _bootstrap(route))
    derived = [_element("sp:RequireDerivedKeys")] if route.secureconversation.derived_keys else []
    sct = _element("sp:SecureConversationToken", {f"{{{ns.SP12}}}IncludeToken": _INCLUDE + "AlwaysToRecipient"},
                   [_element("wsp:Policy", {}, [*derived, bootstrap])])  # fmt: skip
    return _nested("sp:SymmetricBinding", [_nested("sp:ProtectionToken", [sct]), *common])


def _bootstrap(route: Route) -> list[etree._Element]:
    """The Issue exchange: signed like an `rsa` request, its Body encrypted both ways (the client's entropy and the
    issuer's stay secret: the key is computed from both, filters/engine/conversation/ws_trust.answer_issue)."""
    signed = [_element("sp:Body"), _element("sp:Header", {"Namespace": ns.WSA})]
    trust = ["MustSupportIssuedTokens", "RequireClientEntropy", "RequireServerEntropy"]
    return [
        _binding(route.model_copy(update={"profile": "rsa"})),
        _wss(route),
        _nested("sp:Trust13", [_element(f"sp:{t}") for t in trust]),
        _element("sp:SignedParts", {}, signed),
        _element("sp:EncryptedParts", {}, [_element("sp:Body")]),
    ]  # SecurityPolicy assertions only: Metro fails on any other here (the endpoint's wsam:Addressing covers it)


def accepts_cbc(route: Route) -> bool:
    return any(a.endswith("-cbc") for a in route.encryption.data_algorithms)


def _x509(include: str) -> etree._Element:
    token = _element("sp:X509Token", {f"{{{ns.SP12}}}IncludeToken": _INCLUDE + include},
                     [_element("wsp:Policy", {}, [_element("sp:WssX509V3Token10")])])  # fmt: skip
    return token


def _suite(route: Route, asymmetric: bool = False) -> etree._Element:
    size = 128 if route.encryption.data_algorithms[0].startswith("aes128") else 256
    name = f"Basic{size}" + ("Sha256" if route.signature.digests[0] == "sha256" else "")
    suite = _nested("sp:AlgorithmSuite", [_element(f"sp:{name}")])
    # Every SP suite names RSA-SHA1 for X.509 signatures; Metro reads this attribute (JCA name) instead.
    rsa = [a for a in route.signature.algorithms if a.startswith("rsa-")]
    if asymmetric and rsa and rsa[0] == "rsa-sha256":
        suite.set(METRO_SIGNATURE_ALGORITHM, "SHA256withRSA")
    return suite


def _layout() -> etree._Element:
    return _nested("sp:Layout", [_element("sp:Lax")])


def _wss(route: Route) -> etree._Element:
    refs = ["MustSupportRefKeyIdentifier", "MustSupportRefIssuerSerial", "MustSupportRefThumbprint"]
    if route.profile != "rsa":
        refs.append("MustSupportRefEncryptedKey")
    return _nested("sp:Wss11", [_element(f"sp:{r}") for r in refs])


def _protected_parts(route: Route) -> list[etree._Element]:
    signed = [_element("sp:Body")]
    if "addressing" in route.signature.parts:
        signed.append(_element("sp:Header", {"Namespace": ns.WSA}))
    parts = [_element("sp:SignedParts", {}, signed)]
    # One assertion for both directions (per-message policies are left out): a reply the route encrypts must be
    # announced, and a request encrypted though not required is taken (`wsgate check` notes the difference).
    if route.encryption.require_request or route.encryption.encrypt_response:
        parts.append(_element("sp:EncryptedParts", {}, [_element("sp:Body")]))
    return parts


def _supporting(route: Route) -> list[etree._Element]:
    ut = route.username_token
    if not (route.accepts_username_tokens and ut.required):
        return []
    token = _element("sp:UsernameToken", {f"{{{ns.SP12}}}IncludeToken": _INCLUDE + "AlwaysToRecipient"},
                     [_element("wsp:Policy", {}, [_element("sp:WssUsernameToken10")])])  # fmt: skip
    kind = "sp:SignedEncryptedSupportingTokens" if ut.protection == "encrypted" else "sp:SignedSupportingTokens"
    if "username_token" not in route.signature.parts:
        kind = "sp:EncryptedSupportingTokens" if ut.protection == "encrypted" else "sp:SupportingTokens"
    return [_nested(kind, [token])]


_NS = {"wsp": ns.WSP, "sp": ns.SP12, "wsam": ns.WSAM}


def _element(
    qname: str, attrib: dict[str, str] | None = None, children: list[etree._Element] | None = None
) -> etree._Element:
    prefix, local = qname.split(":")
    el = etree.Element(f"{{{_NS[prefix]}}}{local}", attrib or {}, nsmap={prefix: _NS[prefix]})
    el.extend(children or [])
    return el


def _nested(qname: str, children: list[etree._Element]) -> etree._Element:
    """An assertion with a nested policy: <sp:X><wsp:Policy>children</wsp:Policy></sp:X>."""
    return _element(qname, {}, [_element("wsp:Policy", {}, children)])
