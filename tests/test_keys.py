"""filters.engine.wss.keys: PEM loading, the trust store, BinarySecurityToken and SecurityTokenReference forms."""

from __future__ import annotations

import base64
import datetime as dt
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID
from lxml import etree

from certs import pki as pki_mod
from filters.engine import faults, ns
from filters.engine.wss import keys

NOW = dt.datetime.now(dt.UTC)
NSDECL = f'xmlns:ds="{ns.DS}" xmlns:wsse="{ns.WSSE}" xmlns:wsu="{ns.WSU}" xmlns:wsse11="{ns.WSSE11}"'


def ca(pki: Path) -> pki_mod.Issued:
    return pki_mod.Issued(keys.load_private_key(pki / "ca.key"), keys.load_certificate(pki / "ca.pem"))


def store(
    pki: Path, allowed: list[str] | None = None, ttl: dt.timedelta = keys.CACHE_TTL, size: int = keys.CACHE_SIZE
) -> keys.TrustStore:
    return keys.TrustStore(keys.load_certificates([pki / "ca.pem"]), allowed, cache_ttl=ttl, cache_size=size)


def refused(code: str) -> pytest.RaisesExc[faults.Fault]:
    return pytest.raises(faults.Fault, check=lambda f: f.code == code)


def key_info(inner: str) -> etree._Element:
    return etree.fromstring(f"<ds:KeyInfo {NSDECL}>{inner}</ds:KeyInfo>")


# --- loading -------------------------------------------------------------------------------------------


def test_load_pem_files_cached_by_path(pki: Path) -> None:
    key = keys.load_private_key(pki / "client.key")
    assert keys.load_private_key(str(pki / "client.key")) is key
    cert = keys.load_certificate(pki / "client.pem")
    assert cert.public_key().public_numbers() == key.public_key().public_numbers()
    bundle = pki / "bundle.pem"
    bundle.write_bytes((pki / "ca.pem").read_bytes() + (pki / "rogue-ca.pem").read_bytes())
    subjects = [c.subject.rfc4514_string() for c in keys.load_certificates([bundle, pki / "client.pem"])]
    assert subjects == ["CN=WSGate Demo CA,O=WSGate Demo", "CN=Rogue CA,O=WSGate Demo", "CN=Demo Client,O=WSGate Demo"]


def test_load_hmac_keys(pki: Path, tmp_path: Path) -> None:
    loaded = keys.load_hmac_keys(pki / "hmac-keys.yaml")
    assert list(loaded) == ["demo-client"] and len(loaded["demo-client"]) == 32
    short = tmp_path / "short.yaml"
    short.write_text(f"keys: {{weak: {base64.b64encode(b'0123456789').decode()}}}\n")
    with pytest.raises(ValueError, match="shorter"):
        keys.load_hmac_keys(short)
    bad = tmp_path / "bad.yaml"
    bad.write_text("keys: {x: 'not base64!'}\n")
    with pytest.raises(ValueError, match="base64"):
        keys.load_hmac_keys(bad)
    bad.write_text("users: {}\n")
    with pytest.raises(ValueError, match="keys"):
        keys.load_hmac_keys(bad)


# --- trust store ---------------------------------------------------------------------------------------


def test_trusted_client_gives_its_subject(pki: Path) -> None:
    ts = store(pki)
    assert ts.validate(keys.load_certificate(pki / "client.pem"), [], NOW) == "CN=Demo Client,O=WSGate Demo"


def test_rogue_ca_refused(pki: Path) -> None:
    # Same subject as the real client, issued by a CA we do not trust.
    with refused("FailedAuthentication"):
        store(pki).validate(keys.load_certificate(pki / "rogue.pem"), [], NOW)


def test_expired_and_not_yet_valid_refused(pki: Path) -> None:
    expired = pki_mod.issue(ca(pki), "Expired Client", client_auth=True, not_before=NOW - dt.timedelta(days=10), days=1)
    with refused("FailedAuthentication"):
        store(pki).validate(expired.cert, [], NOW)
    future = pki_mod.issue(ca(pki), "Future Client", client_auth=True, not_before=NOW + dt.timedelta(days=2))
    with refused("FailedAuthentication"):
        store(pki).validate(future.cert, [], NOW)


def test_allow_list(pki: Path) -> None:
    # .NET writes ", " between RDNs; both spellings name the same subject.
    ts = store(pki, ["CN=Demo Client, O=WSGate Demo"])
    assert ts.validate(keys.load_certificate(pki / "client.pem"), [], NOW) == "CN=Demo Client,O=WSGate Demo"
    with refused("FailedAuthentication"):
        ts.validate(keys.load_certificate(pki / "client2.pem"), [], NOW)
    with refused("FailedAuthentication"):  # right subject, wrong CA
        ts.validate(keys.load_certificate(pki / "rogue.pem"), [], NOW)


def test_intermediate_needed_to_build_the_chain(pki: Path) -> None:
    inter = pki_mod.make_ca("Issuing CA", days=30, parent=ca(pki))
    inter_cert = inter.cert  # the CA that issues the leaf, not an anchor
    leaf = pki_mod.issue(inter, "Chained Client", client_auth=True)
    with refused("FailedAuthentication"):
        store(pki).validate(leaf.cert, [], NOW)
    assert store(pki).validate(leaf.cert, [inter_cert], NOW) == "CN=Chained Client,O=WSGate Demo"
    # Or from the policy (rsa.intermediates): the client sends only its own certificate.
    configured = keys.TrustStore(keys.load_certificates([pki / "ca.pem"]), intermediates=[inter_cert])
    assert configured.validate(leaf.cert, [], NOW) == "CN=Chained Client,O=WSGate Demo"


def test_positive_decisions_cached_until_expiry(pki: Path) -> None:
    short = pki_mod.issue(ca(pki), "Short Lived", client_auth=True, days=1)
    ts = store(pki, ttl=dt.timedelta(hours=6), size=2)
    assert ts.validate(short.cert, [], NOW) == "CN=Short Lived,O=WSGate Demo"
    assert ts.validate(short.cert, [], NOW + dt.timedelta(hours=1)) == "CN=Short Lived,O=WSGate Demo"
    # The cached decision ends with the certificate, even though the TTL has not run out yet... and then
    # the full check refuses it.
    with refused("FailedAuthentication"):
        ts.validate(short.cert, [], NOW + dt.timedelta(days=1, hours=1))
    for name in ("client", "client2", "gateway-sign"):
        ts.validate(keys.load_certificate(pki / f"{name}.pem"), [], NOW)
    assert len(ts._cache) == 2  # bounded


def test_bad_allow_list_entry_is_a_config_error(pki: Path) -> None:
    with pytest.raises(ValueError):
        store(pki, ["this is not a DN"])


# --- BinarySecurityToken -------------------------------------------------------------------------------


def test_bst_round_trip(pki: Path) -> None:
    cert = keys.load_certificate(pki / "client.pem")
    el = keys.make_bst(cert, "X509-1")
    assert el.get("ValueType") == ns.X509V3 and el.get("EncodingType") == ns.BASE64
    assert el.get(ns.q(ns.WSU, "Id")) == "X509-1"
    reparsed = etree.fromstring(etree.tostring(el))
    assert keys.parse_bst(reparsed) == cert


@pytest.mark.parametrize(
    ("value_type", "encoding", "text", "code"),
    [
        ("urn:pkipath", ns.BASE64, None, "UnsupportedSecurityToken"),
        (ns.X509V3, None, None, "InvalidSecurityToken"),
        (ns.X509V3, "urn:hex", None, "InvalidSecurityToken"),
        (ns.X509V3, ns.BASE64, "###", "InvalidSecurityToken"),
        (ns.X509V3, ns.BASE64, base64.b64encode(b"not a certificate").decode(), "InvalidSecurityToken"),
        (ns.X509V3, ns.BASE64, "", "InvalidSecurityToken"),
    ],
)
def test_bst_refusals(pki: Path, value_type: str, encoding: str | None, text: str | None, code: str) -> None:
    el = keys.make_bst(keys.load_certificate(pki / "client.pem"), "X509-1")
    el.set("ValueType", value_type)
    if encoding is None:
        del el.attrib["EncodingType"]
    else:
        el.set("EncodingType", encoding)
    if text is not None:
        el.text = text
    with refused(code):
        keys.parse_bst(el)


# --- SecurityTokenReference ----------------------------------------------------------------------------


def test_builders_parse_back(pki: Path) -> None:
    cert = keys.load_certificate(pki / "client.pem")
    other = keys.load_certificate(pki / "client2.pem")

    def parsed(child: etree._Element) -> keys.KeyRef:
        ki = etree.Element(ns.q(ns.DS, "KeyInfo"))
        ki.append(child)
        return keys.parse_key_info(etree.fromstring(etree.tostring(ki)))

    assert parsed(keys.str_reference("#X509-1", ns.X509V3)) == keys.KeyRef("reference", "X509-1", ns.X509V3)
    ski = parsed(keys.str_key_identifier(ns.X509_SKI, base64.b64encode(keys.ski(cert)).decode()))
    thumb = parsed(keys.str_key_identifier(ns.THUMBPRINT_SHA1, base64.b64encode(keys.thumbprint_sha1(cert)).decode()))
    issuer_serial = parsed(keys.str_issuer_serial(cert))
    assert (ski.kind, thumb.kind, issuer_serial.kind) == ("ski", "thumbprint", "issuer_serial")
    assert issuer_serial.value == "CN=WSGate Demo CA,O=WSGate Demo" and issuer_serial.serial == cert.serial_number
    for ref in (ski, thumb, issuer_serial):
        assert keys.matches(ref, cert)
        assert not keys.matches(ref, other)
    assert parsed(keys.key_name("demo-client")) == keys.KeyRef("key_name", "demo-client")
    enc = keys.str_key_identifier(ns.ENCKEY_SHA1, base64.b64encode(b"\x01" * 20).decode())
    assert enc.get(ns.q(ns.WSSE11, "TokenType")) == ns.ENCKEY_TOKEN
    assert parsed(enc).kind == "encrypted_key_sha1"
    assert not keys.matches(parsed(enc), cert)


def test_ski_extension_matches_computed() -> None:
    issued = pki_mod.make_ca("SKI Check")
    computed = x509.SubjectKeyIdentifier.from_public_key(issued.key.public_key()).digest
    assert keys.ski(issued.cert) == computed


def test_wss4j_and_dotnet_shapes() -> None:
    # As WSS4J writes them: STR with wsu:Id, IssuerSerial in RFC 2253 form, Reference without ValueType.
    ref = keys.parse_key_info(
        key_info(
            '<wsse:SecurityTokenReference wsu:Id="STR-1"><ds:X509Data><ds:X509IssuerSerial>'
            "<ds:X509IssuerName>CN=Demo Issuing CA,OU=Ops,O=Example,L=Town,ST=State,C=PA</ds:X509IssuerName>"
            "<ds:X509SerialNumber> 864031817 </ds:X509SerialNumber></ds:X509IssuerSerial></ds:X509Data>"
            "</wsse:SecurityTokenReference>"
        )
    )
    assert ref == keys.KeyRef(
        "issuer_serial", "CN=Demo Issuing CA,OU=Ops,O=Example,L=Town,ST=State,C=PA", None, 864031817
    )
    ek = keys.parse_key_info(
        key_info(
            f'<wsse:SecurityTokenReference wsse11:TokenType="{ns.ENCKEY_TOKEN}">'
            '<wsse:Reference URI="#EK-1"/></wsse:SecurityTokenReference>'
        )
    )
    assert ek == keys.KeyRef("reference", "EK-1", None)
    # .NET: "CN=a, O=b" and E= for the e-mail address.
    name = keys.parse_dn("CN=Demo CA, E=ca@example.org, O=Example")
    assert name.get_attributes_for_oid(NameOID.EMAIL_ADDRESS)[0].value == "ca@example.org"


@pytest.mark.parametrize(
    ("inner", "code"),
    [
        ("", "SecurityTokenUnavailable"),
        ("<ds:KeyName>a</ds:KeyName><ds:KeyName>b</ds:KeyName>", "InvalidSecurity"),
        ("<ds:KeyName> </ds:KeyName>", "InvalidSecurity"),
        ('<ds:RetrievalMethod URI="#x"/>', "InvalidSecurity"),
        ("<ds:X509Data><ds:X509Certificate>AAAA</ds:X509Certificate></ds:X509Data>", "SecurityTokenUnavailable"),
        ("<ds:KeyValue/>", "SecurityTokenUnavailable"),
        ("<wsse:SecurityTokenReference/>", "InvalidSecurity"),
        (
            '<wsse:SecurityTokenReference><wsse:Reference URI="#a"/>'
            f'<wsse:KeyIdentifier ValueType="{ns.X509_SKI}">AAAA</wsse:KeyIdentifier></wsse:SecurityTokenReference>',
            "InvalidSecurity",
        ),
        (
            '<wsse:SecurityTokenReference><wsse:Reference URI="http://evil/x"/></wsse:SecurityTokenReference>',
            "SecurityTokenUnavailable",
        ),
        (
            '<wsse:SecurityTokenReference><wsse:Reference URI="#"/></wsse:SecurityTokenReference>',
            "SecurityTokenUnavailable",
        ),
        (
            "<wsse:SecurityTokenReference><wsse:Reference URI=\"#xpointer(id('a'))\"/></wsse:SecurityTokenReference>",
            "SecurityTokenUnavailable",
        ),
        (
            '<wsse:SecurityTokenReference><wsse:KeyIdentifier ValueType="urn:saml:AssertionID">a</wsse:KeyIdentifier>'
            "</wsse:SecurityTokenReference>",
            "SecurityTokenUnavailable",
        ),
        (
            f'<wsse:SecurityTokenReference><wsse:KeyIdentifier ValueType="{ns.X509_SKI}" EncodingType="urn:hex">00'
            "</wsse:KeyIdentifier></wsse:SecurityTokenReference>",
            "InvalidSecurity",
        ),
        (
            f'<wsse:SecurityTokenReference><wsse:KeyIdentifier ValueType="{ns.X509_SKI}">!!</wsse:KeyIdentifier>'
            "</wsse:SecurityTokenReference>",
            "InvalidSecurity",
        ),
        ("<wsse:SecurityTokenReference><wsse:Embedded/></wsse:SecurityTokenReference>", "SecurityTokenUnavailable"),
        (
            "<wsse:SecurityTokenReference><ds:X509Data><ds:X509IssuerSerial><ds:X509IssuerName>CN=a</ds:X509IssuerName>"
            "<ds:X509SerialNumber>12ab</ds:X509SerialNumber></ds:X509IssuerSerial></ds:X509Data></wsse:SecurityTokenReference>",
            "InvalidSecurity",
        ),
        (
            "<wsse:SecurityTokenReference><ds:X509Data><ds:X509IssuerSerial><ds:X509IssuerName>CN=a</ds:X509IssuerName>"
            "<ds:X509SerialNumber>1</ds:X509SerialNumber></ds:X509IssuerSerial><ds:X509SKI>AAAA</ds:X509SKI>"
            "</ds:X509Data></wsse:SecurityTokenReference>",
            "SecurityTokenUnavailable",
        ),
    ],
)
def test_key_info_refusals(inner: str, code: str) -> None:
    with refused(code):
        keys.parse_key_info(key_info(inner))


def test_issuer_serial_needs_issuer_and_serial(pki: Path) -> None:
    cert = keys.load_certificate(pki / "client.pem")
    right = keys.KeyRef("issuer_serial", "CN=WSGate Demo CA, O=WSGate Demo", None, cert.serial_number)
    assert keys.matches(right, cert)
    assert not keys.matches(keys.KeyRef("issuer_serial", right.value, None, cert.serial_number + 1), cert)
    assert not keys.matches(keys.KeyRef("issuer_serial", "CN=Rogue CA,O=WSGate Demo", None, cert.serial_number), cert)
    assert not keys.matches(keys.KeyRef("issuer_serial", "garbage", None, cert.serial_number), cert)
    assert not keys.matches(keys.KeyRef("reference", "X509-1", ns.X509V3), cert)
