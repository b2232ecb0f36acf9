"""Outbound routes in the policy model and in Envoy's configuration (gateway/control/outbound_config.py): a
listener of their own, never the public ones; the partner over verified HTTPS; retries only where named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from filters.engine import faults, ns
from filters.engine.outbound import OutboundPipeline
from filters.engine.pipeline import Exchange
from filters.stores.factory import RouteStores
from gateway.control import envoy_config
from gateway.policy import PolicyError, PolicySet, Route
from tests.support import mime
from tests.support.wss_helpers import route_doc
from tests.unit.test_envoy_config import assert_envoy_accepts

TOPO = envoy_config.Topology()


def route(**changes: Any) -> dict[str, Any]:
    outbound = {"listen": "127.0.0.1:9300", "key_name": "demo-client", **changes.pop("outbound", {})}
    doc: dict[str, Any] = {
        "name": "partner",
        "match": {"path_prefix": "/tax/"},
        "upstream": {"address": "partner.example:443", "tls": True, "ca": "certs/out/ca.pem"},
        "profile": "hmac",
        "direction": "outbound",
        "outbound": outbound,
    }
    return {**doc, **changes}


def policies(*docs: dict[str, Any]) -> PolicySet:
    routes = [Route.model_validate(d) for d in docs]
    return PolicySet(routes=routes, sources={r.name: "routes.yaml" for r in routes})


def by_name(files: dict[str, str], kind: str) -> dict[str, Any]:
    return {r["name"]: r for r in yaml.safe_load(files[kind])["resources"]}


def route_names(listener: dict[str, Any]) -> set[str]:
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return {r["name"] for r in hcm["route_config"]["virtual_hosts"][0]["routes"]}


@pytest.mark.parametrize("listen", ["0.0.0.0:9300", "203.0.113.7:9300", "[::]:9300", "100.64.0.1:9300"])
def test_outbound_listener_on_a_public_address_without_mtls_is_refused(listen: str) -> None:
    with pytest.raises(ValidationError, match="private or loopback"):
        Route.model_validate(route(outbound={"listen": listen}))
    Route.model_validate(route(outbound={"listen": listen, "mtls": True}))


def test_outbound_partner_over_plain_http_is_refused() -> None:
    with pytest.raises(ValidationError, match="HTTPS only"):
        Route.model_validate(route(upstream={"address": "partner.example:80"}))


def test_outbound_encryption_without_the_partners_certificate_is_refused() -> None:
    with pytest.raises(ValidationError, match="encrypted to the partner"):
        Route.model_validate(route(profile="rsa", encryption={"require_request": True}))
    with pytest.raises(ValidationError, match="encrypted to the partner"):  # hmac's EncryptedKey goes to the partner
        Route.model_validate(route(outbound={"key_name": None}))


def test_outbound_route_is_served_on_its_own_listener_only() -> None:
    inbound = {"name": "inbound", "match": {"path_prefix": "/in/"}, "upstream": {"address": "127.0.0.1:8000"},
               "profile": "xml"}  # fmt: skip
    listeners = by_name(envoy_config.render(policies(route(), inbound), TOPO), "lds.yaml")
    assert "partner" not in route_names(listeners["http"]) | route_names(listeners["https"])
    assert "inbound" in route_names(listeners["http"])
    own = listeners["outbound_127_0_0_1_9300"]
    assert own["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 9300}
    assert "partner" in route_names(own) and "inbound" not in route_names(own)
    assert "transport_socket" not in own["filter_chains"][0]  # a private address: plain HTTP


def test_outbound_mtls_listener_requires_client_certificates() -> None:
    doc = route(outbound={"listen": "0.0.0.0:9300", "mtls": True})
    own = by_name(envoy_config.render(policies(doc), TOPO), "lds.yaml")["outbound_0_0_0_0_9300"]
    tls = own["filter_chains"][0]["transport_socket"]["typed_config"]
    assert tls["require_client_certificate"] is True
    assert tls["common_tls_context"]["validation_context"]["trusted_ca"]["filename"] == "certs/out/ca.pem"


def test_outbound_listener_on_a_public_listeners_port_is_refused() -> None:
    doc = route(outbound={"listen": f"127.0.0.1:{TOPO.http_port}"})
    with pytest.raises(PolicyError, match="public listener"):
        envoy_config.render(policies(doc), TOPO)


def test_outbound_partner_certificate_must_name_the_partner_and_client_certificate_is_presented() -> None:
    doc = route(outbound={"client_certificate": "certs/out/client.pem", "client_key": "certs/out/client.key"})
    cluster = by_name(envoy_config.render(policies(doc), TOPO), "cds.yaml")["upstream_partner"]
    tls = cluster["transport_socket"]["typed_config"]
    assert tls["sni"] == "partner.example"
    context = tls["common_tls_context"]
    assert context["validation_context"]["match_typed_subject_alt_names"] == [
        {"san_type": "DNS", "matcher": {"exact": "partner.example"}}
    ]
    assert context["validation_context"]["trusted_ca"]["filename"] == "certs/out/ca.pem"
    assert context["tls_certificates"][0]["certificate_chain"]["filename"] == "certs/out/client.pem"


def test_outbound_retry_only_for_the_operations_named_idempotent() -> None:
    doc = route(outbound={"retry": {"operations": ["urn:tax#status"], "attempts": 2}})
    own = by_name(envoy_config.render(policies(doc), TOPO), "lds.yaml")["outbound_127_0_0_1_9300"]
    entries = own["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    forwarded = [e for e in entries if e["name"] == "partner" and "route" in e]
    retried = [e for e in forwarded if "retry_policy" in e["route"]]
    assert retried and all("urn:tax#status" in str(e["match"]["headers"]) for e in retried)
    assert retried[0]["route"]["retry_policy"]["num_retries"] == 2
    catch_all = [e for e in forwarded if "retry_policy" not in e["route"]]
    assert catch_all and all("urn:tax#status" not in str(e["match"].get("headers")) for e in catch_all)
    assert forwarded.index(retried[-1]) < forwarded.index(catch_all[0])  # the named ones match first


def test_outbound_calls_carry_nothing_of_the_internal_network() -> None:
    own = by_name(envoy_config.render(policies(route()), TOPO), "lds.yaml")["outbound_127_0_0_1_9300"]
    entries = own["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    forwarded = [e for e in entries if e["name"] == "partner" and "route" in e]
    assert forwarded and all("x-forwarded-for" in e["request_headers_to_remove"] for e in forwarded)


def test_envoy_validates_rendered_outbound_config(tmp_path: Path, pki: Path) -> None:
    """Envoy itself accepts the outbound listener (mTLS) and the partner's cluster (client certificate, SAN)."""
    doc = route(outbound={"listen": "0.0.0.0:9300", "mtls": True, "client_ca": str(pki / "ca.pem"),
                          "server_certificate": str(pki / "gateway-tls.pem"), "server_key": str(pki / "gateway-tls.key"),
                          "client_certificate": str(pki / "client.pem"), "client_key": str(pki / "client.key"),
                          "retry": {"operations": ["urn:tax#status"]}},
                upstream={"address": "127.0.0.1:8443", "tls": True, "ca": str(pki / "ca.pem")})  # fmt: skip
    topo = envoy_config.Topology(certs_dir=str(pki), config_dir=str(tmp_path))
    files = envoy_config.render(policies(doc), topo)
    envoy_config.write(files, tmp_path)
    assert_envoy_accepts(files, tmp_path)


def test_outbound_import_maps_the_partners_policy_to_what_the_gateway_sends_and_requires() -> None:
    """The other side of the mapping table: a partner that requires encrypted requests and sends encrypted
    replies (CXF's sign-and-encrypt symmetric binding, with an encrypted UsernameToken) gets them encrypted to its
    certificate, and the gateway requires its replies encrypted."""
    from gateway.tools.wsdl_import import import_wsdl

    wsdl = Path(__file__).resolve().parents[1] / "wsdl" / "cxf-sign-enc-policy.wsdl"
    imported = import_wsdl(wsdl.read_bytes(), wsdl, str(wsdl), outbound="10.0.0.5:9300")
    [doc] = [r.route for r in imported.routes]
    r = Route.model_validate(doc)
    assert r.is_outbound and r.profile == "hmac" and r.upstream.tls
    assert r.encryption.require_request and r.encryption.encrypt_response
    assert r.outbound is not None and r.outbound.listen == "10.0.0.5:9300"
    assert r.outbound.partner_certificate and r.outbound.credentials_file and r.outbound.key_name is None
    assert r.username_token.protection == "encrypted"


def test_outbound_listener_in_compose_binds_the_containers_interfaces_on_the_routes_port() -> None:
    """In Compose the applications are other containers: the listener binds every interface of Envoy's
    container on the route's port, which docker-compose.yml publishes to no host port."""
    lds = by_name(envoy_config.render(policies(route()), envoy_config.compose_topology()), "lds.yaml")
    assert lds["outbound_127_0_0_1_9300"]["address"]["socket_address"] == {"address": "0.0.0.0", "port_value": 9300}
    compose = (Path(__file__).resolve().parents[2] / "docker-compose.yml").read_text()
    assert "9300" not in compose


def test_outbound_username_token_kept_by_tls_is_not_refused_on_its_plain_listener() -> None:
    """`protection: tls` names the partner's HTTPS (always), not the applications' listener: no 426 there."""
    doc = route(profile="rsa", username_token={"protection": "tls"}, outbound={"credentials_file": "creds.yaml",
                                                                               "password_type": "text"})  # fmt: skip
    assert not Route.model_validate(doc).https_only
    own = by_name(envoy_config.render(policies(doc), TOPO), "lds.yaml")["outbound_127_0_0_1_9300"]
    entries = own["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    assert [e for e in entries if e["name"] == "partner" and "route" in e]
    assert not [e for e in entries if e.get("direct_response", {}).get("status") == 426]


def test_a_multipart_message_on_an_outbound_route_that_takes_attachments_is_refused_as_not_soap(pki: Path) -> None:
    """The worker lends a multipart body, on a route that takes attachments, as a memoryview; an outbound route
    secures plain SOAP only: such a request is refused as the application's fault, such a reply as the partner's
    (502), as where the route takes no attachments; never an internal error."""
    doc = route_doc(pki, "rsa", name="out", attachments={"accept": True}, direction="outbound")
    doc["upstream"] = {"address": "partner.example:443", "tls": True, "ca": str(pki / "ca.pem")}
    doc["outbound"] = {"listen": "127.0.0.1:9300", "partner_certificate": str(pki / "client.pem")}
    pipeline = OutboundPipeline(Route.model_validate(doc), RouteStores())
    ct, body = mime.swa({"a@test": b"attached"})
    with pytest.raises(faults.Fault) as request:
        pipeline.request(memoryview(body), {"content-type": ct}, Exchange(pipeline.route))
    assert request.value.sender
    ex = Exchange(pipeline.route)
    plain = f'<s:Envelope xmlns:s="{ns.SOAP11}"><s:Body><echo xmlns="urn:t"/></s:Body></s:Envelope>'.encode()
    pipeline.request(plain, {"content-type": "text/xml"}, ex)
    with pytest.raises(faults.Fault) as reply:
        pipeline.response(memoryview(body), ex)
    assert reply.value.http_status == 502
