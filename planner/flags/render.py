"""A Plan as a command line: placement flags from flags/placement.py's solver, knobs from the tables, and the
result verified by parsing it back (a RenderedCommand that does not reproduce the plan is never emitted).
"""
from __future__ import annotations

from typing import Any
from collections.abc import Callable, Mapping, Sequence

from ..builds import Feature
from ..errors import FlagError
from ..model import ModelInventory
from ..plan import Plan
from . import ik_split, placement
from .cmdline import (
    DialectSpec, MoeRule, ParsedCommand, RenderedCommand, ToolTable, BenchLike, expand_moe, ik_build,
    knob_fields, knob_settings, moot_knobs, spell,
)
from .common import Override, apply_overrides, gpu_index, is_gpu


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
        if n > 0 and "ncmoe" in table.keys():  # noqa: SIM118 (a ToolTable, not a dict)
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
        if (spec.name != "ik" or table.tool == "bench" or n_gpus < 2 or not any(is_gpu(s) for s in slots)
                or not ik_build(opts).has(Feature.TS_BY_LAYER_BYTES)):
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
    if spec.name != "ik" or not ik_build(opts).has(Feature.TS_BY_LAYER_BYTES):
        return table.ts_sep.join(str(c) for c in counts)
    sizes, mc = ik_split.layer_sizes(inv, ik_split.SizeParams.of(plan.knobs, table.tool))
    props = ik_split.tensor_split_for(counts, inv.hparams.n_layer, pf.n_gpu_layers, sizes, mc)
    return table.ts_sep.join(str(int(p)) for p in props)


def render_plan(plan: Plan, inv: ModelInventory, spec: DialectSpec, tool: str, *, opts: Mapping[str, Any],
                bench: BenchLike | None = None, model_path: str | None = None,
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
    ngl0_drops = spec.name == "ik" and ik_build(opts).has(Feature.NGL_AUTO)
    has_ot = "ot" in table.keys()  # noqa: SIM118 (a ToolTable, not a dict)
    pf = placement.solve(plan.assignment, inv, spec.slot_rule, _moe_candidates(rule, table, inv, spread_of),
                         expand, no_ngl0_with_gpu=ngl0_drops,
                         catch_all=IK_EXPS_CATCH_ALL if spec.name == "ik" else None, overrides=has_ot)
    if pf.overrides and not has_ot:
        raise FlagError(f"{table.lacks.get('ot', f'{spec.name} {table.binary} has no -ot')}, and this plan needs "
                        f"tensor overrides (e.g. {pf.overrides[0].text()})")
    notes.extend(pf.notes)
    settings: list[tuple[str, Any]] = []
    if model_path:
        settings.append(("model", model_path))
    if tool == "bench":
        n_prompt = getattr(bench, "n_prompt", table.defaults["n_prompt"])
        n_gen = getattr(bench, "n_gen", table.defaults["n_gen"])
        depth = getattr(bench, "depth", getattr(bench, "n_depth", 0)) or 0
        reps = getattr(bench, "repetitions", None)
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
    if spec.name == "mainline" and "fit" in table.keys():  # noqa: SIM118 (a ToolTable; builds before --fit lack it)
        settings.append(("fit", False))
    settings += knob_settings(plan.knobs, table, notes, mla_model=inv.hparams.is_mla)
    pol, env = spec.render_policy(plan.knobs, table, inv, opts)
    settings += pol
    cache_ram = opts.get("cache_ram_mib")
    if cache_ram is not None and tool == "server" and "cache_ram" in table.keys():  # noqa: SIM118 (a ToolTable)
        settings.append(("cache_ram", cache_ram))     # a build without --cache-ram has no prompt cache to size
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
