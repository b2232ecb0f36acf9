"""Digest-based caching (van Engelen and Zhang, Algorithm 1): a signed element seen before skips its
canonicalization.

The paper keys its cache by (UUID, digest value) and hands back the deserialized object, parsing and hashing
nothing; a gateway has no object to hand back, it forwards the element it received. So the cache here is a memo
of the one deterministic function reference processing computes, element -> digest of its exclusive canonical
form, keyed by a SHA-256 of the element's self-contained serialization (c14n.received_form) with the C14N
parameters and the digest algorithm. Equal keys mean equal elements (namespaces in scope included), hence equal
canonical forms: a hit is the digest of the element received, computed from its own bytes, never one that was
merely claimed. What it saves is the canonicalization minus the serialization (about half of it).

It decides nothing: the digest it returns is compared with the signed DigestValue like a computed one, and the
SignatureValue over the message's own SignedInfo (with its fresh Timestamp reference), the timestamp and the
replay checks all still run. Entries are added only after a signature verified, so unauthenticated senders
cannot fill it, and it is bounded (LRU), one per route and worker.

On the receiving side a hit needs the same signed element twice, wsu:Id included; clients that draw ids at
random (ours, WSS4J) never repeat one. Prehashing (filters/engine/wss/optimizations.py) uses the same memo for the
responses the gateway signs."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

Key = tuple[bytes, tuple[str, ...], str]


def key(form: bytes, prefixes: Sequence[str], algorithm: str) -> Key:
    """What identifies an element's canonical form: the SHA-256 of its received form (c14n.received_form), the
    C14N parameters, and which digest of it is remembered."""
    return hashlib.sha256(form).digest(), tuple(prefixes), algorithm


class DigestCache:
    """A bounded LRU map Key -> digest value, with hit and miss counts for the hit rate."""

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.max_entries = max_entries
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[Key, bytes] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, k: Key) -> bytes | None:
        value = self._entries.get(k)
        if value is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(k)
        return value

    def put(self, k: Key, value: bytes) -> None:
        self._entries[k] = value
        self._entries.move_to_end(k)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
