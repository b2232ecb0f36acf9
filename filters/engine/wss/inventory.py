"""Every key and certificate a route uses, for `wsgate keys list`, `wsgate check`'s expiry warnings and the
metric wsgate_certificate_not_after_seconds{route,use}.

Uses: `signing` (rsa.key and rsa.certificate), `next_signing` (rsa.next_certificate), `decryption` (rsa/hmac.decryption_key; its certificate is the
`.pem` beside a key file when it holds the same public key: the policy does not name it), `trust_anchor`,
`intermediate`, `known_signer`, `hmac_keys` (hmac.keys_file), `master_keys` (secureconversation), `saml_signing`
(the key and certificate of backend_assertion and saml_token_service)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import dsa, ec, rsa

from filters.engine import faults
from filters.engine.wss import keys, token
from gateway.policy import Route

EXPIRY_WARNING = dt.timedelta(days=30)


@dataclass(frozen=True)
class Item:
    use: str
    source: str  # a path or a pkcs11: URI (which names where the PIN is, never the PIN)
    kind: str  # file | token
    algorithm: str  # RSA, HMAC, AES-GCM, or why it could not be read
    size: int | None  # bits; for a key file of many keys, how many
    certificate: x509.Certificate | None = None


def _key(use: str, source: str, certificate: x509.Certificate | None, load: bool) -> Item:
    kind = "token" if token.is_uri(source) else "file"
    if not load:
        return Item(use, source, kind, "RSA", None, certificate)
    try:
        key = keys.load_private_key(source)
        size = key.key_size  # a token key's public half: read from its token
    except (OSError, ValueError, faults.Fault) as exc:
        reason = exc.reason if isinstance(exc, faults.Fault) else f"{type(exc).__name__}: {exc}"
        return Item(use, source, kind, f"unavailable ({reason})", None, certificate)
    if certificate is None and kind == "file":
        certificate = _beside(Path(source), key)
    return Item(use, source, kind, "RSA", size, certificate)


def _beside(path: Path, key: rsa.RSAPrivateKey) -> x509.Certificate | None:
    pem = path.with_suffix(".pem")
    try:
        cert = keys.load_certificate(pem)
    except (OSError, ValueError):
        return None
    public = cert.public_key()
    if not isinstance(public, rsa.RSAPublicKey):  # another kind of key (an EdDSA one has no numbers to compare)
        return None
    return cert if public.public_numbers() == key.public_key().public_numbers() else None


def _certificate(path: str | None) -> x509.Certificate | None:
    try:
        return keys.load_certificate(path) if path else None
    except (OSError, ValueError):
        return None


def _certificates(use: str, paths: list[str]) -> list[Item]:
    out = []
    for path in paths:
        try:
            certs = keys.load_certificates([path])
        except (OSError, ValueError) as exc:
            out.append(Item(use, path, "file", f"unavailable ({type(exc).__name__})", None))
            continue
        out += [Item(use, path, "file", "X.509", _key_size(c), c) for c in certs]
    return out


def _key_size(cert: x509.Certificate) -> int | None:
    """Bits of the certificate's key; None for the kinds that name no size (EdDSA, X25519...)."""
    public = cert.public_key()
    if isinstance(public, rsa.RSAPublicKey | ec.EllipticCurvePublicKey | dsa.DSAPublicKey):
        return public.key_size
    return None


def _secrets(use: str, path: str, algorithm: str) -> Item:
    try:
        doc = yaml.safe_load(Path(path).read_text())
        count = len(doc["keys"])
    except (OSError, yaml.YAMLError, KeyError, TypeError) as exc:
        return Item(use, path, "file", f"unavailable ({type(exc).__name__})", None)
    return Item(use, path, "file", algorithm, count)


def route_items(route: Route, load_keys: bool = True) -> list[Item]:
    """What `route` uses. `load_keys`: read private keys for their size (a token key needs its token);
    without, certificates only are read."""
    items: list[Item] = []
    x509_signer = route.profile in ("rsa", "secureconversation")
    if x509_signer:
        items.append(_key("signing", route.rsa.key, _certificate(route.rsa.certificate), load_keys))
        items += _certificates("next_signing", [route.rsa.next_certificate] if route.rsa.next_certificate else [])
    if route.profile in ("rsa", "secureconversation", "hmac"):
        decryption = route.hmac.decryption_key if route.profile == "hmac" else route.rsa.decryption_key
        opts = route.hmac if route.profile == "hmac" else route.rsa
        if keys.private_key_available(decryption):
            items.append(_key("decryption", decryption, _certificate(opts.decryption_certificate), load_keys))
        items += [
            _key("decryption", p.key, _certificate(p.certificate), load_keys) for p in opts.previous_decryption_keys
        ]
    if x509_signer:
        items += _certificates("trust_anchor", route.rsa.trust_anchors)
        items += _certificates("intermediate", route.rsa.intermediates)
        items += _certificates("known_signer", route.rsa.known_certificates)
    if route.profile == "hmac" and route.hmac.keys_file:
        items.append(_secrets("hmac_keys", route.hmac.keys_file, "HMAC"))
    if route.profile == "secureconversation":
        items.append(_secrets("master_keys", route.secureconversation.master_keys_file, "AES-GCM"))
    issuing = [p for p in (route.backend_assertion, route.saml_token_service) if p is not None]
    items += [_key("saml_signing", p.key, _certificate(p.certificate), load_keys) for p in issuing]
    return items


def expiry_problems(items: list[Item], now: dt.datetime) -> tuple[list[str], list[str]]:
    """(errors: certificates expired or not yet valid, warnings: expiring within EXPIRY_WARNING)."""
    errors, warnings = [], []
    for item in items:
        cert = item.certificate
        if cert is None:
            continue
        what = f"{item.use} certificate {cert.subject.rfc4514_string()!r} ({item.source})"
        if cert.not_valid_after_utc <= now:
            errors.append(f"{what} expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC")
        elif cert.not_valid_before_utc > now:
            errors.append(f"{what} is not valid before {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC")
        elif cert.not_valid_after_utc - now <= EXPIRY_WARNING:
            days = (cert.not_valid_after_utc - now).days
            warnings.append(f"{what} expires in {days} days, on {cert.not_valid_after_utc:%Y-%m-%d} UTC")
    return errors, warnings
