"""What a route that takes AES-CBC (for clients with no GCM: Metro, older .NET) offers them without reopening the
padding and parse oracle of "How to Break XML Encryption" (Jager and Somorovsky 2011): a key from an EncryptedKey
decrypts CBC in one message only, claimed before any byte is decrypted; any other key (pre-shared, derived from a
context) only under a signature that covers the ciphertext, made with that key and verified first
(filters/engine/wss/wssecurity._check_cbc, docs/interop.md "CBC"). The oracle's queries are copies of a genuine message with
its ciphertext changed: every one must be refused unopened, with the one generic fault."""

from __future__ import annotations

import base64
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from lxml import etree

from filters.engine import faults, ns
from filters.engine.profiles import SecuredPipeline
from filters.engine.wss import encryption, wssecurity
from filters.stores.factory import RouteStores
from filters.stores.replay import DeferredRedisReplay
from gateway.tools.client import Client
from tests.support.wss_helpers import client_for, echo, make_route
from tests.unit.test_wssecurity import ENCRYPTED_DATA, REFERENCE_LIST, SOAP11, accept, mutate, parts, refuse

CBC = {"require_request": True, "encrypt_response": True, "data_algorithms": ["aes256-cbc"],
       "response_algorithm": "aes256-cbc"}  # fmt: skip
SIGNATURE = ns.q(ns.DS, "Signature")


def _pipeline_and_client(pki: Path, profile: str, **client: Any) -> tuple[SecuredPipeline, Client]:
    route = make_route(pki, profile, encryption=CBC)
    return SecuredPipeline(route, RouteStores()), client_for(route, pki, **client)


def _body_cipher(root: etree._Element) -> etree._Element:
    value = parts(root)[2].find(f"{ENCRYPTED_DATA}/{{{ns.XENC}}}CipherData/{{{ns.XENC}}}CipherValue")
    assert value is not None
    return value


def _query(block: int, byte: int) -> Callable[[etree._Element], None]:
    """One oracle query: a byte of the IV or of a ciphertext block changed (the attacker's padding probe), and the
    key's carriers moved before the Signature, so that the gateway decrypts before it verifies anything."""

    def change(root: etree._Element) -> None:
        security = parts(root)[1]
        sig = security.find(SIGNATURE)
        assert sig is not None
        for carrier in [c for c in security if c.tag in (wssecurity.ENCRYPTED_KEY, REFERENCE_LIST)]:
            sig.addprevious(carrier)
        value = _body_cipher(root)
        raw = bytearray(base64.b64decode(value.text or ""))
        raw[16 * block + byte] ^= 0x01
        value.text = base64.b64encode(bytes(raw)).decode()

    return change


@pytest.mark.parametrize(("profile", "client"), [("rsa", {}), ("hmac", {})])
def test_cbc_oracle_queries_on_a_spent_encrypted_key_refused_unopened(
    pki: Path, profile: str, client: dict[str, Any]
) -> None:
    """A genuine CBC request (an EncryptedKey to the gateway: the rsa binding, and the symmetric binding as Metro
    sends it) is taken once; every copy with its ciphertext changed, in any block, laid out to be decrypted before
    the signature is looked at, is refused before decryption (the log says the key was spent, never padding or
    parsing), with the same fault as any decryption failure."""
    pipeline, cl = _pipeline_and_client(pki, profile, **client)
    secured, _ = cl.secure(echo("genuine"))
    assert encryption.DATA_ALGORITHMS["aes256-cbc"].encode() in secured
    accept(pipeline, secured)
    queries = [mutate(secured, _query(block, byte)) for block in (0, 1, 2) for byte in (0, 7, 15)]
    reasons = {refuse(pipeline, q, "FailedCheck").reason for q in queries}
    assert reasons == {"CBC key reused"}


def test_cbc_copy_re_signed_by_another_trusted_client_gets_one_decryption_at_most(pki: Path) -> None:
    """An insider with a certificate of its own takes someone's EncryptedKey and ciphertext into messages it signs
    itself (the signature covers the ciphertext, so coverage alone would not stop it). Intercepted before the
    owner's message arrives, the first copy is decrypted; every further one is refused unopened."""
    pipeline, owner = _pipeline_and_client(pki, "rsa")
    stolen = etree.fromstring(owner.secure(echo("secret"))[0])
    _, stolen_security, stolen_body = parts(stolen)
    insider = client_for(pipeline.route, pki, key="client2.key", certificate="client2.pem", encrypt=False)
    stolen_ek = stolen_security.find(wssecurity.ENCRYPTED_KEY)
    assert stolen_ek is not None

    def re_signed(query: int) -> bytes:
        """The insider's own signed request whose Body is the stolen ciphertext (changed), the stolen EncryptedKey
        after its Signature (as an encrypt-then-sign sender lays it out)."""
        plain = etree.fromstring(echo("mine"))
        body = plain.find(ns.q(SOAP11, "Body"))
        assert body is not None
        body.getparent().replace(body, _changed(stolen_body, query))  # type: ignore[union-attr]
        root = etree.fromstring(insider.secure(etree.tostring(plain))[0])
        parts(root)[1].append(_copy(stolen_ek))
        return etree.tostring(root)

    first = refuse(pipeline, re_signed(1), "FailedCheck")  # its one decryption: bad padding, or the digest fails
    assert first.reason.startswith("EncryptedData:"), first.reason  # decrypted: the one query it gets
    for query in range(2, 6):
        assert refuse(pipeline, re_signed(query), "FailedCheck").reason == "CBC key reused"


def _copy(el: etree._Element) -> etree._Element:
    return etree.fromstring(etree.tostring(el))


def _changed(body: etree._Element, query: int) -> etree._Element:
    copy = _copy(body)
    value = copy.find(f"{ENCRYPTED_DATA}/{{{ns.XENC}}}CipherData/{{{ns.XENC}}}CipherValue")
    assert value is not None
    raw = bytearray(base64.b64decode(value.text or ""))
    raw[16 + query] ^= query
    value.text = base64.b64encode(bytes(raw)).decode()
    return copy


def test_cbc_under_a_pre_shared_key_is_sent_and_taken_as_signed_ciphertext(pki: Path) -> None:
    """A pre-shared key is reused by design, so it cannot be single-use: its CBC is encrypted first and the
    ciphertext signed (our client, like the gateway's replies, sends CBC so), and the signature is verified before
    the ReferenceList that follows it is acted on. Two genuine messages under the same key both pass."""
    pipeline, cl = _pipeline_and_client(pki, "hmac", key_name="demo-client")
    for text in ("one", "two"):
        secured, _ = cl.secure(echo(text))
        security = parts(etree.fromstring(secured))[1]
        tags = [c.tag for c in security]
        assert tags.index(SIGNATURE) < tags.index(REFERENCE_LIST), tags
        accept(pipeline, secured)


def test_cbc_under_a_pre_shared_key_not_covered_by_a_verified_signature_refused_unopened(pki: Path) -> None:
    """The ReferenceList moved before the Signature (decrypt first, as sign-then-encrypt would) and the ciphertext
    changed: refused before decryption, not by its padding."""
    pipeline, cl = _pipeline_and_client(pki, "hmac", key_name="demo-client")
    secured, _ = cl.secure(echo())
    fault = refuse(pipeline, mutate(secured, _query(1, 15)), "FailedCheck")
    assert fault.reason == "CBC EncryptedData not covered by a signature verified before decryption"
    assert fault.message == faults.WSSE_CODES["FailedCheck"]


def test_cbc_key_is_claimed_before_decryption_where_the_replay_store_defers(pki: Path, redis_server: str) -> None:
    """With Redis the engine leaves a message's replay keys to the frame, after its verdict; a CBC key is claimed at
    once all the same, so a changed copy is refused before it is decrypted, not after (one worker or many)."""
    route = make_route(pki, "rsa", encryption=CBC, replay={"store": "redis", "redis_url": redis_server})
    first, second = (SecuredPipeline(route, RouteStores(defer_replay=True)) for _ in range(2))
    assert isinstance(first.credentials.replay, DeferredRedisReplay)
    secured, _ = client_for(route, pki).secure(echo("genuine"))
    accept(first, secured)  # its deferred keys not even settled: the CBC key already is
    assert refuse(second, mutate(secured, _query(2, 3)), "FailedCheck").reason == "CBC key reused"
