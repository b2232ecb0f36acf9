"""Load-test traffic: plain SOAP requests in three sizes, secured per profile by gateway.tools.client.Client, and the
check every response must pass. The Locust file and the benchmark both use it.

Sizes (the demo backend's operations, gateway/tools/demo_backend.py):

    small  echo, ~1 KB plain request, the same back
    large  echo, ~30 KB plain request, the same back
    huge   query with count=3500: a small request, a ~1 MB response

Every request is distinct: the echoed texts carry a per-message tag, and a secured message has its own Timestamp,
wsu:Ids, signature (and nonce, keys), so a gateway with replay detection accepts each exactly once."""

from __future__ import annotations

import itertools
import os
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from lxml import etree

from certs import pki
from filters.engine import ns
from filters.engine.wss import keys, saml_issuer
from filters.engine.wss import secure_conversation as sc
from filters.engine.xml import xmlsupport
from gateway.policy import PolicySet, Route, SamlTokenService, load_dir
from gateway.tools.client import Client, ClientConfig, ClientError, Pending, content_type, http_post

DEMO_NS = "urn:wsgate:demo"
SIZES = ("small", "large", "huge")
SIZE_LABELS = {"small": "1 KB", "large": "30 KB", "huge": "1 MB resp"}
TEXT_CHARS = 80  # one d:text element's text
ECHO_TEXTS = {"small": 10, "large": 310}  # d:text elements: ~1.1 KB and ~30 KB plain envelopes
HUGE_COUNT = 3500  # query rows of ~290 bytes: a ~1 MB response
HMAC_KEY_NAME = "demo-client"  # the demo PKI's pre-shared key (certs/out/hmac-keys.yaml)
ENCRYPTED_KEY = "encrypted-key"  # hmac_key value: a fresh key per message in an EncryptedKey (symmetric binding)
USER, PASSWORD = "bob", pki.DEMO_USERS["bob"]  # bob's password is kept in clear, so PasswordDigest works
SAML_AUDIENCE = "urn:wsgate:bench"  # the saml routes' audience (loadtest/policies/bench.yaml)
SAML_LIFETIME_S = 8 * 3600  # the longest run; the routes' max_age_s matches

_PARSER = xmlsupport.parser(huge_tree=True)


@dataclass(frozen=True)
class Profile:
    """A row of the benchmark and a Locust user class: which route of the policies, and how to reach it."""

    name: str
    route: str  # the route's name in the policies (policies/demo.yaml, loadtest/policies/bench.yaml)
    tls: bool = False  # over the HTTPS listener
    secured: bool = False  # WS-Security: gateway.tools.client.Client secures requests and opens replies
    username: bool = False  # with a UsernameToken
    context: bool = False  # WS-SecureConversation: messages in a context established first (Factory.establish)
    # SAML: the messages carry an assertion with this confirmation (Factory.assertion_file), issued as the
    # gateway's STS issues them (saml_token_service: its signing key; the bench route trusts its certificate).
    saml: str | None = None


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile("none", "plain"),
        Profile("tls", "tls", tls=True),
        Profile("xml", "xml"),
        Profile("xml-schema", "xml-schema"),
        Profile("hmac", "hmac", secured=True),
        Profile("hmac-encrypted", "hmac-encrypted", secured=True),
        Profile("rsa", "rsa", secured=True),
        Profile("rsa-encrypted", "rsa-encrypted", secured=True),
        Profile("username", "username", secured=True, username=True),
        Profile("secureconversation", "sc", secured=True, context=True),
        Profile("saml-sender-vouches", "saml-sv", secured=True, saml="sender-vouches"),
        Profile("saml-holder-of-key", "saml-hok", secured=True, saml="holder-of-key"),
    )
}


class CheckFailed(Exception):
    """A response that is not the right answer to its request."""


@dataclass(frozen=True)
class Expect:
    """What the reply to one request must hold."""

    operation: str  # echoResponse or queryResponse
    texts: tuple[str, ...] = ()  # echo: the d:text values, in order
    count: int = 0  # query: the number of rows


@dataclass
class Message:
    body: bytes
    expect: Expect
    pending: Pending | None = None  # secured profiles: what Client.open needs
    created: float = field(default_factory=time.time)  # the Timestamp's Created, for the freshness window


def plain_request(size: str, tag: str) -> tuple[bytes, Expect]:
    """A plain SOAP 1.1 request of `size` whose echoed content carries `tag` (unique per message)."""
    if size == "huge":
        op = f'<d:query xmlns:d="{DEMO_NS}"><d:count>{HUGE_COUNT}</d:count></d:query>'
        expect = Expect("queryResponse", count=HUGE_COUNT)
    elif size in ECHO_TEXTS:
        texts = tuple(f"{tag}.{i:04d}.".ljust(TEXT_CHARS, "x") for i in range(ECHO_TEXTS[size]))
        op = f'<d:echo xmlns:d="{DEMO_NS}">' + "".join(f"<d:text>{t}</d:text>" for t in texts) + "</d:echo>"
        expect = Expect("echoResponse", texts=texts)
    else:
        raise ValueError(f"unknown size {size!r}: one of {', '.join(SIZES)}")
    envelope = f'<soap:Envelope xmlns:soap="{ns.SOAP11}"><soap:Body>{op}</soap:Body></soap:Envelope>'
    return envelope.encode(), expect


def check_operation(op: etree._Element | None, expect: Expect) -> None:
    """The Body's first element must be the expected answer, with the echoed texts or the row count."""
    if op is None or op.tag != f"{{{DEMO_NS}}}{expect.operation}":
        raise CheckFailed(f"expected d:{expect.operation}, got {None if op is None else op.tag}")
    if expect.operation == "echoResponse":
        texts = tuple(c.text or "" for c in op)
        if texts != expect.texts:
            raise CheckFailed(f"echo differs: {len(texts)} texts back for {len(expect.texts)} sent")
    else:
        rows = sum(1 for c in op if c.tag == f"{{{DEMO_NS}}}quake")
        if rows != expect.count or op.get("count") != str(expect.count):
            raise CheckFailed(f"query returned {rows} rows (count={op.get('count')}), expected {expect.count}")


def _first_child(body: etree._Element | None) -> etree._Element | None:
    if body is None:
        return None
    return next((c for c in body if isinstance(c.tag, str)), None)


def assertion_file(confirmation: str, certs: Path) -> Path:
    """A SAML 2.0 assertion for the demo client (holder-of-key for its certificate, or sender-vouches), as the
    gateway's STS issues them: one per Factory, valid for the run, reused by every message as a client reuses
    its token (the message signatures are what is new each time). Written to a file of its own."""
    issuer = saml_issuer.Issuer(
        SamlTokenService(audience=SAML_AUDIENCE, key=str(certs / "gateway-sign.key"),
                         certificate=str(certs / "gateway-sign.pem"), lifetime_s=SAML_LIFETIME_S)
    )  # fmt: skip
    holder = keys.load_certificate(certs / "client.pem")
    now = datetime.now(UTC)
    identity = saml_issuer.Identity(holder.subject.rfc4514_string(), saml_issuer.NAMEID_X509, saml_issuer.AC_X509, now)
    if confirmation == "holder-of-key":
        assertion = issuer.issue(identity, audience=SAML_AUDIENCE, now=now, confirmation=ns.SAML2_HOLDER_OF_KEY,
                                 holder=holder)  # fmt: skip
    else:
        assertion = issuer.issue(identity, audience=SAML_AUDIENCE, now=now)
    path = Path(tempfile.mkdtemp(prefix="wsgate-saml-")) / "assertion.xml"
    path.write_bytes(etree.tostring(assertion))
    return path


def default_policies() -> Path:
    return Path(os.environ.get("WSGATE_POLICIES", "policies"))


class Factory:
    """Makes the messages of one profile and checks their replies. Not thread-safe; cheap to build."""

    _tags = itertools.count()

    def __init__(
        self,
        profile: Profile | str,
        policies: PolicySet | Path | str | None = None,
        certs: Path | str = pki.DEFAULT_DIR,
        hmac_key: str = HMAC_KEY_NAME,
        context: sc.Context | None = None,
    ) -> None:
        self.profile = PROFILES[profile] if isinstance(profile, str) else profile
        self.client: Client | None = None
        self._prefix = f"{os.getpid():x}{int(time.time() * 1000) % 10**9:x}"
        if not self.profile.secured:
            return
        policy_set = policies if isinstance(policies, PolicySet) else load_dir(policies or default_policies())
        route: Route = policy_set.route(self.profile.route)
        cfg = ClientConfig(certs=Path(certs), key_name=None if hmac_key == ENCRYPTED_KEY else hmac_key)
        if route.profile != "hmac":  # rsa, secureconversation: X.509 (and context keys)
            cfg.key_name = None
        if self.profile.username:
            cfg.user, cfg.password = USER, PASSWORD
        if self.profile.saml:
            cfg.assertion = assertion_file(self.profile.saml, Path(certs))
        self.client = Client(route, cfg)
        self.client.context = context

    @property
    def needs_context(self) -> bool:
        return self.profile.context and (self.client is None or self.client.context is None)

    def establish(self, url: str, verify: str | bool = True) -> sc.Context:
        """secureconversation: get a security context from the gateway at `url` (the route's URL); every message
        made afterwards is secured in it. Messages made in another process with the same context open here."""
        assert self.client is not None
        return self.client.establish(http_post(url, verify=verify))

    @property
    def context(self) -> sc.Context | None:
        return self.client.context if self.client is not None else None

    @property
    def content_type(self) -> str:
        return content_type("1.1")

    def make(self, size: str) -> Message:
        tag = f"{self._prefix}-{next(self._tags)}"
        plain, expect = plain_request(size, tag)
        if self.client is None:
            return Message(plain, expect)
        created = time.time()
        body, pending = self.client.secure(plain)
        return Message(body, expect, pending, created)

    def check(self, status: int, body: bytes, message: Message) -> None:
        """Raise CheckFailed unless `body` is the right, verified answer to `message`."""
        if self.client is not None:
            assert message.pending is not None
            try:
                env = self.client.open(body, message.pending)
            except ClientError as exc:
                raise CheckFailed(f"HTTP {status}: {exc}") from None
            op = _first_child(env.body)
        else:
            try:
                root = etree.fromstring(body, _PARSER)
            except etree.XMLSyntaxError as exc:
                raise CheckFailed(f"HTTP {status}: reply is not XML: {exc.msg}: {body[:200]!r}") from None
            op = _first_child(root.find(f"{{{ns.SOAP11}}}Body"))
        if status != 200:
            raise CheckFailed(f"HTTP {status}: {body[:300]!r}")
        check_operation(op, expect=message.expect)
