"""The demo PKI, made with `cryptography`: `wsgate certs init`.

Everything lands in a git-ignored folder (certs/out by default); no private key is ever committed.

| file | what |
|---|---|
| ca.pem / ca.key | the demo CA: trust anchor for client and gateway certificates |
| gateway-tls.pem / .key | Envoy's TLS server certificate (localhost, 127.0.0.1) |
| gateway-sign.pem / .key | signs responses (`rsa`) |
| gateway-enc.pem / .key | clients encrypt requests and symmetric keys to it |
| client.pem / .key | a client: signs requests, decrypts responses, TLS client certificate |
| client2.pem / .key | a second trusted client, for allow-lists |
| rogue-ca.pem, rogue.pem / .key | a client from a CA the gateway does not trust |
| hmac-keys.yaml | pre-shared HMAC keys by name |
| users.yaml | UsernameToken users: salted hashes, digest-capable entries where PasswordDigest needs them |
| sct-master-keys.yaml | master keys that seal SecureConversation contexts |
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import ipaddress
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_DIR = Path("certs/out")
DEMO_USERS = {"alice": "alice-demo-password", "bob": "bob-demo-password"}


@dataclass(frozen=True)
class Issued:
    key: rsa.RSAPrivateKey
    cert: x509.Certificate


def _name(cn: str, org: str = "WSGate Demo") -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, org), x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def make_ca(cn: str, days: int = 3650) -> Issued:
    key = _key()
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(_name(cn))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Issued(key, cert)


def issue(
    ca: Issued,
    cn: str,
    *,
    server_names: list[str] | None = None,
    client_auth: bool = False,
    days: int = 825,
    not_before: dt.datetime | None = None,
) -> Issued:
    """An end-entity certificate signed by `ca`; SANs make it a TLS server certificate."""
    key = _key()
    start = not_before or dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(True, True, True, False, False, False, False, False, False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False)
    )
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH] if client_auth or not server_names else []
    if server_names:
        usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
        sans: list[x509.GeneralName] = []
        for n in server_names:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(n)))
            except ValueError:
                sans.append(x509.DNSName(n))
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    return Issued(key, builder.sign(ca.key, hashes.SHA256()))


def _write(out: Path, stem: str, issued: Issued) -> None:
    (out / f"{stem}.pem").write_bytes(issued.cert.public_bytes(serialization.Encoding.PEM))
    key_path = out / f"{stem}.key"
    key_path.write_bytes(
        issued.key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    key_path.chmod(0o600)


def hash_password(password: str, salt: bytes | None = None) -> str:
    """A salted scrypt hash for PasswordText users: scrypt$n$r$p$salt$hash (base64)."""
    salt = salt or os.urandom(16)
    n, r, p = 2**14, 8, 1
    digest = hashlib.scrypt(password.encode(), salt=salt, n=n, r=r, p=p, dklen=32)
    return f"scrypt${n}${r}${p}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def init(out: Path = DEFAULT_DIR, force: bool = False) -> Path:
    """Make the demo PKI in `out` unless it is already there (or `force`). Returns `out`."""
    out = Path(out)
    if (out / "ca.pem").exists() and not force:
        return out
    out.mkdir(parents=True, exist_ok=True)
    (out / ".gitignore").write_text("*\n")
    ca = make_ca("WSGate Demo CA")
    _write(out, "ca", ca)
    _write(out, "gateway-tls", issue(ca, "localhost", server_names=["localhost", "127.0.0.1"]))
    _write(out, "gateway-sign", issue(ca, "WSGate Gateway Signing"))
    _write(out, "gateway-enc", issue(ca, "WSGate Gateway Encryption"))
    _write(out, "client", issue(ca, "Demo Client", client_auth=True))
    _write(out, "client2", issue(ca, "Demo Client Two", client_auth=True))
    rogue_ca = make_ca("Rogue CA")
    _write(out, "rogue-ca", rogue_ca)
    _write(out, "rogue", issue(rogue_ca, "Demo Client", client_auth=True))
    hmac_keys = {"keys": {"demo-client": base64.b64encode(secrets.token_bytes(32)).decode()}}
    (out / "hmac-keys.yaml").write_text(yaml.safe_dump(hmac_keys))
    users = {
        "users": {
            # PasswordText only: a salted hash is all the gateway keeps.
            "alice": {"password_hash": hash_password(DEMO_USERS["alice"])},
            # PasswordDigest needs the password itself (the digest is over nonce, created and password).
            "bob": {"password": DEMO_USERS["bob"]},
        }
    }
    (out / "users.yaml").write_text(yaml.safe_dump(users))
    master = {"keys": [{"id": "k1", "key": base64.b64encode(secrets.token_bytes(32)).decode()}]}
    (out / "sct-master-keys.yaml").write_text(yaml.safe_dump(master))
    for p in out.iterdir():
        if p.suffix in (".key", ".yaml"):
            p.chmod(0o600)
    return out
