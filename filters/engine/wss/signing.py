"""WSS4J-shaped XML Signature signing (verification is signature.py's, as signxml splits its verifier and signer).

Each signed element gets a wsu:Id (or Id) if it has none and one reference with exclusive C14N and WSS4J's
InclusiveNamespaces PrefixList. With a route's optimizations (filters/engine/wss/optimizations.py) the digests are
computed directly (filters/engine/xml/c14n.py) and the canonical SignedInfo, written out as text, is signed by
`hmac` or `cryptography`; otherwise xmlsec signs the whole template. Attachments (the SwA profile:
filters/engine/wss/attachments.py) are always signed directly."""

from __future__ import annotations

import base64
import functools
import hmac
import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import xmlsec
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa, utils
from lxml import etree

from filters.engine import faults, metrics, ns
from filters.engine.wss import attachments, token
from filters.engine.wss.signature import (
    _RSA_HASHES,
    DIGEST_METHODS,
    EXCL_C14N,
    HMAC_HASHES,
    INCLUSIVE_NAMESPACES,
    SAML_ID_ATTRIBUTES,
    SIGNATURE,
    SIGNATURE_METHODS,
    WSU_ID,
    _ds,
    _id_attribute,
    id_index,
)
from filters.engine.xml import c14n
from filters.engine.xml.soap import Envelope

if TYPE_CHECKING:
    from filters.engine.wss.optimizations import Optimizations

PrivateKey = rsa.RSAPrivateKey | bytes


def _inclusive_prefixes(el: etree._Element, exclude_visible: bool) -> list[str]:
    """WSS4J's InclusiveNamespaces PrefixList: prefixes declared above `el`, less (when `exclude_visible`)
    those `el` declares or uses itself."""
    parent = el.getparent()
    inherited = dict(parent.nsmap) if parent is not None else {}
    prefixes = set(inherited)
    if exclude_visible:
        own = el.nsmap
        prefixes -= {p for p, uri in own.items() if inherited.get(p) != uri}
        prefixes.discard(el.prefix)
        used = {etree.QName(a).namespace for a in el.attrib if a.startswith("{")}
        prefixes -= {p for p, uri in own.items() if uri in used}
    return sorted("#default" if p is None else p for p in prefixes)


# C14N's attribute value escapes (XML C14N 1.0, 2.3); "#" + an id, namespace names and PrefixLists pass these.
_C14N_ATTRIBUTE = str.maketrans({"&": "&amp;", "<": "&lt;", '"': "&quot;", "\t": "&#x9;", "\n": "&#xA;", "\r": "&#xD;"})
# Parses the Signer's own canonical SignedInfo (no entities, no DTD: nothing of the message's).
_TEMPLATE_PARSER = etree.XMLParser(resolve_entities=False, no_network=True, collect_ids=False)


def _c14n_attribute(value: str) -> str:
    return value.translate(_C14N_ATTRIBUTE)


def _inclusive(prefixes: list[str]) -> str:
    """The canonical form of an InclusiveNamespaces element (its parent renders no "ec")."""
    return (f'<ec:InclusiveNamespaces xmlns:ec="{ns.EXC_C14N}" PrefixList="{_c14n_attribute(" ".join(prefixes))}">'
            "</ec:InclusiveNamespaces>")  # fmt: skip


def _add_inclusive(parent: etree._Element, prefixes: list[str]) -> None:
    etree.SubElement(parent, INCLUSIVE_NAMESPACES, nsmap={"ec": ns.EXC_C14N}).set("PrefixList", " ".join(prefixes))


def own_id(el: etree._Element) -> str | None:
    """The id a reference names `el` by: its wsu:Id or Id, a SAML assertion's own ID (a wsu:Id added to an
    assertion would break its issuer's signature)."""
    return el.get(WSU_ID) or el.get("Id") or el.get(SAML_ID_ATTRIBUTES.get(el.tag, "Id"))


def _ensure_id(el: etree._Element, fresh: Callable[[], str]) -> str:
    """The element's wsu:Id or Id, adding one when it has neither."""
    existing = own_id(el)
    if existing:
        return existing
    value = fresh()
    # XML Signature and Encryption elements have their own Id attribute (and no room for wsu:Id in their
    # schemas); everything else gets wsu:Id, lxml declaring the wsu prefix on the element when needed.
    el.set("Id" if etree.QName(el).namespace in (ns.DS, ns.XENC) else WSU_ID, value)
    return value


def _signing_key(key: PrivateKey) -> xmlsec.Key:
    if isinstance(key, bytes):
        return xmlsec.Key.from_binary_data(xmlsec.constants.KeyDataHmac, key)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return xmlsec.Key.from_memory(pem, xmlsec.constants.KeyDataFormatPem)


@functools.cache
def _stand_in() -> rsa.RSAPrivateKey:
    """A throw-away key for xmlsec to sign templates with when the real key is in a token (see Signer)."""
    return rsa.generate_private_key(public_exponent=65537, key_size=1024)


def _id_source(root: etree._Element, prefix: str) -> Callable[[], str]:
    """Fresh ids `prefix-N` that no element of the document has yet."""
    taken = set(id_index(root))
    counter = itertools.count(1)

    def fresh() -> str:
        value = next(v for v in (f"{prefix}-{n}" for n in counter) if v not in taken)
        taken.add(value)
        return value

    return fresh


class Signer:
    """Signs with one key and algorithm. An RSA key is parsed into xmlsec once, so keep one Signer per RSA key; an
    HMAC Signer is cheap (signed directly, it needs no xmlsec key at all)."""

    def __init__(self, key: PrivateKey, algorithm: str, digest: str) -> None:
        if algorithm not in SIGNATURE_METHODS or digest not in DIGEST_METHODS:
            raise ValueError(f"unsupported signature algorithm {algorithm!r} or digest {digest!r}")
        if algorithm.startswith("hmac") != isinstance(key, bytes) or not isinstance(key, bytes | rsa.RSAPrivateKey):
            raise ValueError(f"{algorithm} needs {'a secret' if algorithm.startswith('hmac') else 'an RSA key'}")
        self.algorithm = algorithm
        self.digest = digest
        self._method = SIGNATURE_METHODS[algorithm]
        self._digest = DIGEST_METHODS[digest]
        self._private = key
        # A token key signs in its token (the canonical SignedInfo); where xmlsec signs the whole template, it
        # does so with a stand-in key, and the token signs the SignedInfo digest xmlsec computed (`_resign`).
        self._token = key if isinstance(key, token.TokenKey) else None
        # An RSA key is parsed into xmlsec once, with the route; an HMAC secret only if xmlsec signs the template.
        self._key = None if isinstance(key, bytes) else _signing_key(_stand_in() if self._token is not None else key)

    def _xmlsec_key(self) -> xmlsec.Key:
        return self._key or _signing_key(self._private)

    def _signed_info(
        self,
        scope: dict[str | None, str],
        info_prefixes: list[str],
        ids: list[str],
        ref_prefixes: list[list[str]],
        digests: list[bytes],
        attachment_refs: Sequence[tuple[str, bytes]] = (),
    ) -> bytes | None:
        """The exclusive canonical form (PrefixList `info_prefixes`) of the SignedInfo this Signer writes, with
        the namespaces `scope` in scope on it, written out directly: the SignedInfo itself is then parsed from
        these bytes, which declare everything they render, so the document's SignedInfo canonicalizes to them.
        None where an "ec" prefix in scope would change how InclusiveNamespaces renders (libxml2 then)."""
        if "ec" in scope:
            return None
        rendered = {"ds": ns.DS, **{p: scope[p] for p in info_prefixes if p != "xml" and p in scope}}
        out = ["<ds:SignedInfo"]
        out += [f' xmlns:{p}="{_c14n_attribute(rendered[p])}"' for p in sorted(rendered)]
        out.append(f'><ds:CanonicalizationMethod Algorithm="{EXCL_C14N.href}">{_inclusive(info_prefixes)}')
        out.append(f'</ds:CanonicalizationMethod><ds:SignatureMethod Algorithm="{self._method.href}">')
        out.append("</ds:SignatureMethod>")
        for id_value, prefixes, got in zip(ids, ref_prefixes, digests, strict=True):
            out.append(f'<ds:Reference URI="#{_c14n_attribute(id_value)}"><ds:Transforms>')
            out.append(f'<ds:Transform Algorithm="{EXCL_C14N.href}">{_inclusive(prefixes)}</ds:Transform>')
            out.append(f'</ds:Transforms><ds:DigestMethod Algorithm="{self._digest.href}"></ds:DigestMethod>')
            out.append(f"<ds:DigestValue>{base64.b64encode(got).decode()}</ds:DigestValue></ds:Reference>")
        for uri, got in attachment_refs:  # SwA profile: the part's headers and content (attachments.py)
            out.append(f'<ds:Reference URI="{_c14n_attribute(uri)}"><ds:Transforms>')
            out.append(f'<ds:Transform Algorithm="{attachments.COMPLETE_SIGNATURE}"></ds:Transform></ds:Transforms>')
            out.append(f'<ds:DigestMethod Algorithm="{self._digest.href}"></ds:DigestMethod>')
            out.append(f"<ds:DigestValue>{base64.b64encode(got).decode()}</ds:DigestValue></ds:Reference>")
        out.append("</ds:SignedInfo>")
        return "".join(out).encode()

    def _sign_binary(self, signed_info: bytes) -> bytes:
        if isinstance(self._private, bytes):
            return hmac.new(self._private, signed_info, HMAC_HASHES[self.algorithm]).digest()
        # RSA, in memory or in a token: signed by its own object (an xmlsec context would copy the key in per call,
        # about 15% of a 2048-bit signature). PKCS#1 v1.5 is deterministic: the bytes are xmlsec's.
        return self._private.sign(signed_info, padding.PKCS1v15(), _RSA_HASHES[self.algorithm]())

    @metrics.timed("signature_creation")
    def sign(
        self,
        env: Envelope,
        security: etree._Element,
        elements: Sequence[etree._Element],
        key_info_child: etree._Element,
        id_prefix: str = "id",
        new_id: Callable[[], str] | None = None,
        optimizations: Optimizations | None = None,
        parts: Sequence[attachments.Attachment] = (),
    ) -> etree._Element:
        """Sign `elements` (each gets a wsu:Id if it has none), append the ds:Signature to `security` with
        `key_info_child` in its ds:KeyInfo, and return it. `new_id`: the message's own source of fresh ids (it
        has scanned the document already; a scan costs about 0.5 ms on 30 KB), else ids from `id_prefix`.
        `optimizations`: digests computed directly (and prehashed), xmlsec signing the canonical SignedInfo;
        None: xmlsec signs the whole template. The signature must stay under `security` (the SignedInfo's
        canonical form depends on the namespaces in scope there). `parts`: attachments signed too, with their
        headers (Attachment-Complete-Signature-Transform); always signed directly (xmlsec cannot resolve cid:)."""
        if not elements:
            raise ValueError("nothing to sign")
        root = env.root
        if any(el.getroottree().getroot() is not root for el in (security, *elements)):
            raise ValueError("the security header and signed elements must be in the envelope")
        fresh = new_id or _id_source(root, id_prefix)

        ids = [_ensure_id(el, fresh) for el in elements]
        sig_id = fresh()
        info_prefixes = _inclusive_prefixes(security, exclude_visible=False)
        ref_prefixes = [_inclusive_prefixes(el, exclude_visible=True) for el in elements]
        direct = (optimizations is not None or bool(parts)) and all(
            c14n.direct(p) for p in (info_prefixes, *ref_prefixes)
        )
        digests: list[bytes] = []
        if parts and not direct:
            raise faults.server("signing attachments: a PrefixList with the default namespace")
        if direct:
            # Tokens of the Security header (the Timestamp...) are per message: never worth prehashing. None of
            # the elements holds the Security header, so the signature added there later changes no digest.
            digests = [
                optimizations.digest(el, prefixes, self.digest, cacheable=el.getparent() is not security)
                if optimizations is not None
                else c14n.digest(el, prefixes, self.digest)
                for el, prefixes in zip(elements, ref_prefixes, strict=True)
            ]
            cid_refs = [
                (attachments.cid_uri(p.content_id), attachments.digest(p, attachments.COMPLETE_SIGNATURE, self.digest))
                for p in parts
            ]
            scope = {**security.nsmap, "ds": ns.DS}  # the namespaces in scope on the SignedInfo
            template = self._signed_info(scope, info_prefixes, ids, ref_prefixes, digests, cid_refs)
            if template is None and parts:
                raise faults.server("signing attachments: an 'ec' prefix in scope of the Security header")
            if template is not None:
                try:
                    value = base64.b64encode(self._sign_binary(template))
                except xmlsec.Error as exc:
                    raise faults.server(f"signing failed: {exc}") from None
                head = f'<ds:Signature xmlns:ds="{ns.DS}" Id="{_c14n_attribute(sig_id)}">'.encode()
                tail = b"<ds:SignatureValue>" + value + b"</ds:SignatureValue><ds:KeyInfo/></ds:Signature>"
                sig = etree.fromstring(head + template + tail, _TEMPLATE_PARSER)
                sig[-1].append(key_info_child)
                security.append(sig)
                return sig
        sig = etree.SubElement(security, SIGNATURE, nsmap={"ds": ns.DS})
        sig.set("Id", sig_id)
        info = etree.SubElement(sig, _ds("SignedInfo"))
        method = etree.SubElement(info, _ds("CanonicalizationMethod"), Algorithm=EXCL_C14N.href)
        _add_inclusive(method, info_prefixes)
        etree.SubElement(info, _ds("SignatureMethod"), Algorithm=self._method.href)
        digest_values = []
        for id_value, prefixes in zip(ids, ref_prefixes, strict=True):
            ref = etree.SubElement(info, _ds("Reference"), URI=f"#{id_value}")
            transform = etree.SubElement(
                etree.SubElement(ref, _ds("Transforms")), _ds("Transform"), Algorithm=EXCL_C14N.href
            )
            _add_inclusive(transform, prefixes)
            etree.SubElement(ref, _ds("DigestMethod"), Algorithm=self._digest.href)
            digest_values.append(etree.SubElement(ref, _ds("DigestValue")))
        signature_value = etree.SubElement(sig, _ds("SignatureValue"))
        etree.SubElement(sig, _ds("KeyInfo")).append(key_info_child)

        if direct:
            for holder, got in zip(digest_values, digests, strict=True):
                holder.text = base64.b64encode(got).decode()
            try:
                value = self._sign_binary(c14n.canonical(info, info_prefixes))
            except xmlsec.Error as exc:
                security.remove(sig)
                raise faults.server(f"signing failed: {exc}") from None
            signature_value.text = base64.b64encode(value).decode()
            return sig
        ctx = xmlsec.SignatureContext()
        ctx.key = self._xmlsec_key()
        try:
            for el, id_value in zip(elements, ids, strict=True):
                name, attr_ns = _id_attribute(el, id_value)
                ctx.register_id(el, name, attr_ns)
            ctx.sign(sig)
            if self._token is not None:
                self._resign(self._token, signature_value)
        except (xmlsec.Error, faults.Fault) as exc:
            security.remove(sig)
            if isinstance(exc, faults.Fault):
                raise
            raise faults.server(f"signing failed: {exc}") from None
        return sig

    def _resign(self, key: token.TokenKey, signature_value: etree._Element) -> None:
        """Replace the stand-in's SignatureValue by the token's over the same SignedInfo: the digest xmlsec
        signed (of its own canonical form, with whatever PrefixList) is read back from the stand-in's signature."""
        algorithm = _RSA_HASHES[self.algorithm]()
        stand_in = base64.b64decode("".join((signature_value.text or "").split()))
        digest = _stand_in().public_key().recover_data_from_signature(stand_in, padding.PKCS1v15(), algorithm)
        value = key.sign(digest, padding.PKCS1v15(), utils.Prehashed(algorithm))
        signature_value.text = base64.b64encode(value).decode()


def sign(
    env: Envelope,
    security: etree._Element,
    elements: Sequence[etree._Element],
    key: PrivateKey,
    algorithm: str,
    digest: str,
    key_info_child: etree._Element,
    id_prefix: str = "id",
) -> etree._Element:
    """One-off signing; on the hot path keep a `Signer` instead (it parses the key once)."""
    return Signer(key, algorithm, digest).sign(env, security, elements, key_info_child, id_prefix)
