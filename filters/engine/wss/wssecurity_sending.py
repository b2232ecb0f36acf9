"""The wsse:Security header, sending side (the gateway for responses, the client for requests): `secure`.

The header is laid out as WS-SecurityPolicy's `Strict` and `LaxTsFirst` layouts both allow, and as a receiver
that reads top-down needs it (WSS4J, Membrane, WCF, our own `wssecurity.process`):

    wsu:Timestamp                                first (LaxTsFirst; Membrane refuses a Signature before it)
    SecurityContextToken, DerivedKeyTokens       tokens before their use (BSP R5205)
    BinarySecurityToken                          the X.509 signer's certificate
    xenc:EncryptedKey                            the symmetric binding's key
    xenc:EncryptedKey                            a fresh key to a certificate, its ReferenceList naming what
                                                 that key encrypted
    xenc:ReferenceList                           what a shared secret encrypted (one list per key, BSP R3205)
    wsse:UsernameToken (or its EncryptedData)
    ds:Signature (or its EncryptedData)          sign-then-encrypt: every decryption it needs comes before it

Every KeyInfo holds one wsse:SecurityTokenReference (BSP R5417, R5426): a pre-shared key is named by
keys.str_pre_shared_key, never a bare ds:KeyName."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from cryptography import x509
from lxml import etree

from filters.engine import ns
from filters.engine.wss import attachments, encryption, keys, signature, signing, timestamp, username_token
from filters.engine.wss.optimizations import Optimizations
from filters.engine.wss.secure_conversation import new_id
from filters.engine.wss.wssecurity import (
    REFERENCE_LIST,
    SECURITY,
    WSU_ID,
    addressing,
    drop_comments,
    encrypted_key_sha1,
)
from filters.engine.xml.soap import Envelope


@dataclass
class SignWith:
    """A signing key and how the receiver finds it."""

    signer: signing.Signer
    key_info: Callable[[], etree._Element] | None  # a fresh KeyInfo child per message; None: the binding's key
    certificate: x509.Certificate | None = None  # sent as a BinarySecurityToken (X.509 signatures)
    optimizations: Optimizations | None = None  # the route's (prehashing); None: xmlsec signs it all


@dataclass
class EncryptFor:
    """Encrypt the Body content: to a certificate (a fresh key in an EncryptedKey) or with a shared secret."""

    algorithm: str  # data algorithm (policy name)
    certificate: x509.Certificate | None = None
    transport: str = "rsa-oaep-mgf1p"
    certificate_reference: Callable[[x509.Certificate], etree._Element] = keys.str_issuer_serial
    secret: bytes | None = None
    secret_key_info: Callable[[], etree._Element] | None = None  # how the receiver names it; None: the binding's


@dataclass
class Secured:
    """What securing a message produced that the sender needs later (to read the reply)."""

    encrypted_key_sha1: str | None = None
    secret: bytes | None = None


class _MessageIds:
    """Ids unique within one message, from counters. Signed parts' ids are registered with libxml2, which interns
    every registered id in a per-thread dictionary that is never freed: random ids would grow the process
    forever, so the set of id strings it signs with must stay small."""

    def __init__(self, env: Envelope, unique: bool) -> None:
        self.taken = set(signature.id_index(env.root))
        self.counter = itertools.count(1)
        # A client's requests must differ even when their content and millisecond do (the gateway refuses a
        # signature value it has seen): there, ids are random.
        self.unique = unique

    def __call__(self, prefix: str) -> str:
        if self.unique:
            return new_id(prefix)
        while (value := f"{prefix}-{next(self.counter)}") in self.taken:
            pass
        self.taken.add(value)
        return value


def secure(
    env: Envelope,
    now: datetime,
    *,
    timestamp_ttl_s: int | None,
    sign: SignWith | None,
    sign_parts: tuple[str, ...] = ("body", "timestamp"),
    encrypt: EncryptFor | None = None,
    user: tuple[str, str, bool] | None = None,
    symmetric_binding: tuple[bytes, x509.Certificate, str] | None = None,
    tokens: tuple[etree._Element, ...] = (),
    signed_tokens: tuple[etree._Element, ...] = (),
    unique_ids: bool = False,
    encrypt_user: EncryptFor | None = None,
    encrypt_signature: bool = False,
    parts: attachments.Attachments | None = None,
    sign_parts_attached: bool = False,
    encrypt_parts: bool = False,
) -> Secured:
    """Add a Security header to `env` as the arguments say, laid out as the module docstring shows.

    `symmetric_binding` = (secret, recipient certificate, transport): the client side of the WS-SecurityPolicy
    symmetric binding; the secret travels in an EncryptedKey that the signature and encryption refer to.
    `tokens` (a SecurityContextToken, DerivedKeyTokens) go right after the Timestamp, in order; then
    `signed_tokens`, which the signature covers (the STR naming a SAML assertion).
    `unique_ids`: random ids (clients); otherwise per-message counters (the gateway: see _MessageIds).
    `encrypt_user`: the UsernameToken, once signed, is replaced by an EncryptedData (EncryptedSupportingTokens);
    give it the signing key (the binding's, or a pre-shared one) so the receiver can tie the two together.
    `encrypt_signature` (with `encrypt`): the ds:Signature, once made, is encrypted like the Body
    (WS-SecurityPolicy EncryptSignature, WSS4J's encryptSignature).
    `parts`: the message's attachments (the SwA profile, attachments.py); `sign_parts_attached`: each signed with
    its headers; `encrypt_parts` (with `encrypt`): each encrypted (Attachment-Complete) in place, its
    EncryptedData in the header beside the key's carrier; under CBC encrypted first and the ciphertext signed."""
    if encrypt_signature and (encrypt is None or sign is None or encryption.is_cbc(encrypt.algorithm)):
        raise ValueError("encrypting the signature needs a signature and a Body encryption, not CBC")
    drop_comments(env.root)  # what the receiver's C14N verifies is then all there is to read
    header = env.ensure_header()
    security = etree.Element(SECURITY, nsmap={"wsse": ns.WSSE, "wsu": ns.WSU})
    security.set(ns.q(env.soap_ns, "mustUnderstand"), "true" if env.version == "1.2" else "1")
    header.insert(0, security)
    result = Secured()
    ids = _MessageIds(env, unique_ids)
    to_sign: list[etree._Element] = [env.body]
    if timestamp_ttl_s is not None:
        ts = timestamp.create(timestamp_ttl_s, now, ids("TS"))
        security.append(ts)
        if "timestamp" in sign_parts:
            to_sign.append(ts)
    for token in tokens:
        security.append(token)
    for token in signed_tokens:
        security.append(token)
        to_sign.append(token)
    key_info: etree._Element | None = None
    if sign is not None and sign.key_info is not None:
        key_info = sign.key_info()
        if sign.certificate is not None:
            security.append(keys.make_bst(sign.certificate, _bst_id(key_info)))
    ek: etree._Element | None = None
    binding_ref: Callable[[], etree._Element] | None = None
    if symmetric_binding is not None:
        secret, cert, transport = symmetric_binding
        ek_id = new_id("EK")
        ek = encryption.encrypt_key(secret, cert, transport, ek_id, keys.str_issuer_serial(cert), [])
        security.append(ek)
        result.secret = secret
        result.encrypted_key_sha1 = encrypted_key_sha1(ek)

        def binding_ref() -> etree._Element:
            return keys.str_reference(ek_id, ns.ENCKEY_TOKEN)

    carriers_at = len(security)  # the EncryptedKeys and ReferenceLists of what is encrypted below go here
    ut: etree._Element | None = None
    if user is not None:
        ut = username_token.create(user[0], user[1], user[2], now, ids("UsernameToken"))
        security.append(ut)
        if "username_token" in sign_parts:
            to_sign.append(ut)
    encryptions = _Encryptions(binding_ref)
    # CBC is encrypted first and its ciphertext signed (WS-SecurityPolicy EncryptBeforeSigning): a receiver that
    # verifies before it decrypts never decrypts a changed CBC ciphertext (wssecurity._check_cbc).
    encrypt_first = encrypt is not None and encryption.is_cbc(encrypt.algorithm)
    first = _Encryptions(binding_ref)
    attached = list(parts or ()) if encrypt is not None and encrypt_parts else []
    if encrypt is not None and encrypt_first:
        first.content(env.body, encrypt)
        for part in attached:
            first.attachment(part, encrypt)
    sig: etree._Element | None = None
    if sign is not None:
        if "addressing" in sign_parts and env.header is not None:
            to_sign.extend(h for h in env.header if addressing(h))
        _ensure_wsu_ids(to_sign, ids)
        if key_info is None:
            if binding_ref is None:
                raise ValueError("a signature needs a key reference")
            key_info = binding_ref()
        sig = sign.signer.sign(
            env, security, to_sign, key_info, new_id=lambda: ids("id"), optimizations=sign.optimizations,
            parts=list(parts or ()) if sign_parts_attached else (),
        )  # fmt: skip
    if encrypt_user is not None and ut is not None:
        encryptions.element(ut, encrypt_user)
    if encrypt is not None and not encrypt_first:
        encryptions.content(env.body, encrypt)
        for part in attached:
            encryptions.attachment(part, encrypt)
        if encrypt_signature:
            assert sig is not None
            encryptions.element(sig, encrypt)
    # The carriers of what the Signature covers encrypted go after it: verified before anything is decrypted.
    security.extend(first.carriers())
    security[carriers_at:carriers_at] = encryptions.carriers()
    return result


def _ensure_wsu_ids(elements: list[etree._Element], ids: _MessageIds) -> None:
    for el in elements:
        if signing.own_id(el) is None:
            el.set(WSU_ID, ids("id"))


def _bst_id(key_info: etree._Element) -> str:
    """The BinarySecurityToken id an X.509 signature's KeyInfo refers to."""
    ref = key_info.find(ns.q(ns.WSSE, "Reference"))
    if key_info.tag != keys.STR or ref is None:
        raise ValueError("an X.509 SignWith needs a KeyInfo with a direct reference to its token")
    return (ref.get("URI") or "").removeprefix("#")


class _Encryptions:
    """What one message encrypts, grouped by key: each fresh key to a certificate gets one EncryptedKey, each
    shared secret (the binding's key too, as CXF writes it) one ReferenceList (BSP R3205: one key per list)."""

    def __init__(self, binding_ref: Callable[[], etree._Element] | None) -> None:
        self.binding_ref = binding_ref
        self.groups: dict[int, tuple[EncryptFor, bytes, list[str]]] = {}
        self.held: list[etree._Element] = []  # attachments' EncryptedData, for the header after the carriers

    def _key(self, spec: EncryptFor) -> tuple[bytes, list[str]]:
        group = self.groups.get(id(spec))
        if group is None:
            secret = encryption.new_key(spec.algorithm) if spec.certificate is not None else spec.secret
            assert secret is not None
            group = self.groups[id(spec)] = (spec, secret, [])
        return group[1], group[2]

    def _key_info(self, spec: EncryptFor) -> etree._Element | None:
        if spec.certificate is not None:
            return None  # named by the EncryptedKey's ReferenceList, which precedes it (BSP R5629, R3208)
        name_key = spec.secret_key_info or self.binding_ref
        assert name_key is not None
        return name_key()

    def content(self, el: etree._Element, spec: EncryptFor) -> None:
        secret, listed = self._key(spec)
        ed_id = new_id("ED")
        encryption.encrypt_content(el, secret, spec.algorithm, ed_id, self._key_info(spec))
        listed.append(ed_id)

    def attachment(self, part: attachments.Attachment, spec: EncryptFor) -> None:
        """An attachment encrypted in place (Attachment-Complete); its EncryptedData follows the key's carrier."""
        secret, listed = self._key(spec)
        ed_id = new_id("ED")
        ed = attachments.encrypt(part, secret, spec.algorithm, True, ed_id)
        key_info = self._key_info(spec)
        if key_info is not None:
            ed.insert(1, etree.Element(ns.q(ns.DS, "KeyInfo"), nsmap={"ds": ns.DS}))
            ed[1].append(key_info)
        self.held.append(ed)
        listed.append(ed_id)

    def element(self, el: etree._Element, spec: EncryptFor) -> None:
        """`el` itself replaced by an EncryptedData of Type Element (a UsernameToken, the ds:Signature)."""
        secret, listed = self._key(spec)
        ed_id = new_id("ED")
        encryption.encrypt_element(el, secret, spec.algorithm, ed_id, self._key_info(spec))
        listed.append(ed_id)

    def carriers(self) -> list[etree._Element]:
        out: list[etree._Element] = []
        for spec, secret, listed in self.groups.values():
            if spec.certificate is not None:
                ek = encryption.encrypt_key(secret, spec.certificate, spec.transport, new_id("EK"),
                                            spec.certificate_reference(spec.certificate), listed)  # fmt: skip
                out.append(ek)
            else:
                reflist = etree.Element(REFERENCE_LIST, nsmap={"xenc": ns.XENC})
                for ed_id in listed:
                    etree.SubElement(reflist, ns.q(ns.XENC, "DataReference"), URI=f"#{ed_id}")
                out.append(reflist)
        return out + self.held
