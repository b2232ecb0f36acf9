"""A route's multipart/related messages (RFC 2387): the root part goes through the profile's pipeline like any
envelope, the attachments travel past it byte for byte, as the route's `attachments` policy says
(gateway/policy.py Attachments, docs/attachments.md)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from lxml import etree

from filters.engine.mime import package as mime
from filters.engine.mime import xop
from filters.engine.xml import charset
from filters.engine.xml.soap import Envelope
from gateway.policy import Attachments

SOAP_TYPES = {"text/xml": "1.1", "application/soap+xml": "1.2"}


@dataclass
class Message:
    """One multipart/related message on its way through a route."""

    package: mime.Package
    xop: bool  # the root part is application/xop+xml (MTOM)
    includes: list[etree._Element] = field(default_factory=list)  # the root's xop:Include elements
    stripped: bool = False  # unreferenced attachments left out (policy `strip`)
    inlined: set[str] = field(default_factory=set)  # the Content-IDs inlined as base64 (policy `inline`)
    # Whether a request's root is read again before it goes (`resolve`): decrypted content is new XML. A secured
    # profile clears it where its processing only took its Security header out (SecuredPipeline.process).
    recheck: bool = True

    @property
    def root_bytes(self) -> bytes:
        return bytes(self.package.root.body)  # a bytes body is returned as it is, not copied

    @property
    def soap_type(self) -> str:
        """The SOAP media type the root stands for (an XOP root's own `type` parameter, with its action)."""
        root = self.package.root
        return root.media.params.get("type", "") if self.xop else root.content_type


def receive(content_type: str | None, body: bytes | memoryview, policy: Attachments) -> Message | None:
    """The message's package, or None for a plain SOAP message."""
    if not mime.is_multipart(content_type):
        return None
    assert content_type is not None
    if not policy.accept:
        raise mime.refused("multipart message on a route that takes no attachments")
    package = mime.parse(content_type, body, policy)
    return Message(package, xop=package.root.media.essence == "application/xop+xml")  # the type parameter's (parse)


def check(msg: Message, env: Envelope, policy: Attachments) -> None:
    """The root as received against its labels, every `cid:` reference against the parts (`resolve`), and the
    parts none names as the policy says."""
    label = msg.package.root.media.params.get("charset")
    if label is not None and label.lower() != env.encoding:
        raise mime.refused(f"root part labelled {label[:20]!r}, its bytes are {env.encoding}")
    soap = mime.media_type(msg.soap_type, "root") if msg.xop else msg.package.root.media  # the root's own: parsed
    declared = SOAP_TYPES.get(soap.essence)
    if declared != env.version:
        raise mime.refused(f"root part declared SOAP {declared}, the envelope is SOAP {env.version}")
    named = resolve(msg, env)
    unnamed = [p for p in msg.package.attachments if p.content_id not in named]
    if unnamed and policy.unreferenced == "refuse":
        raise mime.refused(f"{len(unnamed)} attachments no cid: reference names")
    if unnamed and policy.unreferenced == "strip":
        kept = tuple(p for p in msg.package.attachments if p.content_id in named)
        msg.package, msg.stripped = msg.package.with_attachments(kept), True


def resolve(msg: Message, env: Envelope) -> set[str]:
    """The Content-IDs the root names now, every xop:Include and `cid:` URL checked: what a backend would resolve
    must be what the gateway checked. Again after a secured profile has processed the root: decrypted content is
    new XML."""
    msg.includes = xop.check_includes(env.root, msg.package, msg.xop)
    return xop.references(env.root, msg.package)


def inline(msg: Message) -> None:
    """The XOP content inlined as base64 (a route's `inline`): before a reply is signed, before a request goes."""
    msg.inlined |= xop.inline(msg.includes, msg.package)
    msg.includes = []


def forward(env: Envelope, msg: Message, reserialized: bool) -> tuple[bytes | mime.Segments | None, str]:
    """The body for the next hop (None: the message as it came; a package as segments, its attachments the
    slices received, under a boundary of the gateway's own: `mime.rebound`) and its Content-Type. `reserialized`:
    the pipeline changed the envelope (a secured profile)."""
    package = msg.package
    rest = (
        tuple(p for p in package.attachments if p.content_id not in msg.inlined) if msg.inlined else package.attachments
    )
    if msg.inlined and not rest:  # nothing left to package: one SOAP envelope
        return env.serialize(), charset.content_type(msg.soap_type, "utf-8", env.version)
    if not (reserialized or msg.inlined or msg.stripped):
        return None, package.content_type
    root = package.root
    if reserialized or msg.inlined:
        content_type = charset.content_type(root.content_type, "utf-8", env.version)
        root = mime.with_content(root, env.serialize(), {"Content-Type": content_type})
    boundary, content_type = mime.rebound(package)
    return mime.segments(boundary, (root, *rest)), content_type


def without_includes(env: Envelope) -> Envelope:
    """A copy of `env` whose xop:Include elements are empty text (valid base64Binary of no octets): what the
    schema validates of an MTOM message, without its attachments inlined (docs/attachments.md)."""
    if not xop.includes(env.root):
        return env
    stripped = Envelope(copy.deepcopy(env.root), env.version, env.encoding)
    for inc in xop.includes(stripped.root):
        parent = inc.getparent()
        assert parent is not None
        parent.remove(inc)
    return stripped
