"""UsernameToken: PasswordText against scrypt hashes and stored passwords, PasswordDigest, every refusal."""

from __future__ import annotations

import base64
import hashlib
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml
from lxml import etree

from certs import pki as pki_mod
from filters.engine import faults, ns
from filters.engine.wss import username_token as ut_mod
from filters.engine.wss.username_token import Users, create, verify
from filters.stores.auth_throttle import MemoryFailureThrottle
from gateway.policy import UsernameTokenPolicy

NOW = datetime(2026, 11, 21, 20, 35, 10, 123456, tzinfo=UTC)
BOTH = UsernameTokenPolicy(password_types=["digest", "text"])
ALICE, BOB = pki_mod.DEMO_USERS["alice"], pki_mod.DEMO_USERS["bob"]
MAX_AGE, SKEW = 300, 60


@pytest.fixture(scope="module")
def users(pki: Path) -> Users:
    return Users.load(pki / "users.yaml")


def run(
    token: etree._Element, users: Users, policy: UsernameTokenPolicy = BOTH, now: datetime = NOW
) -> ut_mod.VerifiedUsernameToken:
    # Through the wire form, as the gateway sees tokens.
    parsed = etree.fromstring(etree.tostring(token))
    return verify(parsed, users, policy, now, MAX_AGE, SKEW)


def refused(
    token: etree._Element, users: Users, code: str, reason: str, policy: UsernameTokenPolicy = BOTH
) -> faults.Fault:
    with pytest.raises(faults.Fault) as info:
        run(token, users, policy)
    fault = info.value
    assert (fault.code, fault.code_ns) == (code, ns.WSSE)
    assert reason in fault.reason
    for secret in (ALICE, BOB, "wrong-password"):
        assert secret not in fault.reason
        assert secret not in fault.message
    return fault


def child(token: etree._Element, local: str) -> etree._Element:
    found = token.find(ns.q(ns.WSU if local == "Created" else ns.WSSE, local))
    assert found is not None
    return found


def digest_of(nonce: bytes, created: str, password: str) -> str:
    return base64.b64encode(hashlib.sha1(nonce + created.encode() + password.encode()).digest()).decode()


# --- happy paths


def test_text_against_scrypt_hash(users: Users) -> None:
    token = create("alice", ALICE, digest=False, now=NOW, id="UT-1")
    got = run(token, users)
    assert got.username == "alice"
    assert got.password_type == "text"
    assert got.nonce == base64.b64decode(child(token, "Nonce").text or "")
    assert got.created == NOW.replace(microsecond=123000)


def test_text_against_stored_password(users: Users) -> None:
    assert run(create("bob", BOB, digest=False, now=NOW, id="UT-1"), users).username == "bob"


def test_text_without_nonce_and_created(users: Users) -> None:
    token = create("alice", ALICE, digest=False, now=NOW, id="UT-1")
    token.remove(child(token, "Nonce"))
    token.remove(child(token, "Created"))
    got = run(token, users)
    assert (got.username, got.nonce, got.created) == ("alice", None, None)


def test_digest(users: Users) -> None:
    token = create("bob", BOB, digest=True, now=NOW, id="UT-1")
    got = run(token, users)
    assert (got.username, got.password_type) == ("bob", "digest")
    assert got.nonce is not None and len(got.nonce) == 16
    assert got.created == NOW.replace(microsecond=123000)


def test_digest_is_over_created_as_sent(users: Users) -> None:
    # Another client's formatting (offset, no fraction): the digest covers that exact text.
    nonce, created = b"n" * 20, "2026-11-21T21:35:00+01:00"
    token = create("bob", BOB, digest=True, now=NOW, id="UT-1")
    child(token, "Nonce").text = base64.b64encode(nonce).decode()
    child(token, "Created").text = created
    child(token, "Password").text = digest_of(nonce, created, BOB)
    assert run(token, users).created == datetime(2026, 11, 21, 20, 35, tzinfo=UTC)


def test_nonce_without_encoding_type_is_base64(users: Users) -> None:
    token = create("bob", BOB, digest=True, now=NOW, id="UT-1")
    del child(token, "Nonce").attrib["EncodingType"]
    assert run(token, users).username == "bob"


def test_create_shape() -> None:
    token = create("alice", ALICE, digest=False, now=NOW, id="UT-7")
    assert token.tag == ut_mod.USERNAME_TOKEN
    assert token.get(ns.q(ns.WSU, "Id")) == "UT-7"
    assert [c.tag for c in token] == [ut_mod.USERNAME, ut_mod.PASSWORD, ut_mod.NONCE, ut_mod.CREATED]
    assert child(token, "Password").get("Type") == ns.PASSWORD_TEXT
    assert child(token, "Password").text == ALICE
    assert child(token, "Nonce").get("EncodingType") == ns.BASE64
    assert child(token, "Created").text == "2026-11-21T20:35:10.123Z"
    digest = create("bob", BOB, digest=True, now=NOW, id="UT-8")
    nonce = base64.b64decode(child(digest, "Nonce").text or "")
    assert child(digest, "Password").get("Type") == ns.PASSWORD_DIGEST
    assert child(digest, "Password").text == digest_of(nonce, "2026-11-21T20:35:10.123Z", BOB)
    assert BOB not in etree.tostring(digest).decode()


def test_create_uses_fresh_nonces() -> None:
    nonces = {child(create("bob", BOB, True, NOW, "u"), "Nonce").text for _ in range(20)}
    assert len(nonces) == 20


# --- authentication failures: one generic message

GENERIC = faults.WSSE_CODES["FailedAuthentication"]


def test_wrong_text_password_against_hash(users: Users) -> None:
    fault = refused(create("alice", "wrong-password", False, NOW, "u"), users, "FailedAuthentication", "wrong")
    assert fault.message == GENERIC
    assert "'alice'" in fault.reason


def test_wrong_text_password_against_stored_password(users: Users) -> None:
    refused(create("bob", "wrong-password", False, NOW, "u"), users, "FailedAuthentication", "wrong password")


def test_wrong_digest_password(users: Users) -> None:
    fault = refused(create("bob", "wrong-password", True, NOW, "u"), users, "FailedAuthentication", "wrong")
    assert fault.message == GENERIC


def test_unknown_user(users: Users) -> None:
    for digest in (False, True):
        fault = refused(create("mallory", "x", digest, NOW, "u"), users, "FailedAuthentication", "unknown user")
        assert fault.message == GENERIC


def test_digest_for_hash_only_user(users: Users) -> None:
    # alice has only a salted hash: even her right password cannot make a digest we could check.
    fault = refused(create("alice", ALICE, True, NOW, "u"), users, "FailedAuthentication", "only a hash")
    assert fault.message == GENERIC


def test_type_not_allowed_by_policy(users: Users) -> None:
    text_only = UsernameTokenPolicy(password_types=["text"])
    digest_only = UsernameTokenPolicy(password_types=["digest"])
    refused(create("bob", BOB, True, NOW, "u"), users, "FailedAuthentication", "not allowed", policy=text_only)
    refused(create("bob", BOB, False, NOW, "u"), users, "FailedAuthentication", "not allowed", policy=digest_only)


def test_unknown_password_type(users: Users) -> None:
    token = create("bob", BOB, False, NOW, "u")
    child(token, "Password").set("Type", "urn:example:plain")
    refused(token, users, "FailedAuthentication", "not allowed")


# --- freshness


@pytest.mark.parametrize("digest", [False, True])
def test_created_too_old(users: Users, digest: bool) -> None:
    token = create("bob", BOB, digest, NOW - timedelta(seconds=MAX_AGE + SKEW + 1), "u")
    refused(token, users, "MessageExpired", "UsernameToken Created is older")


@pytest.mark.parametrize("digest", [False, True])
def test_created_in_future(users: Users, digest: bool) -> None:
    token = create("bob", BOB, digest, NOW + timedelta(seconds=SKEW + 1), "u")
    refused(token, users, "MessageExpired", "UsernameToken Created is in the future")


def test_created_at_edges_accepted(users: Users) -> None:
    now = NOW.replace(microsecond=0)
    assert run(create("bob", BOB, True, now - timedelta(seconds=MAX_AGE + SKEW), "u"), users, now=now)
    assert run(create("bob", BOB, True, now + timedelta(seconds=SKEW), "u"), users, now=now)


# --- malformed tokens


def test_digest_needs_nonce(users: Users) -> None:
    token = create("bob", BOB, True, NOW, "u")
    token.remove(child(token, "Nonce"))
    refused(token, users, "InvalidSecurity", "needs a Nonce and a Created")


def test_digest_needs_created(users: Users) -> None:
    token = create("bob", BOB, True, NOW, "u")
    token.remove(child(token, "Created"))
    refused(token, users, "InvalidSecurity", "needs a Nonce and a Created")


def test_short_nonce(users: Users) -> None:
    token = create("bob", BOB, True, NOW, "u")
    child(token, "Nonce").text = base64.b64encode(b"x" * 15).decode()
    refused(token, users, "InvalidSecurity", "15 bytes, fewer than 16")


@pytest.mark.parametrize("value", ["not base64!", "YWJj*ZGVm", "YWJjZA"])
def test_nonce_not_base64(users: Users, value: str) -> None:
    token = create("bob", BOB, True, NOW, "u")
    child(token, "Nonce").text = value
    refused(token, users, "InvalidSecurity", "Nonce is not base64")


def test_nonce_other_encoding(users: Users) -> None:
    token = create("bob", BOB, True, NOW, "u")
    child(token, "Nonce").set("EncodingType", "urn:example:hex")
    refused(token, users, "InvalidSecurity", "EncodingType")


def test_digest_value_not_base64(users: Users) -> None:
    token = create("bob", BOB, True, NOW, "u")
    child(token, "Password").text = "%%%"
    refused(token, users, "InvalidSecurity", "PasswordDigest is not base64")


def test_password_without_type(users: Users) -> None:
    token = create("bob", BOB, False, NOW, "u")
    del child(token, "Password").attrib["Type"]
    refused(token, users, "InvalidSecurity", "no Type attribute")


@pytest.mark.parametrize("value", ["2026-11-21T20:35:10", "yesterday"])
def test_created_malformed(users: Users, value: str) -> None:
    token = create("bob", BOB, False, NOW, "u")
    child(token, "Created").text = value
    refused(token, users, "InvalidSecurity", "UsernameToken Created")


@pytest.mark.parametrize("local", ["Username", "Password", "Nonce"])
def test_duplicate_elements(users: Users, local: str) -> None:
    token = create("bob", BOB, True, NOW, "u")
    token.append(etree.fromstring(etree.tostring(child(token, local))))
    refused(token, users, "InvalidSecurity", f"2 {local} elements")


def test_duplicate_created(users: Users) -> None:
    token = create("bob", BOB, True, NOW, "u")
    token.append(etree.fromstring(etree.tostring(child(token, "Created"))))
    refused(token, users, "InvalidSecurity", "2 Created elements")


@pytest.mark.parametrize("local", ["Username", "Password"])
def test_missing_elements(users: Users, local: str) -> None:
    token = create("bob", BOB, False, NOW, "u")
    token.remove(child(token, local))
    refused(token, users, "InvalidSecurity", f"0 {local} elements")


def test_empty_username(users: Users) -> None:
    token = create("bob", BOB, False, NOW, "u")
    child(token, "Username").text = "  "
    refused(token, users, "InvalidSecurity", "Username is empty")


def test_element_inside_password(users: Users) -> None:
    token = create("bob", BOB, False, NOW, "u")
    etree.SubElement(child(token, "Password"), "x")
    refused(token, users, "InvalidSecurity", "Password has child nodes")


def test_unexpected_element(users: Users) -> None:
    # UT 1.1 Salt/Iteration: a token for key derivation, not for authentication here.
    token = create("bob", BOB, False, NOW, "u")
    etree.SubElement(token, ns.q(ns.WSSE11, "Salt")).text = "AAAA"
    refused(token, users, "InvalidSecurity", "unexpected elements")


def test_not_a_username_token(users: Users) -> None:
    token = create("bob", BOB, False, NOW, "u")
    token.tag = ns.q(ns.WSSE11, "UsernameToken")
    refused(token, users, "InvalidSecurity", "expected wsse:UsernameToken")


def test_comments_are_ignored(users: Users) -> None:
    token = create("bob", BOB, False, NOW, "u")
    token.insert(1, etree.Comment("note"))
    assert run(token, users).username == "bob"


# --- Users: loading and the verification cache


def write_users(tmp_path: Path, doc: object) -> Path:
    path = tmp_path / "users.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.parametrize(
    ("doc", "reason"),
    [
        ({}, "expected a 'users' mapping"),
        ({"users": ["alice"]}, "expected a 'users' mapping"),
        ({"users": {"alice": {}}}, "exactly one of"),
        ({"users": {"alice": {"password": "a", "password_hash": "b"}}}, "exactly one of"),
        ({"users": {"alice": {"pwd": "a"}}}, "exactly one of"),
        ({"users": {"alice": {"password": 1234}}}, "must be a non-empty string"),
        ({"users": {"alice": {"password": ""}}}, "must be a non-empty string"),
        ({"users": {1: {"password": "a"}}}, "non-empty strings"),
        ({"users": {"alice": {"password_hash": "bcrypt$x"}}}, "not a scrypt"),
        ({"users": {"alice": {"password_hash": "scrypt$16384$8$1$!!$AAAA"}}}, "malformed field"),
        ({"users": {"alice": {"password_hash": "scrypt$1000$8$1$AAAA$" + "A" * 44}}}, "out of range"),
        ({"users": {"alice": {"password_hash": "scrypt$1048576$8$1$AAAA$" + "A" * 44}}}, "more memory"),
    ],
)
def test_load_refuses_malformed_files(tmp_path: Path, doc: object, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        Users.load(write_users(tmp_path, doc))


def test_load_refuses_broken_yaml(tmp_path: Path) -> None:
    path = tmp_path / "users.yaml"
    path.write_text("users: {alice: [")
    with pytest.raises(ValueError, match="not valid YAML"):
        Users.load(path)


def test_load_reads_pki_users(users: Users) -> None:
    alice, bob = users.get("alice"), users.get("bob")
    assert alice is not None and alice.password_hash is not None and alice.password is None
    assert bob is not None and bob.password == BOB and bob.password_hash is None
    assert BOB not in repr(bob)
    assert users.get("mallory") is None


def test_hashes_with_other_parameters(tmp_path: Path) -> None:
    salt = b"s" * 16
    digest = hashlib.scrypt(b"pw", salt=salt, n=2**10, r=4, p=2, dklen=32)
    value = f"scrypt$1024$4$2${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"
    users = Users.load(write_users(tmp_path, {"users": {"carol": {"password_hash": value}}}))
    assert run(create("carol", "pw", False, NOW, "u"), users).username == "carol"
    refused(create("carol", "pw2", False, NOW, "u"), users, "FailedAuthentication", "wrong password")


def test_cache_makes_repeat_text_checks_cheap(pki: Path) -> None:
    users = Users.load(pki / "users.yaml", cache_size=4)
    alice = users.get("alice")
    assert alice is not None
    start = time.perf_counter()
    assert users.check_text(alice, ALICE)
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(20):
        assert users.check_text(alice, ALICE)
    assert (time.perf_counter() - start) < first  # 20 cached checks cost less than one scrypt


def test_cache_is_bounded_and_keeps_no_plaintext(tmp_path: Path) -> None:
    names = [f"u{i}" for i in range(5)]
    doc = {"users": {n: {"password_hash": pki_mod.hash_password(f"pw-{n}")} for n in names}}
    users = Users.load(write_users(tmp_path, doc), cache_size=3)
    for n in names:
        user = users.get(n)
        assert user is not None and users.check_text(user, f"pw-{n}")
    cache = users._cache
    assert len(cache) == 3
    assert [k[0] for k in cache] == names[2:]  # least recently used went first
    for _, key in cache:
        assert not any(f"pw-{n}".encode() in key for n in names)
        assert key not in {hashlib.sha256(f"pw-{n}".encode()).digest() for n in names}


def test_cache_hit_refreshes_recency(tmp_path: Path) -> None:
    doc = {"users": {n: {"password_hash": pki_mod.hash_password(f"pw-{n}")} for n in ("a", "b", "c")}}
    users = Users.load(write_users(tmp_path, doc), cache_size=2)
    a, b, c = users.get("a"), users.get("b"), users.get("c")
    assert a is not None and b is not None and c is not None
    assert users.check_text(a, "pw-a") and users.check_text(b, "pw-b")
    assert users.check_text(a, "pw-a")  # a hit: a is now the most recently used
    assert users.check_text(c, "pw-c")
    assert [k[0] for k in users._cache] == ["a", "c"]


def test_cache_does_not_remember_failures(pki: Path) -> None:
    users = Users.load(pki / "users.yaml")
    alice = users.get("alice")
    assert alice is not None
    assert not users.check_text(alice, "wrong-password")
    assert len(users._cache) == 0
    assert users.check_text(alice, ALICE)
    assert len(users._cache) == 1
    assert not users.check_text(alice, "wrong-password")


def test_cache_hit_needs_the_same_password(users: Users) -> None:
    alice = users.get("alice")
    assert alice is not None
    assert users.check_text(alice, ALICE)
    assert not users.check_text(alice, ALICE + "x")
    assert not users.check_text(alice, ALICE[:-1])


def test_cache_disabled(pki: Path) -> None:
    users = Users.load(pki / "users.yaml", cache_size=0)
    alice = users.get("alice")
    assert alice is not None and users.check_text(alice, ALICE)
    assert len(users._cache) == 0


# --- equal work: unknown users and stored passwords cost what a hashed known user does


def work_of(users: Users, token: etree._Element) -> Counter[str]:
    before = Counter(users.work)
    with pytest.raises(faults.Fault):
        run(token, users)
    return Counter(users.work) - before


def test_unknown_and_plain_stored_users_cost_one_identical_scrypt(pki: Path) -> None:
    """PasswordText: a wrong password for alice (hash), bob (stored password) and an unknown name each run
    exactly one scrypt with the same parameters, and nothing else: timing tells no user apart."""
    users = Users.load(pki / "users.yaml")
    one_scrypt = Counter({"scrypt:16384:8:1": 1})
    for name in ("alice", "bob", "mallory", "m" * 300):
        assert work_of(users, create(name, "wrong-password", False, NOW, "u")) == one_scrypt, name
    before = Counter(users.work)
    assert run(create("bob", BOB, False, NOW, "u"), users).username == "bob"  # the right one: the same scrypt
    assert Counter(users.work) - before == one_scrypt


def test_digest_checks_cost_one_sha1_for_every_user(pki: Path) -> None:
    """PasswordDigest needs the stored password; for alice (hash only) and unknown names a dummy password takes
    its place, so each check is one SHA-1 whoever is named."""
    users = Users.load(pki / "users.yaml")
    for name in ("alice", "bob", "mallory"):
        assert work_of(users, create(name, "wrong-password", True, NOW, "u")) == Counter({"sha1": 1}), name


def test_hash_parameters_must_agree_within_a_file(tmp_path: Path) -> None:
    """A dummy derivation can only match every user's cost if the file has one parameter set."""
    salt = b"s" * 16
    digest = hashlib.scrypt(b"pw", salt=salt, n=2**10, r=4, p=2, dklen=32)
    other = f"scrypt$1024$4$2${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"
    doc = {"users": {"alice": {"password_hash": pki_mod.hash_password("a")}, "carol": {"password_hash": other}}}
    with pytest.raises(ValueError, match="scrypt parameters differ"):
        Users.load(write_users(tmp_path, doc))


# --- repeated failures per user are slowed down


def test_repeated_failures_refuse_the_user_unchecked(pki: Path) -> None:
    """After max_failures wrong passwords within the window, even the right password is refused, without any
    password work; other users are unaffected; unknown names are throttled the same way."""
    clock = [0.0]
    throttle = MemoryFailureThrottle(3, 60, clock=lambda: clock[0])
    users = Users.load(pki / "users.yaml", throttle=throttle)
    for name in ("bob", "mallory"):
        for _ in range(3):
            refused(
                create(name, "wrong-password", True, NOW, "u"),
                users,
                "FailedAuthentication",
                "wrong" if name == "bob" else "unknown",
            )
        before = Counter(users.work)
        refused(create(name, BOB, True, NOW, "u"), users, "FailedAuthentication", "refused unchecked")
        assert Counter(users.work) == before  # no check ran
    assert run(create("alice", ALICE, False, NOW, "u"), users).username == "alice"
    clock[0] = 60.0  # the window is short: the real user is back when it closes
    assert run(create("bob", BOB, True, NOW, "u"), users).username == "bob"
