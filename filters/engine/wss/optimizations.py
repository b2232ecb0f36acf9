"""The papers' optimizations of signature processing, as a route turns them on (gateway.policy.Optimizations).

How a reference's digest is established, cheapest first; whatever is on:

- on-demand re-canonicalization (van Engelen and Zhang 2.5): hash the element as received; canonicalize only
  when that is not the signed digest. Pays when the fraction alpha of references received in canonical form
  beats the ratio serialization/canonicalization (the paper's whole-message variant: alpha >= 1 - cost_C14N);
- digest-based caching (Algorithm 1, filters/engine/wss/digest_cache.py): an element serialized exactly like one
  verified before has that one's digest;
- prehashing (2.4): the same memo when the gateway signs (identical backend responses);
- otherwise filters/engine/xml/c14n.py: libxml2's exclusive C14N of the element, directly.

Nothing here accepts a message: signature.verify compares each digest with the signed DigestValue, checks the
SignatureValue over the canonical SignedInfo, and sends anything that does not match to xmlsec's full
verification, which decides and names the failure."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from lxml import etree

from filters.engine import metrics
from filters.engine.wss import digest_cache
from filters.engine.wss.digest_cache import DigestCache
from filters.engine.wss.digest_cache import Key as DigestKey
from filters.engine.xml import c14n
from gateway.policy import Route

log = logging.getLogger("wsgate.optimizations")


@dataclass
class Counts:
    """What the optimizations did, for hit rates and alpha (also exported as wsgate_optimizations_total)."""

    received: int = 0  # references tried in their received form (on-demand)
    canonical: int = 0  # ... whose received form was canonical
    verified: int = 0  # signatures verified directly
    fallback: int = 0  # signatures the direct path could not confirm, sent to xmlsec
    diverged: int = 0  # ... that xmlsec then verified


@dataclass
class Optimizations:
    """One route's optimizations with their per-worker state. `route` None: no metrics (clients, tests)."""

    on_demand_c14n: bool = False
    # Annotated by the names imported: in the class body `digest_cache` is this field, not the module.
    digest_cache: DigestCache | None = None  # the receiving side's memo
    prehash: DigestCache | None = None  # the signing side's memo
    route: Route | None = None
    counts: Counts = field(default_factory=Counts)

    @classmethod
    def for_route(cls, route: Route) -> Optimizations | None:
        """None when the route keeps xmlsec's reference processing (direct_c14n off)."""
        opts = route.optimizations
        if not opts.direct_c14n:
            return None
        return cls(
            on_demand_c14n=opts.on_demand_c14n,
            digest_cache=DigestCache(opts.cache_entries) if opts.digest_cache else None,
            prehash=DigestCache(opts.cache_entries) if opts.prehash else None,
            route=route,
        )

    def _count(self, optimization: str, outcome: str) -> None:
        if self.route is not None:
            metrics.series(metrics.OPTIMIZATIONS, self.route.name, self.route.profile, optimization, outcome).inc()

    # -- receiving -------------------------------------------------------------------------------------------

    def check(
        self, el: etree._Element, prefixes: Sequence[str], algorithm: str, expected: bytes, *, cacheable: bool
    ) -> tuple[bool, tuple[DigestKey, bytes] | None]:
        """Whether the digest of `el` is `expected`, and what to remember once the whole signature verified.
        `cacheable`: the element may recur (not a per-message token such as the Timestamp)."""
        cache = self.digest_cache if cacheable else None
        memo: DigestKey | None = None
        if self.on_demand_c14n or cache is not None:
            form = c14n.received_form(el)
            if self.on_demand_c14n:
                self.counts.received += 1
                if hmac.compare_digest(c14n.HASHES[algorithm](form).digest(), expected):
                    self.counts.canonical += 1
                    self._count("on_demand_c14n", "canonical")
                    return True, None
                self._count("on_demand_c14n", "recanonicalized")
            if cache is not None:
                memo = digest_cache.key(form, prefixes, algorithm)
                known = cache.get(memo)
                self._count("digest_cache", "miss" if known is None else "hit")
                if known is not None:
                    return hmac.compare_digest(known, expected), None
        got = c14n.digest(el, prefixes, algorithm)
        return hmac.compare_digest(got, expected), (memo, got) if memo is not None else None

    def verified(self, learned: Sequence[tuple[DigestKey, bytes]]) -> None:
        """The signature verified directly: remember its new (element -> digest) pairs."""
        self.counts.verified += 1
        self._count("direct_c14n", "verified")
        if self.digest_cache is not None:
            for memo, value in learned:
                self.digest_cache.put(memo, value)

    def fell_back(self) -> None:
        self.counts.fallback += 1
        self._count("direct_c14n", "fallback")

    def diverged(self) -> None:
        """xmlsec verified a signature the direct path did not: harmless (xmlsec decided), but a C14N difference
        worth knowing about."""
        self.counts.diverged += 1
        self._count("direct_c14n", "diverged")
        log.warning("route %s: xmlsec verified a signature direct C14N did not", self.route.name if self.route else "-")

    # -- signing ---------------------------------------------------------------------------------------------

    def digest(self, el: etree._Element, prefixes: Sequence[str], algorithm: str, *, cacheable: bool) -> bytes:
        """The digest value to sign for `el`: prehashed when an identical element was signed before."""
        if self.prehash is None or not cacheable:
            return c14n.digest(el, prefixes, algorithm)
        memo = digest_cache.key(c14n.received_form(el), prefixes, algorithm)
        known = self.prehash.get(memo)
        self._count("prehash", "miss" if known is None else "hit")
        if known is not None:
            return known
        value = c14n.digest(el, prefixes, algorithm)
        self.prehash.put(memo, value)
        return value
