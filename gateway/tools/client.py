"""The WS-Security client: secures a plain SOAP request as a route's policy asks, and opens the secured reply.

`wsgate client` uses it for people; the load test uses it to pre-generate traffic and to check every response.
The securing and opening are the engine's requester (filters/engine/requester.py, which the gateway's outbound
routes run too); this module loads the requester's keys from files and talks HTTP."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import requests

from certs import pki
from filters.engine.faults import content_type
from filters.engine.requester import (
    Pending,
    Post,
    Requester,
    RequesterError,
    RequesterKeys,
    RequesterSettings,
    fault_text,
)
from filters.engine.wss import keys
from gateway.policy import Route

__all__ = ["Client", "ClientConfig", "ClientError", "Pending", "Post", "content_type", "fault_text", "http_post"]

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


def http_post(url: str, verify: str | bool = True, timeout: float = 30, soap_action: str | None = None) -> Post:
    """A Post over HTTP(S) with keep-alive."""
    session = requests.Session()
    extra = {"soapaction": f'"{soap_action}"'} if soap_action else {}

    def post(body: bytes, ctype: str) -> bytes:
        headers = {"content-type": ctype, **extra}
        return session.post(url, data=body, headers=headers, timeout=timeout, verify=verify).content

    return post


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
