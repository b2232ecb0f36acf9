"""Body bytes in flight: each filter worker admits exchanges only while their bodies fit its budget.

The worst case of a gateway's memory is (concurrent large exchanges) x (memory per exchange); the budget bounds
the first factor, counting only bytes that actually arrived: Envoy buffers a body whole (up to the route's limit)
before the body phase, and that body's real length is reserved then. A declared content-length reserves nothing
(a client that sends headers declaring 10 MB and then nothing must not hold the budget: Envoy's request timeouts
close it), nor does a chunked body. At a headers phase, a declared body over the route's own limit is refused at
once (413, or 502 for a backend response), before Envoy buffers it, and so is a content-length that is not a
number. An exchange holds one body at a time (its request, then its response), released when the stream ends.
What does not fit is refused at once, never queued: a 503 SOAP fault, with the reason `busy` in the log and the
metrics.

Sizes only: this module knows ext_proc messages and the route's limits, nothing of XML."""

from __future__ import annotations

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from filters import faults, metrics
from gateway.policy import Route


class Budget:
    """One worker's budget. The event loop is single-threaded, so plain integers suffice."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit = limit_bytes
        self.in_flight = 0
        metrics.BODY_BUDGET.set(limit_bytes)

    def ticket(self, route: Route) -> Ticket:
        return Ticket(self, route)

    def _resize(self, held: int, wanted: int) -> None:
        """Grow a reservation from `held` to `wanted` bytes, or raise a busy fault and keep `held`."""
        if wanted > held and self.in_flight - held + wanted > self.limit:
            raise faults.server(
                f"busy: {wanted} body bytes wanted, {self.limit - self.in_flight + held} of {self.limit} free",
                message="Service unavailable",
                status=503,
            )
        self.in_flight += wanted - held
        metrics.BODY_BYTES.set(self.in_flight)


class Ticket:
    """One exchange's reservation; `account` sees every ext_proc message, `release` runs when the stream ends."""

    __slots__ = ("budget", "held", "route")

    def __init__(self, budget: Budget, route: Route) -> None:
        self.budget = budget
        self.route = route
        self.held = 0

    def account(self, req: pb.ProcessingRequest) -> None:
        kind = req.WhichOneof("request")
        if kind == "request_headers":
            self._declared(req.request_headers, self.route.limits.max_body_bytes, response=False)
        elif kind == "response_headers":
            self._declared(req.response_headers, self.route.response_limits.max_body_bytes, response=True)
        elif kind == "request_body":
            self._take(len(req.request_body.body))
        elif kind == "response_body":
            self._take(len(req.response_body.body))

    @staticmethod
    def _declared(headers: pb.HttpHeaders, limit: int, *, response: bool) -> None:
        """Refuse a declared size over the route's limit; reserve nothing (no byte of the body has arrived)."""
        length = next((h.raw_value for h in headers.headers.headers if h.key == "content-length"), None)
        if length is None:
            return  # chunked, or no body: Envoy stops buffering at the route's limit
        if not length.isdigit():
            raise faults.client(f"content-length not a number: {length[:40]!r}")
        size = int(length)
        if size > limit:
            if response:
                raise faults.server(f"backend response refused: body too large: {size} > {limit} bytes", status=502)
            raise faults.client(f"body too large: {size} > {limit} bytes", status=413)

    def _take(self, size: int) -> None:
        """Hold `size` bytes that arrived: one body at a time (the response body replaces the request body)."""
        self.budget._resize(self.held, size)
        self.held = size

    def release(self) -> None:
        self.budget._resize(self.held, 0)
        self.held = 0
