"""Apache WSS4J 4.0.1's secure + verify of the engine's benchmark messages, in the same run (loadtest/engine_cpu.py).

The harness is tests/interop/wss4j (`make wss4j`), driven by tests/support/wss4j.py; its `bench` op times, in the JVM
thread's CPU time, WSS4J securing a fresh copy of the plain envelope and verifying it. The shapes mirror
loadtest/policies/bench.yaml's routes: Body and Timestamp signed with SHA-256 digests and exclusive C14N;
hmac: HMAC-SHA256 under the pre-shared key (WSS4J's custom key reference); rsa: RSA-SHA256, the certificate in a
BinarySecurityToken; rsa-encrypted: that, and the Body's content encrypted with AES-256-GCM under a key sent
RSA-OAEP to the gateway's certificate; secureconversation: a SecurityContextToken, HMAC-SHA256 and AES-256-GCM under
keys derived from it (P_SHA1)."""

from __future__ import annotations

import base64
import secrets
from pathlib import Path
from typing import Any

import yaml

from loadtest.messages import HMAC_KEY_NAME, plain_request
from tests.support import wss4j as harness

PROFILES = ("hmac", "rsa", "rsa-encrypted", "secureconversation")  # the shapes below
SIZES = ("small", "large")  # the huge point's cost is the backend's 1 MB response, which WSS4J would not see


def _shape(profile: str, certs: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """WSS4J's `secure` steps and `verify` parameters for one benchmark profile."""
    signed = [harness.part("Body", harness.SOAP11), harness.part("Timestamp", harness.WSU)]
    body = [harness.part("Body", harness.SOAP11, "Content")]
    trust = {"trust": [str(certs / "ca.pem")]}
    if profile == "hmac":
        key = yaml.safe_load((certs / "hmac-keys.yaml").read_text())["keys"][HMAC_KEY_NAME]
        sign = {"do": "sign", "with": "psk", "name": HMAC_KEY_NAME, "secret": key, "parts": signed}
        return [{"do": "timestamp"}, sign], {"secrets": {HMAC_KEY_NAME: key}}
    if profile == "rsa":
        return [{"do": "timestamp"}, harness.x509_sign(certs, signed)], trust
    if profile == "rsa-encrypted":
        steps = [{"do": "timestamp"}, harness.x509_sign(certs, signed), harness.encrypt_to_gateway(certs, body)]
        return steps, {**trust, "key": str(certs / "gateway-enc.key"), "cert": str(certs / "gateway-enc.pem")}
    if profile == "secureconversation":
        secret = base64.b64encode(secrets.token_bytes(32)).decode()
        context = {"do": "sct", "identifier": f"urn:uuid:{secrets.token_hex(16)}", "secret": secret}
        sign = {"do": "sign", "with": "sct", "parts": signed}
        # Sign, then encrypt the Body's content, in WSS4J's own (prepend) layout: the ReferenceList comes before the
        # Signature, so the Body is decrypted before the signature over its plaintext is checked. The keys are derived
        # from a context WSS4J knows by its identifier (the SecurityContextToken stays out of the header, as on the
        # gateway's own messages once a context is established).
        context["in_header"] = False
        return [{"do": "timestamp"}, context, sign, {"do": "encrypt", "with": "sct", "parts": body}], {}
    raise ValueError(f"no WSS4J shape for {profile!r}")


class Harness:
    """One WSS4J harness process for a benchmark run."""

    def __init__(self, process: harness.Wss4j) -> None:
        self.process = process

    @classmethod
    def start(cls) -> Harness | None:
        """The harness, or None when its jar is not built (the table then says so)."""
        if not harness.JAR.exists():
            return None
        return cls(harness.Wss4j())

    def bench(self, profile: str, size: str, certs: Path, seconds: float, warmup: float) -> float:
        """CPU us per secure + verify, one round of `seconds`."""
        steps, verify = _shape(profile, certs)
        xml, _ = plain_request(size, "wss4j")
        secure = {"xml": xml.decode(), "steps": steps, "layout": "prepend"}
        out = self.process.call("bench", secure=secure, verify=verify, round_s=seconds, warmup_s=warmup, rounds=1)
        return float(out["us"][0])

    def close(self) -> None:
        self.process.close()
