"""Routes, clients and pipelines for WS-Security tests, on the session's demo PKI."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from cryptography.x509.oid import NameOID

from certs import hsm
from filters.engine.engine import Exchange
from filters.engine.profiles import SecuredPipeline
from gateway.policy import Route
from gateway.tools.client import Client, ClientConfig

DEMO = "urn:wsgate:demo"
# Places the gateway's private keys in a route doc: as they are (files) or in a token (the `gateway_keys` fixture).
Keys = Callable[[dict[str, Any]], dict[str, Any]]


def route_doc(pki: Path, profile: str, name: str = "secured", **extra: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "name": name,
        "match": {"path_prefix": f"/{name}/"},
        "upstream": {"address": "BACKEND"},
        "profile": profile,
        "replay": {"store": "memory"},
        "rsa": {
            "trust_anchors": [str(pki / "ca.pem")],
            "key": str(pki / "gateway-sign.key"),
            "certificate": str(pki / "gateway-sign.pem"),
            "decryption_key": str(pki / "gateway-enc.key"),
        },
        "hmac": {
            "keys_file": str(pki / "hmac-keys.yaml"),
            "decryption_key": str(pki / "gateway-enc.key"),
            # Most tests exercise the symmetric binding on its own; the refusal of anonymous requests is tested
            # with allow_anonymous false (tests/threats/test_signed_content_threats.py).
            "allow_anonymous": True,
        },
    }
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(doc.get(k), dict):
            doc[k] = {**doc[k], **v}
        else:
            doc[k] = v
    return doc


def with_token_keys(doc: dict[str, Any], token_dir: Path) -> dict[str, Any]:
    """A route doc (route_doc's) with every private key of the gateway in the token `certs.hsm.init` made."""
    return {**doc, "rsa": {**doc["rsa"], "key": hsm.uri(token_dir, "gateway-sign"),
                           "decryption_key": hsm.uri(token_dir, "gateway-enc")},
            "hmac": {**doc["hmac"], "decryption_key": hsm.uri(token_dir, "gateway-enc")}}  # fmt: skip


def token_route(pki: Path, token_dir: Path, profile: str, name: str = "secured", **extra: object) -> dict:
    """route_doc with every private key in the token."""
    return with_token_keys(route_doc(pki, profile, name=name, **extra), token_dir)


def make_route(pki: Path, profile: str, keys: Keys = lambda doc: doc, **extra: Any) -> Route:
    """route_doc as a Route; `keys` places the gateway's keys (the `gateway_keys` fixture: files or the token)."""
    doc = keys(route_doc(pki, profile, **extra))
    doc["upstream"] = {"address": "127.0.0.1:1"}
    return Route.model_validate(doc)


def client_for(route: Route, pki: Path, **cfg: Any) -> Client:
    return Client(route, ClientConfig(certs=pki, **cfg))


def echo(text: str = "hello", version: str = "1.1") -> bytes:
    soap = (
        "http://www.w3.org/2003/05/soap-envelope" if version == "1.2" else "http://schemas.xmlsoap.org/soap/envelope/"
    )
    return (
        f'<soap:Envelope xmlns:soap="{soap}"><soap:Body><d:echo xmlns:d="{DEMO}"><d:text>{text}</d:text></d:echo>'
        "</soap:Body></soap:Envelope>"
    ).encode()


def echo_response(plain_request: bytes) -> bytes:
    """What the demo backend answers to echo(): the same envelope with echoResponse."""
    return plain_request.replace(b"d:echo ", b"d:echoResponse ").replace(b"</d:echo>", b"</d:echoResponse>")


def round_trip(pipeline: SecuredPipeline, client: Client, plain: bytes) -> tuple[bytes, bytes]:
    """(what the backend got, what the client read) for one exchange through the gateway's engine."""
    secured, pending = client.secure(plain)
    ex = Exchange(route=pipeline.route)
    backend_got = pipeline.request(secured, {}, ex).body
    assert backend_got is not None
    reply = pipeline.response(echo_response(backend_got), ex).body
    assert reply is not None
    return backend_got, client.open(reply, pending).serialize()


def eddsa_certificate(path: Path) -> Path:
    """A self-signed Ed25519 certificate: a key of no size and no numbers (the engine's keys are RSA)."""
    key = ed25519.Ed25519PrivateKey.generate()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "EdDSA")])
    now = datetime.now(UTC)
    cert = (
        x509.CertificateBuilder(name, name, key.public_key(), x509.random_serial_number(), now, now + timedelta(days=1))
        .sign(key, None)
    )  # fmt: skip
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path
