"""The llamacpp engine: measure a Plan with the user's llama-bench (mainline or ik_llama.cpp) or ik's
llama-sweep-bench, and use llama-fit-params as a memory oracle.

    engine = LlamaCppEngine()                      # --llama-bench PATH, else $LLAMA_BENCH, else PATH
    m = engine.measure(inv, plan, BenchRun(512, 128, 0, 3))
    engine.command(inv, plan, bench).shell      # the exact command line it runs
    oracle(inv, plan, "model.gguf", "llama-fit-params")   # {device: {model, context, compute}} in bytes

How a run goes (contract: planner/engine_contract.py):
1. The binary is probed once per path and mtime (`probe`, runtime/llamacpp_binary.py): `--help` says the dialect
   (ik lists -mla/-fmoe/-rtr) and which flags exist (-ot, -ncmoe, -nopo, -d, -fitt, -gp, -lm, the output formats);
   `--version` the build. The -ngl semantics follow (docs/llamacpp.md section 2): ik counts the last blocks;
   mainline takes the output layer first since PR #18148 (Dec 2025). A llama-bench with -fitt (PR #21304, Apr 2026)
   is newer than that; else the build number decides; `ngl_rule=` overrides the guess. A plan whose placement would
   differ under the binary's rule is refused rather than run wrong.
2. planner.flags.render(plan, inv, "bench", bench=..., model_path=...) gives argv and environment
   (GGML_OP_OFFLOAD_MIN_BATCH); every flag must be one the binary's --help lists. `-o jsonl` (mainline) or
   `-o json` (ik) is added.
3. The child runs (runtime/process.py) in its own process group (and dies with us: PR_SET_PDEATHSIG), stdout and
   stderr to files; GPU memory is sampled meanwhile (runtime/gpumem.py; baseline subtracted); host peak RSS comes
   from wait4. Past `timeout_s` the whole group gets SIGTERM, then SIGKILL.
4. Results: llama-bench makes one test per -p and per -n (separate contexts on one loaded model): pp_tps is
   the prompt test's median rate, tg_tps the generation test's. Failures become Measurement(ok=False) with
   raw["failure"] in {timeout, buft, args, oom, load, context, crash, error, no_output, no_gpu} and the log tail;
   a load or context failure, a crash or an error exit (without -v llama-bench says only "failed to ..." or
   "CUDA error") is re-run once with -v to capture the reason.
peak_bytes: sampled device memory when NVML or nvidia-smi exist; else (verbose runs) what the -v log says
llama.cpp allocated on each GPU; else nothing (a CPU-only machine).
"""
from __future__ import annotations

import dataclasses
import os
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from collections.abc import Mapping, Sequence

from planner.engine_contract import Engine, EngineFit
from planner.errors import FlagError, InputError
from planner.flags import parse, render, slot_rule
from planner.flags.common import (
    Override, SlotRule, allocated_names, apply_overrides, base_assignment, match_overrides,
    shell_join, slot_devices,
)
from planner.hardware import HardwareProfile
from planner.options import EngineOptions
from planner.memory import DeviceMemory, MemoryReport, estimate
from planner.model import ModelInventory
from planner.plan import Plan

from . import gpumem
from planner.engine_contract import Measurement, BenchRun
from .llamacpp_binary import FLAG_TOKEN, BinaryInfo, check_devices, device_args, find_binary, list_devices, probe
from .llamacpp_logs import parse_fit_print, parse_ik_fit
from .llamacpp_output import (
    BenchResult, Failure, SweepRow, classify_failure, device_of_buft, log_device_bytes, log_memory,
    parse_bench_output, parse_layer_devices, parse_override_lines, parse_sweep_output, tail,
)
from .process import RunResult, run_process

# ik's common parser (llama-sweep-bench) accepts these always but lists them in --help only when the build can
# offload to a GPU (common.cpp gpt_params_print_usage: `if (llama_supports_gpu_offload())`).
IK_GPU_ONLY_HELP = frozenset({"-ngl", "--gpu-layers", "--n-gpu-layers", "-ts", "--tensor-split", "-op",
                              "--offload-policy", "-no-ooae", "--no-offload-only-active-experts", "-mg",
                              "--main-gpu", "-sm", "--split-mode"})
# Failures whose reason llama-bench keeps to itself without -v (it silences llama.cpp's log; a CUDA out-of-memory
# during compute then shows only as "CUDA error" and an abort): re-run once with -v to read it.
RERUN_VERBOSE = frozenset({"load", "context", "crash", "error"})


# ---- the engine ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EngineCommand:
    """What the engine runs for one measurement: argv (without the program) and the extra environment."""
    program: str
    argv: tuple[str, ...]
    env: dict[str, str]
    notes: tuple[str, ...] = ()
    sweep_depth: int | None = None     # llama-sweep-bench: the n_kv row to read
    gpu_devices: tuple[str, ...] = ()  # the GPUs the plan uses (a build without a GPU backend fails the run)

    @property
    def shell(self) -> str:
        return shell_join([self.program, *self.argv], self.env)


_UNSET: Any = object()


@dataclass
class LlamaCppEngine(Engine):
    """Measures plans with a real llama-bench (or ik llama-sweep-bench). See the module docstring."""
    binary: str | Path | None = None
    timeout_s: float = 900.0
    sample_interval_s: float = 0.05
    model_path: str | Path | None = None     # default: the inventory's source file
    verbose: bool = False                     # always pass -v (log memory lines into raw["log_memory"])
    ngl_rule: SlotRule | None = None          # override the detected -ngl semantics
    sample_vram: bool = True
    cpu_stand_in: bool = False                # run every plan with its tensors on the CPU (a CPU-only dry run)
    name: str = "llamacpp"
    path: Path = field(init=False)
    info: BinaryInfo = field(init=False)
    _sampler: Any = field(init=False, default=_UNSET, repr=False)
    _devices: Any = field(init=False, default=_UNSET, repr=False)

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise InputError(f"timeout must be positive, got {self.timeout_s}")
        self.path = find_binary(self.binary)
        self.info = probe(self.path, self.ngl_rule)

    # -- pieces -------------------------------------------------------------------------------------------------------

    def sampler(self) -> gpumem.MemorySampler | None:
        if self._sampler is _UNSET:
            self._sampler = gpumem.detect(self.sample_interval_s) if self.sample_vram else None
        return self._sampler

    def devices(self) -> dict[str, dict[str, Any]] | None:
        """The devices this build sees ({"CUDA0": {"description", "total_bytes", "free_bytes"}}), from
        `--list-devices` (mainline; cached per engine), or None when the binary cannot list them (ik)."""
        if self._devices is _UNSET:
            self._devices = list_devices(self.path, self.info.flags)
        return self._devices

    def _check_devices(self, plan: Plan) -> None:
        check_devices(plan, self.devices(), self.path.name)

    def _device_args(self, plan: Plan) -> list[str]:
        return device_args(plan, self.devices(), self.info.flags)

    def _model(self, inv: ModelInventory) -> str:
        p = self.model_path if self.model_path is not None else inv.source
        if not p or not Path(p).is_file():
            raise InputError(f"the llamacpp engine needs the model file; {p or inv.name!r} is not one "
                             "(presets cannot run: write one with `offload-tuner synth`)")
        return str(p)

    def _check_flags(self, argv: Sequence[str], what: str) -> None:
        if not self.info.flags:
            return
        hidden = IK_GPU_ONLY_HELP if (self.info.dialect, self.info.tool) == ("ik", "sweep") else frozenset()
        missing = [a for a in argv if FLAG_TOKEN.fullmatch(a) and a not in self.info.flags and a not in hidden]
        if missing:
            raise InputError(f"{self.path.name} ({self.info.dialect}) does not accept {missing[0]}, which {what} "
                             "needs (its --help lists no such flag); use a newer llama.cpp build")

    def _check_ngl(self, inv: ModelInventory, plan: Plan, argv: Sequence[str], tool: str) -> None:
        """Refuse a plan that the binary's -ngl rule would place differently from the renderer's rule (the build's:
        mainline's output layer first from PR #18148 on)."""
        if self.info.ngl_rule == slot_rule(plan.dialect, self.info.build):
            return
        pc = parse(list(argv), inv, plan.dialect, tool=tool, build=self.info.build)
        devices = [f"CUDA{i}" for i in range(max(pc.n_gpus, 1))]
        slots = slot_devices(inv.hparams.n_layer, pc.n_gpu_layers, self.info.ngl_rule, devices, pc.tensor_split)
        placed, _ = apply_overrides(base_assignment(inv, slots), pc.overrides, allocated_names(inv))
        diff = [n for n, d in plan.assignment.items() if placed.get(n, d) != d]
        if diff:
            raise InputError(f"{self.path.name} counts -ngl as {self.info.ngl_rule} ({self.info.ngl_rule_source}), "
                             f"so -ngl {pc.n_gpu_layers} would put {diff[0]} elsewhere than the plan; use a build "
                             "with PR #18148 (output layer first) or pass ngl_rule= if the guess is wrong")

    def command(self, inv: ModelInventory, plan: Plan, bench: BenchRun) -> EngineCommand:
        """The command measure() runs for this plan (InputError if this binary cannot run it)."""
        if plan.dialect != self.info.dialect:
            raise InputError(f"the plan is for {plan.dialect}, but {self.path} is a {self.info.dialect} build; "
                             f"re-plan with --dialect {self.info.dialect}")
        model = self._model(inv)
        self._check_devices(plan)
        if self.info.tool == "sweep":
            return self._sweep_command(inv, plan, bench, model)
        notes: list[str] = []
        extra: list[str] = []
        rendered: BenchRun | _RenderBench = bench    # what -p/-n/-d say
        if bench.depth and not self.info.abilities["depth"]:
            if not (self.info.abilities["gen_at_depth"] and bench.n_gen):
                raise InputError(f"{self.path.name} has no -d (context depth {bench.depth}); measure at depth 0 or "
                                 "use llama-sweep-bench")
            extra = ["-gp", f"{bench.depth},{bench.n_gen}"]
            notes.append(f"ik llama-bench has no -d: TG measured with -gp {bench.depth},{bench.n_gen}; "
                         "PP at depth 0")
            rendered = _RenderBench(bench.n_prompt, 0, 0, bench.repetitions)
        try:
            rc = render(plan, inv, "bench", bench=rendered, model_path=model, build=self.info.build)
        except FlagError as e:
            raise InputError(f"cannot render the plan for {self.path.name}: {e}") from e
        # -o first: llama-bench's parser forgets an earlier bad argument (an unknown -ot buffer type) when a later
        # -o parses (tools/llama-bench/llama-bench.cpp: invalid_param = !output_format_from_str(...))
        argv = ["-o", self.info.output_format, *rc, *extra, *self._device_args(plan)]
        if self.verbose:
            argv.append("-v")
        self._check_flags(argv, "this plan")
        self._check_ngl(inv, plan, list(rc), "bench")
        return EngineCommand(str(self.path), tuple(argv), dict(rc.env), (*rc.notes, *notes),
                             gpu_devices=tuple(d for d in plan.devices() if d != "CPU"))

    def _sweep_command(self, inv: ModelInventory, plan: Plan, wl: BenchRun, model: str) -> EngineCommand:
        ub = min(plan.knobs.n_batch, plan.knobs.n_ubatch)
        row = wl.depth // ub * ub
        n_ctx = sweep_ctx(plan.knobs.n_ubatch, plan.knobs.n_batch, wl)
        p = replace(plan, knobs=replace(plan.knobs, n_ctx=n_ctx))
        try:
            rc = render(p, inv, "server", model_path=model, build=self.info.build)
        except FlagError as e:
            raise InputError(f"cannot render the plan for {self.path.name}: {e}") from e
        argv = [*rc, *self._device_args(plan), "-n", str(max(wl.n_gen, 1)), "-nrep", str(wl.repetitions)]
        if "--output-format" in self.info.flags:
            argv += ["--output-format", "jsonl"]
        if self.verbose:
            argv.append("-v")
        self._check_flags(argv, "this plan")
        self._check_ngl(inv, p, list(rc), "server")
        notes = (f"llama-sweep-bench: PP over one ubatch ({ub} tokens) and TG over {max(wl.n_gen, 1)} tokens, "
                 f"both at a depth of {row} tokens (-c {n_ctx}); n_prompt is not used",)
        return EngineCommand(str(self.path), tuple(argv), dict(rc.env), (*rc.notes, *notes), sweep_depth=row,
                             gpu_devices=tuple(d for d in plan.devices() if d != "CPU"))

    # -- running -------------------------------------------------------------------------------------------------------

    def _env(self, extra: Mapping[str, str]) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")   # CUDA numbering = nvidia-smi numbering
        env.update(extra)
        return env

    def run(self, cmd: EngineCommand) -> RunResult:
        return run_process([cmd.program, *cmd.argv], self._env(cmd.env), self.timeout_s, self.sampler())

    def measure(self, inv: ModelInventory, plan: Plan, bench: BenchRun) -> Measurement:
        if self.cpu_stand_in:       # the same knobs, every tensor on the CPU: the pipeline runs, not the GPU plan
            plan = replace(plan, assignment={n: "CPU" for n in plan.assignment})
        cmd = self.command(inv, plan, bench)
        return self.measure_command(cmd, bench)

    def measure_args(self, args: Sequence[str], bench: BenchRun, env: Mapping[str, str] | None = None
                     ) -> Measurement:
        """Run this binary with hand-made arguments (e.g. llama.cpp's own -fitt) and read them like a plan's run."""
        argv = list(args)
        if self.info.tool == "bench" and "-o" not in argv and "--output" not in argv:
            argv = ["-o", self.info.output_format, *argv]
        if self.verbose and "-v" not in argv:
            argv.append("-v")
        return self.measure_command(EngineCommand(str(self.path), tuple(argv), dict(env or {})), bench)

    def run_memory(self, inv: ModelInventory, plan: Plan, bench: BenchRun,
                   hw: HardwareProfile | None = None) -> MemoryReport:
        """What a run of the plan at this bench run holds per device (bench_memory: llama-bench's contexts)."""
        return bench_memory(inv, plan, bench, hw)

    @property
    def dialect(self) -> str:                     # type: ignore[override]
        return self.info.dialect

    def shell_command(self, inv: ModelInventory, plan: Plan, bench: BenchRun) -> str:
        return self.command(inv, plan, bench).shell

    @property
    def op_offload_per_class(self) -> bool:       # type: ignore[override]
        """ik's llama-sweep-bench takes -op per op class; ik's llama-bench has one switch (docs/ik_llama.md)."""
        return self.info.dialect == "ik" and self.info.tool != "bench"

    def run_context(self, bench: BenchRun, plan: Plan | None = None) -> int:
        """The largest context a run of this bench run holds (llama-bench: one context per test; sweep-bench: the
        -c of the plan's run, whole ubatch rows up to the one it reads), so the tuner can add the memory model's KV
        and compute for the emitted -c. Without the plan, sweep-bench's smallest (-ub 512)."""
        if self.info.tool == "sweep":
            if plan is not None:
                return sweep_ctx(plan.knobs.n_ubatch, plan.knobs.n_batch, bench)
            return bench.depth + max(bench.n_gen, 512)
        return max(bench_contexts(bench), default=0)

    def own_fit(self, inv: ModelInventory, bench: BenchRun, budgets: Mapping[str, int],
                knobs: Sequence[str] = ("-fa", "1", "-ub", "512", "-b", "2048")) -> EngineFit | None:
        """llama.cpp's own --fit at these per-GPU budgets, measured by llama-bench -fitt (mainline) or by ik's
        llama-sweep-bench --fit --fit-margin (docs/ik_llama.md, "ik's own --fit"). None when the binary has no
        such fit: mainline before PR #21304, and ik's llama-bench (its --fit reserves KV for the model's whole
        training context, n_ctx_train, because it never sets max_ctx_size: a fit no server user gets, so not
        a fair reference; use ik's llama-sweep-bench). The target is the free memory llama.cpp must leave on
        each device: what is free now minus the budget (one value for all devices, so the tightest GPU's).
        mainline: also asks llama-fit-params (beside llama-bench, when there) which placement `llama-server
        --fit` picks for the bench run's context, which the study measures beside it."""
        if self.info.dialect == "ik":
            return self._ik_fit(inv, bench, budgets, knobs) if self.info.tool == "sweep" else None
        if not self.info.abilities["fit_target"] or self.info.tool != "bench":
            return None
        free, target_mib = self._fit_target(budgets)
        argv = ("-m", self._model(inv), "-p", str(bench.n_prompt), "-n", str(bench.n_gen),
                "-r", str(bench.repetitions), *(("-d", str(bench.depth)) if bench.depth else ()),
                *knobs, "-fitt", str(target_mib))
        m = self.measure_args(argv, bench)
        note = f"-fitt {target_mib} MiB (free {_mib_list(free)})"
        return EngineFit(m, argv, {}, target_mib << 20, self._fit_choice(inv, bench, target_mib, knobs), note)

    def _fit_target(self, budgets: Mapping[str, int]) -> tuple[dict[str, int], int]:
        """(free bytes per GPU now, the MiB --fit must leave free on the tightest one: free - budget, >= 1; 1024
        when free memory cannot be read, llama.cpp's own default margin)."""
        sampler = self.sampler()
        free = gpumem.per_cuda_device(sampler.free(), self._env({})) if sampler is not None else {}
        targets = [free[d] - b for d, b in budgets.items() if d in free]
        return free, (max(min(targets) // (1 << 20), 1) if targets else 1024)

    def _ik_fit(self, inv: ModelInventory, bench: BenchRun, budgets: Mapping[str, int],
                knobs: Sequence[str]) -> EngineFit | None:
        """ik's --fit as a server user runs it: llama-sweep-bench -c CTX --fit --fit-margin M with the study's
        default knobs (docs/ik_llama.md, "ik's own --fit"). ik sizes KV and compute for max_ctx_size = the
        server's -c (common/common.cpp ~4273) and leaves M MiB free on each GPU (src/llama.cpp ~4298; 0 would
        mean its 1 GiB default, so M >= 1). CTX is the context the emitted command holds (depth + prompt +
        generated), the one every trial's peak is judged at. The placement ik chose
        is read from its log (runtime/llamacpp_logs.py parse_ik_fit)."""
        if "--fit" not in self.info.flags or "--fit-margin" not in self.info.flags:
            return None                        # an ik build from before its auto-fit
        free, margin_mib = self._fit_target(budgets)
        kn = dict(zip(knobs[::2], knobs[1::2]))
        ub, nb = int(kn.get("-ub", 512)), int(kn.get("-b", 2048))
        # fitted for (at least) the context the user's server holds, depth + prompt + generated, as the trials are
        # judged at it. sweep-bench steps one ubatch per row while n_kv < -c and fails the decode of a row that
        # crosses -c, so -c is rounded up to whole ubatches (a few dozen MiB of KV more than the server's)
        step = min(ub, nb)
        want = max(sweep_ctx(ub, nb, bench), bench.depth + bench.n_prompt + bench.n_gen)
        n_ctx = -(-want // step) * step
        argv = ["-m", self._model(inv), "-c", str(n_ctx), "-b", str(nb), "-ub", str(ub)]
        if "-fa" in kn:
            argv += ["-fa", "on" if kn["-fa"] in ("1", "on") else "off"]
        if "-t" in kn:
            argv += ["-t", kn["-t"]]
        argv += ["-n", str(max(bench.n_gen, 1)), "-nrep", str(bench.repetitions)]
        if "--output-format" in self.info.flags:
            argv += ["--output-format", "jsonl"]
        note = f"ik --fit --fit-margin {margin_mib} MiB at -c {n_ctx} (free {_mib_list(free)})"
        if self.cpu_stand_in:
            # a CPU build runs ik's fit block against 0 MiB of device memory and always fails ("Unable to
            # auto-fit model"): the stand-in runs the same line without --fit, all-CPU like every stand-in plan
            note = "CPU stand-in: --fit dropped (a CPU build's fit always fails: no device memory); " + note
        else:
            argv += ["--fit", "--fit-margin", str(margin_mib)]
        if self.verbose:
            argv.append("-v")
        cmd = EngineCommand(str(self.path), tuple(argv), {}, sweep_depth=bench.depth // step * step)
        run = self.run(cmd)
        m = self._read_run(run, cmd, bench)
        choice = None if self.cpu_stand_in else parse_ik_fit(run.stderr)
        if choice is not None:
            note += (f"; ik: {choice.required_mib} MiB of tensors + cache required, {choice.available_mib} MiB "
                     f"available after compute, experts of {len(choice.cpu_expert_layers)} blocks kept in RAM"
                     + (", unable to auto-fit" if choice.failed else ""))
        return EngineFit(m, tuple(argv), {}, margin_mib << 20, choice.args() if choice else (), note,
                         program=self.path.name)

    def _fit_choice(self, inv: ModelInventory, bench: BenchRun, target_mib: int, knobs: Sequence[str]
                    ) -> tuple[str, ...]:
        """llama-fit-params' placement for the whole bench run's context, what `llama-server --fit on -c N` would
        pick for it ((), when the tool is missing or fails). llama-bench -fitt fits each of its tests on its own
        (the generation test to an n_gen-token context and ubatch), so its TG comes from a larger placement than
        any one server that takes the prompt could hold; this one is what a user's server runs."""
        exe = self.path.with_name("llama-fit-params")
        if not exe.is_file():
            return ()
        kn = [("on" if v == "1" else v) if k == "-fa" else v for k, v in zip(knobs[::2], knobs[1::2])]
        n_ctx = bench.depth + bench.n_prompt + bench.n_gen
        argv = [str(exe), "-m", self._model(inv), "-c", str(n_ctx), "-fitt",
                str(target_mib), "-np", "1", *(x for pair in zip(knobs[::2], kn) for x in pair)]
        run = run_process(argv, self._env({}), 600)
        line = next((ln.strip() for ln in run.stdout.splitlines() if ln.startswith("-c ")), None)
        if run.returncode != 0 or line is None:
            return ()
        return tuple(shlex.split(line))

    def measure_command(self, cmd: EngineCommand, bench: BenchRun) -> Measurement:
        return self._read_run(self.run(cmd), cmd, bench)

    def _read_run(self, run: RunResult, cmd: EngineCommand, bench: BenchRun) -> Measurement:
        """The Measurement of a finished run of cmd (a failure that hides its reason is re-run with -v)."""
        try:                                      # engine output is untrusted: any shape is a failed measurement
            pp, tg, tests, backends = self._results(run, cmd)
            bad_output = None
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError, RecursionError) as e:
            pp, tg, tests, backends = None, None, [], set()
            bad_output = Failure("no_output", f"{self.path.name} printed results we cannot read "
                                              f"({type(e).__name__}: {str(e)[:120]})")
        have = (pp is not None or bench.n_prompt == 0) and (tg is not None or bench.n_gen == 0)
        failure = classify_failure(run.stdout, run.stderr, run.returncode, timed_out=run.timed_out,
                                   timeout_s=self.timeout_s, have_results=have)
        if failure is None:
            failure = bad_output
        if failure is None:
            failure = _check_echo(cmd, tests)
        if failure is None and cmd.gpu_devices and backends and not any(b != "CPU" for b in backends):
            failure = Failure("no_gpu", f"the plan puts tensors on {cmd.gpu_devices[0]}, but this build ran on "
                                        f"{'/'.join(sorted(backends))} only (no GPU backend)")
        log_run = run
        if failure is not None and failure.kind in RERUN_VERBOSE and "-v" not in cmd.argv:
            log_run = self.run(replace(cmd, argv=(*cmd.argv, "-v")))
            failure = _with_rerun(failure, log_run, self.timeout_s)
        return self._measurement(run, log_run, cmd, pp, tg, tests, failure)

    def _results(self, run: RunResult, cmd: EngineCommand
                 ) -> tuple[float | None, float | None, list[dict[str, Any]], set[str]]:
        """(pp_tps, tg_tps, the tests as data, the backends the records name: empty when unknown)."""
        if self.info.tool == "sweep":
            rows = parse_sweep_output(run.stdout + "\n" + run.stderr)
            row = _sweep_row(rows, cmd.sweep_depth or 0)
            tests = [dataclasses.asdict(r) for r in rows]
            return (row.pp_tps, row.tg_tps, tests, set()) if row is not None else (None, None, tests, set())
        results = parse_bench_output(run.stdout)
        pp = next((r for r in results if r.kind == "pp"), None)
        tg = next((r for r in results if r.kind == "tg"), None)
        return (pp.median_ts if pp else None, tg.median_ts if tg else None, [r.summary() for r in results],
                {b for r in results for b in _backends(r)})

    def _measurement(self, run: RunResult, log_run: RunResult, cmd: EngineCommand, pp: float | None,
                     tg: float | None, tests: list[dict[str, Any]], failure: Failure | None) -> Measurement:
        verbose = "-v" in log_run.argv
        peak = {d: b for d, b in run.gpu_peak_bytes.items()}
        source = run.vram_source
        if run.vram_source == "none" and verbose:
            peak = log_device_bytes(log_run.stderr)
            source = "log" if peak else "none"
        raw: dict[str, Any] = {
            "engine": self.name, "binary": str(self.path), "dialect": self.info.dialect, "tool": self.info.tool,
            "command": cmd.shell, "argv": list(cmd.argv), "env": dict(cmd.env), "notes": list(cmd.notes),
            "tests": tests, "returncode": run.returncode, "wall_s": round(run.wall_s, 3), "timed_out": run.timed_out,
            "vram_source": source, "vram_samples": run.gpu_samples, "vram_baseline_bytes": run.gpu_baseline_bytes,
            "log_tail": tail(log_run.stderr),
        }
        if verbose:
            raw["log_memory"] = log_memory(log_run.stderr)
        cvs = [t["stddev_ts"] / t["avg_ts"] for t in tests if t.get("avg_ts") and t.get("stddev_ts") is not None]
        if cvs:
            raw["cv"] = max(cvs)          # the run's noise over its repetitions (the worse of PP and TG)
        raw["seen"] = run.seen
        if failure is not None:
            raw["failure"] = failure.kind
            raw["stdout_tail"] = tail(log_run.stdout, 3000)
            raw["verbose_rerun"] = log_run is not run
            return Measurement.failed(failure.message, pp_tps=pp or 0.0, tg_tps=tg or 0.0, peak_bytes=peak,
                                      host_bytes=run.host_peak_bytes, raw=raw)
        return Measurement(pp_tps=pp or 0.0, tg_tps=tg or 0.0, peak_bytes=peak, host_bytes=run.host_peak_bytes,
                           raw=raw)


@dataclass(frozen=True)
class _RenderBench:
    n_prompt: int
    n_gen: int
    depth: int
    repetitions: int


def _with_rerun(first: Failure, log_run: RunResult, timeout_s: float | None) -> Failure:
    """The first run's failure (its kind and cause: signal, OOM, timeout, exit code) with what the verbose re-run
    showed added; a re-run that succeeded says the failure did not repeat."""
    if log_run.returncode == 0 and not log_run.timed_out:
        return Failure(first.kind, f"{first.message} (a verbose re-run succeeded: the failure did not repeat)")
    again = classify_failure(log_run.stdout, log_run.stderr, log_run.returncode, timed_out=log_run.timed_out,
                             timeout_s=timeout_s, have_results=False)
    if again is None or again.message == first.message:
        return first
    return Failure(first.kind, f"{first.message}; the verbose re-run: {again.message}")


def _check_echo(cmd: EngineCommand, tests: Sequence[dict[str, Any]]) -> Failure | None:
    """mainline llama-bench echoes the -ot set each test ran with: it must be one we passed (a bad -ot value
    followed by a good -o is silently dropped by its parser)."""
    if "-ot" not in cmd.argv:
        return None
    wanted = set(cmd.argv[cmd.argv.index("-ot") + 1].split(","))
    for t in tests:
        got = t.get("settings", {}).get("tensor_buft_overrides")
        if got is not None and got not in wanted:
            return Failure("args", f"llama-bench ran with -ot {got!r}, not {sorted(wanted)[0]!r}: it did not apply "
                                   "our overrides")
    return None


def _backends(r: BenchResult) -> set[str]:
    """Backends a llama-bench record says it ran with: mainline "backends" ("CUDA", "CPU", "CUDA,RPC"), ik "cuda"."""
    f = r.fields
    if isinstance(f.get("backends"), str):
        return {b.strip() for b in f["backends"].split(",") if b.strip()}
    if "cuda" in f:
        return {"CUDA"} if f["cuda"] else {"CPU"}
    return set()


def _mib_list(values: Mapping[str, int]) -> str:
    return ", ".join(f"{d} {v >> 20} MiB" for d, v in values.items()) or "unknown"


def sweep_ctx(n_ubatch: int, n_batch: int, wl: BenchRun) -> int:
    """The -c of a llama-sweep-bench run that measures one row at the bench run's depth: the row (a multiple of
    the ubatch, sweep-bench's step) plus room for its prompt ubatch and its generated tokens."""
    ub = min(n_batch, n_ubatch)
    return wl.depth // ub * ub + max(ub, wl.n_gen)


def _sweep_row(rows: Sequence[SweepRow], depth: int) -> SweepRow | None:
    exact = [r for r in rows if r.n_kv == depth]
    if exact:
        return exact[0]
    below = [r for r in rows if r.n_kv <= depth]
    return below[-1] if below else None


# ---- memory: what llama-bench allocates, and llama-fit-params as an oracle -------------------------------------------

def bench_contexts(bench: BenchRun) -> list[int]:
    """Context sizes of llama-bench's tests for a bench run: one per test, n_prompt + depth and n_gen + depth
    (tools/llama-bench/llama-bench.cpp to_llama_cparams; each test gets its own context, the model stays)."""
    out = []
    if bench.n_prompt:
        out.append(bench.n_prompt + bench.depth)
    if bench.n_gen:
        out.append(bench.n_gen + bench.depth)
    return out


def bench_memory(inv: ModelInventory, plan: Plan, bench: BenchRun, hw: HardwareProfile | None = None
                 ) -> MemoryReport:
    """planner.memory.estimate for what a llama-bench run of the plan peaks at: per device, the larger of its
    tests' contexts (the prompt test's n_ubatch-token graphs usually)."""
    reports = [estimate(inv, replace(plan, knobs=replace(plan.knobs, n_ctx=c)), hw) for c in bench_contexts(bench)]
    if not reports:
        return estimate(inv, plan, hw)
    devices: dict[str, DeviceMemory] = {}
    for rep in reports:
        for d, m in rep.devices.items():
            if d not in devices or m.total > devices[d].total:
                devices[d] = m
    first = reports[0]
    return MemoryReport(devices, first.host_mapped, first.host_pinned, first.notes)


def oracle(inv: ModelInventory, plan: Plan, model_path: str | Path, fit_params_binary: str | Path, *,
           timeout_s: float = 600.0) -> dict[str, dict[str, int]]:
    """llama-fit-params -fitp on for the plan's flags (its dry-run allocations): {device: {"model", "context",
    "compute"}} in bytes, floored to MiB by llama.cpp; "CPU" is its "Host" row. mainline only. InputError when
    llama-fit-params cannot run the plan (the reason is in the message)."""
    if plan.dialect != "mainline":
        raise InputError("llama-fit-params is a mainline llama.cpp tool; the oracle needs a mainline plan")
    exe = Path(fit_params_binary).expanduser()
    if not exe.is_file():
        raise InputError(f"--oracle {fit_params_binary}: no such file (give the path of llama-fit-params)")
    try:
        rc = render(plan, inv, "server", model_path=str(model_path))
    except FlagError as e:
        raise InputError(f"cannot render the plan for llama-fit-params: {e}") from e
    env = {**os.environ, "CUDA_DEVICE_ORDER": os.environ.get("CUDA_DEVICE_ORDER", "PCI_BUS_ID"), **rc.env}
    run = run_process([str(exe), *rc, "-fitp", "on"], env, timeout_s)
    rows = parse_fit_print(run.stdout)
    if run.returncode != 0 or run.timed_out or not rows:
        f = classify_failure(run.stdout, run.stderr, run.returncode, timed_out=run.timed_out, timeout_s=timeout_s,
                             have_results=bool(rows))
        why = f.message if f is not None else "it printed no device rows"
        raise InputError(f"llama-fit-params could not estimate this plan: {why}")
    return {("CPU" if name == "Host" else name): {"model": r.model, "context": r.context, "compute": r.compute}
            for name, r in rows.items()}


# ---- where the loader really put things (-v) -------------------------------------------------------------------------

@dataclass(frozen=True)
class LoaderPlacement:
    """What a -v run of llama-bench logged: tensor -> device for every override that matched, slot -> device."""
    overridden: dict[str, str]
    layer_devices: dict[int, str]
    log: str


def loader_placement(binary: str | Path, model_path: str | Path, args: Sequence[str], *,
                     timeout_s: float = 300.0) -> LoaderPlacement:
    """Run llama-bench -v with placement arguments (-ngl, -ot, -ncmoe ...) on a one-token prompt and read the
    loader's "buffer type overridden" and "layer N assigned to device" lines. RuntimeError if the run fails."""
    argv = [str(binary), "-m", str(model_path), "-p", "1", "-n", "0", "-r", "1", "--no-warmup", "-o", "jsonl",
            "-v", *args]
    run = run_process(argv, None, timeout_s)
    f = classify_failure(run.stdout, run.stderr, run.returncode, timed_out=run.timed_out, timeout_s=timeout_s)
    if f is not None:
        raise RuntimeError(f"llama-bench {' '.join(args)}: {f.message}")
    over: dict[str, str] = {}
    for name, buft in parse_override_lines(run.stderr):
        over.setdefault(name, device_of_buft(buft))
    return LoaderPlacement(over, parse_layer_devices(run.stderr), run.stderr)


def our_overrides(inv: ModelInventory, args: Sequence[str], dialect: str = "mainline", tool: str = "bench",
                  n_gpus: int | None = None) -> dict[str, str]:
    """What our matcher says the same arguments override: tensor -> device of its first matching override."""
    pc = parse(list(args), inv, dialect, tool=tool, n_gpus=n_gpus)
    ovs: Sequence[Override] = pc.overrides
    res = match_overrides(allocated_names(inv), ovs)
    return {name: ovs[idx].device for name, idx in res.first.items()}


def from_options(opts: EngineOptions, hw: HardwareProfile) -> LlamaCppEngine:
    """The registry's factory (planner/engine_registry.py): llama-bench from the options (else $LLAMA_BENCH, else
    PATH)."""
    return LlamaCppEngine(binary=opts.llama_bench, timeout_s=opts.timeout_s, model_path=opts.model_path,
                          cpu_stand_in=opts.cpu_stand_in)
