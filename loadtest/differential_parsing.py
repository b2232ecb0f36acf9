"""Differential parsing (Teraguchi, Makino, Ueno and Chung), as a measured prototype: not part of the engine.

The idea: messages to a service share their structure, so match a new message's bytes against one parsed
before and parse only what differs. Here a message is cut into fixed parts (markup) and variable parts (text
nodes and attribute values) by one regular expression; when the fixed parts equal the template's, the new tree
is a copy of the template's checked tree with the changed variable parts written in (each checked against the
text length limit). Any other difference (a new element, an attribute more, a comment, CR characters, a
namespace that changed) parses the whole message, as does anything the cutting cannot map to the tree.

Decision: dropped, not built into the gateway (`python -m loadtest.optimizations` prints the numbers):

- lxml's parser is C and fast: building a fresh tree by copying the template costs about as much as parsing the
  bytes again (deepcopy of a 1 MB tree ~1.3x lxml's parse of it), before a single change is applied; the
  cutting and comparing adds to that. Against lxml alone the prototype never wins.
- It does beat the gateway's threat-protection parse (filters/engine/xml/threat_protection.py) on the 1 MB response: that
  parse's per-element Python checks cost 3-11x lxml's parse. That cost is better removed where it is (limits
  checked without a Python callback per element), which helps every message, not only the ones that repeat.
- A gateway must keep its threat checks exact on every byte; a second parser whose skipped parts are trusted
  because they matched earlier bytes is more attack surface for a gain the first point takes away.
- Messages that repeat byte for byte (the same 1 MB query result) are better recognized whole, by a hash, as
  response-side prehashing (van Engelen 2.4, filters/engine/wss/optimizations.py) does for the signed Body; measured, even
  that saves little once canonicalization is direct."""

from __future__ import annotations

import copy
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TextIO

from lxml import etree

from filters.engine import faults
from filters.engine.xml import xmlsupport
from filters.engine.xml.threat_protection import Limits, parse_envelope
from gateway.policy import Limits as PolicyLimits
from gateway.tools import demo_backend
from loadtest.messages import SIZE_LABELS, Factory, plain_request

# A variable part: text between two tags, or a double-quoted attribute value (both non-empty).
_VARIABLE = re.compile(rb'(?:(?<=>)|(?<==["]))([^<"&\r]+)(?=[<"])')
_NAMESPACE_DECLARATION = re.compile(rb'\sxmlns(?::[\w.\-]+)?="$')
Slot = tuple[int, str] | None  # (element index in document order, "text" | "tail" | attribute); None: xmlns


def _slots(root: etree._Element) -> list[tuple[tuple[int, str], str]]:
    """Every non-empty attribute value, text and tail of the tree, in the order the bytes hold them."""
    index = {el: i for i, el in enumerate(root.iter())}
    out: list[tuple[tuple[int, str], str]] = []

    def walk(el: etree._Element) -> None:
        i = index[el]
        out.extend(((i, name), value) for name, value in el.attrib.items() if value)
        if el.text:
            out.append(((i, "text"), el.text))
        for child in el:
            walk(child)
            if child.tail:
                out.append(((index[child], "tail"), child.tail))

    walk(root)
    return out


@dataclass
class Template:
    """A message parsed and checked once, cut into fixed and variable parts mapped onto its tree."""

    root: etree._Element
    fixed: list[bytes]
    values: list[bytes]
    slots: list[Slot]

    @classmethod
    def build(cls, data: bytes, limits: Limits) -> Template | None:
        """None when the cutting does not map one to one onto the tree (a quote in a text node...)."""
        root = parse_envelope(data, limits).root
        if b"<!" in data or b"<?" in data or b"&" in data:
            return None
        pieces = _VARIABLE.split(data)
        fixed, values = pieces[0::2], pieces[1::2]
        tree = iter(_slots(root))
        slots: list[Slot] = []
        for before, value in zip(fixed, values, strict=False):
            if _NAMESPACE_DECLARATION.search(before):
                slots.append(None)  # a namespace declaration: must stay as it is
                continue
            slot, text = next(tree, ((-1, ""), ""))
            if text != value.decode():
                return None
            slots.append(slot)
        if next(tree, None) is not None:
            return None
        return cls(root, fixed, values, slots)


def parse(data: bytes, template: Template | None, limits: Limits) -> tuple[etree._Element, int]:
    """The checked tree of `data` and how many variable parts had to be written (-1: parsed in full)."""
    if template is not None and b"&" not in data and b"\r" not in data:
        pieces = _VARIABLE.split(data)
        if pieces[0::2] == template.fixed:
            values = pieces[1::2]
            changed = [i for i, (a, b) in enumerate(zip(values, template.values, strict=True)) if a != b]
            if all(template.slots[i] is not None for i in changed):
                return _patched(template, values, changed, limits), len(changed)
    return parse_envelope(data, limits).root, -1


def _patched(template: Template, values: list[bytes], changed: list[int], limits: Limits) -> etree._Element:
    root = copy.deepcopy(template.root)
    if not changed:
        return root
    elements = list(root.iter())
    for i in changed:
        slot = template.slots[i]
        assert slot is not None
        index, where = slot
        text = values[i].decode()
        if len(text) > limits.max_text_length:
            raise faults.client(f"text node longer than {limits.max_text_length}")
        el = elements[index]
        if where == "text":
            el.text = text
        elif where == "tail":
            el.tail = text
        else:
            el.set(where, text)
    return root


@dataclass
class Measured:
    what: str
    size: str
    lxml_us: float
    gateway_us: float
    differential_us: float
    changed: float  # variable parts written per message, as a share of all (-1: fell back to full parses)


def _cpu_us(fn: Callable[[], object], n: int) -> float:
    fn()
    t0 = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - t0) / n * 1e6


def measure(what: str, size: str, messages: Sequence[bytes], limits: Limits) -> Measured:
    """Template = the first message; the others are parsed against it."""
    template = Template.build(messages[0], limits)
    rest = messages[1:]
    parser = xmlsupport.parser(huge_tree=True)
    n = len(rest)
    it = iter(rest * 2)
    lxml_us = _cpu_us(lambda: etree.fromstring(next(it), parser), n - 1)
    it = iter(rest * 2)
    gateway_us = _cpu_us(lambda: parse_envelope(next(it), limits), n - 1)
    changes: list[int] = []
    it = iter(rest * 2)
    differential_us = _cpu_us(lambda: changes.append(parse(next(it), template, limits)[1]), n - 1)
    total = len(template.values) if template is not None else 0
    share = -1.0 if template is None or min(changes) < 0 else sum(changes) / len(changes) / max(total, 1)
    return Measured(what, size, lxml_us, gateway_us, differential_us, share)


def report(factory: Factory, scale: float, out: TextIO) -> list[Measured]:
    limits = PolicyLimits()
    count = max(3, round(8 * scale))
    rows = [
        measure(
            "request", size, [factory.make(size).body for _ in range(count * (4 if size == "small" else 1))], limits
        )
        for size in ("small", "large")
    ]
    _, _, huge = demo_backend.handle_soap(plain_request("huge", "differential")[0])
    rows.append(measure("response", "huge", [huge] * max(3, round(4 * scale)), limits))
    print("Differential parsing prototype (Teraguchi et al.), CPU us per message", file=out)
    print(
        f"{'message':18} {'lxml parse':>10} {'gateway parse':>13} {'differential':>12} {'parts written':>13}", file=out
    )
    for m in rows:
        changed = "full parse" if m.changed < 0 else f"{m.changed:.0%}"
        print(f"{m.what + ' ' + SIZE_LABELS[m.size]:18} {m.lxml_us:10,.0f} {m.gateway_us:13,.0f} "
              f"{m.differential_us:12,.0f} {changed:>13}", file=out)  # fmt: skip
    return rows
