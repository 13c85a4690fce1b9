"""A command line's events read the way llama.cpp reads them: placement, knobs and warnings (a ParsedCommand).

`interpret` is shared by both dialects; the dialect's tables (flags/mainline.py, flags/ik.py) say what differs.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Mapping, Sequence

from ..builds import Feature
from ..errors import FlagError
from ..model import ModelInventory
from ..plan import FULL_PRECISION_KV, Knobs
from . import ik_split
from .cmdline import (
    ALL_LAYERS, KNOB_KEYS, DialectSpec, Event, MoeRule, ParsedCommand, ToolTable, expand_moe, ik_build,
)
from .common import (
    MatchResult, Override, allocated_names, apply_overrides, base_assignment, check_buft, gpu_index,
    gpu_slot_window, is_gpu, slot_devices,
)


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


UINT32 = 1 << 32            # llama.cpp casts -c, -b and -ub to uint32_t
IK_MIN_BATCH = 16            # ik src/llama.cpp: n_batch < GGML_KQ_MASK_PAD (16) is raised to it
LIST_KEYS = frozenset({"ot", "ncmoe", "cmoe", "ncffn", "op"})   # flags that add up instead of replacing

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


# What a split mode other than layer does in the pinned builds (docs/llamacpp.md section 14, docs/ik_llama.md)
_SPLIT_MODE_NOTES = {
    ("mainline", "row"): "the pinned llama.cpp's CUDA backend has no split buffers and refuses to load the model "
                         "(\"device CUDA0 does not support split buffers\", measured on 2x H200); ",
    ("mainline", "tensor"): "tensor parallelism over the GPUs (flash attention on; --fit does not fit it; no op "
                            "offload, so experts in RAM compute the whole prompt on the CPU: PP 0.07x -sm layer, "
                            "measured on 2x H200); ",
    ("ik", "graph"): "tensor parallelism: every GPU holds a slice of each layer, experts overridden to RAM stay "
                     "whole, an -ot turns the graph scheduler off unless -smgs, and -ncmoe N puts the last N layers' "
                     "experts in RAM (PP and TG 0.84-0.86x -sm layer, measured on 2x H200); ",
}


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
        warnings.append(f"W013 -sm {sm}: {_SPLIT_MODE_NOTES.get((spec.name, sm), '')}placement is explained as the "
                        "layer split (-sm layer)")
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


def _taken_by_broader(overrides: Sequence[Override], res: MatchResult, idx: int) -> list[str]:
    """The tensors pattern IDX matches that an earlier, broader pattern (one matching more tensors) places on
    another device: llama.cpp places each tensor by the first pattern it matches, so a narrow exception written
    after the rule it excepts from never applies. The usual idiom, exceptions first and the catch-all (`exps=CPU`)
    last, shadows the catch-all in part by design and is not reported."""
    mine = overrides[idx]
    return sorted(nm for nm in res.matched[idx]
                  if (j := res.first.get(nm, idx)) != idx and overrides[j].device != mine.device
                  and len(res.matched[j]) > len(res.matched[idx]))


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
        elif ov.origin == "-ot" and (taken := _taken_by_broader(overrides, res, idx)):
            warnings.append(f"W030 pattern '{ov.pattern}' ({ov.origin}) is shadowed in part: {len(taken)} of the "
                            f"{len(res.matched[idx])} tensors it sends to {ov.device} go where a broader earlier "
                            f"override says (the first match wins), e.g. {taken[0]}; put the narrower -ot first")
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


def ik_layout(lay: _Layout, settings: Mapping[str, Any], knobs: Knobs, inv: ModelInventory, table: ToolTable,
              opts: Mapping[str, Any], warnings: list[str]
              ) -> tuple[_Layout, list[str], Callable[[int], list[int]] | None]:
    """ik's -ngl (999 by default with a GPU, 0 without one), its byte-based -ts split and its -ncmoe spread."""
    build = ik_build(opts)
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
    if spec.name == "ik" and lay.n_gpu_layers == 0 and overrides and ik_build(opts).has(Feature.NGL_AUTO):
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
    bench: dict[str, int] = {}
    if table.tool == "bench":
        d = table.defaults
        bench = {"n_prompt": int(settings.get("n_prompt", d["n_prompt"])),
                    "n_gen": int(settings.get("n_gen", d["n_gen"])),
                    "n_depth": int(settings.get("depth", d.get("depth", 0)))}
        if "reps" in settings:      # given; else the caller's own default (`run`'s is not llama-bench's 5)
            bench["repetitions"] = int(settings["reps"])
    return ParsedCommand(
        assignment=assignment, knobs=knobs, warnings=tuple(warnings), overrides=tuple(overrides),
        dialect=spec.name, tool=table.tool, n_gpu_layers=lay.n_gpu_layers, tensor_split=lay.tensor_split,
        layer_devices=tuple(slots), n_gpus=lay.n_gpus, output_copy_device=output_copy, env=dict(env),
        bench=bench, fit_moves_experts=fit[0], fit_target_mib=fit[1],
        cache_ram_mib=int(settings["cache_ram"]) if "cache_ram" in settings else None)


def _knobs(settings: Mapping[str, Any], events: Sequence[Event], env: Mapping[str, str], inv: ModelInventory,
           spec: DialectSpec, table: ToolTable, warnings: list[str], opts: Mapping[str, Any]) -> Knobs:
    d = table.defaults
    keys = table.keys()
    base = Knobs()
    vals: dict[str, Any] = {}
    for key, (fname, negated) in KNOB_KEYS.items():
        if key not in keys and key not in table.lacks:
            continue     # a build without the flag runs as its table's default says (e.g. no MLA before -mla)
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
        wl_ctx = (int(settings.get("n_prompt", d["n_prompt"])) + int(settings.get("n_gen", d["n_gen"]))
                  + int(settings.get("depth", d.get("depth", 0))))
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
