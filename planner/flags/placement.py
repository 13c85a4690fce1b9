"""From a tensor -> device assignment to -ngl, -ts and a compact -ot list (plus -cmoe/-ncmoe when shorter).

Strategy (the rendered flags are always verified by parsing them back; see render.render_plan):
1. Every slot (block or output layer) has a home device (`home_devices`): the device of the block's
   attn_norm, of the output layer's output.weight (output_norm when tied), as planner/memory.py reads them.
   llama.cpp keeps a layer's KV cache and activations on the slot's device, so -ngl/-ts must reproduce the
   homes whenever they can (then no norm is ever overridden).
2. A dynamic programme over -ngl and the ordered -ts partition finds the split that matches every home and,
   among those, leaves the fewest tensors as exceptions (when no split matches every home, the fewest
   mismatched homes).
3. Exceptions are grouped per device by tensor suffix, suffixes with the same layer set share one pattern, and
   layer sets become numeric alternations: `blk\\.([3-9]|[1-3][0-9]|40)\\.ffn_(down|gate|up)_exps=CPU`.
4. The dialect's -cmoe / -ncmoe expansions are tried as a base under the exceptions; the shortest wins.
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable, Mapping, Sequence

from ..errors import FlagError
from ..model import ModelInventory, Tensor
from ..plan import device_sort_key
from .common import (
    DEVICE_RE, NameIndex, Override, SlotRule, allocated_names, alternation, apply_overrides, base_assignment,
    gpu_index, group, int_set_regex, is_gpu, match_overrides, memo, slot_devices, slot_of,
)

BIG = 1 << 20   # cost of a home-device mismatch, in tensors


@dataclass(frozen=True)
class SlotSplit:
    n_gpu_layers: int
    tensor_split: tuple[int, ...] | None   # layer counts per GPU (None: one GPU or no GPU layer)
    homes_matched: bool


@dataclass(frozen=True)
class PlacementFlags:
    n_gpu_layers: int
    tensor_split: tuple[int, ...] | None
    overrides: tuple[Override, ...]        # user -ot entries (first in every dialect's list)
    moe: tuple[str, int] | None            # ("cmoe", 0) or ("ncmoe", N): expanded after the -ot entries
    notes: tuple[str, ...]


@dataclass(frozen=True)
class ModelIndex:
    """What the solver looks up repeatedly about one inventory (built once per inventory, kept on it)."""
    n_layer: int
    by_name: Mapping[str, Tensor]
    names: NameIndex
    members: tuple[tuple[Tensor, ...], ...]           # per slot (index n_layer = output layer)
    moe_layers: tuple[int, ...]
    layer_suffixes: dict[int, tuple[str, ...]]       # block -> suffixes after "blk.N."
    suffix_layers: dict[str, frozenset[int]]         # suffix -> blocks that have it

    @classmethod
    def of(cls, inv: ModelInventory) -> ModelIndex:
        return memo(inv, "model_index", lambda: cls._build(inv))

    @classmethod
    def _build(cls, inv: ModelInventory) -> ModelIndex:
        allocated = inv.allocated()
        n_layer = inv.hparams.n_layer
        slots: list[list[Tensor]] = [[] for _ in range(n_layer + 1)]
        ls: dict[int, list[str]] = {}
        sl: dict[str, set[int]] = {}
        for t in allocated:
            s = slot_of(t, n_layer)
            if s is not None:
                slots[s].append(t)
            if t.layer is not None:
                suf = t.name[len(f"blk.{t.layer}."):]
                ls.setdefault(t.layer, []).append(suf)
                sl.setdefault(suf, set()).add(t.layer)
        return cls(n_layer, inv.by_name, allocated_names(inv), tuple(tuple(m) for m in slots), tuple(inv.moe_layers()),
                   {k: tuple(v) for k, v in ls.items()}, {k: frozenset(v) for k, v in sl.items()})


def check_assignment(assignment: Mapping[str, str], inv: ModelInventory) -> None:
    names = set(allocated_names(inv).names)
    missing = names - assignment.keys()
    extra = assignment.keys() - names
    if missing:
        raise FlagError(f"plan leaves {len(missing)} tensors unassigned (e.g. {sorted(missing)[0]!r}); "
                        "a plan must place every allocated tensor")
    if extra:
        raise FlagError(f"plan assigns {len(extra)} tensors the model does not allocate (e.g. {sorted(extra)[0]!r})")
    bad = sorted({d for d in assignment.values() if not DEVICE_RE.match(d)})
    if bad:
        raise FlagError(f"plan uses unknown device {bad[0]!r}; devices are CPU, CUDA0, CUDA1, ...")


def home_devices(assignment: Mapping[str, str], inv: ModelInventory, idx: ModelIndex | None = None
                 ) -> list[str | None]:
    """Home device of each slot (index n_layer = output layer); None for a slot with no allocated tensor.

    The home is the device of the slot's anchor tensor: `blk.N.attn_norm.weight` for a block, `output.weight`
    (`output_norm.weight` when tied) for the output layer (planner/memory.py reads homes the same way). A slot
    without its anchor falls back to where most of its non-expert tensors are (ties: CUDA0 < CUDA1 < ... < CPU).
    It is where llama.cpp must put the slot (-ngl/-ts) so that the layer's KV cache lands there.
    """
    return _homes(assignment, idx or ModelIndex.of(inv))


ANCHORS = ("attn_norm.weight", "output.weight", "output_norm.weight")   # by preference, matched on name suffix


def _homes(assignment: Mapping[str, str], idx: ModelIndex) -> list[str | None]:
    out: list[str | None] = []
    for members in idx.members:
        anchor = next((t for a in ANCHORS for t in members if t.name == a or t.name.endswith("." + a)), None)
        if anchor is not None:
            out.append(assignment[anchor.name])
            continue
        core = [t for t in members if not t.is_expert] or members
        if not core:
            out.append(None)
            continue
        counts: dict[str, int] = {}
        for t in core:
            d = assignment[t.name]
            counts[d] = counts.get(d, 0) + 1
        out.append(min(counts, key=lambda d: (-counts[d], device_sort_key(d))))
    return out


def choose_split(assignment: Mapping[str, str], idx: ModelIndex, rule: SlotRule, n_gpus: int,
                 min_ngl: int = 0) -> SlotSplit:
    """-ngl and -ts (layer counts per GPU) that reproduce the home devices, with the fewest exceptions.

    `min_ngl` > 0 rules out smaller -ngl values (ik drops every -ot with -ngl 0)."""
    n_layer = idx.n_layer
    members = idx.members
    homes = _homes(assignment, idx)
    devs = ["CPU"] + [f"CUDA{i}" for i in range(n_gpus)]
    # cost[s][d]: cost of putting slot s on devs[d]
    cost: list[list[int]] = []
    for s, mem in enumerate(members):
        counts: dict[str, int] = {}
        for t in mem:
            counts[assignment[t.name]] = counts.get(assignment[t.name], 0) + 1
        cost.append([(BIG if homes[s] is not None and homes[s] != d else 0) + len(mem) - counts.get(d, 0)
                     for d in devs])
    k = n_gpus
    cpu_prefix = [0]
    for s in range(n_layer + 1):
        cpu_prefix.append(cpu_prefix[-1] + cost[s][0])

    def suffix_dp(end: int) -> list[list[int]]:
        """g[s][j]: least cost of slots s..end-1 on GPUs with non-decreasing index, slot s on GPU >= j."""
        inf = float("inf")
        g = [[0] * (k + 1) for _ in range(end + 1)]
        for j in range(k + 1):
            g[end][j] = 0
        for s in range(end - 1, -1, -1):
            g[s][k] = inf   # type: ignore[call-overload]
            for j in range(k - 1, -1, -1):
                g[s][j] = min(cost[s][j + 1] + g[s + 1][j], g[s][j + 1])
        return g

    candidates: list[tuple[int, int, int, int]] = []   # (cost, ngl, start, end of the GPU window)
    if k == 0:
        total = cpu_prefix[n_layer + 1]
        return SlotSplit(0, None, total < BIG)
    if rule == "last_slots":
        g_all = suffix_dp(n_layer + 1)
        for ngl in range(n_layer + 2):
            start = n_layer + 1 - ngl
            candidates.append((cpu_prefix[start] + g_all[start][0], ngl, start, n_layer + 1))
        gdp = {n_layer + 1: g_all}
    else:
        g_blocks = suffix_dp(n_layer)
        for ngl in range(n_layer + 1):
            start = n_layer - ngl
            candidates.append((cpu_prefix[start] + g_blocks[start][0] + cost[n_layer][0], ngl, start, n_layer))
        g_all = suffix_dp(n_layer + 1)
        candidates.append((g_all[0][0], n_layer + 1, 0, n_layer + 1))
        gdp = {n_layer: g_blocks, n_layer + 1: g_all}
    best_cost, ngl, start, end = min((c for c in candidates if c[1] >= min_ngl), key=lambda c: (c[0], c[1]))
    g = gdp[end]
    counts = [0] * k
    j = 0
    for s in range(start, end):
        while j + 1 < k and g[s][j + 1] < cost[s][j + 1] + g[s + 1][j]:
            j += 1
        counts[j] += 1
    split = tuple(counts) if (k >= 2 and ngl > 0) else None
    return SlotSplit(ngl, split, best_cost < BIG)


# ---- exceptions -> compact -ot entries -----------------------------------------------------------------------

def _strip_ext(suffix: str) -> str:
    for ext in (".weight", ".bias"):
        if suffix.endswith(ext):
            return suffix[: -len(ext)]
    return suffix


def _group_pattern(layers: frozenset[int], suffixes: Sequence[str], idx: ModelIndex) -> str:
    """Pattern matching exactly blk.L.S for L in layers, S in suffixes (verified by construction)."""
    sufs = sorted(suffixes)
    stems = sorted({_strip_ext(s) for s in sufs})
    # stems are prefixes after "blk.L.": usable when nothing else in those layers starts with one of them
    suffix_set, stem_tuple = set(sufs), tuple(stems)
    if stems != sufs and all(x in suffix_set for layer in layers for x in idx.layer_suffixes.get(layer, ())
                             if x.startswith(stem_tuple)):
        body = stems
    else:
        body = sufs
    alt = group(alternation(body))
    if all(idx.suffix_layers.get(s) == layers for s in sufs):
        # every layer that has these tensors: try without the layer part
        short = "\\." + alt
        want = {f"blk.{layer}.{s}" for layer in layers for s in sufs}
        res = match_overrides(idx.names, [Override(short, "CPU")])
        if set(res.matched[0]) == want:
            return short
    return "blk\\." + group(int_set_regex(layers)) + "\\." + alt


def compact_overrides(exceptions: Mapping[str, str], idx: ModelIndex) -> list[Override]:
    """-ot entries (disjoint, so in any order) that move exactly the `exceptions` tensors to their devices."""
    by_name = idx.by_name
    blk: dict[str, dict[str, set[int]]] = {}
    glob: dict[str, list[str]] = {}
    for name, dev in exceptions.items():
        t = by_name[name]
        if t.layer is None:
            glob.setdefault(dev, []).append(name)
        else:
            blk.setdefault(dev, {}).setdefault(name[len(f"blk.{t.layer}."):], set()).add(t.layer)
    out: list[Override] = []
    for dev in sorted(set(blk) | set(glob), key=device_sort_key):
        entries: list[str] = []
        if dev in glob:
            entries.append("^" + group(alternation(glob[dev])))
        by_layers: dict[frozenset[int], list[str]] = {}
        for suf, layers in blk.get(dev, {}).items():
            by_layers.setdefault(frozenset(layers), []).append(suf)
        for layers, sufs in by_layers.items():
            entries.append(_group_pattern(layers, sufs, idx))
        out.extend(Override(p, dev) for p in sorted(entries))
    return out


# ---- the whole placement -------------------------------------------------------------------------------------

MoeExpander = Callable[[str, int, Sequence[str]], list[Override]]


def solve(assignment: Mapping[str, str], inv: ModelInventory, rule: SlotRule,
          moe_candidates: Callable[[Mapping[str, str], ModelIndex, Sequence[str]], list[tuple[str, int]]],
          expand_moe: MoeExpander, no_ngl0_with_gpu: bool = False,
          catch_all: Override | None = None, overrides: bool = True) -> PlacementFlags:
    """-ngl, -ts, -ot and an optional -cmoe/-ncmoe that together place every tensor where `assignment` says.

    `moe_candidates(assignment, index, slots)` proposes dialect shortcuts (("cmoe", 0), ("ncmoe", N)) whose
    expansion `expand_moe(kind, n, slots)` only moves tensors the plan has on the CPU; the cheapest rendering
    wins (`slots`: the device of each -ngl slot). `no_ngl0_with_gpu`: never -ngl 0 when a tensor is on a GPU.
    `catch_all` (e.g. `exps=CPU`, the way ik users write it) is tried as a last -ot entry under the exceptions.
    `overrides` False (a build without -ot): a rendering without -ot wins over any with one, when there is one.
    """
    check_assignment(assignment, inv)
    idx = ModelIndex.of(inv)
    gpus = [gpu_index(d) for d in set(assignment.values()) if is_gpu(d)]
    n_gpus = max(gpus) + 1 if gpus else 0
    split = choose_split(assignment, idx, rule, n_gpus, 1 if (no_ngl0_with_gpu and n_gpus) else 0)
    devices = [f"CUDA{i}" for i in range(max(n_gpus, 1))]
    slots = slot_devices(inv.hparams.n_layer, split.n_gpu_layers, rule, devices, split.tensor_split)
    base = base_assignment(inv, slots)
    notes: list[str] = []
    if not split.homes_matched:
        homes = home_devices(assignment, inv, idx)
        off = [s for s, h in enumerate(homes) if h is not None and h != slots[s]]
        notes.append(f"W101 -ngl/-ts cannot put every layer on its home device: slots {off[:8]} are on other "
                     "devices (their KV cache follows -ngl/-ts, not the -ot overrides)")

    def render_cost(ovs: Sequence[Override], moe: tuple[str, int] | None) -> int:
        moe_len = 0 if moe is None else (6 if moe[0] == "cmoe" else 8 + len(str(moe[1])))   # "-cmoe " / "-ncmoe N "
        unwritable = 1 << 40 if ovs and not overrides else 0
        return sum(len(o.text()) + 1 for o in ovs) + (4 if ovs else 0) + moe_len + unwritable

    best: tuple[int, list[Override], tuple[str, int] | None] | None = None
    for moe in [None, *moe_candidates(assignment, idx, slots)]:
        start = base
        if moe is not None:
            start, _ = apply_overrides(base, expand_moe(*moe, slots), idx.names)
        exceptions = {n: d for n, d in assignment.items() if start[n] != d}
        ovs = compact_overrides(exceptions, idx)
        c = render_cost(ovs, moe)
        if best is None or c < best[0]:
            best = (c, ovs, moe)
    if catch_all is not None and overrides:
        # the exceptions come first (first match wins), the catch-all takes every other tensor it matches
        start, res = apply_overrides(base, [catch_all], idx.names)
        if res.matched[0]:
            exceptions = {n: d for n, d in assignment.items() if start[n] != d}
            ovs = compact_overrides(exceptions, idx) + [catch_all]
            c = render_cost(ovs, None)
            if best is None or c <= best[0]:
                best = (c, ovs, None)
    assert best is not None
    if assignment.get("token_embd.weight", "CPU") != "CPU":
        notes.append("W102 token_embd on a GPU: llama.cpp keeps the input layer on the CPU unless overridden; "
                     "GET_ROWS gains little from a GPU")
    return PlacementFlags(split.n_gpu_layers, split.tensor_split, tuple(best[1]), best[2], tuple(notes))


def clean_moe_prefix(assignment: Mapping[str, str], idx: ModelIndex, order: Sequence[int],
                     expand_layer: Callable[[int], Override]) -> int:
    """Longest N such that the per-layer expansions of order[:N] only match tensors the plan has on the CPU."""
    n = 0
    for layer in order:
        res = match_overrides(idx.names, [expand_layer(layer)])
        if any(assignment[x] != "CPU" for x in res.matched[0]):
            break
        n += 1
    return n

