"""XOP (XML-binary Optimized Packaging, W3C 2005), MTOM's packaging: `xop:Include href="cid:..."` elements that
stand for base64 content carried as a MIME part, resolved here to what they stand for, and the `cid:` URLs a root
part holds (what names an attachment: an xop:Include, an attribute such as a signature Reference's URI, a swaRef
text)."""

from __future__ import annotations

import base64
import binascii
import re

from lxml import etree

from filters.engine.mime import package as mime

XOP = "http://www.w3.org/2004/08/xop/include"
INCLUDE = f"{{{XOP}}}Include"
# A value names a part when, read as XPath's normalize-space() and translate(., 'CID', 'cid') read it, it starts with
# "cid:": the XPath `//@*[starts-with(translate(normalize-space(.), 'CID', 'cid'), 'cid:')] | //*[not(*)][...]`,
# read here from the lists of strings libxml2 gathers (its evaluation of that expression cost ~100 us an envelope, a
# walk of the elements ~30 us: their proxies).
_URL_START = re.compile(r"[ \t\r\n]*[cC][iI][dD]:")
_URL_FIRST = frozenset("cC \t\r\n")  # what such a value starts with: most fail on that before the regex
_ATTRIBUTE_VALUES = etree.XPath("//@*", smart_strings=False)
_COLONS_ONE_BY_ONE = 16


def includes(root: etree._Element) -> list[etree._Element]:
    """The document's xop:Include elements (a tag-filtered walk in C: a third cheaper than the XPath)."""
    return list(root.getroottree().iter(INCLUDE))


def cid_urls(root: etree._Element) -> list[str]:
    """Every attribute value, and the text of every element without element children (its text nodes joined: a
    comment or a CDATA section cannot split a URL out of sight), that a reader trimming it reads as a `cid:` URL;
    trimmed. Values, and a document's text, without the colon such a URL holds are passed over in C
    (`_may_name_a_part`): a leaf's text nodes are next to each other in the document's text, which libxml2 writes
    as one string (a third of the cost of listing the text nodes and joining them)."""
    values = _ATTRIBUTE_VALUES(root)
    found: list[str] = []
    if _may_name_a_part("\0" + "\0".join(values)):
        found = [v.strip() for v in values if v[:1] in _URL_FIRST and _URL_START.match(v)]
    if not _may_name_a_part(etree.tostring(root.getroottree(), method="text", encoding=str)):
        return found
    for el in root.getroottree().iter(etree.Element):
        if not len(el):
            text = el.text or ""
        elif any(isinstance(child.tag, str) for child in el):
            continue
        else:  # comments or processing instructions only: the text nodes around them
            text = "".join(el.itertext())
        if _URL_START.match(text):
            found.append(text.strip())
    return found


def _may_name_a_part(joined: str) -> bool:
    """Whether a colon in `joined` (attribute values, each after a \0: no XML character; or the document's text,
    where a comment or PI splitting a leaf's text leaves no mark) may be a `cid:` URL's: "d" before it (or \0, a
    colon starting a value; at 0 the last character: a false alarm at worst). A superset: whether to read the
    strings one by one."""
    # Colon by colon (a memchr each): a two-character `in` scans ~1 ns a character, three of them ~9 us over a
    # Security header's texts. Past a few colons (URIs, many timestamps), the scans: bounded either way.
    at = joined.find(":")
    for _ in range(_COLONS_ONE_BY_ONE):
        if at == -1:
            return False
        if joined[at - 1] in "dD\0":
            return True
        at = joined.find(":", at + 1)
    return "d:" in joined or "D:" in joined or "\0:" in joined


def references(root: etree._Element, package: mime.Package) -> set[str]:
    """The Content-IDs of the attachments the root part names. A `cid:` URL that names no attachment, or the root
    part itself, is refused: a reader could resolve it to something the gateway never checked."""
    named: set[str] = set()
    for url in cid_urls(root):  # each starts with "cid:", in some case
        wanted = mime.cid(url)
        if wanted is not None and wanted == package.root.content_id:
            raise mime.refused("cid: reference to the root part")
        part = mime.attachment(package, wanted)
        if part is None or part.content_id is None:
            raise mime.refused("cid: reference to no part")
        named.add(part.content_id)
    return named


def check_includes(root: etree._Element, package: mime.Package, xop_package: bool) -> list[etree._Element]:
    """The xop:Include elements, each the only content of its parent (XOP 3.1: the Include replaces the whole
    base64 text), empty, with an href naming an attachment; none in a package that is not XOP."""
    found = includes(root)
    if found and not xop_package:
        raise mime.refused("xop:Include outside an XOP package")
    for inc in found:
        parent = inc.getparent()
        href = inc.get("href")
        if href is None or mime.find(package, href) is None:
            raise mime.refused("xop:Include naming no attachment")
        if len(inc) or (inc.text or "").strip() or parent is None or len(parent) != 1:
            raise mime.refused("xop:Include not alone in its element or not empty")
        if (parent.text or "").strip() or (inc.tail or "").strip():
            raise mime.refused("xop:Include beside text")
    return found


def octets(part: mime.Part) -> bytes:
    """The part's content without its transfer encoding."""
    if part.transfer_encoding != "base64":
        return bytes(part.body)  # a bytes body is returned as it is, not copied
    try:
        return base64.b64decode(bytes(part.body).replace(b"\r\n", b""), validate=True)
    except binascii.Error:
        raise mime.refused("attachment is not valid base64") from None


def inline(found: list[etree._Element], package: mime.Package) -> set[str]:
    """Replace each xop:Include with the base64 text of the part it names (the infoset XOP stands for); the
    Content-IDs inlined."""
    used: set[str] = set()
    for inc in found:
        part = mime.find(package, inc.get("href", ""))
        assert part is not None and part.content_id is not None  # check_includes
        parent = inc.getparent()
        assert parent is not None
        parent.remove(inc)
        parent.text = base64.b64encode(octets(part)).decode("ascii")
        used.add(part.content_id)
    return used
