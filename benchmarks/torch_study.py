"""Issue 5 acceptance on the GPU machine: one study of <= 40 measured trials on the Qwen3-30B-A3B-shaped model in
BF16 (weights synthesized in memory by the torch engine) at a 24 GiB budget, against the grid of whole-layer
placements, measured with the same engine and workload.

Phases (--phase, default all, in this order; each skips what is done, so a killed or time-limited call resumes):
  grid     -ngl N for N = 0 .. the most the memory model fits in the budget (VRAM - margin), every tensor of a
           layer on the GPU and the rest in RAM, the output layer with the last layer as llama.cpp puts it (the
           planner's -ngl parser), at -ub 512 and -ub 2048; the other knobs at llama.cpp's defaults as the study's
           "default" seed has them (-b 2048, f16 KV, flash attention, op offload at batch 32, all threads). More
           than GRID_MAX_N values of N: every other N, always 0 and the most. Finished points are kept in
           OUT/torch_grid.json (written after every point, read at start).
  study    what `offload-tuner tune MODEL --engine torch --gpu 24GiB --objective both --trials T --study NAME
           --storage URL --hardware HW --n-prompt .. --n-gen .. --reps ..` does, in this process so that one
           engine (and the torch engine's synthesized weights) serves the grid and every trial; its space is the
           full one with KV_TYPES, set here (tune's tuner.setup.study_setup would settle it for a measured engine,
           which this benchmark, made before the settled space, compares against). The study lives in
           --storage (default sqlite:///OUT/torch_study.db) and resumes by name; T counts the engine runs of its
           trials as tune's --trials does (a resumed call adds what is missing); a new study also measures its 3
           baselines first (-ngl 99 -cmoe, a --fit-like fill, the planner's first proposal), so the default T = 37
           makes 40 measured configurations in all. Its report (plots, Markdown, CSV, JSON) goes to
           OUT/reports/NAME.
  compare  OUT/torch_study.json, OUT/torch_study.md and OUT/torch_study.png: the grid table, the study's measured
           TG/PP Pareto front, the best TG and PP of each side (runs whose measured peak is within the budget)
           with the ratio study/grid, the number of measured trials, and the failed runs with their reasons.
           Needs neither the engine nor a GPU: it can run again wherever OUT was copied.

--time-budget S: no grid point, study, or trial starts once S seconds have passed since the start, or when less
than the longest run so far (at least --run-estimate, default 60 s for the torch engine: its first run
synthesizes the weights) is left; what is finished is saved, and the same command continues it.

On the GPU machine (its python3 has torch, numpy, scipy, pandas and matplotlib; optuna, sqlalchemy, alembic,
colorlog, mako and greenlet travel as wheels in .whl/), each call:
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
        .whl/*.whl && export PYTHONPATH=/tmp/site || exit
    python3 benchmarks/torch_study.py --out $OUT/torch_study --time-budget 480
and a later call first copies the previous call's OUT/torch_study back in place (chmod -R u+w: sqlite writes it).
Here, a dry run with the cost model as the engine:
    .venv/bin/python benchmarks/torch_study.py --engine sim --out /tmp/torch_study_sim
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.cost import predict  # noqa: E402
from planner.errors import InputError  # noqa: E402
from planner.flags import parse, render_shell  # noqa: E402
from planner.hardware import GiB, fmt_bytes, load_hardware, parse_size  # noqa: E402
from planner.loader import load_model  # noqa: E402
from planner.engine_contract import MemoryModel, TimedEngine, memory_model, memory_model_name  # noqa: E402
from planner.model import ModelInventory  # noqa: E402
from planner.plan import Plan  # noqa: E402
from planner.propose import Room, model_id  # noqa: E402
from tuner.records import StudyRecord, TrialRecord  # noqa: E402
from tuner.search import slug  # noqa: E402
from planner.bench_run import BenchRun  # noqa: E402
from tuner.space import Space, SpaceConfig  # noqa: E402

PHASES = ("grid", "study", "compare")
GRID_UBATCHES = (512, 2048)
GRID_MAX_N = 14            # more values of N than this: every other N (always 0 and the most)
KV_TYPES = ("f16", "q8_0")  # the tune command's default --kv-types
GRID_FILE = "torch_grid.json"
DEFAULT_RUN_ESTIMATE_S = {"torch": 60.0}
DEFAULT_TRIALS = 37        # + the study's 3 baseline runs = 40 measured configurations (issue 5: <= 40)


# ---- time budget ------------------------------------------------------------------------------------------------

class Clock:
    """Wall time since the start against --time-budget; `longest` is the longest run seen, at least the estimate.
    The process's first run is not counted: the torch engine synthesizes the weights in it (later runs reuse them)."""

    def __init__(self, budget_s: float | None, estimate_s: float) -> None:
        self.t0 = time.perf_counter()
        self.budget_s = budget_s
        self.longest = estimate_s
        self.first_s: float | None = None

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def can_start(self, runs: int = 1) -> bool:
        """Whether `runs` runs as long as the longest so far still end within the budget."""
        return self.budget_s is None or self.elapsed() + runs * self.longest <= self.budget_s

    def ran(self, seconds: float) -> None:
        if self.first_s is None:
            self.first_s = seconds
        else:
            self.longest = max(self.longest, seconds)


def log(msg: str) -> None:
    print(f"[torch_study {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- the set-up every phase shares ----------------------------------------------------------------------------------

class Setup:
    """Model, hardware, workload, the search space's settings and (lazily) one engine for every phase."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out)
        self.inv = load_model(args.model)
        self.hw = load_hardware(args.hardware).with_vram([parse_size(s) for s in args.gpu.split(",")])
        if len(self.hw.gpus) != 1:
            raise InputError(f"--gpu {args.gpu}: this study is for one GPU")
        self.margin = parse_size(args.margin)
        self.bench = BenchRun(n_prompt=args.n_prompt, n_gen=args.n_gen, depth=0, repetitions=args.reps)
        need = self.bench.depth + self.bench.n_prompt + self.bench.n_gen
        self.n_ctx = max(8192, -(-need // 256) * 256)       # the tuner's default context for this workload
        self.config = SpaceConfig(kv_types=KV_TYPES)
        self.room = Room.from_hardware(self.hw, self.margin)
        self.study_name = args.study or slug(f"{self.inv.name}-{args.gpu}-{args.engine}-both")
        self.storage = args.storage or f"sqlite:///{self.out / 'torch_study.db'}"
        est = args.run_estimate if args.run_estimate is not None else DEFAULT_RUN_ESTIMATE_S.get(args.engine, 0.0)
        self.clock = Clock(args.time_budget, est)
        self._engine: TimedEngine | None = None
        self._memory: MemoryModel | None = None
        self.report_tried = False           # the study phase wrote (or could not write) the report already

    def engine(self) -> TimedEngine:
        if self._engine is None:
            from offload_tuner.app import load_engine    # one line (InputError) for an engine this machine cannot run
            from planner.options import EngineOptions
            opts = EngineOptions(engine=self.args.engine, model=self.args.model)
            self._engine = TimedEngine(load_engine(opts, self.hw), self.clock.ran)
            log(f"engine {self._engine.name} ready")
        return self._engine

    def settings(self) -> dict[str, Any]:
        """What the grid was measured for; a resumed grid must match."""
        return {"model": self.args.model, "model_id": model_id(self.inv), "engine": self.args.engine,
                "hardware": {"name": self.hw.name, "gpus": [[g.name, g.vram_bytes] for g in self.hw.gpus]},
                "workload": asdict(self.bench), "n_ctx": self.n_ctx, "margin_bytes": self.margin,
                "ubatches": list(GRID_UBATCHES)}

    def budget_bytes(self) -> int:
        return self.room.gpus["CUDA0"]

    def memory(self) -> MemoryModel:
        """The memory model that judges the engine's plans (the tuner's: the engine's own prediction where it has
        one, the torch engine's; planner.memory's estimate for sim)."""
        if self._memory is None:
            self._memory = memory_model(self.engine(), self.bench)
        return self._memory


# ---- grid -----------------------------------------------------------------------------------------------------------

def parse_ngl(inv: ModelInventory, n: int, knobs: Any) -> Plan:
    """`-ngl n` as llama.cpp places it (the planner's parser: layers n_layer + 1 - n .. and the output layer on
    CUDA0, everything else in RAM), with `knobs`."""
    a = parse(["-ngl", str(n)], inv, "mainline").assignment
    return Plan(model_id(inv), a, knobs, "mainline", f"-ngl {n} -ub {knobs.n_ubatch} -b {knobs.n_batch}")


def grid_plans(s: Setup) -> list[tuple[int, int, Plan]]:
    """(N, ubatch, plan) of every grid point: `-ngl N` placements (the planner's parser) with the study's
    default knobs at that ubatch, for N = 0 .. the most that fits the budget (thinned past GRID_MAX_N values)."""
    memory = s.memory()
    space = Space(s.inv, s.hw, dialect="mainline", n_ctx=s.n_ctx, margin=s.margin, config=s.config, memory=memory)
    out = []
    for ub in GRID_UBATCHES:
        params = {**space.default_params(), "ubatch_log2": int(math.log2(ub)),
                  "batch_mult_log2": space.dims["batch_mult_log2"].snap(math.log2(max(2048 // ub, 1)))}
        knobs = space.knobs(space.fixed(params))      # -b 2048 as llama.cpp's default, as the "default" seed
        fitting = []
        for n in range(s.inv.n_layer + 2):      # -ngl n_layer + 1 puts every layer and the output on the GPU
            plan = parse_ngl(s.inv, n, knobs)
            if space.over_budget(memory(s.inv, plan, s.hw)):
                break
            fitting.append((n, plan))
        if len(fitting) > GRID_MAX_N:
            last = fitting[-1]
            fitting = fitting[::2] + ([last] if last[0] % 2 else [])
        out += [(n, ub, plan) for n, plan in fitting]
    return out


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(f"cannot read {path}: {e}; move it away to start that phase over") from e


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)


def load_grid(s: Setup) -> dict[str, Any]:
    path = s.out / GRID_FILE
    saved = _read_json(path)
    if saved is None:
        return {"settings": s.settings(), "points": []}
    if saved.get("settings") != s.settings():
        diff = [k for k, v in s.settings().items() if saved.get("settings", {}).get(k) != v]
        raise InputError(f"{path} was measured with other settings ({', '.join(diff)}); use another --out")
    return saved


def run_grid(s: Setup) -> dict[str, Any]:
    grid = load_grid(s)
    done = {(p["n_gpu_layers"], p["ubatch"]) for p in grid["points"]}
    todo = [(n, ub, plan) for n, ub, plan in grid_plans(s) if (n, ub) not in done]
    log(f"grid: {len(done)} points done, {len(todo)} to measure")
    for i, (n, ub, plan) in enumerate(todo):
        if not s.clock.can_start():
            log(f"grid: time budget reached after {s.clock.elapsed():.0f} s; {len(todo) - i} points left for the "
                "next call")
            break
        engine = s.engine()
        mem = s.memory()(s.inv, plan, s.hw)
        pr = predict(s.inv, plan, s.hw, n_prompt=max(s.bench.n_prompt, 1), depth=s.bench.depth)
        t0 = time.perf_counter()
        try:
            m = engine.measure(s.inv, plan, s.bench)
        except InputError:
            raise
        except Exception as e:     # an engine bug: a recorded failure, as the tuner records it
            from planner.engine_contract import Measurement
            m = Measurement.failed(f"engine raised {type(e).__name__}: {e}")
        dt = time.perf_counter() - t0
        peak = {k: int(v) for k, v in dict(m.peak_bytes).items()}
        point = {
            "n_gpu_layers": n, "ubatch": ub, "plan_id": plan.id, "label": plan.label,
            "flags": render_shell(plan, s.inv, "server", model_path="MODEL.gguf"),
            "predicted": {"gpu_bytes": mem.devices["CUDA0"].total if "CUDA0" in mem.devices else 0,
                          "tg_tps": pr.tg_tps, "pp_tps": pr.pp_tps},
            "measured": {"ok": bool(m.ok), "error": str(m.error or ""), "pp_tps": float(m.pp_tps),
                         "tg_tps": float(m.tg_tps), "peak_bytes": peak, "host_bytes": int(m.host_bytes)},
            "within_budget": bool(m.ok) and peak.get("CUDA0", 0) <= s.budget_bytes(),
            "duration_s": round(dt, 2),
        }
        grid["memory_model"] = memory_model_name(s.memory())
        grid["points"].append(point)
        grid["points"].sort(key=lambda p: (p["ubatch"], p["n_gpu_layers"]))
        _write_json(s.out / GRID_FILE, grid)
        log(f"grid -ngl {n} -ub {ub}: " + (f"TG {m.tg_tps:.2f} PP {m.pp_tps:.1f} t/s, peak "
                                          f"{peak.get('CUDA0', 0) / GiB:.2f} GiB (predicted "
                                          f"{point['predicted']['gpu_bytes'] / GiB:.2f}) in {dt:.1f} s"
                                          if m.ok else f"failed: {m.error}"))
    return grid


# ---- study ----------------------------------------------------------------------------------------------------------

def engine_runs(study: Any) -> int:
    """Engine runs the study's trials made (a repeat of a plan, or a trial that took a baseline's run, made none)."""
    return sum(1 for t in study.get_trials(deepcopy=False) if TrialRecord.from_trial(t).engine_run)


def _checkpoint(storage_url: str, study: Any) -> None:
    """Fold SQLite's write-ahead log into the database file, so the one .db file carries the whole study."""
    if not storage_url.startswith("sqlite:"):
        return
    storage = study._storage
    storage = getattr(storage, "_backend", storage)
    engine = getattr(storage, "engine", None)
    if engine is None:
        return
    with engine.connect() as conn:
        conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
    engine.dispose()


def run_study(s: Setup) -> None:
    from tuner.search import Tuner, StudyConfig
    from tuner.storage import load_study, make_storage, study_exists
    done, have_baselines = 0, False
    if study_exists(make_storage(s.storage), s.study_name):
        old = load_study(s.study_name, s.storage)
        done, have_baselines = engine_runs(old), StudyRecord.of(old).baselines is not None
    left = s.args.trials - done
    if left <= 0:
        log(f"study {s.study_name}: {done} runs made, {s.args.trials} asked: nothing to do")
        return
    if not s.clock.can_start(1 if have_baselines else 4):   # a new study measures 3 baselines first
        log(f"study: not enough time left ({s.clock.elapsed():.0f} s used, runs take up to {s.clock.longest:.0f} s); "
            "the next call starts it")
        return
    engine = s.engine()
    tuner = Tuner(s.inv, s.hw, engine, StudyConfig(
        model=s.args.model, objective="both", bench=s.bench, dialect="mainline", n_ctx=s.n_ctx, margin=s.margin,
        config=s.config, study_name=s.study_name, storage=s.storage, seed=s.args.seed, pool_size=s.args.pool))
    log(f"study {s.study_name} in {s.storage}: {done} runs made, {left} to go")
    stop = {"why": ""}

    def progress(tuner: Any, trial: Any) -> None:
        rec = TrialRecord.from_trial(trial)
        m = rec.measured
        if m is not None and rec.duplicate_of is None:
            peak = sum(m.peak_bytes.values())
            what = (f"TG {m.tg_tps:.2f} PP {m.pp_tps:.1f} t/s, peak {peak / GiB:.2f} GiB" if m.ok
                    else f"failed: {m.error[:160]}")
            log(f"study trial {trial.number} ({rec.source}): {what}; {rec.label}")
        if not s.clock.can_start() and not stop["why"]:
            stop["why"] = f"time budget reached after {s.clock.elapsed():.0f} s"
            tuner.study.stop()

    try:
        result = tuner.run(left, progress=progress)
    finally:
        total = engine_runs(tuner.study)
        log(f"study {s.study_name}: {total} of {s.args.trials} runs made"
            + (f"; {stop['why']}: the same command continues it" if stop["why"] else ""))
    if result.stopped:
        log(f"study: {result.stopped}")
    write_report(s, tuner.study)
    _checkpoint(s.storage, tuner.study)


def write_report(s: Setup, study: Any) -> Path | None:
    """The `report` command's output for the study (plots need pandas and matplotlib; without them, one line)."""
    from tuner.report import write_study_report
    out = s.out / "reports" / s.study_name
    s.report_tried = True
    try:
        write_study_report(study, out)
    except ImportError as e:
        log(f"study report not written ({e}); run --phase compare where pandas and matplotlib are installed")
        return None
    log(f"study report: {out}/summary.md")
    return out


# ---- compare --------------------------------------------------------------------------------------------------------

def _front(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The non-dominated points (TG and PP both maximised), by TG descending."""
    out, best_pp = [], -1.0
    for p in sorted(points, key=lambda p: (-p["tg_tps"], -p["pp_tps"], p["peak_bytes"])):
        if p["pp_tps"] > best_pp:
            out.append(p)
            best_pp = p["pp_tps"]
    return out


def study_points(study: Any, budget_bytes: int) -> dict[str, Any]:
    """Every measured trial of the study (duplicates of a plan left out), its Pareto front over the successful
    runs within `budget_bytes` (the tuner fails the others: tuner.search), and its failures."""
    from optuna.trial import TrialState
    trials, failed = [], []
    for t in study.get_trials(deepcopy=False):
        rec = TrialRecord.from_trial(t)
        m = rec.measured
        if m is None or rec.duplicate_of is not None:
            continue
        row = {"trial": t.number, "source": rec.source, "plan_id": rec.plan_id,
               "label": rec.label, "flags": rec.commands.get("llama-server", ""),
               "ok": m.ok and t.state == TrialState.COMPLETE, "tg_tps": m.tg_tps,
               "pp_tps": m.pp_tps, "peak_bytes": sum(m.peak_bytes.values()),
               "predicted_gpu_bytes": sum(rec.candidate.gpu_bytes.values()) if rec.candidate is not None else 0,
               "reused_baseline_run": rec.reused_baseline_run, "error": m.error}
        trials.append(row)
        if not row["ok"]:
            failed.append({"trial": t.number, "label": row["label"], "error": row["error"] or t.state.name.lower()})
    record = StudyRecord.of(study)
    baselines_run = record.baselines or []
    baselines = [{"name": b["name"], "ok": bool(b.get("ok")), "error": b.get("error", ""),
                  "tg_tps": (b.get("measured") or {}).get("tg_tps"), "pp_tps": (b.get("measured") or {}).get("pp_tps"),
                  "peak_bytes": sum(((b.get("measured") or {}).get("peak_bytes") or {}).values())}
                 for b in baselines_run]
    runs_trials = sum(1 for r in trials if not r["reused_baseline_run"])
    runs_baselines = sum(1 for b in baselines_run if b.get("measured"))
    counts: dict[str, int] = {}
    for t in study.get_trials(deepcopy=False):
        counts[t.state.name.lower()] = counts.get(t.state.name.lower(), 0) + 1
    return {"name": study.study_name, "n_trials": sum(counts.values()), "counts": counts,
            "measured_trials": len(trials), "engine_runs": {"trials": runs_trials, "baselines": runs_baselines},
            "margin_bytes": record.margin_bytes, "margin_events": record.margin_events,
            "front": _front([r for r in trials if r["ok"] and r["peak_bytes"] <= budget_bytes]),
            "trials": trials, "failed": failed,
            "baselines": baselines}


def _best(points: list[dict[str, Any]], key: str) -> dict[str, Any] | None:
    return max(points, key=lambda p: (p[key], p["tg_tps" if key == "pp_tps" else "pp_tps"]), default=None)


def compare(s: Setup) -> dict[str, Any]:
    from tuner.storage import load_study, make_storage, study_exists
    grid = load_grid(s)
    gpts = [{"n_gpu_layers": p["n_gpu_layers"], "ubatch": p["ubatch"], "label": p["label"], "flags": p["flags"],
             "ok": p["measured"]["ok"], "within_budget": p["within_budget"], "tg_tps": p["measured"]["tg_tps"],
             "pp_tps": p["measured"]["pp_tps"], "peak_bytes": p["measured"]["peak_bytes"].get("CUDA0", 0),
             "predicted_gpu_bytes": p["predicted"]["gpu_bytes"], "error": p["measured"]["error"]}
            for p in grid["points"]]
    study = None
    if study_exists(make_storage(s.storage), s.study_name):
        st = load_study(s.study_name, s.storage)
        study = study_points(st, s.budget_bytes())
        if not s.report_tried:
            write_report(s, st)
    grid_ok = [p for p in gpts if p["within_budget"]]
    study_ok = [p for p in (study or {}).get("trials", []) if p["ok"] and p["peak_bytes"] <= s.budget_bytes()]
    best = {}
    for key, name in (("tg_tps", "tg"), ("pp_tps", "pp")):
        g, t = _best(grid_ok, key), _best(study_ok, key)
        best[name] = {"grid": g, "study": t, "ratio": (t[key] / g[key]) if g and t and g[key] > 0 else None}
    result = {"settings": {**s.settings(), "budget_bytes": s.budget_bytes(), "study": s.study_name,
                           "storage": s.storage, "trials_asked": s.args.trials},
              "grid": gpts, "grid_failed": [p for p in gpts if not p["within_budget"]],
              "memory_model": grid.get("memory_model", "planner.memory"),
              "study": study, "best": best, "plot": None,
              "report_dir": str(Path("reports") / s.study_name)}
    result["plot"] = plot(s, gpts, study)
    _write_json(s.out / "torch_study.json", result)
    (s.out / "torch_study.md").write_text(markdown(result))
    log(f"compare: {s.out / 'torch_study.md'}")
    return result


def plot(s: Setup, grid: list[dict[str, Any]], study: dict[str, Any] | None) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        log(f"no plot ({e}); run --phase compare where matplotlib is installed")
        return None
    fig, ax = plt.subplots(figsize=(7.5, 5.2))
    over_shown = False
    for ub, marker in zip(GRID_UBATCHES, ("o", "s")):
        pts = [p for p in grid if p["ubatch"] == ub and p["ok"]]
        inb = [p for p in pts if p["within_budget"]]
        ax.scatter([p["tg_tps"] for p in inb], [p["pp_tps"] for p in inb], marker=marker, s=36, facecolor="none",
                   edgecolor="C0" if ub == GRID_UBATCHES[0] else "C2", label=f"grid -ngl N, -ub {ub}")
        out = [p for p in pts if not p["within_budget"]]
        if out:
            ax.scatter([p["tg_tps"] for p in out], [p["pp_tps"] for p in out], marker="x", s=30, c="0.5",
                       label=None if over_shown else "measured peak over budget")
            over_shown = True
        for p in inb:
            ax.annotate(str(p["n_gpu_layers"]), (p["tg_tps"], p["pp_tps"]), fontsize=6, xytext=(3, 2),
                        textcoords="offset points", color="0.3")
    gfr = _front([p for p in grid if p["ok"] and p["within_budget"]])
    if gfr:
        ax.plot([p["tg_tps"] for p in gfr], [p["pp_tps"] for p in gfr], "--", c="C0", lw=1, label="grid: Pareto front")
    if study:
        over = [p for p in study["trials"] if not p["ok"] and p["error"].startswith("measured peak")]
        if over:
            ax.scatter([p["tg_tps"] for p in over], [p["pp_tps"] for p in over], marker="x", s=30, c="0.5",
                       label=None if over_shown else "measured peak over budget")
        ok = [p for p in study["trials"] if p["ok"]]
        ax.scatter([p["tg_tps"] for p in ok], [p["pp_tps"] for p in ok], s=14, c="0.65", label="study trials")
        fr = study["front"]
        ax.plot([p["tg_tps"] for p in fr], [p["pp_tps"] for p in fr], "o-", c="C3", ms=5, lw=1.5,
                label="study: measured Pareto front")
    ax.set_xlabel("TG (tokens/s)")
    ax.set_ylabel("PP (tokens/s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{s.inv.name} on {s.hw.gpus[0].name}, budget {fmt_bytes(s.hw.gpus[0].vram_bytes)} "
                 f"({s.args.engine} engine; PP {s.bench.n_prompt}, TG {s.bench.n_gen})", fontsize=9)
    fig.tight_layout()
    name = "torch_study.png"
    fig.savefig(s.out / name, dpi=120)
    plt.close(fig)
    return name


def _gib(b: float | None) -> str:
    return f"{b / GiB:.2f}" if b else "-"


def _md_table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return out


def markdown(r: dict[str, Any]) -> str:
    st, study = r["settings"], r["study"]
    w = st["workload"]
    L = [f"# Torch-engine study vs the -ngl grid: {st['model']}", "",
         f"Engine `{st['engine']}`; GPU budget {fmt_bytes(st['hardware']['gpus'][0][1])} "
         f"(VRAM - {fmt_bytes(st['margin_bytes'])} margin = {fmt_bytes(st['budget_bytes'])} for the runs, measured "
         f"peak included); hardware profile `{st['hardware']['name']}`; workload PP {w['n_prompt']} tokens, "
         f"TG {w['n_gen']} tokens, {w['repetitions']} repetitions (median); context {st['n_ctx']}. "
         f"predicted GiB: the {r.get('memory_model', 'planner.memory')} memory model (the one the study judges "
         "plans with: the torch engine's own dry-run accountant, TorchEngine.predict_memory; planner.memory's "
         "llama.cpp estimate for engines without one).", ""]
    L += ["## Best of each side (runs whose measured peak is within the budget)", ""]
    rows = []
    for name, col, fmt in (("TG", "tg_tps", "{:.2f}"), ("PP", "pp_tps", "{:.1f}")):
        b = r["best"][name.lower()]
        g, t = b["grid"], b["study"]
        rows.append([f"best {name} (t/s)", fmt.format(g[col]) + f" ({g['label']})" if g else "-",
                     fmt.format(t[col]) + f" (trial {t['trial']})" if t else "-",
                     f"{b['ratio']:.2f}x" if b["ratio"] else "-"])
    L += _md_table(["", "grid", "study", "study / grid"], rows) + [""]
    if study:
        er = study["engine_runs"]
        L += [f"Study `{study['name']}`: {study['measured_trials']} measured trials ({er['trials']} engine runs; "
              f"{study['measured_trials'] - er['trials']} took a baseline's run) plus {er['baselines']} baseline "
              f"runs; {study['n_trials']} trials in all ("
              + ", ".join(f"{v} {k}" for k, v in sorted(study["counts"].items())) + f"); {st['trials_asked']} runs "
              f"asked. Margin at the end {fmt_bytes(study['margin_bytes'] or 0)}"
              + (f" (raised {len(study['margin_events'])} times)" if study["margin_events"] else "") + ".", ""]
        L += ["## Study: measured Pareto front (TG vs PP)", ""]
        L += _md_table(["trial", "source", "TG t/s", "PP t/s", "peak GiB", "predicted GiB", "config"],
                       [[p["trial"], p["source"], f"{p['tg_tps']:.2f}", f"{p['pp_tps']:.1f}", _gib(p["peak_bytes"]),
                         _gib(p["predicted_gpu_bytes"]), p["label"]] for p in study["front"]]) + [""]
        L += ["Flags of the front (llama-server):", ""]
        L += [f"- trial {p['trial']}: `{p['flags']}`" for p in study["front"]] + [""]
        if study["baselines"]:
            L += ["Baselines the study measured first:", ""]
            L += _md_table(["baseline", "TG t/s", "PP t/s", "peak GiB", "error"],
                           [[b["name"], f"{b['tg_tps']:.2f}" if b["ok"] else "-",
                             f"{b['pp_tps']:.1f}" if b["ok"] else "-", _gib(b["peak_bytes"]), b["error"] or ""]
                            for b in study["baselines"]]) + [""]
    else:
        L += ["No study yet.", ""]
    L += ["## Grid: whole layers on the GPU (-ngl N), the rest in RAM", ""]
    L += _md_table(["N", "ubatch", "PP t/s", "TG t/s", "peak GiB", "predicted GiB", "within budget"],
                   [[p["n_gpu_layers"], p["ubatch"], f"{p['pp_tps']:.1f}" if p["ok"] else "-",
                     f"{p['tg_tps']:.2f}" if p["ok"] else "-", _gib(p["peak_bytes"]), _gib(p["predicted_gpu_bytes"]),
                     "yes" if p["within_budget"] else ("no" if p["ok"] else f"failed: {p['error']}")]
                    for p in r["grid"]]) + [""]
    fails = [(f"grid -ngl {p['n_gpu_layers']} -ub {p['ubatch']}", p["error"] or
              f"measured peak {_gib(p['peak_bytes'])} GiB over the budget {_gib(st['budget_bytes'])} GiB")
             for p in r["grid_failed"]]
    fails += [(f"study trial {f['trial']} ({f['label']})", f["error"]) for f in (study or {}).get("failed", [])]
    L += ["## Failed runs", ""]
    L += ([f"- {what}: {why}" for what, why in fails] or ["none"]) + [""]
    if r["plot"]:
        L += [f"![TG vs PP]({r['plot']})", ""]
    L += [f"The study's own report (plots of throughput vs VRAM, Pareto, history; CSV; JSON): `{r['report_dir']}/`.",
          ""]
    return "\n".join(L)


# ---- main -----------------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="folder for every file written")
    ap.add_argument("--model", default="preset:Qwen3-30B-A3B:BF16")
    ap.add_argument("--gpu", default="24GiB", help="the GPU budget (VRAM the study may use)")
    ap.add_argument("--hardware", default=str(ROOT / "benchmarks" / "reported" / "runtime_roofline_h100_hw.json"),
                    help="hardware profile (the memory and cost models' view of the machine)")
    ap.add_argument("--engine", choices=("torch", "sim"), default="torch", help="torch, or sim for a dry run")
    ap.add_argument("--trials", type=int, default=DEFAULT_TRIALS,
                    help=f"engine runs of the study's trials, as tune's --trials (default {DEFAULT_TRIALS}: with "
                         "the 3 baselines a new study measures first, 40 runs in all)")
    ap.add_argument("--study", help="study name (default from model, GPU budget and engine)")
    ap.add_argument("--storage", help="SQLAlchemy URL (default sqlite:///OUT/torch_study.db)")
    ap.add_argument("--n-prompt", type=int, default=2048)
    ap.add_argument("--n-gen", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--margin", default="512MiB", help="VRAM kept free (default 512MiB, as tune)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pool", type=int, default=200, help="candidates the cost model pre-screens (as tune)")
    ap.add_argument("--time-budget", type=float, help="seconds after which no new run starts")
    ap.add_argument("--run-estimate", type=float, help="seconds a run may take before one has been timed "
                                                      "(default 60 for torch, 0 otherwise)")
    ap.add_argument("--phase", choices=("all",) + PHASES, default="all")
    return ap


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        for flag in ("trials", "reps"):
            if getattr(args, flag) < 1:
                raise InputError(f"--{flag} must be at least 1")
        if args.n_prompt < 1 or args.n_gen < 1:
            raise InputError("--n-prompt and --n-gen must be at least 1 (the study compares TG and PP)")
        s = Setup(args)
        phases = PHASES if args.phase == "all" else (args.phase,)
        if "grid" in phases or "study" in phases:
            s.engine()           # an engine this machine cannot run: one line now, before anything is written
        s.out.mkdir(parents=True, exist_ok=True)
        if "grid" in phases:
            run_grid(s)
        if "study" in phases:
            run_study(s)
        if "compare" in phases:
            compare(s)
        return 0
    except InputError as e:
        print(f"torch_study: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("torch_study: interrupted; what finished is saved: run the same command to continue", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
