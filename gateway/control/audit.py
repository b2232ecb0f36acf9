"""`wsgate audit`: search, show and verify the non-repudiation archive (docs/audit.md).

The archives are the ones the policies name (each route's `archive:`: store, directory or DSN, stream);
`--stream` picks one when several are named. `verify` re-checks an archived request's signature offline with
the engine's own WS-Security processing, as of the time the gateway received it, against the certificate chain
archived with it; `verify-chain` walks a stream's hash chain and its signed checkpoints and reports the first
break."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric import rsa

from filters.engine import faults
from filters.engine.wss import keys, wssecurity
from filters.engine.xml.threat_protection import parse_envelope
from filters.stores.archive.postgres import DatabaseError
from filters.stores.archive.record import BodyKeyError, ChainReport, Stored, chain_certificates, open_body, verify_chain
from filters.stores.archive.writer import ArchiveStore, open_store
from filters.stores.replay import MemoryReplayCache
from gateway.control.documents import load_checked
from gateway.policy import (
    ArchivePolicy,
    EncryptionPolicy,
    Limits,
    PolicyError,
    Route,
    SignaturePolicy,
    TimestampPolicy,
    UsernameTokenPolicy,
)


class AuditError(Exception):
    """What the command prints before it exits 2."""


def _archives(args: argparse.Namespace) -> list[tuple[ArchivePolicy, list[Route], ArchiveStore]]:
    """The archives the policies name (one per store, place and stream), `--stream` only where given."""
    try:
        policies = load_checked(args.policies)
    except PolicyError as exc:
        raise AuditError(str(exc)) from None
    found: dict[tuple[str, str, str], tuple[ArchivePolicy, list[Route]]] = {}
    for route in policies.routes:
        a = route.archive
        if a is None or (args.stream and a.stream != args.stream):
            continue
        where = a.dsn.get_secret_value() if a.dsn is not None else a.directory
        found.setdefault((a.store, where, a.stream), (a, []))[1].append(route)
    if not found:
        raise AuditError(f"no route of {args.policies} archives" + (f" to stream {args.stream}" if args.stream else ""))
    return [(a, routes, open_store(a)) for a, routes in found.values()]


def _find(args: argparse.Namespace) -> tuple[ArchivePolicy, list[Route], ArchiveStore, Stored]:
    for a, routes, store in _archives(args):
        rec = store.get(args.id)
        if rec is not None:
            return a, routes, store, rec
    raise AuditError(f"no archived record {args.id}")


def _summary(meta: dict) -> dict:
    keep = ("id", "stream", "seq", "at", "route", "kind", "verdict", "identity", "message_id", "request_id", "size")
    return {k: meta[k] for k in keep}


def cmd_search(args: argparse.Namespace) -> int:
    where = {"since": _utc(args.since), "until": _utc(args.until), "route": args.route, "identity": args.identity,
             "verdict": args.verdict, "message_id": args.message_id, "request_id": args.request_id,
             "kind": args.kind}  # fmt: skip
    count = 0
    for _, _, store in _archives(args):
        for meta in store.search(**where):
            print(json.dumps(_summary(meta)))
            count += 1
    print(f"{count} records", file=sys.stderr)
    return 0


def _private_key(path: str | None) -> rsa.RSAPrivateKey | None:
    return keys.load_private_key(path) if path else None


def cmd_show(args: argparse.Namespace) -> int:
    _, _, _, rec = _find(args)
    meta = rec.fields
    meta["chain"] = [c.subject.rfc4514_string() for c in chain_certificates(meta)]
    print(json.dumps(meta, indent=2))
    key = _private_key(args.key)
    if key is None:
        return 0
    body = open_body(rec, key)
    if body is None:
        print(f"(no body kept: {meta['body_omitted'] or 'none'})", file=sys.stderr)
    elif args.out:
        args.out.write_bytes(body)
    else:
        sys.stdout.flush()
        sys.stdout.buffer.write(body)
    return 0


# Offline re-verification accepts what any route could have accepted: the policy of the day is in the record
# (policy_hash), the question now is only whether these bytes carry a valid signature of the archived signer.
_OFFLINE = wssecurity.Requirements(
    timestamp=TimestampPolicy(required=False),
    signature=SignaturePolicy(algorithms=["rsa-sha256", "rsa-sha1"], digests=["sha256", "sha1"], parts=["body"]),
    encryption=EncryptionPolicy(
        data_algorithms=["aes256-gcm", "aes128-gcm", "aes256-cbc", "aes128-cbc"],
        key_transport=["rsa-oaep-mgf1p", "rsa-oaep", "rsa-1_5"],
    ),
    username_token=UsernameTokenPolicy(),
    signer="x509",
    body_encrypted=False,
    limits=Limits(),
)


def reverify(rec: Stored, body: bytes, decryption_key: rsa.RSAPrivateKey | None) -> str:
    """The archived request's X.509 signature checked again as of its receipt, against its archived chain; the
    signer's subject, or a Fault."""
    meta = rec.fields
    chain = chain_certificates(meta)
    if not chain:
        raise faults.security("FailedAuthentication", "no certificate chain archived: not an X.509-signed record")
    trust = keys.TrustStore([chain[-1]], intermediates=chain[1:-1])
    creds = wssecurity.Credentials(trust=trust, known_certificates=[chain[0]], decryption_key=decryption_key,
                                   replay=MemoryReplayCache(epoch_ms=0))  # fmt: skip
    received = datetime.fromisoformat(meta["at"])
    verified = wssecurity.process(parse_envelope(body, _OFFLINE.limits), _OFFLINE, creds, received)
    if verified.subject != meta["identity"]:
        raise faults.security(
            "FailedAuthentication", f"signed by {verified.subject!r}, archived as {meta['identity']!r}"
        )
    return verified.subject or ""


def _walk(a: ArchivePolicy, store: ArchiveStore, certificate: str | None, since: str | None = None,
          until: str | None = None) -> ChainReport:  # fmt: skip
    cert = keys.load_certificate(certificate or a.signing_certificate)
    # Checkpoints, then the head, then the records: each read sees at least what the one before it named.
    checkpoints = store.checkpoints()
    head = store.head()
    records: Iterator[Stored] = store.records()
    columns = store.columns()
    if since or until:
        kept = list(_in_range(records, columns, since, until))
        return verify_chain((r for r, _ in kept), checkpoints, cert,
                            columns=None if columns is None else (c or {} for _, c in kept))  # fmt: skip
    return verify_chain(records, checkpoints, cert, start=store.start(), head=head, head_after=store.head,
                        columns=columns)  # fmt: skip


def _in_range(
    records: Iterator[Stored], columns: Iterator[dict] | None, since: str | None, until: str | None
) -> Iterator[tuple[Stored, dict | None]]:
    """The stored run of records from the first received at or after `since` to the last at or before `until`."""
    started = False
    for rec in records:
        col = next(columns) if columns is not None else None
        at = rec.fields["at"]
        if not started and since and at < since:
            continue
        if until and at > until:
            return
        started = True
        yield rec, col


def cmd_verify(args: argparse.Namespace) -> int:
    a, routes, store, rec = _find(args)
    meta = rec.fields
    ok = True
    report = _walk(a, store, args.certificate)
    pinned = [seq for seq in (json.loads(c)["seq"] for c in store.checkpoints()) if seq >= meta["seq"]]
    if not report.intact:
        print(f"chain: BROKEN: {report.break_at}")
        ok = False
    else:
        where = f"pinned by the checkpoint at seq {min(pinned)}" if pinned else "after the last checkpoint"
        print(f"chain: record seq {meta['seq']} of stream {meta['stream']} in place ({where})")
    if meta["kind"] != "request":
        print(f"signature: not checked ({meta['kind']} record: the gateway's own reply or a refusal)")
        return 0 if ok else 1
    key = _private_key(args.key)
    if key is None:
        print("signature: not checked (the body key is needed to read the original: --key)")
        return 0 if ok else 1
    body = open_body(rec, key)
    if body is None:
        print(f"signature: not checked (no body kept: {meta['body_omitted']})")
        return 0 if ok else 1
    route = next((r for r in routes if r.name == meta["route"]), None)
    dec = args.decryption_key or (route.rsa.decryption_key if route and route.profile != "hmac" else None)
    try:
        subject = reverify(rec, body, _private_key(dec) if dec and keys.private_key_available(dec) else None)
    except faults.Fault as fault:
        print(f"signature: INVALID: {fault.reason}")
        return 1
    print(f"signature: valid, signed by {subject} (as of {meta['at']})")
    return 0 if ok else 1


def cmd_verify_chain(args: argparse.Namespace) -> int:
    broken = False
    for a, _, store in _archives(args):
        report = _walk(a, store, args.certificate, _utc(args.since), _utc(args.until))
        span = f"seq {report.first_seq}..{report.last_seq}" if report.records else "no records"
        if report.intact:
            print(f"stream {a.stream}: intact: {report.records} records ({span}), {report.checkpoints} checkpoints")
        else:
            print(f"stream {a.stream}: BROKEN after {report.records} good records: {report.break_at}")
            broken = True
    return 1 if broken else 0


def run(args: argparse.Namespace) -> int:
    try:
        return int(args.audit_func(args))
    except (AuditError, BodyKeyError, DatabaseError, OSError) as exc:
        print(f"wsgate audit: {exc}", file=sys.stderr)
        return 2


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    audit = sub.add_parser("audit", help="search, show and verify the non-repudiation archive (docs/audit.md)")
    audit.set_defaults(func=run)
    cmds = audit.add_subparsers(dest="audit_command", required=True)

    def command(name: str, fn, help_: str) -> argparse.ArgumentParser:  # type: ignore[no-untyped-def]
        p = cmds.add_parser(name, help=help_)
        p.add_argument("--policies", type=Path, default=Path("policies"))
        p.add_argument("--stream", help="the archive stream (when the policies name several)")
        p.set_defaults(audit_func=fn)
        return p

    search = command("search", cmd_search, "records by time, route, identity, verdict, message id")
    search.add_argument("--since", help="received at or after (ISO 8601, UTC: 2026-11-25T10:00)")
    search.add_argument("--until", help="received at or before (ISO 8601, UTC)")
    for name in ("route", "identity", "verdict", "message-id", "request-id", "kind"):
        search.add_argument(f"--{name}")
    show = command("show", cmd_show, "a record's metadata; the original bytes with the body key")
    show.add_argument("id")
    show.add_argument("--key", help="the body key's private key (PEM or pkcs11: URI): prints the original")
    show.add_argument("--out", type=Path, help="write the original here instead of to stdout")
    verify = command("verify", cmd_verify, "re-verify a record's signature offline and its place in the chain")
    verify.add_argument("id")
    verify.add_argument("--key", help="the body key's private key (PEM or pkcs11: URI)")
    verify.add_argument("--decryption-key", help="opens a request encrypted to the gateway (default: the route's)")
    verify.add_argument("--certificate", help="the checkpoints' signer (default: the policy's signing_certificate)")
    chain = command("verify-chain", cmd_verify_chain, "walk a stream's hash chain and checkpoints; the first break")
    chain.add_argument("--since", help="from the first record received at or after (ISO 8601, UTC)")
    chain.add_argument("--until", help="to the last record received at or before (ISO 8601, UTC)")
    chain.add_argument("--certificate", help="the checkpoints' signer (default: the policy's signing_certificate)")


def _utc(text: str | None) -> str | None:
    """An ISO 8601 time (UTC when it names no zone) as the records spell theirs, so that text order is time order."""
    if not text:
        return None
    t = datetime.fromisoformat(text)
    t = t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)
    return t.isoformat(timespec="microseconds")
