"""`wsgate`: run, check and render the gateway; make the demo PKI; secure requests as a client."""

from __future__ import annotations

import argparse
import base64
import logging
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

from certs import hsm, pki, rotate
from filters.engine.wss import inventory
from gateway.control import audit, envoy_config, monitoring, published_certificates, published_policy, rate_limit
from gateway.control.documents import load_checked
from gateway.control.supervisor import default_workers
from gateway.policy import DEFAULT_BODY_BUDGET_MB, PolicyError, PolicySet


def cmd_up(args: argparse.Namespace) -> int:
    from gateway.control.supervisor import Gateway, Options

    opts = Options(
        policies=args.policies, certs=args.certs, run_dir=args.run_dir, workers=args.workers, bind=args.bind,
        http_port=args.http_port, https_port=args.https_port, admin_port=args.admin_port,
        backend=None if args.no_backend else args.backend, log_level=args.log_level,
        worker_max_rss_mb=args.worker_max_rss_mb, body_budget_mb=args.body_budget_mb,
        envoy_max_heap_mb=args.envoy_max_heap_mb,
    )  # fmt: skip
    gw = Gateway(opts)
    try:
        gw.start()
    except (PolicyError, RuntimeError) as exc:
        gw.stop()
        print(f"wsgate up: {exc}", file=sys.stderr)
        return 1
    print(f"WSGate is up: {len(gw.policies.routes) if gw.policies else 0} routes, {opts.workers} filter workers")
    for name, url in gw.urls().items():
        print(f"  {name:12} {url}")
    print(f"  logs         {opts.run_dir / 'logs'}/   (Ctrl-C stops everything)", flush=True)
    try:
        gw.run_forever()
    except RuntimeError as exc:
        print(f"wsgate up: {exc}", file=sys.stderr)
        return 1
    return 0


def _policies(directory: Path) -> PolicySet | None:
    """The policy set, or None after printing why it is invalid."""
    try:
        return load_checked(directory)
    except PolicyError as exc:
        print(exc, file=sys.stderr)
        return None


def cmd_check(args: argparse.Namespace) -> int:
    ps = _policies(args.policies)
    if ps is None:
        return 1
    from filters.engine.xml.schema_validation import pattern_warnings

    for r in ps.routes:
        print(f"ok  {r.name:24} {r.profile:18} {r.match.path_prefix} -> {r.upstream.address}  ({ps.sources[r.name]})")
        if r.wsdl is not None and r.wsdl.publish:
            for gap in published_policy.gaps(r):
                print(f"    published policy: {gap}")
        for warning in pattern_warnings(r) if r.schema_validation.enabled else []:
            print(f"warning: route {r.name}: {warning}", file=sys.stderr)
    # Certificates only: checking needs no token (and no PIN).
    items = [item for r in ps.routes for item in inventory.route_items(r, load_keys=False)]
    errors, warnings = inventory.expiry_problems(list({(i.use, i.source): i for i in items}.values()), _now())
    for line in warnings:
        print(f"warning: {line}", file=sys.stderr)
    for line in errors:
        print(f"error: {line}", file=sys.stderr)
    return 1 if errors else 0


def _now() -> datetime:
    return datetime.now(UTC)


def cmd_keys_rotate(args: argparse.Namespace) -> int:
    try:
        if args.kind == "master-keys":
            done = rotate.master_keys(args.file, args.name, args.retire)
        else:
            done = rotate.hmac_keys(args.file, args.name, args.retire)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"wsgate keys rotate: {exc}", file=sys.stderr)
        return 1
    print(f"{done} ({args.file}); reload the gateway to apply")
    return 0


def cmd_keys_list(args: argparse.Namespace) -> int:
    """Every key and certificate the policies use, once, with the routes that use it."""
    ps = _policies(args.policies)
    if ps is None:
        return 1
    rows: dict[tuple[str, str, str], tuple[inventory.Item, list[str]]] = {}
    for r in ps.routes:
        for item in inventory.route_items(r):
            serial = str(item.certificate.serial_number) if item.certificate else ""
            rows.setdefault((item.use, item.source, serial), (item, []))[1].append(r.name)
    for item, routes in rows.values():
        cert = item.certificate
        size = "" if item.size is None else (f"{item.size} keys" if item.use.endswith("_keys") else f"{item.size} bits")
        print(f"{item.use:13} {item.kind:5} {item.algorithm} {size}  {item.source}")
        if cert is not None:
            print(f"    subject {cert.subject.rfc4514_string()}; issuer {cert.issuer.rfc4514_string()}; "
                  f"not after {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC")  # fmt: skip
        print(f"    routes {', '.join(routes)}")
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    if args.target == "kubernetes":
        return _render_kubernetes(args)
    ps = _policies(args.policies)
    if ps is None:
        return 1
    # Compose always runs the rate-limit service: its configuration is written even with no quotas (no limits), so
    # a roll that removes the last quota leaves none behind.
    limits = rate_limit.enabled(ps) or args.target == "compose"
    if args.target == "compose":
        topo = envoy_config.compose_topology()
    else:
        topo = envoy_config.Topology(
            filter_endpoints=tuple(f"127.0.0.1:{9100 + i}" for i in range(args.workers)),
            certs_dir=str(args.certs), config_dir=str(args.config_dir),
        )  # fmt: skip
    try:
        files = envoy_config.render(ps, topo)
    except OSError as exc:  # a published ?wsdl reads the route's signing certificate
        print(f"wsgate render: {exc}", file=sys.stderr)
        return 1
    if args.out:
        envoy_config.write(files, args.out)
        for name, text in monitoring.render().items():  # the dashboard and alerts (docs/operations.md)
            (args.out / name).write_text(text)
        print(f"wrote {', '.join(sorted([*files, *monitoring.render()]))} to {args.out}", file=sys.stderr)
        if limits:  # the rate-limit service's RUNTIME_ROOT (docs/quotas.md)
            rate_limit.write(ps, args.out / "ratelimit")
            print(f"wrote ratelimit/{rate_limit.CONFIG_FILE} to {args.out}", file=sys.stderr)
    else:
        for name in files:
            sys.stdout.write(f"# ---- {name}\n{files[name]}")
        if limits:
            sys.stdout.write(f"# ---- ratelimit/{rate_limit.CONFIG_FILE}\n{rate_limit.service_config(ps)}")
    return 0


def _render_kubernetes(args: argparse.Namespace) -> int:
    from gateway.control import kubernetes

    if not args.out:
        print("wsgate render: --target kubernetes writes a folder: give --out DIR", file=sys.stderr)
        return 2
    opts = kubernetes.Options(
        image=args.image, demo_backend=not args.no_demo_backend, redis="external" if args.external_redis else "demo",
        external_redis_port=args.external_redis_port, hsm_ports=tuple(args.hsm_port),
        pkcs11_config=tuple(tuple(c.split("=", 1)) for c in args.pkcs11_config if "=" in c),
    )  # fmt: skip
    if any("=" not in c for c in args.pkcs11_config):
        print("wsgate render: --pkcs11-config takes ENV=FILE", file=sys.stderr)
        return 2
    if opts.demo_backend:
        # The demo policies point at ${BACKEND_ADDR}: in the cluster, the demo backend's Service.
        os.environ.setdefault("BACKEND_ADDR", f"{kubernetes.BACKEND}:{kubernetes.BACKEND_PORT}")
    ps = _policies(args.policies)
    if ps is None:
        return 1
    try:
        files = kubernetes.render(ps, args.policies, opts)
    except PolicyError as exc:
        print(exc, file=sys.stderr)
        return 1
    kubernetes.write(files, args.out)
    keys = files[f"{kubernetes.KEYS_DIR}/.gitignore"].splitlines()[0].split(": ", 1)[1]
    print(f"wrote {len(files)} files to {args.out}; before `kubectl apply -k {args.out}`, copy into "
          f"{args.out / kubernetes.KEYS_DIR}: {keys}", file=sys.stderr)  # fmt: skip
    return 0


def cmd_certs(args: argparse.Namespace) -> int:
    existed = (args.out / "ca.pem").exists()
    out = pki.init(args.out, force=args.force, ocsp_url=args.ocsp_url)
    print(f"demo PKI {'kept' if existed and not args.force else 'written'} in {out}")
    if args.hsm:
        try:
            env = hsm.init_demo(out, force=args.force)
        except (OSError, subprocess.CalledProcessError) as exc:
            print(f"wsgate certs init --hsm: {exc}", file=sys.stderr)
            return 1
        print(f"gateway keys in the SoftHSM2 token {hsm.TOKEN!r}; `set -a; . {env}; set +a` before `wsgate up`")
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    try:
        cert = pki.revoke(args.out, args.name, args.reason)
    except KeyError:
        print(f"wsgate certs revoke: no certificate {args.name!r} in {args.out}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        print(f"wsgate certs revoke: {exc}", file=sys.stderr)
        return 1
    print(f"revoked {cert.subject.rfc4514_string()} (serial {cert.serial_number:X}, {args.reason}); "
          f"published {args.out / 'ca.crl'}, {args.out / 'index.txt'}")  # fmt: skip
    return 0


def cmd_published(args: argparse.Namespace) -> int:
    """The signing certificates the routes publish (current, and next during a rotation), as a PEM bundle."""
    ps = _policies(args.policies)
    if ps is None:
        return 1
    routes = [r for r in ps.routes if args.route in (None, r.name)]
    if args.route and not routes:
        print(f"wsgate certs published: no route {args.route!r}", file=sys.stderr)
        return 1
    try:
        print(published_certificates.pem_bundle(routes), end="")
    except (OSError, ValueError) as exc:
        print(f"wsgate certs published: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_client(args: argparse.Namespace) -> int:
    from gateway.tools.client import Client, ClientConfig, ClientError, attachment, http_exchange, package, unpack

    try:
        route = load_checked(args.policies).route(args.policy)
    except KeyError:
        print(f"wsgate client: no route named {args.policy!r} in {args.policies}", file=sys.stderr)
        return 2
    except PolicyError as exc:
        print(exc, file=sys.stderr)
        return 2
    cfg = ClientConfig(
        certs=args.certs, key=args.key, certificate=args.cert, key_name=args.key_name, user=args.user,
        password=args.password, password_digest=not args.password_text, encrypt=args.encrypt,
        sc_version=args.sc_version, assertion=args.assertion,
    )  # fmt: skip
    try:
        if args.proof_key:  # base64, as an STS returns it (RequestedProofToken/BinarySecret)
            cfg.proof_key = base64.b64decode(args.proof_key.read_text().strip(), validate=True)
        client = Client(route, cfg)
        plain = Path(args.request).read_bytes() if args.request != "-" else sys.stdin.buffer.read()
        attachments = [attachment(spec) for spec in args.attach]
    except (ClientError, OSError, ValueError) as exc:
        print(f"wsgate client: {exc}", file=sys.stderr)
        return 2
    verify: str | bool = str(args.certs / "ca.pem") if args.url.startswith("https") else True
    # A route that matches one SOAPAction is reached only with it: send it unless told otherwise.
    actions = route.match.soap_actions
    soap_action = args.soap_action or (actions[0] if len(actions) == 1 else None)
    exchange = http_exchange(args.url, verify=verify, timeout=args.timeout, soap_action=soap_action)

    def post(body: bytes, ctype: str) -> bytes:
        return exchange(body, ctype)[1]

    session = route.profile == "secureconversation"
    try:
        if session:
            ctx = client.establish(post)
            print(f"# context established: {ctx.identifier[:48]}... ({ctx.version.name})", file=sys.stderr)
        for _ in range(args.repeat):
            secured, pending = client.secure(plain, attachments)
            if args.show_secured:
                print(secured.decode(), file=sys.stderr)
            ctype = pending.content_type
            if attachments:
                ctype, secured = package(secured, pending.soap_version, attachments)
            root, parts = unpack(*exchange(secured, ctype), route)
            reply = client.open(root, pending, parts)
            sys.stdout.write(reply.serialize().decode() + "\n")
            for part in parts:
                print(f"# reply attachment <{part.content_id}> {part.content_type}, {len(part.body)} bytes",
                      file=sys.stderr)  # fmt: skip
                if args.attachments_out:
                    name = (part.content_id or "").replace("/", "_").lstrip(".") or "part"
                    (args.attachments_out / name).write_bytes(part.body)
        if session and not args.keep_context:
            client.cancel(post)
            print("# context cancelled", file=sys.stderr)
    except ClientError as exc:
        print(f"wsgate client: {exc}", file=sys.stderr)
        return 1
    return 0


FETCH_TIMEOUT_S = 10


def _fetch(url: str, save: Path) -> bytes:
    """The operator's fetch of a WSDL URL (never the gateway's): bounded in time and size, kept in `save`."""
    import requests

    from gateway.tools.wsdl_import import MAX_BYTES, WsdlImportError

    try:
        with requests.get(url, timeout=FETCH_TIMEOUT_S, stream=True, allow_redirects=False) as resp:
            resp.raise_for_status()
            data = b""
            for chunk in resp.iter_content(65536):
                data += chunk
                if len(data) > MAX_BYTES:
                    raise WsdlImportError(f"{url}: larger than {MAX_BYTES} bytes")
    except requests.RequestException as exc:
        raise WsdlImportError(f"{url}: {exc}") from None
    save.write_bytes(data)
    print(f"# fetched {url} ({len(data)} bytes) into {save}", file=sys.stderr)
    return data


def cmd_import(args: argparse.Namespace) -> int:
    from gateway.tools.wsdl_import import WsdlImportError, import_wsdl, render

    source: str = args.wsdl
    try:
        if source.startswith(("http://", "https://")):
            out_dir = args.out.parent if args.out else Path(".")
            path = args.save_wsdl or out_dir / (Path(source.split("?", 1)[0].rstrip("/")).stem + ".wsdl")
            data = _fetch(source, path)
        else:
            path = Path(source)
            data = path.read_bytes()
        imported = import_wsdl(
            data,
            path,
            source,
            service=args.service,
            port=args.port,
            upstream=args.upstream,
            validate=args.validate,
            outbound=args.listen if args.outbound else None,
        )
    except (WsdlImportError, OSError) as exc:
        print(f"wsgate import: {exc}", file=sys.stderr)
        return 2
    for note in imported.notes:
        print(f"# note: {note}", file=sys.stderr)
    if args.validate:
        from filters.engine.xml import wsdl, xsd_patterns

        for doc in wsdl.load(path).documents:
            for warning in xsd_patterns.warnings(doc.root, doc.path):
                print(f"# warning: {warning}", file=sys.stderr)
    for r in imported.routes:
        for line in r.mapped.unmapped:
            print(f"UNMAPPED {r.route['name']}: {line}", file=sys.stderr)
    if not imported.routes:
        print("wsgate import: no route the gateway can enforce", file=sys.stderr)
        return 1
    text = render(imported)
    if args.out:
        args.out.write_text(text)
        print(f"# wrote {len(imported.routes)} routes to {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="wsgate", description="WSGate, a WS-Security offload gateway on Envoy.")
    sub = p.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="render the config, start filter workers, Envoy and the demo backend")
    up.add_argument("--policies", type=Path, default=Path("policies"))
    up.add_argument("--certs", type=Path, default=pki.DEFAULT_DIR)
    up.add_argument("--run-dir", type=Path, default=Path("run"))
    up.add_argument("--workers", type=int, default=default_workers(), help="filter worker processes (one per core)")
    up.add_argument("--bind", default="127.0.0.1")
    up.add_argument("--http-port", type=int, default=8080)
    up.add_argument("--https-port", type=int, default=8443)
    up.add_argument("--admin-port", type=int, default=9901)
    up.add_argument("--backend", default="127.0.0.1:8081", help="where the demo backend listens")
    up.add_argument("--no-backend", action="store_true", help="do not start the demo backend")
    up.add_argument("--log-level", default="warning")
    up.add_argument("--worker-max-rss-mb", type=int, default=512, help="replace a filter worker grown past this")
    up.add_argument("--body-budget-mb", type=int, default=DEFAULT_BODY_BUDGET_MB,
                    help="body bytes in flight each filter worker admits; beyond: 503 Service busy")  # fmt: skip
    up.add_argument("--envoy-max-heap-mb", type=int, default=1024,
                    help="Envoy's heap; near it, new requests get 503 (overload manager)")  # fmt: skip
    up.set_defaults(func=cmd_up)

    check = sub.add_parser("check", help="validate policy files")
    check.add_argument("policies", type=Path, nargs="?", default=Path("policies"))
    check.set_defaults(func=cmd_check)

    keys_cmd = sub.add_parser("keys", help="the keys and certificates the policies use")
    keys_sub = keys_cmd.add_subparsers(dest="keys_command", required=True)
    keys_list = keys_sub.add_parser("list", help="every key and certificate: file or token, algorithm, size, "
                                    "subject, issuer, not-after, routes")  # fmt: skip
    keys_list.add_argument("policies", type=Path, nargs="?", default=Path("policies"))
    keys_list.set_defaults(func=cmd_keys_list)
    keys_rotate = keys_sub.add_parser(
        "rotate", help="add a new HMAC or master key, or retire an old one (docs/keys.md)"
    )
    keys_rotate.add_argument("kind", choices=["hmac-keys", "master-keys"])
    keys_rotate.add_argument("file", type=Path, help="hmac.keys_file or secureconversation.master_keys_file")
    keys_rotate.add_argument("--name", help="the new key's name (hmac-keys: required) or id (master-keys: kN)")
    keys_rotate.add_argument("--retire", metavar="NAME", help="remove this key instead")
    keys_rotate.set_defaults(func=cmd_keys_rotate)

    render = sub.add_parser("render", help="print (or write) the Envoy configuration")
    render.add_argument("--policies", type=Path, default=Path("policies"))
    render.add_argument("--target", choices=["local", "compose", "kubernetes"], default="local")
    render.add_argument("--workers", type=int, default=default_workers())
    render.add_argument("--certs", type=Path, default=pki.DEFAULT_DIR)
    render.add_argument("--config-dir", type=Path, default=Path("run/envoy"))
    render.add_argument("--out", type=Path, help="write envoy.yaml, lds.yaml and cds.yaml (kubernetes: manifests and "
                        "a kustomization.yaml) into this folder")  # fmt: skip
    render.add_argument(
        "--image", default="wsgate:local", help="kubernetes: the project's image, as the cluster pulls it"
    )
    render.add_argument("--no-demo-backend", action="store_true", help="kubernetes: leave the demo backend out")
    render.add_argument("--external-redis", action="store_true",
                        help="kubernetes: the filters' Redis URL from keys/redis-url instead of a demo Redis")  # fmt: skip
    render.add_argument("--external-redis-port", type=int, default=6379, help="kubernetes: the port filters may reach")
    render.add_argument("--pkcs11-config", action="append", default=[], metavar="ENV=FILE",
                        help="kubernetes: a PKCS#11 module's configuration file (in keys/) and the variable naming it "
                        "(SoftHSM2's SOFTHSM2_CONF=softhsm2.conf is the default for its module)")  # fmt: skip
    render.add_argument("--hsm-port", type=int, action="append", default=[],
                        help="kubernetes: a TCP port the filters may reach a network HSM on")  # fmt: skip
    render.set_defaults(func=cmd_render)

    imp = sub.add_parser("import", help="write route policies from a WSDL and its WS-SecurityPolicy")
    imp.add_argument("wsdl", help="a WSDL file, or an http(s) URL fetched once, here (the gateway never fetches)")
    imp.add_argument("--service", help="only this wsdl:service")
    imp.add_argument("--port", help="only this wsdl:port")
    imp.add_argument("--upstream", help="host:port of the backend, instead of the soap:address's")
    imp.add_argument("--validate", action="store_true", help="turn on schema validation (schema_validation:)")
    imp.add_argument(
        "--outbound",
        action="store_true",
        help="a partner's WSDL: outbound routes that secure the applications' calls (docs/outbound.md)",
    )
    imp.add_argument("--listen", default="127.0.0.1:9300", help="with --outbound: the applications' listener")  # fmt: skip
    imp.add_argument("--save-wsdl", type=Path, help="where a fetched WSDL is kept (default: beside --out)")
    imp.add_argument("-o", "--out", type=Path, help="write the policy file here (default: standard output)")
    imp.set_defaults(func=cmd_import)

    certs = sub.add_parser("certs", help="demo PKI")
    certs_sub = certs.add_subparsers(dest="certs_command", required=True)
    init = certs_sub.add_parser("init", help="make the demo CA, certificates, HMAC keys and users")
    init.add_argument("--out", type=Path, default=pki.DEFAULT_DIR)
    init.add_argument("--force", action="store_true", help="replace an existing PKI")
    init.add_argument("--ocsp-url", default=pki.DEMO_OCSP_URL, help="the OCSP responder named in client certificates")
    init.add_argument("--hsm", action="store_true",
                      help="also import the gateway keys into a SoftHSM2 token; writes hsm.env (docs/keys.md)")  # fmt: skip
    init.set_defaults(func=cmd_certs)
    revoke = certs_sub.add_parser("revoke", help="revoke a demo certificate: index.txt (OCSP) and ca.crl")
    revoke.add_argument("name", help="file stem (client) or common name slug (demo-client)")
    revoke.add_argument("--out", type=Path, default=pki.DEFAULT_DIR)
    revoke.add_argument("--reason", choices=pki.REVOCATION_REASONS, default="unspecified")
    revoke.set_defaults(func=cmd_revoke)
    published = certs_sub.add_parser("published", help="the routes' signing certificates as ?wsdl publishes them "
                                     "(current, and next during a rotation): a PEM bundle for clients")  # fmt: skip
    published.add_argument("policies", type=Path, nargs="?", default=Path("policies"))
    published.add_argument("--route", help="this route's only")
    published.set_defaults(func=cmd_published)

    client = sub.add_parser(
        "client", help="secure a plain SOAP request as a route's policy asks, send it, open the reply"
    )
    client.add_argument("request", help="plain SOAP request file ('-': standard input)")
    client.add_argument("--policy", required=True, help="the route name whose policy applies")
    client.add_argument("--url", required=True)
    client.add_argument("--policies", type=Path, default=Path("policies"))
    client.add_argument("--certs", type=Path, default=pki.DEFAULT_DIR, help="the client's key material")
    client.add_argument("--key", default="client.key")
    client.add_argument("--cert", default="client.pem")
    client.add_argument("--key-name", help="hmac: pre-shared key name (default: a fresh key in an EncryptedKey)")
    client.add_argument("--user", help="add a UsernameToken")
    client.add_argument("--password")
    client.add_argument("--password-text", action="store_true", help="PasswordText instead of PasswordDigest")
    client.add_argument("--encrypt", action=argparse.BooleanOptionalAction, default=None,
                        help="encrypt the Body (default: as the policy requires)")  # fmt: skip
    client.add_argument("--soap-action")
    client.add_argument(
        "--assertion", type=Path, help="saml routes: a signed SAML assertion file to send (docs/saml.md)"
    )
    client.add_argument("--proof-key", type=Path,
                        help="saml: a file holding the symmetric key (base64) a holder-of-key assertion confirms")  # fmt: skip
    client.add_argument("--attach", action="append", default=[], metavar="FILE[:content-type]",
                        help="send FILE as an attachment, Content-ID its name: MTOM where the request holds "
                        "xop:Include href='cid:<name>', else SOAP with Attachments (docs/attachments.md)")  # fmt: skip
    client.add_argument("--attachments-out", type=Path, help="write the reply's attachments here, by Content-ID")
    client.add_argument("--show-secured", action="store_true", help="print the secured request to stderr")
    client.add_argument("--timeout", type=float, default=30)
    client.add_argument("--repeat", type=int, default=1, help="send the request this many times")
    client.add_argument("--sc-version", choices=["1.3", "2005/02"], default="1.3", help="secureconversation")
    client.add_argument("--keep-context", action="store_true", help="secureconversation: do not cancel at the end")
    client.set_defaults(func=cmd_client)

    # Listed for --help; their own parsers take the arguments (see main).
    sub.add_parser("filter", help="run one ext_proc filter worker (wsgate filter --help)")
    sub.add_parser("backend", help="run the demo SOAP backend (wsgate backend --help)")
    audit.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "filter":
        # A filter worker is its own program, started as the supervisor starts it: the control plane never loads
        # the worker or its compiled frame.
        os.execv(sys.executable, [sys.executable, "-m", "filters.worker", *argv[1:]])
    if argv and argv[0] == "backend":
        from gateway.tools import demo_backend

        demo_backend.main(argv[1:])
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    sys.exit(args.func(args))


if __name__ == "__main__":
    main()
