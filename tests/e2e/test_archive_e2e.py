"""The non-repudiation archive through the running gateway (docs/audit.md): a signed request is archived as it
arrived, with its signer's chain and ids, found by `wsgate audit search`, shown (decrypted with the body key
only), re-verified offline by `wsgate audit verify`, its stream intact by `wsgate audit verify-chain`; the
gateway's signed reply and a refusal are archived beside it."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from tests.support.archive import archived_route, audit, search, wait_for, with_message_id


def test_signed_request_archived_found_shown_and_reverified(gateway, pki: Path, tmp_path: Path) -> None:
    keep = ["signed_requests", "signed_replies", "refusals"]
    gw = gateway([archived_route(pki, "rsa", {"keep": keep, "directory": str(tmp_path / "archive")})])
    message_id = f"urn:uuid:{uuid.uuid4()}"
    secured, pending = gw.client("rsa").secure(with_message_id(message_id))
    resp = gw.post("rsa", secured)
    assert resp.status_code == 200, resp.text
    gw.client("rsa").open(resp.content, pending)  # the reply the gateway signed, as the client checks it
    assert gw.post("rsa", with_message_id("urn:uuid:unsigned")).status_code == 500  # no Security header

    (request,) = wait_for(gw, 1, "--message-id", message_id)
    assert (request["kind"], request["verdict"], request["route"]) == ("request", "accepted", "rsa")
    assert request["identity"].startswith("CN=") and request["size"] == len(secured)
    assert request["request_id"]  # Envoy's x-request-id, the id its access log names
    by_request = wait_for(gw, 2, "--request-id", request["request_id"])
    assert sorted(r["kind"] for r in by_request) == ["reply", "request"]
    refusals = wait_for(gw, 1, "--verdict", "refused")
    assert [r["kind"] for r in refusals] == ["refusal"]
    assert search(gw, "--identity", request["identity"], "--kind", "request") == [request]

    # The metadata without the key; the original bytes, exactly as received, only with the body key.
    shown = json.loads(audit(gw, "show", request["id"]).stdout)
    assert len(shown["chain"]) == 2 and shown["chain"][0] == request["identity"]  # the signer, then the CA
    on_disk = b"".join(p.read_bytes() for p in (tmp_path / "archive" / "default").glob("seg-*.jsonl"))
    assert message_id.encode() in on_disk and b"order 42" not in on_disk  # metadata readable, the body not
    original = tmp_path / "original.xml"
    audit(gw, "show", request["id"], "--key", str(pki / "gateway-enc.key"), "--out", str(original))
    assert original.read_bytes() == secured
    wrong = audit(gw, "show", request["id"], "--key", str(pki / "client.key"), check=False)
    assert wrong.returncode == 2 and "not to the key given" in wrong.stderr

    verified = audit(gw, "verify", request["id"], "--key", str(pki / "gateway-enc.key"))
    assert f"signature: valid, signed by {request['identity']}" in verified.stdout
    assert "in place" in verified.stdout
    chain = audit(gw, "verify-chain")
    assert "intact: 3 records" in chain.stdout, chain.stdout
    assert audit(gw, "verify-chain", "--since", request["at"][:19]).returncode == 0
