"""What libxml2 may match in more than linear time in a schema: `nonlinear` (which decides where validation runs,
filters/engine/xml/schema_validation.py) and `warnings` (what `wsgate check` and `wsgate import --validate` print).

`linear(pattern)`: the class libxml2 matches in linear time, kept narrow so it is sound: no group, and no piece of
varying length followed by a piece that can begin like it (at each character there is one way on, nothing to
go back to). `nonlinear(schema documents)`: a pattern outside that class, a repeated model group (counters nested
in one content model backtrack), or an identity constraint. Such schemas are validated under a CPU budget.

`backtracking(pattern)`, the warning, is the well-known static test for exponential ambiguity, kept simple:
- a nested quantifier: a group repeated more than once that holds a piece itself repeated (`(a+)*`,
  `(\\w{1,10}\\s?)*`, `(a{1,5}){1,20}`);
- an ambiguous alternation under a repetition: two branches of a repeated group that can begin with the same
  character (`(a|aa)*`, `(a|b|ab)*`, `(\\d|[0-9a-f])+`).
Not warned (the budget covers them): overlapping adjacent pieces (`[a-z]+[a-z0-9]*`: polynomial).

Character classes are compared by their ranges (\\d as 0-9 and all of non-ASCII, \\s as its four characters);
another escape (\\w, \\p{..}...), a negation or a subtraction counts as any character: a warning too many, a
schema sent to the budget too many, never one too few."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from lxml import etree

from filters.engine import ns

ANY = None  # a first-character set that may hold anything
Chars = list[tuple[str, str]] | None  # inclusive ranges, or ANY
_SINGLE_ESCAPES = {"n": "\n", "r": "\r", "t": "\t"}
_MULTI_ESCAPES = set("sSiIcCdDwWpP")
# Supersets of two escapes, enough to tell them apart from ASCII punctuation: \d is Unicode Nd, \s exactly these.
_ESCAPE_SETS: dict[str, list[tuple[str, str]]] = {
    "d": [("0", "9"), ("\x80", "\U0010ffff")],
    "s": [(" ", " "), ("\t", "\t"), ("\n", "\n"), ("\r", "\r")],
}


@dataclass
class _Piece:
    first: Chars  # the characters the piece can begin with
    low: int  # its quantifier's bounds (1, 1 without one)
    high: float
    group: _Alt | None = None

    @property
    def repeated(self) -> bool:
        return self.high > 1


@dataclass
class _Alt:
    branches: list[list[_Piece]] = field(default_factory=list)


class _Parser:
    def __init__(self, text: str) -> None:
        self.text, self.i = text, 0

    def peek(self) -> str:
        return self.text[self.i] if self.i < len(self.text) else ""

    def take(self) -> str:
        c = self.peek()
        self.i += 1
        return c

    def alternation(self) -> _Alt:
        alt = _Alt([[]])
        while self.peek() not in ("", ")"):
            if self.peek() == "|":
                self.take()
                alt.branches.append([])
                continue
            alt.branches[-1].append(self.piece())
        return alt

    def piece(self) -> _Piece:
        c = self.take()
        group = None
        if c == "(":
            group = self.alternation()
            self.take()
            first = _union([_first(b) for b in group.branches])
        elif c == "[":
            first = self.char_class()
        elif c == "\\":
            e = self.take()
            if e in _MULTI_ESCAPES:
                if e in "pP" and self.peek() == "{":
                    self.i = self.text.index("}", self.i) + 1
                first = _ESCAPE_SETS.get(e, ANY)
            else:
                first = [(_SINGLE_ESCAPES.get(e, e),) * 2]
        elif c == ".":
            first = ANY
        else:
            first = [(c, c)]
        return _Piece(first, *self.quantifier(), group)

    def char_class(self) -> Chars:
        ranges: Chars = []
        if self.peek() == "^":
            ranges = ANY
        depth = 1
        while depth and self.peek():  # to the matching ']' (subtractions nest)
            c = self.take()
            if c == "\\":
                e = self.take()
                if e in _ESCAPE_SETS and ranges is not ANY:
                    ranges.extend(_ESCAPE_SETS[e])
                elif e in _MULTI_ESCAPES:
                    ranges = ANY
                elif ranges is not ANY:
                    ranges.append((_SINGLE_ESCAPES.get(e, e),) * 2)
            elif c == "[":
                depth += 1
                ranges = ANY
            elif c == "]":
                depth -= 1
            elif ranges is not ANY:
                if self.peek() == "-" and self.text[self.i + 1 : self.i + 2] not in ("", "]", "["):
                    self.take()
                    hi = self.take()
                    ranges.append((c, _SINGLE_ESCAPES.get(self.take(), "\\") if hi == "\\" else hi))
                else:
                    ranges.append((c, c))
        return ranges

    def quantifier(self) -> tuple[int, float]:
        c = self.peek()
        if c in ("*", "+", "?"):
            self.take()
            return {"*": (0, math.inf), "+": (1, math.inf), "?": (0, 1)}[c]
        if c == "{":
            end = self.text.index("}", self.i)
            body, self.i = self.text[self.i + 1 : end], end + 1
            low, comma, high = body.partition(",")
            return int(low), float((high.strip() or "inf") if comma else low)
        return 1, 1


def _first(branch: list[_Piece]) -> Chars:
    return branch[0].first if branch else []


def _union(sets: list[Chars]) -> Chars:
    out: list[tuple[str, str]] = []
    for s in sets:
        if s is ANY:
            return ANY
        out += s
    return out


def _overlap(a: Chars, b: Chars) -> bool:
    if a is ANY or b is ANY:
        return bool(a or a is ANY) and bool(b or b is ANY)
    return any(lo1 <= hi2 and lo2 <= hi1 for lo1, hi1 in a for lo2, hi2 in b)


def _holds_repetition(alt: _Alt) -> bool:
    return any(p.repeated or (p.group is not None and _holds_repetition(p.group)) for b in alt.branches for p in b)


def _reasons(alt: _Alt) -> list[str]:
    out = []
    for piece in (p for b in alt.branches for p in b):
        if piece.group is None:
            continue
        if piece.repeated and _holds_repetition(piece.group):
            out.append("nested quantifier")
        if piece.repeated:
            firsts = [_first(b) for b in piece.group.branches]
            if any(_overlap(x, y) for i, x in enumerate(firsts) for y in firsts[i + 1 :]):
                out.append("alternation whose branches can begin alike, repeated")
        out += _reasons(piece.group)
    return out


def backtracking(pattern: str) -> list[str]:
    """Why `pattern` (XSD regular expression syntax) can backtrack; empty when the test finds nothing."""
    try:
        return list(dict.fromkeys(_reasons(_Parser(pattern).alternation())))
    except (ValueError, IndexError):  # libxml2 compiled it, so this is our parser's limit: say so
        return ["not analysed"]


def warnings(root: etree._Element, path: Path) -> list[str]:
    """One line per pattern facet of the schema document `root` (a WSDL's inline schemas included) that can
    backtrack, naming the type (or the element or attribute of an anonymous type) and the facet."""
    out = []
    for facet in root.iter(ns.q(ns.XSD, "pattern")):
        reasons = backtracking(facet.get("value", ""))
        if reasons:
            owner = next((a for a in facet.iterancestors() if a.get("name")), None)
            kind = etree.QName(owner).localname if owner is not None else "schema"
            name = owner.get("name") if owner is not None else "?"
            out.append(
                f"{path.name}: {kind} {name}: pattern {facet.get('value')!r} can backtrack: {', '.join(reasons)}"
            )
    return out


def linear(pattern: str) -> bool:
    """Whether libxml2 matches `pattern` in time linear in the value, whatever the value: no group, and no piece
    of varying length followed by one that can begin like it (nothing to go back to: at each character one way
    on). A top-level alternation of such branches costs at most one linear match per branch."""
    try:
        alt = _Parser(pattern).alternation()
    except (ValueError, IndexError):
        return False
    for branch in alt.branches:
        for i, piece in enumerate(branch):
            if piece.group is not None:
                return False
            if piece.low == piece.high:
                continue
            follow: list[Chars] = []
            for after in branch[i + 1 :]:
                follow.append(after.first)
                if after.low > 0:
                    break
            if _overlap(piece.first, _union(follow)):
                return False
    return True


_XS = f"{{{ns.XSD}}}"
_GROUPS = (_XS + "sequence", _XS + "choice", _XS + "group")
_IDENTITY = (_XS + "unique", _XS + "key", _XS + "keyref")


def nonlinear(roots: Iterable[etree._Element]) -> str | None:
    """Why libxml2 may validate against these schema documents in more than linear time, or None when it cannot:
    every pattern facet `linear`, no repeated model group (counters nested in one content model backtrack: a
    repeated sequence of a repeated element), no identity constraint (its key tables compare pairwise)."""
    for root in roots:
        for el in root.iter(_GROUPS):
            if el.get("maxOccurs", "1") not in ("0", "1") or el.get("minOccurs", "1") not in ("0", "1"):
                return f"a repeated {etree.QName(el).localname} (line {el.sourceline})"
        for el in root.iter(_IDENTITY):
            return f"an identity constraint {etree.QName(el).localname} (line {el.sourceline})"
        for facet in root.iter(_XS + "pattern"):
            if not linear(facet.get("value", "")):
                return f"pattern {facet.get('value', '')[:80]!r}"
    return None
