"""Body bytes in flight: each filter worker admits exchanges only while their bodies fit its budget.

The worst case of a gateway's memory is (concurrent large exchanges) x (memory per exchange); the budget bounds
the first factor. An exchange reserves its body's declared size (content-length, or the route's limit when the
body is chunked) as soon as the headers arrive, so a refused body is never buffered by Envoy nor sent here; the
reservation follows the real size once the body arrives, moves from the request to the response when the backend
answers, and is released when the exchange ends. What does not fit is refused at once, never queued: a 503 SOAP
fault, with the reason `busy` in the log and the metrics. A declared body over the route's own limit is refused
here too (413, or 502 for a backend response), before Envoy buffers it.

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

    def _declared(self, headers: pb.HttpHeaders, limit: int, *, response: bool) -> None:
        length = next((h.raw_value for h in headers.headers.headers if h.key == "content-length"), None)
        if length is None:
            # Chunked: as large as the route lets it be (Envoy stops buffering there).
            self._take(0 if headers.end_of_stream else limit)
            return
        if not length.isdigit():
            raise faults.client(f"content-length not a number: {length[:40]!r}")
        size = int(length)
        if size > limit:
            if response:
                raise faults.server(f"backend response refused: body too large: {size} > {limit} bytes", status=502)
            raise faults.client(f"body too large: {size} > {limit} bytes", status=413)
        self._take(size)

    def _take(self, size: int) -> None:
        """Hold `size` bytes: one body at a time (once the response comes, the request body has left Envoy)."""
        self.budget._resize(self.held, size)
        self.held = size

    def release(self) -> None:
        self.budget._resize(self.held, 0)
        self.held = 0
