"""What a user's requests look like: a Workload is a list of request classes, each with its new prompt tokens, the
tokens already in the KV cache from earlier turns (prompt caching), the tokens it generates, a weight, and how many
such requests are in flight at once. The tuner's default objective is a workload's mean request time; engines that
replay requests (llamaserver) send exactly these. planner.bench_run's BenchRun is what one benchmark run
measures; this is what the user runs.

Sources: a preset name (PRESETS), a TOML file (`[[request]]` tables), or a JSONL request log with one usage
object per line, as OpenAI-compatible servers report it (prompt_tokens includes the cached ones):

    {"prompt_tokens": 18000, "cached_tokens": 16000, "completion_tokens": 300}
    {"usage": {"prompt_tokens": 900, "prompt_tokens_details": {"cached_tokens": 0}, "completion_tokens": 40}}

A log is folded into at most MAX_LOG_CLASSES classes (requests of similar size together, weights = counts); each
class keeps its members' mean sizes (what a request costs on average) and the longest context among them (what a
server slot must hold: a log's longest request is never cut to its class's mean).
"""
from __future__ import annotations

import io
import json
import math
import sys
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

from .errors import InputError
from .files import open_regular, read_text

if sys.version_info >= (3, 11):
    import tomllib
else:                                  # Python 3.10: the same parser, from PyPI (pyproject's dependency)
    import tomli as tomllib

MAX_TOKENS: Final = 1 << 21            # per request and per field: past any model's context
MAX_IN_FLIGHT: Final = 256
MAX_CLASSES: Final = 64                # in a TOML file
MAX_LOG_CLASSES: Final = 8             # a log is folded into at most this many classes
MAX_LOG_BYTES: Final = 256 << 20
MAX_FILE_BYTES: Final = 1 << 20        # a TOML workload


@dataclass(frozen=True)
class RequestClass:
    """Requests of one shape. new_tokens: prompt tokens the server must process; cached_tokens: tokens of the
    prompt already in the slot's KV cache (an earlier turn's); gen_tokens: tokens generated; weight: the share of
    requests of this class (any positive scale); in_flight: requests of this class served at once (parallel
    slots, `-np`); longest_tokens: the longest context (prompt and generated tokens) of the requests a log folded
    into this class, whose sizes are their means (None: every request of the class is its size)."""
    new_tokens: int
    cached_tokens: int = 0
    gen_tokens: int = 0
    weight: float = 1.0
    in_flight: int = 1
    longest_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("new_tokens", "cached_tokens", "gen_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_TOKENS:
                raise InputError(f"request class {name} = {v!r}: give an integer 0..{MAX_TOKENS}")
        if self.new_tokens == 0 and self.gen_tokens == 0:
            raise InputError("a request class with no new and no generated tokens measures nothing")
        if self.new_tokens == 0 and self.cached_tokens == 0:
            raise InputError("a request class needs a prompt: new_tokens or cached_tokens above 0")
        w = self.weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
            raise InputError(f"request class weight = {w!r}: give a number > 0")
        k = self.in_flight
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_IN_FLIGHT:
            raise InputError(f"request class in_flight = {k!r}: give an integer 1..{MAX_IN_FLIGHT}")
        n = self.longest_tokens
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 3 * MAX_TOKENS):
            raise InputError(f"request class longest_tokens = {n!r}: give an integer 1..{3 * MAX_TOKENS}")

    @property
    def prompt_tokens(self) -> int:
        """The whole prompt: cached plus new."""
        return self.cached_tokens + self.new_tokens

    @property
    def context_tokens(self) -> int:
        """The KV cache one request of this class fills: its prompt and what it generates."""
        return self.prompt_tokens + self.gen_tokens

    @property
    def longest_context(self) -> int:
        """The KV cache the longest request of this class fills (a log's class: its longest member)."""
        return max(self.context_tokens, self.longest_tokens or 0)


@dataclass(frozen=True)
class Workload:
    """A named list of request classes (planner/workload.py's docstring says where they come from)."""
    name: str
    classes: tuple[RequestClass, ...]
    ttft_limit_s: float | None = None     # the longest time to first token a request may take (tune --ttft)

    def __post_init__(self) -> None:
        if not self.classes:
            raise InputError(f"workload {self.name!r} has no request classes")
        if self.ttft_limit_s is not None and not (0 < self.ttft_limit_s < 86400):
            raise InputError(f"workload {self.name!r}: a time-to-first-token limit is a positive duration under a "
                             f"day, got {self.ttft_limit_s!r} s")

    @property
    def slots(self) -> int:
        """Parallel slots the server needs (`-np`): the most requests in flight of any class."""
        return max(c.in_flight for c in self.classes)

    @property
    def slot_ctx(self) -> int:
        """Context one slot must hold: the longest request (of a log: the longest one logged, not a class mean)."""
        return max(c.longest_context for c in self.classes)

    @property
    def ctx(self) -> int:
        """The server's whole context (`-c`): each slot's share of it must hold the longest request."""
        return self.slots * self.slot_ctx

    def mean_request_s(self, request_s: Callable[[RequestClass], float]) -> float:
        """The weighted mean of `request_s(class)` over the classes."""
        total = sum(c.weight for c in self.classes)
        return sum(c.weight * request_s(c) for c in self.classes) / total

    def tokens_per_request(self) -> float:
        """Mean tokens a request moves (new prompt plus generated): over the mean request time, its tokens/s."""
        total = sum(c.weight for c in self.classes)
        return sum(c.weight * (c.new_tokens + c.gen_tokens) for c in self.classes) / total

    def to_dict(self) -> dict[str, Any]:
        # longest_tokens only where a log set it: a preset's or a TOML workload's dict is what it was before
        d: dict[str, Any] = {"name": self.name, "classes": [
            {k: v for k, v in asdict(c).items() if k != "longest_tokens" or v is not None} for c in self.classes]}
        if self.ttft_limit_s is not None:         # written only when set: studies before the limit compare equal
            d["ttft_limit_s"] = self.ttft_limit_s
        return d

    def describe(self) -> str:
        """One line: `agent: 3 classes, new 2048-6144, cached 16384-32768, out 300, longest request 39212, ctx 39212`
        (ctx: what the server's -c must be, each of the slots holding the longest request)."""
        def span(vals: Iterable[int]) -> str:
            lo, hi = min(vals := list(vals)), max(vals)
            return str(lo) if lo == hi else f"{lo}-{hi}"
        cs = self.classes
        flight = f", {self.slots} in flight" if self.slots > 1 else ""
        limit = f", TTFT <= {self.ttft_limit_s:g} s" if self.ttft_limit_s is not None else ""
        return (f"{self.name}: {len(cs)} class{'es' if len(cs) > 1 else ''}, new {span(c.new_tokens for c in cs)}, "
                f"cached {span(c.cached_tokens for c in cs)}, out {span(c.gen_tokens for c in cs)}{flight}, "
                f"longest request {self.slot_ctx}, ctx {self.ctx}{limit}")


def _chat() -> Workload:
    # a multi-turn chat: each turn sends ~300 new tokens and reads ~400 back; the conversation so far stays in
    # the slot's cache, so later turns start deeper (to ~8k)
    return Workload("chat", tuple(RequestClass(300, depth, 400) for depth in (0, 2048, 4096, 6144, 8192)))


def _agent() -> Workload:
    # a coding agent: a long cached context (system prompt, files, history: 16k-32k) plus 2k-6k new tokens of
    # tool output per step, ~300 tokens of answer
    return Workload("agent", (RequestClass(2048, 16384, 300), RequestClass(4096, 24576, 300),
                              RequestClass(6144, 32768, 300)))


def _rag() -> Workload:
    # retrieval: 16k tokens of fresh documents every request, nothing cached, a short answer
    return Workload("rag", (RequestClass(16384, 0, 250),))


def _batch() -> Workload:
    # offline batch jobs: 4 requests at once, 1k in, 500 out each
    return Workload("batch", (RequestClass(1024, 0, 500, in_flight=4),))


PRESETS: Final[dict[str, Callable[[], Workload]]] = {"chat": _chat, "agent": _agent, "rag": _rag, "batch": _batch}
DEFAULT: Final = "chat"


def preset(name: str) -> Workload:
    try:
        return PRESETS[name]()
    except KeyError:
        raise InputError(f"unknown workload {name!r}: give one of {', '.join(PRESETS)}, a .toml file or a .jsonl "
                         "request log") from None


def load(spec: str, base: Path | None = None) -> Workload:
    """A preset name, a .toml workload or a .jsonl request log (relative paths from `base`, else the cwd)."""
    if spec in PRESETS:
        return preset(spec)
    path = Path(spec) if base is None or Path(spec).is_absolute() else base / spec
    if path.suffix not in (".toml", ".jsonl", ".json"):
        return preset(spec)              # the error lists the presets and the file kinds
    try:
        size = path.stat().st_size
    except OSError as e:
        raise InputError(f"workload {spec}: {e.strerror or e}") from e
    if path.suffix == ".toml":
        if size > MAX_FILE_BYTES:
            raise InputError(f"workload {spec}: {size} bytes, a workload file is at most {MAX_FILE_BYTES}")
        return from_toml(path)
    if size > MAX_LOG_BYTES:
        raise InputError(f"workload {spec}: {size} bytes, a request log is read up to {MAX_LOG_BYTES}")
    return from_log(path)


_CLASS_KEYS: Final = ("new_tokens", "cached_tokens", "gen_tokens", "weight", "in_flight")


def from_mapping(data: Any, name: str, where: str) -> Workload:
    """{"name"?: str, "request": [{new_tokens, cached_tokens?, gen_tokens?, weight?, in_flight?}, ...]} (a TOML
    file's tables, a spec's inline workload, a JSON request body)."""
    if not isinstance(data, dict):
        raise InputError(f"{where}: a workload is a table with [[request]] entries")
    unknown = sorted(set(data) - {"name", "request"})
    if unknown:
        raise InputError(f"{where}: unknown key {unknown[0]!r}; a workload has name and [[request]] tables")
    reqs = data.get("request")
    if not isinstance(reqs, list) or not reqs or len(reqs) > MAX_CLASSES:
        raise InputError(f"{where}: give 1-{MAX_CLASSES} [[request]] tables (new_tokens, cached_tokens, "
                         "gen_tokens, weight, in_flight)")
    classes = []
    for i, r in enumerate(reqs):
        if not isinstance(r, dict):
            raise InputError(f"{where}: request {i + 1} is not a table")
        bad = sorted(set(r) - set(_CLASS_KEYS))
        if bad or "new_tokens" not in r:
            raise InputError(f"{where}: request {i + 1}: " + (f"unknown key {bad[0]!r}" if bad else
                             "new_tokens is missing") + f" (keys: {', '.join(_CLASS_KEYS)})")
        try:
            classes.append(RequestClass(**r))
        except InputError as e:
            raise InputError(f"{where}: request {i + 1}: {e}") from None
    label = data.get("name", name)
    if not isinstance(label, str) or not label.strip():
        raise InputError(f"{where}: name must be a non-empty string")
    return Workload(label.strip(), tuple(classes))


def from_toml(path: Path) -> Workload:
    try:
        data = tomllib.loads(read_text(path, "workload", MAX_FILE_BYTES))
    except tomllib.TOMLDecodeError as e:
        raise InputError(f"workload {path}: not TOML ({e})") from e
    return from_mapping(data, path.stem, f"workload {path}")


def _usage(line: str, where: str) -> tuple[int, int, int]:
    """(new, cached, generated) of one log line."""
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise InputError(f"{where}: not JSON ({str(e)[:80]})") from None
    except RecursionError:       # a line nested past the parser's depth: no request log holds one
        raise InputError(f"{where}: JSON nested too deep to be a request's usage") from None
    if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
        obj = obj["usage"]
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected an object with prompt_tokens and completion_tokens")
    cached = obj.get("cached_tokens")
    details = obj.get("prompt_tokens_details")
    if cached is None and isinstance(details, dict):
        cached = details.get("cached_tokens")
    vals = (obj.get("prompt_tokens"), 0 if cached is None else cached, obj.get("completion_tokens"))
    for key, v in zip(("prompt_tokens", "cached_tokens", "completion_tokens"), vals):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_TOKENS:
            raise InputError(f"{where}: {key} = {v!r}: give an integer 0..{MAX_TOKENS}")
    prompt, cached, gen = vals
    if cached > prompt:
        raise InputError(f"{where}: cached_tokens {cached} > prompt_tokens {prompt} (prompt_tokens counts the "
                         "cached ones, as OpenAI's usage does)")
    return prompt - cached, cached, gen


def _bucket(n: int) -> int:
    """Sizes within a factor of ~1.4 share a bucket (0 alone)."""
    return -1 if n == 0 else int(round(2 * math.log2(n)))


def from_log(path: Path) -> Workload:
    """A JSONL request log folded into at most MAX_LOG_CLASSES classes: requests are grouped by the size of their
    new, cached and generated tokens (factors of ~1.4), each group is one class of its members' mean sizes with
    their count as weight and their longest context as longest_tokens; past MAX_LOG_CLASSES groups, the smallest
    groups join the nearest kept one."""
    groups: dict[tuple[int, int, int], list[tuple[int, int, int]]] = {}
    try:
        with io.TextIOWrapper(open_regular(path, "workload"), encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if line.strip():
                    u = _usage(line, f"workload {path}:{i}")
                    if u[0] == 0 and u[2] == 0 or u[0] + u[1] == 0:
                        continue           # nothing processed or generated: not a request to time
                    groups.setdefault(tuple(_bucket(x) for x in u), []).append(u)
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"workload {path}: cannot read it ({e})") from e
    if not groups:
        raise InputError(f"workload {path}: no requests (one JSON usage object per line, with prompt_tokens and "
                         "completion_tokens)")
    ranked = sorted(groups, key=lambda k: -len(groups[k]))
    kept = ranked[:MAX_LOG_CLASSES]
    for k in ranked[MAX_LOG_CLASSES:]:      # fold into the nearest kept group by bucket distance
        near = min(kept, key=lambda q: sum(abs(a - b) for a, b in zip(q, k)))
        groups[near] += groups.pop(k)
    classes = []
    for k in kept:
        members = groups[k]
        new, cached, gen = (round(sum(m[j] for m in members) / len(members)) for j in range(3))
        if new == 0 and gen == 0:
            gen = 1
        longest = max(sum(m) for m in members)       # new + cached + generated: the context the request filled
        classes.append(RequestClass(new, cached, gen, weight=float(len(members)), longest_tokens=longest))
    return Workload(path.stem, tuple(sorted(classes, key=lambda c: (c.cached_tokens, c.new_tokens))))
