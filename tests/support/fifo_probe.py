"""A file nobody may open, and documents that ask a parser to open it, in every encoding a parser might take.

The file is a FIFO: a reader's open() blocks until a writer comes, and a watcher thread keeps trying to open the
write end without blocking, which only succeeds while somebody holds the read end. So a parser (in this process
or a gateway worker) that opens the file is released at once and counted: the probe sees every open, with no
timing window, and a parse never hangs on it."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SOAP11 = "http://schemas.xmlsoap.org/soap/envelope/"


class FifoProbe:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.url = path.as_uri()
        self.opened = 0  # write-end opens that found a reader (several per read-end open)

    def watch(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:  # ENXIO: no reader
                time.sleep(0.0005)
                continue
            self.opened += 1
            os.close(fd)


@contextmanager
def fifo_probe(directory: Path) -> Iterator[FifoProbe]:
    path = directory / "probe.fifo"
    os.mkfifo(path)
    probe = FifoProbe(path)
    stop = threading.Event()
    watcher = threading.Thread(target=probe.watch, args=(stop,), daemon=True)
    watcher.start()
    try:
        yield probe
    finally:
        stop.set()
        watcher.join()
        path.unlink()


def _envelope(body: str, root_attributes: str = "") -> str:
    return f'<soap:Envelope xmlns:soap="{SOAP11}"{root_attributes}><soap:Body>{body}</soap:Body></soap:Envelope>'


def hostile_documents(url: str) -> dict[str, str]:
    """Name -> document (text, no XML declaration) that refers to `url` the ways XML allows. The first ones
    declare a DTD and must be refused; the others are data the gateway never acts on."""
    return {
        "external DTD": f'<!DOCTYPE soap:Envelope SYSTEM "{url}">' + _envelope("<a/>"),
        "public external DTD": f'<!DOCTYPE soap:Envelope PUBLIC "-//W//D" "{url}">' + _envelope("<a/>"),
        "parameter entity": f'<!DOCTYPE soap:Envelope [<!ENTITY % p SYSTEM "{url}"> %p;]>' + _envelope("<a/>"),
        "external general entity": f'<!DOCTYPE soap:Envelope [<!ENTITY e SYSTEM "{url}">]>' + _envelope("<a>&e;</a>"),
        "external entity in an attribute default": (
            f'<!DOCTYPE soap:Envelope [<!ENTITY e SYSTEM "{url}"><!ATTLIST a b CDATA "&e;">]>' + _envelope("<a/>")
        ),
        "xinclude": _envelope(f'<xi:include xmlns:xi="http://www.w3.org/2001/XInclude" href="{url}" parse="text"/>'),
        "schema location": _envelope(
            "<a/>",
            ' xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance"'
            f' xsi:schemaLocation="urn:x {url}" xsi:noNamespaceSchemaLocation="{url}"',
        ),
    }


DECLARES_DTD = ("external DTD", "public external DTD", "parameter entity", "external general entity",
                "external entity in an attribute default")  # fmt: skip


def encodings(text: str) -> dict[str, bytes]:
    """`text` (a document without XML declaration) in each encoding, with the declaration each needs."""

    def declared(name: str) -> str:
        return f'<?xml version="1.0" encoding="{name}"?>' + text

    return {
        "utf-8": declared("UTF-8").encode(),
        "utf-8 without declaration": text.encode(),
        "utf-8 bom": b"\xef\xbb\xbf" + declared("UTF-8").encode(),
        "utf-16le bom": b"\xff\xfe" + declared("UTF-16").encode("utf-16-le"),
        "utf-16be bom": b"\xfe\xff" + declared("UTF-16").encode("utf-16-be"),
        "utf-16le bom without declaration": b"\xff\xfe" + text.encode("utf-16-le"),
        "utf-16le without bom": declared("UTF-16").encode("utf-16-le"),
        "utf-16be without bom": declared("UTF-16").encode("utf-16-be"),
        "utf-32": declared("UTF-32").encode("utf-32"),
        "utf-32be without bom": declared("UTF-32").encode("utf-32-be"),
    }
