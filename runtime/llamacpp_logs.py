"""Parsers for llama.cpp's load and context log lines, and for `llama-fit-params -fitp on`: pure functions over text.

What llama.cpp prints (mainline, the version vendored in llama-cpp-python 0.3.36; ik_llama.cpp's older spellings
are accepted where noted):

    load_tensors:   CPU_Mapped model buffer size =     7.27 MiB                 src/llama-model.cpp (%12s ... %8.2f)
    llama_kv_cache:        CPU KV buffer size =     0.50 MiB                    src/llama-kv-cache.cpp (once per cache)
    llama_kv_cache: size =    0.50 MiB (   512 cells,   2 layers,  1/1 seqs), K (f16):    0.25 MiB, V (f16): ...
    sched_reserve:        CPU compute buffer size =     5.51 MiB                 src/llama-context.cpp sched_reserve
    sched_reserve: graph: nodes = 108, splits = 1, input objects = 4, input tensors = 6
    sched_reserve: graph (pp bs=512, tg bs=1): nodes = 210 / 200, splits = 3 / 2, ...
    ~llama_context:        CPU compute buffer size is   5.5137 MiB, matches expectation of   5.5137 MiB  (debug)
    common_memory_breakdown_print: | - CUDA0 (H100) | 81079 = 1234 + (100 = 50 + 25 + 25) + 300 |    common/fit.cpp
    llama-fit-params -fitp on (stdout):  `CUDA0 1234 256 300` ... `Host 7 0 5`      (MiB, floored)

Every size comes back in bytes (the MiB value times 2**20, rounded). The log rounds: "%8.2f MiB" values are
exact to within RESOLUTION_2DP, the destructor's "%8.4f" to RESOLUTION_4DP, the breakdown table and -fitp
output are floored to whole MiB (RESOLUTION_FLOOR_MIB: true value in [v, v + 1 MiB)). Lines may carry a prefix
(llama-fit-params -v prints "0.00.004.195 D " in front), so the patterns search rather than anchor.

One log can hold several contexts (llama-bench makes one per test; llama-fit-params several dry runs): the
text is cut at each "constructing llama_context" and every piece becomes a ContextLog.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

MiB = 1 << 20
RESOLUTION_2DP = MiB // 200          # "%.2f MiB": +- 0.005 MiB
RESOLUTION_4DP = MiB // 20000 + 1    # "%.4f MiB": +- 0.00005 MiB
RESOLUTION_FLOOR_MIB = MiB           # integer MiB, floored (size / 1024 / 1024 in size_t)


def mib_to_bytes(value: str | float) -> int:
    return round(float(value) * MiB)


_NUM = r"(-?\d+(?:\.\d+)?)"
# mainline "load_tensors:   CPU_Mapped model buffer size = ..."; ik "llm_load_tensors:        CUDA0 buffer size = ..."
_MODEL_BUF = re.compile(rf"(?:(\S+) model|llm_load_tensors:\s+(\S+)) buffer size =\s*{_NUM} MiB")
_KV_BUF = re.compile(rf"(\S+) KV buffer size =\s*{_NUM} MiB")
_KV_SIZE = re.compile(
    rf"size =\s*{_NUM} MiB \(\s*(\d+) cells,\s*(\d+) layers,\s*(\d+)/\s*(\d+) seqs\), "
    rf"K \((\w+)\):\s*{_NUM} MiB, V \((\w+)\):\s*{_NUM} MiB")
# ik_llama.cpp / older mainline: "llama_new_context_with_model: KV self size  =  144.00 MiB, K (f16): ..., V (f16): ..."
_KV_SELF = re.compile(rf"KV self size\s*=\s*{_NUM} MiB, K \((\w+)\):\s*{_NUM} MiB, V \((\w+)\):\s*{_NUM} MiB")
_COMPUTE_BUF = re.compile(rf"(\S+) compute buffer size =\s*{_NUM} MiB")
_COMPUTE_EXACT = re.compile(rf"(\S+) compute buffer size (?:is|of)\s*{_NUM} MiB")
_OUTPUT_BUF = re.compile(rf"(\S+)\s+output buffer size =\s*{_NUM} MiB")
_GRAPH = re.compile(r"graph(?: \(pp bs=(\d+), tg bs=(\d+)\))?: nodes = (\d+)(?: / (\d+))?, splits = (\d+)(?: / (\d+))?")
_CPARAM = re.compile(r"llama_context: (n_seq_max|n_ctx|n_ctx_seq|n_batch|n_ubatch|flash_attn|kv_unified)\s*= (\S+)")
_CONSTRUCT = re.compile(r"constructing llama_context")
_BREAKDOWN_GPU = re.compile(
    r"\|\s*-\s*(\S+?)(?: \((.*?)\))?\s*\|\s*(\d+)\s*=\s*(\d+)\s*\+"
    r"\s*\(\s*(\d+)\s*=\s*(\d+)\s*\+\s*(\d+)\s*\+\s*(\d+)\s*\)"
    r"\s*\+\s*(-?\d+)\s*\|")
_BREAKDOWN_OTHER = re.compile(r"\|\s*-\s*(\S+)\s*\|\s*(\d+)\s*=\s*(\d+)\s*\+\s*(\d+)\s*\+\s*(\d+)\s*\|")
_FIT_ROW = re.compile(r"^\s*(\S+) (\d+) (\d+) (\d+)\s*$")
_REPACK = re.compile(r"repack: repack tensor (\S+) with (\S+)")


@dataclass(frozen=True)
class KVCacheSize:
    """One "llama_kv_cache: size = ..." line: a cache (an SWA model has two: non-SWA and SWA)."""
    cells: int
    layers: int
    seqs: int
    streams: int
    type_k: str
    k_bytes: int
    type_v: str
    v_bytes: int

    @property
    def nbytes(self) -> int:
        return self.k_bytes + self.v_bytes


@dataclass(frozen=True)
class GraphStats:
    """The "graph: nodes = ..., splits = ..." line; tg values equal pp values unless the line gives both."""
    nodes_pp: int
    splits_pp: int
    nodes_tg: int
    splits_tg: int


@dataclass(frozen=True)
class ContextLog:
    """What one llama_context reported. Sizes in bytes, keyed by buffer type name (CPU, CUDA0, CUDA_Host, ...)."""
    cparams: dict[str, str] = field(default_factory=dict)
    kv_buffers: dict[str, int] = field(default_factory=dict)        # summed over caches (SWA: base + swa)
    kv_caches: tuple[KVCacheSize, ...] = ()
    compute_buffers: dict[str, int] = field(default_factory=dict)   # sched_reserve, %.2f MiB
    compute_exact: dict[str, int] = field(default_factory=dict)     # ~llama_context debug line, %.4f MiB
    output_buffers: dict[str, int] = field(default_factory=dict)
    graph: GraphStats | None = None

    def cparam(self, name: str) -> int:
        return int(self.cparams[name])

    @property
    def kv_bytes(self) -> int:
        return sum(self.kv_buffers.values())

    def compute(self, buft: str) -> int:
        """The most precise compute buffer size logged for buft (0 when none was printed: llama.cpp prints
        only buffers larger than 1 byte)."""
        if buft in self.compute_exact:
            return self.compute_exact[buft]
        return self.compute_buffers.get(buft, 0)

    def compute_resolution(self, buft: str) -> int:
        return RESOLUTION_4DP if buft in self.compute_exact else RESOLUTION_2DP


@dataclass(frozen=True)
class LlamaLog:
    model_buffers: dict[str, int]            # buffer type -> bytes, summed over files/buffers (last model load)
    contexts: tuple[ContextLog, ...]

    @property
    def model_bytes(self) -> int:
        return sum(self.model_buffers.values())

    @property
    def context(self) -> ContextLog:
        """The last context (llama-bench with one test has exactly one)."""
        if not self.contexts:
            raise ValueError("the log holds no llama_context (did the model load? run llama-bench with -v)")
        return self.contexts[-1]


@dataclass(frozen=True)
class BreakdownRow:
    """One row of the memory breakdown table printed at exit, in bytes (floored MiB). Host rows and other
    buffer types have no total/free/unaccounted (None)."""
    name: str
    model: int
    context: int
    compute: int
    self_bytes: int
    total: int | None = None
    free: int | None = None
    unaccounted: int | None = None
    description: str = ""


@dataclass(frozen=True)
class FitRow:
    """One device row of `llama-fit-params -fitp on`: bytes, floored to MiB by llama.cpp."""
    name: str
    model: int
    context: int
    compute: int


def _add(d: dict[str, int], key: str, value: int) -> None:
    d[key] = d.get(key, 0) + value


def parse_model_buffers(text: str) -> dict[str, int]:
    """Model buffer sizes per buffer type of the LAST model load in text (CPU_Mapped, CPU, CPU_REPACK, CUDA0,
    CUDA_Host, ...). A split model prints one CPU_Mapped line per file: they are summed."""
    loads: list[dict[str, int]] = []
    previous_was_model_line = False
    for line in text.splitlines():
        m = _MODEL_BUF.search(line)
        if m is None:
            previous_was_model_line = False
            continue
        if not previous_was_model_line:
            loads.append({})
        _add(loads[-1], m.group(1) or m.group(2), mib_to_bytes(m.group(3)))
        previous_was_model_line = True
    return loads[-1] if loads else {}


def parse_repacked_tensors(text: str) -> tuple[str, ...]:
    """Names of the weights the CPU backend repacked into CPU_REPACK (debug lines of ggml-cpu/repack.cpp,
    "repack: repack tensor blk.0.attn_q.weight with q4_0_8x8"), in load order, each once."""
    seen: dict[str, None] = {}
    for m in _REPACK.finditer(text):
        seen.setdefault(m.group(1), None)
    return tuple(seen)


def _parse_context(lines: list[str]) -> ContextLog:
    cparams: dict[str, str] = {}
    kv_buffers: dict[str, int] = {}
    kv_caches: list[KVCacheSize] = []
    compute: dict[str, int] = {}
    exact: dict[str, int] = {}
    output: dict[str, int] = {}
    graph = None
    for line in lines:
        if (m := _CPARAM.search(line)) is not None:
            cparams[m.group(1)] = m.group(2)
        elif (m := _KV_BUF.search(line)) is not None:
            _add(kv_buffers, m.group(1), mib_to_bytes(m.group(2)))
        elif (m := _KV_SIZE.search(line)) is not None:
            kv_caches.append(KVCacheSize(
                cells=int(m.group(2)), layers=int(m.group(3)), seqs=int(m.group(4)), streams=int(m.group(5)),
                type_k=m.group(6), k_bytes=mib_to_bytes(m.group(7)), type_v=m.group(8),
                v_bytes=mib_to_bytes(m.group(9))))
        elif (m := _KV_SELF.search(line)) is not None:
            kv_caches.append(KVCacheSize(0, 0, 0, 0, m.group(2), mib_to_bytes(m.group(3)), m.group(4),
                                         mib_to_bytes(m.group(5))))
        elif (m := _COMPUTE_BUF.search(line)) is not None:
            compute[m.group(1)] = mib_to_bytes(m.group(2))
        elif (m := _COMPUTE_EXACT.search(line)) is not None:
            exact[m.group(1)] = mib_to_bytes(m.group(2))
        elif (m := _OUTPUT_BUF.search(line)) is not None:
            _add(output, m.group(1), mib_to_bytes(m.group(2)))
        elif (m := _GRAPH.search(line)) is not None:
            nodes_pp, splits_pp = int(m.group(3)), int(m.group(5))
            nodes_tg = int(m.group(4)) if m.group(4) else nodes_pp
            splits_tg = int(m.group(6)) if m.group(6) else splits_pp
            graph = GraphStats(nodes_pp, splits_pp, nodes_tg, splits_tg)
    return ContextLog(cparams, kv_buffers, tuple(kv_caches), compute, exact, output, graph)


def parse_contexts(text: str) -> tuple[ContextLog, ...]:
    """One ContextLog per "constructing llama_context" (or one for the whole text if the line is missing,
    as in ik_llama.cpp logs, provided it holds a KV or compute line)."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if _CONSTRUCT.search(line)]
    if not starts:
        ctx = _parse_context(lines)
        return (ctx,) if (ctx.kv_buffers or ctx.compute_buffers or ctx.kv_caches) else ()
    bounds = starts + [len(lines)]
    return tuple(_parse_context(lines[a:b]) for a, b in zip(bounds, bounds[1:]))


def parse_log(text: str) -> LlamaLog:
    """Model buffers and every context of a llama-bench -v / llama-cli / llama-server / llama-fit-params -v log."""
    return LlamaLog(parse_model_buffers(text), parse_contexts(text))


def parse_memory_breakdown(text: str) -> dict[str, BreakdownRow]:
    """The last memory breakdown table in text ("memory breakdown [MiB]" header, then one row per device, the
    host, and other buffer types), keyed by device/buffer name ("CUDA0", "Host", "CUDA_Host", ...)."""
    lines = text.splitlines()
    heads = [i for i, line in enumerate(lines) if "memory breakdown [MiB]" in line]
    if not heads:
        return {}
    rows: dict[str, BreakdownRow] = {}
    for line in lines[heads[-1] + 1:]:
        if (m := _BREAKDOWN_GPU.search(line)) is not None:
            v = [int(x) * MiB for x in m.groups()[2:]]
            rows[m.group(1)] = BreakdownRow(m.group(1), model=v[3], context=v[4], compute=v[5], self_bytes=v[2],
                                            total=v[0], free=v[1], unaccounted=v[6], description=m.group(2) or "")
        elif (m := _BREAKDOWN_OTHER.search(line)) is not None:
            v = [int(x) * MiB for x in m.groups()[1:]]
            rows[m.group(1)] = BreakdownRow(m.group(1), model=v[1], context=v[2], compute=v[3], self_bytes=v[0])
        elif "|" not in line and rows:
            break
    return rows


def parse_fit_print(stdout: str) -> dict[str, FitRow]:
    """`llama-fit-params -fitp on` stdout: one "NAME model context compute" line (MiB) per device, then "Host"."""
    rows: dict[str, FitRow] = {}
    for line in stdout.splitlines():
        m = _FIT_ROW.match(line)
        if m is not None:
            rows[m.group(1)] = FitRow(m.group(1), int(m.group(2)) * MiB, int(m.group(3)) * MiB,
                                      int(m.group(4)) * MiB)
    return rows


# ---- ik_llama.cpp's own --fit (src/llama.cpp llm_load_tensors ~4420-4600, 8337e4cd) ----------------------------------
#   Memory required for model tensors + cache: 17321 MiB
#   Memory available on all devices - compute: 7650 MiB
#   Adding experts CPU overrides for layer 47 in device 0          (split mode layer, walking down from the last)
#   Adding experts CPU overrides for layer 3                        (split mode graph/attn, walking up from 0)
#   Memory use in device 0 is 7600 MiB after adding 26 overrides, which is less than available memory of 7650 MiB
#   Setting layer 47 to device 0                                     (a model without experts: whole layers)
#   llama_model_load: error loading model: Unable to auto-fit model  (even every expert in RAM is too much)

_IK_REQUIRED = re.compile(r"Memory required for model tensors \+ cache: (\d+) MiB")
_IK_AVAILABLE = re.compile(r"Memory available on all devices - compute: (\d+) MiB")
_IK_EXPERTS_CPU = re.compile(r"Adding experts CPU overrides for layer (\d+)(?: in device (\d+))?")
_IK_LAYER_DEVICE = re.compile(r"Setting layer (\d+) to device (\d+)")


@dataclass(frozen=True)
class IkFitChoice:
    """What ik's --fit logged: the MiB it needed and had, and the blocks whose routed experts it kept in RAM
    (every other tensor goes to the GPU: --fit sets -ngl 999). layers_on_gpu: for a model without experts,
    the slots it put on a GPU (empty when it logged none)."""
    required_mib: int | None
    available_mib: int | None
    cpu_expert_layers: tuple[int, ...]
    layers_on_gpu: tuple[int, ...] = ()
    failed: bool = False               # "Unable to auto-fit model": nothing was loaded with this choice

    def args(self) -> tuple[str, ...]:
        """The same placement as server flags: -ngl 999 and one -ot naming those blocks' experts (ik's own
        pattern, src/llama.cpp ~4553); () for a dense model's layer choice, which -ngl alone cannot always say."""
        if self.layers_on_gpu or self.failed:
            return ()
        if not self.cpu_expert_layers:
            return ("-ngl", "999")
        blocks = "|".join(str(i) for i in sorted(self.cpu_expert_layers))
        return ("-ngl", "999", "-ot", rf"blk\.({blocks})\.ffn_(up|down|gate|gate_up)_exps\.(weight|scale)=CPU")


def parse_ik_fit(text: str) -> IkFitChoice | None:
    """ik's --fit decision from the load log of a --fit run; None when the log has none. ik prints the two
    "Memory ..." lines on every load that has a device, --fit or not: only a --fit run's log is a decision."""
    req, avail = _IK_REQUIRED.search(text), _IK_AVAILABLE.search(text)
    if req is None:
        return None
    experts = tuple(dict.fromkeys(int(m.group(1)) for m in _IK_EXPERTS_CPU.finditer(text)))
    layers = tuple(int(m.group(1)) for m in _IK_LAYER_DEVICE.finditer(text))
    return IkFitChoice(int(req.group(1)), int(avail.group(1)) if avail else None, experts, layers,
                       "Unable to auto-fit model" in text)
