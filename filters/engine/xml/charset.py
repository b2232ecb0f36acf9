"""The character encoding of a message: what its bytes are in, and the Content-Type label that names it.

A SOAP message is UTF-8 or UTF-16 (WS-I Basic Profile R1012; SOAP 1.2 Part 2); anything else is refused. The
encoding is found the XML way (XML 1.0 Appendix F: byte order mark, else the first bytes of the declaration),
the declaration's encoding must agree, and the checks and libxml2 only ever see UTF-8: a UTF-16 body is
transcoded first, so a DOCTYPE or a namespace declaration cannot hide from a byte-level check in another
encoding. The label a client or backend sent is never trusted: the next hop gets a Content-Type whose charset
names the encoding of the bytes it gets (the gateway's UTF-8 when it re-serialized, the body's own otherwise)."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from filters.engine import faults

_S = rb"[ \t\r\n]"
_QUOTED = rb"(?:\"([A-Za-z][A-Za-z0-9._-]*)\"|'([A-Za-z][A-Za-z0-9._-]*)')"
# XMLDecl: version, then optional encoding and standalone, in that order (XML 1.0 production 23).
_DECLARATION = re.compile(
    rb"<\?xml" + _S + rb"+version" + _S + rb"*=" + _S + rb"*(?:\"1\.[0-9]+\"|'1\.[0-9]+')"
    rb"(?:" + _S + rb"+encoding" + _S + rb"*=" + _S + rb"*" + _QUOTED + rb")?"
    rb"(?:" + _S + rb"+standalone" + _S + rb"*=" + _S + rb"*(?:\"(?:yes|no)\"|'(?:yes|no)'))?" + _S + rb"*\?>"
)
_DECLARATION_START = re.compile(rb"<\?xml(?:" + _S + rb"|\?)")
_UTF8_NAMES = {"utf-8"}
_UTF16_NAMES = {"utf-16", "utf-16le", "utf-16be"}
_UTF32_BOMS = (b"\x00\x00\xfe\xff", b"\xff\xfe\x00\x00")


@dataclass(frozen=True)
class Decoded:
    utf8: bytes  # the document in UTF-8, its declaration (if any) naming UTF-8: what the parser gets
    encoding: str  # the encoding of the bytes received, as a charset label: utf-8, utf-16, utf-16le, utf-16be


def decode(data: bytes) -> Decoded:
    """The document's encoding and its UTF-8 form; a Client fault for any encoding but UTF-8 and UTF-16."""
    head = data[:4]
    if head.startswith(_UTF32_BOMS):
        raise faults.client("unsupported encoding UTF-32 (UTF-8 or UTF-16 only)")
    if head.startswith(b"\xef\xbb\xbf"):
        return Decoded(_checked_declaration(data, 3, _UTF8_NAMES, "utf-8"), "utf-8")
    if head.startswith((b"\xfe\xff", b"\xff\xfe")):
        return _from_utf16(data, "utf-16", "utf-16")
    if head == b"<\x00?\x00":
        return _from_utf16(data, "utf-16-le", "utf-16le")
    if head == b"\x00<\x00?":
        return _from_utf16(data, "utf-16-be", "utf-16be")
    if b"\x00" in head or head == b"\x4c\x6f\xa7\x94":
        raise faults.client("unsupported encoding (UTF-8 or UTF-16 only)")  # UTF-32, EBCDIC, or no XML at all
    return Decoded(_checked_declaration(data, 0, _UTF8_NAMES, "utf-8"), "utf-8")


def _from_utf16(data: bytes, codec: str, label: str) -> Decoded:
    try:
        text = data.decode(codec)
    except UnicodeDecodeError:
        raise faults.client(f"malformed XML: not {label}") from None
    utf8 = text.encode("utf-8")  # the codec took the byte order mark off
    return Decoded(_checked_declaration(utf8, 0, _UTF16_NAMES, label), label)


def _checked_declaration(utf8: bytes, start: int, allowed: set[str], found: str) -> bytes:
    """`utf8` with its XML declaration checked against the encoding found, and naming UTF-8 if it named another
    (libxml2 would switch to the declared one)."""
    if not _DECLARATION_START.match(utf8, start):
        return utf8
    decl = _DECLARATION.match(utf8, start)
    if decl is None:
        raise faults.client("malformed XML declaration")
    name = decl[1] or decl[2]
    if name is None:
        return utf8
    if name.decode("ascii").lower() not in allowed:
        raise faults.client(f"XML declaration names encoding {name[:40]!r}, the body is {found}")
    if found == "utf-8":
        return utf8
    at = decl.start(1) if decl[1] else decl.start(2)
    return utf8[:at] + b"UTF-8" + utf8[at + len(name) :]


# Content-Type: type "/" subtype *( OWS ";" OWS parameter ), parameter = token "=" ( token / quoted-string )
_TOKEN = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_MEDIA_TYPE = re.compile(rf"\s*({_TOKEN}/{_TOKEN})\s*")
_PARAMETER = re.compile(rf";\s*({_TOKEN})=({_TOKEN}|\"(?:[^\"\\]|\\.)*\")\s*")


@functools.lru_cache(maxsize=64)  # a sender's label recurs: a hit costs a fifth of the parse (12K instructions)
def content_type(received: str | None, encoding: str, soap_version: str) -> str:
    """`received` (the sender's Content-Type) with its charset naming `encoding`, other parameters (SOAP 1.2's
    action) kept; the SOAP version's media type when there was none or it does not parse."""
    received = received or ""
    media = _MEDIA_TYPE.match(received)
    if media is None:
        return f"{faults.content_type(soap_version).split(';')[0]}; charset={encoding}"
    kept, at = [], media.end()
    while at < len(received) and (param := _PARAMETER.match(received, at)) is not None:
        if param[1].lower() != "charset":
            kept.append(f"{param[1]}={param[2]}")
        at = param.end()
    if at != len(received):
        kept = []  # parameters that do not parse are not passed on: the label must not be ambiguous
    return "; ".join([media[1], *kept, f"charset={encoding}"])
