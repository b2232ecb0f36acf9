"""XML Encryption: round trips, policy checks before decryption, uniform failures, and interop with xmlsec.

Everything uses real keys (the session PKI) and real ciphers; hand-made ciphertexts play the attacker who
knows the key or bends the padding."""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import xmlsec
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from lxml import etree

from filters.engine import faults
from filters.engine.faults import Fault
from filters.engine.ns import DS, SOAP11, WSSE, XENC, XENC11, q
from filters.engine.wss import encryption as enc
from gateway.policy import Limits

LIMITS = Limits()
OAEP_SHA1 = padding.OAEP(padding.MGF1(hashes.SHA1()), hashes.SHA1(), None)
GCM = ["aes256-gcm", "aes128-gcm"]
ALL_DATA = ["aes256-gcm", "aes128-gcm", "aes256-cbc", "aes128-cbc"]
OAEP = ["rsa-oaep-mgf1p", "rsa-oaep"]
ALL_TRANSPORT = [*OAEP, "rsa-1_5"]

# The prefixes m, t and xsi (and the default namespace) are declared on the Envelope only.
ENVELOPE = (
    f'<s:Envelope xmlns:s="{SOAP11}" xmlns:m="urn:example:m" xmlns:t="urn:example:t" xmlns="urn:example:d" '
    'xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance">'
    "<s:Header><m:Info>head</m:Info></s:Header>"
    '<s:Body>lead <m:op m:a="1" b="2">x &amp; y &lt; z<t:q xsi:type="t:Kind">SECRET</t:q><plain/></m:op> mid '
    "<!-- a comment --><m:other/> end</s:Body></s:Envelope>"
).encode()

REFERENCE = faults.security("FailedCheck", "reference")


def canonical(doc: bytes | etree._Element) -> tuple[bytes, bytes]:
    """What a signature over the document sees: its inclusive and exclusive C14N (comments kept)."""
    root = etree.fromstring(doc) if isinstance(doc, bytes) else doc
    return tuple(etree.tostring(root, method="c14n", exclusive=e, with_comments=True) for e in (False, True))


@pytest.fixture(scope="module")
def gw_key(pki: Path) -> rsa.RSAPrivateKey:
    key = serialization.load_pem_private_key((pki / "gateway-enc.key").read_bytes(), None)
    assert isinstance(key, rsa.RSAPrivateKey)
    return key


@pytest.fixture(scope="module")
def gw_cert(pki: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate((pki / "gateway-enc.pem").read_bytes())


@pytest.fixture(scope="module")
def client_cert(pki: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate((pki / "client.pem").read_bytes())


def security_token_reference() -> etree._Element:
    str_el = etree.Element(q(WSSE, "SecurityTokenReference"), nsmap={"wsse": WSSE})
    etree.SubElement(str_el, q(WSSE, "Reference"), URI="#X509-1")
    return str_el


def encrypt_envelope(
    cert: x509.Certificate,
    algorithm: str = "aes256-gcm",
    transport: str = "rsa-oaep-mgf1p",
    *,
    digest: enc.Digest = "sha1",
    mgf: enc.Digest = "sha1",
) -> bytes:
    """ENVELOPE with its Body content encrypted, the EncryptedKey inside the EncryptedData's KeyInfo."""
    root = etree.fromstring(ENVELOPE)
    key = enc.new_key(algorithm)
    ek = enc.encrypt_key(key, cert, transport, "EK-1", security_token_reference(), [], digest=digest, mgf=mgf)
    enc.encrypt_content(root.find(q(SOAP11, "Body")), key, algorithm, "ED-1", ek)
    return etree.tostring(root)


def decrypt_envelope(
    data: bytes,
    private_key: rsa.RSAPrivateKey,
    data_algorithms: list[str] = GCM,
    transports: list[str] = OAEP,
) -> tuple[etree._Element, list[etree._Element]]:
    root = etree.fromstring(data)
    ed = root.find(f".//{q(XENC, 'EncryptedData')}")
    ek = enc.embedded_encrypted_key(ed)
    key = enc.decrypt_key(ek, private_key, transports, enc.data_key_size(ed, data_algorithms))
    return root, enc.decrypt_data(ed, key, data_algorithms, LIMITS)


def seal(algorithm: str, key: bytes, plaintext: bytes, *, pad: bytes | None = None) -> bytes:
    """IV || ciphertext (|| tag) the way a sender holding `key` makes it; `pad` overrides the CBC padding."""
    if algorithm.endswith("gcm"):
        iv = os.urandom(12)
        return iv + AESGCM(key).encrypt(iv, plaintext, None)
    if pad is None:
        n = 16 - len(plaintext) % 16
        pad = os.urandom(n - 1) + bytes([n])
    iv = os.urandom(16)
    encryptor = Cipher(algorithms.AES(key), modes.CBC(iv)).encryptor()
    return iv + encryptor.update(plaintext + pad) + encryptor.finalize()


def encrypted_data(
    algorithm: str, cipher_value: bytes | str, kind: str = "Content", uri: str | None = None
) -> etree._Element:
    """A bare xenc:EncryptedData around a given CipherValue (the key is known out of band)."""
    ed = etree.Element(q(XENC, "EncryptedData"), Id="ED-9", Type=XENC + kind, nsmap={"xenc": XENC})
    etree.SubElement(ed, q(XENC, "EncryptionMethod"), Algorithm=uri or enc.DATA_ALGORITHMS[algorithm])
    value = etree.SubElement(etree.SubElement(ed, q(XENC, "CipherData")), q(XENC, "CipherValue"))
    value.text = cipher_value if isinstance(cipher_value, str) else base64.b64encode(cipher_value).decode()
    return ed


def in_body(ed: etree._Element) -> etree._Element:
    """Put `ed` into a fresh ENVELOPE's Body (in place of its content) and return it."""
    root = etree.fromstring(ENVELOPE)
    body = root.find(q(SOAP11, "Body"))
    body.text = None
    del body[:]
    body.append(ed)
    return ed


# --- round trips -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ALL_DATA)
@pytest.mark.parametrize(
    ("transport", "digest", "mgf"),
    [
        ("rsa-oaep-mgf1p", "sha1", "sha1"),
        ("rsa-oaep-mgf1p", "sha256", "sha1"),
        ("rsa-oaep", "sha1", "sha1"),
        ("rsa-oaep", "sha256", "sha1"),
        ("rsa-oaep", "sha256", "sha256"),
    ],
)
def test_round_trip(
    gw_cert: x509.Certificate,
    gw_key: rsa.RSAPrivateKey,
    algorithm: str,
    transport: str,
    digest: enc.Digest,
    mgf: enc.Digest,
) -> None:
    data = encrypt_envelope(gw_cert, algorithm, transport, digest=digest, mgf=mgf)
    assert b"SECRET" not in data and b"m:op" not in data
    root, holders = decrypt_envelope(data, gw_key, ALL_DATA, OAEP)
    body = root.find(q(SOAP11, "Body"))
    assert holders == [body]
    # Text, tails, comments, attributes and the prefixes declared only on the Envelope all came back.
    assert canonical(root) == canonical(ENVELOPE)
    assert (
        body.find("{urn:example:m}op/{urn:example:t}q").get(q("http://www.w3.org/2001/XMLSchema-instance", "type"))
        == "t:Kind"
    )
    assert body.find("{urn:example:m}op/{urn:example:d}plain") is not None


def test_encrypted_key_shape(gw_cert: x509.Certificate) -> None:
    key = enc.new_key("aes256-gcm")
    ek = enc.encrypt_key(
        key,
        gw_cert,
        "rsa-oaep",
        "EK-7",
        security_token_reference(),
        ["ED-1", "ED-2"],
        digest="sha256",
        mgf="sha256",
    )
    method = ek.find(q(XENC, "EncryptionMethod"))
    assert ek.get("Id") == "EK-7"
    assert method.get("Algorithm") == XENC11 + "rsa-oaep"
    assert method.find(q(DS, "DigestMethod")).get("Algorithm") == XENC + "sha256"
    assert method.find(q(XENC11, "MGF")).get("Algorithm") == XENC11 + "mgf1sha256"
    assert ek.find(f"{q(DS, 'KeyInfo')}/{q(WSSE, 'SecurityTokenReference')}") is not None
    assert [c.tag for c in ek] == [q(XENC, n) for n in ("EncryptionMethod",)] + [q(DS, "KeyInfo")] + [
        q(XENC, n) for n in ("CipherData", "ReferenceList")
    ]
    assert enc.reference_list(ek) == ["ED-1", "ED-2"]
    plain = enc.encrypt_key(key, gw_cert, "rsa-oaep-mgf1p", "EK-8", security_token_reference(), [])
    assert len(plain.find(q(XENC, "EncryptionMethod"))) == 0  # SHA-1 defaults stay implicit
    assert plain.find(q(XENC, "ReferenceList")) is None
    assert enc.reference_list(plain) == []


def test_encrypted_data_shape(gw_cert: x509.Certificate) -> None:
    root = etree.fromstring(encrypt_envelope(gw_cert, "aes128-gcm"))
    body = root.find(q(SOAP11, "Body"))
    assert body.text is None and len(body) == 1
    ed = body[0]
    assert ed.tag == q(XENC, "EncryptedData")
    assert ed.get("Id") == "ED-1" and ed.get("Type") == XENC + "Content"
    assert ed.find(q(XENC, "EncryptionMethod")).get("Algorithm") == XENC11 + "aes128-gcm"
    assert enc.key_for(ed) is ed.find(q(DS, "KeyInfo"))
    assert enc.embedded_encrypted_key(ed).get("Id") == "EK-1"
    raw = base64.b64decode(ed.findtext(f"{q(XENC, 'CipherData')}/{q(XENC, 'CipherValue')}"))
    assert (len(raw) - 12 - 16) > 0


def test_rsa_1_5_round_trip_when_allowed(gw_cert: x509.Certificate, gw_key: rsa.RSAPrivateKey) -> None:
    data = encrypt_envelope(gw_cert, "aes256-gcm", "rsa-1_5")
    root, _ = decrypt_envelope(data, gw_key, GCM, ALL_TRANSPORT)
    assert canonical(root) == canonical(ENVELOPE)


@pytest.mark.parametrize("algorithm", ALL_DATA)
def test_element_type_with_prefixes_from_the_envelope(algorithm: str) -> None:
    """An encrypted header element whose plaintext uses prefixes it does not declare (xmlsec and WSS4J do)."""
    key = enc.new_key(algorithm)
    root = etree.fromstring(ENVELOPE)
    header = root.find(q(SOAP11, "Header"))
    header.text, header[0].tail = "before ", " after"
    ed = encrypted_data(
        algorithm,
        seal(algorithm, key, b'<m:Token t:x="1"><t:Name>SECRET</t:Name><bare/></m:Token>'),
        "Element",
    )
    ed.tail = " tail"
    header.insert(1, ed)
    [token] = enc.decrypt_data(ed, key, ALL_DATA, LIMITS)
    assert token.getparent() is header and header.index(token) == 1
    assert token.tag == "{urn:example:m}Token" and token.get("{urn:example:t}x") == "1"
    assert token[0].tag == "{urn:example:t}Name" and token[1].tag == "{urn:example:d}bare"
    assert token.tail == " tail" and header.text == "before " and header[0].tail == " after"
    # Nothing in the result re-declares what the Envelope already declares.
    assert etree.tostring(root).count(b"xmlns:m=") == 1


@pytest.mark.parametrize(
    ("plaintext", "expected"),
    [
        (b"L<z/>T", "<p>a<x/>bL<z/>Tc<y/>d</p>"),
        (b"only text", "<p>a<x/>bonly textc<y/>d</p>"),
        (b"", "<p>a<x/>bc<y/>d</p>"),
        (b"<z/><!--c--><w/>", "<p>a<x/>b<z/><!--c--><w/>c<y/>d</p>"),
    ],
)
def test_content_replacement_keeps_text_in_place(plaintext: bytes, expected: str) -> None:
    key = enc.new_key("aes128-gcm")
    p = etree.fromstring("<p>a<x/>b<y/>d</p>")
    ed = encrypted_data("aes128-gcm", seal("aes128-gcm", key, plaintext))
    ed.tail = "c"
    p.insert(1, ed)
    assert enc.decrypt_data(ed, key, GCM, LIMITS) == [p]
    assert etree.tostring(p).decode() == expected


def test_content_replacement_as_first_child() -> None:
    key = enc.new_key("aes128-gcm")
    p = etree.fromstring("<p>a<y/></p>")
    ed = encrypted_data("aes128-gcm", seal("aes128-gcm", key, b"L<z/>T"))
    ed.tail = "c"
    p.insert(0, ed)
    enc.decrypt_data(ed, key, GCM, LIMITS)
    assert etree.tostring(p) == b"<p>aL<z/>Tc<y/></p>"


def test_encrypted_data_keeps_its_own_namespaces_out_of_the_plaintext() -> None:
    """.NET puts xenc in the default namespace on EncryptedData; the plaintext must not inherit it."""
    key = enc.new_key("aes128-gcm")
    p = etree.fromstring('<p xmlns="urn:outer"/>')
    ed = etree.SubElement(p, q(XENC, "EncryptedData"), Type=XENC + "Content", nsmap={None: XENC})
    etree.SubElement(ed, q(XENC, "EncryptionMethod"), Algorithm=XENC11 + "aes128-gcm")
    value = etree.SubElement(etree.SubElement(ed, q(XENC, "CipherData")), q(XENC, "CipherValue"))
    value.text = base64.b64encode(seal("aes128-gcm", key, b"<inner/>")).decode()
    enc.decrypt_data(ed, key, GCM, LIMITS)
    assert p[0].tag == "{urn:outer}inner"


def test_encrypt_text_only_and_empty_content(gw_key: rsa.RSAPrivateKey) -> None:
    for content in ("a &lt; b &amp; c", ""):
        p = etree.fromstring(f"<p>{content}</p>")
        key = enc.new_key("aes256-cbc")
        ed = enc.encrypt_content(p, key, "aes256-cbc", "ED-2", None)
        assert enc.key_for(ed) is None and enc.embedded_encrypted_key(ed) is None
        enc.decrypt_data(ed, key, ALL_DATA, LIMITS)
        assert canonical(p) == canonical(f"<p>{content}</p>".encode())


def test_new_key_and_key_checks(gw_cert: x509.Certificate) -> None:
    assert len(enc.new_key("aes128-gcm")) == 16 and len(enc.new_key("aes256-cbc")) == 32
    with pytest.raises(ValueError):
        enc.encrypt_content(etree.Element("p"), os.urandom(16), "aes256-gcm", "ED-1", None)
    with pytest.raises(ValueError):
        enc.encrypt_key(os.urandom(16), gw_cert, "rsa-oaep-mgf1p", "EK-1", security_token_reference(), [], mgf="sha256")


# --- policy: algorithms are checked first ------------------------------------------------------------------


def test_cbc_refused_unless_allowed(gw_cert: x509.Certificate, gw_key: rsa.RSAPrivateKey) -> None:
    data = encrypt_envelope(gw_cert, "aes256-cbc")
    with pytest.raises(Fault) as info:
        decrypt_envelope(data, gw_key, GCM)
    assert info.value.code == "UnsupportedAlgorithm"
    root, _ = decrypt_envelope(data, gw_key, ["aes256-cbc"])
    assert canonical(root) == canonical(ENVELOPE)


def test_rsa_1_5_refused_unless_allowed(gw_cert: x509.Certificate, gw_key: rsa.RSAPrivateKey) -> None:
    data = encrypt_envelope(gw_cert, "aes256-gcm", "rsa-1_5")
    with pytest.raises(Fault) as info:
        decrypt_envelope(data, gw_key, GCM, OAEP)
    assert info.value.code == "UnsupportedAlgorithm"


def test_oaep_variant_must_be_allowed(gw_cert: x509.Certificate, gw_key: rsa.RSAPrivateKey) -> None:
    data = encrypt_envelope(gw_cert, "aes256-gcm", "rsa-oaep", digest="sha256")
    with pytest.raises(Fault) as info:
        decrypt_envelope(data, gw_key, GCM, ["rsa-oaep-mgf1p"])
    assert info.value.code == "UnsupportedAlgorithm"


def test_disallowed_data_algorithm_with_garbage_is_unsupported_not_failed() -> None:
    """CVE-2012-5575: the algorithm is refused before anything is decrypted or even decoded."""
    ed = in_body(encrypted_data("aes256-cbc", "!!! not base64 !!!"))
    with pytest.raises(Fault) as info:
        enc.decrypt_data(ed, os.urandom(32), GCM, LIMITS)
    assert info.value.code == "UnsupportedAlgorithm"
    with pytest.raises(Fault) as info:
        enc.data_key_size(ed, GCM)
    assert info.value.code == "UnsupportedAlgorithm"


@pytest.mark.parametrize(
    "uri",
    [
        XENC + "aes192-cbc",
        XENC + "tripledes-cbc",
        XENC11 + "aes192-gcm",
        "http://www.w3.org/2001/04/xmldsig-more#camellia256-cbc",
        "",
    ],
)
def test_unknown_data_algorithms(uri: str) -> None:
    ed = in_body(encrypted_data("aes256-gcm", "garbage", uri=uri))
    if not uri:
        del ed[0].attrib["Algorithm"]
    with pytest.raises(Fault) as info:
        enc.decrypt_data(ed, os.urandom(32), ALL_DATA, LIMITS)
    assert info.value.code == "UnsupportedAlgorithm"


def encrypted_key(transport_uri: str, cipher_value: str, *method_children: etree._Element) -> etree._Element:
    ek = etree.Element(q(XENC, "EncryptedKey"), nsmap={"xenc": XENC, "ds": DS})
    method = etree.SubElement(ek, q(XENC, "EncryptionMethod"), Algorithm=transport_uri)
    method.extend(method_children)
    etree.SubElement(etree.SubElement(ek, q(XENC, "CipherData")), q(XENC, "CipherValue")).text = cipher_value
    return ek


@pytest.mark.parametrize(
    ("transport_uri", "children"),
    [
        (XENC + "rsa-1_5", []),
        (XENC + "kw-aes256", []),
        ("http://www.w3.org/2001/04/xmlenc#rsa-oaep", []),
        (
            XENC + "rsa-oaep-mgf1p",
            [etree.Element(q(DS, "DigestMethod"), Algorithm="http://www.w3.org/2001/04/xmldsig-more#md5")],
        ),
        (XENC11 + "rsa-oaep", [etree.Element(q(DS, "DigestMethod"), Algorithm=XENC + "sha512")]),
        (XENC11 + "rsa-oaep", [etree.Element(q(XENC11, "MGF"), Algorithm=XENC11 + "mgf1sha512")]),
        (XENC + "rsa-oaep-mgf1p", [etree.Element(q(XENC11, "MGF"), Algorithm=XENC11 + "mgf1sha256")]),
    ],
)
def test_key_transport_refused_before_decryption(
    gw_key: rsa.RSAPrivateKey, transport_uri: str, children: list[etree._Element]
) -> None:
    with pytest.raises(Fault) as info:
        enc.decrypt_key(encrypted_key(transport_uri, "!!! garbage !!!", *children), gw_key, OAEP, 32)
    assert info.value.code == "UnsupportedAlgorithm"


def test_rsa_1_5_without_a_key_size(gw_cert: x509.Certificate, gw_key: rsa.RSAPrivateKey) -> None:
    """Without the data algorithm's key size a valid AES key still comes through, a bad block gives 32 bytes."""
    key = enc.new_key("aes128-gcm")
    ek = enc.encrypt_key(key, gw_cert, "rsa-1_5", "EK-1", security_token_reference(), [])
    assert enc.decrypt_key(ek, gw_key, ALL_TRANSPORT) == key
    garbage = base64.b64encode(os.urandom(gw_key.key_size // 8)).decode()
    assert len(enc.decrypt_key(encrypted_key(XENC + "rsa-1_5", garbage), gw_key, ALL_TRANSPORT)) == 32


# --- every decryption failure looks the same ------------------------------------------------------------


def _flip(data: bytes, index: int) -> bytes:
    b = bytearray(data)
    b[index] ^= 0x01
    return bytes(b)


def _data_case(
    algorithm: str,
    plaintext: bytes = b"<m:op>SECRET</m:op>",
    *,
    key_len: int | None = None,
    kind: str = "Content",
    mangle: Callable[[bytes], bytes] = lambda c: c,
    pad: bytes | None = None,
    limits: Limits = LIMITS,
    b64: Callable[[str], str] = lambda s: s,
) -> Callable[[rsa.RSAPrivateKey, x509.Certificate], None]:
    def run(gw_key: rsa.RSAPrivateKey, client_cert: x509.Certificate) -> None:
        key = enc.new_key(algorithm)
        value = b64(base64.b64encode(mangle(seal(algorithm, key, plaintext, pad=pad))).decode())
        ed = in_body(encrypted_data(algorithm, value, kind))
        use = key if key_len is None else os.urandom(key_len)
        enc.decrypt_data(ed, use, ALL_DATA, limits)

    return run


def _wrong_data_key(algorithm: str) -> Callable[[rsa.RSAPrivateKey, x509.Certificate], None]:
    def run(gw_key: rsa.RSAPrivateKey, client_cert: x509.Certificate) -> None:
        key = enc.new_key(algorithm)
        ed = in_body(encrypted_data(algorithm, seal(algorithm, key, b"<m:op>SECRET</m:op>")))
        enc.decrypt_data(ed, enc.new_key(algorithm), ALL_DATA, LIMITS)

    return run


def _key_for_someone_else(transport: str) -> Callable[[rsa.RSAPrivateKey, x509.Certificate], None]:
    """The EncryptedKey was made for the client's certificate; we only have the gateway's key."""

    def run(gw_key: rsa.RSAPrivateKey, client_cert: x509.Certificate) -> None:
        data = encrypt_envelope(client_cert, "aes256-gcm", transport)
        decrypt_envelope(data, gw_key, GCM, ALL_TRANSPORT)

    return run


def _rsa_1_5_garbage(gw_key: rsa.RSAPrivateKey, client_cert: x509.Certificate) -> None:
    """A PKCS#1 v1.5 block with broken padding: no early failure, a random key, then the data fails."""
    key = enc.new_key("aes256-gcm")
    ed = in_body(encrypted_data("aes256-gcm", seal("aes256-gcm", key, b"<m:op>SECRET</m:op>")))
    garbage = base64.b64encode(os.urandom(gw_key.key_size // 8)).decode()
    k = enc.decrypt_key(encrypted_key(XENC + "rsa-1_5", garbage), gw_key, ALL_TRANSPORT, 32)
    assert len(k) == 32  # the countermeasure: a key, not an error
    enc.decrypt_data(ed, k, ALL_DATA, LIMITS)


def _rsa_1_5_wrong_length(gw_key: rsa.RSAPrivateKey, client_cert: x509.Certificate) -> None:
    """A valid PKCS#1 v1.5 block holding a 16-byte key where the data algorithm needs 32."""
    key = enc.new_key("aes256-gcm")
    ed = in_body(encrypted_data("aes256-gcm", seal("aes256-gcm", key, b"<m:op>SECRET</m:op>")))
    block = gw_key.public_key().encrypt(key[:16], padding.PKCS1v15())
    k = enc.decrypt_key(encrypted_key(XENC + "rsa-1_5", base64.b64encode(block).decode()), gw_key, ALL_TRANSPORT, 32)
    assert len(k) == 32 and k[:16] != key[:16]
    enc.decrypt_data(ed, k, ALL_DATA, LIMITS)


def _oaep_wrong_length(gw_key: rsa.RSAPrivateKey, client_cert: x509.Certificate) -> None:
    block = gw_key.public_key().encrypt(os.urandom(16), OAEP_SHA1)
    enc.decrypt_key(encrypted_key(XENC + "rsa-oaep-mgf1p", base64.b64encode(block).decode()), gw_key, OAEP, 32)


def _oaep_truncated(gw_key: rsa.RSAPrivateKey, client_cert: x509.Certificate) -> None:
    block = gw_key.public_key().encrypt(os.urandom(32), OAEP_SHA1)
    enc.decrypt_key(encrypted_key(XENC + "rsa-oaep-mgf1p", base64.b64encode(block[:-8]).decode()), gw_key, OAEP, 32)


SMALL = Limits(max_depth=6, max_elements=10, max_attributes=2, max_text_length=64)

FAILURES: dict[str, Callable[[rsa.RSAPrivateKey, x509.Certificate], None]] = {
    "wrong key gcm": _wrong_data_key("aes256-gcm"),
    "wrong key cbc": _wrong_data_key("aes128-cbc"),
    "key for someone else oaep": _key_for_someone_else("rsa-oaep-mgf1p"),
    "key for someone else rsa-1_5": _key_for_someone_else("rsa-1_5"),
    "rsa-1_5 garbage block": _rsa_1_5_garbage,
    "rsa-1_5 wrong key length": _rsa_1_5_wrong_length,
    "oaep wrong key length": _oaep_wrong_length,
    "oaep truncated": _oaep_truncated,
    "data key of the wrong length": _data_case("aes256-gcm", key_len=16),
    "tampered gcm ciphertext": _data_case("aes128-gcm", mangle=lambda c: _flip(c, 14)),
    "tampered gcm tag": _data_case("aes128-gcm", mangle=lambda c: _flip(c, len(c) - 1)),
    "tampered gcm iv": _data_case("aes256-gcm", mangle=lambda c: _flip(c, 0)),
    "truncated gcm": _data_case("aes256-gcm", mangle=lambda c: c[:20]),
    "truncated gcm base64": _data_case("aes256-gcm", b64=lambda s: s[:-3]),
    "empty cipher value": _data_case("aes256-gcm", b64=lambda s: ""),
    "not base64": _data_case("aes256-gcm", b64=lambda s: "é" + s),
    "truncated cbc": _data_case("aes256-cbc", mangle=lambda c: c[:-5]),
    "cbc iv only": _data_case("aes256-cbc", mangle=lambda c: c[:16]),
    "cbc pad byte zero": _data_case("aes128-cbc", b"<m:op>SECRET</m:op>!!!!!!!!!!!!!", pad=bytes(15) + b"\x00"),
    "cbc pad byte 17": _data_case("aes128-cbc", b"<m:op>SECRET</m:op>!!!!!!!!!!!!!", pad=bytes(15) + b"\x11"),
    "cbc pad byte 255": _data_case("aes256-cbc", b"<m:op>SECRET</m:op>!!!!!!!!!!!!!", pad=bytes(15) + b"\xff"),
    "cbc padding cuts into the xml": _data_case("aes128-cbc", b"<m:op>SECRET</m:op>", pad=bytes(12) + b"\x10"),
    "gcm not xml": _data_case("aes256-gcm", b"SECRET <m:op> no end"),
    "cbc not xml": _data_case("aes256-cbc", b"<m:op>SECRET</x:op>"),
    "binary plaintext": _data_case("aes256-gcm", b"\xff\xfe\x00SECRET"),
    "undeclared prefix": _data_case("aes256-gcm", b"<nope:op>SECRET</nope:op>"),
    "doctype with entity": _data_case("aes256-gcm", b'<!DOCTYPE x [<!ENTITY e "SECRET">]><x>&e;</x>'),
    "external entity": _data_case("aes256-gcm", b'<!DOCTYPE x [<!ENTITY e SYSTEM "file:///etc/passwd">]><x>&e;</x>'),
    "undefined entity": _data_case("aes256-gcm", b"<x>&e;SECRET</x>"),
    "processing instruction": _data_case("aes256-gcm", b"<?secret SECRET?><x/>"),
    "xml declaration": _data_case("aes256-cbc", b'<?xml version="1.0"?><x>SECRET</x>'),
    "closes the wrapper": _data_case("aes256-gcm", b"</wsgate-fragment><x>SECRET</x><wsgate-fragment>"),
    "element type with two elements": _data_case("aes256-gcm", b"<a/><b>SECRET</b>", kind="Element"),
    "element type with text": _data_case("aes256-gcm", b"SECRET<a/>", kind="Element"),
    "element type with only text": _data_case("aes256-gcm", b"SECRET", kind="Element"),
    # The Body's EncryptedData sits at depth 3: with max_depth 6 the plaintext may nest four levels deep.
    "too deep": _data_case("aes256-gcm", b"<a><b><c><d><e>SECRET</e></d></c></b></a>", limits=SMALL),
    "too many elements": _data_case("aes256-gcm", b"<a/>" * 11, limits=SMALL),
    "too many attributes": _data_case("aes256-gcm", b'<a x="1" y="2" z="SECRET"/>', limits=SMALL),
    "text too long": _data_case("aes256-gcm", b"<a>" + b"SECRET" * 20 + b"</a>", limits=SMALL),
    "leading text too long": _data_case("aes256-gcm", b"SECRET" * 20, limits=SMALL),
}


@pytest.mark.parametrize("case", list(FAILURES))
def test_failures_are_one_failed_check(case: str, gw_key: rsa.RSAPrivateKey, client_cert: x509.Certificate) -> None:
    with pytest.raises(Fault) as info:
        FAILURES[case](gw_key, client_cert)
    fault = info.value
    # Same code, same client message, same everything the client can see: no oracle.
    assert (fault.code, fault.message, fault.code_ns, fault.http_status, fault.sender) == (
        REFERENCE.code,
        REFERENCE.message,
        REFERENCE.code_ns,
        REFERENCE.http_status,
        REFERENCE.sender,
    )
    assert faults.render(fault, "1.1") == faults.render(REFERENCE, "1.1")
    # The precise reason is for the log, and even there it holds no plaintext.
    assert fault.reason and "SECRET" not in fault.reason and "passwd" not in fault.reason


def test_limits_count_from_the_encrypted_data_position() -> None:
    """The depth limit is the document's: the plaintext at depth 3..6 passes with max_depth 6."""
    key = enc.new_key("aes256-gcm")
    ed = in_body(
        encrypted_data("aes256-gcm", seal("aes256-gcm", key, b'<a x="1" y="2"><b><c><d/></c></b></a>' + b"<e/>" * 6))
    )
    [body] = enc.decrypt_data(ed, key, GCM, SMALL)
    assert body.find("{urn:example:d}a/{urn:example:d}b/{urn:example:d}c/{urn:example:d}d") is not None


# --- structure -------------------------------------------------------------------------------------------


def test_structure_problems_are_invalid_security() -> None:
    key = enc.new_key("aes256-gcm")
    good = base64.b64encode(seal("aes256-gcm", key, b"<x/>")).decode()
    no_type = in_body(encrypted_data("aes256-gcm", good))
    del no_type.attrib["Type"]
    attachment = in_body(encrypted_data("aes256-gcm", good))
    attachment.set("Type", "http://docs.oasis-open.org/wss/oasis-wss-SwAProfile-1.1#Attachment-Content-Only")
    no_cipher_data = in_body(encrypted_data("aes256-gcm", good))
    no_cipher_data.remove(no_cipher_data.find(q(XENC, "CipherData")))
    two_values = in_body(encrypted_data("aes256-gcm", good))
    etree.SubElement(two_values.find(q(XENC, "CipherData")), q(XENC, "CipherValue")).text = good
    orphan = encrypted_data("aes256-gcm", good)
    for ed in (no_type, attachment, no_cipher_data, two_values, orphan):
        with pytest.raises(Fault) as info:
            enc.decrypt_data(ed, key, GCM, LIMITS)
        assert info.value.code == "InvalidSecurity"
    with pytest.raises(Fault) as info:
        enc.decrypt_data(etree.Element(q(XENC, "EncryptedKey")), key, GCM, LIMITS)
    assert info.value.code == "InvalidSecurity"


def test_reference_list() -> None:
    reflist = etree.fromstring(
        f'<xenc:ReferenceList xmlns:xenc="{XENC}"><xenc:DataReference URI="#ED-1"/><!-- c -->'
        '<xenc:DataReference URI="#ED-2"/></xenc:ReferenceList>'
    )
    assert enc.reference_list(reflist) == ["ED-1", "ED-2"]
    for bad in (
        '<xenc:DataReference URI="http://evil/x"/>',
        '<xenc:DataReference URI="#"/>',
        "<xenc:DataReference/>",
        '<xenc:KeyReference URI="#EK-1"/>',
    ):
        el = etree.fromstring(f'<xenc:ReferenceList xmlns:xenc="{XENC}">{bad}</xenc:ReferenceList>')
        with pytest.raises(Fault) as info:
            enc.reference_list(el)
        assert info.value.code == "InvalidSecurity"
    with pytest.raises(Fault):
        enc.reference_list(etree.Element(q(XENC, "EncryptedData")))


def test_embedded_encrypted_key_absent_with_a_token_reference() -> None:
    ed = encrypted_data("aes256-gcm", "AAAA")
    etree.SubElement(ed, q(DS, "KeyInfo")).append(security_token_reference())
    assert enc.embedded_encrypted_key(ed) is None
    assert enc.key_for(ed)[0].tag == q(WSSE, "SecurityTokenReference")


# --- interop with xmlsec (python-xmlsec 1.3 and the xmlsec1 tool) ------------------------------------------


def xmlsec_template(kind: str, data_uri: str, transport_uri: str, *method_children: str) -> etree._Element:
    children = "".join(method_children)
    return etree.fromstring(
        f'<xenc:EncryptedData xmlns:xenc="{XENC}" xmlns:ds="{DS}" Id="ED-X" Type="{XENC}{kind}">'
        f'<xenc:EncryptionMethod Algorithm="{data_uri}"/><ds:KeyInfo><xenc:EncryptedKey>'
        f'<xenc:EncryptionMethod Algorithm="{transport_uri}">{children}</xenc:EncryptionMethod>'
        "<xenc:CipherData><xenc:CipherValue/></xenc:CipherData></xenc:EncryptedKey></ds:KeyInfo>"
        "<xenc:CipherData><xenc:CipherValue/></xenc:CipherData></xenc:EncryptedData>"
    )


# python-xmlsec crashes encrypting Type Content when the content has text nodes (python-xmlsec issues 83 and
# 265): its envelope keeps element-only content at the Body level, prefixes still declared on the Envelope only.
XMLSEC_ENVELOPE = (
    f'<s:Envelope xmlns:s="{SOAP11}" xmlns:m="urn:example:m" xmlns:t="urn:example:t" xmlns="urn:example:d" '
    'xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance"><s:Header/>'
    '<s:Body><m:op m:a="1">x &amp; y<t:q xsi:type="t:Kind">SECRET</t:q><plain/></m:op><m:other/></s:Body>'
    "</s:Envelope>"
).encode()

XMLSEC_TRANSPORTS = {
    "mgf1p": (XENC + "rsa-oaep-mgf1p", "rsa-oaep-mgf1p", ()),
    "mgf1p-sha256": (
        XENC + "rsa-oaep-mgf1p",
        "rsa-oaep-mgf1p",
        (f'<ds:DigestMethod Algorithm="{XENC}sha256"/>',),
    ),
    "oaep11-sha256": (
        XENC11 + "rsa-oaep",
        "rsa-oaep",
        (
            f'<ds:DigestMethod Algorithm="{XENC}sha256"/>',
            f'<xenc11:MGF xmlns:xenc11="{XENC11}" Algorithm="{XENC11}mgf1sha256"/>',
        ),
    ),
}


@pytest.mark.parametrize("kind", ["Content", "Element"])
@pytest.mark.parametrize("algorithm", ALL_DATA)
@pytest.mark.parametrize("transport", list(XMLSEC_TRANSPORTS))
def test_we_decrypt_what_python_xmlsec_encrypts(
    pki: Path, gw_key: rsa.RSAPrivateKey, kind: str, algorithm: str, transport: str
) -> None:
    transport_uri, transport_name, children = XMLSEC_TRANSPORTS[transport]
    root = etree.fromstring(XMLSEC_ENVELOPE)
    body = root.find(q(SOAP11, "Body"))
    manager = xmlsec.KeysManager()
    manager.add_key(xmlsec.Key.from_file(str(pki / "gateway-enc.pem"), xmlsec.KeyFormat.CERT_PEM))
    ctx = xmlsec.EncryptionContext(manager)
    ctx.key = xmlsec.Key.generate(xmlsec.KeyData.AES, 8 * len(enc.new_key(algorithm)), xmlsec.KeyDataType.SESSION)
    template = xmlsec_template(kind, enc.DATA_ALGORITHMS[algorithm], transport_uri, *children)
    ctx.encrypt_xml(template, body if kind == "Content" else body.find("{urn:example:m}op"))
    data = etree.tostring(root)
    assert b"SECRET" not in data
    root, holders = decrypt_envelope(data, gw_key, [algorithm], [transport_name])
    assert canonical(root) == canonical(XMLSEC_ENVELOPE)
    if kind == "Element":
        assert [h.tag for h in holders] == ["{urn:example:m}op"]


@pytest.mark.parametrize("algorithm", ALL_DATA)
@pytest.mark.parametrize(
    ("transport", "digest", "mgf"),
    [
        ("rsa-oaep-mgf1p", "sha1", "sha1"),
        ("rsa-oaep-mgf1p", "sha256", "sha1"),
        ("rsa-oaep", "sha256", "sha256"),
    ],
)
def test_python_xmlsec_decrypts_what_we_encrypt(
    pki: Path, gw_cert: x509.Certificate, algorithm: str, transport: str, digest: enc.Digest, mgf: enc.Digest
) -> None:
    root = etree.fromstring(encrypt_envelope(gw_cert, algorithm, transport, digest=digest, mgf=mgf))
    manager = xmlsec.KeysManager()
    manager.add_key(xmlsec.Key.from_file(str(pki / "gateway-enc.key"), xmlsec.KeyFormat.PEM))
    xmlsec.EncryptionContext(manager).decrypt(root.find(f".//{q(XENC, 'EncryptedData')}"))
    # xmlsec keeps the declarations our serialization carried; compare the trees modulo those.
    assert etree.tostring(root, method="c14n") == etree.tostring(etree.fromstring(ENVELOPE), method="c14n")


xmlsec1 = pytest.mark.skipif(shutil.which("xmlsec1") is None, reason="the xmlsec1 tool is not installed")


@xmlsec1
@pytest.mark.parametrize("algorithm", ALL_DATA)
def test_xmlsec1_decrypts_what_we_encrypt(pki: Path, gw_cert: x509.Certificate, tmp_path: Path, algorithm: str) -> None:
    (tmp_path / "in.xml").write_bytes(encrypt_envelope(gw_cert, algorithm, "rsa-oaep-mgf1p"))
    out = subprocess.run(
        ["xmlsec1", "--decrypt", "--privkey-pem", str(pki / "gateway-enc.key"), str(tmp_path / "in.xml")],
        capture_output=True,
        check=True,
    ).stdout
    assert etree.tostring(etree.fromstring(out), method="c14n") == etree.tostring(
        etree.fromstring(ENVELOPE), method="c14n"
    )


@xmlsec1
@pytest.mark.parametrize("kind", ["Content", "Element"])
@pytest.mark.parametrize(("algorithm", "session"), [("aes256-gcm", "aes-256"), ("aes128-cbc", "aes-128")])
def test_we_decrypt_what_xmlsec1_encrypts(
    pki: Path, gw_key: rsa.RSAPrivateKey, tmp_path: Path, kind: str, algorithm: str, session: str
) -> None:
    (tmp_path / "doc.xml").write_bytes(ENVELOPE)
    template = xmlsec_template(kind, enc.DATA_ALGORITHMS[algorithm], XENC + "rsa-oaep-mgf1p")
    (tmp_path / "tmpl.xml").write_bytes(etree.tostring(template))
    node = f"{SOAP11}:Body" if kind == "Content" else "urn:example:m:op"
    out = subprocess.run(
        [
            "xmlsec1",
            "--encrypt",
            "--pubkey-cert-pem",
            str(pki / "gateway-enc.pem"),
            "--session-key",
            session,
            "--xml-data",
            str(tmp_path / "doc.xml"),
            "--node-name",
            node,
            str(tmp_path / "tmpl.xml"),
        ],
        capture_output=True,
        check=True,
    ).stdout
    assert b"SECRET" not in out
    assert b"\n" in out.split(b"CipherValue>")[1]  # xmlsec1 wraps its base64 lines
    root, _ = decrypt_envelope(out, gw_key, [algorithm], ["rsa-oaep-mgf1p"])
    assert canonical(root) == canonical(ENVELOPE)
