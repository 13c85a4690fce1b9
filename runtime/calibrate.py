"""`offload-tuner calibrate`: measure this machine's ceilings and write a HardwareProfile JSON (--hardware).

What is measured (several timed runs after a warm-up, device-synchronised):
- GPU: memory bandwidth as a GEMV reads it (a 1 GiB weight matrix in the compute dtype times a vector) and a
  device-to-device copy; GEMM FLOP/s (8192 x 4096 x 4096); VRAM; the CUDA context + library overhead;
- host: GEMV bandwidth on all threads (1 GiB; the best over two shapes, 65536 x 8192 and 16384 x 32768 in bf16,
  of torch.mv, W @ x, F.linear, x @ W.t() and the engine's own expert kernel), a plain copy, GEMM FLOP/s at
  batch 512 and 32 on the same 1 GiB weight (the best of W @ X, F.linear(Xt, W) and Xt @ W.t(): their speed
  differs up to ~10x at batch 32);
- link: host -> GPU and GPU -> host, from page-locked and from ordinary memory (1 GiB);
- overheads: a small kernel's launch (eager) and its cost inside a CUDA graph, a device split (GPU -> host ->
  GPU round trip of one activation row with synchronisation), a CPU op's thread fork/join; for op offload the
  read-back of a ubatch's expert ids (16 KiB into ordinary memory + stream sync) and the extra cost of one
  host -> GPU copy call (256 copies of 64 KiB against one of 16 MiB).
The shares of these ceilings llama.cpp's own kernels reach (Overheads.*_eff) cannot be measured without
llama.cpp: every profile gets planner.hardware.LLAMACPP_SHARES, fitted on measured llama-bench runs
(docs/cost_model.md).
Ceilings (bandwidths, FLOP/s) come from the fastest timed run, not the median: a ceiling is what the machine can
do, and noise from a shared host (other tenants, frequency, page placement) only ever lowers a run, by 10-20%
between calls on the GPU box. The median of the same runs is kept next to each as `<key>_median`. The per-op
overheads (launch, graph op, split, CPU op) are typical costs that every op pays, so they stay medians.
The profile's per-layer overheads are those per-op costs times OPS_PER_LAYER (ggml runs ~20 nodes per MoE
layer per token). Without a GPU the host terms are measured and the profile has no GPUs
(calibration.gpu = "absent"). Everything measured is kept under "calibration" in the JSON.
"""
from __future__ import annotations

import json
import logging
import os
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from collections.abc import Callable

from planner.errors import InputError
from planner.hardware import GPU, LLAMACPP_SHARES, HardwareProfile, Host, Link, Overheads, fmt_bytes

log = logging.getLogger(__name__)

GiB = 1 << 30
OPS_PER_LAYER = 20
COPY_CALLS = 256      # small host -> GPU copies timed for the per-call cost


def _torch():
    try:
        import torch
    except ImportError as e:
        raise InputError("calibrate needs PyTorch (pip install torch)") from e
    return torch


@dataclass(frozen=True)
class Timing:
    best_s: float       # the fastest run: what ceilings are computed from
    median_s: float     # the typical run: what per-op overheads are computed from


def _time(fn: Callable[[], Any], sync: Callable[[], None], reps: int, warmup: int = 2) -> Timing:
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return Timing(best_s=min(times), median_s=statistics.median(times))


def _median_time(fn: Callable[[], Any], sync: Callable[[], None], reps: int, warmup: int = 2) -> float:
    return _time(fn, sync, reps, warmup).median_s


def _ceiling(out: dict[str, float], key: str, amount: float, t: Timing) -> None:
    """out[key] = amount per second of the fastest run, out[key + "_median"] = of the median run."""
    out[key] = amount / t.best_s
    out[f"{key}_median"] = amount / t.median_s


def _filled(torch, shape: tuple[int, ...], dtype, device) -> Any:
    """A large tensor of finite random-looking values, filled fast (a 4M-value random pool, repeated)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    flat = t.view(-1)
    pool = torch.randn(min(flat.numel(), 1 << 22), device=device).to(dtype)
    for i in range(0, flat.numel(), pool.numel()):
        n = min(pool.numel(), flat.numel() - i)
        flat[i:i + n].copy_(pool[:n])
    return t


# GEMV shapes on the host, as the dot length K: the same bytes as N x K (65536 x 8192 and 16384 x 32768 for
# 1 GiB of bf16). Which shape is fastest differs between routes by up to ~25% on the GPU box (16-core Xeon with
# AMX and AVX512-BF16, PyTorch 2.11; e.g. x @ W.t() 56 GB/s at 65536 x 8192, 75 at 16384 x 32768), so the
# ceiling takes the best.
GEMV_K = (8192, 32768)
# GEMV routes: y = W x for W [N, K], x [K]
GEMV_ROUTES = ("mv", "matmul", "linear", "matmul_t", "cpu_moe")
# GEMM forms of Y = A X for A [N, K], X [K, batch] (Xt = X.T contiguous, [batch, K]). oneDNN takes different
# kernels: at batch 32 on the GPU box A @ X ran at 0.14-1.2 TFLOP/s, F.linear(Xt, A) at 1.5-1.7 and Xt @ A.t()
# at 1.6-2.2; at batch 512 all three ~3.1-4.4 (1 GiB weight).
GEMM_FORMS = ("matmul", "linear", "matmul_t")


def _gemv_routes(torch, W, x, dtype) -> dict[str, Callable[[], Any]]:
    """GEMV_ROUTES that run here (cpu_moe needs its C kernel) -> a call computing W x."""
    import torch.nn.functional as F
    routes = {"mv": lambda: torch.mv(W, x), "matmul": lambda: W @ x[:, None],
              "linear": lambda: F.linear(x[None], W), "matmul_t": lambda: x[None] @ W.t()}
    from runtime.torch_engine import cpu_moe
    if cpu_moe.available(dtype):
        ids = torch.zeros(1, 1, dtype=torch.int64)
        W3 = W.unsqueeze(0)
        n_threads = torch.get_num_threads()
        routes["cpu_moe"] = lambda: cpu_moe.moe_up(x[None], ids, W3, n_threads)
    return routes


def _gemm_forms(torch, A, X) -> dict[str, Callable[[], Any]]:
    """GEMM_FORMS -> a call computing A X (or its transpose), A [N, K], X [K, batch]."""
    import torch.nn.functional as F
    Xt = X.t().contiguous()
    return {"matmul": lambda: A @ X, "linear": lambda: F.linear(Xt, A), "matmul_t": lambda: Xt @ A.t()}


def measure_host(dtype_name: str = "bf16", size_bytes: int = GiB, threads: int | None = None,
                 reps: int = 5) -> dict[str, float]:
    torch = _torch()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    if threads:
        torch.set_num_threads(threads)
    sync = lambda: None  # noqa: E731
    esize = torch.finfo(dtype).bits // 8
    n = max(256, size_bytes // (GEMV_K[0] * esize))
    W = _filled(torch, (n, GEMV_K[0]), dtype, "cpu")
    out: dict[str, float] = {"threads": float(torch.get_num_threads())}
    log.info("#   host: GEMV on %s of weights, every route (%d threads)", fmt_bytes(W.numel() * esize),
             torch.get_num_threads())
    # GEMV through every route PyTorch offers (they differ 2x on some CPUs) and through the engine's own
    # expert kernel (runtime/torch_engine/cpu_moe.py), on each shape of GEMV_K (the same buffer, viewed);
    # the ceiling is the best of them
    best: tuple[float, float] = (0.0, 0.0)
    for k in GEMV_K:
        Wk = W.view(-1)[:(W.numel() // k) * k].view(-1, k)
        nbytes = Wk.numel() * esize
        x = torch.randn(k).to(dtype)
        for label, fn in _gemv_routes(torch, Wk, x, dtype).items():
            key = f"gemv_{label}_{Wk.shape[0]}x{k}_bytes_per_s"
            _ceiling(out, key, nbytes, _time(fn, sync, reps))
            out[f"gemv_{label}_bytes_per_s"] = max(out.get(f"gemv_{label}_bytes_per_s", 0.0), out[key])
            best = max(best, (out[key], out[f"{key}_median"]))
    out["gemv_bytes_per_s"], out["gemv_bytes_per_s_median"] = best
    log.info("#   host: copy, GEMM at batch 512 and 32, op overhead")
    dst = torch.empty_like(W)
    _ceiling(out, "copy_bytes_per_s", 2 * W.numel() * esize, _time(lambda d=dst, w=W: d.copy_(w), sync, reps))
    del dst
    # GEMM on the same weight as the GEMV (1 GiB: streamed from RAM, as a model's weights are; a 4096 x 4096
    # matrix stays in the 300 MiB L3 between runs). On the GPU box both gave 3.8-4.5 TFLOP/s at batch 512.
    for batch in (512, 32):
        X = torch.randn(W.shape[1], batch).to(dtype)
        flops = 2 * W.numel() * batch
        for form, fn in _gemm_forms(torch, W, X).items():
            _ceiling(out, f"gemm_{form}_flops_b{batch}", flops, _time(fn, sync, reps))
        top = max(GEMM_FORMS, key=lambda f: out[f"gemm_{f}_flops_b{batch}"])
        out[f"gemm_flops_b{batch}"] = out[f"gemm_{top}_flops_b{batch}"]
        out[f"gemm_flops_b{batch}_median"] = out[f"gemm_{top}_flops_b{batch}_median"]
    small = torch.randn(2048)
    t = _median_time(lambda: [small.add_(1.0) for _ in range(100)], sync, reps)
    out["cpu_op_s"] = t / 100
    return out


def measure_gpu(index: int, dtype_name: str = "bf16", size_bytes: int = GiB, reps: int = 10) -> dict[str, float]:
    torch = _torch()
    dev = torch.device(f"cuda:{index}")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    sync = lambda: torch.cuda.synchronize(dev)  # noqa: E731
    esize = torch.finfo(dtype).bits // 8
    props = torch.cuda.get_device_properties(dev)
    out: dict[str, Any] = {"name": props.name, "n_sm": int(getattr(props, "multi_processor_count", 0))}
    a = torch.ones(256, 256, device=dev)
    (a @ a).sum().item()
    free, total = torch.cuda.mem_get_info(dev)
    out["vram_bytes"] = float(total)
    out["context_bytes"] = float(max(0, total - free - torch.cuda.memory_reserved(dev)))
    k = 8192
    n = max(256, size_bytes // (k * esize))
    log.info("#   CUDA%d %s: GEMV, copy, GEMM", index, props.name)
    W = _filled(torch, (n, k), dtype, dev)
    x = torch.randn(k, 1, device=dev).to(dtype)
    _ceiling(out, "gemv_bytes_per_s", W.numel() * esize, _time(lambda w=W: w @ x, sync, reps))
    dst = torch.empty_like(W)
    _ceiling(out, "copy_bytes_per_s", 2 * W.numel() * esize, _time(lambda d=dst, w=W: d.copy_(w), sync, reps))
    del dst, W
    A = _filled(torch, (8192, 4096), dtype, dev)
    B = _filled(torch, (4096, 4096), dtype, dev)
    _ceiling(out, "gemm_flops", 2 * 8192 * 4096 * 4096, _time(lambda a=A, b=B: a @ b, sync, reps))
    del A, B
    # the link, both ways, page-locked and ordinary host memory
    nbytes = min(size_bytes, GiB)
    log.info("#   CUDA%d: the PCIe link both ways, pinned and pageable", index)
    dev_buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    for kind, pinned in (("pinned", True), ("pageable", False)):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        host.fill_(1)
        _ceiling(out, f"h2d_{kind}_bytes_per_s", nbytes,
                 _time(lambda d=dev_buf, h=host, p=pinned: d.copy_(h, non_blocking=p), sync, max(3, reps // 2)))
        _ceiling(out, f"d2h_{kind}_bytes_per_s", nbytes,
                 _time(lambda d=dev_buf, h=host, p=pinned: h.copy_(d, non_blocking=p), sync, max(3, reps // 2)))
        del host
    del dev_buf
    log.info("#   CUDA%d: launch, CUDA graph, split, read-back and copy-call costs", index)
    out.update(_measure_op_costs(torch, dev, sync, reps))
    return out


def _measure_op_costs(torch: Any, dev: Any, sync: Callable[[], None], reps: int) -> dict[str, float]:
    """What each op costs beside its bytes and flops: eager launch, inside a CUDA graph, a GPU -> host -> GPU
    split of one row, and what op offload adds per uploaded expert tensor (launch_s, graph_op_s, split_s,
    sync_s, copy_call_s)."""
    out: dict[str, float] = {}
    small = torch.zeros(2048, device=dev)
    t = _median_time(lambda: [small.add_(1.0) for _ in range(200)], sync, reps)
    out["launch_s"] = t / 200
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        small.add_(1.0)
    torch.cuda.current_stream(dev).wait_stream(stream)
    with torch.cuda.graph(graph):
        for _ in range(200):
            small.add_(1.0)
    t = _median_time(graph.replay, sync, reps)
    out["graph_op_s"] = t / 200
    row = torch.zeros(1, 4096, device=dev)
    host_row = torch.zeros(1, 4096, pin_memory=True)

    def split() -> None:
        host_row.copy_(row, non_blocking=True)
        torch.cuda.current_stream(dev).synchronize()
        row.copy_(host_row, non_blocking=True)
    t = _median_time(split, sync, reps * 10)
    out["split_s"] = t
    # what op offload adds per uploaded expert tensor (ggml_backend_sched_compute_splits): the expert ids read
    # back into ordinary host memory with a stream sync, and one cudaMemcpyAsync per run of used experts
    ids = torch.zeros(512 * 8, dtype=torch.int32, device=dev)      # a 512-token ubatch's top-8 ids
    ids_host = torch.empty(512 * 8, dtype=torch.int32)

    def readback() -> None:
        ids_host.copy_(ids)
        torch.cuda.current_stream(dev).synchronize()
    out["sync_s"] = _median_time(readback, sync, reps * 10)
    chunk = 64 << 10
    src = torch.empty(COPY_CALLS * chunk, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(COPY_CALLS * chunk, dtype=torch.uint8, device=dev)
    big = _median_time(lambda: dst.copy_(src, non_blocking=True), sync, reps)

    def calls() -> None:
        for i in range(COPY_CALLS):
            dst[i * chunk:(i + 1) * chunk].copy_(src[i * chunk:(i + 1) * chunk], non_blocking=True)
    # the same bytes in COPY_CALLS calls, less the one-call time: what each call adds
    out["copy_call_s"] = max(0.0, (_median_time(calls, sync, reps) - big) / (COPY_CALLS - 1))
    return out


def _ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _is_rate(key: str) -> bool:
    return "bytes_per_s" in key or "flops" in key


def merge_sweeps(sweeps: list[dict[str, Any]]) -> dict[str, Any]:
    """One measurement from several whole sweeps: each ceiling (a rate: bytes/s, FLOP/s) the best sweep's, as a
    ceiling is the best run; each per-op time (launch, split, ...) and each `_median` the median over sweeps;
    anything else (name, sizes, threads) the first sweep's."""
    out: dict[str, Any] = {}
    for key, first in sweeps[0].items():
        vals = [s[key] for s in sweeps if isinstance(s.get(key), (int, float))]
        if not isinstance(first, (int, float)) or isinstance(first, bool) or len(vals) != len(sweeps):
            out[key] = first
        elif _is_rate(key) and not key.endswith("_median"):
            out[key] = max(vals)
        elif _is_rate(key) or key.endswith("_s"):
            out[key] = statistics.median(vals)
        else:
            out[key] = first
    return out


# the ceilings the profile takes, by where they sit in a sweep (what `sweep_spread` reports)
HEADLINE_HOST = ("gemv_bytes_per_s", "copy_bytes_per_s", "gemm_flops_b512")
HEADLINE_GPU = ("gemv_bytes_per_s", "gemm_flops", "h2d_pinned_bytes_per_s", "h2d_pageable_bytes_per_s")


def sweep_spread(sweeps: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, float]:
    """max / min - 1 of each ceiling over the sweeps: how much one short calibration can be off on this machine."""
    out = {}
    for k in keys:
        vals = [s[k] for s in sweeps if s.get(k)]
        if len(vals) == len(sweeps) and min(vals) > 0:
            out[k] = max(vals) / min(vals) - 1
    return out


def host_load() -> dict[str, float]:
    """The 1-minute load average and the CPU count (a busy host reads every ceiling low, the GPU's too: the
    timing loops are launched from the host)."""
    try:
        load1 = os.getloadavg()[0]
    except OSError:
        load1 = float("nan")
    return {"load1": load1, "cpus": float(os.cpu_count() or 1)}


SWEEP_PAUSE_S = 2.0      # between sweeps: lets clocks and the page cache settle after the last one
BUSY_LOAD_SHARE = 0.25   # a 1-minute load above this share of the CPUs before measuring: say the host is busy


def calibrate(dtype_name: str = "bf16", size_bytes: int = GiB, threads: int | None = None,
              name: str = "calibrated", sweeps: int = 1, pause_s: float | None = None
              ) -> tuple[HardwareProfile, dict[str, Any]]:
    """Measure this machine (all its GPUs, its host): the HardwareProfile and every raw measurement. With
    sweeps > 1 the whole measurement repeats (pause_s apart) and the sweeps merge (merge_sweeps); their spread
    is kept, with the host's load before each."""
    torch = _torch()
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    host_sweeps: list[dict[str, Any]] = []
    gpu_sweeps: list[list[dict[str, Any]]] = []
    loads = []
    for i in range(max(1, sweeps)):
        if i:
            time.sleep(SWEEP_PAUSE_S if pause_s is None else pause_s)
        loads.append(host_load())
        log.info("# calibrate: sweep %d of %d (%s per bandwidth test, %s)", i + 1, max(1, sweeps),
                 fmt_bytes(size_bytes), f"{n_gpu} GPU{'s' if n_gpu != 1 else ''}" if n_gpu else "no GPU")
        host_sweeps.append(measure_host(dtype_name, size_bytes, threads))
        gpu_sweeps.append([measure_gpu(g, dtype_name, size_bytes) for g in range(n_gpu)])
    host = merge_sweeps(host_sweeps)
    gpus = [merge_sweeps([s[g] for s in gpu_sweeps]) for g in range(n_gpu)]
    defaults = Overheads()
    overheads = defaults
    link = Link(h2d_pinned=0.0, h2d_pageable=0.0)
    if gpus:
        g0 = gpus[0]
        link = Link(h2d_pinned=g0["h2d_pinned_bytes_per_s"], h2d_pageable=g0["h2d_pageable_bytes_per_s"],
                    copy_call_s=g0["copy_call_s"])
        overheads = replace(defaults, per_split_s=g0["split_s"], per_layer_gpu_s=g0["graph_op_s"] * OPS_PER_LAYER,
                            per_layer_cpu_s=host["cpu_op_s"] * OPS_PER_LAYER, launch_s=g0["launch_s"],
                            sync_s=g0["sync_s"], **LLAMACPP_SHARES)
    else:
        overheads = replace(defaults, per_layer_cpu_s=host["cpu_op_s"] * OPS_PER_LAYER, **LLAMACPP_SHARES)
    profile = HardwareProfile(
        name=name,
        gpus=tuple(GPU(name=g["name"], vram_bytes=int(g["vram_bytes"]), mem_bw=g["gemv_bytes_per_s"],
                       flops=g["gemm_flops"], overhead_bytes=int(g["context_bytes"]), n_sm=int(g.get("n_sm", 0)))
                   for g in gpus),
        host=Host(ram_bytes=_ram_bytes(), mem_bw=host["gemv_bytes_per_s"], flops=host["gemm_flops_b512"],
                  n_threads=int(host["threads"])),
        link=link, overheads=overheads,
        source=f"offload-tuner calibrate ({dtype_name}, {time.strftime('%Y-%m-%d %H:%M')})",
    )
    calibration: dict[str, Any] = {"dtype": dtype_name, "host": host, "gpus": gpus,
                                   "gpu": "present" if gpus else "absent", "sweeps": len(host_sweeps),
                                   "load_before": loads}
    if len(host_sweeps) > 1:
        calibration["sweep_spread"] = {"host": sweep_spread(host_sweeps, HEADLINE_HOST),
                                       **{f"CUDA{g}": sweep_spread([s[g] for s in gpu_sweeps], HEADLINE_GPU)
                                          for g in range(n_gpu)}}
    if busy := busy_note(loads):
        calibration["busy"] = busy
    return profile, calibration


def busy_note(loads: list[dict[str, float]]) -> str:
    """'' when the host was idle before every sweep, else what a user should know: its ceilings read low."""
    busy = [x["load1"] for x in loads if x["load1"] > BUSY_LOAD_SHARE * x["cpus"]]
    if not busy:
        return ""
    return (f"1-minute load {max(busy):.1f} on {int(loads[0]['cpus'])} CPUs before measuring: other work lowers "
            "every ceiling (by 10% or more on the GPU box); calibrate an idle machine")


def profile_json(profile: HardwareProfile, calibration: dict[str, Any]) -> dict[str, Any]:
    """The profile as `--hardware` reads it, with the raw measurements under "calibration"."""
    return {**profile.to_dict(), "calibration": calibration}


def summary(d: dict[str, Any]) -> str:
    """The profile JSON (profile_json) in a few lines: what `calibrate` prints without --json."""
    c = d.get("calibration", {})
    h = c.get("host", {})
    gemv = ", ".join(f"{r} {h[f'gemv_{r}_bytes_per_s'] / 1e9:.0f}" for r in GEMV_ROUTES if f"gemv_{r}_bytes_per_s" in h)
    lines = [f"host: GEMV {h.get('gemv_bytes_per_s', 0) / 1e9:.1f} GB/s ({gemv}), "
             f"copy {h.get('copy_bytes_per_s', 0) / 1e9:.1f} GB/s, "
             f"GEMM {h.get('gemm_flops_b512', 0) / 1e12:.2f} TFLOP/s (batch 512), "
             f"{h.get('gemm_flops_b32', 0) / 1e12:.2f} (batch 32), {int(h.get('threads', 0))} threads "
             f"(best runs; medians GEMV {h.get('gemv_bytes_per_s_median', 0) / 1e9:.1f} GB/s, GEMM "
             f"{h.get('gemm_flops_b512_median', 0) / 1e12:.2f} / {h.get('gemm_flops_b32_median', 0) / 1e12:.2f})"]
    for where, spread in (c.get("sweep_spread") or {}).items():
        lines.append(f"{where}: {c['sweeps']} sweeps, ceilings spread " + ", ".join(
            f"{k.replace('_bytes_per_s', '').replace('_flops', ' flops')} {100 * v:.1f}%" for k, v in spread.items()))
    if c.get("busy"):
        lines.append(f"warning: {c['busy']}")
    if not c.get("gpus"):
        lines.append("gpu: absent (no CUDA device): the profile has no GPUs; give --gpu sizes to plan for one")
    for i, g in enumerate(c.get("gpus", [])):
        lines.append(
            f"CUDA{i} {g['name']}: {fmt_bytes(g['vram_bytes'])}, GEMV {g['gemv_bytes_per_s'] / 1e12:.2f} TB/s, copy "
            f"{g['copy_bytes_per_s'] / 1e12:.2f} TB/s, GEMM {g['gemm_flops'] / 1e12:.0f} TFLOP/s, context "
            f"{fmt_bytes(g['context_bytes'])}")
        lines.append(
            f"  link: H2D pinned {g['h2d_pinned_bytes_per_s'] / 1e9:.1f} GB/s, pageable "
            f"{g['h2d_pageable_bytes_per_s'] / 1e9:.1f}; D2H pinned {g['d2h_pinned_bytes_per_s'] / 1e9:.1f}, pageable "
            f"{g['d2h_pageable_bytes_per_s'] / 1e9:.1f}")
        lines.append(f"  launch {g['launch_s'] * 1e6:.1f} us eager, {g['graph_op_s'] * 1e6:.2f} us in a graph; "
                     f"split {g['split_s'] * 1e6:.1f} us; ids read-back {g.get('sync_s', 0) * 1e6:.1f} us; "
                     f"copy call {g.get('copy_call_s', 0) * 1e6:.1f} us")
    return "\n".join(lines)


def calibrate_profile(*, out: str | None = None, dtype: str = "bf16", threads: int | None = None,
                      size: str = "1GiB", name: str = "calibrated", sweeps: int = 2) -> dict[str, Any]:
    """`offload-tuner calibrate`: the inputs checked (before minutes of measuring), this machine measured, the
    profile JSON (profile_json) returned and written to OUT when given. InputError for bad input."""
    from planner.hardware import GiB, parse_size
    size_bytes = parse_size(size or "1GiB")
    if size_bytes > 64 * GiB:
        raise InputError(f"--size {size}: at most 64GiB per bandwidth test")
    if threads is not None and not 1 <= threads <= 4096:
        raise InputError(f"--threads {threads}: give 1 or more CPU threads")
    if out:                                   # checked before minutes of measuring
        target = Path(out)
        if target.is_dir() or not target.parent.is_dir() or not os.access(target.parent, os.W_OK | os.X_OK):
            raise InputError(f"--out {out}: cannot write a file there (a folder, or a folder that does not exist "
                             "or is not writable)")
    if not 1 <= sweeps <= 20:
        raise InputError(f"--sweeps {sweeps}: give 1 to 20 whole measurements")
    profile, calibration = calibrate(dtype, size_bytes, threads, name or "calibrated", sweeps)
    d = profile_json(profile, calibration)
    if out:
        try:
            Path(out).write_text(json.dumps(d, indent=2) + "\n")
        except OSError as e:
            raise InputError(f"cannot write {out}: {e.strerror or e}") from e
        log.info("wrote %s", out)
    return d


__all__ = ["calibrate", "calibrate_profile", "summary", "profile_json", "measure_host", "measure_gpu"]
