"""Policies -> Kubernetes manifests (`wsgate render --target kubernetes --out DIR`): the Compose topology as plain
manifests and a kustomization.yaml, so `kubectl apply -k DIR` runs it and an operator's overlay can change it.

Rendered from the same policy model as the local and Compose configurations (Envoy's is the Compose one with the
cluster's names), never templated from a second description of the policies. What Envoy and the filters read is
in ConfigMaps named by a hash of their content: a changed policy is a new ConfigMap, so the Deployments roll, old
pods keep their own config until they are gone, and each kind of pod drains before it stops (docs/operations.md
"Kubernetes"). Keys are never in the output: kustomize's secretGenerator reads them from DIR/keys/, where the
operator copies them."""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from certs import pki
from filters.engine.wss import token
from filters.engine.xml import wsdl
from gateway.control import envoy_config, kubernetes_pkcs11, rate_limit
from gateway.policy import DEFAULT_BODY_BUDGET_MB, GRACE_SECONDS, REDIS_URL_ENV, PolicyError, PolicySet, Route

NAMESPACE = "wsgate"
ENVOY, FILTER, REDIS, BACKEND = "wsgate-envoy", "wsgate-filter", "wsgate-redis", "wsgate-backend"
RATELIMIT = "wsgate-ratelimit"  # the Envoy rate-limit service, for routes with quotas (docs/quotas.md)
OUTBOUND = "wsgate-outbound"  # the outbound listeners' Service and NetworkPolicy (docs/outbound.md)
OUTBOUND_CLIENT = {"wsgate.io/outbound-client": "true"}  # the label of the applications' pods, any namespace
ENVOY_IMAGE = "envoyproxy/envoy:v1.40.0"  # the official image, as in Compose
REDIS_IMAGE = "redis:7-alpine"
WSGATE_IMAGE = "wsgate"  # the project's image (gateway/Dockerfile); the kustomization's `images:` names its registry
FILTER_PORT, METRICS_PORT, BACKEND_PORT, REDIS_PORT, DNS_PORT = 9000, 9102, 8081, 6379, 53
RATELIMIT_PORT, RATELIMIT_HEALTH_PORT, RATELIMIT_ROOT = 8081, 8080, "/data/ratelimit"
APP_UID = 101  # the envoy user of the Envoy image and the wsgate user of the project's image: both read the keys
REDIS_UID, REDIS_GID = 999, 1000  # the redis user of redis:7-alpine
KEYS_DIR = "keys"
RATELIMIT_REDIS_FILE = "ratelimit-redis-address"  # with --external-redis and quotas: host:port in keys/  # in DIR: the key files the secretGenerators read (copied there by the operator, never rendered)
POLICIES_MOUNT = "/app/policies"
MAX_CONFIG_MAP_BYTES = 900 * 1024  # the API server stores at most 1 MiB per object, base64 and keys included
FILTER_KEYS_MOUNT = f"/app/{pki.DEFAULT_DIR}"  # policies name key files relative to the image's /app
PART_OF = "app.kubernetes.io/part-of"
COMPONENT = "app.kubernetes.io/component"
# Envoy re-resolves the filters' headless Service every 5 s (its default dns_refresh_rate) and the cluster DNS
# caches its answers 5 s: a stopping filter keeps serving this long before it stops taking new exchanges.
DNS_SETTLE_S = 15
ENDPOINTS_SETTLE_S = 5  # Service endpoints and load balancers stop sending new connections to a stopping Envoy
ENVOY_HEAP_MB = 512
KEY_FILE_SUFFIXES = (".pem", ".key", ".crt", ".cer", ".der", ".crl", ".p12", ".yaml", ".yml")


@dataclass(frozen=True)
class Options:
    image: str = "wsgate:local"  # name:tag of the project's image, as the cluster pulls it
    demo_backend: bool = True
    redis: Literal["demo", "external"] = "demo"  # external: the URL from DIR/keys/redis-url, never rendered
    external_redis_port: int = REDIS_PORT
    envoy_replicas: tuple[int, int] = (2, 6)  # the HorizontalPodAutoscaler's min and max
    filter_replicas: tuple[int, int] = (2, 10)
    pkcs11_config: tuple[tuple[str, str], ...] = ()  # (ENV, file in keys/): a PKCS#11 module's configuration
    hsm_ports: tuple[int, ...] = ()  # TCP ports the filters may reach a network HSM on


def topology() -> envoy_config.Topology:
    """Compose's topology with the cluster's names: the filters' headless Service resolves to every ready pod."""
    return envoy_config.Topology(
        filter_endpoints=(f"{FILTER}:{FILTER_PORT}",), filter_dns=True, bind="0.0.0.0", certs_dir="/certs",
        config_dir="/config", max_heap_mb=ENVOY_HEAP_MB, outbound_bind="0.0.0.0",
        ratelimit=f"{RATELIMIT}:{RATELIMIT_PORT}",
    )  # fmt: skip


def labels(component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": component, COMPONENT: component.removeprefix("wsgate-"), PART_OF: "wsgate"}


def _meta(name: str, component: str) -> dict[str, Any]:
    return {"name": name, "labels": labels(component)}


def _hashed(prefix: str, data: dict[str, str]) -> str:
    """Content-addressed: a change is a new name, so pods roll and old pods keep the config they started with."""
    digest = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:10]
    return f"{prefix}-{digest}"


def _config_map(prefix: str, component: str, data: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(_hashed(prefix, data), component),
            "immutable": True, "data": data}  # fmt: skip


def _hardened(container: dict[str, Any]) -> dict[str, Any]:
    container["securityContext"] = {
        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
    }  # fmt: skip
    return container


def _pod(component: str, containers: list[dict[str, Any]], volumes: list[dict[str, Any]], grace_s: int,
         uid: int = APP_UID, gid: int = APP_UID) -> dict[str, Any]:  # fmt: skip
    return {
        "metadata": {"labels": labels(component)},
        "spec": {
            "automountServiceAccountToken": False,  # no pod talks to the Kubernetes API
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": grace_s,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": uid,
                "runAsGroup": gid,
                "fsGroup": gid,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            # Replicas on different nodes where there are nodes: one node lost is not the whole tier.
            "topologySpreadConstraints": [
                {
                    "maxSkew": 1,
                    "topologyKey": "kubernetes.io/hostname",
                    "whenUnsatisfiable": "ScheduleAnyway",
                    "labelSelector": {"matchLabels": labels(component)},
                }
            ],
            "containers": [_hardened(c) for c in containers],
            "volumes": volumes,
        },
    }


def _deployment(component: str, pod: dict[str, Any], replicas: int | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "selector": {"matchLabels": labels(component)},
        # A new pod is ready before an old one stops: no capacity lost while a policy change rolls out.
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
        "revisionHistoryLimit": 5,
        "template": pod,
    }
    if replicas is not None:  # none where an autoscaler owns the count: an apply would reset it
        spec = {"replicas": replicas, **spec}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(component, component), "spec": spec}


def _service(component: str, ports: list[tuple[str, int]], headless: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "selector": labels(component),
        "ports": [{"name": n, "port": p, "targetPort": n, "protocol": "TCP"} for n, p in ports],
    }
    if headless:
        spec["clusterIP"] = "None"
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(component, component), "spec": spec}


def _autoscaled(component: str, replicas: tuple[int, int]) -> list[dict[str, Any]]:
    """An HPA on CPU (the work is CPU: crypto, parsing) and a PodDisruptionBudget: one pod down at a time."""
    hpa = {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": _meta(component, component),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": component},
            "minReplicas": replicas[0], "maxReplicas": replicas[1],
            "metrics": [{"type": "Resource", "resource": {
                "name": "cpu", "target": {"type": "Utilization", "averageUtilization": 70}}}],
        },
    }  # fmt: skip
    pdb = {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _meta(component, component),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": labels(component)}},
    }  # fmt: skip
    return [hpa, pdb]


def _port(name: str, port: int) -> dict[str, Any]:
    return {"name": name, "containerPort": port, "protocol": "TCP"}


def _secret_volume(name: str, secret: str) -> dict[str, Any]:
    return {"name": name, "secret": {"secretName": secret, "defaultMode": 0o440}}


def _longest_exchange_s(policies: PolicySet, topo: envoy_config.Topology) -> int:
    """How long an exchange already under way can still take: its backend's timeout plus the filter's phases."""
    return math.ceil(max(r.upstream.timeout_s for r in policies.routes) + 2 * topo.filter_timeout_ms / 1000)


def envoy_objects(policies: PolicySet, topo: envoy_config.Topology, opts: Options) -> list[dict[str, Any]]:
    config = _config_map(f"{ENVOY}-config", ENVOY, envoy_config.render(policies, topo))
    drain_s = _longest_exchange_s(policies, topo)
    admin = topo.admin_port
    # Before SIGTERM (Envoy stops at once on it): stop taking new connections gracefully (HTTP/1.1 connection:
    # close, HTTP/2 GOAWAY) and give the exchanges under way their time. The image has bash, not curl.
    drain = (f'exec 3<>/dev/tcp/127.0.0.1/{admin} && printf "POST /drain_listeners?graceful HTTP/1.0\\r\\n\\r\\n" >&3;'
             f" sleep {drain_s + ENDPOINTS_SETTLE_S}")  # fmt: skip
    container = {
        "name": "envoy",
        "image": ENVOY_IMAGE,
        "command": ["envoy"],
        "args": [
            "-c",
            f"{topo.config_dir}/envoy.yaml",
            "--concurrency",
            "2",
            "--disable-hot-restart",
            "--drain-time-s",
            str(drain_s),
            "--drain-strategy",
            "immediate",
        ],
        "ports": [
            _port("http", topo.http_port),
            _port("https", topo.https_port),
            _port("admin", admin),
            *(_port(name, port) for name, port in _outbound_ports(policies)),
        ],
        "resources": {
            "requests": {"cpu": "500m", "memory": "256Mi"},
            "limits": {"cpu": "2", "memory": f"{ENVOY_HEAP_MB + 256}Mi"},
        },
        # Ready: Envoy's own /ready (503 while it initializes or drains); alive: its admin answers at all.
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "admin"}, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {
            "httpGet": {"path": "/server_info", "port": "admin"},
            "periodSeconds": 10,
            "timeoutSeconds": 3,
            "failureThreshold": 3,
        },
        "lifecycle": {"preStop": {"exec": {"command": ["bash", "-c", drain]}}},
        "volumeMounts": [
            {"name": "config", "mountPath": topo.config_dir, "readOnly": True},
            {"name": "tls", "mountPath": topo.certs_dir, "readOnly": True},
        ],
    }
    volumes = [{"name": "config", "configMap": {"name": config["metadata"]["name"]}},
               _secret_volume("tls", f"{ENVOY}-tls")]  # fmt: skip
    pod = _pod(ENVOY, [container], volumes, grace_s=drain_s + ENDPOINTS_SETTLE_S + 10)
    # An ordinary Service in front (ClusterIP: an overlay makes it a LoadBalancer with externalTrafficPolicy: Local,
    # so that Envoy sees the client's address, xff_num_trusted_hops: 0).
    service = _service(ENVOY, [("http", topo.http_port), ("https", topo.https_port)])
    objs = [config, _deployment(ENVOY, pod), service, *_autoscaled(ENVOY, opts.envoy_replicas)]
    if outbound := _outbound_ports(policies):
        # The applications' own Service: Envoy's pods, the outbound ports only (never behind the public one).
        objs.append({**_service(ENVOY, outbound), "metadata": _meta(OUTBOUND, OUTBOUND)})
    return objs


def _outbound_ports(policies: PolicySet) -> list[tuple[str, int]]:
    ports = sorted({r.outbound.port for r in policies.routes if r.outbound is not None})
    return [(f"outbound-{i}", p) for i, p in enumerate(ports)]


def filter_key_files(policies: PolicySet) -> list[str]:
    """Every key, certificate and key file the filters read (file names in certs/out), for their Secret."""
    prefix = f"{pki.DEFAULT_DIR}/"
    files: set[str] = set()
    for route in policies.routes:
        if route.upstream.ca:
            raise PolicyError(f"{policies.sources[route.name]}: route {route.name}: field upstream.ca: the "
                              "kubernetes target verifies upstreams against the system's CAs only")  # fmt: skip
        if route.outbound is not None and (route.outbound.mtls or route.outbound.client_certificate):
            raise PolicyError(f"{policies.sources[route.name]}: route {route.name}: field outbound: the kubernetes "
                              "target renders no mtls listener or client certificate for outbound routes yet: the "
                              "NetworkPolicy admits the applications")  # fmt: skip
        for value in _key_settings(route):
            name = value.removeprefix(prefix)
            if value.endswith(KEY_FILE_SUFFIXES) and (name == value or "/" in name):
                raise PolicyError(f"{policies.sources[route.name]}: route {route.name}: {value}: key files "
                                  f"must be directly in {prefix} (one Secret, mounted there)")  # fmt: skip
            if name != value:
                files.add(name)
    return sorted(files)


def _key_settings(route: Route) -> list[str]:
    """What the profile's pipeline loads (filters/engine/profiles.py), nothing the route only carries as a default."""
    if route.profile not in ("hmac", "rsa", "secureconversation", "saml"):
        return []  # no keys: `none` and `tls` never reach the filters, `xml` checks structure only
    sections: list[Any] = [route.username_token, route.hmac if route.profile == "hmac" else route.rsa]
    if route.profile == "secureconversation" and route.secureconversation.store == "sealed" and not route.is_outbound:
        sections.append(route.secureconversation)
    if route.outbound is not None:  # the partner's certificate, the credentials file
        sections.append(route.outbound)
    if route.saml is not None:
        sections.append(route.saml)
    return [v for section in sections for v in _strings(section.model_dump())]


def filter_tokens(policies: PolicySet, opts: Options) -> kubernetes_pkcs11.Tokens | None:
    """The PKCS#11 tokens the filters open (their keys' pkcs11: URIs): the Secret, mounts and variables they need."""
    uris = {v: f"{policies.sources[r.name]}: route {r.name}" for r in policies.routes for v in _key_settings(r)
            if token.is_uri(v)}  # fmt: skip
    reserved = (POLICIES_MOUNT, FILTER_KEYS_MOUNT, "/tmp")
    return kubernetes_pkcs11.tokens(uris, dict(opts.pkcs11_config), reserved)


def schema_documents(policies: PolicySet) -> dict[str, tuple[str, bytes]]:
    """The WSDL and XSD files the filters read (each route's `wsdl.file` and `xsd_files` with everything they
    import): ConfigMap key -> (the path the pod reads it by, its bytes). The policies name them relative to the
    working directory, as the pod's /app is; Envoy needs none of them (published documents are in its config)."""
    cwd = Path.cwd().resolve()
    found: dict[str, bytes] = {}
    for route in policies.routes:
        named = [*([route.wsdl.file] if route.wsdl else []), *route.schema_validation.xsd_files]
        for path in named:
            try:
                documents = wsdl.load(path).documents
            except wsdl.DocumentError as exc:
                raise PolicyError(f"{policies.sources[route.name]}: route {route.name}: {exc}") from None
            for doc in documents:
                pod_path = f"/app/{doc.path.relative_to(cwd)}" if doc.path.is_relative_to(cwd) else str(doc.path)
                found[pod_path] = doc.path.read_bytes()
    # ConfigMap keys allow [-._a-zA-Z0-9] only: numbered, with the file's own name for a reader.
    return {
        f"{i}-{re.sub(r'[^-._a-zA-Z0-9]', '_', Path(p).name)}": (p, b) for i, (p, b) in enumerate(sorted(found.items()))
    }


def _strings(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def _check_shared_state(policies: PolicySet) -> None:
    """Every replica must see every replay and every context: per-process stores would let a replay through on
    another pod, and lose contexts."""
    for r in policies.routes:
        where = f"{policies.sources[r.name]}: route {r.name}"
        if r.detects_replays and r.replay.store == "memory":
            raise PolicyError(f"{where}: field replay.store: memory misses replays that reach another filter pod")
        if r.profile == "secureconversation" and r.secureconversation.store == "memory":
            raise PolicyError(f"{where}: field secureconversation.store: memory contexts exist on one pod only")


_ENV = re.compile(r"\$\{([A-Z_][A-Z0-9_]*)")


def _policy_env(texts: dict[str, str]) -> list[dict[str, str]]:
    """The variables the policy files name, as they were when Envoy's config was rendered: the filters read the
    same files and must resolve them the same way."""
    names = sorted({m for text in texts.values() for m in _ENV.findall(text)} - {REDIS_URL_ENV})
    return [{"name": n, "value": os.environ[n]} for n in names if n in os.environ]


def filter_objects(policies: PolicySet, texts: dict[str, str], topo: envoy_config.Topology,
                   opts: Options) -> list[dict[str, Any]]:  # fmt: skip
    config = _config_map(f"{FILTER}-policies", FILTER, texts)
    # Stopping: still serving until Envoy's DNS has dropped the pod, then the streams it had opened finish (each
    # lasts its whole exchange, the backend's time included); SIGTERM then gives the frame's own grace.
    stop_after_s = DNS_SETTLE_S + _longest_exchange_s(policies, topo)
    redis_url = {"name": REDIS_URL_ENV, "valueFrom": {"secretKeyRef": {"name": f"{REDIS}-url", "key": "url"}}}
    container: dict[str, Any] = {
        "name": "filter",
        "image": WSGATE_IMAGE,
        "command": [
            "wsgate",
            "filter",
            "--policies",
            POLICIES_MOUNT,
            "--listen",
            f"0.0.0.0:{FILTER_PORT}",
            "--metrics-port",
            str(METRICS_PORT),
            "--body-budget-mb",
            str(DEFAULT_BODY_BUDGET_MB),
        ],
        "ports": [_port("grpc", FILTER_PORT), _port("metrics", METRICS_PORT)],
        "env": [redis_url, *_policy_env(texts)],
        # One worker per pod, one Python thread: a core is all it can use; the body budget bounds its memory.
        "resources": {"requests": {"cpu": "500m", "memory": "256Mi"}, "limits": {"cpu": "1", "memory": "768Mi"}},
        # Ready once it listens (it loads the policies and keys first); alive while its Python thread answers.
        "readinessProbe": {"tcpSocket": {"port": "grpc"}, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {
            "httpGet": {"path": "/metrics", "port": "metrics"},
            "periodSeconds": 10,
            "timeoutSeconds": 3,
            "failureThreshold": 3,
        },
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(stop_after_s)]}}},
        "volumeMounts": [
            {"name": "policies", "mountPath": POLICIES_MOUNT, "readOnly": True},
            {"name": "keys", "mountPath": FILTER_KEYS_MOUNT, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    volumes = [{"name": "policies", "configMap": {"name": config["metadata"]["name"]}},
               _secret_volume("keys", f"{FILTER}-keys"), {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}]  # fmt: skip
    tokens = filter_tokens(policies, opts)
    if tokens:
        container["env"] += tokens.env
        container["volumeMounts"] += tokens.mounts
        volumes += tokens.volumes
    objects = [config]
    documents = schema_documents(policies)
    if documents:
        # Each document at the very path the policies name it by (subPath: one file each); immutable and named
        # after its content like the policies, so a changed WSDL rolls the filters.
        data = {k: base64.b64encode(b).decode() for k, (_, b) in documents.items()}
        if sum(len(k) + len(v) for k, v in data.items()) > MAX_CONFIG_MAP_BYTES:
            raise PolicyError(f"the WSDL and schema files take over {MAX_CONFIG_MAP_BYTES} bytes in a ConfigMap")
        schemas = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(_hashed(f"{FILTER}-schemas", data),
                   FILTER), "immutable": True, "binaryData": data}  # fmt: skip
        objects.append(schemas)
        volumes.append({"name": "schemas", "configMap": {"name": schemas["metadata"]["name"]}})
        container["volumeMounts"] += [{"name": "schemas", "mountPath": path, "subPath": key, "readOnly": True}
                                      for key, (path, _) in documents.items()]  # fmt: skip
    pod = _pod(FILTER, [container], volumes, grace_s=stop_after_s + math.ceil(GRACE_SECONDS) + 5)
    # Headless: one DNS name with every ready pod's address; Envoy's STRICT_DNS cluster balances over them.
    service = _service(FILTER, [("grpc", FILTER_PORT)], headless=True)
    return [*objects, _deployment(FILTER, pod), service, *_autoscaled(FILTER, opts.filter_replicas)]


def redis_objects() -> list[dict[str, Any]]:
    """The demo's Redis: one pod, nothing on disk (replay entries and contexts are short-lived), never evicting
    (a full store refuses rather than forgets). Production points the filters at its own Redis instead."""
    container = {
        "name": "redis",
        "image": REDIS_IMAGE,
        "command": ["redis-server", "--save", "", "--appendonly", "no", "--maxmemory-policy", "noeviction"],
        "ports": [_port("redis", REDIS_PORT)],
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"cpu": "1", "memory": "512Mi"}},
        "readinessProbe": {"exec": {"command": ["redis-cli", "ping"]}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 10},
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    }
    pod = _pod(REDIS, [container], [{"name": "data", "emptyDir": {}}], grace_s=10, uid=REDIS_UID, gid=REDIS_GID)
    stateful_set = {
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": _meta(REDIS, REDIS),
        "spec": {"serviceName": REDIS, "replicas": 1, "selector": {"matchLabels": labels(REDIS)}, "template": pod},
    }  # fmt: skip
    return [stateful_set, _service(REDIS, [("redis", REDIS_PORT)], headless=True)]


def ratelimit_objects(policies: PolicySet, opts: Options) -> list[dict[str, Any]]:
    """The rate-limit service (routes with quotas): stateless replicas counting in the filters' Redis, their
    configuration in a ConfigMap named by its content, so a changed limit rolls them (the counts stay in Redis)."""
    config = _config_map(f"{RATELIMIT}-config", RATELIMIT, {"wsgate.yaml": rate_limit.service_config(policies)})
    settings = rate_limit.environment(f"0.0.0.0:{RATELIMIT_PORT}", Path(RATELIMIT_ROOT),
                                      f"redis://{REDIS}:{REDIS_PORT}/0", health=f"0.0.0.0:{RATELIMIT_HEALTH_PORT}")  # fmt: skip
    env = [{"name": k, "value": v} for k, v in settings.items()]
    if opts.redis == "external":  # host:port of the operator's Redis, from keys/ (its URL is a secret too)
        ref = {"secretKeyRef": {"name": f"{RATELIMIT}-redis", "key": "address"}}
        env = [e if e["name"] != "REDIS_URL" else {"name": "REDIS_URL", "valueFrom": ref} for e in env]
    health = {"httpGet": {"path": "/healthcheck", "port": "health"}, "periodSeconds": 5}
    container = {
        "name": "ratelimit",
        "image": rate_limit.image(),
        "command": ["/bin/ratelimit"],
        "ports": [_port("grpc", RATELIMIT_PORT), _port("health", RATELIMIT_HEALTH_PORT)],
        "env": env,
        "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"cpu": "1", "memory": "256Mi"}},
        "readinessProbe": health,
        "livenessProbe": {**health, "periodSeconds": 10, "timeoutSeconds": 3, "failureThreshold": 3},
        "volumeMounts": [{"name": "config", "mountPath": f"{RATELIMIT_ROOT}/config", "readOnly": True}],
    }
    pod = _pod(RATELIMIT, [container], [{"name": "config", "configMap": {"name": config["metadata"]["name"]}}], 10)
    return [config, _deployment(RATELIMIT, pod, replicas=2), _service(RATELIMIT, [("grpc", RATELIMIT_PORT)])]


def backend_objects() -> list[dict[str, Any]]:
    """The demo SOAP backend (optional: `--no-demo-backend`)."""
    health = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5}
    container = {
        "name": "backend",
        "image": WSGATE_IMAGE,
        "command": ["wsgate", "backend", "--listen", f"0.0.0.0:{BACKEND_PORT}"],
        "ports": [_port("http", BACKEND_PORT)],
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"cpu": "1", "memory": "512Mi"}},
        "readinessProbe": health,
        "livenessProbe": {**health, "periodSeconds": 10},
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    pod = _pod(BACKEND, [container], [{"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}], grace_s=10)
    return [_deployment(BACKEND, pod, replicas=1), _service(BACKEND, [("http", BACKEND_PORT)])]


def _pods_of(component: str) -> dict[str, Any]:
    return {"podSelector": {"matchLabels": labels(component)}}


def _tcp(*ports: int) -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": p} for p in ports]


def _network_policy(name: str, selector: dict[str, Any], ingress: list[Any] | None = None,
                    egress: list[Any] | None = None) -> dict[str, Any]:  # fmt: skip
    spec: dict[str, Any] = {"podSelector": selector, "policyTypes": []}
    for kind, rules in (("Ingress", ingress), ("Egress", egress)):
        if rules is not None:
            spec["policyTypes"].append(kind)
            spec[kind.lower()] = rules
    # Labelled with the component it guards: `kubectl apply -l app.kubernetes.io/component=...` takes it along.
    meta = {"name": name, "labels": labels(name) if name.startswith("wsgate-") else {PART_OF: "wsgate"}}
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": meta, "spec": spec}


def _upstream_egress(routes: list[Route], opts: Options) -> list[dict[str, Any]]:
    """Envoy -> the backends: the demo backend's pods, or what the policies name: an IP as itself, a name as its
    port anywhere (a NetworkPolicy cannot name a host)."""
    rules: list[dict[str, Any]] = []
    for host, port in sorted({(r.upstream.host, r.upstream.port) for r in routes}):
        if opts.demo_backend and host == BACKEND and port == BACKEND_PORT:
            rule = {"to": [_pods_of(BACKEND)], "ports": _tcp(port)}
        else:
            rule = _egress_to(host, port)
        if rule not in rules:
            rules.append(rule)
    return rules


def _egress_to(host: str, port: int | str) -> dict[str, Any]:
    """To `host`:`port`: the address itself when it is one, else the port anywhere (a policy cannot name a host)."""
    host = host.strip("[]")
    if envoy_config.is_ip(host):
        return {"to": [{"ipBlock": {"cidr": str(ipaddress.ip_network(host))}}], "ports": _tcp(int(port))}
    return {"ports": _tcp(int(port))}


def network_policies(policies: PolicySet, topo: envoy_config.Topology, opts: Options) -> list[dict[str, Any]]:
    """Nothing in the namespace talks unless listed: clients -> Envoy's listeners, Envoy -> filters and backends,
    filters -> Redis, Envoy and filters -> the cluster DNS."""
    dns = {"to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                   "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}],
           "ports": [{"protocol": "UDP", "port": DNS_PORT}, {"protocol": "TCP", "port": DNS_PORT}]}  # fmt: skip
    inbound = [r for r in policies.routes if not r.is_outbound]
    outbound = [r for r in policies.routes if r.is_outbound]
    sts = [r for r in outbound if r.profile == "secureconversation"]  # the filters ask the partner's STS
    if opts.redis == "demo":
        to_redis = {"to": [_pods_of(REDIS)], "ports": _tcp(REDIS_PORT)}
    else:
        to_redis = {"ports": _tcp(opts.external_redis_port)}
    # Both send spans to the trace collector (edge.tracing, docs/tracing.md): by address when it is one.
    collector = policies.edge.tracing.collector if policies.edge.tracing else None
    traces = [] if collector is None else [_egress_to(*collector.rsplit(":", 1))]
    quotas = rate_limit.enabled(policies)  # Envoy -> the rate-limit service -> Redis
    to_ratelimit = [{"to": [_pods_of(RATELIMIT)], "ports": _tcp(RATELIMIT_PORT)}] if quotas else []
    out = [
        _network_policy("default-deny", {}, ingress=[], egress=[]),
        _network_policy(ENVOY, _pods_of(ENVOY)["podSelector"], ingress=[{"ports": _tcp(topo.http_port, topo.https_port)}],
                        egress=[{"to": [_pods_of(FILTER)], "ports": _tcp(FILTER_PORT)}, *to_ratelimit,
                                *_upstream_egress(inbound, opts), dns, *traces]),
        _network_policy(FILTER, _pods_of(FILTER)["podSelector"],
                        ingress=[{"from": [_pods_of(ENVOY)], "ports": _tcp(FILTER_PORT)}],
                        egress=[to_redis, *_upstream_egress(sts, opts), dns, *traces,
                                *kubernetes_pkcs11.egress(opts.hsm_ports)]),
    ]  # fmt: skip
    if outbound:
        # Applications in (pods labelled OUTBOUND_CLIENT, any namespace), partners out.
        apps = {"namespaceSelector": {}, "podSelector": {"matchLabels": OUTBOUND_CLIENT}}
        ports = _tcp(*(p for _, p in _outbound_ports(policies)))
        out.append(_network_policy(OUTBOUND, _pods_of(ENVOY)["podSelector"], ingress=[{"from": [apps], "ports": ports}],
                                   egress=_upstream_egress(outbound, opts)))  # fmt: skip
    if quotas:
        out.append(_network_policy(RATELIMIT, _pods_of(RATELIMIT)["podSelector"], egress=[to_redis, dns],
                                   ingress=[{"from": [_pods_of(ENVOY)], "ports": _tcp(RATELIMIT_PORT)}]))  # fmt: skip
    if opts.redis == "demo":
        clients = [_pods_of(FILTER), *([_pods_of(RATELIMIT)] if quotas else [])]
        out.append(_network_policy(REDIS, _pods_of(REDIS)["podSelector"],
                                   ingress=[{"from": clients, "ports": _tcp(REDIS_PORT)}]))  # fmt: skip
    if opts.demo_backend:
        out.append(_network_policy(BACKEND, _pods_of(BACKEND)["podSelector"],
                                   ingress=[{"from": [_pods_of(ENVOY)], "ports": _tcp(BACKEND_PORT)}]))  # fmt: skip
    return out


def envoy_key_files(topo: envoy_config.Topology, envoy_files: dict[str, str]) -> list[str]:
    """The files Envoy's rendered config reads from its Secret's mount."""
    found = re.findall(
        rf"filename: {re.escape(topo.certs_dir)}/(\S+)", envoy_files["lds.yaml"] + envoy_files["cds.yaml"]
    )
    return sorted(set(found))


def kustomization(resources: list[str], envoy_keys: list[str], filter_keys: list[str], opts: Options,
                  token_files: list[str], quotas: bool = False) -> dict[str, Any]:  # fmt: skip
    def generator(name: str, component: str, **source: list[str]) -> dict[str, Any]:
        return {"name": name, **source, "options": {"labels": labels(component)}}

    if opts.redis == "demo":
        redis_url = generator(f"{REDIS}-url", FILTER, literals=[f"url=redis://{REDIS}:{REDIS_PORT}/0"])
    else:
        redis_url = generator(f"{REDIS}-url", FILTER, files=[f"url={KEYS_DIR}/redis-url"])
    # name:tag, the name possibly with a registry's host:port
    name, tag = opts.image.rsplit(":", 1) if ":" in opts.image.rsplit("/", 1)[-1] else (opts.image, "latest")
    return {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": NAMESPACE,
        "resources": resources,
        # Keys come from files the operator puts in keys/; the Secrets' names get a hash of their content, so a
        # rotated key rolls the pods that read it.
        "secretGenerator": [
            generator(f"{ENVOY}-tls", ENVOY, files=[f"{KEYS_DIR}/{f}" for f in envoy_keys]),
            generator(f"{FILTER}-keys", FILTER, files=[f"{KEYS_DIR}/{f}" for f in filter_keys]),
            redis_url,
            *(
                [generator(kubernetes_pkcs11.SECRET, FILTER, files=[f"{KEYS_DIR}/{f}" for f in token_files])]
                if token_files
                else []
            ),
            *(
                [generator(f"{RATELIMIT}-redis", RATELIMIT, files=[f"address={KEYS_DIR}/{RATELIMIT_REDIS_FILE}"])]
                if quotas and opts.redis == "external"
                else []
            ),
        ],
        "images": [{"name": WSGATE_IMAGE, "newName": name, "newTag": tag}],
    }


def render(policies: PolicySet, policies_dir: Path, opts: Options) -> dict[str, str]:
    """DIR's files (relative path -> text): kustomization.yaml, one manifest file per part, keys/.gitignore."""
    _check_shared_state(policies)
    quotas = rate_limit.enabled(policies)
    topo = topology()
    texts = {p.name: p.read_text() for p in sorted(Path(policies_dir).glob("*.y*ml")) if p.suffix in (".yaml", ".yml")}
    envoy = envoy_objects(policies, topo, opts)
    filter_keys = filter_key_files(policies)
    tokens = filter_tokens(policies, opts)
    token_files = tokens.secret_keys if tokens else []
    parts: dict[str, list[dict[str, Any]]] = {
        "namespace.yaml": [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE, "labels": {PART_OF: "wsgate"}}}
        ],
        "envoy.yaml": envoy,
        "filter.yaml": filter_objects(policies, texts, topo, opts),
    }
    if opts.redis == "demo":
        parts["redis.yaml"] = redis_objects()
    if quotas:
        parts["ratelimit.yaml"] = ratelimit_objects(policies, opts)
    if opts.demo_backend:
        parts["backend.yaml"] = backend_objects()
    parts["network-policies.yaml"] = network_policies(policies, topo, opts)
    envoy_keys = envoy_key_files(topo, envoy[0]["data"])
    external = ["redis-url", *([RATELIMIT_REDIS_FILE] if quotas else [])] if opts.redis == "external" else []
    needed = sorted({*envoy_keys, *filter_keys, *token_files, *external})
    files = {name: yaml.safe_dump_all(objs, sort_keys=False, width=200) for name, objs in parts.items()}
    files["kustomization.yaml"] = yaml.safe_dump(
        kustomization(list(parts), envoy_keys, filter_keys, opts, token_files, quotas), sort_keys=False, width=200
    )
    # What keys/ must hold before `kubectl apply -k`; and never let them into the operator's repository.
    files[f"{KEYS_DIR}/.gitignore"] = (
        f"# The Secrets' key files (kustomization.yaml): {' '.join(needed)}\n*\n!.gitignore\n"
    )
    return files


def write(files: dict[str, str], out: Path) -> None:
    for name, text in files.items():
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
