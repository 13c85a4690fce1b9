"""A step-bounded backtracking matcher for -ot patterns that could backtrack without bound.

llama.cpp matches -ot patterns with std::regex_search (ECMAScript), a backtracking engine with no limit: a pattern
such as '(.|.)*Z' takes exponential time on a 60-character tensor name there, and in Python's `re` here. Patterns
are classified once (`needs_bound`): those without nested or stacked unbounded quantifiers go to Python `re`
(fast, same answers; see common.translate_ecmascript); the others are matched by this engine, which follows the
ECMAScript backtracking rules (greedy/lazy quantifiers, an iteration that matches nothing ends a loop,
look-ahead, back-references) and counts its steps: past STEP_LIMIT for one pattern it raises FlagError saying the
pattern would hang, rather than hang.

It runs on the Python translation of the pattern (common.translate_ecmascript), so a character class or escape
means exactly what it means on the fast path: each is compiled with `re` and used as a one-character test.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from collections.abc import Callable

from ..errors import FlagError

STEP_LIMIT = 200_000        # per tensor name (a tenth of a second of pure Python); names are at most 63 chars
UNBOUNDED = 1 << 30
STACKED_LIMIT = 5           # this many unbounded quantifiers can cost n^5/120 steps on an n-character name


class Budget(Exception):
    """Raised inside the matcher when the step budget is spent."""


@dataclass(frozen=True)
class Node:
    kind: str                       # char, start, end, wordb, nwordb, group, alt, seq, rep, look, nlook, backref
    test: Callable[[str], bool] | None = None
    kids: tuple[Node, ...] = ()
    lo: int = 0
    hi: int = 0
    greedy: bool = True
    index: int = 0                  # capture group number (group), back-reference number (backref)


_QUANT = re.compile(r"\{(\d+)(?:(,)(\d*))?\}")


class _Parser:
    def __init__(self, text: str) -> None:
        self.s, self.i, self.groups = text, 0, 0

    def peek(self) -> str:
        return self.s[self.i] if self.i < len(self.s) else ""

    def alt(self) -> Node:
        branches = [self.seq()]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.seq())
        return branches[0] if len(branches) == 1 else Node("alt", kids=tuple(branches))

    def seq(self) -> Node:
        items: list[Node] = []
        while self.peek() not in ("", "|", ")"):
            atom = self.atom()
            items.append(self.quantified(atom))
        return Node("seq", kids=tuple(items))

    def quantified(self, atom: Node) -> Node:
        c = self.peek()
        if c in ("*", "+", "?"):
            self.i += 1
            lo, hi = {"*": (0, UNBOUNDED), "+": (1, UNBOUNDED), "?": (0, 1)}[c]
        elif c == "{" and (m := _QUANT.match(self.s, self.i)) is not None:
            self.i = m.end()
            lo = int(m.group(1))
            hi = lo if m.group(2) is None else (int(m.group(3)) if m.group(3) else UNBOUNDED)
        else:
            return atom
        greedy = True
        if self.peek() == "?":
            self.i += 1
            greedy = False
        return Node("rep", kids=(atom,), lo=lo, hi=hi, greedy=greedy)

    def atom(self) -> Node:
        s, i = self.s, self.i
        c = s[i]
        if c == "(":
            if s.startswith(("(?=", "(?!"), i):
                self.i += 3
                inner = self.alt()
                self.i += 1
                return Node("look" if c == "(" and s[i + 2] == "=" else "nlook", kids=(inner,))
            capture = not s.startswith("(?:", i)
            self.i += 1 if capture else 3
            index = 0
            if capture:
                self.groups += 1
                index = self.groups
            inner = self.alt()
            self.i += 1
            return Node("group", kids=(inner,), index=index)
        if c == "[":
            j = i + 1
            if j < len(s) and s[j] == "^":
                j += 1
            while j < len(s) and s[j] != "]":
                j += 2 if s[j] == "\\" else 1
            self.i = j + 1
            return Node("char", test=re.compile(s[i:j + 1]).fullmatch)
        if c == "\\":
            e = s[i + 1]
            if e in "123456789":
                self.i += 2
                return Node("backref", index=int(e))
            if e in "bB":
                self.i += 2
                return Node("wordb" if e == "b" else "nwordb")
            n = {"x": 4, "u": 6}.get(e, 2)
            self.i += n
            return Node("char", test=re.compile(s[i:i + n]).fullmatch)
        self.i += 1
        if c == ".":
            return Node("char", test=lambda ch: ch not in "\n\r\u2028\u2029")
        if c == "^":
            return Node("start")
        if c == "$":
            return Node("end")
        return Node("char", test=lambda ch, c=c: ch == c)


def parse(python_text: str) -> Node:
    return _Parser(python_text).alt()


def _can_vary(n: Node) -> bool:
    """Whether a node can match text of more than one length or in more than one way."""
    if n.kind == "rep":
        return n.lo != n.hi or _can_vary(n.kids[0])
    if n.kind == "alt":
        return True
    return any(_can_vary(k) for k in n.kids)


def needs_bound(python_text: str) -> bool:
    """Nested quantification ((a+)*, (a|b)*) or STACKED_LIMIT unbounded quantifiers: catastrophic backtracking is
    possible, so the pattern goes to the bounded engine."""
    try:
        root = parse(python_text)
    except (IndexError, re.error):
        return True
    unbounded = 0

    def walk(n: Node) -> bool:
        nonlocal unbounded
        if n.kind == "rep":
            if n.hi >= UNBOUNDED:
                unbounded += 1
            if n.hi > 1 and _can_vary(n.kids[0]):
                return True
        return any(walk(k) for k in n.kids)
    return walk(root) or unbounded >= STACKED_LIMIT


def _word(s: str, i: int) -> bool:
    return 0 <= i < len(s) and (s[i].isalnum() or s[i] == "_") and s[i].isascii()


class BoundedMatcher:
    """search(name) -> True or None (as re's search is truthy or None), ECMAScript backtracking within a step
    budget per name."""

    def __init__(self, source: str, python_text: str, limit: int = STEP_LIMIT) -> None:
        self.source, self.root, self.left = source, parse(python_text), limit
        self.limit = limit

    def search(self, s: str) -> bool | None:
        self.left = self.limit
        try:
            for start in range(len(s) + 1):
                if self._m(self.root, s, start, {}, lambda i, caps: True):
                    return True
            return None
        except Budget:
            raise FlagError(f"-ot pattern {self.source!r} needs more than {self.limit:,} backtracking steps (at "
                            f"tensor {s!r}): std::regex in llama.cpp would backtrack without bound on it too; "
                            "rewrite it without nested or repeated quantifiers (e.g. 'exps' instead of '(.|.)*exps')"
                            ) from None
        except RecursionError:
            raise FlagError(f"-ot pattern {self.source!r} nests too deeply to match; simplify it") from None

    def _m(self, n: Node, s: str, i: int, caps: dict, k: Callable[[int, dict], bool]) -> bool:
        self.left -= 1
        if self.left < 0:
            raise Budget
        kind = n.kind
        if kind == "char":
            return i < len(s) and bool(n.test(s[i])) and k(i + 1, caps)   # type: ignore[misc]
        if kind == "seq":
            return self._seq(n.kids, 0, s, i, caps, k)
        if kind == "alt":
            return any(self._m(b, s, i, caps, k) for b in n.kids)
        if kind == "group":
            def close(j: int, c: dict) -> bool:
                return k(j, {**c, n.index: (i, j)} if n.index else c)
            return self._m(n.kids[0], s, i, caps, close)
        if kind == "rep":
            return self._rep(n, s, i, caps, k, 0)
        if kind == "start":
            return i == 0 and k(i, caps)
        if kind == "end":
            return i == len(s) and k(i, caps)
        if kind in ("wordb", "nwordb"):
            at = _word(s, i - 1) != _word(s, i)
            return (at if kind == "wordb" else not at) and k(i, caps)
        if kind in ("look", "nlook"):
            box: list[dict] = []
            found = self._m(n.kids[0], s, i, caps, lambda j, c: box.append(c) or True)
            if kind == "look":
                return found and k(i, box[0])
            return not found and k(i, caps)
        if kind == "backref":
            span = caps.get(n.index)
            text = s[span[0]:span[1]] if span else ""
            return s.startswith(text, i) and k(i + len(text), caps)
        raise AssertionError(kind)

    def _seq(self, kids: tuple[Node, ...], idx: int, s: str, i: int, caps: dict,
             k: Callable[[int, dict], bool]) -> bool:
        if idx == len(kids):
            return k(i, caps)
        return self._m(kids[idx], s, i, caps, lambda j, c: self._seq(kids, idx + 1, s, j, c, k))

    def _rep(self, n: Node, s: str, i: int, caps: dict, k: Callable[[int, dict], bool], count: int) -> bool:
        body = n.kids[0]

        def again(j: int, c: dict) -> bool:
            if j == i and count >= n.lo:     # ECMAScript: an empty iteration past the minimum fails
                return False
            return self._rep(n, s, j, c, k, count + 1)

        if count < n.lo:
            return self._m(body, s, i, caps, again)
        if count >= n.hi:
            return k(i, caps)
        if n.greedy:
            return self._m(body, s, i, caps, again) or k(i, caps)
        return k(i, caps) or self._m(body, s, i, caps, again)
