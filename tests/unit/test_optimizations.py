"""The papers' optimizations (gateway.policy.Optimizations) never change what is accepted.

- direct C14N computes the digests xmlsec computes, byte for byte, on awkward namespace layouts too; signatures
  made that way verify with xmlsec alone, and a direct path that cannot confirm a valid signature leaves the
  decision to xmlsec (counted as a divergence) instead of refusing;
- after messages were accepted and the shortcuts were warm (the same Body cached, received in canonical form,
  so on-demand re-canonicalization and the digest cache both hit), a message that differs in a signed element,
  its DigestValue or SignatureValue, its key, its freshness or its id attribute is refused with the same fault
  as with every optimization off;
- prehashed responses verify with xmlsec alone, and a body that changed in one character, or only in the
  namespaces around it, never gets a stale digest.

Real keys from the session PKI, the gateway's pipelines without Envoy, the client (plain xmlsec) as the
independent verifier."""

from __future__ import annotations

import base64
import hashlib
import hmac
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from lxml import etree
from pydantic import ValidationError

from filters.engine import faults, metrics, ns
from filters.engine.engine import Exchange
from filters.engine.profiles import SecureConversationPipeline, SecuredPipeline
from filters.engine.wss import keys, signature, signing, wssecurity
from filters.engine.wss import wssecurity_sending as sending
from filters.engine.wss.digest_cache import DigestCache
from filters.engine.wss.optimizations import Optimizations
from filters.engine.xml import c14n
from filters.engine.xml.soap import Envelope
from filters.engine.xml.threat_protection import parse_envelope
from filters.stores.factory import RouteStores
from gateway.policy import Limits, Route, SignaturePolicy
from gateway.tools.client import Client, ClientConfig
from loadtest.optimizations import canonical_sender
from tests.support.wss_helpers import DEMO, client_for, echo, echo_response, make_route, round_trip, route_doc

SOAP11 = ns.SOAP11
WSU_ID = ns.q(ns.WSU, "Id")
DS = ns.DS
WSA = "http://www.w3.org/2005/08/addressing"
XSI = "http://www.w3.org/2001/XMLSchema-instance"
ALL_ON = {"direct_c14n": True, "on_demand_c14n": True, "digest_cache": True, "prehash": True}
CONFIGS: dict[str, dict[str, bool]] = {
    "xmlsec": {"direct_c14n": False},
    "direct_c14n": {},
    "on_demand_c14n": {"on_demand_c14n": True},
    "digest_cache": {"digest_cache": True},
    "all": ALL_ON,
}


def repeated(text: str = "pay 10") -> bytes:
    """A request whose Body (content and wsu:Id) is the same every time: what a digest cache can hit."""
    return (
        f'<soap:Envelope xmlns:soap="{SOAP11}"><soap:Body xmlns:wsu="{ns.WSU}" wsu:Id="body-1">'
        f'<d:echo xmlns:d="{DEMO}"><d:text>{text}</d:text></d:echo></soap:Body></soap:Envelope>'
    ).encode()


def pipeline(pki: Path, profile: str, config: str, **extra: Any) -> SecuredPipeline:
    return SecuredPipeline(make_route(pki, profile, optimizations=CONFIGS[config], **extra), RouteStores())


def accept(pl: SecuredPipeline, data: bytes) -> bytes:
    ex = Exchange(route=pl.route)
    out = pl.request(data, {}, ex).body
    assert out is not None and ex.security is not None
    return out


def refuse(pl: SecuredPipeline, data: bytes, code: str) -> faults.Fault:
    """Refused with `code` ("" = threat protection's plain Client fault), nothing left for the backend."""
    ex = Exchange(route=pl.route)
    with pytest.raises(faults.Fault) as info:
        pl.request(data, {}, ex)
    assert ex.security is None
    assert info.value.code == code, info.value.reason
    return info.value


def mutate(data: bytes, change: Callable[[etree._Element], None]) -> bytes:
    root = etree.fromstring(data)
    change(root)
    return etree.tostring(root)


def find(root: etree._Element, path: str) -> etree._Element:
    el = root.find(path)
    assert el is not None, path
    return el


def body_reference(root: etree._Element) -> etree._Element:
    return find(root, f".//{{{DS}}}Reference[@URI='#body-1']")


def psk(pki: Path) -> bytes:
    return keys.load_hmac_keys(pki / "hmac-keys.yaml")["demo-client"]


# =========================================================================================================
# Direct C14N: xmlsec's digests, xmlsec's signatures


def awkward(fresh: str, default_namespace: bool = False) -> Envelope:
    """A request built through the API (so its namespace prefixes were never parsed: lxml's C14N once dropped
    such InclusiveNamespaces prefixes), with a prefix declared above the Body and used only in QName content,
    a default namespace in the content and none below it, attribute values and text that C14N escapes,
    non-ASCII, a CDATA section and a comment (C14N without comments drops it). `default_namespace`: one
    declared on the Envelope too, so the PrefixLists name "#default"."""
    nsmap: dict[str | None, str] = {"soap": SOAP11, fresh: "urn:wsgate:fresh", "xsi": XSI}
    if default_namespace:
        nsmap[None] = "urn:wsgate:outer"
    root = etree.Element(ns.q(SOAP11, "Envelope"), nsmap=nsmap)
    header = etree.SubElement(root, ns.q(SOAP11, "Header"))
    etree.SubElement(header, ns.q(WSA, "To"), nsmap={"wsa": WSA}).text = "urn:wsgate:to"
    body = etree.SubElement(root, ns.q(SOAP11, "Body"))
    body.append(etree.fromstring(
        f'<echo xmlns="{DEMO}" xmlns:xsi="{XSI}" note="a&#9;b&#10;c &quot;q&quot; &amp; &lt;" xsi:type="{fresh}:t">'
        "<text>caf\u00e9 &#13; ]]&gt; <![CDATA[<raw> & stuff]]></text><!-- a comment -->"
        '<plain xmlns=""><inner b="1" a="2"/></plain><text>  spaced  </text></echo>'
    ))  # fmt: skip
    return Envelope(root, "1.1")


def fresh_prefix() -> str:
    return "p" + uuid.uuid4().hex[:10]  # a prefix no parser in this process has seen


def sign_awkward(
    pki: Path,
    optimizations: Optimizations | None,
    algorithm: str = "hmac-sha256",
    default_namespace: bool = False,
    prefix: str | None = None,
) -> Envelope:
    env = awkward(prefix or fresh_prefix(), default_namespace)
    sending.secure(env, datetime(2030, 1, 1, tzinfo=UTC), timestamp_ttl_s=300, sign=None)
    security = wssecurity.find_security(env)
    assert security is not None and env.header is not None
    parts = [env.body, security[0], env.header[1]]  # Body, Timestamp, wsa:To
    key: Any = psk(pki) if algorithm.startswith("hmac") else keys.load_private_key(pki / "client.key")
    signer = signing.Signer(key, algorithm, "sha256")
    signer.sign(env, security, parts, keys.key_name("demo-client"), optimizations=optimizations)
    return env


def references(env: Envelope) -> list[tuple[etree._Element, list[str], bytes]]:
    index = signature.id_index(env.root)
    out = []
    for ref in env.root.iter(f"{{{DS}}}Reference"):
        inclusive = ref.find(f".//{ns.q(ns.EXC_C14N, 'InclusiveNamespaces')}")
        prefixes = (inclusive.get("PrefixList") or "").split() if inclusive is not None else []
        value = base64.b64decode(find(ref, f"{{{DS}}}DigestValue").text or "")
        out.append((index[(ref.get("URI") or "#")[1:]], prefixes, value))
    return out


def test_direct_digests_are_xmlsec_digests(pki: Path) -> None:
    env = sign_awkward(pki, None)  # xmlsec computes every DigestValue
    refs = references(env)
    assert len(refs) == 3 and all(prefixes for _, prefixes, _ in refs)  # every reference has a PrefixList
    for el, prefixes, value in refs:
        assert c14n.digest(el, prefixes, "sha256") == value
    reparsed = parse_envelope(env.serialize(), Limits())
    for el, prefixes, value in references(reparsed):
        assert c14n.digest(el, prefixes, "sha256") == value


def _reference_c14n(el: etree._Element, prefixes: list[str]) -> bytes:
    """The element's PrefixList C14N by libxml2 on a fresh parse of it (the parse interns every prefix it declares,
    so lxml hands the whole list on): what xmlsec computes."""
    alone = etree.fromstring(etree.tostring(el))
    return etree.tostring(alone, method="c14n", exclusive=True, with_comments=False, inclusive_ns_prefixes=prefixes)


def _api_built(fresh: str, apex: str, child: str = "<c/>") -> etree._Element:
    """`apex` under an element that declares `fresh` through lxml's API, a prefix no parser has interned."""
    outer = etree.Element("{urn:wsgate:outer}o", nsmap={fresh: "urn:wsgate:fresh", "o": "urn:wsgate:outer"})
    outer.append(etree.fromstring(apex.replace("CHILD", child)))
    return outer[0]


def test_a_listed_prefix_lxml_drops_is_never_left_out_of_the_canonical_form() -> None:
    """lxml hands libxml2 only PrefixList prefixes its dictionary holds: one declared through the API and never
    parsed is dropped without a word. The in-place C14N (c14n._in_place) must see that in its output and give up,
    and the canonical form must still declare the prefix, as xmlsec's does."""
    fresh = fresh_prefix()
    el = _api_built(fresh, '<a xmlns="urn:wsgate:a" x="1">CHILD</a>')
    raw = etree.tostring(el, method="c14n", exclusive=True, with_comments=False, inclusive_ns_prefixes=[fresh])
    assert f"xmlns:{fresh}=".encode() not in raw  # lxml dropped it: the case the proof is for
    assert c14n._in_place(el, [fresh]) is None
    expected = _reference_c14n(el, [fresh])
    assert f'<a xmlns="urn:wsgate:a" xmlns:{fresh}="urn:wsgate:fresh"'.encode() in expected
    assert c14n.canonical(el, [fresh]) == expected


@pytest.mark.parametrize(
    ("apex", "prefixes", "in_place"),
    [
        ('<p:a xmlns:p="urn:p" xmlns:q="urn:q" q:x="1">CHILD</p:a>', ["q", "o"], False),  # the apex uses q itself
        ('<p:a xmlns:p="urn:p">CHILD</p:a>', ["p"], False),  # ... its own prefix
        ('<a><b xmlns:z="urn:z"/></a>', ["z"], False),  # z declared below the apex only
        ('<a xmlns:r="urn:r" xmlns:s="urn:s" xmlns:t="urn:t">CHILD</a>', ["r", "s", "t"], False),  # a long list
        ('<a xmlns:h="urn:h" xmlns:q="urn:q">CHILD</a>', ["h", "q", "xml"], True),  # both rebound below, unused
    ],
)
def test_in_place_c14n_gives_up_where_its_output_proves_nothing(apex: str, prefixes: list[str], in_place: bool) -> None:
    """Where a listed prefix is used by the apex, declared only below it, or the list is long, the apex's
    declarations cannot show whether lxml passed the list on: the marker or parse way decides. The canonical form
    is xmlsec's either way, listed prefixes rebound below the apex (and not used there) included."""
    el = _api_built("o", apex, child='<c xmlns:h="urn:other" xmlns:q="urn:q2"><d/></c>')
    assert (c14n._in_place(el, prefixes) is not None) == in_place
    assert c14n.canonical(el, prefixes) == _reference_c14n(el, prefixes)


def test_in_place_c14n_of_a_parsed_timestamp_and_signed_info_is_the_marker_ways() -> None:
    """The hot path: a parsed request's Timestamp ("soap wsse") and SignedInfo ("soap") take libxml2's PrefixList
    C14N in place, byte for byte what the marker way and a fresh parse give."""
    env = parse_envelope(etree.tostring(sign_awkward_env()), Limits())
    security = wssecurity.find_security(env)
    assert security is not None
    ts, info = security[0], security.find(f"{{{DS}}}Signature/{{{DS}}}SignedInfo")
    assert info is not None
    for el, prefixes in ((ts, ["soap", "wsse"]), (info, ["soap"])):
        got = c14n._in_place(el, prefixes)
        assert got is not None and got == c14n._marked(el, c14n.received_form(el), prefixes)
        assert got == _reference_c14n(el, prefixes)


def sign_awkward_env() -> etree._Element:
    """A request with a Timestamp and a signature, as our client lays them out (no key needed: HMAC)."""
    env = awkward(fresh_prefix())
    sending.secure(env, datetime(2030, 1, 1, tzinfo=UTC), timestamp_ttl_s=300, sign=None)
    security = wssecurity.find_security(env)
    assert security is not None
    signing.Signer(b"k" * 32, "hmac-sha256", "sha256").sign(env, security, [env.body, security[0]],
                                                               keys.key_name("demo-client"))  # fmt: skip
    return env.root


@pytest.mark.parametrize("algorithm", ["hmac-sha256", "rsa-sha256"])
@pytest.mark.parametrize("default_namespace", [False, True])
def test_direct_signatures_are_xmlsec_signatures(pki: Path, algorithm: str, default_namespace: bool) -> None:
    """Both signature methods are deterministic: signed directly or by xmlsec, the same bytes; and the direct
    one verifies with xmlsec alone. (A PrefixList naming "#default" is signed by xmlsec either way.)"""
    prefix = fresh_prefix()
    direct = sign_awkward(pki, Optimizations(), algorithm, default_namespace, prefix)
    by_xmlsec = sign_awkward(pki, None, algorithm, default_namespace, prefix)
    sig_x = find(by_xmlsec.root, f".//{{{DS}}}Signature")
    sig_d = find(direct.root, f".//{{{DS}}}Signature")
    assert "#default" in etree.tostring(sig_x).decode() or not default_namespace
    digests = [[d.text for d in s.iter(f"{{{DS}}}DigestValue")] for s in (sig_x, sig_d)]
    assert digests[0] == digests[1]
    values = [base64.b64decode(s.findtext(f"{{{DS}}}SignatureValue") or "") for s in (sig_x, sig_d)]
    assert values[0] == values[1]
    key: Any = psk(pki) if algorithm.startswith("hmac") else keys.load_certificate(pki / "client.pem")
    policy = SignaturePolicy(algorithms=[algorithm])  # type: ignore[list-item]
    verified = signature.verify(sig_d, direct, key, policy)  # xmlsec's full verification
    assert len(verified.elements) == 3


@pytest.mark.parametrize(
    "quirk", ["ds prefix bound elsewhere and listed", "ec prefix in scope", "Body id C14N escapes", "prefix of 'xml'"]
)
@pytest.mark.parametrize("algorithm", ["hmac-sha256", "rsa-sha256"])
def test_signed_info_written_directly_is_the_one_xmlsec_signs(pki: Path, algorithm: str, quirk: str) -> None:
    """The Signer writes its canonical SignedInfo as text and parses the signature from it: the bytes it signs
    must be what xmlsec canonicalizes in the message, whatever the envelope declares above the signature."""

    def signed(optimizations: Optimizations | None, prefix: str) -> etree._Element:
        env = awkward(prefix)
        if quirk == "ds prefix bound elsewhere and listed":
            env.root.set(ns.q("urn:wsgate:not-dsig", "x"), "1")
            env = Envelope(etree.fromstring(env.serialize().replace(b"ns0:", b"ds:").replace(b"xmlns:ns0", b"xmlns:ds")),
                           "1.1")  # fmt: skip
        elif quirk == "ec prefix in scope":
            env.root.set(ns.q(ns.EXC_C14N, "x"), "1")
        elif quirk == "Body id C14N escapes":
            env.body.set(ns.q(ns.WSU, "Id"), 'b&"<\tody')
        elif quirk == "prefix of 'xml'":
            env.body.set("{http://www.w3.org/XML/1998/namespace}lang", "en")
        sending.secure(env, datetime(2030, 1, 1, tzinfo=UTC), timestamp_ttl_s=300, sign=None)
        security = wssecurity.find_security(env)
        assert security is not None
        key: Any = psk(pki) if algorithm.startswith("hmac") else keys.load_private_key(pki / "client.key")
        signing.Signer(key, algorithm, "sha256").sign(
            env, security, [env.body, security[0]], keys.key_name("demo-client"), optimizations=optimizations
        )
        return find(parse_envelope(env.serialize(), Limits()).root, f".//{{{DS}}}Signature")

    prefix = fresh_prefix()
    direct = signed(Optimizations(), prefix)
    value = base64.b64decode(direct.findtext(f"{{{DS}}}SignatureValue") or "")
    info = direct[0]
    listed = (info.find(f".//{ns.q(ns.EXC_C14N, 'InclusiveNamespaces')}").get("PrefixList") or "").split()
    key: Any = psk(pki) if algorithm.startswith("hmac") else keys.load_certificate(pki / "client.pem")
    assert signature._signature_matches(c14n.canonical(info, listed), key, algorithm, value)  # libxml2's C14N
    if quirk != "Body id C14N escapes":  # xmlsec takes no such reference URI
        by_xmlsec = signed(None, prefix)
        assert value == base64.b64decode(by_xmlsec.findtext(f"{{{DS}}}SignatureValue") or "")
    if quirk == "ds prefix bound elsewhere and listed":
        assert "ds" in listed


@pytest.mark.parametrize("default_namespace", [False, True])
def test_awkward_layout_verified(pki: Path, default_namespace: bool) -> None:
    """Verified directly; a PrefixList naming "#default" is left to xmlsec (neither verified nor a fallback)."""
    opts = Optimizations()
    env = parse_envelope(sign_awkward(pki, None, default_namespace=default_namespace).serialize(), Limits())
    sig = find(env.root, f".//{{{DS}}}Signature")
    signature.verify(sig, env, psk(pki), SignaturePolicy(), opts)
    assert (opts.counts.verified, opts.counts.fallback) == ((0, 0) if default_namespace else (1, 0))


def test_valid_signature_the_direct_path_misses_is_left_to_xmlsec(pki: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Should direct C14N ever differ from xmlsec's, a valid message is still accepted (xmlsec decides), and
    the divergence is counted."""
    pl = pipeline(pki, "hmac", "all")
    client = client_for(pl.route, pki, key_name="demo-client")
    monkeypatch.setattr(c14n, "canonical", lambda el, prefixes: b"<not-it/>")
    accept(pl, client.secure(echo())[0])
    assert pl.optimizations is not None
    assert (pl.optimizations.counts.verified, pl.optimizations.counts.diverged) == (0, 1)


CLIENTS = {
    "rsa": ({}, {}),
    "rsa-encrypted": ({"encryption": {"require_request": True, "encrypt_response": True}}, {}),
    "hmac-psk": ({}, {"key_name": "demo-client"}),
    "hmac-symmetric-binding": ({"encryption": {"require_request": True, "encrypt_response": True}}, {}),
    "username": ({"username_token": {"required": True, "users_file": "USERS", "protection": "encrypted"},
                  "signature": {"parts": ["body", "timestamp", "username_token"]}},
                 {"user": "bob", "password": "bob-demo-password"}),
}  # fmt: skip


@pytest.mark.parametrize("case", CLIENTS)
def test_every_profile_is_verified_and_signed_directly(pki: Path, case: str) -> None:
    """The gateway's own traffic takes the direct path both ways: nothing falls back to xmlsec, and the client
    (xmlsec only) opens every reply."""
    extra, cfg = CLIENTS[case]
    if "username_token" in extra:
        extra = {**extra, "username_token": {**extra["username_token"], "users_file": str(pki / "users.yaml")}}
    profile = "rsa" if case.startswith("rsa") else "hmac"
    route = make_route(pki, profile, optimizations=ALL_ON, **extra)
    pl = SecuredPipeline(route, RouteStores())
    client = client_for(route, pki, **cfg)
    for _ in range(3):
        _, opened = round_trip(pl, client, echo("direct"))
        assert etree.fromstring(opened).findtext(f".//{{{DEMO}}}text") == "direct"
    assert pl.optimizations is not None
    assert (pl.optimizations.counts.verified, pl.optimizations.counts.fallback) == (3, 0)


def test_secure_conversation_messages_verified_directly(pki: Path) -> None:
    doc = route_doc(pki, "secureconversation", name="sc", optimizations=ALL_ON,
                    secureconversation={"store": "sealed", "master_keys_file": str(pki / "sct-master-keys.yaml")},
                    encryption={"encrypt_response": True})  # fmt: skip
    doc["upstream"] = {"address": "127.0.0.1:1"}
    route = Route.model_validate(doc)
    pl = SecureConversationPipeline(route, RouteStores())
    client = Client(route, ClientConfig(certs=pki))

    def post(body: bytes, content_type: str) -> bytes:
        out = pl.request(body, {"x-forwarded-proto": "https"}, Exchange(route=route))
        assert out.answer and out.body is not None
        return out.body

    client.establish(post)
    _, opened = round_trip(pl, client, echo("in context"))
    assert etree.fromstring(opened).findtext(f".//{{{DEMO}}}text") == "in context"
    assert pl.optimizations is not None
    assert (pl.optimizations.counts.verified, pl.optimizations.counts.fallback) == (2, 0)  # Issue, then in context


def test_direct_verification_counted_in_metrics(pki: Path) -> None:
    pl = pipeline(pki, "hmac", "direct_c14n", name="metrics-direct")
    counter = metrics.OPTIMIZATIONS.labels("metrics-direct", "hmac", "direct_c14n", "verified")
    before = counter._value.get()
    accept(pl, client_for(pl.route, pki, key_name="demo-client").secure(echo())[0])
    assert counter._value.get() == before + 1


# =========================================================================================================
# Tampering after the shortcuts were warm


EVIL = f'<d:echo xmlns:d="{DEMO}"><d:text>pay 9999</d:text></d:echo>'
ATTACK = "urn:attacker"


@dataclass
class Warm:
    """A pipeline whose shortcuts have all hit on the repeated Body, with the client that made it."""

    pipeline: SecuredPipeline
    client: Client
    form: Callable[[bytes], bytes]  # how the sender writes its messages: as the client does, or canonically
    profile: str
    pki: Path
    accepted: bytes  # a message the pipeline accepted

    def fresh(self, text: str = "pay 10", client: Client | None = None) -> bytes:
        return self.form((client or self.client).secure(repeated(text))[0])


FORMS: dict[str, Callable[[bytes], bytes]] = {"as-sent": lambda b: b, "canonical-sender": canonical_sender}


def warm(pki: Path, profile: str, config: str, form: str) -> Warm:
    pl = pipeline(pki, profile, config)
    client = client_for(pl.route, pki, **({"key_name": "demo-client"} if profile == "hmac" else {}))
    w = Warm(pl, client, FORMS[form], profile, pki, b"")
    for _ in range(2):
        w.accepted = w.fresh()
        accept(pl, w.accepted)
    opts = pl.optimizations
    if opts is not None:
        assert opts.counts.fallback == 0
        if opts.on_demand_c14n and form == "canonical-sender":
            assert opts.counts.canonical > 0  # received in canonical form: re-canonicalization skipped
        elif opts.digest_cache is not None:
            assert opts.digest_cache.hits > 0  # the Body seen before: canonicalization skipped
    return w


def _body_text_changed(w: Warm) -> bytes:
    return w.fresh().replace(b"pay 10", b"pay 99")


def _body_moved_into_header_block(w: Warm) -> bytes:
    """The signed content moves to a header block that takes over the Body's id; the Body says something else."""

    def change(root: etree._Element) -> None:
        header, body = root[0], root[1]
        del body.attrib[WSU_ID]
        fake = etree.SubElement(header, ns.q(ATTACK, "Fake"), {"Id": "body-1"})
        fake.extend(list(body))
        body.append(etree.fromstring(EVIL))

    return mutate(w.fresh(), change)


def _body_wrapped_in_new_body(w: Warm) -> bytes:
    def change(root: etree._Element) -> None:
        body = root[1]
        new = etree.Element(ns.q(SOAP11, "Body"))
        new.append(etree.fromstring(EVIL))
        body.addprevious(new)
        etree.SubElement(new, ns.q(ATTACK, "Wrapper")).append(body)

    return mutate(w.fresh(), change)


def _accepted_body_under_another_signature(w: Warm) -> bytes:
    """The Body accepted (and cached) before, in a message whose signature covers another Body."""
    accepted_body = etree.fromstring(w.accepted)[1]
    return mutate(w.fresh("pay 99"), lambda root: root.replace(root[1], accepted_body))


def _digest_value_swapped(w: Warm) -> bytes:
    other = body_reference(etree.fromstring(w.fresh("pay 99"))).findtext(f"{{{DS}}}DigestValue")

    def change(root: etree._Element) -> None:
        find(body_reference(root), f"{{{DS}}}DigestValue").text = other

    return mutate(w.fresh(), change)


def _digest_value_swapped_and_signed(w: Warm) -> bytes:
    """The key holder itself signs a SignedInfo whose Body digest is another Body's (the one in the cache)."""
    other = body_reference(etree.fromstring(w.fresh("pay 99"))).findtext(f"{{{DS}}}DigestValue")

    def change(root: etree._Element) -> None:
        find(body_reference(root), f"{{{DS}}}DigestValue").text = other
        resign(root, w)

    # The Body says "pay 99" would be the honest message; "pay 10" stays, under the other Body's digest.
    return mutate(w.fresh(), change)


def resign(root: etree._Element, w: Warm) -> None:
    sig = find(root, f".//{{{DS}}}Signature")
    info = sig[0]
    inclusive = info[0].find(ns.q(ns.EXC_C14N, "InclusiveNamespaces"))
    data = c14n.canonical(info, (inclusive.get("PrefixList") or "").split() if inclusive is not None else [])
    if w.profile == "hmac":
        value = hmac.new(psk(w.pki), data, hashlib.sha256).digest()
    else:
        key = keys.load_private_key(w.pki / "client.key")
        assert isinstance(key, rsa.RSAPrivateKey)
        value = key.sign(data, padding.PKCS1v15(), hashes.SHA256())
    find(sig, f"{{{DS}}}SignatureValue").text = base64.b64encode(value).decode()


def _signature_value_swapped(w: Warm) -> bytes:
    other = etree.fromstring(w.fresh()).findtext(f".//{{{DS}}}SignatureValue")

    def change(root: etree._Element) -> None:
        find(root, f".//{{{DS}}}SignatureValue").text = other

    return mutate(w.fresh(), change)


def _signed_with_another_key(w: Warm) -> bytes:
    """The cached Body, signed with a key that is not the route's: another secret under the same key name
    (hmac), a certificate from a CA the gateway does not trust (rsa)."""
    if w.profile == "hmac":
        other = w.pki / "other-hmac-keys.yaml"
        other.write_text(yaml.safe_dump({"keys": {"demo-client": base64.b64encode(b"x" * 32).decode()}}))
        route = w.pipeline.route.model_copy(
            update={"hmac": w.pipeline.route.hmac.model_copy(update={"keys_file": str(other)})}
        )
        return w.fresh(client=client_for(route, w.pki, key_name="demo-client"))
    return w.fresh(client=client_for(w.pipeline.route, w.pki, key="rogue.key", certificate="rogue.pem"))  # fmt: skip


def _truncated_signature_value(w: Warm) -> bytes:
    def change(root: etree._Element) -> None:
        value = find(root, f".//{{{DS}}}SignatureValue")
        value.text = base64.b64encode(base64.b64decode("".join((value.text or "").split()))[:10]).decode()

    return mutate(w.fresh(), change)


def _replayed(w: Warm) -> bytes:
    return w.accepted


def _body_named_by_xml_id(w: Warm) -> bytes:
    def change(root: etree._Element) -> None:
        body = root[1]
        del body.attrib[WSU_ID]
        body.set("{http://www.w3.org/XML/1998/namespace}id", "body-1")

    return mutate(w.fresh(), change)


TAMPERS: dict[str, tuple[Callable[[Warm], bytes], dict[str, str]]] = {
    "body-text-changed": (_body_text_changed, {"hmac": "FailedCheck", "rsa": "FailedCheck"}),
    "body-moved-into-header-block": (_body_moved_into_header_block, {"hmac": "FailedCheck", "rsa": "FailedCheck"}),
    "body-wrapped-in-new-body": (_body_wrapped_in_new_body, {"hmac": ""}),
    "accepted-body-under-another-signature": (
        _accepted_body_under_another_signature, {"hmac": "FailedCheck", "rsa": "FailedCheck"}
    ),
    "digest-value-swapped": (_digest_value_swapped, {"hmac": "FailedCheck"}),
    "digest-value-swapped-and-signed": (
        _digest_value_swapped_and_signed, {"hmac": "FailedCheck", "rsa": "FailedCheck"}
    ),
    "signature-value-swapped": (_signature_value_swapped, {"hmac": "FailedCheck", "rsa": "FailedCheck"}),
    "signed-with-another-key": (_signed_with_another_key, {"hmac": "FailedCheck", "rsa": "FailedAuthentication"}),
    "truncated-signature-value": (_truncated_signature_value, {"hmac": "InvalidSecurity"}),  # refused by its length
    "replayed": (_replayed, {"hmac": "InvalidSecurity", "rsa": "InvalidSecurity"}),
    "body-named-by-xml-id": (_body_named_by_xml_id, {"hmac": "InvalidSecurity"}),
}  # fmt: skip
CASES = [(profile, tamper) for tamper, (_, codes) in TAMPERS.items() for profile in codes]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize(("profile", "tamper"), CASES)
def test_tampered_message_refused_after_shortcuts_hit(
    pki: Path, profile: str, tamper: str, config: str, form: str
) -> None:
    """Refused with the fault it gets with every optimization off, after the same Body was accepted (and cached,
    or received in canonical form) moments before."""
    w = warm(pki, profile, config, form)
    build, codes = TAMPERS[tamper]
    refuse(w.pipeline, build(w), codes[profile])


@pytest.mark.parametrize("config", CONFIGS)
def test_expired_message_refused_with_a_cached_body(
    pki: Path, config: str, client_clock: Callable[[timedelta], None]
) -> None:
    w = warm(pki, "hmac", config, "as-sent")
    client_clock(timedelta(hours=-1))
    refuse(w.pipeline, w.fresh(), "MessageExpired")


def test_digest_cache_learns_only_from_verified_signatures(pki: Path) -> None:
    pl = pipeline(pki, "hmac", "digest_cache")
    client = client_for(pl.route, pki, key_name="demo-client")
    assert pl.optimizations is not None and pl.optimizations.digest_cache is not None
    cache = pl.optimizations.digest_cache
    refuse(pl, _signature_value_swapped(Warm(pl, client, FORMS["as-sent"], "hmac", pki, b"")), "FailedCheck")
    assert len(cache) == 0  # a valid Body digest under a bad signature: not remembered
    accept(pl, client.secure(repeated())[0])
    assert len(cache) == 1  # the Body; never the Timestamp (per message)
    accept(pl, client.secure(repeated())[0])
    assert (len(cache), cache.hits) == (1, 1)


def test_digest_cache_misses_on_real_traffic(pki: Path) -> None:
    """The client draws its ids at random: no signed element ever repeats, whatever the content."""
    pl = pipeline(pki, "hmac", "digest_cache")
    client = client_for(pl.route, pki, key_name="demo-client")
    for _ in range(5):
        accept(pl, client.secure(echo("same content"))[0])
    assert pl.optimizations is not None and pl.optimizations.digest_cache is not None
    assert pl.optimizations.digest_cache.hits == 0


def test_digest_cache_is_bounded() -> None:
    cache = DigestCache(3)
    for i in range(5):
        cache.put((bytes([i]), (), "sha256"), b"d")
    assert len(cache) == 3
    assert cache.get((bytes([0]), (), "sha256")) is None  # the oldest went first
    assert cache.get((bytes([4]), (), "sha256")) == b"d"


# =========================================================================================================
# Prehashing: the gateway's own signatures


def fixed_backend(text: str) -> Callable[[bytes], bytes]:
    """A backend that answers the same Body whatever it was asked."""
    return lambda _: echo_response(echo(text))


def exchange(pl: SecuredPipeline, client: Client, backend: Callable[[bytes], bytes]) -> tuple[bytes, Envelope]:
    secured, pending = client.secure(echo())
    ex = Exchange(route=pl.route)
    forwarded = pl.request(secured, {}, ex).body
    assert forwarded is not None
    reply = pl.response(backend(forwarded), ex).body
    assert reply is not None
    return reply, client.open(reply, pending)  # the client verifies with xmlsec alone


def body_digest(reply: bytes) -> str | None:
    root = etree.fromstring(reply)
    body_id = find(root, f"{{{SOAP11}}}Body").get(WSU_ID)
    return find(root, f".//{{{DS}}}Reference[@URI='#{body_id}']").findtext(f"{{{DS}}}DigestValue")


@pytest.mark.parametrize("profile", ["hmac", "rsa"])
def test_prehashed_responses_verify_with_xmlsec(pki: Path, profile: str) -> None:
    pl = pipeline(pki, profile, "all")
    client = client_for(pl.route, pki, **({"key_name": "demo-client"} if profile == "hmac" else {}))
    replies = [exchange(pl, client, fixed_backend("the same answer")) for _ in range(3)]
    assert pl.optimizations is not None and pl.optimizations.prehash is not None
    assert (pl.optimizations.prehash.misses, pl.optimizations.prehash.hits) == (1, 2)
    assert len(pl.optimizations.prehash) == 1  # the Body; the Timestamp is never prehashed
    assert len({body_digest(reply) for reply, _ in replies}) == 1
    for _, opened in replies:
        assert opened.body.findtext(f".//{{{DEMO}}}text") == "the same answer"


def test_changed_body_never_gets_a_stale_digest(pki: Path) -> None:
    pl = pipeline(pki, "hmac", "all")
    client = client_for(pl.route, pki, key_name="demo-client")
    first, _ = exchange(pl, client, fixed_backend("pay 10"))
    second, opened = exchange(pl, client, fixed_backend("pay 19"))
    assert pl.optimizations is not None and pl.optimizations.prehash is not None
    assert pl.optimizations.prehash.hits == 0
    assert body_digest(first) != body_digest(second)
    assert opened.body.findtext(f".//{{{DEMO}}}text") == "pay 19"


def test_same_body_in_other_namespaces_never_gets_a_stale_digest(pki: Path) -> None:
    """The same Body bytes under an Envelope that binds a prefix differently: another canonical form (the
    prefix is in the Body's InclusiveNamespaces), so another digest, never the prehashed one."""
    opts = Optimizations(prehash=DigestCache(16))
    signer = signing.Signer(psk(pki), "hmac-sha256", "sha256")
    digests = []
    for uri in ("urn:one", "urn:two"):
        plain = echo("same").replace(b"<soap:Envelope ", f'<soap:Envelope xmlns:x="{uri}" '.encode())
        env = parse_envelope(plain, Limits())
        sending.secure(env, datetime.now(UTC), timestamp_ttl_s=300,
                          sign=sending.SignWith(signer, lambda: keys.key_name("demo-client"),
                                                   optimizations=opts))  # fmt: skip
        reply = env.serialize()
        digests.append(body_digest(reply))
        sig = find(env.root, f".//{{{DS}}}Signature")
        signature.verify(sig, env, psk(pki), SignaturePolicy())  # xmlsec
    assert opts.prehash is not None and (opts.prehash.hits, len(opts.prehash)) == (0, 2)
    assert digests[0] != digests[1]


# =========================================================================================================
# Policy


def test_defaults_turn_on_direct_c14n_only() -> None:
    opts = make_route_defaults().optimizations
    assert (opts.direct_c14n, opts.on_demand_c14n, opts.digest_cache, opts.prehash) == (True, False, False, False)


def make_route_defaults() -> Route:
    return Route.model_validate(
        {"name": "r", "match": {"path_prefix": "/r/"}, "upstream": {"address": "h:1"}, "profile": "hmac"}
    )


@pytest.mark.parametrize("shortcut", ["on_demand_c14n", "digest_cache", "prehash"])
def test_shortcuts_need_direct_c14n(shortcut: str) -> None:
    with pytest.raises(ValidationError, match="work on direct_c14n"):
        Route.model_validate({"name": "r", "match": {"path_prefix": "/r/"}, "upstream": {"address": "h:1"},
                              "profile": "hmac", "optimizations": {"direct_c14n": False, shortcut: True}})  # fmt: skip


def test_unknown_optimization_refused() -> None:
    with pytest.raises(ValidationError, match="extra"):
        Route.model_validate({"name": "r", "match": {"path_prefix": "/r/"}, "upstream": {"address": "h:1"},
                              "profile": "hmac", "optimizations": {"differential_parsing": True}})  # fmt: skip


def test_xmlsec_route_has_no_optimizations(pki: Path) -> None:
    assert pipeline(pki, "hmac", "xmlsec").optimizations is None
