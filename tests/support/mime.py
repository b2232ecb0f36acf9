"""Building multipart/related messages for tests: MTOM (XOP) and SwA packages, well formed or bent one way."""

from __future__ import annotations

BOUNDARY = "MIMEBoundary_6b1f"
SOAP11 = "http://schemas.xmlsoap.org/soap/envelope/"
SOAP12 = "http://www.w3.org/2003/05/soap-envelope"
XOP = "http://www.w3.org/2004/08/xop/include"


def envelope(payload: str, version: str = "1.1") -> bytes:
    ns = SOAP12 if version == "1.2" else SOAP11
    return f'<s:Envelope xmlns:s="{ns}"><s:Body>{payload}</s:Body></s:Envelope>'.encode()


def mtom_envelope(cids: list[str], version: str = "1.1") -> bytes:
    """A Body with one `<d:Doc>` per attachment, its content an xop:Include."""
    docs = "".join(f'<d:Doc><xop:Include xmlns:xop="{XOP}" href="cid:{c}"/></d:Doc>' for c in cids)
    return envelope(f'<d:Upload xmlns:d="urn:docs">{docs}</d:Upload>', version)


def part(headers: list[tuple[str, str]], body: bytes) -> bytes:
    return b"".join(f"{n}: {v}\r\n".encode() for n, v in headers) + b"\r\n" + body


def package(parts: list[bytes], boundary: str = BOUNDARY, close: bytes = b"--\r\n", preamble: bytes = b"") -> bytes:
    dash = f"--{boundary}".encode()
    return preamble + b"".join(dash + b"\r\n" + p + b"\r\n" for p in parts) + dash + close


def mtom(
    attachments: dict[str, bytes], version: str = "1.1", root: bytes | None = None, boundary: str = BOUNDARY
) -> tuple[str, bytes]:
    """(Content-Type, body) of an MTOM request: the root an XOP envelope naming every attachment."""
    soap = "application/soap+xml" if version == "1.2" else "text/xml"
    root = root if root is not None else mtom_envelope(list(attachments), version)
    parts = [
        part([("Content-Type", f'application/xop+xml; charset=UTF-8; type="{soap}"'),
              ("Content-Transfer-Encoding", "binary"), ("Content-ID", "<root.message@test>")], root)
    ] + [
        part([("Content-Type", "application/octet-stream"), ("Content-Transfer-Encoding", "binary"),
              ("Content-ID", f"<{cid}>")], data)
        for cid, data in attachments.items()
    ]  # fmt: skip
    content_type = (
        f'multipart/related; type="application/xop+xml"; boundary="{boundary}"; '
        f'start="<root.message@test>"; start-info="{soap}"'
    )
    return content_type, package(parts, boundary)


def swa(attachments: dict[str, bytes], version: str = "1.1", root: bytes | None = None) -> tuple[str, bytes]:
    """(Content-Type, body) of a SOAP with Attachments request: the Body names each part by an href attribute."""
    soap = "application/soap+xml" if version == "1.2" else "text/xml"
    refs = "".join(f'<d:Doc href="cid:{c}"/>' for c in attachments)
    root = root if root is not None else envelope(f'<d:Upload xmlns:d="urn:docs">{refs}</d:Upload>', version)
    parts = [part([("Content-Type", f"{soap}; charset=utf-8"), ("Content-ID", "<root@test>")], root)] + [
        part([("Content-Type", "image/png"), ("Content-ID", f"<{c}>")], data) for c, data in attachments.items()
    ]
    return f'multipart/related; type="{soap}"; boundary={BOUNDARY}; start="<root@test>"', package(parts)
