"""A multipart/related message (RFC 2387): its root part (the SOAP envelope) and its attachments.

A small strict parser over bytes, not Python's `email` package: `email` is built to read what mail user agents
send and repairs what it cannot read (bare LF line ends, folded and repeated headers, a boundary that merely
starts a line, junk before the first and after the last delimiter, a missing close delimiter): every repair is a
place where the gateway and the backend could split the same bytes into different parts. Here there is one
reading or a fault: CRLF line ends only, every occurrence of "--boundary" must be a delimiter, headers are
unfolded ASCII and unique per part, and every limit is checked before anything is copied. Parts are memoryview
slices of the one body (the frame's own bytes: filters/frame answer.rs `Body`), and a package is serialized as
segments that keep them: an attachment's bytes are never copied on the way through.

Content-IDs are kept without their angle brackets; `cid:` URLs (RFC 2392) are percent-decoded to compare."""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import NamedTuple, Protocol

from filters.engine import faults

CRLF = b"\r\n"
# RFC 2046 5.1.1: bchars, 1 to 70 of them, not ending in a space.
_BOUNDARY = re.compile(r"[0-9A-Za-z'()+_,\-./:=? ]{0,69}[0-9A-Za-z'()+_,\-./:=?]")
_TOKEN = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_MEDIA_TYPE = re.compile(rf"[ \t]*({_TOKEN})/({_TOKEN})[ \t]*")
_QUOTED = r'"[^"\\\r\n]*(?:\\[^\r\n][^"\\\r\n]*)*"'  # a quoted-string, its quoted pairs (one loop: sre backtracks less)
_PARAMETER = re.compile(rf";[ \t]*({_TOKEN})[ \t]*=[ \t]*({_TOKEN}|{_QUOTED})[ \t]*")
_QUOTED_PAIR = re.compile(r"\\(.)")
_HEADER_NAME = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
# A part's header block: unfolded lines of a name, a colon and printable ASCII (or tab), each ended by CRLF.
_HEADER_BLOCK = re.compile(rb"(?:[!#$%&'*+.^_`|~0-9A-Za-z-]+:[\t\x20-\x7e]*\r\n)*")
_HEADER_FIELD = re.compile(r"([^:]+):(.*)\r\n")  # one line of a block _HEADER_BLOCK matched
# msg-id as senders write it: no spaces, no brackets, no quotes, no '%' (a cid: URL's escape character: an id
# holding one could be named by two URLs).
_CONTENT_ID = re.compile(r"<([!#$&'*+\-./0-9:=?@A-Z^_`a-z{|}~]{1,250})>")
ROOT_TYPES = frozenset({"text/xml", "application/soap+xml", "application/xop+xml"})
ENCODINGS = frozenset({"binary", "8bit", "7bit", "base64"})
ROOT_ENCODINGS = frozenset({"binary", "8bit", "7bit"})
# A serialized package: its pieces in order, joined only where they are written (the frame writes them to Envoy).
Segments = tuple[bytes | bytearray | memoryview, ...]  # a bytearray: an attachment ciphered here


class Limits(Protocol):
    """gateway/policy.py Attachments; the total is the route's limits.max_body_bytes (the frame refuses more)."""

    max_parts: int  # the root part included
    max_part_header_bytes: int  # one part's header block
    max_boundary_length: int
    max_part_bytes: int  # one attachment's content


def refused(reason: str) -> faults.Fault:
    """Every MIME refusal: one metric class ("mime", filters/engine/faults.py), the detail for the log only."""
    return faults.client(f"mime: {reason}")


class MediaType(NamedTuple):
    """A Content-Type value: `type/subtype` lowercased, its parameters (names lowercased, values unquoted)."""

    essence: str
    params: dict[str, str]


def media_type(value: str, what: str) -> MediaType:
    m = _MEDIA_TYPE.match(value)
    if m is None:
        raise refused(f"{what} content type does not parse")
    params: dict[str, str] = {}
    at = m.end()
    while at < len(value):
        p = _PARAMETER.match(value, at)
        if p is None:
            raise refused(f"{what} content type parameters do not parse")
        name, raw = p[1].lower(), p[2]
        if name in params:
            raise refused(f"{what} content type repeats parameter {name}")
        if raw.startswith('"'):
            raw = raw[1:-1]
            if "\\" in raw:
                raw = _QUOTED_PAIR.sub(r"\1", raw)
        params[name] = raw
        at = p.end()
    return MediaType(f"{m[1]}/{m[2]}".lower(), params)


class Part(NamedTuple):
    """One part: its headers and content (a NamedTuple: made for every part of every message, ~4x cheaper than a
    frozen dataclass)."""

    headers: tuple[tuple[str, str], ...]  # as received, in order (names as spelled, values without outer spaces)
    content_id: str | None  # without angle brackets
    content_type: str  # the Content-Type header's value as received
    body: memoryview | bytes | bytearray  # the content, still in its transfer encoding (bytearray: ciphered here)
    raw_headers: memoryview | bytes | None = None  # the header block as received: serialized as it came
    parsed_type: MediaType | None = None  # content_type as `parse` read it

    @property
    def media(self) -> MediaType:
        """The Content-Type parsed: once, by `parse`, for the parts it read (read by every check and profile)."""
        return self.parsed_type if self.parsed_type is not None else media_type(self.content_type, "part")

    def header(self, name: str) -> str | None:
        name = name.lower()
        for n, v in self.headers:  # a loop: next() over a generator costs twice as much, read for every part
            if n.lower() == name:
                return v
        return None

    @property
    def transfer_encoding(self) -> str:
        return (self.header("content-transfer-encoding") or "7bit").lower()


class Package(NamedTuple):
    """A parsed or assembled package (a NamedTuple: made for every package parsed or changed; a frozen dataclass's
    `__init__` cost twice as much)."""

    root: Part
    attachments: tuple[Part, ...]
    start: str | None  # the start parameter's Content-ID, without brackets
    boundary: str
    content_type: str  # the outer Content-Type header as received
    params: Mapping[str, str] | None = None  # its parameters as `parse` read them (None: a package made to be written)

    @property
    def parts(self) -> Iterator[Part]:
        yield self.root
        yield from self.attachments

    def with_attachments(self, attachments: tuple[Part, ...]) -> Package:
        """The package with other attachments (`_replace` costs 4x)."""
        return Package(self.root, attachments, self.start, self.boundary, self.content_type, self.params)


def is_multipart(content_type_header: str | None) -> bool:
    """Whether a message declares itself multipart/related (what then decides everything is `parse`)."""
    m = _MEDIA_TYPE.match(content_type_header or "")
    return m is not None and f"{m[1]}/{m[2]}".lower() == "multipart/related"


def parse(content_type_header: str, body: bytes | memoryview, limits: Limits) -> Package:
    """The package, or the fault that names its first violation."""
    outer = media_type(content_type_header, "message")
    if outer.essence != "multipart/related":
        raise refused(f"message is {outer.essence[:60]}, not multipart/related")
    if "charset" in outer.params:
        raise refused("multipart message with a charset parameter")  # only the root part's own label counts
    boundary = outer.params.get("boundary", "")
    if not 0 < len(boundary) <= limits.max_boundary_length or not _BOUNDARY.fullmatch(boundary):
        raise refused(f"boundary missing, invalid or longer than {limits.max_boundary_length}")
    root_type = outer.params.get("type", "").lower()
    if root_type not in ROOT_TYPES:
        raise refused(f"type parameter {root_type[:60]!r} is not a SOAP or XOP type")
    start = outer.params.get("start")
    if start is not None:
        m = _CONTENT_ID.fullmatch(start)
        if m is None:
            raise refused("start parameter is not a Content-ID")
        start = m[1]
    parts = [_part(chunk, limits) for chunk in _split(memoryview(body), boundary.encode("ascii"), limits)]
    seen: set[str] = set()
    for p in parts:
        if p.content_id is not None:
            folded = p.content_id.lower()  # consumers that compare ids without case must not see two as one
            if folded in seen:
                raise refused("duplicate Content-ID")
            seen.add(folded)
    if start is None:
        root, rest = parts[0], parts[1:]
    else:
        at = next((i for i, p in enumerate(parts) if p.content_id == start), None)
        if at is None:
            raise refused("start parameter names no part")
        root, rest = parts[at], parts[:at] + parts[at + 1 :]
    _check_root(root, root_type, outer)
    for p in rest:
        _check_attachment(p, limits)
    return Package(root, tuple(rest), start, boundary, content_type_header, outer.params)


_LINE_ENDS = re.compile(rb"[\r\n]*")
_SEARCH_WINDOW = 64 * 1024  # the delimiter search's window (`_split`), from a first one that most parts end in
_FIRST_WINDOW = 4 * 1024


def _split(body: memoryview, boundary: bytes, limits: Limits) -> list[memoryview]:
    """The parts' bytes (headers and content) between the delimiters. Every "--boundary" in the body must be a
    delimiter (after CRLF, followed by CRLF or by the closing "--"): a boundary string anywhere else is refused,
    not read as content, so no reader can find a part boundary the gateway did not. The body is searched where it
    is, never copied whole: `bytes.find` over one window at a time (a window overlapping the next by the
    delimiter's length less one, so none is missed between them): about a quarter less CPU than `re`'s search over
    the memoryview (each window's copy stays in the cache)."""
    dash = b"--" + boundary
    overlap = len(dash) - 1

    def at(pos: int, what: bytes) -> bool:
        return body[pos : pos + len(what)] == what

    def find(pos: int) -> int:
        window = _FIRST_WINDOW
        while pos < len(body):
            i = body[pos : pos + window + overlap].tobytes().find(dash)
            if i != -1:
                return pos + i
            pos += window
            window = min(2 * window, _SEARCH_WINDOW)
        return -1

    first = 0
    while at(first, CRLF):  # a preamble of blank lines is tolerated, nothing else
        first += 2
    if not at(first, dash):
        raise refused("message does not start with the boundary")
    chunks: list[memoryview] = []
    nxt = first
    while True:
        after = nxt + len(dash)
        if at(after, b"--"):  # the close delimiter
            if not _LINE_ENDS.fullmatch(body, after + 2) or find(after) != -1:
                raise refused("content after the close delimiter")
            break
        if not at(after, CRLF):
            raise refused("boundary string inside content or followed by other than CRLF")
        nxt = find(after)
        if nxt == -1:
            raise refused("no close delimiter")
        if not at(nxt - 2, CRLF):
            raise refused("boundary string inside content (not after CRLF)")
        if len(chunks) == limits.max_parts:
            raise refused(f"more than {limits.max_parts} parts")
        chunks.append(body[after + 2 : nxt - 2])
    if not chunks:
        raise refused("no parts")
    return chunks


def _part(chunk: memoryview, limits: Limits) -> Part:
    raw = chunk[: limits.max_part_header_bytes + 4].tobytes()  # the headers are looked for in this much only
    if raw.startswith(CRLF):
        end = 0  # no headers at all
    else:
        end = raw.find(b"\r\n\r\n")
        if end == -1:
            raise refused(
                f"part headers unterminated (bare line ends?) or longer than {limits.max_part_header_bytes} bytes"
            )
        end += 2
    if end > limits.max_part_header_bytes:
        raise refused(f"part headers longer than {limits.max_part_header_bytes} bytes")
    block = raw[:end]
    if not _HEADER_BLOCK.fullmatch(block):
        raise refused(_header_fault(block))
    headers = [(n, v.strip(" \t")) for n, v in _HEADER_FIELD.findall(block.decode("ascii"))]
    found = {n.lower(): v for n, v in headers}
    if len(found) < len(headers):
        raise refused(f"part header {_repeated(n.lower() for n, _ in headers)[:40]} repeated")
    content_id = None
    if "content-id" in found:
        m = _CONTENT_ID.fullmatch(found["content-id"])
        if m is None:
            raise refused("malformed Content-ID")
        content_id = m[1]
    if "content-type" not in found:
        raise refused("part without a Content-Type")
    if "content-location" in found:  # a second way to name a part (RFC 2557), which no check here resolves
        raise refused("part with a Content-Location")
    content_type = found["content-type"]
    return Part(
        tuple(headers), content_id, content_type, chunk[end + 2 :], chunk[:end], media_type(content_type, "part")
    )


def _header_fault(block: bytes) -> str:
    """Why `_HEADER_BLOCK` refused a part's header block, for the log."""
    if b"\n" in block.replace(CRLF, b"") or b"\r" in block.replace(CRLF, b""):
        return "bare CR or LF in part headers"
    for line in block.split(CRLF)[:-1]:
        if line[:1] in (b" ", b"\t"):
            return "folded part header"
        name, colon, _ = line.partition(b":")
        if not colon or not _HEADER_NAME.fullmatch(name):
            return "malformed part header"
    return "non-ASCII or control character in a part header"


def _repeated(names: Iterable[str]) -> str:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            return name
        seen.add(name)
    raise AssertionError("no name repeated")


def _check_root(root: Part, root_type: str, outer: MediaType) -> None:
    media = root.media
    if media.essence != root_type:
        raise refused(f"root part is {media.essence[:60]}, the type parameter says {root_type}")
    if root.transfer_encoding not in ROOT_ENCODINGS:
        raise refused(f"root part transfer encoding {root.transfer_encoding[:40]!r}")
    charset = media.params.get("charset")
    if charset is not None and charset.lower() not in ("utf-8", "utf-16", "utf-16le", "utf-16be"):
        raise refused(f"root part charset {charset[:40]!r}")
    if root_type == "application/xop+xml":
        # The SOAP media type travels in the root's own type parameter and the message's start-info: both, the same.
        inner = media.params.get("type", "").lower()
        info = outer.params.get("start-info", inner).lower()
        if inner not in ("text/xml", "application/soap+xml") or media_type(info, "start-info").essence != inner:
            raise refused("XOP root part without a matching SOAP type and start-info")


def _check_attachment(part: Part, limits: Limits) -> None:
    if part.content_id is None:
        raise refused("attachment without a Content-ID")
    essence = part.media.essence
    if essence.startswith(("multipart/", "message/")):
        raise refused(f"nested {essence[:60]} part")
    if part.transfer_encoding not in ENCODINGS:
        raise refused(f"transfer encoding {part.transfer_encoding[:40]!r}")
    if len(part.body) > limits.max_part_bytes:
        raise refused(f"part larger than {limits.max_part_bytes} bytes")


_ESCAPE = re.compile(r"%([0-9A-Fa-f]{2})")
_ID_CHARACTERS = re.compile(r"[\x21-\x7e]*")  # printable ASCII: what a Content-ID (_CONTENT_ID) may hold


def cid(url: str) -> str | None:
    """The Content-ID a `cid:` URL names (RFC 2392: percent-decoded), or None for any other URL or an escape that
    does not decode to a printable ASCII character (no Content-ID holds one)."""
    if url[:4].lower() != "cid:":
        return None
    decoded = _ESCAPE.sub(lambda m: chr(int(m[1], 16)), url[4:]) if "%" in url else url[4:]
    return decoded if _ID_CHARACTERS.fullmatch(decoded) else None


def find(package: Package, url_or_id: str) -> Part | None:
    """The attachment a `cid:` URL (or a bare Content-ID) names; None if none does. The root is not an attachment:
    a reference to it is the caller's to refuse (xop.references)."""
    return attachment(package, cid(url_or_id) if url_or_id[:4].lower() == "cid:" else url_or_id)


def attachment(package: Package, content_id: str | None) -> Part | None:
    """The attachment with this Content-ID (None: none has it)."""
    return next((p for p in package.attachments if p.content_id == content_id), None) if content_id else None


def _header_block(part: Part) -> bytes | memoryview:
    if part.raw_headers is not None:
        return part.raw_headers
    return b"".join(f"{n}: {v}\r\n".encode("ascii") for n, v in part.headers)


def segments(boundary: str, parts: Iterable[Part]) -> Segments:
    """A package's parts (its root first) serialized: each part's header block and content as they are
    (byte-exact for untouched parts, the very slices received), between delimiters of `boundary`. No copy."""
    dash = b"--" + boundary.encode("ascii")
    pieces: list[bytes | bytearray | memoryview] = []
    for p in parts:
        pieces += [dash, CRLF, _header_block(p), CRLF, p.body, CRLF]
    pieces += [dash, b"--", CRLF]
    return tuple(pieces)


_TOKEN_VALUE = re.compile(_TOKEN)


@functools.lru_cache(maxsize=64)  # the parameters but the boundary recur message after message
def _parameter(name: str, value: str) -> str:
    if _TOKEN_VALUE.fullmatch(value):
        return f"{name}={value}"
    return f'{name}="' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def rebound(package: Package) -> tuple[str, str]:
    """A boundary of the gateway's own, drawn now, and the package's Content-Type (as received: parsed before)
    rendered anew with it. For a package the gateway writes anew: its new bytes (a root re-serialized, parts
    decrypted) are partly the sender's choice, and the sender knew the received boundary. Text the parser saw as
    character references (`&#45;&#45;boundary`) is written back as the characters, and a plaintext is whatever
    was encrypted: under the received boundary either could end a part early, or start parts the gateway never
    checked, for a lenient reader. 128 random bits drawn after the content exists are in none of it. The
    parameters are those `parse` read (a second parse of the header cost about as much as the rest)."""
    boundary = f"wsgate-{os.urandom(16).hex()}"  # secrets.token_hex's own bytes, without its two calls around
    received = package.params if package.params is not None else media_type(package.content_type, "message").params
    params = ["multipart/related"]
    for name, value in received.items():  # in their order, the boundary where it was (a token: as it is)
        params.append(f"boundary={boundary}" if name == "boundary" else _parameter(name, value))
    if "boundary" not in received:
        params.append(f"boundary={boundary}")
    return boundary, "; ".join(params)


def serialize(package: Package) -> bytes:
    """The package as bytes: its `segments` joined (one copy)."""
    return b"".join(segments(package.boundary, package.parts))


def with_content(part: Part, body: bytes | memoryview, set_headers: Mapping[str, str] | None = None) -> Part:
    """`part` with new content and `set_headers` (each name once, in any case) replacing the headers of those names
    (or added); its header block rendered anew where that changes a header, else kept as received."""
    for name, value in (set_headers or {}).items():  # a loop: all() over a generator cost a quarter of the call
        if part.header(name) != value:
            break
    else:  # the usual case (the root's Content-Type as it was): no dict of the names lowercased, ~4K instructions
        return Part(part.headers, part.content_id, part.content_type, body, part.raw_headers, part.parsed_type)
    new = {n.lower(): (n, v) for n, v in (set_headers or {}).items()}
    content_type = new.get("content-type", ("", part.content_type))[1]
    headers = tuple(new.pop(n.lower(), (n, v)) for n, v in part.headers) + tuple(new.values())
    return Part(headers, part.content_id, content_type, body, None)
