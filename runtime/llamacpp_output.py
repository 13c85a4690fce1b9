"""What llama.cpp's benchmark binaries print, read back: results, failures, and the loader's placement lines.

Pure functions over text (the llamacpp engine runs the binaries; runtime/llamacpp_logs.py reads the memory lines).

Sources (llama.cpp vendored in llama-cpp-python 0.3.36, commit 0c1e57098; ik_llama.cpp as published in 2026):
- mainline tools/llama-bench/llama-bench.cpp: `-o json|jsonl` records with n_prompt, n_gen, n_depth, avg_ts,
  stddev_ts, samples_ns, samples_ts (one record per test: a pp test has n_gen 0, a tg test n_prompt 0). Values
  come from std::to_string, so a zero-time sample prints `inf` (not JSON): we read it as Infinity.
- ik examples/llama-bench/llama-bench.cpp: `-o json` (no jsonl) with the same throughput fields, no n_depth, and
  a "test" label: pp512, tg128, pp512+tg128, or tg128@pp4096 for `-gp 4096,128` (tg at a depth of 4096).
- ik examples/sweep-bench/sweep-bench.cpp: a table `|PP|TG|N_KV|T_PP s|S_PP t/s|T_TG s|S_TG t/s|` or, with
  `--output-format jsonl`, records with pp, tg, n_kv, t_pp, speed_pp, t_tg, speed_tg.
- src/llama-model-loader.cpp: "tensor %s (%zu MiB %s) buffer type overridden to %s" (debug, -v only);
  src/llama-model.cpp: "load_tensors: layer %3d assigned to device %s, is_swa = %d" (debug, -v only).
- Failure texts: llama-bench.cpp ("error: unrecognized buffer type", "invalid parameter for argument",
  "failed to load model", "failed to create context"), common/arg.cpp ("error while handling argument"),
  ggml-cuda.cu ("cudaMalloc failed: out of memory", "CUDA error"), ggml-alloc.c ("failed to allocate %s buffer
  of size"), llama-model.cpp ("unable to allocate %s buffer"), llama-kv-cache.cpp, llama-context.cpp.
"""
from __future__ import annotations

import json
import math
import re
import signal
import statistics
from dataclasses import dataclass, field
from typing import Any, Literal
from collections.abc import Iterator

from .llamacpp_logs import parse_log

TestKind = Literal["pp", "tg", "pg"]
FailureKind = Literal["timeout", "buft", "args", "oom", "load", "context", "crash", "error", "no_output",
                      "no_gpu"]


# ---- llama-bench results ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BenchResult:
    """One llama-bench test: throughput over its samples (tokens per second)."""
    kind: TestKind
    n_prompt: int
    n_gen: int
    n_depth: int
    avg_ts: float
    stddev_ts: float
    samples_ts: tuple[float, ...] = ()
    fields: dict[str, Any] = field(default_factory=dict, compare=False)   # the whole record as printed

    @property
    def median_ts(self) -> float:
        """Median over the repetitions (the Engine contract), else llama-bench's mean."""
        return float(statistics.median(self.samples_ts)) if self.samples_ts else self.avg_ts

    def summary(self) -> dict[str, Any]:
        """The numbers, and the settings the binary says it ran with (to check it read our flags as meant)."""
        return {"kind": self.kind, "n_prompt": self.n_prompt, "n_gen": self.n_gen, "n_depth": self.n_depth,
                "avg_ts": self.avg_ts, "stddev_ts": self.stddev_ts, "median_ts": self.median_ts,
                "samples_ts": list(self.samples_ts),
                "settings": {k: self.fields[k] for k in ECHOED_SETTINGS if k in self.fields}}


# Record fields that echo how the binary read its flags (mainline and ik spellings).
ECHOED_SETTINGS = ("n_batch", "n_ubatch", "n_threads", "type_k", "type_v", "n_gpu_layers", "n_cpu_moe", "flash_attn",
                   "tensor_buft_overrides", "override_tensor", "no_op_offload", "load_mode", "use_mmap",
                   "no_kv_offload", "no_host", "repack",
                   "fit_target", "backends", "gpu_info", "cuda", "mla_attn", "attn_max_batch", "fused_moe", "test")
_BARE_NONFINITE = re.compile(r"(?<=[\s:\[,])(-?)(inf|nan)(?=[\s,\]}])", re.I)
_IK_LABEL = re.compile(r"^tg(\d+)@pp(\d+)$")


def json_objects(text: str) -> Iterator[dict[str, Any]]:
    """Every top-level JSON object in text: jsonl lines, the elements of a json array, or what a crashed run
    printed before it died (a cut-off last object is skipped)."""
    text = _BARE_NONFINITE.sub(lambda m: ("-" if m.group(1) else "") + ("Infinity" if m.group(2).lower() == "inf"
                                                                          else "NaN"), text)
    dec = json.JSONDecoder()
    i = 0
    while (j := text.find("{", i)) >= 0:
        try:
            obj, end = dec.raw_decode(text, j)
        except ValueError:
            i = j + 1
            continue
        if isinstance(obj, dict):
            yield obj
        i = end


def _int(rec: dict[str, Any], key: str) -> int:
    v = rec.get(key, 0)
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else 0


def _rate(v: Any, nan_ok: bool = False) -> float | None:
    """A tokens/s value as llama-bench writes it: a number >= 0 (inf when a test was too fast to time; NaN only
    where nan_ok, a stddev of one sample). Output is untrusted: anything else is not a rate."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or (math.isnan(v) and not nan_ok):
        return None
    return float(v)


def bench_result(rec: dict[str, Any]) -> BenchResult | None:
    """A BenchResult from one record of either dialect; None for records that are not test results."""
    if "avg_ts" not in rec and "samples_ts" not in rec:
        return None
    raw_samples = rec.get("samples_ts")
    if raw_samples is not None and not isinstance(raw_samples, list):
        return None
    samples_ok = [_rate(x) for x in raw_samples or []]
    avg = _rate(rec.get("avg_ts", 0.0) if rec.get("avg_ts") is not None else 0.0)
    std = _rate(rec.get("stddev_ts", 0.0) if rec.get("stddev_ts") is not None else 0.0, nan_ok=True)
    if avg is None or std is None or any(x is None for x in samples_ok):
        return None                   # numbers as strings, NaN, negative rates: not a result we can use
    n_prompt, n_gen, n_depth = _int(rec, "n_prompt"), _int(rec, "n_gen"), _int(rec, "n_depth")
    m = _IK_LABEL.match(str(rec.get("test", "")))
    if m is not None:                 # ik -gp: n_prompt holds the depth, the rate counts n_gen tokens only
        n_gen, n_depth, n_prompt = int(m.group(1)), int(m.group(2)), 0
    kind: TestKind = "pg" if n_prompt and n_gen else ("tg" if n_gen else "pp")
    samples = tuple(x for x in samples_ok if x is not None)
    return BenchResult(kind, n_prompt, n_gen, n_depth, avg, std, samples, rec)


def parse_bench_output(text: str) -> list[BenchResult]:
    """The test results in llama-bench's stdout (`-o json` or `-o jsonl`, mainline or ik)."""
    return [r for r in (bench_result(o) for o in json_objects(text)) if r is not None]


# ---- ik llama-sweep-bench ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SweepRow:
    """One row of llama-sweep-bench: pp tokens (= n_ubatch) and tg tokens at a context depth of n_kv."""
    pp: int
    tg: int
    n_kv: int
    t_pp_s: float
    pp_tps: float
    t_tg_s: float
    tg_tps: float


_FLOAT = r"(-?(?:\d+(?:\.\d*)?|inf|nan))"
_SWEEP_ROW = re.compile(rf"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*{_FLOAT}\s*\|\s*{_FLOAT}\s*\|\s*{_FLOAT}"
                        rf"\s*\|\s*{_FLOAT}\s*\|", re.I)


def parse_sweep_output(text: str) -> list[SweepRow]:
    """Rows of llama-sweep-bench output, from its jsonl records or, when there are none, its table."""
    rows = []
    for o in json_objects(text):
        if not {"pp", "tg", "n_kv", "speed_pp", "speed_tg"} <= o.keys():
            continue
        nums = [o.get(k) for k in ("pp", "tg", "n_kv", "t_pp", "speed_pp", "t_tg", "speed_tg")]
        if any(_rate(v) is None for v in nums):
            continue                  # untrusted output: a row with a missing or non-numeric field is skipped
        rows.append(SweepRow(int(nums[0]), int(nums[1]), int(nums[2]), *(float(v) for v in nums[3:])))
    if rows:
        return rows
    for line in text.splitlines():
        m = _SWEEP_ROW.match(line.strip())
        if m is not None:
            g = m.groups()
            rows.append(SweepRow(int(g[0]), int(g[1]), int(g[2]), float(g[3]), float(g[4]), float(g[5]),
                                 float(g[6])))
    return rows


# ---- the loader's placement lines (-v) ---------------------------------------------------------------------------

_OVERRIDDEN = re.compile(r"tensor (\S+) \(\s*\d+ MiB (\w+)\) buffer type overridden to (\S+)")
_LAYER_DEVICE = re.compile(r"layer\s+(\d+) assigned to device (\S+?),")


def parse_override_lines(text: str) -> list[tuple[str, str]]:
    """(tensor name, buffer type) of every "buffer type overridden" line, in load order. A tied output loads
    token_embd twice, so a name may appear twice. CPU overrides may name an extra CPU buffer type (CPU_REPACK)."""
    return [(m.group(1), m.group(3)) for m in _OVERRIDDEN.finditer(text)]


def parse_layer_devices(text: str) -> dict[int, str]:
    """Slot -> device of the last model load ("layer N assigned to device D"; slot n_layer is the output layer)."""
    out: dict[int, str] = {}
    for m in _LAYER_DEVICE.finditer(text):
        il = int(m.group(1))
        if il == 0 and out:
            out = {}                     # a new load starts over
        out[il] = m.group(2)
    return out


def device_of_buft(buft: str) -> str:
    """The device a buffer type lives on: CUDA0 -> CUDA0; CPU, CPU_REPACK, CPU_Mapped, CUDA_Host -> CPU."""
    m = re.match(r"^(CUDA\d+)$", buft)
    return m.group(1) if m else "CPU"


_GPU_DEVICE = re.compile(r"^CUDA\d+$")


def log_device_bytes(text: str) -> dict[str, int]:
    """Per GPU, what a -v log says llama.cpp allocated there: model buffers plus, for the largest context,
    KV, compute and output buffers. Excludes what ggml does not account (CUDA context, cuBLAS, the pool)."""
    log = parse_log(text)
    out: dict[str, int] = {d: b for d, b in log.model_buffers.items() if _GPU_DEVICE.match(d)}
    best: dict[str, int] = {}
    for ctx in log.contexts:
        per: dict[str, int] = {}
        for table in (ctx.kv_buffers, ctx.compute_buffers, ctx.output_buffers):
            for d, b in table.items():
                if _GPU_DEVICE.match(d):
                    per[d] = per.get(d, 0) + b
        for d, b in per.items():
            best[d] = max(best.get(d, 0), b)
    for d, b in best.items():
        out[d] = out.get(d, 0) + b
    return out


def log_memory(text: str) -> dict[str, Any]:
    """The memory lines of a -v log as plain data (bytes, by buffer type), for Measurement.raw; pipeline_parallel:
    whether llama.cpp said it enabled pipeline parallelism (several GPUs, every layer offloaded, no -ot: its
    scheduler then keeps 4 copies of each graph input, planner/memory.py pipeline_copies)."""
    log = parse_log(text)
    return {"pipeline_parallel": "pipeline parallelism enabled" in text, "model": dict(log.model_buffers),
            "contexts": [{"n_ctx": c.cparams.get("n_ctx"), "n_ubatch": c.cparams.get("n_ubatch"),
                          "kv": dict(c.kv_buffers), "compute": dict(c.compute_buffers),
                          "output": dict(c.output_buffers)} for c in log.contexts]}


# ---- failures ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Failure:
    kind: FailureKind
    message: str


_UNKNOWN_BUFT = re.compile(r"(?:unrecognized|unknown) buffer type '([^']*)'")
_AVAILABLE_BUFTS = re.compile(r"Available buffer types:\s*\n((?:[ \t]+\S+\s*\n?)+)")
_BAD_ARG = (re.compile(r"invalid parameter for argument: (\S+)"),
            re.compile(r'error while handling argument "([^"]+)": ?(.*)'),
            re.compile(r"(?:error: )?unknown argument: (\S+)"),
            re.compile(r"error: invalid argument: (\S+)"))        # common/arg.cpp (llama-server, llama-cli)
_OOM = (
    re.compile(r"allocating ([\d.]+) MiB on device (\d+): cudaMalloc failed: out of memory"),
    re.compile(r"failed to allocate (\S+) buffer of size (\d+)"),
    re.compile(r"unable to allocate (\S+) buffer"),
    re.compile(r"CUDA error: out of memory"),
    re.compile(r"failed to allocate buffer for kv cache"),
    re.compile(r"failed to allocate compute (?:pp|tg) buffers"),
    re.compile(r"std::bad_alloc"),
    re.compile(r"\bout of memory\b", re.I),
)
_LOAD_FAILED = re.compile(r"failed to load model|unable to load model")
_CONTEXT_FAILED = re.compile(r"failed to create (?:the )?(?:llama_)?context")
# why a load failed: the file, the loader's exception, or the device list (a split mode without the devices it needs)
_LOAD_REASONS = (re.compile(r"gguf_init\w*: (.+)"), re.compile(r"error loading model: (.+)"),
                 re.compile(r"llama_prepare_model_devices: (.*\b(?:needs|invalid)\b.*)"))
_CONTEXT_REASON = re.compile(r"(?:llama_init_from_model|llama_context|llama_new_context_with_model): (.*"
                             r"(?:requires|not supported|failed|error|invalid|must).*)", re.I)
_ERROR_LINE = re.compile(r"(GGML_ASSERT.*|.*\berror\b.*|.*\bfailed\b.*)", re.I)


def _last_error_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if _ERROR_LINE.fullmatch(ln.strip() or "-")]
    return lines[-1][:300] if lines else ""


def _signal_name(returncode: int) -> str:
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def classify_failure(stdout: str, stderr: str, returncode: int, *, timed_out: bool = False,
                     timeout_s: float | None = None, have_results: bool = True) -> Failure | None:
    """Why a run failed, or None when it did not. Looks at both streams: llama-bench prints some errors on
    stdout. Without -v llama-bench silences llama.cpp's log, so a load or context failure says only that it
    failed; the engine then re-runs with -v and classifies again (an out-of-memory may show up then)."""
    text = stdout + "\n" + stderr
    if timed_out:
        return Failure("timeout", f"timed out after {timeout_s:g} s; the process group was killed"
                       if timeout_s is not None else "timed out; the process group was killed")
    if (m := _UNKNOWN_BUFT.search(text)) is not None:     # even when it then ran: without our overrides
        avail = _AVAILABLE_BUFTS.search(text)
        have = ", ".join(avail.group(1).split()) if avail else ""
        return Failure("buft", f"unknown buffer type {m.group(1)!r} in -ot" + (f"; this build has: {have}" if have
                                                                                else ""))
    if returncode == 0 and have_results:
        return None
    for rx in _BAD_ARG:
        if (m := rx.search(text)) is not None:
            extra = f": {m.group(2).strip()}" if m.lastindex and m.lastindex >= 2 and m.group(2).strip() else ""
            return Failure("args", f"the binary rejected argument {m.group(1)}{extra}")
    for rx in _OOM:
        if (m := rx.search(text)) is not None:
            if rx is _OOM[0]:
                what = f"cudaMalloc of {m.group(1)} MiB on CUDA{m.group(2)} failed"
            elif rx is _OOM[1]:
                what = f"failed to allocate a {m.group(1)} buffer of {int(m.group(2)) / 2**20:.1f} MiB"
            else:
                what = m.group(0).strip()
            return Failure("oom", f"out of memory: {what}")
    if _LOAD_FAILED.search(text):
        reasons = [m.group(1).strip() for rx in _LOAD_REASONS for m in [rx.search(text)] if m is not None]
        return Failure("load", "could not load the model" + (": " + "; ".join(reasons) if reasons else
                                                            " (no reason printed)"))
    if _CONTEXT_FAILED.search(text):
        m = _CONTEXT_REASON.search(text)
        return Failure("context", "could not create the context" + (f": {m.group(1).strip()}" if m else
                                                                   " (no reason printed)"))
    if returncode < 0:
        last = _last_error_line(text)
        return Failure("crash", f"crashed with {_signal_name(returncode)}" + (f": {last}" if last else "")
                       + (" (SIGKILL often means the host ran out of memory)" if returncode == -9 else ""))
    if returncode != 0:
        last = _last_error_line(text)
        return Failure("error", f"exited with code {returncode}" + (f": {last}" if last else ""))
    return Failure("no_output", "exited normally but printed no results")


def tail(text: str, max_chars: int = 6000) -> str:
    """The end of a log, cut at a line start."""
    if len(text) <= max_chars:
        return text
    cut = text[-max_chars:]
    nl = cut.find("\n")
    return cut[nl + 1:] if 0 <= nl < 200 else cut
