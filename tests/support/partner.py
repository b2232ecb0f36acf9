"""A partner service we did not write, for the outbound routes (docs/outbound.md): Apache WSS4J 4.0.1 (the
session's harness process, tests/support/wss4j.py) behind a real HTTPS server on loopback. Each request's Security
header is processed by WSS4J's WSSecurityEngine (BSP enforcement on); the reply is an echoResponse secured by
WSS4J's WSSec* builders, as the path's `Service` says. Tests may alter what goes back (`tamper`, `replay_next`,
`unsecured`) to play a hostile or broken partner."""

from __future__ import annotations

import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

import requests
import yaml
from lxml import etree

from tests.support.harness import LoopbackHttp
from tests.support.wss4j import Wss4j, Wss4jError, part, signed_parts, soap_ns, x509_sign
from tests.support.wss_helpers import DEMO, route_doc

# How the gateway names a pre-shared key (WSS4J writes it with CUSTOM_SYMM_SIGNING and this ValueType).
PRE_SHARED_KEY = "urn:wsgate:ws-security:PreSharedKey"
PARTNER_STEM = "client"  # the partner's own key and certificate in the demo PKI: CN=Demo Client
PARTNER_SUBJECT = "CN=Demo Client,O=WSGate Demo"


@dataclass
class Service:
    """What the partner does on one path: how it signs its reply (`x509` with the key `stem`, `psk`, or
    `received`: the key the request sent in an EncryptedKey, named by its EncryptedKeySHA1),
    whether it encrypts the reply to the gateway, the UsernameToken passwords it knows."""

    sign: str = "x509"
    stem: str = PARTNER_STEM
    encrypt_reply: bool = False
    users: dict[str, str] = field(default_factory=dict)


class Wss4jPartner(LoopbackHttp):
    protocol_version = "HTTP/1.1"  # keep-alive: the gateway pools its connections to the partner

    def __init__(self, wss4j: Wss4j, pki: Path, services: dict[str, Service]) -> None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(pki / "gateway-tls.pem", pki / "gateway-tls.key")  # SAN 127.0.0.1, the demo CA
        self.wss4j, self.pki, self.services = wss4j, pki, services
        self.psk = yaml.safe_load((pki / "hmac-keys.yaml").read_text())["keys"]["demo-client"]
        self.verified: list[dict[str, Any]] = []  # WSS4J's account of each request it took
        self.refused: list[str] = []  # WSS4J's reasons for those it did not
        self.headers: list[dict[str, str]] = []
        self.tamper: Callable[[bytes], bytes] | None = None
        self.unsecured = False  # answer plain SOAP
        self.replay_next = False  # answer the previous reply again
        self.last_reply = b""
        super().__init__(tls=context)

    def reset(self) -> None:
        self.verified.clear()
        self.refused.clear()
        self.headers.clear()
        self.tamper, self.unsecured, self.replay_next = None, False, False

    def respond(self, path: str, headers: dict[str, str], body: bytes) -> tuple[int, str, bytes]:
        service = next(s for prefix, s in self.services.items() if path.startswith(prefix))
        ctype = headers.get("Content-Type") or headers.get("content-type") or ""
        version = "1.2" if "soap+xml" in ctype else "1.1"
        self.headers.append({k.lower(): v for k, v in headers.items()})
        try:
            got = self.wss4j.verify(body, trust=[str(self.pki / "ca.pem")], key=str(self.pki / f"{PARTNER_STEM}.key"),
                                    cert=str(self.pki / f"{PARTNER_STEM}.pem"), secrets={"demo-client": self.psk},
                                    users=service.users)  # fmt: skip
        except Wss4jError as exc:
            self.refused.append(str(exc))
            return 500, ctype, fault(version)
        self.verified.append(got)
        text = etree.fromstring(got["xml"].encode()).findtext(f".//{{{DEMO}}}echo/{{{DEMO}}}text") or ""
        if self.replay_next:
            return 200, ctype, self.last_reply
        reply = echo_response(text, version)
        if not self.unsecured:
            reply = self.wss4j.secure(reply, self.steps(service, version, got))["xml"].encode()
        if self.tamper is not None:
            reply = self.tamper(reply)
        self.last_reply = reply
        return 200, ctype, reply

    def steps(self, service: Service, version: str, got: dict[str, Any]) -> list[dict[str, Any]]:
        parts = signed_parts(version, addressing=False)
        if service.sign == "received":
            sign = {"do": "sign", "with": "received", "encrypted_key_sha1": got["encrypted_key_sha1"], "parts": parts}
        elif service.sign == "psk":
            sign = {"do": "sign", "with": "psk", "name": "demo-client", "secret": self.psk,
                    "value_type": PRE_SHARED_KEY, "parts": parts}  # fmt: skip
        else:
            sign = x509_sign(self.pki, parts, stem=service.stem)
        steps: list[dict[str, Any]] = [{"do": "timestamp"}, sign]
        if service.encrypt_reply:
            steps.append({"do": "encrypt", "with": "x509", "cert": str(self.pki / "gateway-enc.pem"),
                          "parts": [part("Body", soap_ns(version), "Content")]})  # fmt: skip
        return steps


def echo_response(text: str, version: str) -> bytes:
    return (
        f'<soap:Envelope xmlns:soap="{soap_ns(version)}"><soap:Body><d:echoResponse xmlns:d="{DEMO}">'
        f"<d:text>{escape(text)}</d:text></d:echoResponse></soap:Body></soap:Envelope>"
    ).encode()


def fault(version: str) -> bytes:
    return (
        f'<soap:Envelope xmlns:soap="{soap_ns(version)}"><soap:Body><soap:Fault><faultcode>soap:Client</faultcode>'
        "<faultstring>refused by the partner</faultstring></soap:Fault></soap:Body></soap:Envelope>"
    ).encode()


def outbound_route(
    pki: Path, profile: str, name: str, partner: Wss4jPartner, listen: str, **extra: Any
) -> dict[str, Any]:
    """An outbound route to `partner` on the listener `listen`: the gateway signs with its signing key, replies
    must be signed by the partner's certificate (the demo CA, the partner's subject only)."""
    outbound = {"listen": listen, "partner_certificate": str(pki / f"{PARTNER_STEM}.pem"), **extra.pop("outbound", {})}
    doc = route_doc(pki, profile, name=name, **extra)
    doc["direction"] = "outbound"
    doc["outbound"] = outbound
    doc["upstream"] = {"address": partner.address, "tls": True, "ca": str(pki / "ca.pem"), "timeout_s": 10}
    doc["rsa"] = {**doc["rsa"], "allowed_subjects": [PARTNER_SUBJECT]}
    return doc


def post(listen: str, path: str, body: bytes, version: str = "1.1", **headers: str) -> requests.Response:
    """What an internal application sends: plain SOAP to the outbound listener."""
    ctype = "application/soap+xml; charset=utf-8" if version == "1.2" else "text/xml; charset=utf-8"
    return requests.post(f"http://{listen}{path}", data=body, headers={"content-type": ctype, **headers}, timeout=20)
