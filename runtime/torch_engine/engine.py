"""TorchEngine: the bundled PyTorch runtime as an Engine (planner/engine_contract.py), and TorchModel, a placed model
that runs ubatches and decode steps (what the engine times, and what tests drive directly).

Timing follows llama-bench: PP = n_prompt tokens processed in ubatches of knobs.n_ubatch_eff after a prompt of
`depth` tokens; TG = n_gen single-token greedy steps after a prompt of `depth`; one untimed warm-up of each,
then `repetitions` timed runs, the median reported and every sample kept in raw. Every clock read follows a
device synchronisation. Peak bytes per GPU are torch.cuda.max_memory_allocated plus the CUDA context and
library overhead measured once per device; on logical GPUs, the accountant's peak (weights, KV, staging and
live activations) and raw["logical_gpus"] = True.
"""
from __future__ import annotations

import gc
import os
import resource
import statistics
import time
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Mapping, Sequence

import torch

from planner.errors import InputError
from planner.hardware import HardwareProfile
from planner.memory import DEFAULT_GPU_OVERHEAD, HOST_PROCESS_OVERHEAD, DeviceMemory, MemoryReport
from planner.residency import output_device as plan_output_device
from planner.model import ModelInventory
from planner.plan import Plan, device_sort_key, gpu_index

from planner.engine_contract import Engine, Measurement, BenchRun
from .config import ModelConfig, config_from_inventory
from . import cpu_moe
from . import kernels as K
from .kernels import ceil_to
from .model import ForwardBuilder, Runtime, make_fast_helpers
from .placement import (
    Accountant, BufferCache, Counters, Devices, OutOfMemory, Stager, allocate_kv, buffer_keys, is_gpu,
    place_weights, resolve_devices,
)
from .scheduler import GraphRunner, OffloadRules, Program, now, run_eager, synchronize
from .weights import SyntheticSource, WeightSource, open_source

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "f32": torch.float32, "fp16": torch.float16}
DECODE_BUCKET = 256            # decode graphs are captured per KV length rounded up to this
# cuBLAS's workspace on each GPU that runs a matmul, taken from torch's caching allocator at the first one (so in
# max_memory_allocated, not in the CUDA context): 32 MiB on the H100 with torch 2.11 (the probe's engine.py
# context_overhead line, benchmarks/reported/torch_memory_probe_h100x2.md)
CUBLAS_WORKSPACE = 32 << 20


def default_threads() -> int:
    """llama.cpp's default -t: the physical cores (we take the cores this process may use)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


class TorchModel:
    """A model placed as `plan` says, with its KV cache allocated for at least `min_cells` positions."""

    def __init__(self, inv: ModelInventory, plan: Plan, source: WeightSource, devices: Devices, *,
                 dtype: torch.dtype = torch.bfloat16, min_cells: int = 0, use_cuda_graphs: bool = True,
                 compile: bool = True, cache: BufferCache | None = None,
                 metadata: Mapping[str, Any] | None = None) -> None:
        self.inv, self.plan, self.devices, self.dtype = inv, plan, devices, dtype
        self.cfg: ModelConfig = config_from_inventory(inv, metadata or getattr(source, "metadata", None))
        self.counters = Counters()
        self.acct = Accountant(devices)
        self._own_cache = cache is None
        self.cache = cache or BufferCache()
        self.threads = plan.knobs.n_threads or default_threads()
        torch.set_num_threads(self.threads)
        out_dev = plan_output_device(inv, plan)
        self.weights = place_weights(inv, plan, devices, source, dtype, self.acct, out_dev, self.cache)
        self.caches = allocate_kv(self.cfg, inv, plan, devices, dtype, self.acct, max(min_cells, 1))
        stagers = {g: Stager(g, devices, self.acct, self.counters) for g in devices.gpus}
        self.max_pos = max(ceil_to(max(min_cells, 1), 256), plan.knobs.kv_size,
                           max((c.cells for c in self.caches), default=0))
        # CUDA graphs where the plan uses one GPU: a copy between two GPUs inside a capture waits on the other GPU's
        # stream, which invalidates it (2x H100, 2026-11-27: cudaErrorStreamCaptureInvalidated on each capture,
        # then an illegal address that aborted the process); several GPUs run eagerly
        self.use_graphs = use_cuda_graphs and devices.cuda and len(graph_gpus(plan, out_dev)) <= 1
        fast = make_fast_helpers(self.cfg, dtype, compile and devices.cuda)
        self.rt = Runtime(self.cfg, inv, plan, devices, self.weights, self.caches, stagers, self.counters, source,
                          dtype, self.threads, OffloadRules(inv, plan, devices, self.weights.device_of), out_dev,
                          self.max_pos, fast)
        self.builder = ForwardBuilder(self.rt)
        self._programs: dict[tuple, Program] = {}
        self._states: dict[tuple, dict[str, Any]] = {}
        self.full_cells = min((c.cells for c in self.caches if not c.swa), default=self.max_pos)
        self.charge_scratch = False     # a dry run for real GPUs: the accountant charges each op's scratch too

    # ---- running -------------------------------------------------------------------------------------------------

    def program(self, T: int, n_out: int, n_kv: int, fast: bool = False) -> Program:
        key = (T, n_out, n_kv, fast)
        if key not in self._programs:
            self._programs[key] = self.builder.build(T, n_out, n_kv, fast)
        return self._programs[key]

    def _n_kv(self, end: int) -> int:
        return min(self.full_cells, ceil_to(end, DECODE_BUCKET))

    def _check(self, pos0: int, T: int) -> None:
        if pos0 + T > self.max_pos:
            raise InputError(f"positions {pos0}..{pos0 + T - 1} exceed the KV cache of {self.max_pos} cells")

    def _externals(self, program: Program, tokens: torch.Tensor, pos: torch.Tensor) -> dict[str, Any]:
        state: dict[str, Any] = {"tokens": tokens}
        for dev in program.device_inputs.get("pos", []):
            # a copy per device, as on real GPUs (on logical ones .to() would hand every device the host tensor,
            # which the accountant then charges to one device only)
            state[f"pos@{dev}"] = pos.to(self.devices.torch(dev), copy=self.devices.logical)
        return state

    def forward(self, tokens: Sequence[int] | torch.Tensor, pos0: int,
                n_out: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """One ubatch: tokens at positions pos0.., KV cache updated; (logits [n_out, V] float32 of the last n_out
        tokens, their argmax). On CUDA a ubatch without uploads replays CUDA graphs captured on its first run."""
        tok = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)
        T = tok.numel()
        self._check(pos0, T)
        fast = T == 1 and self.use_graphs and bool(self.rt.fast)
        program = self.program(T, min(n_out, T), self._n_kv(pos0 + T), fast)
        if self.use_graphs and program.graphable:
            state = self._run_graphs(program, tok, torch.arange(pos0, pos0 + T, dtype=torch.int64))
            if state is not None:
                return state[program.outputs["logits"]], state[program.outputs["next"]]
        pos = torch.arange(pos0, pos0 + T, dtype=torch.int64)
        state = self._externals(program, tok, pos)
        run_eager(program, state, self.counters, self.acct if self.devices.logical else None,
                  scratch=self.charge_scratch)
        return state[program.outputs["logits"]], state[program.outputs["next"]]

    def _run_graphs(self, program: Program, tok: torch.Tensor, pos: torch.Tensor) -> dict[str, Any] | None:
        """Replay `program`'s graphs with these inputs (capturing them on first use); None if capture fails."""
        key = id(program)
        state = self._states.get(key)
        first = state is None
        if first:
            state = self._static_inputs(program, tok.numel())
            self._set_inputs(program, state, tok, pos)
            runner = GraphRunner(program, self.devices)
            before = _snapshot(self.counters)
            run_eager(program, state, self.counters, free=not runner.needs_warm_state)   # warm-up, compiles
            program.per_run = _delta(self.counters, before)
            try:
                runner.capture(state)
            except RuntimeError as e:     # e.g. an op that synchronises: this program runs eagerly from now on
                program.graph_failed = f"{type(e).__name__}: {e}"[:300]
                K.CAPABILITIES.fell_back("CUDA graph capture", e)
                torch.cuda.synchronize()
                return None
            program.graphs = runner
            self._states[key] = state
        self._set_inputs(program, state, tok, pos)
        program.graphs.replay(state)
        if not first:             # the first run was counted by the warm-up
            self.counters.add(program.per_run)
        return state

    def prefill(self, tokens: Sequence[int] | torch.Tensor, pos0: int, n_ubatch: int, n_out: int = 1) -> torch.Tensor:
        """Process tokens in ubatches of n_ubatch; logits of the last n_out tokens of the last ubatch."""
        tok = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)
        logits = torch.empty(0)
        for start in range(0, tok.numel(), n_ubatch):
            chunk = tok[start:start + n_ubatch]
            last = start + n_ubatch >= tok.numel()
            logits, _ = self.forward(chunk, pos0 + start, n_out if last else 1)
        return logits

    def decode(self, token: int, pos: int) -> int:
        """One greedy decode step: feed `token` at `pos`, return the argmax of its logits (from CUDA graphs on
        CUDA unless a step must read routed experts on the host)."""
        _, nxt = self.forward([token], pos)
        return int(nxt[0])

    def _static_inputs(self, program: Program, T: int) -> dict[str, Any]:
        pin = self.devices.cuda
        state: dict[str, Any] = {"tokens": torch.zeros(T, dtype=torch.int64, pin_memory=pin),
                                 "_pos_host": torch.zeros(T, dtype=torch.int64, pin_memory=pin)}
        for dev in program.device_inputs.get("pos", []):
            state[f"pos@{dev}"] = torch.zeros(T, dtype=torch.int64, device=self.devices.torch(dev))
        return state

    def _set_inputs(self, program: Program, state: dict[str, Any], tok: torch.Tensor, pos: torch.Tensor) -> None:
        state["tokens"].copy_(tok)
        state["_pos_host"].copy_(pos)
        for dev in program.device_inputs.get("pos", []):
            state[f"pos@{dev}"].copy_(state["_pos_host"], non_blocking=True)

    def generate(self, prompt: Sequence[int], n_gen: int, n_ubatch: int = 512) -> list[int]:
        """Greedy tokens after `prompt` (positions from 0)."""
        logits = self.prefill(prompt, 0, n_ubatch)
        out = [int(logits[-1].argmax())]
        for i in range(n_gen - 1):
            out.append(self.decode(out[-1], len(prompt) + i))
        return out

    # ---- memory -----------------------------------------------------------------------------------------------------

    def close(self) -> None:
        self._programs.clear()
        self._states.clear()
        self.weights.tensors.clear()
        self.weights.buffers.clear()
        self.weights.replicas.clear()
        self.caches.clear()
        if self._own_cache:
            self.cache.close()


def graph_gpus(plan: Plan, out_dev: str) -> set[str]:
    """The GPUs a plan's forward pass runs on (weights, KV and the output layer): more than one rules out CUDA
    graphs (TorchModel)."""
    return {d for d in (*plan.devices(), out_dev) if is_gpu(d)}


def _snapshot(c: Counters) -> Counters:
    s = Counters()
    s.add(c)
    return s


def _delta(c: Counters, before: Counters) -> Counters:
    d = Counters()
    d.add(c)
    neg = Counters()
    neg.add(before)
    for k, v in neg.ops.items():
        d.ops[k] -= v
    for k, v in neg.offloaded.items():
        d.offloaded[k] -= v
    d.upload_bytes -= neg.upload_bytes
    d.upload_model_bytes -= neg.upload_model_bytes
    d.uploads -= neg.uploads
    d.transfer_bytes -= neg.transfer_bytes
    d.transfers -= neg.transfers
    d.ops = +d.ops
    d.offloaded = +d.offloaded
    return d


# ---- the engine ------------------------------------------------------------------------------------------------------

@dataclass
class TorchEngine(Engine):
    """Measure plans by running the model's real forward pass in PyTorch.

    compute_dtype "bf16" or "fp32"; device_map None (real GPUs if CUDA is available, else logical GPUs),
    "logical", or {"CUDA0": "cuda:0", ...}; seed and routing ("uniform" or "zipf:S") for synthetic weights;
    weights "auto" (the GGUF when the inventory came from a file), "synthetic" or "gguf";
    logical_gpu_bytes: budget per logical GPU (default 24 GiB); compile: torch.compile the small decode ops
    (CUDA only); keep_weights: keep weight buffers between measure() calls of the same model and source."""
    compute_dtype: str = "bf16"
    device_map: Any = None
    seed: int = 0
    routing: str = "uniform"
    use_cuda_graphs: bool = True
    weights: str = "auto"
    logical_gpu_bytes: Any = None
    compile: bool = True
    keep_weights: bool = True
    name: str = "torch"
    predicts_memory = True     # its dry-run accountant (predict_memory), not llama.cpp's memory
    _cache: BufferCache = field(default_factory=BufferCache, repr=False)
    _overhead: dict[str, int] = field(default_factory=dict, repr=False)
    _source: Any = field(default=None, repr=False)
    _predictions: dict[tuple, MemoryReport] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.compute_dtype not in DTYPES:
            raise InputError(f"bad compute_dtype {self.compute_dtype!r}: use bf16 or fp32")

    def _source_for(self, inv: ModelInventory) -> WeightSource:
        key = (inv.name, inv.source, inv.total_bytes(), self.weights, self.seed, self.routing)
        if self._source is None or self._source[0] != key:
            self._source = (key, open_source(inv, self.weights, self.seed, self.routing))
        return self._source[1]

    def _prepare_cache(self, inv: ModelInventory, plan: Plan, devices: Devices) -> BufferCache | None:
        """The weight cache for this model and placement, with the buffers the plan does not use freed."""
        if not self.keep_weights:
            return None
        source = self._source_for(inv)
        self._cache.reset_for((id(source), self.compute_dtype, devices.logical))
        self._cache.drop_unused_now(buffer_keys(inv, plan, DTYPES[self.compute_dtype]))
        return self._cache

    def load(self, inv: ModelInventory, plan: Plan, min_cells: int = 0) -> TorchModel:
        """Place `inv` as `plan` says (raises OutOfMemory / torch.cuda.OutOfMemoryError when it does not fit)."""
        devices = resolve_devices(plan.devices(), self.device_map, self.logical_gpu_bytes)
        source = self._source_for(inv)
        cache = self._prepare_cache(inv, plan, devices)
        return TorchModel(inv, plan, source, devices, dtype=DTYPES[self.compute_dtype], min_cells=min_cells,
                          use_cuda_graphs=self.use_cuda_graphs, compile=self.compile, cache=cache)

    def context_overhead(self, devices: Devices) -> dict[str, int]:
        """CUDA context + library handles per real GPU, not seen by torch's allocator (measured once)."""
        out = {}
        for g in devices.gpus if devices.cuda else ():
            if g not in self._overhead:
                d = devices.torch(g)
                a = torch.ones(256, 256, device=d)
                (a @ a).sum().item()
                torch.cuda.synchronize(d)
                free, total = torch.cuda.mem_get_info(d)
                self._overhead[g] = max(0, total - free - torch.cuda.memory_reserved(d))
            out[g] = self._overhead[g]
        return out

    def predict_memory(self, inv: ModelInventory, plan: Plan, hw: HardwareProfile | None,
                       bench: BenchRun) -> MemoryReport:
        """What measure() would hold per device, without allocating a byte: the same TorchModel built on the meta
        device (weights per device in the dtype the engine loads, KV caches, the tied output copy), the same
        forward calls as measure() runs (_bench's sequence, see _dry_calls), the same executor and accountant,
        so staging buffers (two per shape) and live activations are charged as on a logical GPU. A GPU's total
        is that accountant's peak, plus on real GPUs the CUDA context of `hw` (its GPU overhead; on logical
        GPUs there is none, as measure() reports none). Parts: weights; kv; compute = staging buffers and the
        activations live at the peak; overhead. The CPU: its weights as host_pinned (the engine copies them
        into anonymous memory), its peak activations as compute, planner.memory's process overhead.
        Cached per plan and bench run."""
        devices = resolve_devices(plan.devices(), self.device_map, self.logical_gpu_bytes)
        key = (inv.name, inv.source, inv.total_bytes(), plan.id, bench, self.compute_dtype, devices.gpus,
               devices.logical, None if hw is None else hw.name, None if hw is None else
               tuple(g.overhead_bytes for g in hw.gpus))
        hit = self._predictions.get(key)
        if hit is None:
            source = self._source_for(inv)
            acct = dry_accountant(inv, plan, devices, DTYPES[self.compute_dtype], bench,
                                  getattr(source, "metadata", None), source)
            hit = memory_report(acct, devices, hw)
            if len(self._predictions) > 1024:
                self._predictions.clear()
            self._predictions[key] = hit
        return hit

    def measure(self, inv: ModelInventory, plan: Plan, bench: BenchRun) -> Measurement:
        devices = resolve_devices(plan.devices(), self.device_map, self.logical_gpu_bytes)
        overhead = self.context_overhead(devices)
        self._prepare_cache(inv, plan, devices)      # what the last plan kept and this one does not: freed now
        if devices.cuda:
            gc.collect()
            torch.cuda.empty_cache()
            for g in devices.gpus:
                torch.cuda.reset_peak_memory_stats(devices.torch(g))
        raw: dict[str, Any] = {"engine": "torch", "logical_gpus": devices.logical, "compute_dtype": self.compute_dtype,
                               "routing": self.routing, "seed": self.seed, "context_bytes": dict(overhead)}
        model = None
        events_before = len(K.CAPABILITIES.events)
        try:
            t0 = time.perf_counter()
            model = self.load(inv, plan, min_cells=min_cells(bench))
            raw["load_s"] = time.perf_counter() - t0
            raw["weights"] = model.rt.source.kind
            raw["n_threads"] = model.threads
            raw["cuda_graphs"] = model.use_graphs
            pp, tg = _bench(model, plan, bench, self.seed)
            raw.update(pp)
            raw.update(tg)
            raw["counters"] = model.counters.to_dict()
            raw["kv_cells"] = [c.cells for c in model.caches]
            peak = _peak_bytes(model, devices, overhead)
            raw["static_bytes"] = dict(model.acct.static)
            raw["static_parts"] = {d: dict(c) for d, c in model.acct.parts.items()}
            raw["fallbacks"] = self._fallbacks(inv, plan, events_before)
            return Measurement(pp_tps=pp.get("pp_tps", 0.0), tg_tps=tg.get("tg_tps", 0.0), peak_bytes=peak,
                               host_bytes=_host_peak(), raw=raw)
        except (OutOfMemory, torch.cuda.OutOfMemoryError) as e:
            return Measurement.failed(f"out of memory: {_one_line(e)}", peak_bytes=_safe_peak(model, devices, overhead),
                                      host_bytes=_host_peak(), raw=raw)
        except InputError:
            raise
        except Exception as e:     # a crash of the run (kernel, compiler, driver): a failed measurement
            return Measurement.failed(f"{type(e).__name__}: {_one_line(e)}",
                                      peak_bytes=_safe_peak(model, devices, overhead), host_bytes=_host_peak(), raw=raw)
        finally:
            if model is not None:
                model.close()
            del model
            gc.collect()
            if devices.cuda:
                torch.cuda.empty_cache()


    def _fallbacks(self, inv: ModelInventory, plan: Plan, events_before: int) -> list[str]:
        """The slower paths this measurement ran on: fast paths dropped during it or earlier in the process, and
        experts in RAM without the C kernel (torch's per-expert loop instead)."""
        out = [*K.CAPABILITIES.events[events_before:],
               *(f"{d} (dropped earlier in this process)" for d in K.CAPABILITIES.dropped())]
        experts_in_ram = any(t.is_expert and plan.assignment.get(t.name) == "CPU" for t in inv.allocated())
        if experts_in_ram and not cpu_moe.available(DTYPES[self.compute_dtype]):
            out.append("cpu_moe C kernel unavailable (no C compiler, or no flags built it): experts in RAM run "
                       "torch's per-expert loop")
        return list(dict.fromkeys(out))


def min_cells(wl: BenchRun) -> int:
    """KV cells a measurement of `wl` needs (its deepest position, plus one)."""
    return wl.depth + max(wl.n_prompt, wl.n_gen) + 1


# ---- the dry run (predict_memory) ----------------------------------------------------------------------------------

DRY_BUDGET = 1 << 62


class _DrySource:
    """Fills nothing (meta tensors hold no values); the real source's metadata. No router bias: a bias is added to
    the router's logits inside its op, so it changes no activation that outlives the op."""
    kind = "dry"

    def __init__(self, metadata: Mapping[str, Any] | None) -> None:
        self.metadata = metadata

    def fill(self, name: str, out: torch.Tensor) -> None:
        pass

    def router_bias(self, layer: int) -> torch.Tensor | None:
        return None


def _dry_calls(wl: BenchRun, ub: int, n_kv: Any) -> list[tuple[str, int, int]]:
    """The forward calls of _bench for `wl`, as ("prefill", pos0, n_tokens) and ("decode", pos, 1), with the
    repeats that cannot change the accountant's peak left out: a call sequence repeated a third time, and a
    decode step whose program (its n_kv bucket) ran in both steps before it. After two runs of the same calls,
    every staging buffer they use exists (two per shape, taken in turn) and their live activations are the same
    each run, so neither the static bytes nor the peak can move (exact, not an approximation)."""
    calls: list[tuple[str, int, int]] = []
    d = wl.depth
    if d:
        calls.append(("prefill", 0, d))
    runs = min(wl.repetitions + 1, 2)                # the warm-up and the timed repetitions
    if wl.n_prompt:
        calls += [("prefill", d, wl.n_prompt)] * runs
    if wl.n_gen:
        keys = [n_kv(d + i + 1) for i in range(wl.n_gen)]
        steps = [i for i, k in enumerate(keys) if i < 2 or not (keys[i - 1] == k == keys[i - 2])]
        calls += [("decode", d + i, 1) for i in steps] * runs
    return calls


def dry_accountant(inv: ModelInventory, plan: Plan, devices: Devices, dtype: torch.dtype, wl: BenchRun,
                   metadata: Mapping[str, Any] | None = None, source: WeightSource | None = None) -> Accountant:
    """The accountant of a measurement of `plan` on `devices`, from a run on the meta device: the placement,
    KV caches, programs and executor of a real run (TorchModel, run_eager), every tensor shaped but empty.
    For real GPUs (`devices` not logical) it also charges what a CUDA run holds beyond the engine's tensors,
    seen on two H100s (benchmarks/torch_memory_probe.py): cuBLAS's workspace on every GPU that holds weights,
    the synthetic `source`'s value pools on each GPU, and each op's scratch (Op.scratch: the grouped experts'
    temporaries of a prompt ubatch) on top of what is live as it ends."""
    meta = torch.device("meta")
    dry = Devices({d: meta for d in devices.torch_of}, devices.gpus, True,
                  {d: DRY_BUDGET for d in (*devices.gpus, "CPU")})
    threads = torch.get_num_threads()
    try:
        model = TorchModel(inv, plan, _DrySource(metadata), dry, dtype=dtype, min_cells=min_cells(wl),
                           use_cuda_graphs=False, compile=False, cache=BufferCache(), metadata=metadata)
        if not devices.logical:
            _charge_cuda_extras(model, source)
        for how, pos0, n in _dry_calls(wl, plan.knobs.n_ubatch_eff, model._n_kv):
            tokens = torch.zeros(n, dtype=torch.int64)
            if how == "prefill":
                model.prefill(tokens, pos0, plan.knobs.n_ubatch_eff)
            else:
                model.forward(tokens, pos0)
        model.close()
    finally:
        torch.set_num_threads(threads)
    return model.acct


def _charge_cuda_extras(model: TorchModel, source: WeightSource | None) -> None:
    """What a real GPU holds that the engine's tensors do not show (dry_accountant), charged before the calls."""
    model.charge_scratch = True
    acct, w = model.acct, model.weights
    for g in model.devices.gpus:
        if acct.parts.get(g, {}).get("weights"):
            acct.reserve(g, CUBLAS_WORKSPACE, "cuBLAS workspace", "library")
    if isinstance(source, SyntheticSource):
        placed = {n: (d, w.tensors[n].dtype) for n, d in w.device_of.items() if d in model.devices.gpus}
        for g, n in source.pool_bytes(placed).items():
            acct.reserve(g, n, "synthetic weight pools", "library")


def memory_report(acct: Accountant, devices: Devices, hw: HardwareProfile | None) -> MemoryReport:
    """planner.memory's MemoryReport of a (dry) accountant: see TorchEngine.predict_memory."""
    out: dict[str, DeviceMemory] = {}
    for d in sorted({*devices.gpus, "CPU"}, key=device_sort_key):
        parts = acct.parts.get(d, {})
        w, kv = int(parts.get("weights", 0)), int(parts.get("kv", 0))
        compute = int(acct.peak.get(d, 0)) - w - kv
        if d == "CPU":
            overhead = HOST_PROCESS_OVERHEAD
        elif devices.logical:
            overhead = 0
        elif hw is not None and gpu_index(d) < len(hw.gpus):
            overhead = hw.gpu(d).overhead_bytes
        else:
            overhead = DEFAULT_GPU_OVERHEAD
        out[d] = DeviceMemory(w, kv, compute, overhead)
    cpu_w = out["CPU"].weights
    return MemoryReport(out, host_mapped=0, host_pinned=cpu_w,
                        notes=("torch engine: a dry run of its own placement and accountant (meta device)",))


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text[:300]


def _bench(model: TorchModel, plan: Plan, wl: BenchRun, seed: int) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)
    vocab = model.cfg.n_vocab
    prompt = torch.randint(0, vocab, (wl.depth + max(wl.n_prompt, 1),), generator=g)
    ub = plan.knobs.n_ubatch_eff
    d = wl.depth
    if d:
        model.prefill(prompt[:d], 0, ub)
    pp: dict[str, Any] = {}
    if wl.n_prompt:
        chunk = prompt[d:d + wl.n_prompt]
        model.prefill(chunk, d, ub)                  # warm-up
        before = _snapshot(model.counters)
        times = []
        for _ in range(wl.repetitions):
            t0 = now(model.devices)
            model.prefill(chunk, d, ub)
            times.append(now(model.devices) - t0)
        pp = _stats("pp", wl.n_prompt, times)
        pp["pp_counters_per_run"] = _per_run(_delta(model.counters, before), wl.repetitions)
    tg: dict[str, Any] = {}
    if wl.n_gen:
        first = int(prompt[d - 1]) if d else 0

        def run() -> None:
            tok = first
            for i in range(wl.n_gen):
                tok = model.decode(tok, d + i)
        run()                                         # warm-up (captures the decode graphs)
        before = _snapshot(model.counters)
        times = []
        for _ in range(wl.repetitions):
            t0 = now(model.devices)
            run()
            times.append(now(model.devices) - t0)
        tg = _stats("tg", wl.n_gen, times)
        tg["tg_counters_per_run"] = _per_run(_delta(model.counters, before), wl.repetitions)
    synchronize(model.devices)
    return pp, tg


def _stats(prefix: str, n_tokens: int, times: list[float]) -> dict[str, Any]:
    tps = [n_tokens / t for t in times]
    return {f"{prefix}_tps": statistics.median(tps), f"{prefix}_tps_samples": tps,
            f"{prefix}_tps_min": min(tps), f"{prefix}_tps_max": max(tps),
            f"{prefix}_tps_stdev": statistics.stdev(tps) if len(tps) > 1 else 0.0,
            f"{prefix}_s_samples": times}


def _per_run(c: Counters, reps: int) -> dict[str, Any]:
    d = c.to_dict()
    return {"upload_bytes": d["upload_bytes"] // reps, "upload_model_bytes": d["upload_model_bytes"] // reps,
            "transfer_bytes": d["transfer_bytes"] // reps,
            "ops": {k: v // reps for k, v in d["ops"].items()},
            "offloaded": {k: v // reps for k, v in d["offloaded"].items()}}


def _peak_bytes(model: TorchModel, devices: Devices, overhead: dict[str, int]) -> dict[str, int]:
    if devices.logical:
        return {g: int(model.acct.peak.get(g, 0)) for g in devices.gpus}
    return {g: int(torch.cuda.max_memory_allocated(devices.torch(g))) + overhead.get(g, 0) for g in devices.gpus}


def _safe_peak(model: TorchModel | None, devices: Devices, overhead: dict[str, int]) -> dict[str, int]:
    try:
        if model is None:
            if devices.cuda:
                return {g: int(torch.cuda.max_memory_allocated(devices.torch(g))) + overhead.get(g, 0)
                        for g in devices.gpus}
            return {}
        return _peak_bytes(model, devices, overhead)
    except RuntimeError:
        return {}


def _host_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


__all__ = ["TorchEngine", "TorchModel", "is_gpu"]
