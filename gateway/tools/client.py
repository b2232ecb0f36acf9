"""The WS-Security client: secures a plain SOAP request as a route's policy asks, and opens the secured reply.

`wsgate client` uses it for people; the load test uses it to pre-generate traffic and to check every response.
The securing and opening are the engine's requester (filters/engine/requester.py, which the gateway's outbound
routes run too); this module loads the requester's keys from files and talks HTTP."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import requests

from certs import pki
from filters.engine import faults
from filters.engine.faults import content_type
from filters.engine.mime import package as mime
from filters.engine.mime.xop import XOP as XOP_NS
from filters.engine.requester import (
    Pending,
    Post,
    Requester,
    RequesterError,
    RequesterKeys,
    RequesterSettings,
    fault_text,
    saml_reference,
)
from filters.engine.wss import keys
from gateway.policy import Route

__all__ = ["Client", "ClientConfig", "ClientError", "Pending", "Post", "attachment", "content_type", "fault_text",
           "http_exchange", "http_post", "package", "saml_reference", "unpack"]  # fmt: skip

ClientError = RequesterError  # the reply was a SOAP fault, or did not verify


@dataclass
class ClientConfig(RequesterSettings):
    """Who the client is. Defaults: the demo PKI's client."""

    certs: Path = pki.DEFAULT_DIR
    key: str = "client.key"
    certificate: str = "client.pem"
    gateway_encryption_certificate: str = "gateway-enc.pem"
    ca: str = "ca.pem"

    def path(self, name: str) -> Path:
        p = Path(name)
        return p if p.is_absolute() else self.certs / p


Exchange = Callable[[bytes, str], tuple[str, bytes]]  # (body, content type) -> (reply content type, reply body)


def http_exchange(url: str, verify: str | bool = True, timeout: float = 30, soap_action: str | None = None) -> Exchange:
    """An Exchange over HTTP(S) with keep-alive."""
    session = requests.Session()
    extra = {"soapaction": f'"{soap_action}"'} if soap_action else {}

    def exchange(body: bytes, ctype: str) -> tuple[str, bytes]:
        headers = {"content-type": ctype, **extra}
        r = session.post(url, data=body, headers=headers, timeout=timeout, verify=verify)
        return r.headers.get("content-type", ""), r.content

    return exchange


def http_post(url: str, verify: str | bool = True, timeout: float = 30, soap_action: str | None = None) -> Post:
    """A Post over HTTP(S) with keep-alive: the reply's body only."""
    exchange = http_exchange(url, verify, timeout, soap_action)
    return lambda body, ctype: exchange(body, ctype)[1]


# ---- attachments: MTOM (the envelope holds xop:Include) or SOAP with Attachments (docs/attachments.md)

ROOT_ID = "root@wsgate-client"


def attachment(spec: str) -> mime.Part:
    """`FILE[:content-type]` (default application/octet-stream) as a part; its Content-ID is the file's name
    (characters a Content-ID cannot hold replaced by `_`): the request names it `cid:<name>`."""
    path, _, ctype = spec.partition(":")
    content_id = re.sub(r"[^A-Za-z0-9!#$&'*+\-./=?@^_`{|}~]", "_", Path(path).name)
    ctype = ctype or "application/octet-stream"
    headers = (("Content-Type", ctype), ("Content-Transfer-Encoding", "binary"), ("Content-ID", f"<{content_id}>"))
    return mime.Part(headers, content_id, ctype, Path(path).read_bytes())


def package(envelope: bytes, soap_version: str, attachments: list[mime.Part]) -> tuple[str, bytes]:
    """(Content-Type, body) of the envelope with its attachments: MTOM where it holds xop:Include, else SwA."""
    soap = content_type(soap_version).split(";")[0]
    is_xop = XOP_NS.encode() in envelope
    root_type = f'application/xop+xml; charset=utf-8; type="{soap}"' if is_xop else f"{soap}; charset=utf-8"
    headers = (("Content-Type", root_type), ("Content-Transfer-Encoding", "binary"), ("Content-ID", f"<{ROOT_ID}>"))
    boundary = f"uuid:{uuid.uuid4()}"
    outer = (
        f'multipart/related; type="{"application/xop+xml" if is_xop else soap}"; boundary="{boundary}"; '
        f'start="<{ROOT_ID}>"' + (f'; start-info="{soap}"' if is_xop else "")
    )
    root = mime.Part(headers, ROOT_ID, root_type, envelope)
    return outer, mime.serialize(mime.Package(root, tuple(attachments), ROOT_ID, boundary, outer))


def unpack(reply_type: str, reply: bytes, route: Route) -> tuple[bytes, tuple[mime.Part, ...]]:
    """A reply's envelope and attachments (none for a plain SOAP reply), checked as the gateway checks them."""
    if not mime.is_multipart(reply_type):
        return reply, ()
    try:
        pkg = mime.parse(reply_type, reply, route.attachments)
    except faults.Fault as f:
        raise ClientError(f"reply is not a valid package: {f.reason}") from None
    return bytes(pkg.root.body), pkg.attachments


class Client(Requester):
    """The requester for one route with the keys of a ClientConfig (the gateway is the recipient)."""

    def __init__(self, route: Route, cfg: ClientConfig | None = None) -> None:
        cfg = cfg or ClientConfig()
        enc_cert = cfg.path(cfg.gateway_encryption_certificate)
        loaded = RequesterKeys(
            private_key=keys.load_private_key(cfg.path(cfg.key)),
            certificate=keys.load_certificate(cfg.path(cfg.certificate)),
            recipient=keys.load_certificate(enc_cert) if enc_cert.exists() else None,
            trust=keys.TrustStore([keys.load_certificate(cfg.path(cfg.ca))]),
            psk=keys.load_hmac_keys(route.hmac.keys_file) if cfg.key_name and route.hmac.keys_file else {},
        )
        super().__init__(route, cfg, loaded)
        self.cfg: ClientConfig = cfg
