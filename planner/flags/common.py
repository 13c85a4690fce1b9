"""Pieces shared by both dialects: llama.cpp's regex dialect, the override matcher, -ngl slots, regex compaction.

Facts and their sources (docs/llamacpp.md sections 2-3; llama.cpp vendored in llama-cpp-python
0.3.36, commit 0c1e57098):
- src/llama-model-loader.cpp (create_tensor): for each tensor, overrides are tried in order with
  `std::regex_search(name, std::regex(pattern))` (ECMAScript grammar, substring search, case-sensitive); the
  FIRST match wins. Tensors of skipped (NextN) blocks never reach that code.
- src/llama-model.cpp ~1580 (load_tensors): n_layer + 1 slots (blocks, then the output layer); the input layer
  (token_embd) is always on the CPU; a GPU slot goes to device
  `upper_bound(splits, float(il - i_gpu_start) / act_gpu_layers)` with splits the normalised cumulative -ts
  proportions, all in float32. The slot rule per dialect is in SLOT_RULES.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal, TypeVar
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from ..errors import FlagError
from ..model import ModelInventory, Tensor
from ..plan import gpu_index, is_gpu  # noqa: F401  (the flag modules take them from here)
from .ecma_regex import BoundedMatcher, needs_bound

SlotRule = Literal["last_slots", "last_blocks"]
T = TypeVar("T")
OUTPUT_ROLES = frozenset({"output", "output_norm"})
_GPU_RE = re.compile(r"^CUDA(\d+)$")
DEVICE_RE = re.compile(r"^(CPU|CUDA\d+)$")
# Buffer-type names some users try; llama.cpp only accepts each device's default buffer type (CPU, CUDA0, ...).
REJECTED_BUFTS = ("CUDA_Host", "CPU_REPACK", "CPU_Mapped", "CUDA_Split")


def check_buft(name: str, n_gpus: int | None) -> str:
    """A -ot buffer-type name as llama.cpp validates it; FlagError (one line, valid names listed) otherwise."""
    m = _GPU_RE.match(name)
    if name == "CPU" or (m is not None and (n_gpus is None or int(m.group(1)) < n_gpus)):
        return name
    valid = "CPU, " + (", ".join(f"CUDA{i}" for i in range(n_gpus)) if n_gpus is not None else "CUDA0, CUDA1, ...")
    hint = ""
    if name in REJECTED_BUFTS or name.startswith(("CUDA_Host", "CPU_")):
        hint = f" ({name} is not a device buffer type: llama.cpp rejects it; use CPU for RAM)"
    raise FlagError(f"unknown buffer type {name!r} in -ot{hint}; valid names: {valid}")


# ---- shell ---------------------------------------------------------------------------------------------------

def shell_join(argv: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    """POSIX-shell command line that shlex.split turns back into `env` assignments followed by `argv`."""
    parts = [f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()]
    return " ".join(parts + [shlex.quote(a) for a in argv])


# ---- llama.cpp's regex dialect (ECMAScript std::regex) versus Python re ---------------------------------------

_POSIX_CLASSES = {
    "alpha": "a-zA-Z", "digit": "0-9", "alnum": "a-zA-Z0-9", "upper": "A-Z", "lower": "a-z", "space": r" \t\n\r\f\v",
    "blank": r" \t", "xdigit": "0-9A-Fa-f", "word": r"\w", "w": r"\w", "d": "0-9", "s": r" \t\n\r\f\v",
    "punct": r"!-/:-@\[-`{-~", "cntrl": r"\x00-\x1f\x7f", "print": r"\x20-\x7e", "graph": r"\x21-\x7e",
}
# Escapes that mean the same in ECMAScript and Python re (for ASCII tensor names).
_SAME_ESCAPES = set("bBdDsSwWfnrtv0123456789") | set(r".^$|?*+()[]{}\/-=!:,;'\"#&~%@<>`_ ")


@dataclass(frozen=True)
class Pattern:
    """One -ot regex: the text llama.cpp sees, its Python translation, a substring every match must contain, and
    what matches it: Python `re`, or the step-bounded engine for patterns that could backtrack without bound."""
    source: str
    python: str
    literal: str
    rx: re.Pattern[str] | BoundedMatcher


def _ecma_error(pattern: str, what: str) -> FlagError:
    return FlagError(f"-ot pattern '{pattern}': {what}; llama.cpp compiles -ot patterns as ECMAScript std::regex")


def translate_ecmascript(pattern: str) -> str:
    """Python `re` text with the meaning std::regex (ECMAScript) gives `pattern`; FlagError where they differ.

    Rejected: constructs std::regex does not accept (possessive quantifiers, atomic groups, inline flags, named
    groups, look-behind, comments, \\A \\Z), a '{' that is not a quantifier, and '[]' / '[^]' (empty class in
    ECMAScript, a literal ']' in Python). POSIX classes such as [[:digit:]] are translated.
    """
    out: list[str] = []
    i, n = 0, len(pattern)
    in_class = False
    while i < n:
        c = pattern[i]
        if c == "\\":
            if i + 1 >= n:
                raise _ecma_error(pattern, "ends with a lone backslash")
            e = pattern[i + 1]
            if e not in _SAME_ESCAPES and not (e == "x" or e == "u"):
                raise _ecma_error(pattern, f"escape \\{e} means something else (or nothing) in ECMAScript")
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            if c == "[" and pattern.startswith("[:", i):
                end = pattern.find(":]", i + 2)
                name = pattern[i + 2:end] if end >= 0 else ""
                if end < 0 or name not in _POSIX_CLASSES:
                    raise _ecma_error(pattern, f"unknown character class {pattern[i:end + 2 if end >= 0 else n]!r}")
                out.append(_POSIX_CLASSES[name])
                i = end + 2
                continue
            if c == "[" and pattern.startswith(("[.", "[="), i):
                raise _ecma_error(pattern, "collating elements [. .] / [= =] are not supported here")
            if c == "]":
                in_class = False
                out.append(c)
            elif c in "[&~|":
                out.append("\\" + c)   # literal in ECMAScript; Python warns about (future) set operations
            else:
                out.append(c)
            i += 1
            continue
        if c == "[":
            j = i + 1
            if j < n and pattern[j] == "^":
                j += 1
            if j < n and pattern[j] == "]":
                raise _ecma_error(pattern, "'[]' / '[^]' is an empty class in ECMAScript but starts a class with "
                                           "a literal ']' in Python; write \\] for a literal bracket")
            out.append(pattern[i:j])
            in_class = True
            i = j
            continue
        if c == "(" and pattern.startswith("(?", i) and (i + 2 >= n or pattern[i + 2] not in ":=!"):
            raise _ecma_error(pattern, f"group {pattern[i:i + 4]!r}... is not ECMAScript (only (?: (?= (?! are)")
        if c == "{":
            m = _QUANTIFIER.match(pattern, i)
            if m is None or not out:
                raise _ecma_error(pattern, "'{' must start a quantifier such as {3} (a comma is split off anyway)")
        if c in "*+?}" and i + 1 < n and pattern[i + 1] == "+" and (c != "?" or _is_quantifier_q(pattern, i)):
            raise _ecma_error(pattern, f"possessive quantifier {c}+ is not ECMAScript")
        out.append(c)
        i += 1
    if in_class:
        raise _ecma_error(pattern, "unterminated character class '['")
    text = "".join(out)
    try:
        re.compile(text)
    except re.error as e:
        raise FlagError(f"-ot pattern '{pattern}' is not a valid regex: {e}") from e
    return text


def _is_quantifier_q(pattern: str, i: int) -> bool:
    """Whether the '?' at i is a quantifier (not the '?' of '(?:' and friends)."""
    return not (i > 0 and pattern[i - 1] == "(")


_META = set(".[](){}*+?|^$\\")
_QUANTIFIER = re.compile(r"\{(\d+)(,\d*)?\}")


def literal_prefix(pattern: str) -> str:
    """A literal every match of `pattern` contains (its leading literal run); '' when none is obvious."""
    if has_top_level_bar(pattern):   # alternatives: no common literal worth computing
        return ""
    lit: list[str] = []
    i = 1 if pattern.startswith("^") else 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern) and not pattern[i + 1].isalnum():
            ch, step = pattern[i + 1], 2
        elif c not in _META:
            ch, step = c, 1
        else:
            break
        nxt = pattern[i + step] if i + step < len(pattern) else ""
        if nxt in ("*", "?", "{"):
            break
        lit.append(ch)
        i += step
        if nxt == "+":
            break
    return "".join(lit)


@lru_cache(maxsize=8192)
def compile_pattern(source: str) -> Pattern:
    """The Pattern for an -ot regex (a pure function of the text, memoised)."""
    python = translate_ecmascript(source)
    rx = BoundedMatcher(source, python) if needs_bound(python) else re.compile(python)
    return Pattern(source, python, literal_prefix(source), rx)


# ---- overrides and the matcher -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Override:
    """One entry of llama.cpp's tensor_buft_overrides list: regex -> device, and which flag put it there."""
    pattern: str
    device: str
    origin: str = "-ot"

    def text(self) -> str:
        return f"{self.pattern}={self.device}"


_BLOCK_LITERAL = re.compile(r"^blk\.\d+\.")


@dataclass(frozen=True)
class NameIndex:
    """Tensor names grouped by block, so a regex whose literal starts with 'blk.N.' is only tried on block N."""
    names: tuple[str, ...]
    by_block: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @classmethod
    def of(cls, names: Sequence[str]) -> NameIndex:
        by_block: dict[str, list[str]] = {}
        for n in names:
            if n.startswith("blk.") and "blk." not in n[4:]:
                dot = n.find(".", 4)
                key = n[:dot + 1]
                if dot > 4 and key[4:dot].isdigit():
                    by_block.setdefault(key, []).append(n)
                    continue
            if "blk." in n:
                return cls(tuple(names))      # "blk." elsewhere in a name: no shortcut is safe
        return cls(tuple(names), {k: tuple(v) for k, v in by_block.items()})

    def candidates(self, literal: str) -> Sequence[str]:
        m = _BLOCK_LITERAL.match(literal)
        if m is None or not self.by_block:
            return self.names
        return self.by_block.get(m.group(0), ())


@dataclass(frozen=True)
class MatchResult:
    first: dict[str, int]              # tensor name -> index of the override that places it (first match)
    matched: tuple[tuple[str, ...], ...]   # per override: every allocated tensor its regex matches


def match_overrides(names: Sequence[str] | NameIndex, overrides: Sequence[Override]) -> MatchResult:
    """Apply overrides the way llama-model-loader.cpp does: per tensor, the first override whose regex matches."""
    index = names if isinstance(names, NameIndex) else NameIndex.of(names)
    first: dict[str, int] = {}
    matched: list[tuple[str, ...]] = []
    for idx, ov in enumerate(overrides):
        pat = compile_pattern(ov.pattern)
        search, lit = pat.rx.search, pat.literal
        hits = tuple(n for n in index.candidates(lit) if lit in n and search(n) is not None)
        matched.append(hits)
        for n in hits:
            first.setdefault(n, idx)
    return MatchResult(first, tuple(matched))


# ---- -ngl slots ----------------------------------------------------------------------------------------------

def memo(inv: ModelInventory, key: str, factory: Callable[[], T]) -> T:
    """A value derived from `inv`, kept on the inventory the way its own cached_property values are.

    ModelInventory is immutable, so an index built from it stays valid; entries live in the instance __dict__
    (not dataclass fields: equality and hashing are unaffected) and die with the inventory.
    """
    store = getattr(inv, "__dict__", None)
    if store is None:
        return factory()
    full = "_flags_" + key
    if full not in store:
        store[full] = factory()
    return store[full]


def allocated_names(inv: ModelInventory) -> NameIndex:
    return memo(inv, "names", lambda: NameIndex.of([t.name for t in inv.allocated()]))


def slot_of(t: Tensor, n_layer: int) -> int | None:
    """Slot of a tensor: its block index, n_layer for the output layer, None for the input layer (always CPU)."""
    if t.layer is not None:
        return t.layer
    if t.role in OUTPUT_ROLES:
        return n_layer
    return None


def gpu_slot_window(n_layer: int, n_gpu_layers: int, rule: SlotRule) -> tuple[int, int]:
    """(i_gpu_start, act_gpu_layers): slot il is on a GPU iff i_gpu_start <= il < i_gpu_start + act_gpu_layers.

    last_slots (mainline since PR #18148; llama-model.cpp load_tensors):
        i_gpu_start = max(n_layer + 1 - ngl, 0), act = min(ngl, n_layer + 1): the output slot goes first.
    last_blocks (ik_llama.cpp, older mainline): i_gpu_start = max(n_layer - ngl, 0), act = min(ngl, n_layer + 1):
        the last ngl blocks; the output only when ngl > n_layer.
    A negative ngl means "all" in mainline (n_gpu_layers() returns n_layer + 1); ik treats it as the default 0.
    """
    ngl = n_gpu_layers
    if ngl < 0:
        ngl = n_layer + 1 if rule == "last_slots" else 0
    start = max(n_layer + 1 - ngl, 0) if rule == "last_slots" else max(n_layer - ngl, 0)
    return start, min(ngl, n_layer + 1)


def split_points(tensor_split: Sequence[float] | None, n_devices: int) -> list[np.float32]:
    """Normalised cumulative split points as llama-model.cpp computes them (float32); equal split when unset."""
    vals = [np.float32(v) for v in (tensor_split or ())][:n_devices]
    vals += [np.float32(0)] * (n_devices - len(vals))
    if all(v == 0 for v in vals):
        vals = [np.float32(1)] * n_devices     # planning default; llama.cpp uses free memory (reference s.2)
    out: list[np.float32] = []
    acc = np.float32(0)
    for v in vals:
        acc = np.float32(acc + v)
        out.append(acc)
    return [np.float32(s / acc) for s in out]


def slot_devices(n_layer: int, n_gpu_layers: int, rule: SlotRule, devices: Sequence[str],
                 tensor_split: Sequence[float] | None = None) -> list[str]:
    """Device of each of the n_layer + 1 slots (index n_layer = output layer)."""
    start, act = gpu_slot_window(n_layer, n_gpu_layers, rule)
    out = ["CPU"] * (n_layer + 1)
    if not devices or act <= 0:
        return out
    splits = split_points(tensor_split, len(devices))
    for il in range(start, min(start + act, n_layer + 1)):
        x = np.float32(np.float32(il - start) / np.float32(act))
        j = next((k for k, s in enumerate(splits) if s > x), len(splits))   # std::upper_bound
        if j >= len(devices):
            raise FlagError(f"tensor split {list(tensor_split or ())} leaves layer {il} without a device")
        out[il] = devices[j]
    return out


def _slot_table(inv: ModelInventory) -> tuple[tuple[str, int | None], ...]:
    n_layer = inv.hparams.n_layer
    return tuple((t.name, slot_of(t, n_layer)) for t in inv.allocated())


def base_assignment(inv: ModelInventory, slots: Sequence[str]) -> dict[str, str]:
    """Every allocated tensor on its slot's device (token_embd and other input-layer tensors on the CPU)."""
    return {name: "CPU" if s is None else slots[s] for name, s in memo(inv, "slot_table", lambda: _slot_table(inv))}


def apply_overrides(base: Mapping[str, str], overrides: Sequence[Override], index: NameIndex | None = None
                    ) -> tuple[dict[str, str], MatchResult]:
    res = match_overrides(index if index is not None else NameIndex.of(list(base)), overrides)
    out = dict(base)
    for name, idx in res.first.items():
        out[name] = overrides[idx].device
    return out, res


def assign(inv: ModelInventory, n_gpu_layers: int, overrides: Iterable[Override | tuple[str, str]],
           dialect: str, n_gpus: int = 1, tensor_split: Sequence[float] | None = None, *,
           devices: Sequence[str] | None = None) -> dict[str, str]:
    """{tensor name: device} for every allocated tensor: -ngl/-ts slots, then the first-match override list.

    `overrides` is the effective list in llama.cpp's order (user -ot and the -cmoe/-ncmoe expansions already
    placed where the dialect puts them). `devices` (default CUDA0..CUDA{n_gpus-1}) is the GPU list layers are
    split over, in order (-dev / -sm none change it).
    """
    rule = SLOT_RULES[dialect]
    devs = list(devices) if devices is not None else [f"CUDA{i}" for i in range(n_gpus)]
    slots = slot_devices(inv.hparams.n_layer, n_gpu_layers, rule, devs, tensor_split)
    ovs = [o if isinstance(o, Override) else Override(o[0], o[1]) for o in overrides]
    out, _ = apply_overrides(base_assignment(inv, slots), ovs, allocated_names(inv))
    return out


SLOT_RULES: dict[str, SlotRule] = {"mainline": "last_slots", "ik": "last_blocks"}


# ---- regex compaction ----------------------------------------------------------------------------------------

def _charclass(digits: Iterable[int]) -> str:
    ds = sorted(set(digits))
    if len(ds) == 1:
        return str(ds[0])
    parts: list[str] = []
    i = 0
    while i < len(ds):
        j = i
        while j + 1 < len(ds) and ds[j + 1] == ds[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{ds[i]}-{ds[j]}")
        else:
            parts.extend(str(d) for d in ds[i:j + 1])
        i = j + 1
    return "[" + "".join(parts) + "]"


def _range_pieces(lo: int, hi: int) -> list[tuple[str, frozenset[int], int]]:
    """lo..hi (same number of digits) as pieces (fixed prefix, digit set, number of free trailing digits)."""
    pieces = []
    width = len(str(lo))
    while lo <= hi:
        k = 0
        while k + 1 <= width - 1 and lo % 10 ** (k + 1) == 0 and lo + 10 ** (k + 1) - 1 <= hi:
            k += 1
        step = 10 ** k
        d = (lo // step) % 10
        m = min((hi - lo + 1) // step, 10 - d)
        pieces.append((str(lo)[:width - k - 1], frozenset(range(d, d + m)), k))
        lo += m * step
    return pieces


def int_set_regex(values: Iterable[int]) -> str:
    """An alternation (no parentheses, no commas, no braces) matching exactly the decimal forms of `values`.

    E.g. {3..40} -> '[3-9]|[1-3][0-9]|40'; {10..23} -> '1[0-9]|2[0-3]'; {0, 2, 4} -> '[024]'.
    """
    vals = sorted(set(values))
    if not vals or vals[0] < 0:
        raise ValueError("int_set_regex needs non-negative integers")
    merged: dict[tuple[str, int], set[int]] = {}
    i = 0
    while i < len(vals):
        j = i
        while j + 1 < len(vals) and vals[j + 1] == vals[j] + 1:
            j += 1
        lo, hi = vals[i], vals[j]
        while lo <= hi:     # split the run at powers of ten: pieces of one width each
            band_hi = min(hi, 10 ** len(str(lo)) - 1)
            for prefix, digits, k in _range_pieces(lo, band_hi):
                merged.setdefault((prefix, k), set()).update(digits)
            lo = band_hi + 1
        i = j + 1
    items = sorted(merged.items(), key=lambda kv: (len(kv[0][0]) + kv[0][1], kv[0][0], min(kv[1])))
    return "|".join(prefix + _charclass(ds) + "[0-9]" * k for (prefix, k), ds in items)


def escape(text: str) -> str:
    """Regex-escape the characters that are special in ECMAScript (tensor names need only '.')."""
    return "".join("\\" + c if c in _META else c for c in text)


def alternation(strings: Iterable[str]) -> str:
    """Escaped regex matching exactly the given literals: common prefix and suffix factored out."""
    ss = sorted(set(strings))
    if not ss:
        raise ValueError("alternation of nothing")
    if len(ss) == 1:
        return escape(ss[0])
    pre = 0
    shortest = min(len(s) for s in ss)
    while pre < shortest and all(s[pre] == ss[0][pre] for s in ss):
        pre += 1
    suf = 0
    while suf < shortest - pre and all(s[len(s) - 1 - suf] == ss[0][len(ss[0]) - 1 - suf] for s in ss):
        suf += 1
    mids = sorted({s[pre:len(s) - suf] for s in ss})
    return escape(ss[0][:pre]) + "(" + "|".join(escape(m) for m in mids) + ")" + escape(ss[0][len(ss[0]) - suf:])


def has_top_level_bar(regex: str) -> bool:
    depth, i = 0, 0
    while i < len(regex):
        c = regex[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            j = regex.find("]", i + 2)
            i = j + 1 if j >= 0 else len(regex)
            continue
        depth += (c == "(") - (c == ")")
        if c == "|" and depth == 0:
            return True
        i += 1
    return False


def group(alt: str) -> str:
    """Parenthesise an alternation when it has a top-level '|'."""
    return f"({alt})" if has_top_level_bar(alt) else alt
