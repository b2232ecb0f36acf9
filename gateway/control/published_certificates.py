"""The signing certificates a route publishes: the one its responses are signed with now (`rsa.certificate`) and,
during a rotation, the one they switch to on a later reload (`rsa.next_certificate`), so clients can trust the new
certificate before the first response signed with it (docs/keys.md "The signing key").

Published in the route's `?wsdl` (an optional WSDL 1.1 extension element in each wsdl:port, which clients that do
not know it skip) and by `wsgate certs published` as a PEM bundle. Deliberately not the WS-Addressing identity
of the port (WCF's and Metro's EndpointReference/Identity): clients encrypt to that certificate, and the gateway
decrypts with another key."""

from __future__ import annotations

import base64

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from lxml import etree

from filters.engine import ns
from filters.engine.wss import keys
from gateway.policy import Route

NS = "urn:wsgate:published-certificates"
ELEMENT = f"{{{NS}}}SigningCertificates"


def signing(route: Route) -> list[tuple[str, x509.Certificate]]:
    """("current", cert) and ("next", cert) where the policy names one; empty for a route that does not sign
    responses with a certificate (hmac's are signed with the client's key, none and xml are not signed)."""
    if route.profile not in ("rsa", "secureconversation"):
        return []
    out = [("current", keys.load_certificate(route.rsa.certificate))]
    if route.rsa.next_certificate:
        out.append(("next", keys.load_certificate(route.rsa.next_certificate)))
    return out


def wsdl_element(route: Route) -> etree._Element | None:
    """`<pc:SigningCertificates>` with a ds:KeyInfo per certificate (ds:KeyName current or next, ds:X509Data)."""
    certs = signing(route)
    if not certs:
        return None
    top = etree.Element(ELEMENT, nsmap={"pc": NS, "ds": ns.DS})
    for name, cert in certs:
        info = etree.SubElement(top, f"{{{ns.DS}}}KeyInfo")
        etree.SubElement(info, f"{{{ns.DS}}}KeyName").text = name
        data = etree.SubElement(info, f"{{{ns.DS}}}X509Data")
        der = cert.public_bytes(serialization.Encoding.DER)
        etree.SubElement(data, f"{{{ns.DS}}}X509Certificate").text = base64.b64encode(der).decode()
    return top


def publish(definitions: etree._Element, route: Route) -> None:
    """Add the route's signing certificates to every wsdl:port of a published WSDL (changed in place)."""
    element = wsdl_element(route)
    if element is None:
        return
    for port in definitions.iterfind(f"{{{ns.WSDL}}}service/{{{ns.WSDL}}}port"):
        port.append(etree.fromstring(etree.tostring(element)))


def pem_bundle(routes: list[Route]) -> str:
    """Each route's published certificates as PEM, each after a line saying which it is (text outside the PEM
    blocks, which OpenSSL and cryptography skip): a trust bundle clients can take whole."""
    out = []
    for route in routes:
        for name, cert in signing(route):
            fingerprint = cert.fingerprint(hashes.SHA256()).hex(":")
            out.append(f"# route {route.name}: {name} signing certificate {cert.subject.rfc4514_string()}, "
                       f"not after {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC, sha256 {fingerprint}\n"
                       + cert.public_bytes(serialization.Encoding.PEM).decode())  # fmt: skip
    return "".join(out)
