"""A partner service we did not write, for the outbound routes (docs/outbound.md): Apache WSS4J 4.0.1 (the
session's harness process, tests/support/wss4j.py) behind a real HTTPS server on loopback. Each request's Security
header is processed by WSS4J's WSSecurityEngine (BSP enforcement on); the reply is an echoResponse secured by
WSS4J's WSSec* builders, as the path's `Service` says. Tests may alter what goes back (`tamper`, `replay_next`,
`unsecured`, `sct_override`; the STS's Issue answers: `sts_tamper`, `sts_unsecured`) to play a hostile or broken
partner.

For `secureconversation` the partner has an STS path (`Service(sts=True)`): WSS4J verifies the signed WS-Trust
Issue, WSS4J's P_SHA1 computes the context's secret from both parties' entropy (ComputedKey; the secret stays in
the JVM), and the RSTR (built here) goes back signed by the partner and encrypted to the gateway; a Cancel signed
with the context's derived keys ends it. Its service paths (`Service(sign="sct")`) take requests secured with
keys derived from a context it issued and answer with keys derived from the same context."""

from __future__ import annotations

import ssl
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

import requests
import yaml
from lxml import etree

from tests.support.harness import LoopbackHttp
from tests.support.wss4j import WSU, Wss4j, Wss4jError, part, signed_parts, soap_ns, x509_sign
from tests.support.wss_helpers import DEMO, route_doc

# How the gateway names a pre-shared key (WSS4J writes it with CUSTOM_SYMM_SIGNING and this ValueType).
PRE_SHARED_KEY = "urn:wsgate:ws-security:PreSharedKey"
PARTNER_STEM = "client"  # the partner's own key and certificate in the demo PKI: CN=Demo Client
PARTNER_SUBJECT = "CN=Demo Client,O=WSGate Demo"
# WS-Trust 1.3 and WS-SecureConversation 1.3 (what the gateway asks for).
WST = "http://docs.oasis-open.org/ws-sx/ws-trust/200512"
WSC = "http://docs.oasis-open.org/ws-sx/ws-secureconversation/200512"
WSSE = "http://docs.oasis-open.org/wss/2004/01/oasis-200401-wss-wssecurity-secext-1.0.xsd"
WST_NS = f'xmlns:wst="{WST}"'
CONTEXT_LIFETIME = timedelta(hours=1)


@dataclass
class Service:
    """What the partner does on one path: how it signs its reply (`x509` with the key `stem`, `psk`,
    `received`: the key the request sent in an EncryptedKey, named by its EncryptedKeySHA1, `sct`: a key derived
    from the request's context, which must be one the partner issued, or `sct_direct`: that context's own key, the
    request's derived or not, as a policy without sp:RequireDerivedKeys), whether it encrypts the reply to the gateway
    (`sct`: with a derived key), the UsernameToken passwords it knows; `sts`: the path is the partner's STS."""

    sign: str = "x509"
    stem: str = PARTNER_STEM
    encrypt_reply: bool = False
    users: dict[str, str] = field(default_factory=dict)
    sts: bool = False


class Refused(Exception):
    """WSS4J took the message, but what it proved is not what the path requires."""


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
        self.sct_override: dict[str, str] = {}  # the reply's context: another "identifier", or "key" (secret)
        self.sts_tamper: Callable[[bytes], bytes] | None = None  # alters the STS's answers
        self.sts_unsecured = False  # the STS answers plain SOAP
        self.last_reply = b""
        self.issued: dict[str, str] = {}  # contexts issued: Identifier -> SHA-256 of the secret (in the JVM)
        self.cancelled: list[str] = []
        super().__init__(tls=context)

    def reset(self) -> None:
        self.verified.clear()
        self.refused.clear()
        self.headers.clear()
        self.paths.clear()
        self.tamper, self.unsecured, self.replay_next, self.sct_override = None, False, False, {}
        self.sts_tamper, self.sts_unsecured = None, False

    def respond(self, path: str, headers: dict[str, str], body: bytes) -> tuple[int, str, bytes]:
        service = next(s for prefix, s in self.services.items() if path.startswith(prefix))
        ctype = headers.get("Content-Type") or headers.get("content-type") or ""
        version = "1.2" if "soap+xml" in ctype else "1.1"
        self.headers.append({k.lower(): v for k, v in headers.items()})
        try:
            got = self.wss4j.verify(body, trust=[str(self.pki / "ca.pem")], key=str(self.pki / f"{PARTNER_STEM}.key"),
                                    cert=str(self.pki / f"{PARTNER_STEM}.pem"), secrets={"demo-client": self.psk},
                                    users=service.users)  # fmt: skip
            if service.sts:
                reply = self.sts(got, version, service)
                self.verified.append(got)
                return 200, ctype, reply
            context = self.context_of(got, direct=service.sign == "sct_direct") if "sct" in service.sign else None
        except (Wss4jError, Refused) as exc:
            self.refused.append(str(exc))
            return 500, ctype, fault(version)
        self.verified.append(got)
        text = etree.fromstring(got["xml"].encode()).findtext(f".//{{{DEMO}}}echo/{{{DEMO}}}text") or ""
        if self.replay_next:
            return 200, ctype, self.last_reply
        reply = echo_response(text, version)
        if not self.unsecured:
            reply = self.wss4j.secure(reply, self.steps(service, version, got, context))["xml"].encode()
        if self.tamper is not None:
            reply = self.tamper(reply)
        self.last_reply = reply
        return 200, ctype, reply

    def context_of(self, got: dict[str, Any], direct: bool = False) -> str:
        """The context whose derived key signed the Body (WSS4J found its secret, so it is one we issued);
        `direct`: or whose own key did (the signature's key is the context's secret)."""
        contexts = set(got["derived_from"]) & set(self.issued)
        if direct:
            contexts |= {i for i, digest in self.issued.items() if digest == got.get("signature_key_sha256")}
        if len(contexts) != 1 or not any(name.endswith("}Body") for name in got["signed"]):
            raise Refused(f"Body not signed with a key derived from one context we issued: {got['derived_from']}")
        return contexts.pop()

    def sts(self, got: dict[str, Any], version: str, service: Service) -> bytes:
        """WS-Trust Issue (authenticated by WSS4J: an X.509 signature, from the demo CA, over Body and Timestamp)
        or Cancel (signed with a key derived from the context it cancels): the RSTR, secured by WSS4J as the
        service's replies (the Issue's: signed by the partner's certificate, encrypted to the gateway)."""
        rst = etree.fromstring(got["xml"].encode()).find(f".//{{{WST}}}RequestSecurityToken")
        if rst is None:
            raise Refused("no RequestSecurityToken")
        request_type = rst.findtext(f"{{{WST}}}RequestType")
        if request_type == f"{WST}/Cancel":
            context = self.context_of(got, direct=True)  # as the context's services take it
            target = rst.find(f"{{{WST}}}CancelTarget/{{{WSSE}}}SecurityTokenReference/{{{WSSE}}}Reference")
            if target is None or target.get("URI") != context:
                raise Refused("Cancel of a context the request is not signed with")
            rstr = f"<wst:RequestSecurityTokenResponse {WST_NS}><wst:RequestedTokenCancelled/>"
            cancelled = envelope(version, rstr + "</wst:RequestSecurityTokenResponse>")
            # Answered with the context's keys, before it is forgotten.
            reply = self.wss4j.secure(cancelled, self.steps(replace(service, sign="sct"), version, got, context))
            self.wss4j.sc_cancel(context)
            self.cancelled.append(context)
            return str(reply["xml"]).encode()
        signed = set(got["signed"])
        if request_type != f"{WST}/Issue" or "signer" not in got or not {f"{{{WSU}}}Timestamp"} <= signed:
            raise Refused(f"{request_type}: not an Issue with an X.509-signed Timestamp")
        if f"{{{soap_ns(version)}}}Body" not in signed:
            raise Refused("Issue whose Body is not signed")
        entropy = rst.findtext(f"{{{WST}}}Entropy/{{{WST}}}BinarySecret")
        if not entropy:
            raise Refused("Issue without requestor entropy (this STS computes keys: ComputedKey P_SHA1)")
        bits = int(rst.findtext(f"{{{WST}}}KeySize") or 256)
        identifier = f"urn:uuid:{uuid.uuid4()}"
        issued = self.wss4j.sc_issue(identifier, entropy, bits)
        self.issued[identifier] = issued["secret_sha256"]
        reply = envelope(version, issue_rstr(identifier, issued["entropy"], bits, datetime.now(UTC)))
        if not self.sts_unsecured:
            reply = self.wss4j.secure(reply, self.steps(service, version, got))["xml"].encode()
        return self.sts_tamper(reply) if self.sts_tamper is not None else reply

    def steps(
        self, service: Service, version: str, got: dict[str, Any], context: str | None = None
    ) -> list[dict[str, Any]]:
        parts = signed_parts(version, addressing=False)
        body = [part("Body", soap_ns(version), "Content")]
        if service.sign == "sct":
            # Keys derived from the request's context, named by its Identifier (no SCT in the header).
            sct = {"do": "sct", "identifier": context, "in_header": False, **self.sct_override}
            steps = [{"do": "timestamp"}, sct, {"do": "sign", "with": "sct", "parts": parts}]
            if service.encrypt_reply:
                steps.append({"do": "encrypt", "with": "sct", "parts": body})
            return steps
        if service.sign == "sct_direct":  # the context's own key, named by its Identifier; signs only
            sct = {"do": "sct", "identifier": context, "in_header": False, **self.sct_override}
            return [{"do": "timestamp"}, sct, {"do": "sign", "with": "sct_direct", "parts": parts}]
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


def envelope(version: str, body: str) -> bytes:
    return f'<soap:Envelope xmlns:soap="{soap_ns(version)}"><soap:Body>{body}</soap:Body></soap:Envelope>'.encode()


def issue_rstr(identifier: str, issuer_entropy: str, bits: int, now: datetime) -> str:
    """WS-Trust 1.3's answer to an Issue (a collection of one RSTR): the SCT, references to it, the proof as a
    ComputedKey (P_SHA1 of both entropies) with the issuer's entropy, the context's lifetime."""
    stamp = "%Y-%m-%dT%H:%M:%SZ"
    sct = f'<wsc:SecurityContextToken wsu:Id="sct-1"><wsc:Identifier>{identifier}</wsc:Identifier></wsc:SecurityContextToken>'
    ref = (
        f'<wsse:SecurityTokenReference><wsse:Reference URI="{{}}" ValueType="{WSC}/sct"/></wsse:SecurityTokenReference>'
    )
    return (
        f'<wst:RequestSecurityTokenResponseCollection {WST_NS} xmlns:wsc="{WSC}" xmlns:wsse="{WSSE}" '
        f'xmlns:wsu="{WSU}"><wst:RequestSecurityTokenResponse>'
        f"<wst:TokenType>{WSC}/sct</wst:TokenType><wst:RequestedSecurityToken>{sct}</wst:RequestedSecurityToken>"
        f"<wst:RequestedAttachedReference>{ref.format('#sct-1')}</wst:RequestedAttachedReference>"
        f"<wst:RequestedUnattachedReference>{ref.format(identifier)}</wst:RequestedUnattachedReference>"
        f"<wst:RequestedProofToken><wst:ComputedKey>{WST}/CK/PSHA1</wst:ComputedKey></wst:RequestedProofToken>"
        f'<wst:Entropy><wst:BinarySecret Type="{WST}/Nonce">{issuer_entropy}</wst:BinarySecret></wst:Entropy>'
        f"<wst:Lifetime><wsu:Created>{now.strftime(stamp)}</wsu:Created>"
        f"<wsu:Expires>{(now + CONTEXT_LIFETIME).strftime(stamp)}</wsu:Expires></wst:Lifetime>"
        f"<wst:KeySize>{bits}</wst:KeySize></wst:RequestSecurityTokenResponse>"
        "</wst:RequestSecurityTokenResponseCollection>"
    )


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


ENCRYPTED = {"require_request": True, "encrypt_response": True}
SC_SERVICES = {
    "/sc/": Service(sign="sct", encrypt_reply=True),
    "/sc-signed/": Service(sign="sct"),
    "/sc-direct/": Service(sign="sct_direct"),
    "/sc-sts/": Service(sts=True, encrypt_reply=True),
}


def sc_outbound_route(pki: Path, partner: Wss4jPartner, listen: str, name: str = "sc") -> dict[str, Any]:
    """secureconversation to SC_SERVICES' `name`, the partner's STS at /sc-sts/: "sc" encrypts requests and
    replies with derived keys, "sc-signed" only signs. The context is shared by the workers through the
    gateway's Redis (and cancelled from there when the gateway stops)."""
    encryption = ENCRYPTED if name == "sc" else {}
    keys = {"derived_keys": name != "sc-direct"}  # sc-direct: the context's own key (no sp:RequireDerivedKeys)
    return outbound_route(pki, "secureconversation", name, partner, listen, encryption=encryption,
                          outbound={"sts_path": "/sc-sts/"}, replay={"store": "auto"}, secureconversation=keys)  # fmt: skip


def post(listen: str, path: str, body: bytes, version: str = "1.1", **headers: str) -> requests.Response:
    """What an internal application sends: plain SOAP to the outbound listener."""
    ctype = "application/soap+xml; charset=utf-8" if version == "1.2" else "text/xml; charset=utf-8"
    return requests.post(f"http://{listen}{path}", data=body, headers={"content-type": ctype, **headers}, timeout=20)
