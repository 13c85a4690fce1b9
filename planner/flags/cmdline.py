"""Table-driven reading and writing of llama.cpp command lines; the dialect modules supply the tables.

A `ToolTable` (one per dialect and tool) lists the flags that matter for placement and knobs (`Flag`: canonical
key, spellings, value style), every other spelling the tool accepts with its number of values, separators and
the values llama.cpp uses when a flag is absent. `walk` turns argv into typed `Event`s; `spell` turns settings
back into argv; `expand_moe` turns -cmoe/-ncmoe into overrides. Between events and a Plan, shared by both
dialects: flags/interpret.py (events -> ParsedCommand) and flags/render.py (Plan -> RenderedCommand).
"""
from __future__ import annotations

import dataclasses
import re
import shlex
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal, Protocol
from collections.abc import Callable, Mapping, Sequence

from ..builds import PINNED, Build, Spelling
from ..errors import FlagError
from ..model import ModelInventory
from ..plan import FULL_PRECISION_KV, Knobs, OffloadPolicy, Plan
from .common import Override, SlotRule, memo, shell_join

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
    "W030": "pattern shadowed in part by earlier overrides",
    "W101": "layer homes not expressible", "W102": "token_embd on a GPU", "W103": "knob not expressible in bench",
    "W104": "host RAM short: weights read from disk",
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
    since: Spelling | None = None        # the planner/builds.py FLAGS row that says which builds have it


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
    build: Build | None = None           # the build the table is for (None: the pinned one)
    lacks: Mapping[str, str] = field(default_factory=dict)   # setting key -> why this build has no flag for it

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


class BenchLike(Protocol):
    """What llama-bench needs of a bench run (planner.engine_contract.BenchRun fits; depth and repetitions optional)."""
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
    bench: dict[str, int] = field(default_factory=dict)   # llama-bench: n_prompt, n_gen, n_depth (, repetitions)
    # mainline's --fit (on by default in the server) with no expert overrides given: it would move experts to RAM
    # until each GPU keeps fit_target_mib free (-fitt; 1024 MiB by default; docs/llamacpp.md section 7)
    fit_moves_experts: bool = False
    fit_target_mib: tuple[int, ...] = ()
    cache_ram_mib: int | None = None     # --cache-ram as given (llama-server's prompt cache, MiB; None: not given)

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


class FlagHints(Protocol):
    """What to tell a user whose flag the tool does not read (flags/hints.py): '' when there is nothing to add."""
    def unknown(self, name: str) -> str: ...
    def bad_value(self, name: str, value: str | None) -> str: ...   # None: the flag ended the command line; a
    # word after a switch: the value form of a later build


def _value_hint(flag: Flag, name: str, value: str | None, hints: FlagHints | None) -> str:
    """A hint when a flag that takes a value got none, or got the next flag (an old build's bare switch)."""
    if hints is None or flag.style != "choice" or flag.choices is None:
        return ""
    if value is not None and (not value.startswith("-") or (value.lower() if flag.icase else value) in flag.choices):
        return ""
    return hints.bad_value(name, value)


def walk(argv: Sequence[str], table: ToolTable, warnings: list[str], hints: FlagHints | None = None) -> list[Event]:
    """Typed events for the flags in `table`; other known flags skipped; unknown ones rejected (or warned), with
    what to write instead where `hints` knows it."""
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
                hint = (hints.bad_value(name, argv[i])
                        if hints is not None and i < len(argv) and not argv[i].startswith("-") else "")
                if hint:                 # -fa on for a build whose -fa is a bare switch
                    raise FlagError(hint)
                events.append(Event(flag.key, flag.const, name, len(events)))
                continue
            if inline is None:
                hint = _value_hint(flag, name, argv[i] if i < len(argv) else None, hints)
                if hint:
                    raise FlagError(hint)
                if i >= len(argv):
                    raise FlagError(f"{name} expects a value ({table.binary})")
                inline = argv[i]
                i += 1
            events.append(Event(flag.key, _convert(flag, inline, table, name, warnings), name, len(events)))
            continue
        n_values = table.known.get(name)
        if n_values is None:
            hint = hints.unknown(name) if hints is not None else ""
            if table.strict:
                raise FlagError(f"unknown flag {name!r}: {table.dialect} {table.binary} would reject it"
                                + (f"; {hint}" if hint else ""))
            takes = i < len(argv) and not argv[i].startswith("-") and inline is None
            warnings.append(f"W024 flag {name!r} is not in our {table.dialect} {table.binary} table; ignored"
                            + (f" with its value {argv[i]!r}" if takes else "") + (f"; {hint}" if hint else ""))
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
            if key in table.lacks:      # a flag this build does not have: fine while the build's own way holds
                if fname not in moot and setting != table.defaults.get(key, setting):
                    raise FlagError(f"{table.lacks[key]}, so {table.binary} cannot set {fname}={value!r}")
                continue
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


# ---- -cmoe / -ncmoe as overrides ------------------------------------------------------------------------

ALL_LAYERS = 1 << 30     # ik: -cmoe is -ncmoe with "every" MoE layer (it sets ncmoe = 999)


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


def for_build(table: ToolTable, build: Build, old: Sequence[Flag] = (), absent: Mapping[str, Any] | None = None,
              defaults: Mapping[str, Any] | None = None) -> ToolTable:
    """`table` as `build` reads it: the flags it accepts (each Flag's `since` row in planner/builds.py FLAGS), the
    spellings of earlier builds in `old` that it still accepts (after the current ones, so the current spelling is
    written), a setting whose flags it lacks at its `absent` value (what the build does without the flag), and
    a switch (bare -fa) written only when it changes something."""
    keep = [f for f in (*table.flags, *old) if f.since is None or build.accepts(f.since)]
    kept_keys = {f.key for f in keep}
    kept_spellings = {s for f in keep for s in f.spellings}
    gone = {s for f in (*table.flags, *old) for s in f.spellings} - kept_spellings
    lacks = {f.key: build.lacks(f.since) for f in table.flags
             if f.key not in kept_keys and f.since is not None}
    new_defaults = {**table.defaults, **(defaults or {})}
    new_defaults.update({k: v for k, v in (absent or {}).items() if k in lacks})
    always = frozenset(k for k in table.always if any(f.key == k and f.style != "switch" for f in keep))
    known = {s: n for s, n in table.known.items() if s not in gone}
    return dataclasses.replace(table, flags=tuple(keep), known=known, always=always, defaults=new_defaults,
                               build=build, lacks=lacks)


def ik_build(opts: Mapping[str, Any]) -> Build:
    """The ik build the options name (the pinned one by default): which flags it has and what they do."""
    return opts.get("build") or PINNED["ik"]
