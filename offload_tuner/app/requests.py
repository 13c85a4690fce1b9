"""The use cases' requests: small frozen dataclasses, one per use case, built at the edge (the CLI's flags, a JSON
body, a study spec, the demo) and passed on typed. Each field's help text is its metadata (fields.opt): the CLI's
--help and the service's OpenAPI schema show the same words; its type is its annotation, which the CLI and the
service both parse values by (fields.py).

Defaults live here, in the dataclasses (their numbers in planner/defaults.py): the CLI's flags default to None, so
a flag counts only when given."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from planner import defaults as D
from planner.engine_registry import ENGINES
from planner.errors import InputError
from planner.options import EngineName, EngineOptions
from planner.plan import DEFAULT_CTX, KV_TYPES, Dialect, KvType
from tuner.confirm import CONFIRM_ROUNDS
from .fields import Bounds, check_bounds, opt, options

PlanObjective = Literal["time", "tg", "pp", "both", "balanced"]     # balanced: both's old name, read as both
SpaceMode = Literal["settled", "full"]                      # defaults.SPACE_MODES

MODEL = "path to a .gguf (first shard of a split) or preset:NAME[:QUANT]"
GPU = "GPU memory per GPU, e.g. 24GiB or 24GiB,16GiB (a generic desktop otherwise)"
HARDWARE = "hardware preset name or calibrated JSON (offload-tuner calibrate)"
RAM = ("host RAM the plan may use, e.g. 128GiB: the weights kept in RAM, KV and compute on the CPU, llama-server's "
       "prompt cache, the process (default: the --hardware profile's ram_bytes; for --gpu alone, this machine's "
       "memory)")
BUILD = ("the engine build the printed lines are for, as `llama-server --version` numbers it (e.g. ik:4840, "
         "mainline:10114), or the path of the program (its --help and --version are read); default: the pinned "
         "builds (ik 8337e4cd = 4840, mainline as in llama-cpp-python 0.3.36)")
DIALECT = "mainline or ik (default mainline)"
# the ranges of the counts (planner/defaults.py says why each maximum)
TOKENS = Bounds(0, D.MAX_TOKENS, why="16M tokens, above any model's context")
TOKENS_1 = Bounds(1, D.MAX_TOKENS, why="16M tokens, above any model's context")
TRIALS = Bounds(1, D.MAX_TRIALS)
POOL = Bounds(0, D.MAX_POOL, why="each candidate costs 10-30 ms of pre-screening before the first run")
KEEP_FREE = (f"GPU memory kept free on each GPU for the display, other processes and the driver: no plan uses it "
             f"(default {D.KEEP_FREE}, what llama.cpp's own fit keeps free; 0 allowed)")


@dataclass(frozen=True)
class InspectRequest:
    """`inspect`: hparams, tensor groups, bytes per group and per layer of one model."""
    model: str = opt(help=MODEL)


@dataclass(frozen=True)
class PlanRequest:
    """`plan`: the best predicted placement for a model on a machine."""
    model: str = opt(help=MODEL)
    gpu: str | None = opt(None, help=GPU)
    hardware: str | None = opt(None, help=HARDWARE)
    ram: str | None = opt(None, help=RAM)
    ctx: int = opt(DEFAULT_CTX, help=f"context length (default {DEFAULT_CTX}; raised, in whole 256s, to hold the "
                                     "workload's longest request in each slot)", bounds=TOKENS_1)
    ubatch: int | None = opt(None, help="-ub (default 512)", bounds=TOKENS_1)
    batch: int | None = opt(None, help="-b (default 2048, at least --ubatch)", bounds=TOKENS_1)
    kv_type: KvType | None = opt(None, help="KV cache type for K and V (default f16)")
    threads: int | None = opt(None, help="-t (default: the hardware's cores)",
                              bounds=Bounds(1, D.MAX_THREADS, why="ggml's most threads"))
    dialect: Dialect = opt("mainline", help=DIALECT)
    build: str | None = opt(None, help=BUILD)
    amb: int | None = opt(None, help="ik -amb in MiB (default 512 for MLA models, else ik's default)",
                          bounds=Bounds(0, D.MAX_AMB_MIB, why="1 TiB"))
    objective: PlanObjective = opt(D.PLAN_OBJECTIVE, help="time (the workload's predicted mean request time, the "
                                   "default, as tune's), tg, pp or both (the geometric mean of the two speeds, the "
                                   "pick tune's 'both' front holds; 'balanced', its old name, reads as both)")
    workload: str | None = opt(None, help="the requests the time objective answers: chat, agent, rag, batch, a .toml "
                                          f"or a .jsonl log (default {D.TUNE_REQUESTS}); the context and slots hold "
                                          "its longest request (under tg, pp or both too, where given, its request "
                                          "times shown beside)")
    keep_free: str = opt(D.KEEP_FREE, help=KEEP_FREE)
    margin: str = opt(D.PLAN_MARGIN, help="GPU memory held back, beyond --keep-free, for the memory model's error "
                                          f"(default {D.PLAN_MARGIN}: the room is the GPU memory less --keep-free)")
    top: int = opt(D.PLAN_TOP, help=f"candidates to list (default {D.PLAN_TOP})", bounds=Bounds(1, D.MAX_TOP))

    def __post_init__(self) -> None:
        if self.objective == "balanced":           # an old command line's word: one objective vocabulary after it
            object.__setattr__(self, "objective", "both")
        check_bounds(self)
        if self.ubatch is not None and self.batch is not None and self.ubatch > self.batch:
            raise InputError(f"--ubatch {self.ubatch} is more than --batch {self.batch}: llama.cpp never runs a "
                             f"ubatch larger than the batch; give --batch {self.ubatch} (or more), or a smaller "
                             "--ubatch")


@dataclass(frozen=True)
class ExplainRequest:
    """`explain`: what a llama.cpp command line does with a model: placement, memory, speed, warnings."""
    model: str = opt(help=MODEL)
    args: tuple[str, ...] = opt((), help='the llama.cpp arguments, one per item, e.g. ["-ngl", "99", "-cmoe"]')
    dialect: Dialect = opt("mainline", help=DIALECT)
    build: str | None = opt(None, help=BUILD)
    gpu: str | None = opt(None, help=GPU)
    hardware: str | None = opt(None, help=HARDWARE)
    ram: str | None = opt(None, help=RAM)
    oracle: str | None = opt(None, help="llama-fit-params binary: its memory estimate beside ours")


@dataclass(frozen=True)
class TuneRequest:
    """Everything `tune` takes (from flags, a studies/NAME.toml spec, or both: flags given win; the demo; a JSON
    body). None means "the engine's or the study's default" where the help says so (dialect: the binary's; ctx:
    max(DEFAULT_CTX, the workload); confirm and space: per engine)."""
    model: str = opt(help="path to a .gguf or preset:NAME[:QUANT] (or the spec's model)")
    spec: str | None = opt(None, help="study spec (TOML): starts or resumes that study, its database beside the file "
                                      "(studies/NAME.db) unless --storage or the spec says otherwise; flags given "
                                      "here override the spec's values")
    engine: EngineName = opt(D.TUNE_ENGINE, help="what measures a candidate: " + "; ".join(
        f"{s.name}: {s.help}" for s in ENGINES.values()) + f" (default {D.TUNE_ENGINE})", choices=tuple(ENGINES))
    gpu: str | None = opt(None, help=GPU)
    hardware: str | None = opt(None, help=HARDWARE)
    ram: str | None = opt(None, help=RAM)
    trials: int = opt(D.TUNE_TRIALS, help=f"engine runs to add to the study (default {D.TUNE_TRIALS})",
                      bounds=TRIALS)
    study: str | None = opt(None, help="study name (default: the spec's file name, else from model, hardware, "
                                       "engine, objective); resumes it")
    storage: str | None = opt(None, help="SQLAlchemy URL (default sqlite:///studies/STUDY.db, or STUDY.db beside "
                                         "the spec; postgresql://... for several workers)")
    objective: str = opt(D.TUNE_OBJECTIVE, help="time (the workload's mean request time), tg, pp, both (Pareto) or "
                                                "an expression such as 'tg + 0.1*pp' "
                                                f"(default {D.TUNE_OBJECTIVE})")
    workload: str = opt(D.TUNE_REQUESTS, help="the requests the time objective answers: chat, agent, rag, batch, a "
                                              ".toml of [[request]] tables or a .jsonl log of OpenAI usage lines "
                                              f"(default {D.TUNE_REQUESTS})")
    ttft: str | None = opt(None, help="time objective: the longest time to first token a request may take (e.g. 3s, "
                                      "500ms): configs over it rank below every config within it, and the served "
                                      "pick meets it where any contender does")
    n_prompt: int | None = opt(None, help="prompt tokens of each benchmark run (default: the workload's mean new "
                                          f"tokens under time, else {D.TUNE_WORKLOAD.n_prompt})", bounds=TOKENS)
    n_gen: int | None = opt(None, help="generated tokens of each benchmark run (default: the workload's mean, at most "
                                       f"128, under time, else {D.TUNE_WORKLOAD.n_gen})", bounds=TOKENS)
    depth: int | None = opt(None, help="context depth of each benchmark run (default: the workload's mean cached "
                                       f"tokens under time, else {D.TUNE_WORKLOAD.depth})", bounds=TOKENS)
    reps: int = opt(D.TUNE_WORKLOAD.repetitions,
                    help=f"repetitions per measurement (default {D.TUNE_WORKLOAD.repetitions})",
                    bounds=Bounds(1, D.MAX_REPS))
    ctx: int | None = opt(None, help=f"context the emitted commands reserve (default max({DEFAULT_CTX}, the "
                                     "workload's longest request, depth+prompt+gen))", bounds=TOKENS_1)
    dialect: Dialect | None = opt(None, help="mainline or ik (default: the llama.cpp binary's, else mainline)")
    llama_bench: str | None = opt(None, help="llamacpp engine: llama-bench or llama-sweep-bench (else $LLAMA_BENCH, "
                                             "else llama-bench on PATH)")
    llama_server: str | None = opt(None, help="after the search, serve the finalists and llama-server's own --fit "
                                              "(-ub 512, 2048, 4096) on the workload with this llama-server, "
                                              "interleaved, and recommend the fastest (time objective)")
    keep_free: str = opt(D.KEEP_FREE, help=KEEP_FREE)
    margin: str = opt(D.TUNE_MARGIN, help="GPU memory held back, beyond --keep-free, for the memory model's error: "
                                          "auto (default: learnt from the runs, starting at the engine's known error) "
                                          "or a size, 0 allowed (kept, raised only by an out-of-memory or a run over "
                                          "the budget)")
    cpu_stand_in: bool = opt(False, help="llamacpp: run every plan with all its tensors on the CPU: a dry run of a "
                                         "GPU study's whole pipeline on a CPU-only build (its speeds and peaks are "
                                         "not the GPU plans')")
    confirm: int | None = opt(None, help="rounds of interleaved re-measurement of the finalists and --fit before the "
                                         f"study reports (default {CONFIRM_ROUNDS}; 0 for the sim engine, which is "
                                         "exact)", bounds=Bounds(0, D.MAX_CONFIRM))
    space: SpaceMode | None = opt(None, help="settled: threads, flash attention, batch, output layer, mmap and op "
                                             "offload fixed at what won on real engines, so runs go to placement, "
                                             "ubatch and KV (default for llamacpp and torch); full: search every "
                                             "knob (default for sim)")
    kv_types: tuple[str, ...] = opt(D.TUNE_KV_TYPES, help="KV cache types the search may use (default "
                                                          f"{','.join(D.TUNE_KV_TYPES)})")
    space_limits: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)   # SpaceConfig fields (specs only)
    seed: int = opt(D.TUNE_SEED, help=f"sampler seed (default {D.TUNE_SEED})",
                    bounds=Bounds(0, D.MAX_SEED, why="the samplers' seed range, 0 to 2**32-1"))
    pool: int = opt(D.TUNE_POOL, help=f"candidates the cost model pre-screens (default {D.TUNE_POOL}, at most "
                                      f"{D.MAX_POOL})", bounds=POOL)
    timeout_s: float | None = opt(None, flag="timeout", help="seconds per measurement (llamacpp; default "
                                                             f"{D.RUN_TIMEOUT_S:.0f})",
                                  bounds=Bounds(0, D.MAX_TIMEOUT_S, above=True, why="a week"))
    time_limit: str | None = opt(None, help="end within this long (e.g. 10m, 1.5h): the search takes its first half "
                                            "when --llama-server serves after it, else all; the serving ends at a "
                                            "safe point with its verdict so far marked partial, and the same command "
                                            "goes on")
    fresh: bool = opt(False, help="delete the study of that name first")
    out: str | None = opt(None, help="report folder (default reports/STUDY)")
    no_report: bool = opt(False, help="do not write the report at the end")
    quiet: bool = opt(False, help="no progress bar")
    json: bool = opt(False, help="print the outcome as JSON")

    def __post_init__(self) -> None:
        check_bounds(self)

    def engine_options(self) -> EngineOptions:
        return EngineOptions(engine=self.engine, model=self.model, llama_bench=self.llama_bench,
                             timeout_s=self.timeout_s if self.timeout_s is not None else D.RUN_TIMEOUT_S,
                             cpu_stand_in=self.cpu_stand_in, llama_server=self.llama_server)

    @classmethod
    def from_values(cls, given: Mapping[str, Any]) -> TuneRequest:
        """From the values given (flags, a JSON body), over the spec's values when `spec` names one."""
        from offload_tuner.app.studyspec import check_model_file, load_spec
        base: dict[str, Any] = load_spec(given["spec"]) if given.get("spec") else {}
        if "model" in base and "model" not in given:
            check_model_file(given["spec"], base["model"])
        merged = {**base, **given}
        if not merged.get("model"):
            raise InputError("say which model: tune MODEL ..., or tune --spec studies/NAME.toml with model = ...")
        return cls(**merged)

    def to_argv(self) -> list[str]:
        """The `offload-tuner tune` command line that parses back into these options (how the service starts a
        tune worker). Values are written `--flag=value`, so one that starts with '-' stays a value. Fields at
        their default are left out, but for a spec'd study, whose values yield only to flags given: there every
        field is written. Space limits have no flag (a spec holds them)."""
        if self.space_limits and self.spec is None:
            raise InputError("space limits come from a study spec (tune --spec FILE); no flag carries them")
        defaults = {f.name: f.default for f in fields(self)}
        # a positional that starts with '-' would read as a flag: the same file as ./-name
        argv = ["tune", f"./{self.model}" if self.model.startswith("-") else self.model]
        for name, o in options(TuneRequest).items():
            value = getattr(self, name)
            if o.kind == "other" or name == "model" or value is None or value is False:
                continue
            if self.spec is None and value == defaults[name]:
                continue
            if o.kind == "bool":
                argv.append(o.flag)
            else:
                argv.append(f"{o.flag}={','.join(value) if o.kind == 'list' else value}")
        return argv


def parse_kv_types(text: str, where: str) -> tuple[str, ...]:
    """'f16,q8_0' -> ("f16", "q8_0"); InputError naming `where` for an empty list or an unknown type."""
    kv = tuple(k.strip() for k in text.split(",") if k.strip())
    if not kv or any(k not in KV_TYPES for k in kv):
        raise InputError(f"{where} {text!r}: expected a comma list of {', '.join(KV_TYPES)}")
    return kv


# the demo's study: what studies/demo.toml spells out (a test holds the two equal), built in so that `demo` runs
# from any folder. Qwen3-30B-A3B Q4_K_M on a 16 GiB RTX 4090 with dual-channel DDR5, sim engine, objective both.
DEMO = TuneRequest(model="preset:Qwen3-30B-A3B:Q4_K_M", engine="sim", hardware="rtx4090-ddr5", gpu="16GiB",
                   trials=60, study="demo", objective="both", n_prompt=2048, n_gen=128, depth=0, reps=1,
                   ctx=DEFAULT_CTX, pool=120)


@dataclass(frozen=True)
class DemoRequest:
    """`demo`: the main job on the embedded default (or on a spec), a fresh study each run."""
    spec: str | None = opt(None, help="the study to run as the demo (default: the built-in one, which "
                                      "studies/demo.toml spells out)")
    trials: int | None = opt(None, help=f"engine runs (default {DEMO.trials})", bounds=TRIALS)
    pool: int | None = opt(None, help=f"candidates the cost model pre-screens (default {DEMO.pool})", bounds=POOL)
    quiet: bool = opt(False, help="no progress bar")

    def __post_init__(self) -> None:
        check_bounds(self)


@dataclass(frozen=True)
class ReportRequest:
    """`report`: a study's plots, Markdown/HTML summary, CSV and JSON."""
    study: str = opt(help="the study's name")
    storage: str | None = opt(None, help="SQLAlchemy URL (default sqlite:///studies/STUDY.db)")
    out: str | None = opt(None, help="folder (default reports/STUDY)")


@dataclass(frozen=True)
class ServerConfig:
    """`serve`: what the HTTP service is started with. Engines, binaries, storage and model folders are the
    server's to choose; a request only picks among them."""
    host: str = opt("127.0.0.1", help="address to bind (default 127.0.0.1; anything else needs --token)")
    port: int = opt(8787, help="port (default 8787)", bounds=Bounds(0, 65535))
    storage: str | None = opt(None, help="SQLAlchemy URL of the studies (default: one sqlite:///studies/STUDY.db per "
                                         "study, as tune writes them)")
    workdir: Path = field(default_factory=Path.cwd)     # where studies/ lives and tune workers run
    model_dirs: tuple[Path, ...] = opt((), flag="models", help="folder whose .gguf files, hardware JSON and workload "
                                       "files (.toml, .jsonl) requests may name (repeatable; default none: presets "
                                       "only)")
    token: str | None = opt(None, help="secret every request must carry (Authorization: Bearer, or /?token= once in "
                                       "a browser); also $OFFLOAD_TUNER_TOKEN")
    engines: tuple[str, ...] = opt(("sim",), flag="engine", help="engines a tune request may use, comma list "
                                                                 "(default sim)")
    llama_bench: str | None = opt(None, help="the llamacpp engine's llama-bench (else $LLAMA_BENCH, else PATH)")
    max_tunes: int = opt(1, help="tune workers at once (default 1)", bounds=Bounds(1, 64))
    max_trials: int = opt(200, help="trials one tune request may ask for (default 200)", bounds=TRIALS)
    request_limit_s: float = opt(60.0, flag="request-limit", help="seconds a plan, explain or inspect may compute "
                                 "before its worker is restarted and the request answered 503 (default 60)",
                                 bounds=Bounds(0, 86400, above=True, why="a day"))
    max_body: int = 64 * 1024            # bytes of a request body
    compute_threads: int = 4             # plan/explain/inspect computed at once (the rest wait)
    max_waiting: int = 256               # requests waiting for a compute slot before 503

    def __post_init__(self) -> None:
        check_bounds(self)

    @property
    def studies_dir(self) -> Path:
        from tuner.storage import STUDIES_DIR
        return self.workdir / STUDIES_DIR
