"""Security contexts as the engine sees them: where they live is a ContextStore it is handed (memory, Redis or
sealed into the token: filters/stores/contexts.py), and one message's SCT references resolve through it."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from datetime import datetime
from typing import Protocol

from filters.engine import faults
from filters.engine.wss.secure_conversation import (
    Context,
    Sct,
    SctRef,
    SctResolver,
    Version,
    resolve_identifier,
    wsc_fault,
)
from filters.engine.wss.timestamp import format_datetime


def random_identifier() -> str:
    return f"urn:uuid:{uuid.uuid4()}"


def unknown_context(version: Version, identifier: str, why: str = "unknown security context") -> faults.Fault:
    return wsc_fault(version, "BadContextToken", f"{why}: {identifier[:80]!r}")


def live(ctx: Context, version: Version, now: datetime) -> Context:
    """`ctx` if it may be used in a `version` message at `now`."""
    if ctx.version is not version:
        raise unknown_context(
            version, ctx.identifier, f"context of version {ctx.version.name} used with {version.name}"
        )
    if now >= ctx.expires:
        raise wsc_fault(version, "RenewNeeded", f"security context expired at {format_datetime(ctx.expires)}")
    return ctx


class ContextStore(Protocol):
    """Where contexts live. `version` is that of the message at hand: it names the faults' namespace, and a
    context is only found for messages of the version it was established with."""

    lifetime_s: int

    def issue(self, secret: bytes, subject: str, version: Version, now: datetime) -> Context:
        """A new context created at `now`, expiring `lifetime_s` later."""
        ...

    def lookup(self, identifier: str, version: Version, now: datetime) -> Context:
        """The live context `identifier` names; BadContextToken (unknown, cancelled, tampered, other version)
        or RenewNeeded (expired)."""
        ...

    def cancel(self, identifier: str, version: Version, now: datetime) -> Context:
        """End a live context (faults as `lookup`) and return it."""
        ...


def store_resolver(store: ContextStore, now: datetime, local: Mapping[str, Sct] | None = None) -> SctResolver:
    """Resolves SCT references of one message: '#id' through `local` (header_scts of its Security header),
    Identifiers directly, then the live context from `store` (its faults). Each context once per message: its
    derived keys (signature, encryption) name the same one, and a lookup may be a Redis round trip."""
    found: dict[tuple[str, str], Context] = {}

    def resolve(ref: SctRef) -> Context:
        identifier = resolve_identifier(ref, local, "UnknownDerivationSource")
        key = (identifier, ref.version.name)
        if key not in found:
            found[key] = store.lookup(identifier, ref.version, now)
        return found[key]

    return resolve


class PartnerContexts(Protocol):
    """The context an outbound `secureconversation` route holds with its partner, one for all the workers
    (filters/stores/partner_contexts.py: in Redis, or this worker's memory): whoever takes `lock` issues the
    next one, the others use the current one meanwhile."""

    def get(self) -> Context | None:
        """The current context (perhaps expired), or None."""
        ...

    def put(self, ctx: Context) -> None: ...

    def lock(self, ttl_s: float) -> bool:
        """True: this caller issues the next context (and then `unlock`s); False: another one is at it."""
        ...

    def unlock(self) -> None: ...

    def take(self) -> Context | None:
        """Remove the current context and return it (to cancel it)."""
        ...
