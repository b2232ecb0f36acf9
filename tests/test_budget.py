"""The body budget's accounting on ext_proc messages: what an exchange holds at each step, and what it refuses."""

from __future__ import annotations

import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from filters import faults
from filters.budget import Budget
from gateway.policy import Route

ROUTE = Route.model_validate({
    "name": "r", "match": {"path_prefix": "/"}, "upstream": {"address": "127.0.0.1:1"}, "profile": "xml",
    "limits": {"max_body_bytes": 1000}, "response_limits": {"max_body_bytes": 3000},
})  # fmt: skip


def headers(kind: str, length: int | str | None, end: bool = False) -> pb.ProcessingRequest:
    values = [HeaderValue(key=":method", raw_value=b"POST")]
    if length is not None:
        values.append(HeaderValue(key="content-length", raw_value=str(length).encode()))
    return pb.ProcessingRequest(**{kind: pb.HttpHeaders(headers=HeaderMap(headers=values), end_of_stream=end)})


def body(kind: str, size: int) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(**{kind: pb.HttpBody(body=b"x" * size, end_of_stream=True)})


def test_an_exchange_holds_one_body_at_a_time_and_releases_it() -> None:
    budget = Budget(5000)
    ticket = budget.ticket(ROUTE)
    ticket.account(headers("request_headers", 900))
    assert budget.in_flight == 0  # declared: no byte has arrived yet
    ticket.account(body("request_body", 800))
    assert budget.in_flight == 800  # the body Envoy buffered whole
    ticket.account(headers("response_headers", None))
    assert budget.in_flight == 800  # chunked response: still the request body until the response body arrives
    ticket.account(body("response_body", 2500))
    assert budget.in_flight == 2500  # one body at a time
    ticket.release()
    assert budget.in_flight == 0


def test_declared_lengths_that_never_arrive_hold_nothing() -> None:
    """Clients that send headers declaring large bodies and then nothing must not pin the budget."""
    budget = Budget(1500)
    idle = [budget.ticket(ROUTE) for _ in range(50)]
    for ticket in idle:
        ticket.account(headers("request_headers", 1000))
    assert budget.in_flight == 0
    real = budget.ticket(ROUTE)
    real.account(headers("request_headers", 1000))
    real.account(body("request_body", 1000))
    assert budget.in_flight == 1000
    real.release()
    assert budget.in_flight == 0


def test_what_does_not_fit_is_refused_and_holds_nothing() -> None:
    budget = Budget(1500)
    first = budget.ticket(ROUTE)
    first.account(body("request_body", 1000))
    second = budget.ticket(ROUTE)
    with pytest.raises(faults.Fault) as refused:
        second.account(body("request_body", 600))
    assert (refused.value.http_status, faults.metric_reason(refused.value)) == (503, "busy")
    assert refused.value.message == "Service unavailable" and not refused.value.sender
    second.release()
    assert budget.in_flight == 1000
    second.account(body("request_body", 500))  # fits exactly
    first.release()
    second.release()
    assert budget.in_flight == 0


def test_a_response_body_that_does_not_fit_is_refused_and_keeps_the_request_reservation() -> None:
    budget = Budget(3000)
    first, second = budget.ticket(ROUTE), budget.ticket(ROUTE)
    first.account(body("request_body", 1000))
    second.account(body("request_body", 1000))
    with pytest.raises(faults.Fault):
        first.account(body("response_body", 2500))
    assert budget.in_flight == 2000
    first.release()
    second.release()
    assert budget.in_flight == 0


@pytest.mark.parametrize(
    ("message", "status", "reason"),
    [
        (headers("request_headers", 1001), 413, "body too large"),
        (headers("response_headers", 3001), 502, "backend response refused"),
        (headers("request_headers", "12x"), 500, "content-length not a number"),
    ],
)
def test_declared_sizes_over_the_route_limit_are_refused(
    message: pb.ProcessingRequest, status: int, reason: str
) -> None:
    budget = Budget(10_000)
    ticket = budget.ticket(ROUTE)
    with pytest.raises(faults.Fault) as refused:
        ticket.account(message)
    assert (refused.value.http_status, faults.metric_reason(refused.value)) == (status, reason)
    assert budget.in_flight == 0


@pytest.mark.parametrize("length", [None, 0, 1000])
def test_headers_reserve_nothing(length: int | None) -> None:
    budget = Budget(10)
    ticket = budget.ticket(ROUTE)
    ticket.account(headers("request_headers", length, end=length is None))
    ticket.account(headers("response_headers", length))
    assert budget.in_flight == 0
