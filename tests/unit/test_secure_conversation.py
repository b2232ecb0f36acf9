"""WS-SecureConversation: P_SHA1, derived keys, the RST/RSTR exchange, and the three context stores.

Real keys (the session PKI), real AES-GCM master keys files, and a real redis-server per module."""

from __future__ import annotations

import base64
import copy
import dataclasses
import hmac
import os
import pickle
import time
import tracemalloc
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import redis
import yaml
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import rsa
from lxml import etree

from filters.engine import faults, ns
from filters.engine.conversation import contexts, ws_trust
from filters.engine.wss import keys
from filters.engine.wss import secure_conversation as sc
from filters.engine.wss.secure_conversation import VERSIONS, WSC_1_3, WSC_2005_02, Context, Version
from filters.engine.xml.threat_protection import parse_envelope
from filters.stores import contexts as context_store
from filters.stores import replay
from filters.stores.factory import RouteStores
from gateway.policy import Limits, SecureConversationOptions
from tests.support.harness import free_ports

NOW = datetime.now(UTC)
SUBJECT = "CN=Demo Client,O=WSGate Demo"
LIFETIME = 3600
VERSION_IDS = [v.name for v in VERSIONS]


def refused(code: str, code_ns: str | None = None) -> pytest.RaisesExc[faults.Fault]:
    return pytest.raises(faults.Fault, check=lambda f: f.code == code and (code_ns is None or f.code_ns == code_ns))


def reparsed(el: etree._Element) -> etree._Element:
    """What the other side gets: the element serialized and parsed again."""
    return etree.fromstring(etree.tostring(el))


def b64(text: str) -> bytes:
    return base64.b64decode(text)


# --- the client and master keys


@pytest.fixture(scope="module")
def client_key(pki: Path) -> rsa.RSAPrivateKey:
    return keys.load_private_key(pki / "client.key")


@pytest.fixture(scope="module")
def client_cert(pki: Path) -> x509.Certificate:
    return keys.load_certificate(pki / "client.pem")


def write_master_keys(path: Path, *key_ids: str, secrets: dict[str, bytes] | None = None) -> Path:
    """A master keys file; keys already in `secrets` are reused, so a key keeps its value across files."""
    secrets = secrets if secrets is not None else {}
    for key_id in key_ids:
        secrets.setdefault(key_id, os.urandom(32))
    doc = {"keys": [{"id": k, "key": base64.b64encode(secrets[k]).decode()} for k in key_ids]}
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture
def master_keys(tmp_path: Path) -> Path:
    return write_master_keys(tmp_path / "sct-master-keys.yaml", "k1")


def sealed(
    master_keys: Path, lifetime_s: int = LIFETIME, max_revocations: int = 1000
) -> context_store.SealedContextStore:
    revocations = context_store.MemoryRevocations(
        max_revocations, epoch=NOW - timedelta(hours=1)
    )  # the tests' clock is NOW
    return context_store.SealedContextStore(context_store.load_master_keys(master_keys), lifetime_s, revocations)


@pytest.fixture
def redis_url(redis_server: str) -> Iterator[str]:
    client = redis.Redis.from_url(redis_server)
    client.flushdb()
    replay.set_epoch(client, int((NOW - timedelta(hours=1)).timestamp() * 1000))  # flushed: a new epoch, before NOW
    yield redis_server
    client.close()


# --- every store, built the way a route builds it

STORE_KINDS = ["sealed", "sealed-shared-cancel", "memory", "redis"]
StoreFactory = Callable[..., contexts.ContextStore]


@pytest.fixture(params=STORE_KINDS)
def make(request: pytest.FixtureRequest, master_keys: Path) -> Iterator[StoreFactory]:
    """Builds stores of one kind (a second call: another replica sharing what that kind shares)."""
    kind = request.param
    url = request.getfixturevalue("redis_url") if kind in ("redis", "sealed-shared-cancel") else None
    built: list[contexts.ContextStore] = []

    def factory(lifetime_s: int = LIFETIME, max_contexts: int = 1000) -> contexts.ContextStore:
        options = SecureConversationOptions(
            store="memory" if kind == "memory" else "redis" if kind == "redis" else "sealed",
            lifetime_s=lifetime_s,
            max_contexts=max_contexts,
            master_keys_file=str(master_keys),
        )
        store = context_store.make_store(options, url)
        built.append(store)
        return store

    yield factory
    for store in built:
        if isinstance(store, context_store.RedisContextStore):
            store.close()
        if isinstance(store, context_store.SealedContextStore) and isinstance(
            store.revocations, context_store.RedisRevocations
        ):
            store.revocations.close()


# --- namespaces and P_SHA1


def test_namespace_table_matches_the_specs() -> None:
    old, new = WSC_2005_02, WSC_1_3
    assert (old.wsc, old.wst) == (
        "http://schemas.xmlsoap.org/ws/2005/02/sc",
        "http://schemas.xmlsoap.org/ws/2005/02/trust",
    )
    assert old.sct_token_type == "http://schemas.xmlsoap.org/ws/2005/02/sc/sct"
    assert old.dk_token_type == "http://schemas.xmlsoap.org/ws/2005/02/sc/dk"
    assert old.p_sha1 == "http://schemas.xmlsoap.org/ws/2005/02/sc/dk/p_sha1"
    assert old.computed_key_psha1 == "http://schemas.xmlsoap.org/ws/2005/02/trust/CK/PSHA1"
    assert old.nonce_type == "http://schemas.xmlsoap.org/ws/2005/02/trust/Nonce"
    assert old.issue_action == "http://schemas.xmlsoap.org/ws/2005/02/trust/RST/SCT"
    assert old.cancel_reply_action == "http://schemas.xmlsoap.org/ws/2005/02/trust/RSTR/SCT/Cancel"
    assert new.wsc == "http://docs.oasis-open.org/ws-sx/ws-secureconversation/200512"
    assert new.wst == "http://docs.oasis-open.org/ws-sx/ws-trust/200512"
    assert new.sct_token_type == "http://docs.oasis-open.org/ws-sx/ws-secureconversation/200512/sct"
    assert new.dk_token_type == "http://docs.oasis-open.org/ws-sx/ws-secureconversation/200512/dk"
    assert new.p_sha1 == "http://docs.oasis-open.org/ws-sx/ws-secureconversation/200512/dk/p_sha1"
    assert new.computed_key_psha1 == "http://docs.oasis-open.org/ws-sx/ws-trust/200512/CK/PSHA1"
    assert new.nonce_type == "http://docs.oasis-open.org/ws-sx/ws-trust/200512/Nonce"
    assert new.issue == "http://docs.oasis-open.org/ws-sx/ws-trust/200512/Issue"
    assert new.issue_action == "http://docs.oasis-open.org/ws-sx/ws-trust/200512/RST/SCT"
    assert new.issue_reply_action == "http://docs.oasis-open.org/ws-sx/ws-trust/200512/RSTR/SCT"
    assert new.cancel_action == "http://docs.oasis-open.org/ws-sx/ws-trust/200512/RST/SCT/Cancel"


VECTOR_SECRET = b64("grrlUUfhuNwlvQzQ4bV6TT3wA8ieZPltIf4+H7nIvCE=")
VECTOR_SEED = b64("YLABh3ZmZyiO5gvVLZe9J4JPd9w59KGeTFwE85XlzxE=")


def test_p_sha1_vector() -> None:
    assert sc.p_sha1(VECTOR_SECRET, VECTOR_SEED, 32) == b64("Wv3QzY84KfgwSkn1z3QV+LXEoo3nPraZPysJYtA3u4c=")


def test_p_sha1_vector_with_secret_and_seed_swapped() -> None:
    # The interop bug the notes warn about: the other argument order is another key.
    assert sc.p_sha1(VECTOR_SEED, VECTOR_SECRET, 32) == b64("g/uYZmYX7rOm/X7UV4usrvjIPCiWMWwNZJL0ejvz6Y4=")


def test_p_sha1_lengths() -> None:
    long = sc.p_sha1(VECTOR_SECRET, VECTOR_SEED, 100)
    assert len(long) == 100
    for n in (0, 1, 19, 20, 21, 32, 64):
        assert sc.p_sha1(VECTOR_SECRET, VECTOR_SEED, n) == long[:n]
    with pytest.raises(ValueError):
        sc.p_sha1(VECTOR_SECRET, VECTOR_SEED, -1)


def test_p_sha1_keyed_once_is_the_same_function() -> None:
    keyed = sc.KeyedSha1(VECTOR_SECRET)
    assert sc.p_sha1(keyed, VECTOR_SEED, 32) == b64("Wv3QzY84KfgwSkn1z3QV+LXEoo3nPraZPysJYtA3u4c=")
    assert sc.p_sha1(keyed, VECTOR_SEED, 100) == sc.p_sha1(VECTOR_SECRET, VECTOR_SEED, 100)  # not used up by a call


@pytest.mark.parametrize("size", [0, 1, 16, 20, 32, 63, 64, 65, 128, 255])
def test_keyed_sha1_is_rfc_2104_hmac_at_every_key_size(size: int) -> None:
    """KeyedSha1 computes HMAC-SHA1 from SHA-1 states made once: the same MAC as the standard library's for
    keys shorter than, as long as and longer than SHA-1's block (hashed first), over any data, again and again."""
    key = os.urandom(size)
    keyed = sc.KeyedSha1(key)
    for data in (b"", b"x", os.urandom(100), VECTOR_SEED):
        assert keyed.mac(data) == hmac.digest(key, data, "sha1")
        assert keyed.mac(data) == hmac.digest(key, data, "sha1")


# --- DerivedKeyToken


SECRET = bytes(range(32))
NONCE = bytes(range(100, 116))


def dkt_xml(version: Version, params: str, reference: str | None = None, attrs: str = "") -> etree._Element:
    """A DerivedKeyToken as a foreign stack writes it."""
    ref = (
        f'<wsse:Reference URI="urn:uuid:ctx" ValueType="{version.sct_token_type}"/>' if reference is None else reference
    )
    return etree.fromstring(
        f'<wsc:DerivedKeyToken xmlns:wsc="{version.wsc}" xmlns:wsse="{ns.WSSE}" xmlns:wsu="{ns.WSU}" '
        f'wsu:Id="DK-1"{attrs}><wsse:SecurityTokenReference>{ref}</wsse:SecurityTokenReference>{params}'
        "</wsc:DerivedKeyToken>"
    )


def nonce_xml(nonce: bytes = NONCE) -> str:
    return f"<wsc:Nonce>{base64.b64encode(nonce).decode()}</wsc:Nonce>"


def context_for(version: Version, identifier: str = "urn:uuid:ctx") -> Context:
    return Context(identifier, SECRET, SUBJECT, version, NOW, NOW + timedelta(hours=1))


def fixed(ctx: Context) -> sc.SctResolver:
    """A resolver that knows one context by its identifier."""

    def resolve(ref: sc.SctRef) -> Context:
        assert ref.identifier == ctx.identifier
        return ctx

    return resolve


@pytest.mark.parametrize("version", VERSIONS, ids=VERSION_IDS)
def test_dkt_defaults(version: Version) -> None:
    got = sc.derive(dkt_xml(version, nonce_xml()), fixed(context_for(version)))
    assert got.id == "DK-1"
    assert got.key == sc.p_sha1(SECRET, b"WS-SecureConversationWS-SecureConversation" + NONCE, 32)
    assert got.context.subject == SUBJECT


@pytest.mark.parametrize("version", VERSIONS, ids=VERSION_IDS)
def test_dkt_offset(version: Version) -> None:
    el = dkt_xml(version, f"<wsc:Offset>16</wsc:Offset><wsc:Length>24</wsc:Length>{nonce_xml()}")
    got = sc.derive(el, fixed(context_for(version)))
    assert got.key == sc.p_sha1(SECRET, sc.DEFAULT_LABEL + NONCE, 40)[16:40]
    assert len(got.key) == 24


@pytest.mark.parametrize("version", VERSIONS, ids=VERSION_IDS)
def test_dkt_generation(version: Version) -> None:
    # WSE: without Offset, the key starts at Generation x Length.
    el = dkt_xml(version, f"<wsc:Generation>3</wsc:Generation><wsc:Length>16</wsc:Length>{nonce_xml()}")
    got = sc.derive(el, fixed(context_for(version)))
    assert got.key == sc.p_sha1(SECRET, sc.DEFAULT_LABEL + NONCE, 64)[48:64]
    el0 = dkt_xml(version, f"<wsc:Generation>0</wsc:Generation>{nonce_xml()}")
    assert sc.derive(el0, fixed(context_for(version))).key == sc.p_sha1(SECRET, sc.DEFAULT_LABEL + NONCE, 32)


def test_dkt_label_and_algorithm() -> None:
    version = WSC_1_3
    el = dkt_xml(version, f"<wsc:Label>my label</wsc:Label>{nonce_xml()}", attrs=f' Algorithm="{version.p_sha1}"')
    assert sc.derive(el, fixed(context_for(version))).key == sc.p_sha1(SECRET, b"my label" + NONCE, 32)


@pytest.mark.parametrize(
    ("params", "attrs", "code"),
    [
        (f"<wsc:Offset>0</wsc:Offset><wsc:Generation>1</wsc:Generation>{nonce_xml()}", "", "InvalidSecurity"),
        ("", "", "InvalidSecurity"),  # no Nonce
        (nonce_xml(b"short"), "", "InvalidSecurity"),
        ("<wsc:Nonce>not base64!</wsc:Nonce>", "", "InvalidSecurity"),
        ("<wsc:Nonce>QUJDREVGR0hJSktMTU5PUA\u00c4=</wsc:Nonce>", "", "InvalidSecurity"),  # beyond ASCII: a fault
        ("<wsc:Nonce>=QUJDREVGR0hJSktMTU5PUA=</wsc:Nonce>", "", "InvalidSecurity"),  # padding first
        (f"<wsc:Length>8</wsc:Length>{nonce_xml()}", "", "InvalidSecurity"),
        (f"<wsc:Length>65</wsc:Length>{nonce_xml()}", "", "InvalidSecurity"),
        (f"<wsc:Length>32</wsc:Length><wsc:Length>16</wsc:Length>{nonce_xml()}", "", "InvalidSecurity"),
        (f"<wsc:Offset>4065</wsc:Offset>{nonce_xml()}", "", "InvalidSecurity"),
        (f"<wsc:Generation>999999</wsc:Generation>{nonce_xml()}", "", "InvalidSecurity"),
        (f"<wsc:Offset>-1</wsc:Offset>{nonce_xml()}", "", "InvalidSecurity"),
        # Other spellings of a number int() would take: a sign, '_', other scripts' digits, too many digits.
        *(
            (f"<wsc:{n}>{v}</wsc:{n}>{nonce_xml()}", "", "InvalidSecurity")
            for n, v in (
                ("Length", "+32"),
                ("Length", "3_2"),
                ("Length", "\u0663\u0662"),
                ("Offset", "0000000016"),
                ("Generation", "\uff11"),
                ("Offset", "0x10"),
                ("Length", "32.0"),
            )
        ),
        (f"<wsc:Properties/>{nonce_xml()}", "", "InvalidSecurity"),
        (
            f'<old:Nonce xmlns:old="{WSC_2005_02.wsc}">{base64.b64encode(NONCE).decode()}</old:Nonce>',
            "",
            "InvalidSecurity",
        ),  # the other version's Nonce
        (nonce_xml(), ' Algorithm="http://example.com/hkdf"', "UnsupportedAlgorithm"),
    ],
)
def test_dkt_refusals(params: str, attrs: str, code: str) -> None:
    with refused(code, ns.WSSE):
        sc.derive(dkt_xml(WSC_1_3, params, attrs=attrs), fixed(context_for(WSC_1_3)))


def test_dkt_reference_split_by_a_comment_reads_alike() -> None:
    """A comment beside the Reference changes nothing; a comment where the Reference should be names nothing."""
    reference = f'<wsse:Reference URI="urn:uuid:ctx" ValueType="{WSC_1_3.sct_token_type}"/>'
    for spelled in (f"<!--a-->{reference}", f"{reference}<!--b-->", f"<?pi x?>{reference}"):
        got = sc.derive(dkt_xml(WSC_1_3, nonce_xml(), reference=spelled), fixed(context_for(WSC_1_3)))
        assert got.key == sc.p_sha1(SECRET, sc.DEFAULT_LABEL + NONCE, 32)
    for spelled in ("<!--a-->", "<?pi x?>", f"{reference}{reference}"):
        with refused("UnknownDerivationSource", WSC_1_3.wsc):
            sc.derive(dkt_xml(WSC_1_3, nonce_xml(), reference=spelled), fixed(context_for(WSC_1_3)))


@pytest.mark.parametrize("version", VERSIONS, ids=VERSION_IDS)
@pytest.mark.parametrize(
    "reference",
    [
        f'<wsse:Reference URI="#x509" ValueType="{ns.X509V3}"/>',
        '<wsse:Reference URI="urn:uuid:ctx"/>',  # an identifier needs the SCT ValueType
        f'<wsse:KeyIdentifier ValueType="{ns.ENCKEY_SHA1}">AAAA</wsse:KeyIdentifier>',
        f'<wsse:Reference URI="urn:uuid:ctx" ValueType="{ns.ENCKEY_TOKEN}"/>',
        '<wsse:Reference URI="#no-such-sct"/>',
        "",
    ],
    ids=["x509", "no-value-type", "key-identifier", "encrypted-key", "missing-local", "empty"],
)
def test_unknown_derivation_source(version: Version, reference: str) -> None:
    store = context_store.MemoryContextStore(LIFETIME, 10)
    with refused("UnknownDerivationSource", version.wsc):
        sc.derive(dkt_xml(version, nonce_xml(), reference), contexts.store_resolver(store, NOW, {}))


def test_dkt_of_one_version_naming_an_sct_of_the_other() -> None:
    other = WSC_2005_02.sct_token_type
    with refused("UnknownDerivationSource", WSC_1_3.wsc):
        sc.parse_dkt(dkt_xml(WSC_1_3, nonce_xml(), f'<wsse:Reference URI="urn:uuid:ctx" ValueType="{other}"/>'))


def security_header(*children: etree._Element) -> etree._Element:
    """A wsse:Security header in an envelope, holding `children`."""
    env = parse_envelope(
        f'<s:Envelope xmlns:s="{ns.SOAP11}"><s:Header><wsse:Security xmlns:wsse="{ns.WSSE}"/></s:Header>'
        '<s:Body><m xmlns="urn:m">x</m></s:Body></s:Envelope>'.encode(),
        Limits(),
    )
    security = env.root.find(f".//{ns.q(ns.WSSE, 'Security')}")
    assert security is not None
    security.extend(children)
    return security


@pytest.mark.parametrize("version", VERSIONS, ids=VERSION_IDS)
def test_dkt_referencing_an_sct_in_the_same_header(version: Version) -> None:
    store = context_store.MemoryContextStore(LIFETIME, 10)
    ctx = store.issue(SECRET, SUBJECT, version, NOW)
    token = sc.sct_element(version, ctx.identifier, "sct-1")
    mine = sc.message_keys(ctx, local_id="sct-1")
    security = security_header(token, mine.signing.element, mine.encryption.element)
    local = sc.header_scts(reparsed(security))
    assert local == {"sct-1": sc.Sct(version, ctx.identifier, "sct-1")}
    resolve = contexts.store_resolver(store, NOW, local)
    assert sc.derive(reparsed(mine.signing.element), resolve).key == mine.signing.key
    assert sc.derive(reparsed(mine.encryption.element), resolve).key == mine.encryption.key
    assert mine.signing.key != mine.encryption.key
    # Without the header's SCTs, '#sct-1' names nothing.
    with refused("UnknownDerivationSource", version.wsc):
        sc.derive(reparsed(mine.signing.element), contexts.store_resolver(store, NOW))


def test_context_keyed_p_sha1_is_its_own_secret() -> None:
    """Context.prf (keyed once per context) derives with that context's secret only: another secret, or the same
    context rebuilt with another one (dataclasses.replace), derives another key from the same token."""
    el = dkt_xml(WSC_1_3, nonce_xml())
    one = context_for(WSC_1_3)
    other = dataclasses.replace(one, secret=bytes(range(1, 33)))
    assert other.prf is not one.prf and other == dataclasses.replace(one, secret=other.secret)
    assert sc.derive(el, fixed(one)).key == sc.p_sha1(SECRET, sc.DEFAULT_LABEL + NONCE, 32)
    assert sc.derive(el, fixed(other)).key == sc.p_sha1(other.secret, sc.DEFAULT_LABEL + NONCE, 32)
    assert "prf" not in repr(one) and SECRET.hex() not in repr(one)


def test_derived_key_never_shown_in_a_repr_or_log_line() -> None:
    """A derived key (built to send, or derived from a received token) prints without its key bytes."""
    ctx = context_for(WSC_1_3)
    built = sc.context_key(ctx)
    derived = sc.derive(dkt_xml(WSC_1_3, nonce_xml()), fixed(ctx))
    for item, key in ((built, built.key), (derived, derived.key)):
        shown = f"{item!r} {item}"
        assert key.hex() not in shown and repr(key) not in shown and "key=" not in shown


def test_context_pickled_or_copied_keys_its_own_sha1() -> None:
    """A context handed to another process (the bench's pool) or copied is the same context and derives the same
    keys: its keyed SHA-1 states, which do not pickle, are made again from its secret."""
    ctx = context_for(WSC_1_3)
    el = dkt_xml(WSC_1_3, nonce_xml())
    for other in (pickle.loads(pickle.dumps(ctx)), copy.deepcopy(ctx), copy.copy(ctx)):
        assert other == ctx and other.prf is not ctx.prf
        assert sc.derive(el, fixed(other)).key == sc.derive(el, fixed(ctx)).key


def test_message_keys_fresh_per_message() -> None:
    """DerivedKeyTokens are copied from a template: each has its own Id, nonce and key, what one message's token
    carries never shows in the next one's, and each derives the key it says from the context."""
    ctx = context_for(WSC_1_3)
    first, second = sc.message_keys(ctx), sc.message_keys(ctx)
    tokens = [first.signing, first.encryption, second.signing, second.encryption]
    assert len({t.id for t in tokens}) == len({t.key for t in tokens}) == 4
    first.signing.element.find(ns.q(WSC_1_3.wsc, "Nonce")).text = "tampered"
    first.encryption.element[0][0].set("URI", "urn:other")
    third = sc.message_keys(ctx)
    for t in [*tokens[2:], third.signing, third.encryption]:
        parsed = sc.parse_dkt(reparsed(t.element))
        assert parsed.id == t.id and parsed.source.identifier == ctx.identifier
        assert sc.derive_key(parsed, SECRET) == t.key
    by_generation = sc.build_dkt(WSC_1_3, sc.sct_reference(WSC_1_3, local_id="sct-1"), SECRET, generation=2,
                                 length=16, label="my label", nonce=NONCE)  # fmt: skip
    parsed = sc.parse_dkt(reparsed(by_generation.element))
    assert (parsed.offset, parsed.length, parsed.label, parsed.nonce) == (32, 16, b"my label", NONCE)
    assert parsed.source.local_id == "sct-1"
    assert by_generation.key == sc.p_sha1(SECRET, b"my label" + NONCE, 48)[32:]
    assert sc.message_keys(ctx).signing.element.find(ns.q(WSC_1_3.wsc, "Label")) is None  # the default shape again


def test_derived_key_token_never_names_another_context_kept_built() -> None:
    """Each context's DerivedKeyToken is kept built (per version, reference and length): a message in one context
    never carries another's reference, whichever was built first, and the version's own namespace."""
    one, two = context_for(WSC_1_3, "urn:uuid:one"), context_for(WSC_1_3, "urn:uuid:two")
    old = context_for(WSC_2005_02, "urn:uuid:one")
    for ctx in (one, two, old, one, two, old):
        parsed = sc.parse_dkt(reparsed(sc.context_key(ctx).element))
        assert (parsed.version, parsed.source.identifier, parsed.length) == (ctx.version, ctx.identifier, 32)
    local = sc.parse_dkt(reparsed(sc.context_key(one, local_id="sct-1", length=16).element))
    assert (local.source.local_id, local.source.identifier, local.length) == ("sct-1", None, 16)


def test_header_sct_ids_must_be_unique() -> None:
    token = sc.sct_element(WSC_1_3, "urn:uuid:a", "dup")
    security = security_header(token)
    body_child = security.getroottree().getroot()[1][0]
    body_child.set(ns.q(ns.WSU, "Id"), "dup")
    with refused("InvalidSecurity", ns.WSSE):
        sc.header_scts(security)


def test_sct_parsing() -> None:
    v = WSC_2005_02
    decl = f'xmlns:wsc="{v.wsc}" xmlns:wsu="{ns.WSU}"'
    wcf = etree.fromstring(
        f'<wsc:SecurityContextToken {decl} wsu:Id="uuid-1"><wsc:Identifier> urn:uuid:abc </wsc:Identifier>'
        '<x:Cookie xmlns:x="urn:ext">opaque</x:Cookie></wsc:SecurityContextToken>'
    )
    assert sc.parse_sct(wcf) == sc.Sct(v, "urn:uuid:abc", "uuid-1")
    with refused("BadContextToken", v.wsc):
        sc.parse_sct(etree.fromstring(f"<wsc:SecurityContextToken {decl}/>"))
    with refused("BadContextToken", v.wsc):
        sc.parse_sct(
            etree.fromstring(
                f"<wsc:SecurityContextToken {decl}><wsc:Identifier>a</wsc:Identifier>"
                "<wsc:Identifier>b</wsc:Identifier></wsc:SecurityContextToken>"
            )
        )
    with refused("UnsupportedContextToken", v.wsc):
        sc.parse_sct(
            etree.fromstring(
                f"<wsc:SecurityContextToken {decl}><wsc:Identifier>a</wsc:Identifier>"
                "<wsc:Instance>2</wsc:Instance></wsc:SecurityContextToken>"
            )
        )


def test_build_dkt_shapes() -> None:
    version = WSC_2005_02
    ref = sc.sct_reference(version, identifier="urn:uuid:ctx")
    with_generation = sc.build_dkt(version, ref, SECRET, generation=2, length=16, label="L", nonce=NONCE)
    el = with_generation.element
    assert [etree.QName(c).localname for c in el] == [
        "SecurityTokenReference",
        "Generation",
        "Length",
        "Label",
        "Nonce",
    ]
    assert el.get(ns.q(ns.WSU, "Id")) == with_generation.id
    assert with_generation.key == sc.p_sha1(SECRET, b"L" + NONCE, 48)[32:]
    assert sc.derive(reparsed(el), fixed(context_for(version))).key == with_generation.key
    plain = sc.build_dkt(version, sc.sct_reference(version, identifier="urn:uuid:ctx"), SECRET)
    # Offset 0 and Length 32 are the defaults: left out, as WCF leaves them out; read back as such.
    assert [etree.QName(c).localname for c in plain.element] == ["SecurityTokenReference", "Nonce"]
    assert (parsed := sc.parse_dkt(reparsed(plain.element))).offset == 0 and parsed.length == sc.DEFAULT_DK_LENGTH
    assert plain.key == sc.p_sha1(
        SECRET, sc.DEFAULT_LABEL + b64(plain.element.findtext(ns.q(version.wsc, "Nonce"))), 32
    )
    at_offset = sc.build_dkt(version, sc.sct_reference(version, identifier="urn:uuid:ctx"), SECRET, offset=16)
    assert [etree.QName(c).localname for c in at_offset.element] == ["SecurityTokenReference", "Offset", "Nonce"]
    assert len(b64(plain.element.findtext(ns.q(version.wsc, "Nonce")) or "")) == 16
    with pytest.raises(ValueError):
        sc.build_dkt(version, sc.sct_reference(version, identifier="x"), SECRET, offset=32, generation=1)
    with pytest.raises(ValueError):
        sc.sct_reference(version)


def test_message_keys_have_distinct_nonces() -> None:
    ctx = context_for(WSC_1_3)
    mine = sc.message_keys(ctx)
    nonces = {k.element.findtext(ns.q(WSC_1_3.wsc, "Nonce")) for k in (mine.signing, mine.encryption)}
    assert len(nonces) == 2
    assert mine.signing.id != mine.encryption.id
    assert mine.signing.key != mine.encryption.key
    again = sc.message_keys(ctx)
    assert again.signing.key != mine.signing.key  # fresh nonces per message


# --- the exchange, on every store and both versions


def issue(
    store: contexts.ContextStore,
    version: Version,
    client_key: rsa.RSAPrivateKey,
    client_cert: x509.Certificate,
    *,
    entropy: bytes | None,
    confidential: bool = True,
    now: datetime = NOW,
) -> tuple[ws_trust.IssueAnswer, ws_trust.IssuedContext]:
    rst = ws_trust.parse_rst(reparsed(ws_trust.build_issue_rst(version, entropy=entropy, context="req-1")))
    answer = ws_trust.answer_issue(rst, store, client_cert, SUBJECT, now, entropy_confidential=confidential)
    got = ws_trust.read_rstr(reparsed(answer.response), entropy=entropy, private_key=client_key)
    return answer, got


@pytest.mark.parametrize("version", VERSIONS, ids=VERSION_IDS)
@pytest.mark.parametrize("with_entropy", [True, False], ids=["computed-key", "encrypted-key"])
def test_issue_use_cancel(
    make: StoreFactory,
    version: Version,
    with_entropy: bool,
    client_key: rsa.RSAPrivateKey,
    client_cert: x509.Certificate,
) -> None:
    store = make()
    entropy = os.urandom(32) if with_entropy else None
    answer, got = issue(store, version, client_key, client_cert, entropy=entropy)
    ctx = got.context
    assert ctx.secret == answer.context.secret and len(ctx.secret) == 32
    assert ctx.identifier == answer.context.identifier
    assert (ctx.created, ctx.expires) == (answer.context.created, answer.context.expires)
    assert ctx.expires - ctx.created == timedelta(seconds=LIFETIME)
    assert answer.context.subject == SUBJECT
    assert sc.parse_sct(got.token).identifier == ctx.identifier

    # The gateway finds the context again from the keys the client derives.
    resolve = contexts.store_resolver(store, NOW)
    mine = sc.message_keys(ctx)
    for dk in (mine.signing, mine.encryption):
        found = sc.derive(reparsed(dk.element), resolve)
        assert found.key == dk.key
        assert found.id == dk.id
        assert found.context.subject == SUBJECT
        assert found.context.secret == ctx.secret

    proven = store.lookup(ctx.identifier, version, NOW)
    cancel = ws_trust.parse_rst(reparsed(ws_trust.build_cancel_rst(ctx, context="req-2")))
    assert cancel.request_type == "cancel"
    reply = ws_trust.answer_cancel(cancel, store, proven, NOW)
    assert reply.get("Context") == "req-2"
    assert ws_trust.read_cancel_rstr(reparsed(reply)) is version
    with refused("BadContextToken", version.wsc):
        store.lookup(ctx.identifier, version, NOW)
    with refused("BadContextToken", version.wsc):  # the next message's resolver
        sc.derive(reparsed(mine.signing.element), contexts.store_resolver(store, NOW))


def test_one_lookup_per_context_per_message(client_key: rsa.RSAPrivateKey, client_cert: x509.Certificate) -> None:
    # Both derived keys of a message name the same context: one store lookup (with Redis, one round trip).
    store = context_store.MemoryContextStore(LIFETIME, 10)
    _, got = issue(store, sc.VERSIONS[0], client_key, client_cert, entropy=os.urandom(32))
    lookups: list[str] = []
    lookup = store.lookup
    store.lookup = lambda identifier, version, now: lookups.append(identifier) or lookup(identifier, version, now)  # type: ignore[method-assign]
    resolve = contexts.store_resolver(store, NOW)
    mine = sc.message_keys(got.context)
    for dk in (mine.signing, mine.encryption):
        assert sc.derive(reparsed(dk.element), resolve).key == dk.key
    assert lookups == [got.context.identifier]


@pytest.mark.parametrize("version", VERSIONS, ids=VERSION_IDS)
def test_expired_context_needs_renewal(make: StoreFactory, version: Version) -> None:
    store = make()
    ctx = store.issue(SECRET, SUBJECT, version, NOW)
    assert store.lookup(ctx.identifier, version, NOW + timedelta(seconds=LIFETIME - 1)) == ctx
    later = NOW + timedelta(seconds=LIFETIME)
    with refused("RenewNeeded", version.wsc):
        store.lookup(ctx.identifier, version, later)
    with refused("RenewNeeded", version.wsc):
        store.cancel(ctx.identifier, version, later)


@pytest.mark.parametrize("version", VERSIONS, ids=VERSION_IDS)
def test_unknown_and_cancelled_contexts(make: StoreFactory, version: Version) -> None:
    store = make()
    for unknown in ("urn:uuid:00000000-0000-0000-0000-000000000000", "urn:wsgate:sct:k1:AAAA", "x" * 10_000):
        with refused("BadContextToken", version.wsc):
            store.lookup(unknown, version, NOW)
    ctx = store.issue(SECRET, SUBJECT, version, NOW)
    assert store.cancel(ctx.identifier, version, NOW) == ctx
    for then in (NOW, NOW + timedelta(seconds=LIFETIME - 1)):
        with refused("BadContextToken", version.wsc):
            store.lookup(ctx.identifier, version, then)
    with refused("BadContextToken", version.wsc):
        store.cancel(ctx.identifier, version, NOW)


def test_context_is_only_found_for_its_own_version(make: StoreFactory) -> None:
    store = make()
    ctx = store.issue(SECRET, SUBJECT, WSC_1_3, NOW)
    with refused("BadContextToken", WSC_2005_02.wsc):
        store.lookup(ctx.identifier, WSC_2005_02, NOW)


# --- RST parsing, RSTR shapes


def rst_xml(version: Version, inner: str, attrs: str = "") -> etree._Element:
    return etree.fromstring(
        f'<wst:RequestSecurityToken xmlns:wst="{version.wst}" xmlns:wsc="{version.wsc}" xmlns:wsse="{ns.WSSE}" '
        f'xmlns:wsu="{ns.WSU}"{attrs}>{inner}</wst:RequestSecurityToken>'
    )


def test_wcf_style_issue_rst() -> None:
    v = WSC_2005_02
    entropy = os.urandom(32)
    el = rst_xml(
        v,
        f"<wst:TokenType>{v.sct_token_type}</wst:TokenType><wst:RequestType>{v.issue}</wst:RequestType>"
        f'<wst:Entropy><wst:BinarySecret wsu:Id="uuid-2" Type="{v.nonce_type}">'
        f"{base64.b64encode(entropy).decode()}</wst:BinarySecret></wst:Entropy><wst:KeySize>256</wst:KeySize>",
        ' Context="uuid-1"',
    )
    rst = ws_trust.parse_rst(el)
    assert (rst.version, rst.request_type, rst.context, rst.key_size_bits, rst.entropy) == (
        v,
        "issue",
        "uuid-1",
        256,
        entropy,
    )


def test_minimal_issue_rst() -> None:
    rst = ws_trust.parse_rst(
        rst_xml(WSC_1_3, f"<wst:RequestType>{WSC_1_3.issue}</wst:RequestType><wst:KeySize>128</wst:KeySize>")
    )
    assert (rst.entropy, rst.key_size_bits, rst.context) == (None, 128, None)


def issue_with(version: Version, extra: str) -> str:
    return f"<wst:RequestType>{version.issue}</wst:RequestType>{extra}"


def entropy_xml(version: Version, value: bytes, type_attr: str | None = None) -> str:
    t = f' Type="{type_attr}"' if type_attr else ""
    return f"<wst:Entropy><wst:BinarySecret{t}>{base64.b64encode(value).decode()}</wst:BinarySecret></wst:Entropy>"


V = WSC_1_3


@pytest.mark.parametrize(
    "inner",
    [
        "",  # no RequestType
        "<wst:RequestType>http://example.com/Validate</wst:RequestType>",
        issue_with(V, f"<wst:RequestType>{V.issue}</wst:RequestType>"),
        issue_with(V, "<wst:TokenType>urn:oasis:names:tc:SAML:2.0:assertion</wst:TokenType>"),
        issue_with(V, f"<wst:TokenType>{WSC_2005_02.sct_token_type}</wst:TokenType>"),
        issue_with(V, "<wst:KeySize>100</wst:KeySize>"),
        issue_with(V, "<wst:KeySize>1024</wst:KeySize>"),
        issue_with(V, "<wst:KeySize>130</wst:KeySize>"),
        issue_with(V, "<wst:KeySize>big</wst:KeySize>"),
        issue_with(V, f"<wst:KeyType>{V.wst}/PublicKey</wst:KeyType>"),
        issue_with(V, "<wst:ComputedKeyAlgorithm>http://example.com/ck</wst:ComputedKeyAlgorithm>"),
        issue_with(V, entropy_xml(V, b"short")),
        issue_with(V, entropy_xml(V, os.urandom(32), f"{V.wst}/AsymmetricKey")),
        issue_with(V, entropy_xml(V, os.urandom(32)) * 2),
        issue_with(V, f'<wst:Entropy><xenc:EncryptedKey xmlns:xenc="{ns.XENC}"/></wst:Entropy>'),
        f"<wst:RequestType>{V.cancel}</wst:RequestType>",  # no CancelTarget
        f"<wst:RequestType>{V.cancel}</wst:RequestType><wst:CancelTarget/>",
        f"<wst:RequestType>{V.cancel}</wst:RequestType><wst:CancelTarget><wsse:SecurityTokenReference>"
        '<wsse:Reference URI="urn:uuid:x"/></wsse:SecurityTokenReference></wst:CancelTarget>',
    ],
)
def test_bad_rsts(inner: str) -> None:
    with refused("InvalidRequest", V.wst):
        ws_trust.parse_rst(rst_xml(V, inner))


def test_overlong_context_attribute_refused() -> None:
    with refused("InvalidRequest", V.wst):
        ws_trust.parse_rst(rst_xml(V, issue_with(V, ""), f' Context="{"c" * 2000}"'))


@pytest.mark.parametrize("version", VERSIONS, ids=VERSION_IDS)
def test_renew_is_refused(version: Version) -> None:
    with refused("UnableToRenew", version.wsc):
        ws_trust.parse_rst(rst_xml(version, f"<wst:RequestType>{version.renew}</wst:RequestType>"))


def test_not_an_rst() -> None:
    with pytest.raises(faults.Fault, check=lambda f: f.code == "" and f.sender):
        ws_trust.parse_rst(etree.fromstring('<RequestSecurityToken xmlns="urn:other"/>'))


@pytest.mark.parametrize("version", VERSIONS, ids=VERSION_IDS)
def test_cancel_targets(version: Version) -> None:
    # CXF puts the token itself in CancelTarget; others reference it by Identifier or by '#id'.
    token = etree.tostring(sc.sct_element(version, "urn:uuid:abc", "sct-9")).decode()
    by_token = ws_trust.parse_rst(
        rst_xml(
            version, f"<wst:RequestType>{version.cancel}</wst:RequestType><wst:CancelTarget>{token}</wst:CancelTarget>"
        )
    )
    assert by_token.cancel_target == sc.SctRef(version, identifier="urn:uuid:abc")
    local = etree.tostring(sc.sct_reference(version, local_id="sct-9")).decode()
    by_id = ws_trust.parse_rst(
        rst_xml(
            version, f"<wst:RequestType>{version.cancel}</wst:RequestType><wst:CancelTarget>{local}</wst:CancelTarget>"
        )
    )
    assert by_id.cancel_target == sc.SctRef(version, local_id="sct-9")


def test_cancel_by_local_reference(client_key: rsa.RSAPrivateKey, client_cert: x509.Certificate) -> None:
    store = context_store.MemoryContextStore(LIFETIME, 10)
    _, got = issue(store, V, client_key, client_cert, entropy=None)
    target = etree.tostring(sc.sct_reference(V, local_id="sct-in-header")).decode()
    rst = ws_trust.parse_rst(
        rst_xml(V, f"<wst:RequestType>{V.cancel}</wst:RequestType><wst:CancelTarget>{target}</wst:CancelTarget>")
    )
    with refused("BadContextToken", V.wsc):
        ws_trust.answer_cancel(rst, store, got.context, NOW)  # the header's SCTs were not given
    local = {"sct-in-header": sc.Sct(V, got.context.identifier, "sct-in-header")}
    ws_trust.answer_cancel(rst, store, got.context, NOW, local)
    with refused("BadContextToken", V.wsc):
        store.lookup(got.context.identifier, V, NOW)


def test_cancel_only_the_context_the_message_proved(
    client_key: rsa.RSAPrivateKey, client_cert: x509.Certificate
) -> None:
    store = context_store.MemoryContextStore(LIFETIME, 10)
    _, mine = issue(store, V, client_key, client_cert, entropy=None)
    _, theirs = issue(store, V, client_key, client_cert, entropy=None)
    rst = ws_trust.parse_rst(ws_trust.build_cancel_rst(theirs.context))
    with refused("BadContextToken", V.wsc):
        ws_trust.answer_cancel(rst, store, mine.context, NOW)
    assert store.lookup(theirs.context.identifier, V, NOW).secret == theirs.context.secret


def names(el: etree._Element) -> list[str]:
    return [etree.QName(c).localname for c in el]


@pytest.mark.parametrize("version", VERSIONS, ids=VERSION_IDS)
def test_rstr_shape_with_computed_key(
    version: Version, master_keys: Path, client_key: rsa.RSAPrivateKey, client_cert: x509.Certificate
) -> None:
    entropy = os.urandom(32)
    answer, got = issue(sealed(master_keys), version, client_key, client_cert, entropy=entropy)
    outer = answer.response
    wst = version.wst
    if version is WSC_1_3:  # CXF's shape: a collection of one RSTR
        assert outer.tag == ns.q(wst, "RequestSecurityTokenResponseCollection")
        (rstr,) = outer
    else:
        rstr = outer
    assert rstr.tag == ns.q(wst, "RequestSecurityTokenResponse")
    assert rstr.get("Context") == "req-1"
    assert names(rstr) == [
        "TokenType",
        "RequestedSecurityToken",
        "RequestedAttachedReference",
        "RequestedUnattachedReference",
        "RequestedProofToken",
        "Entropy",
        "Lifetime",
        "KeySize",
    ]
    token = rstr.find(f"{ns.q(wst, 'RequestedSecurityToken')}/{ns.q(version.wsc, 'SecurityContextToken')}")
    assert token is not None
    sct_id = token.get(ns.q(ns.WSU, "Id"))
    attached = rstr.find(f".//{ns.q(wst, 'RequestedAttachedReference')}//{ns.q(ns.WSSE, 'Reference')}")
    unattached = rstr.find(f".//{ns.q(wst, 'RequestedUnattachedReference')}//{ns.q(ns.WSSE, 'Reference')}")
    assert attached is not None and attached.get("URI") == f"#{sct_id}"
    assert unattached is not None and unattached.get("URI") == answer.context.identifier
    assert attached.get("ValueType") == unattached.get("ValueType") == version.sct_token_type
    assert rstr.findtext(f"{ns.q(wst, 'RequestedProofToken')}/{ns.q(wst, 'ComputedKey')}") == version.computed_key_psha1
    server_entropy = b64(rstr.findtext(f"{ns.q(wst, 'Entropy')}/{ns.q(wst, 'BinarySecret')}") or "")
    # Computed key = P_SHA1(requestor entropy, issuer entropy), in that order.
    assert got.context.secret == sc.p_sha1(entropy, server_entropy, 32)
    assert rstr.findtext(ns.q(wst, "KeySize")) == "256"
    assert rstr.findtext(f"{ns.q(wst, 'Lifetime')}/{ns.q(ns.WSU, 'Expires')}", "").endswith("Z")


def test_rstr_without_entropy_carries_the_key_for_an_encrypted_body(
    master_keys: Path, client_key: rsa.RSAPrivateKey, client_cert: x509.Certificate
) -> None:
    """No entropy to compute from: a fresh key as a BinarySecret proof (the form Metro, CXF and WCF all parse),
    and the answer says the reply's Body must be encrypted to the requester (the pipeline does)."""
    answer, got = issue(sealed(master_keys), WSC_2005_02, client_key, client_cert, entropy=None)
    proof = answer.response.find(ns.q(WSC_2005_02.wst, "RequestedProofToken"))
    assert proof is not None and names(proof) == ["BinarySecret"]
    assert proof[0].get("Type") == WSC_2005_02.symmetric_key_type
    assert answer.response.find(ns.q(WSC_2005_02.wst, "Entropy")) is None
    assert answer.key_in_body
    assert base64.b64decode(proof[0].text or "") == got.context.secret


def test_entropy_sent_in_the_clear_is_not_used(
    master_keys: Path, client_key: rsa.RSAPrivateKey, client_cert: x509.Certificate
) -> None:
    entropy = os.urandom(32)
    answer, got = issue(sealed(master_keys), V, client_key, client_cert, entropy=entropy, confidential=False)
    proof = answer.response.find(f".//{ns.q(V.wst, 'RequestedProofToken')}")
    assert proof is not None and names(proof) == ["BinarySecret"] and answer.key_in_body
    assert got.context.secret == answer.context.secret


def test_key_size_is_honoured(master_keys: Path, client_key: rsa.RSAPrivateKey, client_cert: x509.Certificate) -> None:
    store = sealed(master_keys)
    for entropy in (None, os.urandom(16)):
        rst = ws_trust.parse_rst(ws_trust.build_issue_rst(V, entropy=entropy, key_size_bits=128))
        answer = ws_trust.answer_issue(rst, store, client_cert, SUBJECT, NOW, entropy_confidential=True)
        got = ws_trust.read_rstr(reparsed(answer.response), entropy=entropy, private_key=client_key, key_size_bits=999)
        assert len(got.context.secret) == 16 == len(answer.context.secret)
        assert got.context.secret == answer.context.secret


def test_client_refuses_unusable_rstrs(
    master_keys: Path, client_key: rsa.RSAPrivateKey, client_cert: x509.Certificate
) -> None:
    store = sealed(master_keys)
    entropy = os.urandom(32)
    computed = ws_trust.answer_issue(
        ws_trust.parse_rst(ws_trust.build_issue_rst(V, entropy=entropy)),
        store,
        client_cert,
        SUBJECT,
        NOW,
        entropy_confidential=True,
    ).response
    with refused("InvalidSecurityToken"):
        ws_trust.read_rstr(computed, entropy=None, private_key=client_key)
    encrypted = ws_trust.answer_issue(
        ws_trust.parse_rst(ws_trust.build_issue_rst(V, entropy=None)),
        store,
        client_cert,
        SUBJECT,
        NOW,
        entropy_confidential=True,
    ).response
    short = copy.deepcopy(encrypted)
    secret = short.find(f".//{ns.q(V.wst, 'RequestedProofToken')}/{ns.q(V.wst, 'BinarySecret')}")
    assert secret is not None
    secret.text = base64.b64encode(os.urandom(16)).decode()
    with refused("InvalidSecurityToken"):
        ws_trust.read_rstr(short, entropy=None, private_key=None)
    two = copy.deepcopy(encrypted)
    two.append(copy.deepcopy(two[0]))
    with refused("InvalidSecurityToken"):
        ws_trust.read_rstr(two, entropy=None, private_key=client_key)
    no_lifetime = copy.deepcopy(encrypted)
    rstr = no_lifetime[0]
    lifetime = rstr.find(ns.q(V.wst, "Lifetime"))
    assert lifetime is not None
    rstr.remove(lifetime)
    with refused("InvalidSecurityToken"):
        ws_trust.read_rstr(no_lifetime, entropy=None, private_key=client_key)
    with refused("InvalidSecurityToken"):
        ws_trust.read_cancel_rstr(encrypted)


def test_envelopes_for_the_exchange() -> None:
    request = ws_trust.envelope("1.2", ws_trust.build_issue_rst(V, entropy=None), action=V.issue_action)
    parsed = parse_envelope(request.serialize(), Limits())
    assert parsed.version == "1.2"
    rst = ws_trust.find_rst(parsed)
    assert rst is not None and ws_trust.parse_rst(rst).request_type == "issue"
    asked = ws_trust.message_id(parsed)
    assert asked is not None and asked.startswith("urn:uuid:")
    reply = ws_trust.envelope("1.2", etree.Element("x"), action=V.issue_reply_action, relates_to=asked)
    header = reply.header
    assert header is not None
    assert header.findtext(ns.q(ns.WSA, "Action")) == V.issue_reply_action
    assert header.findtext(ns.q(ns.WSA, "RelatesTo")) == asked
    plain = parse_envelope(
        f'<s:Envelope xmlns:s="{ns.SOAP11}"><s:Body><m xmlns="urn:m"/></s:Body></s:Envelope>'.encode(), Limits()
    )
    assert ws_trust.find_rst(plain) is None
    assert ws_trust.message_id(plain) is None


# --- sealed store


def test_sealed_identifier_shape(master_keys: Path) -> None:
    ctx = sealed(master_keys).issue(SECRET, SUBJECT, V, NOW)
    assert ctx.identifier.startswith("urn:wsgate:sct:k1:")
    payload = ctx.identifier.rsplit(":", 1)[1]
    assert set(payload) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
    # Nothing readable travels: neither the subject nor the secret.
    raw = base64.urlsafe_b64decode(payload + "==")
    assert SUBJECT.encode() not in raw and SECRET not in raw
    # Two contexts for the same requester and secret still have unrelated identifiers.
    assert sealed(master_keys).issue(SECRET, SUBJECT, V, NOW).identifier != ctx.identifier


def test_subject_too_long_to_seal(master_keys: Path) -> None:
    with refused("RequestFailed", V.wst):
        sealed(master_keys).issue(SECRET, "CN=" + "x" * 4000, V, NOW)


def test_sealed_context_opens_in_another_instance_with_only_the_keys_file(master_keys: Path, tmp_path: Path) -> None:
    ctx = sealed(master_keys).issue(SECRET, SUBJECT, WSC_2005_02, NOW)
    copied = tmp_path / "copy.yaml"
    copied.write_bytes(master_keys.read_bytes())
    other = sealed(copied)
    assert other.lookup(ctx.identifier, WSC_2005_02, NOW) == ctx
    # A gateway with other master keys cannot open it.
    stranger = sealed(write_master_keys(tmp_path / "other.yaml", "k1"))
    with refused("BadContextToken", WSC_2005_02.wsc):
        stranger.lookup(ctx.identifier, WSC_2005_02, NOW)


def test_master_key_rollover(tmp_path: Path) -> None:
    values: dict[str, bytes] = {}
    before = sealed(write_master_keys(tmp_path / "v1.yaml", "k1", secrets=values))
    during = sealed(write_master_keys(tmp_path / "v2.yaml", "k2", "k1", secrets=values))
    after = sealed(write_master_keys(tmp_path / "v3.yaml", "k2", secrets=values))
    old = before.issue(SECRET, SUBJECT, V, NOW)
    new = during.issue(SECRET, SUBJECT, V, NOW)
    assert ":k1:" in old.identifier and ":k2:" in new.identifier  # the first key seals
    assert during.lookup(old.identifier, V, NOW) == old  # every key opens
    assert during.lookup(new.identifier, V, NOW) == new
    assert after.lookup(new.identifier, V, NOW) == new
    with refused("BadContextToken", V.wsc):
        after.lookup(old.identifier, V, NOW)  # k1 retired
    with refused("BadContextToken", V.wsc):
        before.lookup(new.identifier, V, NOW)  # k2 not rolled out there yet


def flip(text: str, index: int) -> str:
    swap = "B" if text[index] == "A" else "A"
    return text[:index] + swap + text[index + 1 :]


def test_tampered_sealed_identifiers_are_refused(tmp_path: Path) -> None:
    values: dict[str, bytes] = {}
    store = sealed(write_master_keys(tmp_path / "keys.yaml", "k1", "k2", secrets=values))
    ctx = store.issue(SECRET, SUBJECT, V, NOW)
    head, payload = ctx.identifier.rsplit(":", 1)
    tampered = [
        f"{head}:{flip(payload, 0)}",  # the nonce
        f"{head}:{flip(payload, 30)}",  # the ciphertext
        f"{head}:{flip(payload, len(payload) - 3)}",  # the tag
        f"{head}:{payload[:-1]}",
        f"{head}:{payload}AAAA",
        f"{head}:{payload[:20]}",
        ctx.identifier.replace(":k1:", ":k2:"),  # sealed under k1, presented as k2's
        ctx.identifier.replace(":k1:", ":k9:"),
        ctx.identifier.replace("urn:wsgate:sct:", "urn:wsgate:xxx:"),
        f"{head}:{payload[:10]}+/{payload[12:]}",
        f"{head}:{payload}==",
        f"{head}",
        "",
    ]
    for identifier in tampered:
        with refused("BadContextToken", V.wsc):
            store.lookup(identifier, V, NOW)
    assert store.lookup(ctx.identifier, V, NOW) == ctx


def test_other_spelling_of_a_cancelled_identifier_is_refused(master_keys: Path) -> None:
    # base64 leaves unused bits in the last character of some lengths: decoding ignores them, so one payload
    # has several spellings. Only the canonical one opens, so a cancellation cannot be side-stepped.
    store = sealed(master_keys)
    subject = next(s for s in (SUBJECT + "x" * n for n in range(3)) if (79 + len(s)) % 3)
    ctx = store.issue(SECRET, subject, V, NOW)
    head, payload = ctx.identifier.rsplit(":", 1)
    raw = base64.urlsafe_b64decode(payload + "==")
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    variants = [
        payload[:-1] + c
        for c in alphabet
        if c != payload[-1] and base64.urlsafe_b64decode(payload[:-1] + c + "==") == raw
    ]
    assert variants
    for variant in variants:
        with refused("BadContextToken", V.wsc):
            store.lookup(f"{head}:{variant}", V, NOW)
    store.cancel(ctx.identifier, V, NOW)
    for variant in variants:
        with refused("BadContextToken", V.wsc):
            store.lookup(f"{head}:{variant}", V, NOW)


@pytest.mark.slow  # seconds: kept out of make test-fast
def test_sealed_store_keeps_no_state_per_context(master_keys: Path) -> None:
    store = sealed(master_keys)
    tracemalloc.start()
    try:
        store.issue(SECRET, SUBJECT, V, NOW)  # warm up caches
        start, _ = tracemalloc.get_traced_memory()
        for i in range(100_000):
            ctx = store.issue(SECRET, SUBJECT, V, NOW)
            if i % 10_000 == 0:
                assert len(store) == 0
        grown = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert len(store) == 0
    assert grown < 100_000  # bytes: far below one byte per context issued
    assert store.lookup(ctx.identifier, V, NOW) == ctx


def test_sealed_cancellations_are_bounded(master_keys: Path) -> None:
    store = sealed(master_keys, lifetime_s=60, max_revocations=2)
    first = [store.issue(SECRET, SUBJECT, V, NOW) for _ in range(3)]
    store.cancel(first[0].identifier, V, NOW)
    store.cancel(first[1].identifier, V, NOW)
    assert len(store) == 2
    with pytest.raises(
        faults.Fault, check=lambda f: f.code == "RequestFailed" and f.http_status == 500 and not f.sender
    ):
        store.cancel(first[2].identifier, V, NOW)
    assert store.lookup(first[2].identifier, V, NOW) == first[2]  # a refused cancel changes nothing
    # The cancellations leave once the contexts they name have expired anyway.
    later = NOW + timedelta(seconds=61)
    fresh = store.issue(SECRET, SUBJECT, V, later)
    store.cancel(fresh.identifier, V, later)
    assert len(store) == 1


def test_sealed_cancellation_is_per_process_without_redis(master_keys: Path) -> None:
    # Why a route with several replicas gives the sealed store a Redis URL (see the next test).
    one, two = sealed(master_keys), sealed(master_keys)
    ctx = one.issue(SECRET, SUBJECT, V, NOW)
    one.cancel(ctx.identifier, V, NOW)
    assert two.lookup(ctx.identifier, V, NOW) == ctx


def test_sealed_cancellation_shared_through_redis(master_keys: Path, redis_url: str) -> None:
    revocations = [context_store.RedisRevocations(redis_url), context_store.RedisRevocations(redis_url)]
    one, two = (
        context_store.SealedContextStore(context_store.load_master_keys(master_keys), LIFETIME, r) for r in revocations
    )
    try:
        ctx = one.issue(SECRET, SUBJECT, V, NOW)
        assert two.lookup(ctx.identifier, V, NOW) == ctx
        two.cancel(ctx.identifier, V, NOW)
        with refused("BadContextToken", V.wsc):
            one.lookup(ctx.identifier, V, NOW)
        client = redis.Redis.from_url(redis_url)
        (name,) = client.keys("wsgate:sct-cancelled:*")
        assert 0 < client.pttl(name) <= LIFETIME * 1000  # remembered until the context would have expired
        client.close()
        assert len(one) == len(two) == 0
    finally:
        for r in revocations:
            r.close()


def test_sealed_context_refused_after_redis_forgot_cancellations(master_keys: Path, redis_url: str) -> None:
    """RedisRevocations reads the epoch and the cancellation (kept until Redis pushes a change): a Redis found
    without its epoch (restarted empty: every cancellation forgotten) gets one, and no context issued before it
    opens again, cancelled or not."""
    revocations = context_store.RedisRevocations(redis_url)
    store = context_store.SealedContextStore(context_store.load_master_keys(master_keys), LIFETIME, revocations)
    client = redis.Redis.from_url(redis_url)
    try:
        before = store.issue(SECRET, SUBJECT, V, NOW)
        assert store.lookup(before.identifier, V, NOW) == before  # opened, and kept opened (the store's cache)
        client.flushdb()
        deadline = time.monotonic() + 0.3  # the flush's push may reach the store a moment after the reply
        while time.monotonic() < deadline:
            try:
                store.lookup(before.identifier, V, NOW)
            except faults.Fault:
                break
            time.sleep(0.01)
        with refused("BadContextToken", V.wsc):
            store.lookup(before.identifier, V, NOW)
        epoch = int(client.get(replay.EPOCH_KEY) or 0)
        assert epoch >= int(NOW.timestamp() * 1000)
        later = NOW + timedelta(seconds=60) + (datetime.now(UTC) - NOW)
        after = store.issue(SECRET, SUBJECT, V, later)
        assert store.lookup(after.identifier, V, later) == after
        assert int(client.get(replay.EPOCH_KEY) or 0) == epoch  # read, not started again
        store.cancel(after.identifier, V, later)
        with refused("BadContextToken", V.wsc):
            store.lookup(after.identifier, V, later)  # the cancellation's empty value counts
    finally:
        client.close()
        revocations.close()


# --- memory store


def test_memory_store_full_of_live_contexts_refuses() -> None:
    store = context_store.MemoryContextStore(lifetime_s=60, max_contexts=3)
    live = [store.issue(SECRET, SUBJECT, V, NOW) for _ in range(3)]
    with pytest.raises(faults.Fault) as info:
        store.issue(SECRET, SUBJECT, V, NOW)
    fault = info.value
    assert (fault.code, fault.code_ns, fault.http_status, fault.sender) == ("RequestFailed", V.wst, 500, False)
    assert "retry later" in fault.message and "full" in fault.reason
    assert len(store) == 3
    assert all(store.lookup(c.identifier, V, NOW) == c for c in live)  # nobody was evicted


def test_memory_store_makes_room_from_expired_contexts() -> None:
    store = context_store.MemoryContextStore(lifetime_s=60, max_contexts=3)
    early = store.issue(SECRET, SUBJECT, V, NOW)
    later = [store.issue(SECRET, SUBJECT, V, NOW + timedelta(seconds=30)) for _ in range(2)]
    then = NOW + timedelta(seconds=61)
    with refused("RenewNeeded", V.wsc):
        store.lookup(early.identifier, V, then)  # expired, still known
    newest = store.issue(SECRET, SUBJECT, V, then)  # full: the expired one makes room
    assert len(store) == 3
    with refused("BadContextToken", V.wsc):
        store.lookup(early.identifier, V, then)
    assert [store.lookup(c.identifier, V, then) for c in [*later, newest]] == [*later, newest]


def test_memory_store_forgets_long_expired_contexts() -> None:
    store = context_store.MemoryContextStore(lifetime_s=60, max_contexts=100)
    for _ in range(10):
        store.issue(SECRET, SUBJECT, V, NOW)
    store.issue(SECRET, SUBJECT, V, NOW + timedelta(seconds=60 + sc.EXPIRED_GRACE_S))
    assert len(store) == 1


def test_memory_store_stays_bounded() -> None:
    store = context_store.MemoryContextStore(lifetime_s=60, max_contexts=1000)
    now = NOW
    for i in range(20_000):
        now += timedelta(milliseconds=10)  # 6,000 contexts per lifetime: more than fit
        try:
            ctx = store.issue(SECRET, SUBJECT, V, now)
        except faults.Fault:
            continue
        if i % 3 == 0:
            store.cancel(ctx.identifier, V, now)
        assert len(store) <= 1000
        assert len(store._expiry) <= 2 * 1000 + 1


# --- redis store


def test_redis_record_and_expiry(redis_url: str) -> None:
    store = context_store.RedisContextStore(redis_url, lifetime_s=LIFETIME, prefix="t:")
    client = redis.Redis.from_url(redis_url)
    try:
        ctx = store.issue(SECRET, SUBJECT, V, NOW)
        record, marker = sorted(k for k in client.keys("t:*") if isinstance(k, bytes))
        assert record.startswith(b"t:ctx:") and marker.startswith(b"t:expired:")
        assert LIFETIME * 1000 - 5000 < client.pttl(record) <= LIFETIME * 1000  # EXPIRE = lifetime
        assert client.pttl(marker) > LIFETIME * 1000
        assert client.get(marker) == b""  # the marker holds no secret
        assert ctx.identifier.encode() not in record
        store.cancel(ctx.identifier, V, NOW)
        assert client.keys("t:*") == []
    finally:
        client.close()
        store.close()


def test_redis_forgets_the_secret_when_the_context_expires(redis_url: str) -> None:
    store = context_store.RedisContextStore(redis_url, lifetime_s=1)
    client = redis.Redis.from_url(redis_url)
    try:
        ctx = store.issue(SECRET, SUBJECT, V, datetime.now(UTC))
        time.sleep(1.1)
        assert client.keys("wsgate:sct:ctx:*") == []
        with refused("RenewNeeded", V.wsc):
            store.lookup(ctx.identifier, V, datetime.now(UTC))
    finally:
        client.close()
        store.close()


def test_two_redis_stores_share_contexts(redis_url: str) -> None:
    one, two = (
        context_store.RedisContextStore(redis_url, LIFETIME),
        context_store.RedisContextStore(redis_url, LIFETIME),
    )
    try:
        mine = one.issue(SECRET, SUBJECT, WSC_2005_02, NOW)
        theirs = two.issue(os.urandom(32), "CN=Other", V, NOW)
        assert two.lookup(mine.identifier, WSC_2005_02, NOW) == mine
        assert one.lookup(theirs.identifier, V, NOW) == theirs
        one.cancel(theirs.identifier, V, NOW)
        with refused("BadContextToken", V.wsc):
            two.lookup(theirs.identifier, V, NOW)
    finally:
        one.close()
        two.close()


def test_redis_unavailable_is_a_server_fault() -> None:
    store = context_store.RedisContextStore(f"redis://127.0.0.1:{free_ports(1)[0]}/0", LIFETIME, timeout_s=0.5)
    try:
        for attempt in (lambda: store.issue(SECRET, SUBJECT, V, NOW), lambda: store.lookup("urn:uuid:x", V, NOW)):
            with pytest.raises(faults.Fault, check=lambda f: not f.sender and "unavailable" in f.reason):
                attempt()
    finally:
        store.close()


# --- the factory and the master keys file


def test_make_store_kinds(master_keys: Path, redis_url: str) -> None:
    def options(**kw: object) -> SecureConversationOptions:
        return SecureConversationOptions.model_validate({"master_keys_file": str(master_keys), **kw})

    memory = context_store.make_store(options(store="memory", max_contexts=7))
    assert isinstance(memory, context_store.MemoryContextStore) and memory.max_contexts == 7
    default = context_store.make_store(options())
    assert isinstance(default, context_store.SealedContextStore) and isinstance(
        default.revocations, context_store.MemoryRevocations
    )
    shared = context_store.make_store(options(), redis_url)
    assert isinstance(shared, context_store.SealedContextStore) and isinstance(
        shared.revocations, context_store.RedisRevocations
    )
    shared.revocations.close()
    # The URL given (e.g. WSGATE_REDIS_URL) serves a policy that names none ...
    given = context_store.make_store(options(store="redis", lifetime_s=5), redis_url)
    assert isinstance(given, context_store.RedisContextStore) and given.lifetime_s == 5
    given.issue(SECRET, SUBJECT, V, NOW)
    given.close()
    # ... but a policy's own redis_url wins.
    dead = f"redis://127.0.0.1:{free_ports(1)[0]}/0"
    own = context_store.make_store(options(store="redis", redis_url=dead), redis_url)
    assert isinstance(own, context_store.RedisContextStore)
    with pytest.raises(faults.Fault, check=lambda f: not f.sender):
        own.issue(SECRET, SUBJECT, V, NOW)
    own.close()


@pytest.mark.parametrize(
    "doc",
    [
        {},
        {"keys": []},
        {"keys": {"k1": base64.b64encode(os.urandom(32)).decode()}},
        {"keys": [{"id": "k:1", "key": base64.b64encode(os.urandom(32)).decode()}]},
        {"keys": [{"id": "k1", "key": base64.b64encode(os.urandom(16)).decode()}]},
        {"keys": [{"id": "k1", "key": "not base64!"}]},
        {"keys": [{"id": "k1"}]},
        {"keys": [{"id": "k1", "key": base64.b64encode(os.urandom(32)).decode()}] * 2},
    ],
)
def test_bad_master_keys_files(tmp_path: Path, doc: object) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ValueError):
        context_store.load_master_keys(path)


def test_demo_pki_master_keys_load(pki: Path) -> None:
    (key,) = context_store.load_master_keys(pki / "sct-master-keys.yaml")
    assert key.id == "k1" and len(key.key) == 32
    assert "key=" not in repr(key)


def test_pipeline_looks_a_context_up_once_per_message(pki: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A message in a context carries two derived keys (signature, encryption) naming it: one lookup, which with
    # Redis is one round trip for the cancellation check.
    from filters.engine.engine import Exchange
    from filters.engine.profiles import SecureConversationPipeline
    from gateway.policy import Route
    from gateway.tools.client import Client, ClientConfig
    from tests.support.wss_helpers import echo, echo_response, route_doc

    monkeypatch.delenv("WSGATE_REDIS_URL", raising=False)
    doc = route_doc(pki, "secureconversation", name="sc",
                    secureconversation={"store": "sealed", "master_keys_file": str(pki / "sct-master-keys.yaml")},
                    encryption={"require_request": True, "encrypt_response": True})  # fmt: skip
    doc["upstream"] = {"address": "127.0.0.1:1"}
    route = Route.model_validate(doc)
    pl = SecureConversationPipeline(route, RouteStores())
    client = Client(route, ClientConfig(certs=pki))
    client.establish(lambda body, ctype: pl.request(body, {"x-forwarded-proto": "https"}, Exchange(route=route)).body)
    lookups: list[str] = []
    lookup = pl.store.lookup
    monkeypatch.setattr(pl.store, "lookup", lambda i, v, now: lookups.append(i) or lookup(i, v, now))
    secured, pending = client.secure(echo("once"))
    assert secured.count(b"DerivedKeyToken ") >= 2
    ex = Exchange(route=route)
    forwarded = pl.request(secured, {}, ex).body
    assert forwarded is not None and b"once" in forwarded
    assert lookups == [client.context.identifier]
    reply = pl.response(echo_response(forwarded), ex).body
    assert reply is not None
    assert client.open(reply, pending).body.findtext(".//{urn:wsgate:demo}text") == "once"


def test_issue_sent_unencrypted_gets_its_key_only_in_an_encrypted_body(pki: Path) -> None:
    """An Issue whose Body came in the clear (its entropy readable by anyone on the way): the key is fresh, not
    computed from that entropy, and travels as a BinarySecret proof (the form Metro parses) in a reply Body
    encrypted to the requester's certificate, whatever encrypt_response says."""
    from datetime import UTC, datetime

    from filters.engine.engine import Exchange
    from filters.engine.profiles import SecureConversationPipeline
    from gateway.policy import Route
    from gateway.tools.client import Client, ClientConfig
    from tests.support.wss_helpers import route_doc

    doc = route_doc(pki, "secureconversation", name="sc",
                    secureconversation={"store": "sealed", "master_keys_file": str(pki / "sct-master-keys.yaml")})  # fmt: skip
    doc["upstream"] = {"address": "127.0.0.1:1"}
    route = Route.model_validate(doc)
    assert not route.encryption.encrypt_response
    pl = SecureConversationPipeline(route, RouteStores())
    client = Client(route, ClientConfig(certs=pki, encrypt=False))
    entropy = os.urandom(32)
    env = ws_trust.envelope("1.1", ws_trust.build_issue_rst(V, entropy=entropy), action=V.issue_action)
    secured, pending = client._secure(env, datetime.now(UTC))
    assert b"EncryptedData" not in secured and base64.b64encode(entropy) in secured
    reply = pl.request(secured, {}, Exchange(route=route)).body
    assert reply is not None and b"EncryptedData" in reply and b"BinarySecret" not in reply
    rstr = client.open(reply, pending).body[0]
    proof = rstr.find(f".//{ns.q(V.wst, 'RequestedProofToken')}")
    assert proof is not None and names(proof) == ["BinarySecret"]
    issued = ws_trust.read_rstr(rstr, entropy=entropy, private_key=client.private_key)
    assert issued.context.secret == base64.b64decode(proof[0].text or "")
