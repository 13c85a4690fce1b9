"""Table-driven reading and writing of llama.cpp command lines; the dialect modules supply the tables.

A `ToolTable` (one per dialect and tool) lists the flags that matter for placement and knobs (`Flag`: canonical
key, spellings, value style), every other spelling the tool accepts with its number of values, separators and
the values llama.cpp uses when a flag is absent. `walk` turns argv into typed `Event`s; `spell` turns settings
back into argv; `interpret` and `render` (here, shared by both dialects) go between events and a Plan.
"""
from __future__ import annotations

import dataclasses
import math
import re
import shlex
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal, Protocol
from collections.abc import Callable, Mapping, Sequence

from ..builds import PINNED, Build, Feature
from ..errors import FlagError
from ..model import ModelInventory
from ..plan import FULL_PRECISION_KV, Knobs, OffloadPolicy, Plan
from . import ik_split, placement
from .common import (
    MatchResult, Override, SlotRule, allocated_names, apply_overrides, base_assignment, check_buft, gpu_index,
    gpu_slot_window, is_gpu, memo, shell_join, slot_devices,
)

Tool = Literal["server", "cli", "bench"]
TOOLS: tuple[str, ...] = ("server", "cli", "bench")
Style = Literal["int", "str", "switch", "choice", "ngl"]

# Program name -> tool whose parser it uses (ik's llama-sweep-bench takes the server's common flags).
BINARY_TOOLS: dict[str, str] = {
    "llama-server": "server", "server": "server", "llama-sweep-bench": "server", "llama-fit-params": "server",
    "llama-cli": "cli", "main": "cli", "llama-completion": "cli", "llama-bench": "bench",
}
_ENV_ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)
TRUTHY = ("on", "enabled", "true", "1")      # common/arg.cpp is_truthy / is_falsey
FALSEY = ("off", "disabled", "false", "0")

# Warning codes: the text after the code is filled in where the warning is raised.
WARNINGS: dict[str, str] = {
    "W001": "pattern matches no tensor", "W002": "pattern shadowed entirely by earlier overrides",
    "W003": "comma inside an -ot value", "W004": "KV cache in host memory", "W005": "ubatch larger than batch",
    "W006": "-ngl counts layers differently in mainline and ik", "W007": "token_embd overridden to a GPU",
    "W008": "--flag=value form", "W009": "-fit on may change unset arguments", "W010": "flag repeated",
    "W011": "llama-bench sweep", "W012": "several GPUs without -ts", "W013": "split mode not modelled",
    "W014": "no -c", "W015": "flash attention auto", "W016": "(retired)",
    "W017": "no -ngl", "W018": "unknown -op id", "W019": "ik applies -ncmoe/-cmoe after every -ot",
    "W020": "server slots", "W021": "ik -amb below 128", "W022": "-op dense ops disagree",
    "W023": "environment value", "W024": "unknown flag", "W026": "ik MoE offload threshold",
    "W027": "ik -ngl 0 drops overrides",
    "W028": "-b/-ub as llama.cpp runs them", "W029": "context above the training context",
    "W101": "layer homes not expressible", "W102": "token_embd on a GPU", "W103": "knob not expressible in bench",
}


@dataclass(frozen=True)
class Flag:
    key: str
    spellings: tuple[str, ...]           # the first is the one we write
    style: Style = "str"
    const: Any = True                    # value a switch sets
    choices: Mapping[str, Any] | None = None   # style "choice": accepted words -> value
    render_as: Mapping[Any, str] | None = None  # style "choice": value -> word we write
    env: str | None = None               # environment variable llama.cpp reads for this flag
    env_kind: Literal["void", "bool", "value"] = "value"
    sweep: bool = False                  # llama-bench: ',' separates alternative values
    icase: bool = False                  # choice words are case-insensitive


@dataclass(frozen=True)
class MoeRule:
    """How -cmoe / -ncmoe become tensor overrides in one tool (docs/llamacpp.md section 3)."""
    ncmoe_template: str                  # per-layer regex, {i} = layer index
    cmoe_pattern: str | None             # one regex for -cmoe; None: -cmoe means -ncmoe with every MoE layer
    order: Literal["first_layers", "last_moe_layers"]
    placement: Literal["cmdline", "after_user"]   # where the expansion joins the first-match list
    accumulate: bool                     # every -ncmoe appends (mainline) or the last value wins (ik)
    ncffn_template: str | None = None    # mainline -ncffn: dense FFN of the first N layers


@dataclass(frozen=True)
class ToolTable:
    dialect: str
    tool: str
    binary: str
    flags: tuple[Flag, ...]
    known: Mapping[str, int]             # every other spelling the tool accepts -> number of values
    strict: bool                         # unknown flags are errors (we read the parser) or warnings
    ot_sep: str                          # between overrides inside one -ot value
    ts_sep: str                          # between -ts proportions when we write them
    ts_split: str                        # regex the tool splits -ts proportions with
    int_ranges: bool                     # llama-bench (mainline): ints accept first-last[+step]
    defaults: Mapping[str, Any]          # setting key -> value when the flag is absent
    always: frozenset[str]               # setting keys always written
    ignored_knobs: frozenset[str]        # Knobs fields this tool cannot set (written nowhere, not an error)
    kv_types: tuple[str, ...]
    moe: MoeRule | None
    max_devices: int = 16                # llama_max_devices()

    @cached_property
    def lookup(self) -> dict[str, Flag]:
        return {s: f for f in self.flags for s in f.spellings}

    @cached_property
    def _keys(self) -> frozenset[str]:
        return frozenset(f.key for f in self.flags)

    def keys(self) -> frozenset[str]:
        """Setting keys this tool has a flag for."""
        return self._keys


@dataclass(frozen=True)
class Event:
    key: str
    value: Any
    spelling: str
    pos: int


class WorkloadLike(Protocol):
    """What llama-bench needs of a workload (planner.engine.BenchWorkload fits; depth and repetitions optional)."""
    n_prompt: int
    n_gen: int


class RenderedCommand(list):
    """The argv (without the program) of a rendered plan: a list of str, plus what goes with it.

    `env` holds environment variables the command needs (GGML_OP_OFFLOAD_MIN_BATCH), `notes` what could not be
    said exactly (coded like parse warnings); `.shell()` is a paste-ready line. Treat it as read-only.
    """
    __slots__ = ("env", "dialect", "tool", "binary", "notes")

    def __init__(self, argv: Sequence[str], env: Mapping[str, str] | None = None, dialect: str = "",
                 tool: str = "server", binary: str = "", notes: Sequence[str] = ()) -> None:
        super().__init__(argv)
        self.env: dict[str, str] = dict(env or {})
        self.dialect = dialect
        self.tool = tool
        self.binary = binary
        self.notes: tuple[str, ...] = tuple(notes)

    @property
    def argv(self) -> tuple[str, ...]:
        return tuple(self)

    def shell(self, binary: str | None = None) -> str:
        """Shell-quoted line: environment assignments, the program (default: the tool's binary), argv."""
        prog = self.binary if binary is None else binary
        return shell_join(([prog] if prog else []) + list(self), self.env)

    def __repr__(self) -> str:
        return f"RenderedCommand({list(self)!r}, env={self.env!r}, tool={self.tool!r})"


@dataclass(frozen=True)
class ParsedCommand:
    assignment: dict[str, str]           # every allocated tensor -> device
    knobs: Knobs
    warnings: tuple[str, ...]
    overrides: tuple[Override, ...]      # the effective first-match list, in llama.cpp's order
    dialect: str
    tool: str
    n_gpu_layers: int
    tensor_split: tuple[float, ...] | None
    layer_devices: tuple[str, ...]       # device of each slot (index n_layer = output layer): KV follows it
    n_gpus: int
    output_copy_device: str | None = None   # tied output: where llama.cpp puts the second token_embd (the output)
    env: dict[str, str] = field(default_factory=dict)
    workload: dict[str, int] = field(default_factory=dict)   # llama-bench: n_prompt, n_gen, n_depth (, repetitions)
    # mainline's --fit (on by default in the server) with no expert overrides given: it would move experts to RAM
    # until each GPU keeps fit_target_mib free (-fitt; 1024 MiB by default; docs/llamacpp.md section 7)
    fit_moves_experts: bool = False
    fit_target_mib: tuple[int, ...] = ()

    def to_plan(self, model_id: str = "", label: str = "") -> Plan:
        return Plan(model_id=model_id, assignment=dict(self.assignment), knobs=self.knobs,
                    dialect=self.dialect, label=label)  # type: ignore[arg-type]


PolicyRender = Callable[[Knobs, ToolTable, ModelInventory, Mapping[str, Any]],
                        tuple[list[tuple[str, Any]], dict[str, str]]]
PolicyParse = Callable[[Mapping[str, Any], Sequence[Event], Mapping[str, str], ToolTable, list[str],
                        Mapping[str, Any]], tuple[OffloadPolicy, bool]]
PlacementNotes = Callable[[Mapping[str, str], Knobs, ModelInventory], list[str]]


@dataclass(frozen=True)
class DialectSpec:
    name: str
    slot_rule: SlotRule
    tools: Mapping[str, ToolTable]
    render_policy: PolicyRender          # Knobs.offload / only_active_experts -> settings and environment
    parse_policy: PolicyParse            # settings, events, environment -> (OffloadPolicy, only_active_experts)
    placement_notes: PlacementNotes      # dialect facts worth saying about a placement (e.g. ik's MoE threshold)


# ---- argv in ---------------------------------------------------------------------------------------------

def split_command(args: Sequence[str] | str | RenderedCommand) -> tuple[dict[str, str], str | None, list[str]]:
    """(environment assignments, program or None, arguments) of a pasted command line or an argv list."""
    env: dict[str, str] = {}
    if isinstance(args, RenderedCommand):
        return dict(args.env), None, list(args.argv)
    if isinstance(args, str):
        text = args.replace("\\\r\n", " ").replace("\\\n", " ")
        try:
            tokens = shlex.split(text)
        except ValueError as e:
            raise FlagError(f"cannot split the command line like a shell does: {e}") from e
    else:
        tokens = list(args)
    while tokens:
        m = _ENV_ASSIGN.match(tokens[0])
        if m and not tokens[0].startswith("-"):
            env[m.group(1)] = m.group(2)
            tokens.pop(0)
        elif tokens[0] == "env":
            tokens.pop(0)
        else:
            break
    binary = None
    if tokens and not tokens[0].startswith("-"):
        binary = tokens.pop(0)
    return env, binary, tokens


def tool_of_binary(binary: str) -> str:
    base = re.split(r"[\\/]", binary)[-1]
    base = base[:-4] if base.lower().endswith(".exe") else base
    if base in BINARY_TOOLS:
        return BINARY_TOOLS[base]
    raise FlagError(f"unknown program {binary!r}: expected one of {', '.join(sorted(BINARY_TOOLS))} "
                    "(or say which tool with tool=...)")


def stoi(text: str, what: str) -> int:
    """std::stoi: optional whitespace and sign, digits; trailing characters ignored."""
    m = re.match(r"\s*([+-]?\d+)", text)
    if m is None:
        raise FlagError(f"{what} expects an integer, got {text!r}")
    value = int(m.group(1))
    if not INT_MIN <= value <= INT_MAX:
        raise FlagError(f"{what}: {m.group(1)} is out of range for llama.cpp's int (std::stoi throws); the largest "
                        f"is {INT_MAX}")
    return value


INT_MIN, INT_MAX = -(1 << 31), (1 << 31) - 1
UINT32 = 1 << 32
IK_MIN_BATCH = 16            # ik src/llama.cpp: n_batch < GGML_KQ_MASK_PAD (16) is raised to it


def int_range_first(text: str, what: str) -> tuple[int, int]:
    """llama-bench parse_int_range: first value and how many values `first-last[+|*step],...` spells."""
    vals: list[int] = []
    rest = text
    rx = re.compile(r"^(-?\d+)(?:-(\d+)(?:([+*])(\d+))?)?(?:,|$)")
    while rest:
        m = rx.match(rest)
        if m is None:
            raise FlagError(f"{what} expects integers or ranges like 512,1024 or 256-2048*2, got {text!r}")
        first = int(m.group(1))
        last = int(m.group(2)) if m.group(2) else first
        op, step = (m.group(3) or "+"), int(m.group(4) or 1)
        i = first
        while i <= last and len(vals) < 10_000:
            vals.append(i)
            nxt = i + step if op == "+" else i * step
            if nxt <= i:
                raise FlagError(f"{what}: invalid range {text!r}")
            i = nxt
        rest = rest[m.end():]
    if not vals:
        raise FlagError(f"{what} expects a value, got {text!r}")
    return vals[0], len(vals)


def _convert(flag: Flag, raw: str, table: ToolTable, name: str, warnings: list[str]) -> Any:
    what = f"{name} ({table.binary})"
    if flag.sweep and flag.style != "int" and "," in raw:
        parts = raw.split(",")
        warnings.append(f"W011 {name} {raw!r}: llama-bench runs one configuration per ','-separated value; "
                        f"explaining the first ({parts[0]!r})")
        raw = parts[0]
    if flag.style in ("int", "ngl"):
        if flag.style == "ngl" and raw in ("all", "auto") and not flag.sweep:
            return -2 if raw == "all" else -1
        if table.int_ranges and flag.sweep:
            first, count = int_range_first(raw, what)
            if count > 1:
                warnings.append(f"W011 {name} {raw!r}: llama-bench runs one configuration per value; "
                                f"explaining the first ({first})")
            return first
        if flag.sweep and "," in raw:
            parts = raw.split(",")
            warnings.append(f"W011 {name} {raw!r}: llama-bench runs one configuration per value; "
                            f"explaining the first ({parts[0]})")
            raw = parts[0]
        return stoi(raw, what)
    if flag.style == "choice":
        assert flag.choices is not None
        word = raw.lower() if flag.icase else raw
        if word not in flag.choices:
            raise FlagError(f"{what}: unknown value {raw!r}; expected one of {', '.join(flag.choices)}")
        return flag.choices[word]
    return raw


def walk(argv: Sequence[str], table: ToolTable, warnings: list[str]) -> list[Event]:
    """Typed events for the flags in `table`; other known flags skipped; unknown ones rejected (or warned)."""
    events: list[Event] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        i += 1
        if not tok.startswith("-") or tok == "-":
            if table.strict:
                raise FlagError(f"unexpected argument {tok!r}: {table.binary} takes only flags (a value without "
                                "its flag, or a quoting problem?)")
            warnings.append(f"W024 stray argument {tok!r} ignored")
            continue
        name, inline = tok, None
        if tok.startswith("--") and "=" in tok:
            name, inline = tok.split("=", 1)
            warnings.append(f"W008 {tok!r}: {table.dialect} {table.binary} expects '{name} {inline}' (two "
                            "arguments) and rejects the '=' form; read as if written that way")
        if name.startswith("--"):
            name = name.replace("_", "-")    # both parsers do this for long flags
        flag = table.lookup.get(name)
        if flag is not None:
            if flag.style == "switch":
                if inline is not None:
                    raise FlagError(f"{name} takes no value (got {inline!r})")
                events.append(Event(flag.key, flag.const, name, len(events)))
                continue
            if inline is None:
                if i >= len(argv):
                    raise FlagError(f"{name} expects a value ({table.binary})")
                inline = argv[i]
                i += 1
            events.append(Event(flag.key, _convert(flag, inline, table, name, warnings), name, len(events)))
            continue
        n_values = table.known.get(name)
        if n_values is None:
            if table.strict:
                raise FlagError(f"unknown flag {name!r}: {table.dialect} {table.binary} would reject it")
            takes = i < len(argv) and not argv[i].startswith("-") and inline is None
            warnings.append(f"W024 flag {name!r} is not in our {table.dialect} {table.binary} table; ignored"
                            + (f" with its value {argv[i]!r}" if takes else ""))
            i += 1 if takes else 0
            continue
        n_values -= 1 if inline is not None else 0
        if i + n_values > len(argv):
            raise FlagError(f"{name} expects {n_values} value(s) ({table.binary})")
        i += max(n_values, 0)
    return events


def env_events(env: Mapping[str, str], table: ToolTable, warnings: list[str]) -> list[Event]:
    """Events for LLAMA_ARG_* variables of flags we interpret (llama.cpp applies them before argv)."""
    out: list[Event] = []
    for flag in table.flags:
        if flag.env is None:
            continue
        neg = flag.env.replace("LLAMA_ARG_", "LLAMA_ARG_NO_", 1)
        if flag.env_kind == "bool" and neg in env:
            out.append(Event(flag.key, not flag.const, neg, -1))
            continue
        if flag.env not in env:
            continue
        val = env[flag.env]
        if flag.env_kind == "void":
            if val in TRUTHY:
                out.append(Event(flag.key, flag.const, flag.env, -1))
        elif flag.env_kind == "bool":
            if val not in TRUTHY + FALSEY:
                raise FlagError(f"{flag.env}={val!r}: expected one of {', '.join(TRUTHY + FALSEY)}")
            out.append(Event(flag.key, flag.const if val in TRUTHY else not flag.const, flag.env, -1))
        else:
            out.append(Event(flag.key, _convert(flag, val, table, flag.env, warnings), flag.env, -1))
    return out


# ---- argv out --------------------------------------------------------------------------------------------

def spell(settings: Sequence[tuple[str, Any]], table: ToolTable) -> list[str]:
    """argv for (key, value) settings, using each key's first spelling in `table`."""
    argv: list[str] = []
    for key, value in settings:
        flags = [f for f in table.flags if f.key == key]
        if not flags:
            raise FlagError(f"{table.dialect} {table.binary} has no flag for {key}")
        valued = [f for f in flags if f.style != "switch" and (f.style != "choice" or value in (f.render_as or {}))]
        switch = [f for f in flags if f.style == "switch" and f.const == value]
        if valued:
            f = valued[0]
            argv += [f.spellings[0], f.render_as[value] if f.style == "choice" and f.render_as else str(value)]
        elif switch:
            argv.append(switch[0].spellings[0])
        else:
            raise FlagError(f"{table.dialect} {table.binary} cannot write {key}={value!r}")
    return argv


# ---- knobs <-> settings ----------------------------------------------------------------------------------

# setting key -> (Knobs field, whether the setting is the field negated)
KNOB_KEYS: dict[str, tuple[str, bool]] = {
    "ctx": ("n_ctx", False), "np": ("n_seq", False), "batch": ("n_batch", False), "ubatch": ("n_ubatch", False),
    "threads": ("n_threads", False), "fa": ("flash_attn", False), "ctk": ("type_k", False),
    "ctv": ("type_v", False), "kv_offload": ("no_kv_offload", True), "mmap": ("mmap", False),
    "swa_full": ("swa_full", False), "mla": ("mla", False), "amb": ("amb", False), "fmoe": ("fmoe", False),
    "rtr": ("rtr", False), "no_host": ("no_host", False),
}
POLICY_FIELDS = ("offload", "only_active_experts")


def knob_fields(spec: DialectSpec, tool: str) -> frozenset[str]:
    """Knobs fields a command line of this dialect and tool sets (the others keep their defaults)."""
    table = spec.tools[tool]
    return frozenset({KNOB_KEYS[k][0] for k in table.keys() if k in KNOB_KEYS} | set(POLICY_FIELDS))  # noqa: SIM118 (a ToolTable, not a dict)


def check_knobs(knobs: Knobs, table: ToolTable) -> None:
    """Values no llama.cpp command line can carry (they would be changed or rejected)."""
    for fname, low in (("n_ctx", 1), ("n_batch", 1), ("n_ubatch", 1), ("n_seq", 1), ("n_threads", 0)):
        if getattr(knobs, fname) < low and fname not in table.ignored_knobs:
            raise FlagError(f"knob {fname}={getattr(knobs, fname)} must be >= {low}")
    if table.dialect == "ik" and table.tool != "bench" and 0 < knobs.amb < 128:
        raise FlagError(f"knob amb={knobs.amb}: ik raises -amb values below 128 to 128; use 0 (off) or >= 128")
    if knobs.no_host and table.dialect != "mainline":
        raise FlagError(f"knob no_host=True is mainline's --no-host; {table.dialect} {table.binary} has no such flag "
                        "(ik repacks with -rtr, knob rtr)")
    if not knobs.flash_attn and knobs.type_v not in FULL_PRECISION_KV:
        raise FlagError(f"knob type_v={knobs.type_v} with flash_attn=False: {table.dialect} refuses a quantized V "
                        "cache without flash attention; set flash_attn=True or an f16/bf16/f32 V cache")
    if knobs.rtr and knobs.mmap and table.dialect == "ik":
        raise FlagError("knob rtr=True with mmap=True: ik's -rtr repacks at load time and turns mmap off; "
                        "set mmap=False")


def moot_knobs(knobs: Knobs, mla_model: bool) -> frozenset[str]:
    """Knobs that change nothing for this model: ik's -mla without MLA, and -amb (which bounds only attention
    without flash attention) without MLA and with flash attention. They are not written, so a Qwen3 plan carries
    no `-mla 3 -amb 0`, and a command read back may hold the program's defaults for them."""
    if mla_model:
        return frozenset()
    return frozenset({"mla", "amb"}) if knobs.flash_attn else frozenset({"mla"})


def knob_settings(knobs: Knobs, table: ToolTable, notes: list[str], mla_model: bool = True
                  ) -> list[tuple[str, Any]]:
    check_knobs(knobs, table)
    moot = moot_knobs(knobs, mla_model)
    out: list[tuple[str, Any]] = []
    keys = table.keys()
    default_knobs = Knobs()
    for key, (fname, negated) in KNOB_KEYS.items():
        value = getattr(knobs, fname)
        setting = (not value) if negated else value
        if key not in keys:
            if fname in table.ignored_knobs:
                if value != getattr(default_knobs, fname) and fname != "n_ctx":
                    notes.append(f"W103 {table.binary} cannot set {fname}={value!r}; it runs with its own")
                continue
            if value != getattr(default_knobs, fname):
                raise FlagError(f"{table.dialect} {table.binary} cannot express knob {fname}={value!r} "
                                f"(no such flag in this dialect)")
            continue
        if key in ("ctk", "ctv") and value not in table.kv_types:
            raise FlagError(f"{table.dialect} {table.binary} does not accept KV cache type {value!r} "
                            f"for {fname}; valid: {', '.join(table.kv_types)}")
        if key == "threads" and value <= 0:
            continue
        if fname in moot:
            continue
        if key in table.always or setting != table.defaults.get(key, setting):
            out.append((key, setting))
    return out


# ---- interpretation ----------------------------------------------------------------------------------------

def _last(events: Sequence[Event]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for e in events:
        out[e.key] = e.value
    return out


def _split_overrides(value: str, table: ToolTable, spelling: str, warnings: list[str]) -> list[tuple[str, str]]:
    pieces: list[str]
    if table.ot_sep == ";":
        groups = value.split(",")
        if len(groups) > 1:
            warnings.append(f"W003 {spelling} {value!r}: in llama-bench ',' separates alternative override "
                            "sets (one benchmark each) and ';' separates overrides of one set; explaining the "
                            "first set")
        pieces = []
        for p in groups[0].split(";"):
            if not p:
                break          # llama-bench stops at an empty ';' span
            pieces.append(p)
    else:
        pieces = value.split(",")
    out: list[tuple[str, str]] = []
    for p in pieces:
        if "=" not in p:
            if "," in value:
                raise FlagError(f"{spelling} '{value}': llama.cpp splits -ot on ',' before reading the regex, "
                                f"leaving '{p}' without '=BUFT'; a pattern cannot contain a comma: write "
                                "(1|2|3) instead of {1,3}")
            raise FlagError(f"{spelling} '{p}': expected PATTERN=BUFT (e.g. 'ffn_.*_exps=CPU')")
        pat, buft = p.split("=", 1)
        out.append((pat, buft))
    if table.ot_sep == "," and "," in value and any(re.search(r"\{\d*$|^\d*\}", pat) for pat, _ in out):
        warnings.append(f"W003 {spelling} '{value}': a ',' split what looks like one pattern ({{n,m}}); "
                        "llama.cpp splits -ot on ','")
    return out


def _parse_ts(value: str, table: ToolTable, warnings: list[str]) -> tuple[float, ...]:
    if table.tool == "bench" and "," in value:
        warnings.append(f"W011 -ts {value!r}: llama-bench runs one configuration per ','-separated split; "
                        "explaining the first")
        value = value.split(",")[0]
    parts = re.split(table.ts_split, value)
    if len(parts) >= table.max_devices + (table.tool == "bench"):
        raise FlagError(f"-ts {value!r}: {len(parts)} proportions, more than llama.cpp's {table.max_devices} devices")
    try:
        props = tuple(float(p) for p in parts)
    except ValueError as e:
        raise FlagError(f"-ts {value!r}: proportions must be numbers like 3,1") from e
    if not all(math.isfinite(p) and p >= 0 for p in props):
        raise FlagError(f"-ts {value!r}: proportions must be finite and >= 0, like 3,1")
    return props


ALL_LAYERS = 1 << 30     # ik: -cmoe is -ncmoe with "every" MoE layer (it sets ncmoe = 999)
LIST_KEYS = frozenset({"ot", "ncmoe", "cmoe", "ncffn", "op"})   # flags that add up instead of replacing


def _expand_ncmoe(rule: MoeRule, n: int, inv: ModelInventory, origin: str) -> list[Override]:
    if rule.order == "first_layers":
        layers = list(range(min(n, inv.hparams.n_layer)))   # llama.cpp's loop stops at the last layer too
    else:
        moe = memo(inv, "moe_layers", inv.moe_layers)
        layers = moe[max(len(moe) - n, 0):] if n > 0 else []
    return [Override(rule.ncmoe_template.format(i=i), "CPU", origin) for i in layers]


def expand_moe(rule: MoeRule, kind: str, n: int, inv: ModelInventory) -> list[Override]:
    if kind == "cmoe":
        if rule.cmoe_pattern is not None:
            return [Override(rule.cmoe_pattern, "CPU", "-cmoe")]
        return _expand_ncmoe(rule, ALL_LAYERS, inv, "-cmoe")
    return _expand_ncmoe(rule, n, inv, f"-ncmoe {n}")


def _infer_n_gpus(explicit: int | None, env: Mapping[str, str], ts: Sequence[float] | None,
                  names: Sequence[str]) -> int:
    if explicit is not None:
        return explicit
    n = 1
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        n = max(n, len([x for x in cvd.split(",") if x.strip()]))
    if ts:
        n = max(n, len(ts))
    for d in names:
        if is_gpu(d):
            n = max(n, gpu_index(d) + 1)
    return n


@dataclass(frozen=True)
class _Layout:
    n_gpus: int
    devices: list[str]                   # GPUs the layers are split over, in order
    tensor_split: tuple[float, ...] | None
    n_gpu_layers: int


def _layout(settings: Mapping[str, Any], env: Mapping[str, str], bufts: Sequence[str], spec: DialectSpec,
            table: ToolTable, n_layer: int, n_gpus: int | None, warnings: list[str]) -> _Layout:
    """GPU count, the devices layers go to (-dev, -sm none/-mg), -ts and -ngl, with their warnings."""
    ts = _parse_ts(settings["ts"], table, warnings) if "ts" in settings else None
    dev_list: list[str] | None = None
    if "dev" in settings:
        val = str(settings["dev"])
        dev_list = [] if val.strip() == "none" else [x.strip() for x in val.replace("/", ",").split(",") if x.strip()]
    n = _infer_n_gpus(n_gpus, env, ts, list(bufts) + (dev_list or []))
    if ts is not None and n_gpus is not None and len(ts) > n_gpus and any(ts[n_gpus:]):
        raise FlagError(f"-ts {settings['ts']!r} gives {len(ts)} proportions but the hardware has {n_gpus} GPU(s) "
                        f"({', '.join(f'CUDA{i}' for i in range(n_gpus))}); declare the GPUs with --gpu or --hardware")
    for buft in bufts:
        check_buft(buft, n)
    devices = dev_list if dev_list is not None else [f"CUDA{i}" for i in range(n)]
    for dname in devices:
        if not is_gpu(dname) or gpu_index(dname) >= n:
            raise FlagError(f"-dev {settings['dev']!r}: unknown device {dname!r}; valid: "
                            + ", ".join(f"CUDA{i}" for i in range(n)))
    sm = settings.get("sm", "layer")
    if sm == "none" and devices:
        mg = int(settings.get("mg", 0))
        if not 0 <= mg < len(devices):
            raise FlagError(f"-mg {mg}: there are only {len(devices)} GPU(s)")
        devices = [devices[mg]]
    elif sm not in ("layer", "none"):
        warnings.append(f"W013 -sm {sm}: placement is explained as the layer split (-sm layer)")
    if len(devices) > 1 and ts is None and settings.get("ngl", 1) != 0:
        warnings.append(f"W012 {len(devices)} GPUs and no -ts: llama.cpp splits layers by free memory "
                        f"{'(ik: free memory shared out by cumulative layer bytes) ' if spec.name == 'ik' else ''}"
                        "; assumed an equal split")
    ngl = int(settings.get("ngl", table.defaults.get("ngl", -1)))
    on_gpu = gpu_slot_window(n_layer, ngl, spec.slot_rule)[1]
    if "ngl" not in settings:
        where = "every layer on the GPU" if on_gpu else "every layer on the CPU"
        if spec.name == "mainline" and table.tool != "bench":
            where = "-ngl auto: -fit decides (with -fit off, every layer on the GPU)"
        warnings.append(f"W017 no -ngl: {spec.name} {table.binary} defaults to {where}; say -ngl N")
    if 0 < on_gpu < n_layer + 1:
        what = (f"the output layer and the last {on_gpu - 1} blocks" if spec.slot_rule == "last_slots"
                else f"the last {on_gpu} blocks (no output layer)")
        other = "ik" if spec.name == "mainline" else "mainline"
        warnings.append(f"W006 -ngl {ngl} of {n_layer + 1} slots: {spec.name} puts {what} on the GPU; "
                        f"{other} would differ")
    return _Layout(n, devices, ts, ngl)


def _override_list(events: Sequence[Event], raw_ot: Sequence[tuple[Event, str, str]], inv: ModelInventory,
                   spec: DialectSpec, table: ToolTable, n_devices: int, warnings: list[str],
                   spread: Callable[[int], list[int]] | None = None) -> list[Override]:
    """llama.cpp's first-match list: -ot entries and -cmoe/-ncmoe/-ncffn expansions where the dialect puts them.

    `spread(N)` (ik, several GPUs): the blocks whose experts -ncmoe N moves, instead of the one-GPU rule."""
    rule = table.moe
    overrides: list[Override] = []
    after: list[Override] = []
    ncmoe_last: int | None = None
    first_ot_pos = min((e.pos for e, _, _ in raw_ot if e.pos >= 0), default=None)
    for e in sorted(events, key=lambda e: e.pos):       # environment (pos -1) first, as llama.cpp applies it
        if e.key == "ot":
            origin = e.spelling if e.pos >= 0 else "LLAMA_ARG_OVERRIDE_TENSOR"
            overrides.extend(Override(p, b, origin) for ev, p, b in raw_ot if ev is e)
            continue
        if e.key not in ("cmoe", "ncmoe", "ncffn"):
            continue
        if rule is None:
            raise FlagError(f"{e.spelling} is not a {table.binary} flag")
        if e.key != "cmoe" and e.value < 0:
            raise FlagError(f"{e.spelling} {e.value}: must be >= 0")
        if e.key == "ncffn" and rule.ncffn_template is not None:
            overrides.extend(Override(rule.ncffn_template.format(i=i), "CPU", f"-ncffn {e.value}")
                             for i in range(min(e.value, inv.hparams.n_layer)))
            continue
        if rule.placement == "after_user" and first_ot_pos is not None and 0 <= e.pos < first_ot_pos:
            warnings.append(f"W019 {e.spelling} before -ot: {spec.name} {table.binary} applies it after every -ot "
                            "override, whatever the order on the command line")
        kind, count = ("cmoe", 0) if e.key == "cmoe" else ("ncmoe", int(e.value))
        if rule.accumulate:
            (overrides if rule.placement == "cmdline" else after).extend(expand_moe(rule, kind, count, inv))
        else:
            ncmoe_last = ALL_LAYERS if kind == "cmoe" else count
    if rule is not None and ncmoe_last is not None:
        if spread is not None and 0 < ncmoe_last < inv.hparams.n_layer:
            after.extend(Override(rule.ncmoe_template.format(i=i), "CPU", f"-ncmoe {ncmoe_last}")
                         for i in spread(ncmoe_last))
        else:
            after.extend(expand_moe(rule, "cmoe", 0, inv) if ncmoe_last >= ALL_LAYERS
                         else expand_moe(rule, "ncmoe", ncmoe_last, inv))
    return overrides + after


def _match_warnings(overrides: Sequence[Override], res: MatchResult, rule: MoeRule | None,
                    assignment: Mapping[str, str], warnings: list[str]) -> None:
    for idx, ov in enumerate(overrides):
        if ov.origin.startswith(("-ncmoe", "-ncffn")) or (ov.origin == "-cmoe" and rule and rule.cmoe_pattern is None):
            continue     # per-layer expansions that match nothing (dense layers) are expected
        if not res.matched[idx]:
            warnings.append(f"W001 pattern '{ov.pattern}' ({ov.origin}) matches no tensor")
        elif not any(res.first.get(nm) == idx for nm in res.matched[idx]):
            warnings.append(f"W002 pattern '{ov.pattern}' ({ov.origin}) is shadowed entirely by earlier "
                            "overrides (the first match wins)")
    te = assignment.get("token_embd.weight")
    if te is not None and te != "CPU":
        warnings.append(f"W007 token_embd.weight overridden to {te}: llama.cpp keeps the input layer on the CPU "
                        "by default; the embedding lookup gains little on a GPU and costs VRAM")


FIT_TARGET_MIB = 1024       # mainline's -fitt default: free memory --fit keeps on each device


def _fit_of(settings: Mapping[str, Any], events: Sequence[Event], table: ToolTable) -> tuple[bool, tuple[int, ...]]:
    """(whether --fit would move experts: on, and no -ot/-cmoe/-ncmoe given; the MiB it keeps free per device)."""
    on = bool(settings.get("fit", table.defaults.get("fit", False))) or "fitt" in settings
    given = any(e.key in ("ot", "cmoe", "ncmoe") for e in events)
    try:
        target = tuple(int(x) for x in str(settings["fitt"]).split(",")) if "fitt" in settings else (FIT_TARGET_MIB,)
    except ValueError:
        target = (FIT_TARGET_MIB,)
    return on and not given, target


def _fit_warning(settings: Mapping[str, Any], events: Sequence[Event], spec: DialectSpec, table: ToolTable,
                 n_devices: int, warnings: list[str]) -> None:
    if not (settings.get("fit", table.defaults.get("fit", False)) or "fitt" in settings):
        return
    unset = [f for f, k in (("-c", "ctx"), ("-ngl", "ngl")) if k not in settings and k in table.keys()]  # noqa: SIM118 (a ToolTable, not a dict)
    if n_devices > 1 and "ts" not in settings:
        unset.append("-ts")
    if not any(e.key in ("ot", "cmoe", "ncmoe") for e in events):
        unset.append("-ot/-cmoe/-ncmoe")
    how = " (the default; add -fit off)" if "fit" not in settings and "fitt" not in settings else ""
    if unset:
        warnings.append(f"W009 fitting to device memory is on{how}: {spec.name} may change {', '.join(unset)}; "
                        "explained as written")


def _ik_build(opts: Mapping[str, Any]) -> Build:
    return opts.get("build") or PINNED["ik"]


def ik_layout(lay: _Layout, settings: Mapping[str, Any], knobs: Knobs, inv: ModelInventory, table: ToolTable,
              opts: Mapping[str, Any], warnings: list[str]
              ) -> tuple[_Layout, list[str], Callable[[int], list[int]] | None]:
    """ik's -ngl (999 by default with a GPU, 0 without one), its byte-based -ts split and its -ncmoe spread."""
    build = _ik_build(opts)
    n_layer = inv.hparams.n_layer
    ngl = lay.n_gpu_layers
    if not lay.devices:
        ngl = 0
    elif ngl < 0:
        ngl = 999 if build.has(Feature.NGL_AUTO) else 0
    lay = dataclasses.replace(lay, n_gpu_layers=ngl)
    layer_split = settings.get("sm", "layer") == "layer"
    if len(lay.devices) > 1 and layer_split and build.has(Feature.TS_BY_LAYER_BYTES):
        sizes, max_compute = ik_split.layer_sizes(inv, ik_split.SizeParams.of(knobs, table.tool, "ctx" in settings))
        slots = ik_split.split_slots(n_layer, ngl, lay.devices, lay.tensor_split, sizes, max_compute)
    else:
        slots = slot_devices(n_layer, ngl, "last_blocks", lay.devices, lay.tensor_split)
    spread = None
    if table.tool != "bench" and len(lay.devices) > 1 and layer_split and build.has(Feature.TS_BY_LAYER_BYTES):
        dd = ik_split.default_devices(slots, lay.devices)
        spread = lambda n: ik_split.ncmoe_spread(n, dd, len(lay.devices))   # noqa: E731
    return lay, slots, spread


def interpret(events: Sequence[Event], env: Mapping[str, str], inv: ModelInventory, spec: DialectSpec,
              table: ToolTable, warnings: list[str], n_gpus: int | None, opts: Mapping[str, Any]) -> ParsedCommand:
    """Placement and knobs of a command line, the way llama.cpp would read it."""
    n_layer = inv.hparams.n_layer
    settings = _last(events)
    if table.strict:
        counts: dict[str, int] = {}
        for e in events:
            if e.pos >= 0 and e.key not in LIST_KEYS:
                counts[e.key] = counts.get(e.key, 0) + 1
        warnings.extend(f"W010 {key} given {c} times: llama.cpp uses the last value ({settings[key]!r}) and prints "
                        "a DEPRECATED warning" for key, c in counts.items() if c > 1)
    raw_ot = [(e, pat, buft) for e in events if e.key == "ot"
              for pat, buft in _split_overrides(e.value, table, e.spelling, warnings)]
    lay = _layout(settings, env, [b for _, _, b in raw_ot], spec, table, n_layer, n_gpus, warnings)
    knobs = _knobs(settings, events, env, inv, spec, table, warnings, opts)
    if spec.name == "ik":
        lay, slots, spread = ik_layout(lay, settings, knobs, inv, table, opts, warnings)
    else:
        slots, spread = slot_devices(n_layer, lay.n_gpu_layers, spec.slot_rule, lay.devices, lay.tensor_split), None
    overrides = _override_list(events, raw_ot, inv, spec, table, len(lay.devices), warnings, spread)
    if spec.name == "ik" and lay.n_gpu_layers == 0 and overrides and _ik_build(opts).has(Feature.NGL_AUTO):
        warnings.append("W027 ik with -ngl 0 (or no GPU) drops every -ot and -ncmoe (src/llama.cpp "
                        "llama_model_load_from_file, since ik PR 2209): every tensor stays in RAM")
        overrides = []
    assignment, res = apply_overrides(base_assignment(inv, slots), overrides, allocated_names(inv))
    _match_warnings(overrides, res, table.moe, assignment, warnings)
    output_copy = None
    if inv.tied_output and "token_embd.weight" in assignment:
        # the duplicate token_embd (the output) is matched by name too, so it follows token_embd's override;
        # without one it goes where the output layer goes (llama-model-loader.cpp buft_for_tensor)
        first = res.first.get("token_embd.weight")
        output_copy = overrides[first].device if first is not None else slots[n_layer]
    _fit_warning(settings, events, spec, table, len(lay.devices), warnings)
    fit = _fit_of(settings, events, table) if "fit" in table.keys() else (False, ())  # noqa: SIM118 (a ToolTable)
    warnings.extend(spec.placement_notes(assignment, knobs, inv))
    workload: dict[str, int] = {}
    if table.tool == "bench":
        d = table.defaults
        workload = {"n_prompt": int(settings.get("n_prompt", d["n_prompt"])),
                    "n_gen": int(settings.get("n_gen", d["n_gen"])),
                    "n_depth": int(settings.get("depth", d.get("depth", 0)))}
        if "reps" in settings:      # given; else the caller's own default (`run`'s is not llama-bench's 5)
            workload["repetitions"] = int(settings["reps"])
    return ParsedCommand(
        assignment=assignment, knobs=knobs, warnings=tuple(warnings), overrides=tuple(overrides),
        dialect=spec.name, tool=table.tool, n_gpu_layers=lay.n_gpu_layers, tensor_split=lay.tensor_split,
        layer_devices=tuple(slots), n_gpus=lay.n_gpus, output_copy_device=output_copy, env=dict(env),
        workload=workload, fit_moves_experts=fit[0], fit_target_mib=fit[1])


def _knobs(settings: Mapping[str, Any], events: Sequence[Event], env: Mapping[str, str], inv: ModelInventory,
           spec: DialectSpec, table: ToolTable, warnings: list[str], opts: Mapping[str, Any]) -> Knobs:
    d = table.defaults
    keys = table.keys()
    base = Knobs()
    vals: dict[str, Any] = {}
    for key, (fname, negated) in KNOB_KEYS.items():
        if key not in keys:
            continue
        v = settings.get(key, d.get(key, getattr(base, fname) if not negated else not getattr(base, fname)))
        vals[fname] = (not v) if negated else v
    if table.tool != "bench":
        ctx = settings.get("ctx", d.get("ctx"))
        if ctx is not None and ctx < 0:
            raise FlagError(f"-c {ctx}: llama.cpp stores the context as an unsigned count ({ctx % UINT32} tokens) "
                            "and cannot allocate that KV cache; give -c 0 (the model's training context) or a size")
        if ctx is None or ctx == 0:
            if "ctx" not in settings:
                warnings.append(f"W014 no -c: the context is the model's training context ({inv.hparams.n_ctx_train}); "
                                "say -c N")
            ctx = inv.hparams.n_ctx_train
        elif ctx > inv.hparams.n_ctx_train:
            warnings.append(f"W029 -c {ctx} is more than the model's training context ({inv.hparams.n_ctx_train}): "
                            "llama.cpp warns of a possible context overflow; quality may suffer")
        vals["n_ctx"] = int(ctx)
        n_seq = int(vals.get("n_seq", 1))
        if n_seq < 0:
            n_seq = 4
            warnings.append("W020 -np auto: llama-server uses 4 slots sharing one KV pool (-kvu); say -np 1")
        elif "np" not in settings and table.tool == "server" and spec.name == "mainline":
            warnings.append("W020 no -np: llama-server uses 4 slots sharing one KV pool (-kvu); say -np 1")
        if n_seq == 0:
            raise FlagError("-np 0: llama-server needs at least one slot")
        vals["n_seq"] = n_seq
    else:
        wl_ctx = int(settings.get("n_prompt", d["n_prompt"])) + int(settings.get("n_gen", d["n_gen"])) \
            + int(settings.get("depth", d.get("depth", 0)))
        vals["n_ctx"] = wl_ctx
    if vals.get("flash_attn", True) is None:
        warnings.append("W015 -fa auto: assumed on (llama.cpp enables flash attention where the backend supports it)")
        vals["flash_attn"] = True
    if "n_threads" in vals and vals["n_threads"] <= 0:
        vals["n_threads"] = 0
    for fname in ("type_k", "type_v"):
        if fname in vals and vals[fname] not in table.kv_types:
            raise FlagError(f"KV cache type {vals[fname]!r} ({fname}) is not one {table.dialect} {table.binary} "
                            f"accepts or we model; valid: {', '.join(table.kv_types)}")
    if vals.get("flash_attn") is False and vals.get("type_v", "f16") not in FULL_PRECISION_KV:
        raise FlagError(f"-fa off with a quantized V cache ({vals['type_v']}): {table.dialect} {table.binary} refuses "
                        "to create the context (a quantized V cache needs flash attention)")
    if vals.get("rtr"):
        vals["mmap"] = False     # ik: -rtr repacks at load time and turns mmap off
    amb = vals.get("amb", 0)
    if table.dialect == "ik" and table.tool != "bench" and 0 < amb < 128:
        warnings.append(f"W021 -amb {amb}: ik raises values below 128 to 128")
        vals["amb"] = 128
    if vals.get("no_kv_offload"):
        warnings.append("W004 -nkvo: the whole KV cache stays in host memory; attention runs on the CPU side")
    nb, nub = _batch_semantics(vals, table, warnings)
    if nub > nb:
        warnings.append(f"W005 -ub {nub} > -b {nb}: llama.cpp runs with ubatch {nb} (the smaller)")
    policy, ooae = spec.parse_policy(settings, events, env, table, warnings, opts)
    vals["offload"] = policy
    vals["only_active_experts"] = ooae
    return dataclasses.replace(base, **vals)


def _batch_semantics(vals: dict[str, Any], table: ToolTable, warnings: list[str]) -> tuple[int, int]:
    """-b / -ub as llama.cpp runs them (mainline src/llama-context.cpp, ik src/llama.cpp llama_new_context):
    both zero is refused; values are cast to uint32 (a negative one becomes huge); n_batch = min(n_ctx, -b)
    (ik raises it to 16); -ub 0 means -ub = -b; n_ubatch = min(n_batch, -ub). Stores the values that run."""
    base = Knobs()
    nb, nub = int(vals.get("n_batch", base.n_batch)), int(vals.get("n_ubatch", base.n_ubatch))
    if nb == 0 and nub == 0:
        raise FlagError("-b 0 with -ub 0: llama.cpp refuses the context (n_batch and n_ubatch cannot both be zero)")
    if table.int_ranges and (nb < 0 or nub < 0):
        raise FlagError(f"{'-b' if nb < 0 else '-ub'} {nb if nb < 0 else nub}: llama-bench refuses a negative value "
                        "(invalid range format)")
    ctx = int(vals.get("n_ctx", base.n_ctx))
    nb_run = min(ctx, nb % UINT32)
    raised = table.dialect == "ik" and 0 <= nb < IK_MIN_BATCH
    if raised:
        warnings.append(f"W028 -b {nb}: ik runs with n_batch {IK_MIN_BATCH} (its minimum)")
        nb_run = IK_MIN_BATCH
    if nb_run == 0:
        raise FlagError(f"-b {nb}: mainline llama.cpp would run with n_batch 0 and n_ubatch 0 and cannot decode; "
                        "give -b >= 1")
    if nb < 0:
        warnings.append(f"W028 -b {nb}: llama.cpp reads it as {nb % UINT32} (unsigned) and runs with n_batch = "
                        f"n_ctx ({nb_run})")
    nub_run = min(nb_run, (nb % UINT32) if nub == 0 else nub % UINT32)
    if nub <= 0:
        why = "-ub 0 means -ub = -b" if nub == 0 else f"it is read as {nub % UINT32} (unsigned)"
        warnings.append(f"W028 -ub {nub}: {why}; llama.cpp runs with n_ubatch {nub_run}")
    if nb <= 0 or raised:
        vals["n_batch"] = nb_run
    if nub <= 0:
        vals["n_ubatch"] = nub_run
    return vals.get("n_batch", nb), vals.get("n_ubatch", nub)


# ---- rendering ---------------------------------------------------------------------------------------------

def _moe_candidates(rule: MoeRule | None, table: ToolTable, inv: ModelInventory,
                    spread_of: Callable[[Sequence[str]], Callable[[int], list[int]] | None]
                    ) -> Callable[[Mapping[str, str], placement.ModelIndex, Sequence[str]], list[tuple[str, int]]]:
    """The tool's -ncmoe N (largest exact N) and -cmoe, when their expansion only moves tensors the plan has on
    the CPU; the solver keeps whichever renders shortest. `spread_of(slots)`: ik's several-GPU -ncmoe rule."""
    def candidates(assignment: Mapping[str, str], idx: placement.ModelIndex, slots: Sequence[str]
                   ) -> list[tuple[str, int]]:
        moe_layers = list(idx.moe_layers)
        if rule is None or not moe_layers:
            return []
        spread = spread_of(slots)
        if spread is not None:
            return _spread_candidates(rule, assignment, idx, spread)
        if rule.order == "first_layers":
            order = list(range(inv.hparams.n_layer))
        else:
            order = list(reversed(moe_layers))
        n = placement.clean_moe_prefix(assignment, idx, order,
                                       lambda i: Override(rule.ncmoe_template.format(i=i), "CPU"))
        out: list[tuple[str, int]] = []
        if n > 0:
            # mainline counts layer indices (leading dense layers included); trim to the last MoE layer covered
            if rule.order == "first_layers":
                moe = [i for i in moe_layers if i < n]
                n = moe[-1] + 1 if moe else 0
            if n > 0:
                out.append(("ncmoe", n))
        has_cmoe = any(f.key == "cmoe" for f in table.flags)
        if has_cmoe and n >= (moe_layers[-1] + 1 if rule.order == "first_layers" else len(moe_layers)):
            out.append(("cmoe", 0))
        elif has_cmoe and rule.cmoe_pattern is not None:
            cm = expand_moe(rule, "cmoe", 0, inv)
            _, res = apply_overrides({nm: "CPU" for nm in assignment}, cm, idx.names)
            if all(assignment[x] == "CPU" for x in res.matched[0]):
                out.append(("cmoe", 0))
        return out
    return candidates


# What ik users write to keep every routed expert in RAM (the exceptions that stay on a GPU go before it).
IK_EXPS_CATCH_ALL = Override("exps", "CPU")


def _spread_candidates(rule: MoeRule, assignment: Mapping[str, str], idx: placement.ModelIndex,
                       spread: Callable[[int], list[int]]) -> list[tuple[str, int]]:
    """ik, several GPUs: the largest -ncmoe N whose spread only moves experts the plan has in RAM."""
    best = 0
    for n in range(1, idx.n_layer):
        ovs = [Override(rule.ncmoe_template.format(i=i), "CPU") for i in spread(n)]
        res = placement.match_overrides(idx.names, ovs)
        if any(assignment[x] != "CPU" for hits in res.matched for x in hits):
            break
        best = n
    return [("ncmoe", best)] if best else []


def _ik_spread_of(spec: DialectSpec, table: ToolTable, plan_devices: Sequence[str], opts: Mapping[str, Any]
                  ) -> Callable[[Sequence[str]], Callable[[int], list[int]] | None]:
    gpus = [gpu_index(d) for d in set(plan_devices) if is_gpu(d)]
    n_gpus = max(gpus) + 1 if gpus else 0      # what the parser infers from -ts and the -ot names

    def spread_of(slots: Sequence[str]) -> Callable[[int], list[int]] | None:
        if spec.name != "ik" or table.tool == "bench" or n_gpus < 2 or not any(is_gpu(s) for s in slots) \
                or not _ik_build(opts).has(Feature.TS_BY_LAYER_BYTES):
            return None
        devices = [f"CUDA{i}" for i in range(n_gpus)]
        dd = ik_split.default_devices(slots, devices)
        return lambda n: ik_split.ncmoe_spread(n, dd, len(devices))
    return spread_of


def _ts_text(pf: placement.PlacementFlags, plan: Plan, inv: ModelInventory, spec: DialectSpec, table: ToolTable,
             opts: Mapping[str, Any]) -> str:
    """-ts for the layer counts the solver chose: the counts themselves, or for ik (bytes) the proportions that
    make ik's byte split give the same counts."""
    counts = pf.tensor_split or ()
    if spec.name != "ik" or not _ik_build(opts).has(Feature.TS_BY_LAYER_BYTES):
        return table.ts_sep.join(str(c) for c in counts)
    sizes, mc = ik_split.layer_sizes(inv, ik_split.SizeParams.of(plan.knobs, table.tool))
    props = ik_split.tensor_split_for(counts, inv.hparams.n_layer, pf.n_gpu_layers, sizes, mc)
    return table.ts_sep.join(str(int(p)) for p in props)


def render_plan(plan: Plan, inv: ModelInventory, spec: DialectSpec, tool: str, *, opts: Mapping[str, Any],
                workload: WorkloadLike | None = None, model_path: str | None = None,
                parse_back: Callable[[RenderedCommand], ParsedCommand]) -> RenderedCommand:
    """argv + env for `plan` (placement from placement.solve, knobs from the tables), verified by parse_back."""
    if tool not in spec.tools:
        raise FlagError(f"unknown tool {tool!r}; expected one of {', '.join(spec.tools)}")
    table = spec.tools[tool]
    rule = table.moe
    notes: list[str] = []
    spread_of = _ik_spread_of(spec, table, list(plan.assignment.values()), opts)

    def expand(kind: str, n: int, slots: Sequence[str]) -> list[Override]:
        spread = spread_of(slots)
        if rule is not None and spread is not None and kind == "ncmoe":
            return [Override(rule.ncmoe_template.format(i=i), "CPU", f"-ncmoe {n}") for i in spread(n)]
        return expand_moe(rule, kind, n, inv) if rule else []
    ngl0_drops = spec.name == "ik" and _ik_build(opts).has(Feature.NGL_AUTO)
    pf = placement.solve(plan.assignment, inv, spec.slot_rule, _moe_candidates(rule, table, inv, spread_of),
                         expand, no_ngl0_with_gpu=ngl0_drops,
                         catch_all=IK_EXPS_CATCH_ALL if spec.name == "ik" else None)
    notes.extend(pf.notes)
    settings: list[tuple[str, Any]] = []
    if model_path:
        settings.append(("model", model_path))
    if tool == "bench":
        wl = workload
        n_prompt = getattr(wl, "n_prompt", table.defaults["n_prompt"])
        n_gen = getattr(wl, "n_gen", table.defaults["n_gen"])
        depth = getattr(wl, "depth", getattr(wl, "n_depth", 0)) or 0
        reps = getattr(wl, "repetitions", None)
        settings += [("n_prompt", n_prompt), ("n_gen", n_gen)]
        if depth:
            if "depth" not in table.keys():  # noqa: SIM118 (a ToolTable, not a dict)
                raise FlagError(f"{spec.name} {table.binary} has no -d (context depth {depth}); use "
                                "llama-sweep-bench or the server")
            settings.append(("depth", depth))
        if reps is not None:
            settings.append(("reps", reps))
    settings.append(("ngl", pf.n_gpu_layers))
    if pf.tensor_split is not None:
        settings.append(("ts", _ts_text(pf, plan, inv, spec, table, opts)))
    if pf.overrides:
        settings.append(("ot", table.ot_sep.join(o.text() for o in pf.overrides)))
    if pf.moe is not None:
        settings.append(("cmoe", True) if pf.moe[0] == "cmoe" else ("ncmoe", pf.moe[1]))
    if spec.name == "mainline" and tool != "bench":
        settings.append(("fit", False))
    settings += knob_settings(plan.knobs, table, notes, mla_model=inv.hparams.is_mla)
    pol, env = spec.render_policy(plan.knobs, table, inv, opts)
    settings += pol
    notes.extend(spec.placement_notes(plan.assignment, plan.knobs, inv))
    rc = RenderedCommand(spell(settings, table), env, spec.name, tool, table.binary, notes)
    verify(rc, plan, inv, spec, tool, parse_back)
    return rc


def verify(rc: RenderedCommand, plan: Plan, inv: ModelInventory, spec: DialectSpec, tool: str,
           parse_back: Callable[[RenderedCommand], ParsedCommand]) -> None:
    """Parse the rendered command with our own matcher; raise unless it reproduces the plan exactly."""
    back = parse_back(rc)
    diff = [n for n, dev in plan.assignment.items() if back.assignment.get(n) != dev]
    if diff:
        n = diff[0]
        raise FlagError(f"internal error: the rendered flags would put {len(diff)} tensors elsewhere than the plan "
                        f"(e.g. {n}: plan {plan.assignment[n]}, flags {back.assignment.get(n)}); not emitting them")
    for fname in sorted(knob_fields(spec, tool) - spec.tools[tool].ignored_knobs
                        - moot_knobs(plan.knobs, inv.hparams.is_mla)):
        if getattr(back.knobs, fname) != getattr(plan.knobs, fname):
            raise FlagError(f"internal error: the rendered flags set {fname}={getattr(back.knobs, fname)!r}, the plan "
                            f"says {getattr(plan.knobs, fname)!r}; not emitting them")
