"""The wsse:Security header, receiving side (the gateway for requests, the client for responses): `process`.

Each header child goes to the processor for its token type, in document order, so sign-then-encrypt and
encrypt-then-sign both work, whatever the layout (Strict, Lax, LaxTsFirst, LaxTsLast, tokens after their use
as zeep sends them). An encrypted ds:Signature is decrypted where it is and verified when the walk reaches it,
like a clear one. Then the requirements are checked on what was actually verified (element identity, never
ids), the header is removed, and the envelope holds plain SOAP. The sending side is filters/engine/wss/wssecurity_sending.py."""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import rsa
from lxml import etree

from filters.engine import faults, ns
from filters.engine.wss import attachments, encryption, keys, saml, signature, timestamp, username_token
from filters.engine.wss import secure_conversation as sc
from filters.engine.wss.optimizations import Optimizations
from filters.engine.wss.replay import DeferredKey, DeferredReplay, ReplayCache, check_epoch, first_sight
from filters.engine.xml import xmlsupport
from filters.engine.xml.soap import Envelope
from filters.engine.xml.threat_protection import Limits
from gateway.policy import (
    AttachmentSecurity,
    EncryptionPolicy,
    SignaturePolicy,
    TimestampPolicy,
    UsernameTokenPolicy,
)

SECURITY = ns.q(ns.WSSE, "Security")
TIMESTAMP = ns.q(ns.WSU, "Timestamp")
USERNAME_TOKEN = ns.q(ns.WSSE, "UsernameToken")
BST = ns.q(ns.WSSE, "BinarySecurityToken")
SIGNATURE = ns.q(ns.DS, "Signature")
ENCRYPTED_KEY = ns.q(ns.XENC, "EncryptedKey")
REFERENCE_LIST = ns.q(ns.XENC, "ReferenceList")
ENCRYPTED_DATA = ns.q(ns.XENC, "EncryptedData")
KEY_INFO = ns.q(ns.DS, "KeyInfo")
WSU_ID = ns.q(ns.WSU, "Id")
ANONYMOUS = "anonymous"
# How long an EncryptedKey that decrypted CBC is remembered: past the replay window, so that one copy of it
# gets one decryption a day at most, not one per window (docs/interop.md "CBC").
CBC_KEY_MEMORY_S = 86400


# --------------------------------------------------------------------------------------------------------
# Receiving


@dataclass(frozen=True)
class Requirements:
    """What a message must carry to be accepted, derived from the route's policy."""

    timestamp: TimestampPolicy
    signature: SignaturePolicy
    encryption: EncryptionPolicy
    username_token: UsernameTokenPolicy
    # "x509", "symmetric" (pre-shared or EncryptedKey) or "context" (a key derived from a security context):
    # a signature with such a key is required; None: no signature required.
    signer: str | None
    body_encrypted: bool  # the Body content must have arrived encrypted
    limits: Limits
    # Whether a symmetric signature whose key came in an EncryptedKey may be the only credential (hmac routes:
    # hmac.allow_anonymous); such a sender proves nothing about who it is.
    anonymous: bool = True
    attachments: AttachmentSecurity = field(default_factory=AttachmentSecurity)
    # signer "context": the context's own key, named by a reference to its SCT, may sign and encrypt beside keys
    # derived from it (WS-SecurityPolicy without sp:RequireDerivedKeys).
    context_key_direct: bool = False


@dataclass
class Credentials:
    """What the receiving side holds to check a message."""

    trust: keys.TrustStore | None = None  # validates signer certificates
    known_certificates: list[x509.Certificate] = field(default_factory=list)  # for SKI/thumbprint/IssuerSerial refs
    decryption_key: rsa.RSAPrivateKey | None = None  # opens EncryptedKeys sent to us
    # While a key is rotated: every key taken (the current one first) with its certificate, which the EncryptedKey's
    # key reference must name.
    decryption_keys: list[tuple[x509.Certificate, rsa.RSAPrivateKey]] = field(default_factory=list)
    psk: Mapping[str, bytes] = field(default_factory=dict)  # pre-shared keys by ds:KeyName
    encrypted_keys: Mapping[str, bytes] = field(default_factory=dict)  # EncryptedKeySHA1 (base64) -> key we sent
    users: username_token.Users | None = None
    replay: ReplayCache | DeferredReplay | None = None
    optimizations: Optimizations | None = None  # the route's signature optimizations (None: xmlsec throughout)
    # WS-SecureConversation: resolves the SCT references of one message (now, the header's SCTs by wsu:Id).
    contexts: Callable[[datetime, Mapping[str, sc.Sct]], sc.SctResolver] | None = None
    # `saml` routes: checks assertions; the assertion, not the trust store, says who may sign (saml.confirm).
    saml: saml.Validator | None = None


@dataclass
class Verified:
    """What a processed Security header established (the one `Verified`: its parts are a
    `signature.VerifiedSignature` and a `username_token.VerifiedUsernameToken`)."""

    signed: list[etree._Element] = field(default_factory=list)
    signer_certificate: x509.Certificate | None = None
    signer_chain: tuple[x509.Certificate, ...] = ()  # the validated chain, leaf first (kept as evidence: archive)
    # Who sent it, for the backend: the X.509 signer (RFC 4514), the UsernameToken user, the context's subject,
    # "key:<name>" (a pre-shared key) or ANONYMOUS (a key from an EncryptedKey and nothing else).
    subject: str | None = None
    symmetric_key: bytes | None = None  # the key an HMAC signature was made with
    signature_algorithm: str | None = None  # the verified signature's (policy name): a reply may answer in it
    key_reference: keys.KeyRef | None = None  # how the sender named that key, to name it back in a reply
    username: str | None = None
    timestamp: timestamp.Window | None = None
    decrypted_body: bool = False
    decrypted: bool = False  # XML decrypted into the envelope (the Body's or any other): new content to check
    context: sc.Context | None = None  # the security context whose derived keys the message used
    # Replay keys of a deferred store: the message passes only if it is the first to set every one of them.
    replay_keys: list[DeferredKey] = field(default_factory=list)
    # Its freshness evidence (ms since the Unix epoch), to compare with the store's replay epoch (filters/engine/wss/replay.py).
    replay_since_ms: int = 0
    assertion: saml.Assertion | None = None  # the header's one SAML assertion, verified (`saml` routes)
    # The assertion's holder-of-key EncryptedKey whose symmetric key the signature verified with (saml.confirm).
    proof_key: etree._Element | None = None
    signed_attachments: list[str] = field(default_factory=list)  # Content-IDs, each covered by the signature

    def covers(self, el: etree._Element) -> bool:
        """Whether `el` or an ancestor of it was signed (by identity)."""
        signed = {id(s) for s in self.signed}
        return id(el) in signed or any(id(a) in signed for a in el.iterancestors())


@dataclass
class _State:
    env: Envelope
    req: Requirements
    creds: Credentials
    now: datetime
    security: etree._Element
    tokens: dict[str, x509.Certificate] = field(default_factory=dict)  # BinarySecurityTokens by wsu:Id
    secret_by_id: dict[str, bytes] = field(default_factory=dict)  # EncryptedKeys by Id
    secret_by_sha1: dict[str, bytes] = field(default_factory=dict)  # EncryptedKeys by EncryptedKeySHA1
    decrypted: list[tuple[etree._Element, list[etree._Element], bool]] = field(default_factory=list)
    derived_ids: set[str] = field(default_factory=set)  # DerivedKeyTokens, by wsu:Id, whose keys are in secret_by_id
    # An element decrypted whole -> its key. Keyed by the element (identity), not id(): the key keeps the proxy
    # alive, so a later lookup of the same node finds it and no other node can take its id.
    decrypted_with: dict[etree._Element, bytes] = field(default_factory=dict)
    username_token: etree._Element | None = None  # the header's one UsernameToken, authenticated after the walk
    username_key: bytes | None = None  # the key it arrived encrypted under
    key_carriers: list[tuple[bytes, etree._Element]] = field(default_factory=list)  # opened EncryptedKeys
    cbc_keys_used: list[bytes] = field(default_factory=list)  # keys that decrypted CBC (once per message)
    scts: dict[str, sc.Sct] = field(default_factory=dict)
    resolve: sc.SctResolver | None = None  # the message's one resolver: each context looked up once
    # signature.id_index of the document as it is now: made once, forgotten by any handler that may change the tree.
    index: dict[str, etree._Element] | None = None
    signatures: int = 0
    signature: etree._Element | None = None  # the one ds:Signature, once verified
    timestamp: etree._Element | None = None  # the wsu:Timestamp, to tell whether it was signed
    username_created: datetime | None = None  # the authenticated UsernameToken's Created
    replay_checked: bool = False  # a key of this message went to the replay store
    parts: attachments.Attachments | None = None  # the message's attachments (None: a plain SOAP message)
    out: Verified = field(default_factory=Verified)


_ROLE = {"1.1": ns.q(ns.SOAP11, "actor"), "1.2": ns.q(ns.SOAP12, "role")}  # who a header block is for
_ULTIMATE = frozenset({None, "", "http://www.w3.org/2003/05/soap-envelope/role/ultimateReceiver"})


def find_security(env: Envelope) -> etree._Element | None:
    """The one wsse:Security header addressed to us (no actor/role, or the ultimate receiver's)."""
    header = env.header
    if header is None:
        return None
    role_attr = _ROLE[env.version]
    ours = [h for h in header.iterchildren(SECURITY) if h.get(role_attr) in _ULTIMATE]
    if len(ours) > 1:
        raise faults.security("InvalidSecurity", f"{len(ours)} wsse:Security headers for the same role")
    return ours[0] if ours else None


def process(
    env: Envelope,
    req: Requirements,
    creds: Credentials,
    now: datetime,
    parts: attachments.Attachments | None = None,
    security: etree._Element | None = None,
) -> Verified:
    """Check the message's Security header against `req`, then remove it. Raises a Fault on any refusal.
    `parts`: the attachments of a multipart message, which signatures may cover and which may arrive encrypted
    (decrypted in place). `security`: what find_security(env) returned, where the caller looked already."""
    security = find_security(env) if security is None else security
    if security is None:
        raise faults.security("InvalidSecurity", "no wsse:Security header")
    drop_comments(env.root)
    st = _State(env=env, req=req, creds=creds, now=now, security=security, parts=parts)
    # Tokens are resolved anywhere in the header, as WSS4J does: zeep puts its certificate after the signature.
    for bst in security.iterchildren(BST):
        _bst(st, bst)
    st.scts = sc.header_scts(security)
    i = 0
    while i < len(security):
        child = security[i]
        if not isinstance(child.tag, str):
            i += 1
            continue
        handler = _PROCESSORS.get(child.tag)
        if handler is None:
            raise faults.security("InvalidSecurity", f"unsupported security header element {child.tag[:120]}")
        replaced = handler(st, child)
        if handler not in _KEEP_TREE:
            st.index = None
        # A decrypted header token takes the place of its EncryptedData: read it next.
        if not replaced:
            i += 1
    if st.username_token is not None:
        _authenticate_user(st, st.username_token)
    _identify(st)
    _check_requirements(st)
    _check_attachments(st)
    _check_replay_epoch(st)
    _strip(env, security)
    return st.out


def drop_comments(el: etree._Element) -> None:
    """Remove every comment below `el`, keeping the text around it (C14N without comments, the only kind we
    allow, ignores them). Before anything is read, so every reader and both signature paths see one text per
    value; and the bytes forwarded say exactly what was verified, not "user@victim<!---->.attacker" to a reader
    that stops at the first text node."""
    if next(el.iter(etree.Comment), None) is not None:
        etree.strip_tags(el, etree.Comment)


def _identify(st: _State) -> None:
    """Name the sender of a message whose only credential is its symmetric signature key."""
    out = st.out
    if out.subject is not None or out.context is not None or out.symmetric_key is None or out.key_reference is None:
        return
    if out.proof_key is not None:
        return  # the key a SAML assertion confirms: the assertion names the sender (saml.confirm)
    if out.key_reference.kind == "key_name":
        out.subject = f"key:{out.key_reference.value}"
        return
    if not st.req.anonymous:
        raise faults.security("FailedAuthentication", "anonymous request: a key from an EncryptedKey and no credential")
    out.subject = ANONYMOUS


def _timestamp(st: _State, el: etree._Element) -> bool:
    if st.out.timestamp is not None:
        raise faults.security("InvalidSecurity", "more than one wsu:Timestamp")
    st.out.timestamp = timestamp.check(el, st.req.timestamp, st.now)
    st.timestamp = el
    return False


def _first_sight(st: _State, key: bytes, ttl_s: float, replayed: faults.Fault) -> None:
    st.replay_checked = True
    first_sight(st.creds.replay, key, ttl_s, replayed, st.out.replay_keys)


def _check_replay_epoch(st: _State) -> None:
    """Refuse a message the replay store could have accepted before it lost its memory (filters/engine/wss/replay.py): its
    evidence must be newer than the store's epoch. A deferred store compares them with the keys (the frame)."""
    if not st.replay_checked or st.creds.replay is None:
        return
    tp = st.req.timestamp
    if st.timestamp is not None and st.out.timestamp is not None and st.out.covers(st.timestamp):
        evidence = st.out.timestamp.created
    elif st.username_created is not None:
        evidence = st.username_created  # bound to the password by the digest (a text password shows it anyway)
    else:  # nothing signed says when: only a loss older than the keys' lifetime is out of reach
        evidence = st.now - timedelta(seconds=tp.max_age_s + 2 * tp.clock_skew_s)
    st.out.replay_since_ms = int(evidence.timestamp() * 1000)
    if not isinstance(st.creds.replay, DeferredReplay):
        check_epoch(st.out.replay_since_ms, st.creds.replay.epoch_ms())


def _replay_ttl(st: _State) -> float:
    if st.out.timestamp is not None:
        return st.out.timestamp.replay_ttl_s(st.req.timestamp, st.now)
    # Read before the Timestamp: a Created up to clock_skew_s ahead keeps the message fresh that much longer.
    return float(st.req.timestamp.max_age_s + 2 * st.req.timestamp.clock_skew_s)


def _username_token(st: _State, el: etree._Element) -> bool:
    """Noted here, authenticated after the walk (_authenticate_user): once the signature and decryptions are known."""
    if st.username_token is not None:
        raise faults.security("InvalidSecurity", "more than one wsse:UsernameToken")
    if st.creds.users is None:
        raise faults.security("InvalidSecurity", "UsernameToken sent to a route without users")
    if st.req.username_token.protection == "encrypted":
        # EncryptedSupportingTokens: a token that came readable may have been captured; refused before any check.
        st.username_key = st.decrypted_with.get(el)
        if st.username_key is None:
            raise faults.security("InvalidSecurity", "UsernameToken not encrypted (protection: encrypted)")
    st.username_token = el
    return False


def _authenticate_user(st: _State, el: etree._Element) -> None:
    if st.username_key is not None and st.req.signer == "symmetric":
        # The token must be sealed under the key that signs this message: a token copied, still encrypted, from
        # another message next to the copier's own key is someone else's. Checked before the password, so a
        # copy neither costs a check nor uses up the owner's nonce.
        if st.out.symmetric_key is None or not hmac.compare_digest(st.username_key, st.out.symmetric_key):
            raise faults.security("InvalidSecurity", "UsernameToken encrypted under another key than the signature's")
    tp = st.req.timestamp
    assert st.creds.users is not None  # _username_token noted no token on a route without users
    got = username_token.verify(el, st.creds.users, st.req.username_token, st.now, tp.max_age_s, tp.clock_skew_s)
    if got.nonce is not None:
        key = b"ut:" + got.username.encode() + b":" + got.nonce
        replayed = faults.security("FailedAuthentication", "replay: UsernameToken nonce seen before")
        _first_sight(st, key, float(tp.max_age_s + 2 * tp.clock_skew_s), replayed)
        st.username_created = got.created
    st.out.username = got.username
    if st.out.subject is None:
        st.out.subject = got.username


def _bst(st: _State, el: etree._Element) -> bool:
    token_id = el.get(WSU_ID)
    if not token_id:
        raise faults.security("InvalidSecurityToken", "BinarySecurityToken without wsu:Id")
    st.tokens[token_id] = keys.parse_bst(el)
    return False


def _encrypted_key(st: _State, ek: etree._Element) -> bool:
    secret = _open_encrypted_key(st, ek)
    ek_id = ek.get("Id")
    if ek_id:
        st.secret_by_id[ek_id] = secret
    st.secret_by_sha1[encrypted_key_sha1(ek)] = secret
    for ref in encryption.reference_list(ek):
        _decrypt_reference(st, ref, secret)
    return False


def _open_encrypted_key(st: _State, ek: etree._Element, key_size: int | None = None) -> bytes:
    if st.creds.decryption_key is None:
        raise faults.security("SecurityTokenUnavailable", "EncryptedKey sent to a route without a decryption key")
    key = _decryption_key_for(st, ek) if st.creds.decryption_keys else st.creds.decryption_key
    secret = encryption.decrypt_key(ek, key, st.req.encryption.key_transport, key_size)
    st.key_carriers.append((secret, ek))
    return secret


def _check_cbc(st: _State, ed: etree._Element, secret: bytes) -> None:
    """A CBC EncryptedData is decrypted only where its padding and parse errors teach its sender nothing (the
    Jager-Somorovsky oracle; docs/interop.md "CBC"). A key that came in an EncryptedKey decrypts CBC in one message
    only: the EncryptedKey is claimed in the replay store, settled now even where the store defers, before the first
    byte is decrypted, so a copy of someone else's EncryptedKey with changed ciphertext (any number of
    EncryptedData in that one message: the first failure ends it) is refused unopened. Any other key (pre-shared,
    derived from a security context) is reused by design: then a signature verified before decryption must cover
    the ciphertext (encrypt-then-sign) and be made with that key or one of the same context, so its maker holds
    the key already and a changed ciphertext is refused before it is decrypted.

    The receiving side with no replay store (a client reading its reply, which answers nobody) needs the
    covering signature whatever the key."""
    carrier = next((ek for key, ek in st.key_carriers if key is secret), None)
    if carrier is not None and st.creds.replay is not None:
        if all(key is not secret for key in st.cbc_keys_used):
            st.cbc_keys_used.append(secret)
            _claim_now(st, b"cbc-key:" + encrypted_key_sha1(carrier).encode(), encryption.failed("CBC key reused"))
        return
    if not (st.out.covers(ed) or _ciphertext_signed(st, ed)):
        raise encryption.failed("CBC EncryptedData not covered by a signature verified before decryption")
    if carrier is None and st.out.symmetric_key is None:
        raise encryption.failed("CBC EncryptedData under a shared key its X.509 signer need not hold")
    ctx = st.out.context
    derived = ctx is not None and (
        any(st.secret_by_id.get(i) is secret for i in st.derived_ids) or hmac.compare_digest(secret, ctx.secret)
    )
    if carrier is None and not (derived or hmac.compare_digest(secret, st.out.symmetric_key or b"")):
        raise encryption.failed("CBC EncryptedData under a key its signature was not made with")


def _ciphertext_signed(st: _State, ed: etree._Element) -> bool:
    """Whether the attachment an EncryptedData names was signed as it is now: ciphertext (encrypt-then-sign)."""
    if st.parts is None or not attachments.is_attachment_data(ed):
        return False
    return any(p.signed is not None and not p.decrypted for p in st.parts if _names(ed, p))


def _names(ed: etree._Element, part: attachments.Attachment) -> bool:
    return any(attachments.content_id(r.get("URI") or "") == part.content_id
               for r in ed.iter(ns.q(ns.XENC, "CipherReference")))  # fmt: skip


def _claim_now(st: _State, key: bytes, used: faults.Fault) -> None:
    """Set a replay key before going on, whatever the store (a deferred one is settled for this key at once)."""
    store = st.creds.replay
    assert store is not None
    if isinstance(store, DeferredReplay):
        store.claim(store.key(key, CBC_KEY_MEMORY_S, used))
    elif store.seen(key, CBC_KEY_MEMORY_S):
        raise used


def _decryption_key_for(st: _State, ek: etree._Element) -> rsa.RSAPrivateKey:
    """The route's key whose certificate the EncryptedKey names (a route holding the current and previous keys)."""
    key_info = encryption.key_for(ek)
    if key_info is None:
        raise faults.security("SecurityTokenUnavailable", "EncryptedKey names no key, and the route holds several")
    ref = keys.parse_key_info(key_info)
    token = st.tokens.get(ref.value) if ref.kind == "reference" else None
    for cert, key in st.creds.decryption_keys:
        if keys.matches(ref, cert) or (token is not None and token == cert):
            return key
    raise faults.security("SecurityTokenUnavailable", f"EncryptedKey is for none of the route's keys ({ref.kind})")


def encrypted_key_sha1(ek: etree._Element) -> str:
    """WS-Security 1.1 EncryptedKeySHA1: SHA-1 of the EncryptedKey's decoded CipherValue, base64."""
    raw = encryption.cipher_value(ek, "EncryptedKey")  # the bytes decrypt_key opened
    return base64.b64encode(hashlib.sha1(raw).digest()).decode()


def _reference_list(st: _State, el: etree._Element) -> bool:
    for ref in encryption.reference_list(el):
        _decrypt_reference(st, ref, None)
    return False


def _decrypt_reference(st: _State, ref_id: str, secret: bytes | None) -> None:
    matches = [e for e in st.env.root.iter(ENCRYPTED_DATA) if e.get("Id") == ref_id]
    if len(matches) != 1:
        raise faults.security("InvalidSecurity", f"DataReference #{ref_id[:80]} resolves to {len(matches)} elements")
    ed = matches[0]
    if attachments.is_attachment_data(ed):
        _decrypt_attachment(st, ed, secret)
        return
    if secret is None:
        secret = _data_key(st, ed)
    parent = ed.getparent()
    assert parent is not None
    was_signed = st.out.covers(ed)
    if encryption.cbc_data(ed, st.req.encryption.data_algorithms):
        _check_cbc(st, ed, secret)
    landing = encryption.decrypt_data(ed, secret, st.req.encryption.data_algorithms, st.req.limits)
    drop_comments(parent)  # decrypted content is read and forwarded like the rest
    st.decrypted.append((parent, landing, was_signed))
    st.out.decrypted = True
    for node in landing:
        if node is not parent:  # Type Element: this element itself was encrypted
            st.decrypted_with[node] = secret
    if parent is st.env.body:
        st.out.decrypted_body = True


def _decrypt_attachment(st: _State, ed: etree._Element, secret: bytes | None) -> None:
    """An attachment encrypted per the SwA profile: its part decrypted in place (attachments.decrypt). Under CBC
    the same rules as an element (_check_cbc), a signature before decryption covering the part's ciphertext."""
    if st.parts is None:
        raise faults.security("InvalidSecurity", "attachment EncryptedData in a message without attachments")
    if ed.getparent() is not st.security:  # where WSS4J puts it; in the Body it would reach the backend
        raise faults.security("InvalidSecurity", "attachment EncryptedData outside the Security header")
    if _decrypted_already(st, ed):
        return  # named again by a ReferenceList
    if secret is None:
        secret = _data_key(st, ed)
    key = secret

    def cbc_rules(algorithm: str) -> None:  # the EncryptedData is read once, in attachments.decrypt
        if encryption.is_cbc(algorithm):
            _check_cbc(st, ed, key)

    attachments.decrypt(ed, secret, st.req.encryption.data_algorithms, st.parts, cbc_rules)


def _decrypted_already(st: _State, ed: etree._Element) -> bool:
    return st.parts is not None and any(p.encrypted_data is ed for p in st.parts)


def _data_key(st: _State, ed: etree._Element) -> bytes:
    """The key of an EncryptedData that names it in its own KeyInfo."""
    embedded = encryption.embedded_encrypted_key(ed)
    if embedded is not None:
        size = encryption.data_key_size(ed, st.req.encryption.data_algorithms)
        return _open_encrypted_key(st, embedded, size)
    key_info = encryption.key_for(ed)
    if key_info is None:
        raise faults.security("SecurityTokenUnavailable", "EncryptedData names no key")
    secret = _context_secret(st, key_info) or _resolve_secret(st, _named_key(st, keys.parse_key_info(key_info)))
    if secret is None:
        raise faults.security("SecurityTokenUnavailable", "EncryptedData key reference does not name a secret")
    return secret


def _named_key(st: _State, ref: keys.KeyRef, index: Mapping[str, etree._Element] | None = None) -> keys.KeyRef:
    """A wsse:Reference that names no element of the message but a configured pre-shared key is that key, by
    name (keys.str_pre_shared_key). Elements of the message win: an attacker's wsu:Id never stands for a key
    name, and a key name is looked up only when nothing in the message carries it. `index`: the document's
    signature.id_index, where the caller has it."""
    if ref.kind != "reference" or ref.value in st.secret_by_id or ref.value in st.tokens:
        return ref
    named = ref.value_type == ns.PRE_SHARED_KEY or (ref.value_type is None and ref.value in st.creds.psk)
    if not named or ref.value in (signature.id_index(st.env.root) if index is None else index):
        return ref
    return keys.KeyRef("key_name", ref.value)


def _resolve_secret(st: _State, ref: keys.KeyRef) -> bytes | None:
    if ref.kind == "reference" and ref.value in st.secret_by_id:
        return st.secret_by_id[ref.value]
    if ref.kind == "encrypted_key_sha1":
        got = st.secret_by_sha1.get(ref.value) or st.creds.encrypted_keys.get(ref.value)
        if got is None:
            raise faults.security("SecurityTokenUnavailable", "EncryptedKeySHA1 names no known key")
        return got
    if ref.kind == "key_name":
        got = st.creds.psk.get(ref.value)
        if got is None:
            raise faults.security("SecurityTokenUnavailable", f"unknown key name {ref.value[:80]!r}")
        return got
    return None


def _holder_key(st: _State, ref: keys.KeyRef) -> x509.Certificate | bytes | None:
    """Where the signature's KeyInfo names the header's SAML assertion (SAML Token Profile 1.1, 3.5): the key it
    confirms, its certificate or the symmetric key of its EncryptedKey, opened with the route's key under the rules
    of any EncryptedKey (one FailedCheck whatever fails). None where the KeyInfo names something else."""
    a = st.out.assertion
    if not (ref.kind == "saml_id" or (ref.kind == "reference" and a is not None and ref.value == a.id)):
        return None
    if a is None or st.creds.saml is None or ref.value != a.id:
        raise faults.security("SecurityTokenUnavailable", "reference names no SAML assertion read before it")
    key = st.creds.saml.holder_key(a)
    if isinstance(key, x509.Certificate):
        return key
    secret = _open_encrypted_key(st, key)
    if len(secret) < signature.MIN_HMAC_KEY:
        raise encryption.failed(f"holder-of-key EncryptedKey: a key of {len(secret)} bytes")
    return secret


def _resolve_certificate(st: _State, ref: keys.KeyRef) -> x509.Certificate:
    if ref.kind == "reference":
        cert = st.tokens.get(ref.value)
        if cert is None:
            raise faults.security("SecurityTokenUnavailable", f"reference #{ref.value[:80]} names no token")
        return cert
    for cert in [*st.tokens.values(), *st.creds.known_certificates]:
        if keys.matches(ref, cert):
            return cert
    raise faults.security("SecurityTokenUnavailable", f"no certificate matches the {ref.kind} reference")


def _assertion(st: _State, el: etree._Element) -> bool:
    if st.creds.saml is None:
        raise faults.security("InvalidSecurity", "SAML assertion on a route that takes none")
    if st.out.assertion is not None:
        raise faults.security("InvalidSecurity", "more than one SAML assertion")
    st.out.assertion = st.creds.saml.verify(el, _ids(st), st.now)
    return False


def _assertion_reference(st: _State, el: etree._Element) -> bool:
    """A SecurityTokenReference of its own in the header names the SAML assertion read before it (and, signed,
    binds the message to that assertion: sender-vouches)."""
    if st.out.assertion is None or not st.out.assertion.named_by(el):
        raise faults.security("InvalidSecurity", "SecurityTokenReference names no SAML assertion read before it")
    return False


def _encrypted_assertion(st: _State, el: etree._Element) -> bool:
    """A SAML 2.0 EncryptedAssertion: opened as any EncryptedData (the same oracle rules: GCM, or CBC under a key
    from an EncryptedKey used once), the Assertion put in its place and read next."""
    if st.creds.saml is None:
        raise faults.security("InvalidSecurity", "SAML assertion on a route that takes none")
    parts = [c for c in el if isinstance(c.tag, str)]
    if [c.tag for c in parts] != [ENCRYPTED_DATA] or parts[0].get("Type") != encryption.TYPE_ELEMENT:
        raise faults.security("InvalidSecurity", "EncryptedAssertion must hold one EncryptedData of an element")
    ed = parts[0]
    if encryption.embedded_encrypted_key(ed) is None:
        raise faults.security("InvalidSecurity", "EncryptedAssertion's key must be in its EncryptedData's KeyInfo")
    secret = _data_key(st, ed)
    algorithms = st.req.encryption.data_algorithms
    if encryption.cbc_data(ed, algorithms):
        _check_cbc(st, ed, secret)
    landing = [n for n in encryption.decrypt_data(ed, secret, algorithms, st.req.limits) if isinstance(n.tag, str)]
    if len(landing) != 1 or landing[0].tag != saml.ASSERTION2:
        raise faults.security("InvalidSecurity", "EncryptedAssertion does not hold one saml:Assertion")
    drop_comments(landing[0])
    st.out.decrypted = True
    el.addnext(landing[0])
    xmlsupport.remove(el, blank_tail=False)
    return True


def _signature(st: _State, sig: etree._Element) -> bool:
    st.signatures += 1
    if st.signatures > 1:
        raise faults.security("InvalidSecurity", "more than one ds:Signature")
    key_info = xmlsupport.child(sig, KEY_INFO)
    if key_info is None:
        raise faults.security("SecurityTokenUnavailable", "ds:Signature without ds:KeyInfo")
    # One walk of the document for its ids, here and in signature.verify: nothing changes the tree in between.
    index = _ids(st)
    ref: keys.KeyRef | None = None
    holder: x509.Certificate | bytes | None = None
    secret = _context_secret(st, key_info)
    if secret is None:
        ref = _named_key(st, keys.parse_key_info(key_info), index)
        holder = _holder_key(st, ref)
        secret = _resolve_secret(st, ref) if holder is None else None
    key: x509.Certificate | bytes
    if isinstance(holder, bytes):
        key = holder  # the assertion, not the route's kind of signer, says which key signs (saml.confirm)
    elif secret is not None:
        from_context = ref is None or (ref.kind == "reference" and ref.value in st.derived_ids)
        if st.req.signer == "x509":
            raise faults.security("InvalidSecurity", "symmetric signature on a route that requires X.509")
        if st.req.signer == "context" and not from_context:
            raise faults.security("InvalidSecurity", "signature key not derived from a security context")
        key = secret
    else:
        if st.req.signer == "symmetric":
            raise faults.security("InvalidSecurity", "X.509 signature on a route that requires a symmetric key")
        assert ref is not None  # a context's own key is a secret
        key = holder if isinstance(holder, x509.Certificate) else _resolve_certificate(st, ref)
        if st.creds.saml is not None:  # the assertion says whether this signer may sign (saml.confirm)
            st.out.signer_certificate = key
        elif st.creds.trust is None:
            raise faults.security("FailedAuthentication", "no trust anchors for X.509 signatures")
        else:  # The certificate is trusted before its signature is worth checking.
            st.out.subject = st.creds.trust.validate(key, [], st.now)
            st.out.signer_certificate = key
            st.out.signer_chain = st.creds.trust.chain(key)
    verified = signature.verify(
        sig, st.env, key, st.req.signature, st.creds.optimizations, st.parts, lambda r: _str_token(st, r), index
    )
    replayed = faults.security("InvalidSecurity", "replay: signature value seen before")
    _first_sight(st, b"sig:" + verified.signature_value, _replay_ttl(st), replayed)
    st.out.signed.extend(verified.elements)
    st.out.signed_attachments.extend(verified.attachments)
    st.out.signature_algorithm = verified.algorithm
    st.signature = sig
    if isinstance(key, bytes):
        st.out.symmetric_key = key
        st.out.key_reference = None if ref is None else _reply_reference(st, ref, key)
    if isinstance(holder, bytes) and st.out.assertion is not None and st.creds.saml is not None:
        st.out.proof_key = st.creds.saml.holder_key(st.out.assertion)  # the EncryptedKey, by identity
    return False


def _str_token(st: _State, str_el: etree._Element) -> etree._Element:
    """What an STR-Transform reference signs: the header's one SAML assertion, verified before, by identity."""
    a = st.out.assertion
    if a is None or not a.named_by(str_el):
        raise faults.security("InvalidSecurity", "STR-Transform: the STR names no SAML assertion verified before")
    return a.element


def _read_before(st: _State, el: etree._Element) -> bool:
    """A token read before the walk (BinarySecurityTokens, SecurityContextTokens): nothing to do in it."""
    return False


def _ids(st: _State) -> dict[str, etree._Element]:
    """Every id value of the document -> its element (signature.id_index), one walk of the whole document for the
    assertion's and the signature's checks while no handler changed the tree in between."""
    if st.index is None:
        st.index = signature.id_index(st.env.root)
    return st.index


def _reply_reference(st: _State, ref: keys.KeyRef, secret: bytes) -> keys.KeyRef:
    """How to name a symmetric key back to its sender: by EncryptedKeySHA1 for a key it sent us encrypted."""
    if ref.kind == "reference":
        for sha1, value in st.secret_by_sha1.items():
            if value is secret:
                return keys.KeyRef("encrypted_key_sha1", sha1, ns.ENCKEY_SHA1)
    return ref


def _derived_key_token(st: _State, el: etree._Element) -> bool:
    ck = sc.derive(el, _resolver(st, "DerivedKeyToken"))
    if not ck.id:
        raise faults.security("InvalidSecurity", "DerivedKeyToken without wsu:Id")
    _enter_context(st, ck.context)
    st.secret_by_id[ck.id] = ck.key
    st.derived_ids.add(ck.id)
    return False


def _context_secret(st: _State, key_info: etree._Element) -> bytes | None:
    """The context's own key where `key_info` names an SCT (a reference with the SCT token type, or '#id' of one
    in the header), on routes that take it (Requirements.context_key_direct); None where it names anything else."""
    children = sc.child_elements(key_info)
    if len(children) != 1 or children[0].tag != keys.STR:
        return None
    str_el = children[0]
    version = sc.names_sct(str_el, st.scts)
    if version is None:
        return None
    resolve = _resolver(st, "SecurityContextToken reference")
    if st.req.signer != "context" or not st.req.context_key_direct:
        raise faults.security("InvalidSecurity", "security context key not derived on a route that requires it")
    ctx = resolve(sc.parse_sct_ref(str_el, version, sc.invalid_token))
    _enter_context(st, ctx)
    return ctx.secret


def _resolver(st: _State, what: str) -> sc.SctResolver:
    if st.creds.contexts is None:
        raise faults.security("InvalidSecurity", f"{what} on a route without security contexts")
    if st.resolve is None:
        st.resolve = st.creds.contexts(st.now, st.scts)
    return st.resolve


def _enter_context(st: _State, ctx: sc.Context) -> None:
    """One security context per message: every key, derived or not, comes from the same one."""
    if st.out.context is not None and st.out.context.identifier != ctx.identifier:
        raise faults.security("InvalidSecurity", "keys from two security contexts in one message")
    st.out.context = ctx
    st.out.subject = ctx.subject or st.out.subject


def _encrypted_data(st: _State, ed: etree._Element) -> bool:
    """An encrypted header token (e.g. a UsernameToken) that names its own key, or an encrypted attachment's
    EncryptedData (it stays in the header: nothing takes its place)."""
    ed_id = ed.get("Id")
    if not ed_id:
        raise faults.security("InvalidSecurity", "EncryptedData in the Security header without Id")
    if _decrypted_already(st, ed):
        # An attachment's, named by a ReferenceList before: its Id was found on it alone then, and this is the
        # element itself, not found by Id (a later reference to that Id is looked up again).
        return False
    _decrypt_reference(st, ed_id, None)
    return not attachments.is_attachment_data(ed)


_PROCESSORS: dict[str, Callable[[_State, etree._Element], bool]] = {
    TIMESTAMP: _timestamp,
    USERNAME_TOKEN: _username_token,
    BST: _read_before,  # registered before the walk
    ENCRYPTED_KEY: _encrypted_key,
    REFERENCE_LIST: _reference_list,
    SIGNATURE: _signature,
    ENCRYPTED_DATA: _encrypted_data,
    saml.ASSERTION2: _assertion,
    saml.ASSERTION1: _assertion,
    saml.ENCRYPTED_ASSERTION: _encrypted_assertion,
    saml.STR: _assertion_reference,
    # A SecurityContextToken is read with the header (header_scts), when a DerivedKeyToken names it.
    **{ns.q(v.wsc, "SecurityContextToken"): _read_before for v in sc.VERSIONS},
    **{ns.q(v.wsc, "DerivedKeyToken"): _derived_key_token for v in sc.VERSIONS},
}
# Handlers that never change the tree (no decryption, nothing moved): the id index made before them still holds.
_KEEP_TREE = {_timestamp, _signature, _assertion, _assertion_reference, _read_before}


def _check_requirements(st: _State) -> None:
    req, out, env = st.req, st.out, st.env
    if req.timestamp.required and out.timestamp is None:
        raise faults.security("InvalidSecurity", "required wsu:Timestamp missing")
    if req.username_token.required and out.username is None:
        raise faults.security("InvalidSecurity", "required UsernameToken missing")
    if req.body_encrypted and not out.decrypted_body:
        raise faults.security("InvalidSecurity", "the Body was required to be encrypted")
    if req.signer is None and (st.signatures == 0 or st.creds.saml is None):
        return  # a `saml` route's optional signature (bearer) is held to the parts like any other
    if st.signatures == 0:
        raise faults.security("InvalidSecurity", "required signature missing")
    parts = req.signature.parts
    if not out.covers(env.body):
        raise faults.security("InvalidSecurity", "the soap:Body is not signed")
    security = st.security
    if "timestamp" in parts:
        ts = xmlsupport.child(security, TIMESTAMP)
        if ts is not None and not any(s is ts for s in out.signed):
            raise faults.security("InvalidSecurity", "the wsu:Timestamp is not signed")
    if "username_token" in parts:
        ut = xmlsupport.child(security, USERNAME_TOKEN)
        if ut is not None and not any(s is ut for s in out.signed):
            raise faults.security("InvalidSecurity", "the UsernameToken is not signed")
    if "addressing" in parts and env.header is not None:
        for h in env.header.iterchildren():
            if addressing(h) and not any(s is h for s in out.signed):
                raise faults.security("InvalidSecurity", f"WS-Addressing header {h.tag} is not signed")
    # Every decrypted part must be covered by the signature: before decryption (encrypt-then-sign) or after
    # (sign-then-encrypt). An unsigned EncryptedData is an attacker's ciphertext (CVE-2015-0227). The one
    # exception is the ds:Signature itself, decrypted (EncryptSignature) and then verified like any other.
    for parent, landing, was_signed in st.decrypted:
        if len(landing) == 1 and landing[0] is st.signature and parent is security:
            continue
        if not (was_signed or out.covers(parent) or all(out.covers(n) for n in landing if isinstance(n.tag, str))):
            raise faults.security("InvalidSecurity", "decrypted content not covered by the signature")


def _check_attachments(st: _State) -> None:
    """Each attachment the route's policy names arrived signed (with its headers where `headers_signed`) and,
    where `encrypted`, encrypted; a decrypted attachment is signed like decrypted content (CVE-2015-0227)."""
    policy = st.req.attachments
    for part in st.parts or ():
        if part.decrypted and part.signed is None and not st.out.covers(part.encrypted_data):
            raise faults.security("InvalidSecurity", f"decrypted attachment {part.content_id[:80]!r} not signed")
        if not policy.must_sign_type(part.content_type):
            continue
        if part.signed is None:
            raise faults.security("InvalidSecurity", f"attachment {part.content_id[:80]!r} is not signed")
        if policy.headers_signed and part.signed != "complete":
            raise faults.security("InvalidSecurity", f"attachment {part.content_id[:80]!r}: its headers are not signed")
        if policy.encrypted and not part.decrypted:
            raise faults.security("InvalidSecurity", f"attachment {part.content_id[:80]!r} was not encrypted")


def addressing(block: etree._Element) -> bool:
    return isinstance(block.tag, str) and etree.QName(block).namespace in ns.ADDRESSING


def _strip(env: Envelope, security: etree._Element) -> None:
    """Leave plain SOAP: no Security header, no empty Header, no wsu:Id the sender put on the Body."""
    header = security.getparent()
    assert header is not None
    xmlsupport.remove(security, blank_tail=False)
    if not any(isinstance(c.tag, str) for c in header):
        xmlsupport.remove(header, blank_tail=False)
    body = env.body
    if body.get(WSU_ID) is not None:
        del body.attrib[WSU_ID]
        _drop_wsu_declaration(body)


# Whether a prefix is written as a QName's ("p:") in any attribute value or text of a subtree.
_MENTIONED = etree.XPath("boolean(descendant-or-self::*/@*[contains(., $p)] | descendant::text()[contains(., $p)])")


def _drop_wsu_declaration(body: etree._Element) -> None:
    """Remove the wsu declaration the signer put on the Body for its wsu:Id, when that is safe with lxml's only
    tool, cleanup_namespaces: it sees element and attribute names, not QNames in values (xsi:type="p:T"), and it
    drops any unused default namespace declaration, an undeclaration (xmlns="") included. So it runs limited to
    the wsu prefix, when no value names that prefix and the Body declares no default namespace; else the
    declaration stays (unused, harmless)."""
    parent = body.getparent()
    inherited = parent.nsmap if parent is not None else {}
    for prefix in [p for p, uri in body.nsmap.items() if uri == ns.WSU and p and inherited.get(p) != uri]:
        declared = {p for _, (p, _) in etree.iterwalk(body, events=("start-ns",))}
        if "" in declared or None in declared or _MENTIONED(body, p=prefix + ":"):
            continue
        etree.cleanup_namespaces(body, keep_ns_prefixes=[p for p in declared if p != prefix])
