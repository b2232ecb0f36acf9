"""The text values the engine acts on (SignatureValue, DigestValue, CipherValue...), each read whole and the
same way on every path.

Comments are gone before anything is read (wssecurity.process removes them: C14N without comments ignores them,
so removing them changes nothing a signature covers), the parser merges CDATA sections into text, threat
protection refuses entities and processing instructions: what is left of a value is its text, one string. A
child element inside a value is refused, never skipped. Base64 is decoded strictly once XML whitespace (space,
tab, CR, LF) is removed, so one value has one byte string, whatever line breaks or splits it was sent with."""

from __future__ import annotations

import base64

from lxml import etree

from filters.engine import faults

_XML_WHITESPACE = b" \t\r\n"


def text(el: etree._Element, what: str, code: str = "InvalidSecurity") -> str:
    """The whole text of a value element that must hold text only."""
    if len(el):
        raise faults.security(code, f"{what} has child nodes")
    return el.text or ""


def base64_bytes(el: etree._Element, what: str, code: str = "InvalidSecurity") -> bytes:
    """The decoded bytes of a base64 value element; `code` for anything else (empty included)."""
    try:
        # Deleting bytes is C work; str.translate looks every character up (2 us a DigestValue).
        value = base64.b64decode(text(el, what, code).encode().translate(None, _XML_WHITESPACE), validate=True)
    except ValueError:  # binascii.Error (characters outside ASCII included)
        raise faults.security(code, f"{what} is not base64") from None
    if not value:
        raise faults.security(code, f"{what} is empty")
    return value
