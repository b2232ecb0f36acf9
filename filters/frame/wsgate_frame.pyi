# The compiled frame's Python face (src/*.rs); maturin ships it in the wheel. `make lint` checks the glue
# (filters/worker.py) against it with mypy, and it against the compiled module with mypy's stubtest.
from collections.abc import Sequence
from typing import Any, Protocol, final

from typing_extensions import Buffer, disjoint_base

__all__ = ["Answer", "Body", "RenderedFault", "ReplayCheck", "ReplayOutcome", "Route", "Table", "counters", "serve"]

class _Worker(Protocol):
    """What the frame calls back (filters/worker.py `Worker`)."""

    def handle(
        self, route: str, phase: str, body: Body, headers: dict[str, str], in_flight: Any, may_wait: bool, /
    ) -> Answer: ...
    def refused(self, route: str, phase: str, refusal: str, reason: str, /) -> None: ...
    def replay_refused(self, route: str, in_flight: Any, outcome: ReplayOutcome, /) -> Answer: ...
    def reload(self) -> Table | None: ...
    def ready(self) -> None: ...

@final
class Route:
    max_request_bytes: int
    max_response_bytes: int
    identity_header: str | None  # lowercase
    waits_on_network: bool  # its engine calls go to the engine threads (a partner STS, an OCSP responder)
    streamed: bool  # Envoy streams its bodies (FULL_DUPLEX_STREAMED): the frame holds them, then answers
    def __new__(
        cls,
        *,
        max_request_bytes: int,
        max_response_bytes: int,
        identity_header: str | None = None,
        waits_on_network: bool = False,
        streamed: bool = False,
    ) -> Route: ...

@final
class RenderedFault:
    """A refusal as the client gets it: the status, then (content type, body) for SOAP 1.1 and for SOAP 1.2."""

    def __new__(cls, status: int, soap11: tuple[str, bytes], soap12: tuple[str, bytes]) -> RenderedFault: ...

@final
class Table:
    """The routes by name and a fault for every refusal the frame makes itself (ValueError otherwise)."""

    def __new__(cls, routes: dict[str, Route], faults: dict[str, RenderedFault]) -> Table: ...

@final
class ReplayCheck:
    url: str
    keys: list[tuple[bytes, int]]  # (Redis key, TTL in ms)
    epoch_key: bytes
    since_ms: int  # the message's freshness evidence
    def __new__(cls, url: str, keys: list[tuple[bytes, int]], epoch_key: bytes, since_ms: int) -> ReplayCheck: ...

@disjoint_base
class ReplayOutcome:
    @final
    class First(ReplayOutcome):
        __match_args__ = ()
        def __new__(cls) -> ReplayOutcome.First: ...

    @final
    class Replayed(ReplayOutcome):
        __match_args__ = ("index",)
        @property
        def index(self) -> int: ...
        def __new__(cls, index: int) -> ReplayOutcome.Replayed: ...

    @final
    class BeforeEpoch(ReplayOutcome):
        __match_args__ = ("epoch_ms", "since_ms")
        @property
        def epoch_ms(self) -> int: ...
        @property
        def since_ms(self) -> int: ...
        def __new__(cls, epoch_ms: int, since_ms: int) -> ReplayOutcome.BeforeEpoch: ...

    @final
    class Unavailable(ReplayOutcome):
        __match_args__ = ("reason",)
        @property
        def reason(self) -> str: ...
        def __new__(cls, reason: str) -> ReplayOutcome.Unavailable: ...

@final
class Body:
    """A received body: `memoryview(body)` reads the frame's own bytes (read-only, never copied)."""

    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __len__(self) -> int: ...

# An answer's body: read-only bytes-like, or a sequence of them to join (the frame writes them to Envoy as they are).
_Segments = Buffer | Sequence[Buffer]

@final
class Answer:
    status: int | None  # None: the message is passed on
    body: _Segments | None  # None: unchanged
    headers: list[tuple[str, str]]
    in_flight: Any
    replay: ReplayCheck | None
    @staticmethod
    def forward(
        body: _Segments | None, headers: list[tuple[str, str]], in_flight: Any, replay: ReplayCheck | None = None
    ) -> Answer: ...
    @staticmethod
    def reply(
        status: int, body: _Segments, headers: list[tuple[str, str]], in_flight: Any, replay: ReplayCheck | None = None
    ) -> Answer: ...
    @staticmethod
    def elsewhere(in_flight: Any) -> Answer: ...  # no answer: make the call again where it may wait on the network

def serve(
    worker: _Worker,
    listen: str,
    table: Table,
    budget_bytes: int,
    max_message_bytes: int,
    grace_seconds: float = 5.0,
) -> None: ...
def counters() -> dict[str, Any]: ...
