"""The autotuner's search space: a handful of ordinal and categorical dimensions that decode into a Plan.

Never one categorical per tensor: a candidate says *how much* of each GPU to fill with routed experts (a share
of what is left after the layers' homes, KV and compute), in which layer order, whole layers or single
up/gate/down tensors, whether the output layer sits on a GPU, how many layers are homed on the GPUs (only when
not all of them fit) and how they split between GPUs, and the run-time knobs. Decoding reuses the planner's
building blocks (propose.split_homes, assignment_from_homes, fill_experts), so every candidate is a placement
the planner itself could have made, and the memory model judges it against the per-GPU budget and host RAM.

    # D dims; a candidate is {dim name: value}; decode(ask) asks for the dims it needs, in a fixed order,
    # so conditional dims (order only when something is filled, min_batch only with op offload on, ...) are
    # asked only when they matter. `ask` is an Optuna trial, a dict of fixed values, or a random source.

The same Space enumerates its grid (benchmarks/tuner_quality.py compares the tuner with it).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from typing import Any, Literal
from collections.abc import Callable, Iterator, Mapping, Sequence

from planner.engine_contract import Engine
from planner.engine_registry import traits_of
from planner.hardware import HardwareProfile, fmt_bytes
from planner.host import host_bill
from planner.memory import MemoryReport, estimate
from planner.model import ModelInventory
from planner.plan import (DEFAULT_CTX, FULL_PRECISION_KV, Dialect, Knobs, OffloadPolicy, OpRule, Plan,
                    gpu_names)
from planner.propose import (
    DEFAULT_MARGIN, ORDERS, Room, Proposal, assignment_from_homes, fill_experts, max_gpu_layers, model_id,
    split_homes,
)

DimKind = Literal["float", "int", "cat"]


@dataclass(frozen=True)
class Dim:
    """One sampler dimension. float/int: an arithmetic progression `values` (ordinal, the sampler can learn a
    direction); cat: unordered choices."""
    name: str
    kind: DimKind
    values: tuple[Any, ...]

    def suggest(self, trial: Any) -> Any:
        if self.kind == "cat" or len(self.values) == 1:
            return trial.suggest_categorical(self.name, list(self.values))
        lo, hi = self.values[0], self.values[-1]
        # 0.3 - 0.25 is 0.04999999999999999: Optuna then finds the range not divisible by the step, warns, and
        # moves the upper end below 1.0 (and warns again for every enqueued 1.0)
        step = self.values[1] - self.values[0] if self.kind == "int" else round(self.values[1] - self.values[0], 9)
        if self.kind == "int":
            return trial.suggest_int(self.name, lo, hi, step=step)
        return self.snap(trial.suggest_float(self.name, lo, hi, step=step))

    def snap(self, v: Any) -> Any:
        """The nearest of `values` (floats come back from storage with rounding noise)."""
        if self.kind == "cat":
            return v
        return min(self.values, key=lambda x: abs(x - v))

    def neighbours(self, v: Any) -> list[Any]:
        if self.kind == "cat":
            return [x for x in self.values if x != v]
        i = self.values.index(self.snap(v))
        return [self.values[j] for j in (i - 1, i + 1) if 0 <= j < len(self.values)]


def _steps(lo: float, hi: float, step: float) -> tuple[float, ...]:
    n = int(round((hi - lo) / step))
    return tuple(round(lo + k * step, 6) for k in range(n + 1))


@dataclass(frozen=True)
class SpaceConfig:
    """Choices per dimension. The defaults are the tuner's space; benchmarks use a coarser one for their grid."""
    fill_step: float = 0.05                       # share of each GPU's free budget filled with experts
    orders: tuple[str, ...] = ORDERS
    partial: tuple[bool, ...] = (True, False)     # fill single up/gate/down tensors of the next layer
    output: tuple[str, ...] = ("gpu", "cpu")
    home_step: float = 0.05                       # share of the most layers that fit, when not all fit
    home_min: float = 0.25
    split_step: float = 0.25                      # multi-GPU: log2 of each GPU's layer weight vs CUDA0
    split_range: float = 1.0
    ubatch: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096)   # powers of two, ascending
    batch_mult: tuple[int, ...] = (1, 2, 4)       # n_batch = n_ubatch * mult (batch >= ubatch)
    threads: tuple[int, ...] | None = None        # None: half, three quarters and all of the host's threads
    flash_attn: tuple[bool, ...] = (True, False)
    kv_types: tuple[str, ...] = ("f16", "q8_0")
    offload: tuple[bool, ...] = (True, False)
    min_batch: tuple[int, ...] = (32, 64, 128, 256)   # powers of two, ascending
    only_active: tuple[bool, ...] = (True, False)     # ik only (mainline always uploads only active experts)
    mmap: tuple[bool, ...] = (True, False)
    mla: tuple[int, ...] = (3, 2, 1)              # ik, MLA models only
    amb: tuple[int, ...] = (0, 256, 512)          # ik
    fmoe: tuple[bool, ...] = (True, False)        # ik
    rtr: tuple[bool, ...] = (False, True)         # ik
    op_per_class: bool = True                     # ik: one -op switch per op class; False for ik's llama-bench,
                                                  # which has no -op: offload stays on, only its batch is tuned
    no_host: tuple[bool, ...] = (False,)          # mainline --no-host; `tune` offers (False, True) to a real engine
                                                  # (docs/tuning.md); studies made before it ran with (False,)

    def settled(self, n_threads: int, dialect: Dialect = "mainline") -> SpaceConfig:
        """The space for an engine whose runs cost real time: the knobs that never reached the front in the
        H100 studies of issue 10 (30-50% of their runs: 8 or 12 threads on 16 cores, flash attention off,
        -b 16384, the output layer on the CPU, mmap'd (pageable) experts, op offload off with experts in RAM)
        are settled at the value that won, so the runs go to placement, ubatch and KV type."""
        settled = replace(self, threads=(n_threads,), flash_attn=(True,), batch_mult=(1,), output=("gpu",),
                          mmap=(False,), min_batch=(32,))
        return replace(settled, offload=(True,)) if dialect == "mainline" else settled

    def for_engine(self, engine: Engine, dialect: Dialect) -> SpaceConfig:
        """What the engine that runs the study adds or takes away: mainline's --no-host for a real llama.cpp (its
        gain is measured, docs/tuning.md; the sim engine does not model it), one op-offload switch for ik's
        llama-bench, which has no -op (docs/ik_llama.md). `tune` and the GPU benchmarks both ask here."""
        out = self
        if dialect == "mainline" and traits_of(engine).no_host_probe:
            out = replace(out, no_host=(False, True))
        if dialect == "ik" and not engine.op_offload_per_class:
            out = replace(out, op_per_class=False)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpaceConfig:
        return cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items()})


@dataclass(frozen=True)
class Candidate:
    """A decoded point: the plan, the dims it used, its memory and whether it fits (else `reason`)."""
    plan: Plan
    params: dict[str, Any]
    memory: MemoryReport | None
    fits: bool
    reason: str = ""
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return self.plan.id

    def gpu_bytes(self) -> dict[str, int]:
        if self.memory is None:
            return {}
        return {d: m.total for d, m in self.memory.devices.items() if d != "CPU"}


Ask = Callable[[Dim], Any]


class Space:
    """Dimensions and decoder for one model, machine, dialect, context and margin."""

    def __init__(self, inv: ModelInventory, hw: HardwareProfile, *, dialect: Dialect = "mainline",
                 n_ctx: int = DEFAULT_CTX, margin: int = DEFAULT_MARGIN, config: SpaceConfig = SpaceConfig(),
                 memory: Callable[[ModelInventory, Plan, HardwareProfile | None], MemoryReport] = estimate,
                 ubatch_margins: Mapping[int, int] | None = None) -> None:
        """`memory`: the memory model that judges candidates (planner.engine_contract.memory_model: the engine's own
        prediction where it has one, else planner.memory.estimate). `ubatch_margins`: a margin of its own for
        some ubatch sizes (the memory model's error is mostly the compute buffer's, which grows with the ubatch);
        every other ubatch gets `margin`."""
        self.inv, self.hw, self.dialect, self.n_ctx, self.margin, self.config = inv, hw, dialect, n_ctx, margin, config
        self.ubatch_margins = dict(ubatch_margins or {})
        self.estimate = memory
        self.gpus = gpu_names(len(hw.gpus))
        self.room = Room.from_hardware(hw, margin)
        self._rooms = {ub: Room.from_hardware(hw, m) for ub, m in self.ubatch_margins.items()}
        self._n_max: dict[tuple, int] = {}
        self._base_mem: dict[tuple, MemoryReport] = {}
        self._trie: dict[tuple, Any] = {}        # grid(cache=True): path of (dim, value) -> next dim or Candidate
        self._pending: dict[tuple, Any] = {}
        c = config
        threads = c.threads or _default_threads(hw.host.n_threads)
        d: dict[str, Dim] = {}

        def add(name: str, kind: DimKind, values: Sequence[Any]) -> None:
            d[name] = Dim(name, kind, tuple(values))

        # knobs first (the placement's limits depend on them), then placement
        add("ubatch_log2", "int", [int(math.log2(u)) for u in c.ubatch])
        add("batch_mult_log2", "int", [int(math.log2(m)) for m in c.batch_mult])
        add("threads", "int" if _arithmetic(threads) else "cat", threads)
        add("kv", "cat", c.kv_types)
        add("flash_attn", "cat", c.flash_attn)
        if dialect == "ik":
            # ik's -op per op class: MUL_MAT (dense and output), MUL_MAT_ID (routed experts), and, with fused MoE
            # (-fmoe, the default), MOE_FUSED_UP_GATE for the experts' up/gate; -no-ooae; -cuda offload-batch-size
            # (min_batch); -rtr; -amb; -mla (docs/ik_llama.md)
            add("fmoe", "cat", c.fmoe)
            if c.op_per_class:
                add("offload_moe", "cat", c.offload)
                add("offload_fused", "cat", c.offload)
                add("offload_dense", "cat", c.offload)
            add("only_active", "cat", c.only_active)
            add("rtr", "cat", c.rtr)
            add("amb", "cat", c.amb)
            if inv.hparams.is_mla:
                add("mla", "cat", c.mla)
        else:
            add("offload", "cat", c.offload)
            if True in c.no_host:
                add("no_host", "cat", c.no_host)
        add("min_batch_log2", "int", [int(math.log2(m)) for m in c.min_batch])
        add("mmap", "cat", c.mmap)
        add("output", "cat", c.output)
        for g in self.gpus[1:]:
            add(f"split.{g}", "float", _steps(-c.split_range, c.split_range, c.split_step))
        add("home_frac", "float", _steps(c.home_min, 1.0, c.home_step))
        if inv.hparams.is_moe:
            for g in self.gpus:
                add(f"fill.{g}", "float", _steps(0.0, 1.0, c.fill_step))
            add("order", "cat", c.orders)
            add("partial", "cat", c.partial)
        self.dims = d

    # ---- decoding -------------------------------------------------------------------------------------------

    def knobs(self, ask: Ask) -> Knobs:
        d, hp = self.dims, self.inv.hparams
        ub = 2 ** ask(d["ubatch_log2"])
        nb = ub * 2 ** ask(d["batch_mult_log2"])
        kv = ask(d["kv"])
        fa = ask(d["flash_attn"]) if kv in FULL_PRECISION_KV else True
        k = Knobs(n_ctx=self.n_ctx, n_batch=nb, n_ubatch=ub, n_threads=ask(d["threads"]), flash_attn=fa,
                  type_k=kv, type_v=kv)
        if self.dialect == "ik":
            fmoe = ask(d["fmoe"])
            per_class = self.config.op_per_class
            moe_on = ask(d["offload_moe"]) if per_class else True
            fused_on = ask(d["offload_fused"]) if fmoe and per_class else moe_on   # without -fmoe: no fused op
            dense_on = ask(d["offload_dense"]) if per_class else moe_on
            rtr = ask(d["rtr"])
            mb = 2 ** ask(d["min_batch_log2"]) if (moe_on or fused_on or dense_on) and not rtr else 32
            dense, moe, fused = OpRule(dense_on, mb), OpRule(moe_on, mb), OpRule(fused_on, mb)
            only = ask(d["only_active"]) if (moe_on or fused_on) and not rtr else True
            k = replace(k, offload=OffloadPolicy(dense, moe, fused, dense), only_active_experts=only, rtr=rtr,
                        fmoe=fmoe, amb=ask(d["amb"]), mla=ask(d["mla"]) if hp.is_mla else 3,
                        mmap=False if rtr else ask(d["mmap"]))
        else:
            on = ask(d["offload"])
            mb = 2 ** ask(d["min_batch_log2"]) if on else 32
            k = replace(k, offload=OffloadPolicy.all(on, mb), mmap=ask(d["mmap"]),
                        no_host=ask(d["no_host"]) if "no_host" in d else False)
        return k

    def margin_for(self, n_ubatch: int) -> int:
        return self.ubatch_margins.get(n_ubatch, self.margin)

    def room_for(self, n_ubatch: int | None) -> Room:
        """The room a candidate with this ubatch is held to (None: the default margin's)."""
        return self.room if n_ubatch is None else self._rooms.get(n_ubatch, self.room)

    def max_homes(self, knobs: Knobs, weights: list[float], output_on_gpu: bool) -> int:
        """Most layers homed on the GPUs with every expert on the CPU (cached on what changes memory)."""
        key = (replace(knobs, n_threads=0), tuple(weights), output_on_gpu)
        n = self._n_max.get(key)
        if n is None:
            inv = self.inv
            homes = split_homes(inv.n_layer, inv.n_layer, self.gpus, weights)
            a = assignment_from_homes(inv, homes, homes[-1] if output_on_gpu else "CPU", "CPU")
            budget = self.room_for(knobs.n_ubatch)
            if budget.fits(self.estimate(inv, Plan(model_id(inv), a, knobs, self.dialect), self.hw)):
                n = inv.n_layer          # the common case: one estimate, which the decoder's base reuses
            else:
                n = max_gpu_layers(inv, self.hw, budget, knobs, self.dialect, experts_on_cpu=True,
                                   weights=weights, output_on_gpu=output_on_gpu)
            self._n_max[key] = n
        return n

    def decode(self, ask: Ask) -> Candidate:
        """Ask for the dims this candidate needs and build its Plan; `fits` says whether the memory model
        keeps it within every GPU's budget (VRAM minus margin) and host RAM. After grid(cache=True), decoding
        walks the cached grid instead (the same asks in the same order, no memory model)."""
        if self._trie:
            return self._decode_cached(ask)
        return self._decode(ask)

    def _decode_cached(self, ask: Ask) -> Candidate:
        path: tuple[tuple[str, Any], ...] = ()
        while True:
            entry = self._trie.get(path)
            if isinstance(entry, Candidate):
                return entry
            if entry is None:       # outside the cached grid: decode for real, replaying the answers given
                given = dict(path)
                return self._decode(lambda dim: given[dim.name] if dim.name in given else ask(dim))  # noqa: B023
            dim = self.dims[entry]
            path += ((dim.name, dim.snap(ask(dim))),)

    def _decode(self, ask: Ask) -> Candidate:
        used: dict[str, Any] = {}

        def rec(dim: Dim) -> Any:
            v = ask(dim)
            used[dim.name] = v
            return v

        inv, d = self.inv, self.dims
        knobs = self.knobs(rec)
        out_gpu = rec(d["output"]) == "gpu"
        weights = [float(g.vram_bytes) * 2.0 ** (rec(d[f"split.{dev}"]) if i else 0.0)
                   for i, (dev, g) in enumerate(zip(self.gpus, self.hw.gpus))]
        n_max = self.max_homes(knobs, weights, out_gpu)
        info: dict[str, Any] = {"n_max_homes": n_max}
        if n_max < 0:
            plan = Plan(model_id(inv), {}, knobs, self.dialect, "unplaceable")
            return Candidate(plan, used, None, False, "nothing fits: not even every layer on the CPU (host RAM)", info)
        n_home = n_max if n_max >= inv.n_layer else int(round(rec(d["home_frac"]) * n_max))
        homes = split_homes(inv.n_layer, n_home, self.gpus, weights)
        gpu_homes = [h for h in homes if h != "CPU"]
        out_dev = (gpu_homes[-1] if gpu_homes else self.gpus[-1]) if out_gpu else "CPU"
        base = Plan(model_id(inv), assignment_from_homes(inv, homes, out_dev, "CPU" if inv.hparams.is_moe else None),
                    knobs, self.dialect, "")
        info["n_home"] = n_home
        plan = base
        if inv.hparams.is_moe:
            shares = {g: rec(d[f"fill.{g}"]) for g in self.gpus}
            if any(s > 0 for s in shares.values()):
                order, partial = rec(d["order"]), rec(d["partial"])
                base_mem = self._base_memory(base)
                budget, scaled = self.room_for(knobs.n_ubatch), {}
                for g in self.gpus:
                    have, used_b = budget.gpus[g], base_mem.gpu_total(g)
                    scaled[g] = used_b + int(shares[g] * max(have - used_b, 0))
                plan = fill_experts(inv, base, Room(scaled, budget.host), self.hw, order, partial,
                                    estimate=self.estimate)
        plan = replace(plan, label=self.label(used, knobs))
        mem = self.estimate(inv, plan, self.hw)
        reason = self.over_budget(mem, n_ubatch=knobs.n_ubatch)
        return Candidate(plan, used, mem, not reason, reason, info)

    def _base_memory(self, base: Plan) -> MemoryReport:
        """estimate() of a candidate's homes with every expert on the CPU: many candidates share one (the
        fill share, order and threads do not change it), so it is cached."""
        key = (replace(base.knobs, n_threads=0), tuple(sorted(set(base.assignment.items()))))
        mem = self._base_mem.get(key)
        if mem is None:
            if len(self._base_mem) > 256:
                self._base_mem.clear()
            mem = self._base_mem[key] = self.estimate(self.inv, base, self.hw)
        return mem

    def over_budget(self, mem: MemoryReport, margin: int | None = None, n_ubatch: int | None = None) -> str:
        """'' when `mem` fits every GPU (VRAM - margin) and host RAM; else what is over and by how much. The
        margin: `margin` when given, else that of the plan's `n_ubatch` (margin_for)."""
        budget = Room.from_hardware(self.hw, margin) if margin is not None else self.room_for(n_ubatch)
        for dev, m in mem.devices.items():
            if dev == "CPU":
                # the whole host bill but llama-server's prompt cache (sized to what is left): weights in RAM,
                # mmap'd ones too, past the RAM are read from disk on every token (planner/host.py)
                bill = host_bill(mem, budget.host)
                if bill.need > budget.host:
                    return (f"host RAM: needs {fmt_bytes(bill.need)} ({fmt_bytes(bill.weights)} of weights in RAM), "
                            f"has {fmt_bytes(budget.host)}")
            elif m.total > budget.gpus.get(dev, 0):
                return (f"{dev}: needs {fmt_bytes(m.total)}, budget {fmt_bytes(budget.gpus.get(dev, 0))} "
                        f"(VRAM - {fmt_bytes(self.hw.gpu(dev).vram_bytes - budget.gpus.get(dev, 0))} margin)")
        return ""

    def legal(self, params: dict[str, Any]) -> dict[str, Any]:
        """params with each value one its dim allows (a seed made for the full space, in a settled one: a
        choice the space fixed becomes its one value, a number snaps to the nearest step)."""
        out = {}
        for k, v in params.items():
            dim = self.dims.get(k)
            if dim is None:
                continue
            out[k] = (v if v in dim.values else dim.values[0]) if dim.kind == "cat" else dim.snap(v)
        return out

    def label(self, p: dict[str, Any], knobs: Knobs | None = None) -> str:
        """Short description: expert fill per GPU, order, homes, output; then the knobs that differ by candidate."""
        fills = [p.get(f"fill.{g}", 0.0) for g in self.gpus]
        parts = [f"fill {'/'.join(f'{f:.2f}' for f in fills)}"]
        if any(fills):
            parts.append(f"{p.get('order')}{'+partial' if p.get('partial') else ''}")
        if "home_frac" in p:
            parts.append(f"homes {p['home_frac']:.2f}")
        parts.append(f"out {p.get('output')}")
        text = " ".join(parts)
        if knobs is not None:
            k = knobs
            pol = k.offload
            onoff = lambda r: "on" if r.enabled else "off"   # noqa: E731
            if self.dialect == "ik" and len({pol.moe_matmul.enabled, pol.moe_fused_up_gate.enabled,
                                             pol.dense_matmul.enabled}) > 1:
                op = f"op moe {onoff(pol.moe_matmul)}"
                if pol.moe_fused_up_gate.enabled != pol.moe_matmul.enabled:
                    op += f" fused {onoff(pol.moe_fused_up_gate)}"
                op += f" dense {onoff(pol.dense_matmul)} {pol.moe_matmul.min_batch}"
            else:
                op = "op " + (f"{pol.moe_matmul.min_batch}" if pol.any_enabled else "off")
            if self.dialect == "ik" and pol.moe_matmul.enabled and not k.only_active_experts:
                op += " all-experts"
            text += (f"; ub {k.n_ubatch} b {k.n_batch} t {k.n_threads} kv {k.type_k}{'' if k.flash_attn else ' nofa'} "
                     f"{op}{'' if k.mmap else ' nommap'}{' nohost' if k.no_host else ''}")
            if self.dialect == "ik":
                text += (f" amb {k.amb}{' rtr' if k.rtr else ''}{'' if k.fmoe else ' nofmoe'}"
                         + (f" mla {k.mla}" if self.inv.hparams.is_mla else ""))
        return text

    # ---- sources of params ----------------------------------------------------------------------------------

    def fixed(self, params: dict[str, Any], default: Callable[[Dim], Any] | None = None) -> Ask:
        """An Ask reading `params`; dims it lacks come from `default` (else the dim's first value)."""
        def ask(dim: Dim) -> Any:
            if dim.name in params:
                return dim.snap(params[dim.name])
            return default(dim) if default else dim.values[0]
        return ask

    def random(self, rng: random.Random) -> Ask:
        return lambda dim: rng.choice(dim.values)

    def neighbours(self, params: dict[str, Any]) -> list[dict[str, Any]]:
        """Params one step away in one dim (ordinal dims: the adjacent values; categorical: every other)."""
        out = []
        for name, v in params.items():
            dim = self.dims[name]
            for w in dim.neighbours(v):
                out.append({**params, name: w})
        return out

    def grid(self, cache: bool = False) -> Iterator[Candidate]:
        """Every distinct candidate of the space (each conditional dim expanded only where it is asked).

        Depth-first over partial assignments (paths of (dim, value) in ask order): decode with the values fixed
        so far; the first dim not yet fixed branches. Yields one Candidate per distinct set of used params.
        cache=True keeps the decision tree, so later decode() calls (a sampler's) cost a few dict lookups."""
        stack: list[tuple[tuple[str, Any], ...]] = [()]
        while stack:
            path = stack.pop()
            fixed = dict(path)
            missing: list[Dim] = []

            def ask(dim: Dim) -> Any:          # called only inside this iteration's _decode
                if dim.name in fixed:           # noqa: B023
                    return fixed[dim.name]      # noqa: B023
                missing.append(dim)             # noqa: B023
                raise _Branch()
            try:
                cand = self._decode(ask)
            except _Branch:
                dim = missing[0]
                if cache:
                    self._pending[path] = dim.name
                for v in reversed(dim.values):
                    stack.append(path + ((dim.name, v),))
                continue
            if cache:
                self._pending[path] = cand
            yield cand
        if cache:
            self._trie, self._pending = self._pending, {}

    def clear_cache(self) -> None:
        self._trie, self._pending = {}, {}

    # ---- seeds ----------------------------------------------------------------------------------------------

    def default_params(self) -> dict[str, Any]:
        """llama.cpp's defaults where the space has them (ubatch 512, batch 2048, all threads, f16 KV, flash
        attention, op offload at 32, mmap), output on the GPU."""
        d, c = self.dims, self.config
        p: dict[str, Any] = {
            "ubatch_log2": d["ubatch_log2"].snap(9),
            "threads": d["threads"].values[-1] if d["threads"].kind != "cat" else max(d["threads"].values),
            "kv": "f16" if "f16" in c.kv_types else c.kv_types[0],
            "flash_attn": True if True in c.flash_attn else c.flash_attn[0],
            "min_batch_log2": d["min_batch_log2"].snap(5),
            "mmap": True if True in c.mmap else c.mmap[0],
            "output": "gpu" if "gpu" in c.output else c.output[0],
            "home_frac": 1.0,
        }
        ub = 2 ** p["ubatch_log2"]
        p["batch_mult_log2"] = d["batch_mult_log2"].snap(math.log2(max(2048 // ub, 1)))
        for name in ("offload", "offload_moe", "offload_fused", "offload_dense", "only_active", "fmoe"):
            if name in d:
                p[name] = True if True in d[name].values else d[name].values[0]
        for name in ("rtr", "no_host"):
            if name in d:
                p[name] = False if False in d[name].values else d[name].values[0]
        if "amb" in d:
            amb = d["amb"]
            p["amb"] = amb.snap(256) if amb.kind != "cat" else (256 if 256 in amb.values else amb.values[0])
        if "mla" in d:
            p["mla"] = 3 if 3 in d["mla"].values else d["mla"].values[0]
        for g in self.gpus[1:]:
            p[f"split.{g}"] = d[f"split.{g}"].snap(0.0)
        for g in self.gpus:
            if f"fill.{g}" in d:
                p[f"fill.{g}"] = 0.0
        return {k: v for k, v in p.items() if k in d}

    def proposal_params(self, proposal: Proposal) -> dict[str, Any]:
        """Params that reproduce a propose.py candidate (its strategy, fill order and knob variant) as closely as
        the space can."""
        knobs = proposal.plan.knobs
        p = self.default_params()
        if "offload" in p:
            p["offload"] = knobs.offload.any_enabled
        for name, op in (("offload_moe", "moe_matmul"), ("offload_fused", "moe_fused_up_gate"),
                         ("offload_dense", "dense_matmul")):
            if name in p:
                p[name] = knobs.offload.rule(op).enabled
        if "mmap" in p and knobs.mmap in self.dims["mmap"].values:
            p["mmap"] = knobs.mmap
        if proposal.strategy == "experts-cpu+fill":
            order = proposal.order
            for g in self.gpus:
                if f"fill.{g}" in self.dims:
                    p[f"fill.{g}"] = 1.0
            p["order"] = order if order in self.config.orders else self.config.orders[0]
            p["partial"] = True if True in self.config.partial else self.config.partial[0]
        elif proposal.strategy in ("layers", "output-only"):
            for g in self.gpus:
                if f"fill.{g}" in self.dims:
                    p[f"fill.{g}"] = 1.0
            p["order"] = "last" if "last" in self.config.orders else self.config.orders[0]
            p["partial"] = False if False in self.config.partial else self.config.partial[0]
        return p


class _Branch(Exception):
    pass


def _default_threads(n: int) -> tuple[int, ...]:
    if n <= 2:
        return tuple(range(1, n + 1))
    vals = sorted({max(1, n // 2), max(1, (3 * n) // 4), n})
    return tuple(vals)


def _arithmetic(vals: Sequence[int]) -> bool:
    if len(vals) < 2:
        return True
    step = vals[1] - vals[0]
    return step > 0 and all(b - a == step for a, b in zip(vals, vals[1:]))
