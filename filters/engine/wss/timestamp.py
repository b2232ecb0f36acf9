"""wsu:Timestamp (WS-Security 1.0 section 10, Basic Security Profile 1.1 section 8.3).

`check` reads a request's Timestamp and refuses it when it is malformed (InvalidSecurity) or outside the
freshness window (MessageExpired); `create` makes one for a message we send. The xsd:dateTime parser and
the freshness check are shared with the UsernameToken's wsse:Created."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone

from lxml import etree

from filters.engine import faults, ns
from gateway.policy import TimestampPolicy

TIMESTAMP = ns.q(ns.WSU, "Timestamp")
CREATED = ns.q(ns.WSU, "Created")
EXPIRES = ns.q(ns.WSU, "Expires")

# xsd:dateTime with a mandatory time zone. ASCII only: `\d` alone would also take other scripts' digits.
_DATETIME = re.compile(
    r"([0-9]{4})-([0-9]{2})-([0-9]{2})T([0-9]{2}):([0-9]{2}):([0-9]{2})(?:\.([0-9]+))?(Z|[+-][0-9]{2}:[0-9]{2})"
)
_MAX_OFFSET_MIN = 14 * 60  # xsd:dateTime zones run from -14:00 to +14:00


@dataclass(frozen=True)
class Window:
    """A checked Timestamp, in UTC."""

    created: datetime
    expires: datetime | None

    def replay_ttl_s(self, policy: TimestampPolicy, now: datetime) -> float:
        """How long from `now` the message stays acceptable: the TTL its replay-cache entry needs."""
        last = self.created + timedelta(seconds=policy.max_age_s)
        if self.expires is not None:
            last = min(last, self.expires)
        # At least a second, so an entry made right at the edge of the window still lands in the cache.
        return max((last - now).total_seconds() + policy.clock_skew_s, 1.0)


def parse_datetime(text: str) -> datetime:
    """An xsd:dateTime that names its time zone, as an aware UTC datetime; ValueError for anything else."""
    m = _DATETIME.fullmatch(text.strip())
    if m is None:
        raise ValueError("not an xsd:dateTime with a time zone")
    year, month, day, hour, minute, second = (int(g) for g in m.groups()[:6])
    micro = int((m.group(7) or "")[:6].ljust(6, "0"))  # finer digits than microseconds are dropped
    zone = m.group(8)
    if zone == "Z":
        tz = UTC
    else:
        offset = int(zone[1:3]) * 60 + int(zone[4:6])
        if int(zone[4:6]) > 59 or offset > _MAX_OFFSET_MIN:
            raise ValueError("time zone offset out of range")
        tz = timezone(timedelta(minutes=-offset if zone[0] == "-" else offset))
    try:
        return datetime(year, month, day, hour, minute, second, micro, tzinfo=tz).astimezone(UTC)
    except OverflowError:
        # Year 1 with a positive offset lands before datetime.min in UTC.
        raise ValueError("date out of range") from None


def format_datetime(when: datetime) -> str:
    """UTC with millisecond precision, as WSS4J writes it: 2026-11-21T20:35:10.123Z."""
    utc = when.astimezone(UTC)
    return f"{utc:%Y-%m-%dT%H:%M:%S}.{utc.microsecond // 1000:03d}Z"


def check_fresh(created: datetime, now: datetime, max_age_s: int, skew_s: int, what: str) -> None:
    """Refuse a creation instant too far in the future or too old (MessageExpired)."""
    if created > now + timedelta(seconds=skew_s):
        raise faults.security("MessageExpired", f"{what} is in the future: {format_datetime(created)}")
    if created < now - timedelta(seconds=max_age_s + skew_s):
        raise faults.security(
            "MessageExpired",
            f"{what} is older than {max_age_s}s (+{skew_s}s skew): {format_datetime(created)}",
        )


def _value(el: etree._Element) -> datetime:
    name = etree.QName(el).localname
    # BSP R3225/R3226: no ValueType, and the value is a plain xsd:dateTime.
    if el.get("ValueType") is not None:
        raise faults.security("InvalidSecurity", f"Timestamp {name} has a ValueType attribute")
    if len(el):
        raise faults.security("InvalidSecurity", f"Timestamp {name} has child nodes")
    try:
        return parse_datetime(el.text or "")
    except ValueError as exc:
        raise faults.security("InvalidSecurity", f"Timestamp {name} is not a valid dateTime: {exc}") from None


def check(ts: etree._Element, policy: TimestampPolicy, now: datetime) -> Window:
    """Check a wsu:Timestamp against the policy's window at `now` (an aware datetime)."""
    if ts.tag != TIMESTAMP:
        raise faults.security("InvalidSecurity", f"expected wsu:Timestamp, got {str(ts.tag)[:120]}")
    children = [c for c in ts if isinstance(c.tag, str)]
    tags = [c.tag for c in children]
    # BSP R3203/R3224/R3221/R3222: one Created, first; at most one Expires, after it; nothing else.
    if tags.count(CREATED) != 1:
        raise faults.security("InvalidSecurity", f"Timestamp has {tags.count(CREATED)} Created elements")
    if tags not in ([CREATED], [CREATED, EXPIRES]):
        raise faults.security("InvalidSecurity", "Timestamp must be one Created followed by an optional Expires")
    created = _value(children[0])
    expires = _value(children[1]) if len(children) == 2 else None

    check_fresh(created, now, policy.max_age_s, policy.clock_skew_s, "Timestamp Created")
    if expires is not None:
        if expires < created:
            raise faults.security(
                "MessageExpired",
                f"Timestamp Expires {format_datetime(expires)} is before Created {format_datetime(created)}",
            )
        if expires < now - timedelta(seconds=policy.clock_skew_s):
            raise faults.security(
                "MessageExpired",
                f"Timestamp expired at {format_datetime(expires)} (+{policy.clock_skew_s}s skew)",
            )
    return Window(created=created, expires=expires)


def create(ttl_s: int, now: datetime, id: str) -> etree._Element:
    """A wsu:Timestamp created `now` that expires `ttl_s` seconds later, with wsu:Id `id`."""
    if ttl_s <= 0:
        raise ValueError(f"Timestamp TTL must be positive, got {ttl_s}")
    ts = etree.Element(TIMESTAMP, {ns.q(ns.WSU, "Id"): id}, nsmap={"wsu": ns.WSU})
    etree.SubElement(ts, CREATED).text = format_datetime(now)
    etree.SubElement(ts, EXPIRES).text = format_datetime(now + timedelta(seconds=ttl_s))
    return ts
