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
| ocsp.pem / .key | the demo CA's OCSP responder (OCSPSigning), for `openssl ocsp -index index.txt ...` |
| index.txt | what the demo CA issued and revoked, in `openssl ca`'s format (`wsgate certs revoke`) |
| ca.crl | the demo CA's CRL (PEM), published by `init` and `wsgate certs revoke` |
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
from cryptography.x509.oid import AuthorityInformationAccessOID, ExtendedKeyUsageOID, NameOID

DEFAULT_DIR = Path("certs/out")
DEMO_USERS = {"alice": "alice-demo-password", "bob": "bob-demo-password"}
DEMO_OCSP_URL = "http://127.0.0.1:8890/"  # where `openssl ocsp -port 8890` answers for the demo CA
CRL_DAYS = 7  # the demo CRL's nextUpdate; `init` publishes a new one when fewer than CRL_RENEW_DAYS remain
CRL_RENEW_DAYS = 2
REVOCATION_REASONS = ("unspecified", "keyCompromise", "affiliationChanged", "superseded", "cessationOfOperation")


@dataclass(frozen=True)
class Issued:
    key: rsa.RSAPrivateKey
    cert: x509.Certificate


def _name(cn: str, org: str = "WSGate Demo") -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, org), x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def make_ca(cn: str, days: int = 3650, parent: Issued | None = None) -> Issued:
    """A self-signed root CA, or an intermediate CA certified by `parent`."""
    key = _key()
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(parent.cert.subject if parent else _name(cn))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0 if parent else None), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    if parent:
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(parent.key.public_key()), critical=False
        )
    return Issued(key, builder.sign(parent.key if parent else key, hashes.SHA256()))


def issue(
    ca: Issued,
    cn: str,
    *,
    server_names: list[str] | None = None,
    client_auth: bool = False,
    days: int = 825,
    not_before: dt.datetime | None = None,
    ocsp_url: str | None = None,
    ocsp_signing: bool = False,
) -> Issued:
    """An end-entity certificate signed by `ca`; SANs make it a TLS server certificate, `ocsp_url` names the
    issuer's OCSP responder (Authority Information Access), `ocsp_signing` makes it that responder."""
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
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH] if client_auth or not (server_names or ocsp_signing) else []
    if ocsp_signing:
        usages.append(ExtendedKeyUsageOID.OCSP_SIGNING)
        builder = builder.add_extension(x509.OCSPNoCheck(), critical=False)
    if ocsp_url:
        builder = builder.add_extension(
            x509.AuthorityInformationAccess(
                [x509.AccessDescription(AuthorityInformationAccessOID.OCSP, x509.UniformResourceIdentifier(ocsp_url))]
            ),
            critical=False,
        )
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


def write(out: Path, stem: str, issued: Issued) -> None:
    """out/stem.pem and out/stem.key (mode 0600)."""
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


def init(out: Path = DEFAULT_DIR, force: bool = False, ocsp_url: str = DEMO_OCSP_URL) -> Path:
    """Make the demo PKI in `out` unless it is already there (or `force`). Returns `out`. A kept PKI gets what
    revocation needs if it lacks it (index, OCSP responder, CRL), and a new CRL when its own is near nextUpdate."""
    out = Path(out)
    if (out / "ca.pem").exists() and not force:
        ensure_revocation(out)
        return out
    out.mkdir(parents=True, exist_ok=True)
    (out / ".gitignore").write_text("*\n")
    (out / "index.txt").write_text("")
    ca = make_ca("WSGate Demo CA")
    write(out, "ca", ca)
    write(out, "gateway-tls", issue(ca, "localhost", server_names=["localhost", "127.0.0.1"]))
    write(out, "gateway-sign", issue(ca, "WSGate Gateway Signing"))
    write(out, "gateway-enc", issue(ca, "WSGate Gateway Encryption"))
    write(out, "client", issue(ca, "Demo Client", client_auth=True, ocsp_url=ocsp_url))
    write(out, "client2", issue(ca, "Demo Client Two", client_auth=True, ocsp_url=ocsp_url))
    write(out, "ocsp", issue(ca, "WSGate Demo OCSP Responder", ocsp_signing=True))
    for stem in ("gateway-tls", "gateway-sign", "gateway-enc", "client", "client2", "ocsp"):
        record(out, load_pem_certificate(out / f"{stem}.pem"))
    publish_crl(out)
    rogue_ca = make_ca("Rogue CA")
    write(out, "rogue-ca", rogue_ca)
    write(out, "rogue", issue(rogue_ca, "Demo Client", client_auth=True))
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


# ---------------------------------------------------------------------------------------------------------
# Revocation: an `openssl ca`-style index (so `openssl ocsp -index` can answer from it) and the CRL made from it


def load_pem_certificate(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def load_ca(out: Path) -> Issued:
    key = serialization.load_pem_private_key((out / "ca.key").read_bytes(), password=None)
    assert isinstance(key, rsa.RSAPrivateKey)
    return Issued(key, load_pem_certificate(out / "ca.pem"))


def _index_time(when: dt.datetime) -> str:
    """openssl's index time: UTCTime before 2050, GeneralizedTime after (RFC 5280 4.1.2.5)."""
    return when.strftime("%y%m%d%H%M%SZ" if when.year < 2050 else "%Y%m%d%H%M%SZ")


def _serial_hex(serial: int) -> str:
    """As openssl writes (and looks up) a serial in the index: upper-case hex in whole bytes."""
    text = f"{serial:X}"
    return text.rjust(len(text) + len(text) % 2, "0")


def _oneline(name: x509.Name) -> str:
    return "".join(f"/{a.rfc4514_attribute_name}={a.value}" for a in name)


def _index(out: Path) -> list[list[str]]:
    path = out / "index.txt"
    return [line.split("\t") for line in path.read_text().splitlines() if line] if path.exists() else []


def _write_index(out: Path, rows: list[list[str]]) -> None:
    (out / "index.txt").write_text("".join("\t".join(r) + "\n" for r in rows))


def record(out: Path, cert: x509.Certificate) -> None:
    """Enter an issued certificate in the index as valid (once)."""
    rows = _index(out)
    serial = _serial_hex(cert.serial_number)
    if any(r[3] == serial for r in rows):
        return
    rows.append(["V", _index_time(cert.not_valid_after_utc), "", serial, "unknown", _oneline(cert.subject)])
    _write_index(out, rows)


def find_certificate(out: Path, name: str) -> Path:
    """A certificate of the demo PKI by file stem (`client`) or common name slug (`demo-client`)."""
    for path in sorted(out.glob("*.pem")):
        cert = load_pem_certificate(path)
        cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        slug = str(cns[0].value).lower().replace(" ", "-") if cns else ""
        if name in (path.stem, slug):
            return path
    raise KeyError(name)


def revoke(out: Path, name: str, reason: str = "unspecified") -> x509.Certificate:
    """Mark a demo certificate revoked in the index and publish a new CRL; returns the certificate."""
    if reason not in REVOCATION_REASONS:
        raise ValueError(f"reason {reason!r}: one of {', '.join(REVOCATION_REASONS)}")
    cert = load_pem_certificate(find_certificate(out, name))
    ca = load_ca(out)
    if cert.issuer != ca.cert.subject or cert.subject == ca.cert.subject:
        raise ValueError(f"{name}: not a certificate the demo CA issued")
    record(out, cert)
    rows = _index(out)
    serial = _serial_hex(cert.serial_number)
    for row in rows:
        if row[3] == serial and row[0] == "V":
            row[0], row[2] = "R", f"{_index_time(dt.datetime.now(dt.UTC))},{reason}"
    _write_index(out, rows)
    publish_crl(out)
    return cert


def publish_crl(out: Path, days: int = CRL_DAYS) -> Path:
    """ca.crl from the index's revoked entries, signed by the demo CA, numbered one past the last."""
    ca = load_ca(out)
    now = dt.datetime.now(dt.UTC)
    number_file = out / "crlnumber"
    number = int(number_file.read_text()) + 1 if number_file.exists() else 1
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca.cert.subject)
        .last_update(now - dt.timedelta(minutes=1))
        .next_update(now + dt.timedelta(days=days))
        .add_extension(x509.CRLNumber(number), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False)
    )
    for status, _expiry, revoked, serial, *_ in _index(out):
        if status != "R":
            continue
        when, _, reason = revoked.partition(",")
        fmt = "%y%m%d%H%M%SZ" if len(when) == 13 else "%Y%m%d%H%M%SZ"
        entry = (
            x509.RevokedCertificateBuilder()
            .serial_number(int(serial, 16))
            .revocation_date(dt.datetime.strptime(when, fmt).replace(tzinfo=dt.UTC))
        )
        if reason and reason != "unspecified":
            entry = entry.add_extension(x509.CRLReason(x509.ReasonFlags(reason)), critical=False)
        builder = builder.add_revoked_certificate(entry.build())
    crl = builder.sign(ca.key, hashes.SHA256())
    path = out / "ca.crl"
    tmp = out / "ca.crl.tmp"
    tmp.write_bytes(crl.public_bytes(serialization.Encoding.PEM))
    tmp.replace(path)  # readers see the old CRL or the new one, never half of it
    number_file.write_text(f"{number}\n")
    return path


def ensure_revocation(out: Path) -> None:
    """An older demo PKI: add the index (from the demo CA's certificates there) and the OCSP responder; then
    publish a CRL if there is none or it is near its nextUpdate."""
    ca = load_ca(out)
    if not (out / "ocsp.pem").exists():
        write(out, "ocsp", issue(ca, "WSGate Demo OCSP Responder", ocsp_signing=True))
        (out / "ocsp.key").chmod(0o600)
    if not (out / "index.txt").exists():
        (out / "index.txt").write_text("")
        for path in sorted(out.glob("*.pem")):
            cert = load_pem_certificate(path)
            if cert.issuer == ca.cert.subject and cert.subject != ca.cert.subject:
                record(out, cert)
    crl_path = out / "ca.crl"
    if crl_path.exists():
        next_update = x509.load_pem_x509_crl(crl_path.read_bytes()).next_update_utc
        if next_update and next_update - dt.datetime.now(dt.UTC) > dt.timedelta(days=CRL_RENEW_DAYS):
            return
    publish_crl(out)
