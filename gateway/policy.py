"""Policies: YAML files in policies/ -> validated models.

Every file holds `routes:`; each route has a match, an upstream and a security profile with that profile's
options. One file may also hold `edge:`, Envoy's listener settings (timeouts, header limits, trusted proxies). Validation errors name the file, the route and the field. `${VAR:-default}` in a string value is
replaced from the environment, so one policy set serves the local and the Compose topology."""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

Profile = Literal["none", "xml", "tls", "hmac", "rsa", "secureconversation", "saml"]
XML_PROFILES = {"xml", "hmac", "rsa", "secureconversation", "saml"}
SignedPart = Literal["body", "timestamp", "username_token", "addressing"]
SignatureAlgorithm = Literal["rsa-sha256", "rsa-sha1", "hmac-sha256", "hmac-sha1"]
DigestAlgorithm = Literal["sha256", "sha1"]
DataAlgorithm = Literal["aes256-gcm", "aes128-gcm", "aes256-cbc", "aes128-cbc"]
KeyTransport = Literal["rsa-oaep-mgf1p", "rsa-oaep", "rsa-1_5"]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PolicyError(Exception):
    """A policy problem, with the file, the route and the field it is about."""


class FieldError(ValueError):
    """A route-level check's error about one field (dotted path), reported as that field's."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field, self.message = field, message


class Match(Strict):
    path_prefix: str = Field(pattern=r"^/")
    # The exact SOAPAction header value (quotes stripped), or one of several (a WSDL binding's operations).
    soap_action: str | Annotated[list[str], Field(min_length=1)] | None = None

    @property
    def soap_actions(self) -> list[str]:
        return [self.soap_action] if isinstance(self.soap_action, str) else list(self.soap_action or [])


class Upstream(Strict):
    address: str = Field(pattern=r"^[A-Za-z0-9_.\-\[\]:]+:\d{1,5}$")
    tls: bool = False
    ca: str | None = None  # CA bundle to verify the upstream; None with tls: the system's
    sni: str | None = None
    timeout_s: float = Field(default=30.0, gt=0)

    @property
    def host(self) -> str:
        return self.address.rsplit(":", 1)[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])


# Body bytes in flight one filter worker admits (filters/frame/src/budget.rs); `wsgate up --body-budget-mb`.
DEFAULT_BODY_BUDGET_MB = 48
# On SIGTERM a filter worker finishes its in-flight exchanges within this, new ones go to other workers; the
# Kubernetes pods' grace period (gateway/control/kubernetes.py) allows for it.
GRACE_SECONDS = 5.0
# Where the shared Redis is, for every route whose store names none: set by `wsgate up` (its own Redis) or by the
# deployment (Compose, Kubernetes); read by the stores (filters/stores/factory.py).
REDIS_URL_ENV = "WSGATE_REDIS_URL"
# The operation of a verified request (its signed wsa:Action or SOAPAction), set by the filter worker for Envoy's
# rate-limit filter (per-operation quotas); clients cannot send it (x-wsgate-* is stripped on arrival).
OPERATION_HEADER = "x-wsgate-operation"


MAX_BODY_BYTES = 64 * 1024 * 1024  # the largest body limit a policy may set


class Limits(Strict):
    """XML threat protection limits; the defaults are safe for ordinary SOAP traffic."""

    max_body_bytes: int = Field(default=10 * 1024 * 1024, gt=0, le=MAX_BODY_BYTES)
    max_depth: int = Field(default=64, gt=2, le=256)
    max_elements: int = Field(default=200_000, gt=0)
    max_attributes: int = Field(default=32, gt=0)
    max_text_length: int = Field(default=4 * 1024 * 1024, gt=0)  # text, attribute values, namespace names, comments
    # Canonicalizing costs about (elements x namespaces in scope), serializing with inherited namespaces their
    # square (loadtest/hostile.py): real SOAP declares fewer than 30, WS-Security messages 10-15 on the Envelope.
    max_namespace_declarations: int = Field(default=32, gt=0, le=1024)  # on one element
    max_namespaces_in_scope: int = Field(default=32, gt=0, le=1024)  # on an element and its ancestors


HEADER_NAME = r"^[a-z0-9][a-z0-9-]{0,127}$"  # lowercase, no underscore: what Envoy forwards and can strip


class TlsOptions(Strict):
    require_client_certificate: bool = False
    subject_header: str | None = Field(default="x-client-subject", pattern=HEADER_NAME)


class TimestampPolicy(Strict):
    required: bool = True
    clock_skew_s: int = Field(default=300, ge=0)  # how far Created may lie in the future
    max_age_s: int = Field(default=300, gt=0)  # how old Created may be, Expires or not


UsernameTokenProtection = Literal["none", "encrypted", "tls"]


class UsernameTokenPolicy(Strict):
    required: bool = False
    users_file: str | None = None
    password_types: list[Literal["text", "digest"]] = ["digest", "text"]
    # How the token is kept from capture: `encrypted` (WS-SecurityPolicy EncryptedSupportingTokens: an
    # EncryptedData in the Security header, under the key that signs the message), `tls` (the route is served on
    # the HTTPS listener only) or `none`. Route validation refuses `none` where the token would travel readable
    # and be the only credential (see Route._username_token_protected).
    protection: UsernameTokenProtection = "none"
    max_failures: int = Field(default=5, ge=1)  # per username and window, then refused unchecked (auth_throttle)
    failure_window_s: int = Field(default=60, gt=0, le=3600)

    @model_validator(mode="after")
    def _users(self) -> UsernameTokenPolicy:
        if self.required and not self.users_file:
            raise ValueError("users_file is needed when a UsernameToken is required")
        return self


class SignaturePolicy(Strict):
    algorithms: list[SignatureAlgorithm] = ["rsa-sha256", "hmac-sha256"]
    digests: list[DigestAlgorithm] = ["sha256"]
    parts: list[SignedPart] = ["body", "timestamp"]

    @field_validator("parts")
    @classmethod
    def _body_always(cls, parts: list[str]) -> list[str]:
        if "body" not in parts:
            raise ValueError("the Body is always signed: 'body' must be listed")
        return parts


class EncryptionPolicy(Strict):
    require_request: bool = False  # the request Body must arrive encrypted
    encrypt_response: bool = False
    # CBC (for clients without GCM: Metro, older .NET) is off unless listed, and then taken only where it teaches
    # its sender nothing: a key from an EncryptedKey once, any other key under a signature over the ciphertext
    # made with it (filters/engine/wss/wssecurity._check_cbc, docs/interop.md "CBC"); CBC is sent encrypt-then-sign.
    data_algorithms: list[DataAlgorithm] = ["aes256-gcm", "aes128-gcm"]
    key_transport: list[KeyTransport] = ["rsa-oaep-mgf1p", "rsa-oaep"]
    response_algorithm: DataAlgorithm = "aes256-gcm"
    # The reply's ds:Signature encrypted with its Body (sp:EncryptSignature): its digests of the plaintext Body
    # would otherwise let a reader confirm guesses of it. Requests with an encrypted Signature are always taken;
    # none is required to have one: the guessing is the sender's exposure, and refusing after the fact undoes
    # nothing.
    encrypt_signature: bool = False

    @model_validator(mode="after")
    def _signature_with_body(self) -> EncryptionPolicy:
        if self.encrypt_signature and not self.encrypt_response:
            raise ValueError("encrypt_signature needs encrypt_response: the Signature is encrypted with the Body")
        if self.encrypt_signature and self.response_algorithm.endswith("-cbc"):
            raise ValueError("encrypt_signature needs a GCM response_algorithm: CBC is sent encrypt-then-sign")
        return self


class AttachmentSecurity(Strict):
    """WS-Security over SOAP attachments (the SwA profile 1.1; docs/attachments.md). `must_sign`: the Content-Types
    of the attachments a request must have signed ("*/*" all of them, "image/*" a family, "application/pdf" one);
    `headers_signed`: signed with their MIME headers (Attachment-Complete-Signature-Transform), so a part cannot be
    re-labelled; `encrypted`: those attachments must also have arrived encrypted. Replies: `sign_response` signs
    every attachment of a signed reply (with its headers), `encrypt_response` encrypts them (Attachment-Complete)
    where the reply is encrypted (encryption.encrypt_response)."""

    must_sign: list[str] = Field(default=[], max_length=50)
    headers_signed: bool = True
    encrypted: bool = False
    sign_response: bool = False
    encrypt_response: bool = False

    @field_validator("must_sign")
    @classmethod
    def _media_ranges(cls, ranges: list[str]) -> list[str]:
        for r in ranges:
            if not re.fullmatch(r"(\*/\*|[\w.+\-]+/(\*|[\w.+\-]+))", r):
                raise ValueError(f"{r!r} is not a media type or range (type/subtype, type/* or */*)")
        return [r.lower() for r in ranges]

    def must_sign_type(self, content_type: str) -> bool:
        """Whether an attachment of this Content-Type (parameters ignored) must be signed."""
        ranges = self.must_sign
        if "*/*" in ranges:  # the usual policy: no parsing (a generator over the ranges cost 17K instructions)
            return True
        mime = content_type.split(";", 1)[0].strip().lower()
        return mime in ranges or mime.split("/", 1)[0] + "/*" in ranges


class RevocationPolicy(Strict):
    """Whether the signer's certificate and its intermediates are still in good standing (filters/stores/revocation.py).

    `crl`: CRL files (PEM or DER; reloaded when they change); `ocsp`: the responder in `ocsp_responder`, else the
    one in the certificate's Authority Information Access; `both`: either may revoke, one good answer suffices.
    `on_unknown`: what a certificate no source can answer for gets: `fail` (refused) or `allow` (accepted, logged)."""

    mode: Literal["off", "crl", "ocsp", "both"] = "off"
    crl_files: list[str] = []
    ocsp_responder: str | None = Field(default=None, pattern=r"^https?://")
    on_unknown: Literal["fail", "allow"] = "fail"
    # All OCSP requests of one lookup together; the worker waits for them. Within Envoy's 3 s for a filter's answer.
    timeout_s: float = Field(default=1.5, gt=0, le=2)
    max_cache_s: int = Field(default=3600, gt=0, le=7 * 86400)  # an answer is reused at most this long

    @model_validator(mode="after")
    def _sources(self) -> RevocationPolicy:
        if self.mode in ("crl", "both") and not self.crl_files:
            raise ValueError(f"mode {self.mode} needs crl_files")
        if self.mode in ("off", "ocsp") and self.crl_files:
            raise ValueError(f"crl_files are not read with mode {self.mode}")
        return self


def _no_pin(value: str) -> str:
    """A private key is a PEM file or a pkcs11: URI (docs/keys.md); a URI's PIN comes from pin-source (env: or
    file:), never the policy itself."""
    if value.startswith("pkcs11:") and "pin-value" in value:
        raise ValueError("a pkcs11: URI must not hold the PIN (pin-value): use pin-source=env:NAME or file:/path")
    return value


PrivateKeyRef = Annotated[str, AfterValidator(_no_pin)]


class PreviousKey(Strict):
    """A decryption key kept while clients move to the new one (docs/keys.md "Rotation")."""

    key: PrivateKeyRef
    certificate: str  # what picks it: the EncryptedKey's reference names this certificate


class DecryptionKeys(Strict):
    """The current decryption key (`decryption_key`) and the `previous_decryption_keys` still taken. With previous
    keys, an EncryptedKey's key reference (SKI, thumbprint, IssuerSerial, a BinarySecurityToken) picks the key by
    its certificate; `decryption_certificate` is the current key's (None: the .pem beside a key file)."""

    decryption_certificate: str | None = None
    previous_decryption_keys: list[PreviousKey] = []


class RsaOptions(DecryptionKeys):
    trust_anchors: list[str] = ["certs/out/ca.pem"]
    intermediates: list[str] = []  # CA certificates a signer's chain may go through (not trusted by themselves)
    revocation: RevocationPolicy = RevocationPolicy()
    allowed_subjects: list[str] | None = None  # RFC 4514 subject strings; None: any the anchors vouch for
    known_certificates: list[str] = []  # signers named by SKI, thumbprint or IssuerSerial instead of a token
    sign_response: bool = True
    key: PrivateKeyRef = "certs/out/gateway-sign.key"  # signs responses (a PEM file or a pkcs11: URI)
    certificate: str = "certs/out/gateway-sign.pem"
    # The certificate signing switches to on a later reload: published beside `certificate` meanwhile (?wsdl,
    # `wsgate certs published`), never used to sign (docs/keys.md "The signing key").
    next_certificate: str | None = None
    decryption_key: PrivateKeyRef = "certs/out/gateway-enc.key"  # decrypts requests encrypted to us


class HmacOptions(DecryptionKeys):
    keys_file: str | None = "certs/out/hmac-keys.yaml"  # pre-shared keys by name
    # The symmetric binding's key, sent in an EncryptedKey to us, proves only that the sender has our public
    # certificate: a request with no other credential (a pre-shared key, a UsernameToken) is anonymous, and
    # accepted only where the policy says so (the backend is then told `anonymous`).
    allow_anonymous: bool = False
    decryption_key: PrivateKeyRef = (
        "certs/out/gateway-enc.key"  # opens EncryptedKeys (symmetric binding, encrypted parts)
    )
    sign_response: bool = True

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: object) -> object:
        if isinstance(data, dict) and "allow_encrypted_key" in data:
            raise ValueError(
                "allow_encrypted_key was replaced by allow_anonymous: EncryptedKeys are always taken as key carriers; "
                "allow_anonymous says whether one may be the request's only credential"
            )
        return data


HeaderBlockRule = Literal["forward", "strip", "refuse"]


class UnsignedHeaders(Strict):
    """What happens to a SOAP header block the request's signature does not cover (the wsse:Security header
    itself is always removed): `forward` it to the backend, `strip` it (refusing the request when the block is
    mustUnderstand: it cannot be dropped silently), or `refuse` the request. `addressing`: WS-Addressing blocks
    (2004/08 and 2005/08); `default`: every other block."""

    default: HeaderBlockRule = "strip"
    addressing: HeaderBlockRule = "strip"


class ReplayPolicy(Strict):
    """Where seen signature values and nonces are remembered for the timestamp window.

    `auto`: the Redis server `wsgate up` starts for its workers (or WSGATE_REDIS_URL), so a replay is caught
    whichever worker or replica it reaches; `memory` only when one worker serves the route."""

    store: Literal["auto", "memory", "redis"] = "auto"
    redis_url: str | None = None
    max_entries: int = Field(default=1_000_000, gt=0)


class Optimizations(Strict):
    """Signature processing shortcuts (docs/performance.md; `python -m loadtest.optimizations`
    measures each off and on). None decides acceptance: the SignatureValue is always checked over the message's
    own SignedInfo, and whatever the shortcuts cannot confirm goes to xmlsec's full verification.

    Defaults: on where it measured faster on the load test's traffic (fresh Timestamp, ids and nonce per message)."""

    # Reference digests over libxml2's exclusive C14N of the element itself (and xmlsec over the canonical
    # SignedInfo) instead of xmlsec's node-set transforms: 1.1-1.4x per exchange, every size.
    direct_c14n: bool = True
    # van Engelen 2.5: digest the element as received, canonicalize only when that does not match. Our clients'
    # alpha is 0 (namespace declaration order), so it only adds; 1.0x even with a canonical sender (alpha 1).
    on_demand_c14n: bool = False
    # van Engelen Algorithm 1: remember (element serialization hash -> digest) of verified elements. 0% hits
    # with per-message ids; 1.0x even when the same Body comes every time.
    digest_cache: bool = False
    # van Engelen 2.4: the same memo for the responses the gateway signs. 0% hits on echoes, 90% on the
    # repeated 1 MB query result, 1.0x either way: direct C14N costs about what the memo key does.
    prehash: bool = False
    cache_entries: int = Field(default=4096, gt=0, le=1_000_000)  # per cache (digest_cache, prehash) and worker

    @model_validator(mode="after")
    def _direct(self) -> Optimizations:
        if not self.direct_c14n and (self.on_demand_c14n or self.digest_cache or self.prehash):
            raise ValueError("on_demand_c14n, digest_cache and prehash work on direct_c14n: turn it on")
        return self


class SecureConversationOptions(Strict):
    store: Literal["sealed", "memory", "redis"] = "sealed"
    lifetime_s: int = Field(default=3600, gt=0)
    max_contexts: int = Field(default=100_000, gt=0)
    redis_url: str = "redis://127.0.0.1:6379/0"
    master_keys_file: str = "certs/out/sct-master-keys.yaml"
    # WS-SecurityPolicy sp:RequireDerivedKeys. False: messages are signed (and encrypted) with the context's own key,
    # named by a reference to its SCT; inbound, derived keys of the same context are taken as well (docs/secure-conversation.md).
    derived_keys: bool = True


SubjectConfirmation = Literal["bearer", "sender-vouches", "holder-of-key"]


class SamlIssuer(Strict):
    """An identity provider whose assertions a `saml` route takes: its Issuer name, and either its signing
    `certificates` (only these verify) or `trust_anchors` (a certificate the signature's KeyInfo carries must
    chain to one; revocation as `rsa.revocation` says). A certificate in KeyInfo is never trusted for being there."""

    name: str = Field(min_length=1, max_length=1024)
    certificates: list[str] = []
    trust_anchors: list[str] = []
    intermediates: list[str] = []

    @model_validator(mode="after")
    def _one_source(self) -> SamlIssuer:
        if bool(self.certificates) == bool(self.trust_anchors):
            raise ValueError("an issuer needs certificates or trust_anchors (one of them)")
        return self


ATTRIBUTE_HEADER = r"^x-wsgate-[a-z0-9][a-z0-9-]{0,117}$"  # the gateway's prefix: Envoy and the frame drop clients'


class SamlPolicy(Strict):
    """A `saml` route's assertions (SAML Token Profile 1.1, SAML 2.0 and 1.1; docs/saml.md). `confirmation`: the
    subject confirmation methods taken; `attesting_certificates`: who may vouch (sender-vouches); `audiences`: one
    of them must be named by every AudienceRestriction; `attribute_headers`: attribute Name -> header."""

    issuers: Annotated[list[SamlIssuer], Field(min_length=1)]
    confirmation: Annotated[list[SubjectConfirmation], Field(min_length=1)] = ["holder-of-key", "sender-vouches"]
    attesting_certificates: list[str] = []
    audiences: Annotated[list[str], Field(min_length=1)]
    clock_skew_s: int = Field(default=60, ge=0, le=3600)
    max_age_s: int = Field(default=3600, gt=0, le=7 * 86400)  # since IssueInstant
    algorithms: list[Literal["rsa-sha256", "rsa-sha1"]] = ["rsa-sha256"]
    digests: list[DigestAlgorithm] = ["sha256"]
    versions: list[Literal["2.0", "1.1"]] = ["2.0", "1.1"]
    attribute_headers: dict[str, Annotated[str, Field(pattern=ATTRIBUTE_HEADER)]] = {}
    max_attribute_bytes: int = Field(default=1024, gt=0, le=8192)  # all values of one attribute, joined

    @model_validator(mode="after")
    def _vouchers(self) -> SamlPolicy:
        if "sender-vouches" in self.confirmation and not self.attesting_certificates:
            raise ValueError("sender-vouches needs attesting_certificates: who may vouch")
        return self


class WsdlPolicy(Strict):
    """The service's WSDL 1.1, a local file (its imports resolved from files in its directory only, never the
    network: filters/engine/xml/wsdl.py). `publish`: served at the route's path with `?wsdl` (docs/interop.md)."""

    file: str
    publish: bool = False


class SchemaValidation(Strict):
    """Payloads (the Body's children) validated against the WSDL's types and `xsd_files`
    (filters/engine/xml/schema_validation.py): requests after their security is processed, responses before they are
    secured."""

    requests: bool = False
    responses: bool = False
    xsd_files: list[str] = []
    # The CPU one message's validation may take (filters/engine/cpu_budget.py): this much, plus per MB of payload. Plain
    # payloads cost about 5 ms per MB of text, more for dense markup; over the budget is a schema fault.
    cpu_budget_ms: float = Field(default=4.0, gt=0, le=60_000)
    cpu_budget_ms_per_mb: float = Field(default=100.0, ge=0, le=60_000)

    @property
    def enabled(self) -> bool:
        return self.requests or self.responses


class SamlIssuing(Strict):
    """The gateway as a SAML 2.0 issuer (docs/saml.md): its name, the key that signs its assertions (a PEM file or a
    pkcs11: URI), the audience they are for and how long they are valid."""

    issuer: str = Field(default="urn:wsgate:gateway", min_length=1, max_length=1024)
    key: PrivateKeyRef = "certs/out/gateway-sign.key"
    certificate: str = "certs/out/gateway-sign.pem"
    audience: str = Field(min_length=1, max_length=1024)
    lifetime_s: int = Field(default=300, gt=0, le=3600)  # short: the assertion vouches for one exchange


class BackendAssertion(SamlIssuing):
    """A fresh assertion per request for the backend, sender-vouches by the gateway: who called (the verified
    identity), how and when they were authenticated. In a wsse:Security header block of the message the backend
    gets (`security_header`) or base64 in an HTTP header (`http_header`, named by `header`)."""

    placement: Literal["security_header", "http_header"] = "security_header"
    header: str = Field(default="x-wsgate-assertion", pattern=HEADER_NAME)


class SamlTokenService(SamlIssuing):
    """The route's WS-Trust 1.3 endpoint also issues SAML 2.0 assertions (TokenType ...#SAMLV2.0) to callers
    whose Issue request is signed with a trusted certificate: bearer, or holder-of-key for that certificate.
    `audience` is the default; a request's AppliesTo must name it or one of `other_audiences`."""

    confirmations: Annotated[list[Literal["holder-of-key", "bearer"]], Field(min_length=1)] = ["holder-of-key"]
    other_audiences: list[str] = []
    lifetime_s: int = Field(default=3600, gt=0, le=8 * 3600)


ArchiveKeep = Literal["signed_requests", "signed_replies", "refusals"]


class ArchivePolicy(Strict):
    """The non-repudiation archive (docs/audit.md, filters/stores/archive/): what of this route's traffic is kept,
    where, for how long, and what an archive that cannot keep up does to the exchange. Records are chained per
    `stream` and checkpointed with `signing_key`; bodies are encrypted to `body_key_certificate` (its private key,
    held by the auditors, opens them: the gateway cannot read its own archive)."""

    keep: Annotated[list[ArchiveKeep], Field(min_length=1)] = ["signed_requests"]
    store: Literal["segments", "postgres"] = "segments"
    # segments: one directory per stream here; every store: the writers' spools in <directory>/spool (what a killed
    # worker had queued is archived by another: filters/stores/archive/spool.py)
    directory: str = "run/archive"
    # postgres: a libpq DSN; the password from ${VAR} or PGPASSFILE, never written into the policy (kept secret).
    dsn: SecretStr | None = None
    stream: str = Field(default="default", pattern=r"^[a-z0-9][a-z0-9_\-]{0,62}$")
    body_key_certificate: str = "certs/out/gateway-enc.pem"
    signing_key: PrivateKeyRef = "certs/out/gateway-sign.key"  # signs checkpoints (a PEM file or a pkcs11: URI)
    signing_certificate: str = "certs/out/gateway-sign.pem"
    checkpoint_records: int = Field(default=1000, gt=0)  # a signed checkpoint after this many records
    checkpoint_interval_s: float = Field(default=60, gt=0)  # ... or this long, whichever comes first
    retention_days: int = Field(default=3650, gt=0)
    segment_max_mb: int = Field(default=64, gt=0, le=4096)  # segments: rotated at this size or daily
    on_failure: Literal["fail_closed", "alarm"] = "fail_closed"  # the archive down: refuse (503) or pass and count
    queue_size: int = Field(default=10_000, gt=0, le=1_000_000)
    when_full: Literal["refuse", "drop"] = "refuse"  # the queue full: 503, or pass, drop the record and count
    max_record_bytes: int = Field(default=MAX_BODY_BYTES, gt=0, le=MAX_BODY_BYTES)
    oversize: Literal["refuse", "metadata_only"] = "metadata_only"  # a larger message: 413, or kept without its body

    @model_validator(mode="after")
    def _dsn(self) -> ArchivePolicy:
        if (self.store == "postgres") != (self.dsn is not None):
            raise ValueError("dsn is needed with store postgres, and only there")
        return self


XopRule = Literal["keep", "inline"]


class Attachments(Strict):
    """multipart/related messages: MTOM/XOP and SOAP with Attachments (docs/attachments.md). A route takes them only
    where `accept` says so; the limits hold for requests and replies alike, the total is limits.max_body_bytes."""

    accept: bool = False
    max_parts: int = Field(default=8, ge=2, le=1000)  # the root part included
    max_part_header_bytes: int = Field(default=2048, ge=256, le=65536)  # one part's header block
    max_boundary_length: int = Field(default=70, ge=1, le=70)  # RFC 2046's own ceiling is 70
    max_part_bytes: int = Field(default=10 * 1024 * 1024, gt=0, le=MAX_BODY_BYTES)  # one attachment's content
    # Attachments no `cid:` URL in the root part names (xop:Include, an attribute, a swaRef text).
    unreferenced: HeaderBlockRule = "refuse"
    # What the backend gets of an MTOM request: the package as it came (`keep`), or one SOAP envelope with the XOP
    # content inlined as base64 (`inline`); `to_client` is the same for replies.
    to_backend: XopRule = "keep"
    to_client: XopRule = "keep"
    # Envoy streams the package to the filter and takes it back in chunks (cheaper for large documents; the
    # backend and the client get it chunked). False: Envoy buffers it, as other routes' bodies, and the backend
    # gets a Content-Length, which some older SOAP servers insist on (docs/attachments.md).
    streamed: bool = True


class Rate(Strict):
    """Requests allowed per second and per day; either may be left out (docs/quotas.md)."""

    # The rate-limit service reads each limit as a uint32: a larger one fails its whole configuration (every
    # quota-checked request then 503).
    per_second: int | None = Field(default=None, gt=0, le=2**32 - 1)
    per_day: int | None = Field(default=None, gt=0, le=2**32 - 1)

    @model_validator(mode="after")
    def _some(self) -> Rate:
        if self.per_second is None and self.per_day is None:
            raise ValueError("a rate needs per_second, per_day or both")
        return self

    def units(self) -> list[tuple[str, int]]:
        """(the rate-limit service's unit, requests per unit) for each limit set."""
        return [(u, n) for u, n in (("second", self.per_second), ("day", self.per_day)) if n is not None]


class Quotas(Strict):
    """Request quotas, counted by the Envoy rate-limit service across every gateway replica (docs/quotas.md).
    `client_address`: every request, by client address, before any XML work (shapes anonymous floods);
    `caller`: verified requests by the identity the gateway verified (the route's identity_header), counted only
    once the credential is verified; `operations`: the same per operation (SOAPAction, or the signed wsa:Action);
    `backend`: the route's verified requests, every caller together."""

    client_address: Rate | None = None
    caller: Rate | None = None
    operations: dict[Annotated[str, Field(min_length=1, max_length=512)], Rate] = {}
    backend: Rate | None = None

    @property
    def enabled(self) -> bool:
        return any((self.client_address, self.caller, self.operations, self.backend))


# Where an outbound listener without mtls may be: loopback, RFC 1918, IPv6 unique local (not ipaddress's
# is_private, which also counts documentation and reserved ranges).
PRIVATE_NETWORKS = [ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7")]


class OutboundRetry(Strict):
    """Retries of an outbound call that failed on its way (connection refused or reset, no reply, 502/503/504):
    only for the operations named, which the partner defines as idempotent; any other call is tried once."""

    operations: list[str] = []  # SOAPAction values (quotes stripped)
    attempts: int = Field(default=2, ge=1, le=5)  # retries after the first try


class OutboundOptions(Strict):
    """`direction: outbound` (docs/outbound.md): internal applications send plain SOAP to `listen`; the gateway
    secures it as the route's profile says and sends it to the partner (`upstream`: HTTPS, its `ca`), and hands
    back the partner's reply only once it verified. The route's other sections keep their meaning, seen from the
    partner: `encryption.require_request` encrypts the request, `encryption.encrypt_response` requires an
    encrypted reply, `rsa.trust_anchors`/`allowed_subjects` are whom the reply may be signed by, `rsa.key` and
    `rsa.certificate` sign the request, `rsa.decryption_key` opens the reply."""

    # The applications' listener, never the public one: a private or loopback IP, or any with `mtls`.
    listen: str = Field(pattern=r"^[0-9A-Fa-f.:\[\]]+:\d{1,5}$")
    mtls: bool = False  # applications present a certificate from `client_ca` (the listener serves HTTPS)
    client_ca: str = "certs/out/ca.pem"
    server_certificate: str = "certs/out/gateway-tls.pem"  # the listener's, with mtls
    server_key: str = "certs/out/gateway-tls.key"
    partner_certificate: str | None = None  # encrypted to (rsa with encryption; hmac without a key_name)
    client_certificate: str | None = None  # the gateway's TLS client certificate to the partner
    client_key: str | None = None
    key_name: str | None = None  # hmac: the pre-shared key (hmac.keys_file) named to the partner
    # UsernameToken sent to the partner: a YAML file {username: ..., password: ...}; digest or text.
    credentials_file: str | None = None
    password_type: Literal["digest", "text"] = "digest"
    retry: OutboundRetry = OutboundRetry()
    # secureconversation: the partner's STS (WS-Trust Issue) at this path of the partner's address (None: the
    # route's path); its context is shared by all workers and issued anew this long before it expires.
    sts_path: str | None = Field(default=None, pattern=r"^/")
    renew_before_s: int = Field(default=60, ge=1)

    @property
    def host(self) -> str:
        return self.listen.rsplit(":", 1)[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.listen.rsplit(":", 1)[1])

    @model_validator(mode="after")
    def _private(self) -> OutboundOptions:
        try:
            ip = ipaddress.ip_address(self.host)
        except ValueError:
            raise FieldError("outbound.listen", "an IP address (the listener's, not a name)") from None
        if not self.mtls and not (ip.is_loopback or any(ip in net for net in PRIVATE_NETWORKS)):
            raise FieldError(
                "outbound.listen", "without mtls the applications' listener must be a private or loopback address"
            )
        if (self.client_certificate is None) != (self.client_key is None):
            raise FieldError("outbound.client_key", "client_certificate and client_key go together")
        return self


class Route(Strict):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_\-]{0,62}$")
    match: Match
    upstream: Upstream
    profile: Profile
    tls: TlsOptions = TlsOptions()
    limits: Limits = Limits()  # requests, from clients
    response_limits: Limits = Limits()  # responses, from the backend (result sets are larger than requests)
    timestamp: TimestampPolicy = TimestampPolicy()
    username_token: UsernameTokenPolicy = UsernameTokenPolicy()
    signature: SignaturePolicy = SignaturePolicy()
    encryption: EncryptionPolicy = EncryptionPolicy()
    attachment_security: AttachmentSecurity = AttachmentSecurity()
    rsa: RsaOptions = RsaOptions()
    hmac: HmacOptions = HmacOptions()
    secureconversation: SecureConversationOptions = SecureConversationOptions()
    saml: SamlPolicy | None = None  # the `saml` profile's assertions (its message signatures and keys: `rsa`)
    replay: ReplayPolicy = ReplayPolicy()
    optimizations: Optimizations = Optimizations()
    unsigned_headers: UnsignedHeaders = UnsignedHeaders()
    # Who the request is from, for the backend: the X.509 signer's subject, the UsernameToken user, `key:<name>`
    # for a pre-shared key, the context's subject (secureconversation), or `anonymous` (hmac.allow_anonymous).
    identity_header: str | None = Field(default="x-wsgate-subject", pattern=HEADER_NAME)
    secure_faults: bool = True  # sign/encrypt backend faults like other responses
    wsdl: WsdlPolicy | None = None
    schema_validation: SchemaValidation = SchemaValidation()
    backend_assertion: BackendAssertion | None = None  # a signed SAML assertion of the caller for the backend
    saml_token_service: SamlTokenService | None = None  # secureconversation: the STS issues SAML 2.0 too
    archive: ArchivePolicy | None = None
    attachments: Attachments = Attachments()
    quotas: Quotas = Quotas()
    # `inbound`: clients reach the gateway's public listeners; `outbound`: applications reach `outbound.listen`
    # and the gateway secures their calls to a partner (OutboundOptions).
    direction: Literal["inbound", "outbound"] = "inbound"
    outbound: OutboundOptions | None = None

    @property
    def touches_xml(self) -> bool:
        return self.profile in XML_PROFILES

    @property
    def streams_bodies(self) -> bool:
        """Envoy streams this route's bodies to the filter (ext_proc FULL_DUPLEX_STREAMED), else buffers them."""
        return self.touches_xml and self.attachments.accept and self.attachments.streamed

    @property
    def detects_replays(self) -> bool:
        """The WS-Security profiles remember signatures and nonces (filters/engine/wss/replay.py); `xml` has none."""
        return self.touches_xml and self.profile != "xml"

    @property
    def https_only(self) -> bool:
        """Served on the TLS listener only (426 on plain HTTP): `tls` routes, and UsernameTokens kept by TLS. Not
        outbound routes: they have a listener of their own (outbound.mtls), and the partner is always HTTPS."""
        if self.is_outbound:
            return False
        return self.profile == "tls" or (self.accepts_username_tokens and self.username_token.protection == "tls")

    @property
    def accepts_username_tokens(self) -> bool:
        return self.profile in ("hmac", "rsa", "secureconversation") and self.username_token.users_file is not None

    @property
    def is_outbound(self) -> bool:
        return self.direction == "outbound"

    @model_validator(mode="after")
    def _outbound(self) -> Route:
        """An outbound route secures what it sends: a partner reached over TLS, a WS-Security profile."""
        if not self.is_outbound:
            if self.outbound is not None:
                raise FieldError("outbound", "outbound options need direction: outbound")
            return self
        if self.outbound is None:
            raise FieldError("outbound", "direction outbound needs outbound options (listen, ...)")
        if self.profile not in ("rsa", "hmac", "secureconversation"):
            raise FieldError("profile", "an outbound route secures rsa, hmac or secureconversation")
        if not self.upstream.tls:
            raise FieldError("upstream.tls", "the partner is reached over HTTPS only")
        needs_cert = (
            self.encryption.require_request
            or (self.profile == "hmac" and self.outbound.key_name is None)
            or self.profile == "secureconversation"  # the Issue's entropy travels encrypted
        )
        if needs_cert and self.outbound.partner_certificate is None:
            raise FieldError("outbound.partner_certificate", "the request is encrypted to the partner: its certificate")
        if self.profile == "hmac" and self.outbound.key_name and not self.hmac.keys_file:
            raise FieldError("hmac.keys_file", "outbound.key_name names a key from hmac.keys_file")
        return self

    @model_validator(mode="after")
    def _saml_options(self) -> Route:
        if (self.profile == "saml") != (self.saml is not None):
            raise FieldError("saml", "the saml profile needs saml options, and saml options need the saml profile")
        return self

    @model_validator(mode="after")
    def _schema_source(self) -> Route:
        if not self.schema_validation.enabled:
            return self
        if self.wsdl is None and not self.schema_validation.xsd_files:
            raise FieldError("schema_validation", "validation needs a schema: wsdl.file or xsd_files")
        if not self.touches_xml:
            raise FieldError("schema_validation", f"the {self.profile} profile does not read messages: no validation")
        return self

    @model_validator(mode="after")
    def _saml_issuing(self) -> Route:
        """Assertions vouch for a verified caller: the WS-Security profiles have one (tls: docs/saml.md); an
        anonymous hmac caller has none."""
        if self.backend_assertion is not None:
            if not self.detects_replays:
                raise FieldError("backend_assertion", f"the {self.profile} profile verifies no caller to vouch for")
            if self.profile == "hmac" and self.hmac.allow_anonymous:
                raise FieldError("backend_assertion", "an anonymous caller (hmac.allow_anonymous) has no identity")
        if self.saml_token_service is not None and self.profile != "secureconversation":
            raise FieldError("saml_token_service", "the WS-Trust endpoint is on secureconversation routes")
        return self

    @model_validator(mode="after")
    def _archive_reads(self) -> Route:
        if self.archive is not None and not self.touches_xml:
            raise FieldError("archive", f"the {self.profile} profile does not read messages: nothing to archive")
        return self

    @model_validator(mode="after")
    def _quota_identity(self) -> Route:
        """Per-caller quotas count the identity the worker verified and sets in identity_header."""
        q = self.quotas
        field = "quotas.caller" if q.caller else "quotas.operations"
        if (q.caller or q.operations) and not self.detects_replays:
            raise FieldError(field, f"the {self.profile} profile verifies no caller: use client_address or backend")
        if (q.caller or q.operations) and not self.identity_header:
            raise FieldError(field, "per-caller quotas count the identity_header: set one")
        return self

    @model_validator(mode="after")
    def _username_token_protected(self) -> Route:
        """A UsernameToken nobody can capture. PasswordText is a readable password. A readable PasswordDigest
        token can be re-bound: with the symmetric binding (a key anyone can send in an EncryptedKey) it is the
        only credential, and a token read on any route can be sealed by its reader and sent to an `encrypted`
        route. So every route that takes tokens keeps them from capture: `encrypted` or `tls`."""
        ut = self.username_token
        if self.is_outbound or not self.accepts_username_tokens or ut.protection != "none":
            return self
        if "text" in ut.password_types:
            raise FieldError("username_token.protection", "PasswordText needs protection: encrypted or tls")
        if self.profile == "hmac":
            raise FieldError(
                "username_token.protection",
                "on an hmac route (the symmetric binding: a key anyone can send in an EncryptedKey) the UsernameToken "
                "is the only credential: protection must be encrypted or tls",
            )
        raise FieldError(
            "username_token.protection",
            "a readable UsernameToken can be captured and re-bound to another message: protection must be "
            "encrypted or tls",
        )


class Tracing(Strict):
    """OpenTelemetry traces of requests (docs/tracing.md): Envoy's spans and the filter workers' stage spans, sent
    over OTLP/HTTP to `collector` (host:port, e.g. the collector's 4318). `sampling_percent` of the requests Envoy
    starts a trace for; a W3C traceparent is taken only from `trusted_callers` (CIDR ranges of the peer address:
    the proxy in front when there is one), and dropped from anyone else."""

    collector: str = Field(pattern=r"^[A-Za-z0-9_.\-\[\]:]+:\d{1,5}$")
    sampling_percent: float = Field(default=1.0, ge=0, le=100)
    trusted_callers: list[Annotated[str, Field(pattern=r"^[0-9A-Fa-f:.]+/\d{1,3}$")]] = []


class Edge(Strict):
    """Envoy's per-listener settings (both listeners), against slow and lying clients. At most one policy file
    sets `edge:`; the defaults hold without it."""

    # From the first byte of a request's headers to their end; a connection that dribbles headers is closed.
    request_headers_timeout_s: float = Field(default=10, gt=0, le=300)
    # From the first byte to the whole request received and processed (ext_proc included): bounds a slow body.
    request_timeout_s: float = Field(default=60, gt=0, le=3600)
    # No byte either way on a stream (also while the backend thinks: must exceed every route's upstream timeout).
    stream_idle_timeout_s: float = Field(default=60, gt=0, le=3600)
    # A connection with no request in flight (keep-alive, or opened and silent).
    connection_idle_timeout_s: float = Field(default=60, gt=0, le=3600)
    max_request_headers_kb: int = Field(default=60, ge=1, le=8192)  # request line and headers together
    max_headers_count: int = Field(default=100, ge=1, le=1000)
    # Proxies in front of the gateway whose x-forwarded-for/-proto are believed; 0: the client is the peer and
    # every x-forwarded-* / forwarded header it sends is dropped, Envoy writes its own.
    xff_num_trusted_hops: int = Field(default=0, ge=0, le=10)
    # The gateway's URL as clients reach it (scheme, host, port; no path), written into published WSDLs. Never
    # the request's Host header (the client chooses it). None: the listener's own address (docs/interop.md).
    public_url: str | None = Field(default=None, pattern=r"^https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-]+)(:\d{1,5})?$")
    tracing: Tracing | None = None  # off unless set


class PolicyFile(Strict):
    routes: Annotated[list[Route], Field(min_length=1)]
    edge: Edge | None = None


class PolicySet(Strict):
    """All routes of a policies directory, in a deterministic order (file name, then order in the file)."""

    routes: list[Route]
    sources: dict[str, str]  # route name -> file it came from
    edge: Edge = Edge()

    def route(self, name: str) -> Route:
        for r in self.routes:
            if r.name == name:
                return r
        raise KeyError(name)


def check_body_budget(policies: PolicySet, budget_bytes: int) -> PolicySet:
    """Refuse policies with a route whose one body would not fit a filter worker's budget: it would only ever
    answer `busy`. An exchange holds one body at a time (its request, then its response)."""
    for r in policies.routes:
        largest = max(r.limits.max_body_bytes, r.response_limits.max_body_bytes)
        if r.touches_xml and largest > budget_bytes:
            raise PolicyError(
                f"{policies.sources[r.name]}: route {r.name}: bodies of up to {largest} bytes do not fit the filter "
                f"workers' body budget of {budget_bytes} bytes (--body-budget-mb)"
            )
    return policies


_ENV = re.compile(r"\$\{([A-Z_][A-Z0-9_]*)(?::-([^}]*))?\}")


def _interpolate(value: object) -> object:
    if isinstance(value, str):

        def sub(m: re.Match[str]) -> str:
            got = os.environ.get(m.group(1))
            if got is None:
                if m.group(2) is None:
                    raise PolicyError(f"environment variable {m.group(1)} is not set")
                return m.group(2)
            return got

        return _ENV.sub(sub, value)
    if isinstance(value, list):
        return [_interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: _interpolate(v) for k, v in value.items()}
    return value


def _describe(err: ValidationError, doc: object, path: Path) -> str:
    lines = []
    for e in err.errors():
        loc = list(e["loc"])
        where = f"{path}"
        if len(loc) >= 2 and loc[0] == "routes" and isinstance(loc[1], int):
            idx = loc[1]
            name = None
            if isinstance(doc, dict) and isinstance(doc.get("routes"), list) and idx < len(doc["routes"]):
                item = doc["routes"][idx]
                name = item.get("name") if isinstance(item, dict) else None
            where += f": route {name or f'#{idx + 1}'}"
            loc = loc[2:]
        field, msg = ".".join(str(x) for x in loc) or "(route)", e["msg"]
        error = e.get("ctx", {}).get("error")
        if isinstance(error, FieldError):
            field, msg = ".".join(filter(None, [field if loc else "", error.field])), error.message
        lines.append(f"{where}: field {field}: {msg}")
    return "\n".join(lines)


def load_file(path: Path) -> PolicyFile:
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise PolicyError(f"{path}: not valid YAML: {exc}") from None
    try:
        doc = _interpolate(doc)
    except PolicyError as exc:
        raise PolicyError(f"{path}: {exc}") from None
    try:
        return PolicyFile.model_validate(doc)
    except ValidationError as err:
        raise PolicyError(_describe(err, doc, path)) from None


def load_dir(directory: Path | str, documents: Callable[[Route], list[str]] | None = None) -> PolicySet:
    """`documents`: the errors of the files a route names (WSDL, XSD), as the control plane reads them
    (gateway/control/documents.py); the model itself reads no document."""
    directory = Path(directory)
    files = sorted(p for p in directory.glob("*.y*ml") if p.suffix in (".yaml", ".yml"))
    if not files:
        raise PolicyError(f"{directory}: no policy files (*.yaml)")
    routes: list[Route] = []
    sources: dict[str, str] = {}
    errors: list[str] = []
    edge, edge_source = Edge(), None
    for path in files:
        try:
            pf = load_file(path)
        except PolicyError as exc:
            errors.append(str(exc))
            continue
        if pf.edge is not None:
            if edge_source is not None:
                errors.append(f"{path}: field edge: already set in {edge_source}")
            edge, edge_source = pf.edge, str(path)
        for r in pf.routes:
            if r.name in sources:
                errors.append(f"{path}: route {r.name}: field name: already defined in {sources[r.name]}")
                continue
            sources[r.name] = str(path)
            routes.append(r)
    seen: dict[tuple[str, str, str | None], str] = {}
    for r in routes:
        for action in r.match.soap_actions or [None]:
            # Envoy matches prefixes ignoring case; outbound routes have their own listeners.
            key = (r.outbound.listen if r.outbound else "", r.match.path_prefix.lower(), action)
            if key in seen and seen[key] != r.name:
                errors.append(f"{sources[r.name]}: route {r.name}: field match: same match as route {seen[key]}")
            seen[key] = r.name
        if r.upstream.timeout_s >= edge.stream_idle_timeout_s:
            errors.append(
                f"{sources[r.name]}: route {r.name}: field upstream.timeout_s: {r.upstream.timeout_s:g} s is not below "
                f"edge.stream_idle_timeout_s ({edge.stream_idle_timeout_s:g} s): the stream would idle out first"
            )
    if edge.public_url and edge.public_url.startswith("http:"):
        errors += [
            f"{sources[r.name]}: route {r.name}: field wsdl.publish: served over HTTPS only, but edge.public_url is "
            "http: the published address would not work"
            for r in routes
            if r.wsdl and r.wsdl.publish and r.https_only
        ]
    if documents is not None:
        errors += [f"{sources[r.name]}: route {r.name}: {e}" for r in routes for e in documents(r)]
    if errors:
        raise PolicyError("\n".join(errors))
    return PolicySet(routes=routes, sources=sources, edge=edge)
