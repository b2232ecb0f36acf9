"""Locust load for WSGate: one user class per profile, every response checked.

    make load URL=http://127.0.0.1:8080 USERS=20 TIME=30s [SIZE=small,large] [PROFILES="HmacUser RsaUser"]
    .venv/bin/locust -f loadtest/locustfile.py            # the web UI, http://127.0.0.1:8089

User classes (routes of policies/demo.yaml, or of WSGATE_POLICIES): PlainUser (none, /plain/), TlsUser (tls,
HTTPS on the 8443 listener, verified against certs/out/ca.pem), XmlUser (xml), HmacUser (hmac), HmacEncryptedUser
(hmac-encrypted: hmac with AES-GCM both ways), RsaUser (rsa: X.509 signatures both ways), RsaEncryptedUser (rsa-encrypted: signed and encrypted both ways), UsernameUser
(username: UsernameToken, PasswordDigest, signed with HMAC and encrypted under the signing key),
SecureConversationUser (sc: messages in a WS-SecureConversation context, established once per Locust process before
the test starts).

Sizes, one task each, tagged: small (echo, ~1 KB request), large (echo, ~30 KB request), huge (query of 3500
rows, ~1 MB response). `--tags large huge` picks sizes; without tags, LOAD_SIZE (comma-separated, default
"small") does.

Secured requests come from gateway.tools.client.Client, made ahead of time into a pool per profile and size (so
sending is cheap) and topped up by a background greenlet. Each message is distinct (its own Timestamp, ids,
nonce, signature) and sent once, so the gateway's replay cache sees real traffic. Every reply is checked: a
secured one is verified and decrypted by Client.open, and the echoed texts (or the query's row count) must be
what was sent. A reply that fails is a Locust failure.

Environment: LOAD_SIZE; LOAD_TLS_URL (default: the host with https and port 8443); LOAD_POOL (messages kept
ready per profile and size, default 200); LOAD_HMAC_KEY (hmac/username signing key: a pre-shared key name,
default demo-client, or "encrypted-key" for a fresh key per message in an EncryptedKey); LOAD_USER_RPS (per
user; default: no wait); WSGATE_POLICIES (default policies); WSGATE_CERTS (default certs/out)."""

from __future__ import annotations

import collections
import logging
import os
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import gevent
import gevent.ssl
from locust import FastHttpUser, constant, constant_throughput, events, tag, task
from locust.env import Environment
from locust.runners import MasterRunner

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `locust -f loadtest/locustfile.py` from a checkout
    sys.path.insert(0, str(ROOT))

from gateway.policy import PolicyError, PolicySet, load_dir  # noqa: E402
from loadtest.messages import (  # noqa: E402
    HMAC_KEY_NAME,
    PROFILES,
    SIZES,
    CheckFailed,
    Factory,
    Message,
    default_policies,
)

log = logging.getLogger("wsgate.load")

CERTS = Path(os.environ.get("WSGATE_CERTS", "certs/out"))
POOL_SIZE = int(os.environ.get("LOAD_POOL", "200"))
HMAC_KEY = os.environ.get("LOAD_HMAC_KEY", HMAC_KEY_NAME)
MAX_AGE_S = 240  # a pooled message older than this is dropped: the gateway accepts Timestamps up to 300 s old
HEADERS = {"content-type": "text/xml; charset=utf-8"}


def selected_sizes() -> list[str]:
    sizes = [s.strip() for s in os.environ.get("LOAD_SIZE", "small").split(",") if s.strip()]
    unknown = set(sizes) - set(SIZES)
    if unknown:
        raise ValueError(f"LOAD_SIZE: unknown size(s) {', '.join(sorted(unknown))}: use {', '.join(SIZES)}")
    return sizes


def tls_url(host: str) -> str:
    """The HTTPS listener's URL: LOAD_TLS_URL, or `host` with https and port 8443 (8080's sibling)."""
    if os.environ.get("LOAD_TLS_URL"):
        return os.environ["LOAD_TLS_URL"].rstrip("/")
    parts = urlsplit(host)
    hostname = parts.hostname or "127.0.0.1"
    port = 8443 if parts.port in (None, 8080) else parts.port
    return urlunsplit(("https", f"{hostname}:{port}", "", "", "")).rstrip("/")


# ---- pools of ready messages


_policies: PolicySet | None = None


def policies() -> PolicySet | None:
    global _policies
    if _policies is None:
        try:
            _policies = load_dir(default_policies())
        except PolicyError as exc:
            log.warning("no policies (%s): plain routes use /<route>/demo", exc)
            return None
    return _policies


def route_path(profile: str) -> str:
    """The URL path of a profile's route: its path prefix in the policies, then `demo`."""
    route = PROFILES[profile].route
    ps = policies()
    prefix = ps.route(route).match.path_prefix if ps and route in {r.name for r in ps.routes} else f"/{route}/"
    return f"{prefix}demo"


def base_url(profile: str, host: str) -> str:
    return tls_url(host) if PROFILES[profile].tls else host.rstrip("/")


class Pool:
    """Ready messages of one profile and size; a greenlet keeps `target` of them, made in the background."""

    pools: dict[tuple[str, str], Pool] = {}
    factories: dict[str, Factory] = {}

    def __init__(self, profile: str, size: str, target: int, host: str) -> None:
        self.factory = Pool.factory(profile, host)
        self.profile, self.size, self.target = profile, size, target
        self.items: collections.deque[Message] = collections.deque()
        self.made = self.inline = self.stale = 0
        self.greenlet: gevent.Greenlet | None = None

    @classmethod
    def factory(cls, profile: str, host: str) -> Factory:
        """One per profile and process; for secureconversation, with a context established at the gateway."""
        if profile not in cls.factories:
            factory = Factory(profile, policies(), certs=CERTS, hmac_key=HMAC_KEY)
            if factory.needs_context:
                url = base_url(profile, host) + route_path(profile)
                ctx = factory.establish(url, verify=str(CERTS / "ca.pem"))
                log.info("%s: context %s established at %s", profile, ctx.identifier[:40], url)
            cls.factories[profile] = factory
        return cls.factories[profile]

    @classmethod
    def get(cls, profile: str, size: str, host: str) -> Pool:
        pool = cls.pools.get((profile, size))
        if pool is None:
            pool = cls.pools[(profile, size)] = Pool(profile, size, POOL_SIZE, host)
            pool.start()
        return pool

    def start(self) -> None:
        # Plain profiles need no pool to speak of: their messages cost microseconds.
        if self.factory.client is not None and self.greenlet is None:
            self.greenlet = gevent.spawn(self._refill)

    def fill(self, count: int) -> None:
        for _ in range(count):
            self.items.append(self.factory.make(self.size))
            self.made += 1

    def _refill(self) -> None:
        while True:
            while self.items and time.time() - self.items[0].created > MAX_AGE_S:
                self.items.popleft()
                self.stale += 1
            if len(self.items) < self.target:
                self.fill(1)
                gevent.sleep(0)  # one message at a time: the users' requests go on meanwhile
            else:
                gevent.sleep(0.05)

    def take(self) -> Message:
        if self.items:
            return self.items.popleft()
        if self.factory.client is not None:
            self.inline += 1  # the pool ran dry: made while the user waits (see the summary at the end)
        self.made += 1
        return self.factory.make(self.size)

    def stop(self) -> None:
        if self.greenlet is not None:
            self.greenlet.kill(block=False)
            self.greenlet = None


# ---- user classes


class WsgateUser(FastHttpUser):
    """Sends one profile's messages of the selected sizes; checks every reply."""

    abstract = True
    profile = "none"
    host = "http://127.0.0.1:8080"
    wait_time = constant_throughput(float(os.environ["LOAD_USER_RPS"])) if os.environ.get("LOAD_USER_RPS") else constant(0)  # fmt: skip
    network_timeout = 60.0
    connection_timeout = 10.0

    def on_start(self) -> None:
        self._path = route_path(self.profile)

    def send(self, size: str) -> None:
        pool = Pool.get(self.profile, size, self.environment.host or WsgateUser.host)
        message = pool.take()
        with self.client.post(self._path, data=message.body, headers=HEADERS, name=f"{self.profile} {size}",
                              catch_response=True) as resp:  # fmt: skip
            try:
                pool.factory.check(resp.status_code, resp.content or b"", message)
            except CheckFailed as exc:
                resp.failure(str(exc))
            else:
                resp.success()

    @tag("small")
    @task
    def small(self) -> None:
        self.send("small")

    @tag("large")
    @task
    def large(self) -> None:
        self.send("large")

    @tag("huge")
    @task
    def huge(self) -> None:
        self.send("huge")


def _tls_context(**_: object) -> gevent.ssl.SSLContext:
    return gevent.ssl.create_default_context(cafile=str(CERTS / "ca.pem"))


class PlainUser(WsgateUser):
    profile = "none"


class TlsUser(WsgateUser):
    profile = "tls"
    insecure = False
    ssl_context_factory = staticmethod(_tls_context)

    def __init__(self, environment: Environment) -> None:
        self.host = tls_url(environment.host or type(self).host)  # FastHttpUser.__init__ reads self.host
        super().__init__(environment)


class XmlUser(WsgateUser):
    profile = "xml"


class XmlSchemaUser(WsgateUser):
    profile = "xml-schema"


class HmacUser(WsgateUser):
    profile = "hmac"


class HmacEncryptedUser(WsgateUser):
    profile = "hmac-encrypted"


class RsaUser(WsgateUser):
    profile = "rsa"


class RsaEncryptedUser(WsgateUser):
    profile = "rsa-encrypted"


class UsernameUser(WsgateUser):
    profile = "username"


class SamlSenderVouchesUser(WsgateUser):
    profile = "saml-sender-vouches"


class SamlHolderOfKeyUser(WsgateUser):
    profile = "saml-holder-of-key"


class SecureConversationUser(WsgateUser):
    """Messages in one WS-SecureConversation context per Locust process (established before the test)."""

    profile = "secureconversation"


# ---- events


def _user_profiles(environment: Environment) -> list[str]:
    return [u.profile for u in environment.user_classes if issubclass(u, WsgateUser)]


def _sizes(environment: Environment) -> list[str]:
    tags = environment.tags or getattr(environment.parsed_options, "tags", None) or []
    return [s for s in SIZES if s in tags] or selected_sizes()


@events.init.add_listener
def _on_init(environment: Environment, **_: object) -> None:
    if not (environment.tags or getattr(environment.parsed_options, "tags", None)):
        environment.tags = selected_sizes()  # Locust drops the tasks of the other sizes when the test starts


@events.test_start.add_listener
def _on_test_start(environment: Environment, **_: object) -> None:
    if isinstance(environment.runner, MasterRunner):
        return  # the workers make and send the messages
    sizes = _sizes(environment)
    host = environment.host or WsgateUser.host
    started = time.perf_counter()
    made = 0
    for profile in _user_profiles(environment):
        for size in sizes:
            pool = Pool.pools.get((profile, size)) or Pool(profile, size, POOL_SIZE, host)
            Pool.pools[(profile, size)] = pool
            if pool.factory.client is not None:
                # A first batch before the users start; the greenlet makes the rest while they run.
                count = max(0, min(POOL_SIZE, 50 if size == "huge" else POOL_SIZE // 2) - len(pool.items))
                pool.fill(count)
                made += count
            pool.start()
    log.info("pools ready: %d messages made in %.1f s (sizes %s)", made, time.perf_counter() - started, sizes)


@events.test_stop.add_listener
def _on_test_stop(environment: Environment, **_: object) -> None:
    for (profile, size), pool in sorted(Pool.pools.items()):
        pool.stop()
        if pool.factory.client is not None:
            log.info("pool %s %s: %d made, %d made inline (pool empty), %d dropped as stale, %d left",
                     profile, size, pool.made, pool.inline, pool.stale, len(pool.items))  # fmt: skip
