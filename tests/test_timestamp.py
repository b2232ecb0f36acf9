"""wsu:Timestamp: the window, the BSP structure rules, the dateTime parser, and what we create."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta, timezone

import pytest
from lxml import etree

from filters.engine import faults, ns
from filters.engine.wss import timestamp
from gateway.policy import TimestampPolicy

NOW = datetime(2026, 11, 21, 20, 35, 10, 123456, tzinfo=UTC)
POLICY = TimestampPolicy(clock_skew_s=60, max_age_s=300)


def ts(*children: tuple[str, str], **attrs: str) -> etree._Element:
    """A Timestamp from (local name, text) pairs; a local name without a prefix is in wsu."""
    el = etree.Element(timestamp.TIMESTAMP, nsmap={"wsu": ns.WSU})
    for name, text in children:
        child = etree.SubElement(el, ns.q(ns.WSU, name), attrs)
        child.text = text
    return el


def iso(when: datetime) -> str:
    return timestamp.format_datetime(when)


def refused(el: etree._Element, code: str, reason: str, now: datetime = NOW) -> None:
    with pytest.raises(faults.Fault) as info:
        timestamp.check(el, POLICY, now)
    assert info.value.code == code
    assert info.value.code_ns == ns.WSSE
    assert reason in info.value.reason


def test_created_and_expires_accepted() -> None:
    created, expires = NOW - timedelta(seconds=10), NOW + timedelta(seconds=290)
    window = timestamp.check(ts(("Created", iso(created)), ("Expires", iso(expires))), POLICY, NOW)
    assert window == timestamp.Window(created.replace(microsecond=123000), expires.replace(microsecond=123000))


def test_expires_is_optional() -> None:
    window = timestamp.check(ts(("Created", "2026-11-21T20:35:00Z")), POLICY, NOW)
    assert window.created == datetime(2026, 11, 21, 20, 35, tzinfo=UTC)
    assert window.expires is None


def test_offsets_are_normalised_to_utc() -> None:
    el = ts(("Created", "2026-11-21T21:35:00.5+01:00"), ("Expires", "2026-11-21T15:36:00-05:00"))
    window = timestamp.check(el, POLICY, NOW)
    assert window.created == datetime(2026, 11, 21, 20, 35, 0, 500000, tzinfo=UTC)
    assert window.expires == datetime(2026, 11, 21, 20, 36, tzinfo=UTC)
    assert window.created.tzinfo is UTC


def test_comments_between_children_are_ignored() -> None:
    el = ts(("Created", iso(NOW)), ("Expires", iso(NOW + timedelta(seconds=5))))
    el.insert(1, etree.Comment("between"))
    assert timestamp.check(el, POLICY, NOW).expires is not None


@pytest.mark.parametrize(
    ("children", "reason"),
    [
        ((), "0 Created"),
        ((("Expires", "2026-11-21T20:40:00Z"),), "0 Created"),
        ((("Created", "2026-11-21T20:35:00Z"), ("Created", "2026-11-21T20:35:00Z")), "2 Created"),
        (
            (
                ("Created", "2026-11-21T20:35:00Z"),
                ("Expires", "2026-11-21T20:40:00Z"),
                ("Expires", "2026-11-21T20:40:00Z"),
            ),
            "one Created followed by an optional Expires",
        ),
        (  # BSP R3221: Created precedes Expires
            (("Expires", "2026-11-21T20:40:00Z"), ("Created", "2026-11-21T20:35:00Z")),
            "one Created followed by an optional Expires",
        ),
    ],
)
def test_structure_refused(children: tuple[tuple[str, str], ...], reason: str) -> None:
    refused(ts(*children), "InvalidSecurity", reason)


def test_foreign_child_refused() -> None:
    el = ts(("Created", iso(NOW)))
    etree.SubElement(el, ns.q(ns.WSSE, "Nonce")).text = "x"
    refused(el, "InvalidSecurity", "one Created followed by an optional Expires")


def test_not_a_timestamp_refused() -> None:
    el = etree.Element(ns.q(ns.WSSE, "Timestamp"))
    etree.SubElement(el, timestamp.CREATED).text = iso(NOW)
    refused(el, "InvalidSecurity", "expected wsu:Timestamp")


def test_value_type_refused() -> None:
    refused(ts(("Created", iso(NOW)), ValueType="x"), "InvalidSecurity", "ValueType")


def test_child_nodes_in_value_refused() -> None:
    el = ts(("Created", iso(NOW)))
    etree.SubElement(el[0], "b").text = "x"
    refused(el, "InvalidSecurity", "Created has child nodes")


@pytest.mark.parametrize(
    "value",
    [
        "2026-11-21T20:35:00",  # no time zone
        "2026-11-21T20:35:00.123",  # no time zone
        "2026-11-21 20:35:00Z",
        "2026-11-21T20:35Z",
        "20261121T203500Z",
        "2026-13-01T00:00:00Z",
        "2026-11-21T24:00:00Z",
        "2026-11-21T20:35:00+15:00",
        "2026-11-21T20:35:00+01:60",
        "2026-11-21T20:35:00+0100",
        "\u0662026-11-21T20:35:00Z",  # an Arabic-Indic digit
        "0001-01-01T00:00:00+01:00",  # before datetime.min once in UTC
        "",
        "tomorrow",
    ],
)
def test_bad_datetime_refused(value: str) -> None:
    refused(ts(("Created", value)), "InvalidSecurity", "Created is not a valid dateTime")
    refused(ts(("Created", iso(NOW)), ("Expires", value)), "InvalidSecurity", "Expires is not a valid dateTime")


def test_whitespace_around_value_is_collapsed() -> None:
    assert timestamp.check(ts(("Created", f"\n  {iso(NOW)}  ")), POLICY, NOW).created <= NOW


def test_fraction_longer_than_microseconds_is_truncated() -> None:
    assert timestamp.parse_datetime("2026-11-21T20:35:10.1234569Z").microsecond == 123456


def test_created_in_future_within_skew_accepted() -> None:
    assert timestamp.check(ts(("Created", iso(NOW + timedelta(seconds=59)))), POLICY, NOW)


def test_created_in_future_beyond_skew_refused() -> None:
    refused(ts(("Created", iso(NOW + timedelta(seconds=61)))), "MessageExpired", "Created is in the future")


def test_created_at_max_age_plus_skew_accepted() -> None:
    created = NOW.replace(microsecond=0) - timedelta(seconds=360)
    assert timestamp.check(ts(("Created", iso(created))), POLICY, NOW.replace(microsecond=0))


def test_created_older_than_max_age_plus_skew_refused() -> None:
    old = NOW - timedelta(seconds=361)
    refused(ts(("Created", iso(old))), "MessageExpired", "older than 300s (+60s skew)")
    # Refused even when Expires still lies ahead: the policy's max age caps the client's Expires.
    refused(
        ts(("Created", iso(old)), ("Expires", iso(NOW + timedelta(hours=1)))),
        "MessageExpired",
        "older than 300s",
    )


def test_expires_in_past_within_skew_accepted() -> None:
    el = ts(("Created", iso(NOW - timedelta(seconds=100))), ("Expires", iso(NOW - timedelta(seconds=59))))
    assert timestamp.check(el, POLICY, NOW).expires is not None


def test_expires_in_past_beyond_skew_refused() -> None:
    el = ts(("Created", iso(NOW - timedelta(seconds=100))), ("Expires", iso(NOW - timedelta(seconds=61))))
    refused(el, "MessageExpired", "Timestamp expired at")


def test_expires_before_created_refused() -> None:
    el = ts(("Created", iso(NOW)), ("Expires", iso(NOW - timedelta(seconds=1))))
    refused(el, "MessageExpired", "is before Created")


def test_replay_ttl_covers_the_rest_of_the_window() -> None:
    created = datetime(2026, 11, 21, 20, 35, tzinfo=UTC)
    now = created + timedelta(seconds=100)
    # No Expires: max age (300) + skew (60) from Created.
    assert timestamp.Window(created, None).replay_ttl_s(POLICY, now) == 260
    # An Expires sooner than max age ends the window earlier.
    assert timestamp.Window(created, created + timedelta(seconds=120)).replay_ttl_s(POLICY, now) == 80
    # A later Expires does not stretch it.
    assert timestamp.Window(created, created + timedelta(days=1)).replay_ttl_s(POLICY, now) == 260
    # At the very edge the entry still lives a moment.
    assert timestamp.Window(created, None).replay_ttl_s(POLICY, created + timedelta(seconds=360)) == 1


def test_create_shape_and_precision() -> None:
    el = timestamp.create(300, NOW, "TS-1")
    assert el.tag == timestamp.TIMESTAMP
    assert el.get(ns.q(ns.WSU, "Id")) == "TS-1"
    assert [c.tag for c in el] == [timestamp.CREATED, timestamp.EXPIRES]
    assert el[0].text == "2026-11-21T20:35:10.123Z"
    assert el[1].text == "2026-11-21T20:40:10.123Z"
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", c.text or "") for c in el)
    assert el.nsmap == {"wsu": ns.WSU}


def test_create_converts_to_utc() -> None:
    local = NOW.astimezone(timezone(timedelta(hours=-5)))
    assert timestamp.create(1, local, "t")[0].text == "2026-11-21T20:35:10.123Z"


def test_create_round_trips_through_check() -> None:
    el = etree.fromstring(etree.tostring(timestamp.create(60, NOW, "TS-2")))
    window = timestamp.check(el, POLICY, NOW)
    assert window.expires is not None
    assert window.expires - window.created == timedelta(seconds=60)


def test_create_refuses_non_positive_ttl() -> None:
    with pytest.raises(ValueError):
        timestamp.create(0, NOW, "t")
