"""The tuner against llama.cpp's own `--fit` (issue 10): per VRAM budget and context depth, a study of at most
--runs engine runs on the real llama-bench (its baselines: --fit through llama-bench -fitt, -ngl 99 -cmoe, the best
-ncmoe N; its search; its confirmation: the finalists and --fit re-measured interleaved), on the synthetic
Qwen3-30B-A3B-shaped Q4_0 model of benchmarks/llamacpp_gpu.py.

Writes NAME.json, NAME.md and NAME.png (--name, default tune_vs_fit) to --out (default $OUT, else <workdir>/report): per
budget and depth the confirmed --fit, best TG (at no more VRAM than --fit measured) and balanced (best TG with PP
>= 1.5x --fit's) configs with medians, spreads, VRAM and flags, their ratios to --fit, the -ncmoe baseline and the
study's front. Also NAME_runs.jsonl: every llama-bench run of the studies in the format of the shared calibration data
(llama_bench_args, env, pp_tps, tg_tps, peak_vram_mib), for the cost-model benchmark.

Resumable across 10-minute device calls: each cell (budget, depth) is an Optuna study in <workdir>/tune_vs_fit.db
(SQLite), so a call cut off loses at most the run in flight; a call stops starting runs after --time-budget
seconds (a baseline, a search run or a confirmation round never starts past it; one in flight ends) and exits 3
while work is left (0 when every cell is confirmed). After each cell the report is rewritten and the database
copied, gzipped, beside it (tune_vs_fit_state.db.gz) after the baselines, the search and each confirmation sample of
a cell: a call killed at the device's limit still brings back all but the run it was in.
For a fresh machine, unpack it into the workdir you carry: `gunzip -c OUT/tune_vs_fit_state.db.gz >
benchmarks/results/tune_vs_fit/tune_vs_fit.db`.

On the GPU machine (after `bash benchmarks/llamacpp_gpu.sh build TARBALL`, which also serves this script; carry
.whl with optuna and its needs, see the device notes in README):
    python3 benchmarks/tune_vs_fit.py --budgets 8,16 --depths 0 --time-budget 520
Here, without a GPU, the whole pipeline on the CPU build, a tiny model, every plan run all-CPU (--cpu-stand-in):
    .venv/bin/python benchmarks/tune_vs_fit.py --cpu
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple
from collections.abc import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import device_options as opts  # noqa: E402
from planner.engine_contract import TimedEngine  # noqa: E402
from planner.gguf_header import load_inventory  # noqa: E402
from planner.hardware import GiB, MiB, load_hardware  # noqa: E402
from tuner.baselines import SERVER_FIT, server_fit_record  # noqa: E402
from tuner.records import StudyRecord, TrialRecord  # noqa: E402
from tuner.report import study_summary, trials_frame  # noqa: E402
from tuner.search import Tuner, StudyConfig  # noqa: E402
from tuner.setup import study_setup  # noqa: E402
from planner.bench_run import BenchRun  # noqa: E402
from runtime.cost_check import run_line  # noqa: E402

DEFAULT_WORKDIR = ROOT / "benchmarks" / "results" / "tune_vs_fit"
STATE_NAME = "tune_vs_fit_state.db.gz"   # the study database, as the report folder gets it after every cell
CONFIRM_CONTENDERS = 4      # --fit, its server placement, best TG, balanced: what confirmation costs per round
CONFIRM_RUN_S = 25.0        # seconds a confirmation run is planned at until this call has timed 3 runs
# what a whole device call gives a study (the 10-minute limit less start, install, build checks and report): a
# confirmation longer than 0.8 of it starts at once, as waiting for the next call would not help. An invocation
# given less (`--time-budget $((545-SECONDS))` after a build) is still judged against a whole call.
WHOLE_CALL_S = 520.0
DEFAULTS: opts.Defaults = {"runs": (30, 30), "confirm": (3, 3), "n_prompt": (2048, 32), "n_gen": (64, 4),
                           "reps": (3, 1)}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cell_name(budget_gib: int, depth: int, series: str = "") -> str:
    """A cell's study name; a --series gets fresh studies beside the confirmed ones (a new space, a new machine)."""
    return f"tvf-{budget_gib}g-d{depth}" + (f"-{series}" if series else "")


# this benchmark's own study attrs, beside the product's StudyRecord: samples set aside (a confirmation of an earlier
# device call, or one made before the references were re-measured), kept for the record and read by no one else
SET_ASIDE = ("confirmation_earlier_call", "confirmation_before_redo", "confirmed_before_redo")


def set_aside(study, **values: Any) -> None:
    for key, value in values.items():
        if key not in SET_ASIDE:
            raise TypeError(f"not a set-aside attr: {key}")
        study.set_user_attr(key, value)


def redo_references(measurer) -> list[str]:
    """Measure again the reference baselines that never ran (llama.cpp's placement in a server refused by a
    budget check that studies before this one applied to it), and set the confirmation aside so the next
    `confirm` interleaves them. Returns the names re-measured (`--reconfirm`)."""
    rec = StudyRecord.of(measurer.study)
    base = list(rec.baselines or [])
    fit = next((b for b in base if b.get("kind") == "engine-fit" and b.get("chosen_args")), None)
    redone = []
    for i, b in enumerate(base):
        if b.get("kind") == "engine-fit-server" and not b.get("ok") and fit is not None:
            base[i] = server_fit_record(measurer, fit["chosen_args"])
            redone.append(SERVER_FIT)
    if redone:
        StudyRecord.save(measurer.study, baselines=base)
        if rec.confirmed is not None:
            set_aside(measurer.study, confirmed_before_redo=rec.confirmed)
            StudyRecord.save(measurer.study, confirmed=None)
        if rec.confirmation is not None:
            set_aside(measurer.study, confirmation_before_redo=rec.confirmation)
            StudyRecord.save(measurer.study, confirmation=None)
    return redone


def run_cell(args, engine, inv, hw0, budget_gib: int, depth: int, deadline: float, dialect: str = "mainline",
             study_name: str | None = None, n_gpus: int = 1, confirm_ncmoe: bool = False,
             confirm_run_s: float | Callable[[], float] = 0.0, call_s: float = float("inf"),
             checkpoint: Callable[[], None] | None = None) -> bool:
    """One (budget, depth) study to the end: baselines, search, confirmation. False when the deadline stopped it.
    benchmarks/ik_gpu.py runs its ik cells through here too (dialect "ik", its own study names), and
    benchmarks/multi_gpu.py its two-GPU cells: `n_gpus` GPUs of budget_gib each, the best -ncmoe (-ts) baseline
    confirmed with the others (`confirm_ncmoe`), and a confirmation started only when it ends before the deadline
    (so all its samples come from one device call), timed by `confirm_plan`: each contender's own stored run, else
    `confirm_run_s` seconds a run (or what that callable says then); one that needs more than 0.8 of a whole call
    (`call_s`) runs at fewer repetitions per run. `checkpoint`, called after the baselines, after the search and
    after each confirmation sample, saves what a device call killed later must still bring back (a cell's search
    and confirmation can take a whole call)."""
    save = checkpoint or (lambda: None)
    wl = BenchRun(args.n_prompt, args.n_gen, depth, args.reps)
    hw = hw0.with_vram([budget_gib * GiB] * n_gpus)
    # the emitted command holds the whole workload (-c depth + prompt + generated); llama-bench's prompt test
    # holds depth + prompt: the tuner adds the memory model's difference (a few MiB of KV) to each peak
    ctx = depth + args.n_prompt + args.n_gen
    # the study `tune` makes, at the profile's thread count (these cells predate the thread probe; their stored
    # studies were made at it)
    config = study_setup(engine, dialect, space="settled", threads=hw.host.n_threads).config
    tuner = Tuner(inv, hw, engine, StudyConfig(
        model=str(inv.source), objective="both", bench=wl, n_ctx=ctx, margin=None, config=config, dialect=dialect,
        study_name=study_name or cell_name(budget_gib, depth, getattr(args, "series", "")),
        storage=args.storage, seed=args.seed, pool_size=args.pool))
    if getattr(args, "reconfirm", False) and redo_references(tuner.measurer):
        log(f"{tuner.study_name}: references re-measured; confirmation again")
    if StudyRecord.of(tuner.study).confirmed:
        return True
    if StudyRecord.of(tuner.study).baselines is None:
        log(f"{tuner.study_name}: baselines")
        tuner.baselines(deadline)        # no new one starts past the deadline; the next call goes on
        save()
        if StudyRecord.of(tuner.study).baselines is None:
            log(f"{tuner.study_name}: baselines unfinished at the deadline")
            return False
    # the search gets what the baselines and the confirmation leave of --runs
    runs = study_summary(tuner.study).engine_runs
    contenders = CONFIRM_CONTENDERS + (1 if confirm_ncmoe else 0)
    n_search = args.runs - runs.baselines - args.confirm * contenders - runs.trials
    if n_search > 0 and time.monotonic() < deadline:
        res = tuner.run(n_search, deadline=deadline, patience=40)
        log(f"{tuner.study_name}: {res.measured} search runs this call ({res.stopped or 'done'}); margin "
            f"{tuner.margin / MiB:.0f} MiB, by ubatch "
            + (", ".join(f"{ub}: {m / MiB:.0f}" for ub, m in sorted(tuner.ubatch_margins.items())) or "none yet"))
        save()
        if res.stopped.startswith("stopped at the deadline"):
            return False
    if time.monotonic() >= deadline:
        return False
    reps, need, need_whole = confirm_plan(tuner, args, confirm_ncmoe, confirm_run_s, call_s)
    if reps != wl.repetitions:
        log(f"{tuner.study_name}: confirmation at -r {reps} (not {wl.repetitions}): {args.confirm} rounds at "
            f"-r {wl.repetitions} need ~{need_whole:.0f} s, more than 0.8 of a whole call")
    earlier = StudyRecord.of(tuner.study).confirmation or {}
    if earlier.get("rows") and (0 < need <= call_s or earlier.get("repetitions", wl.repetitions) != reps):
        # samples of an earlier call (this one never re-enters a cell): a ratio must come from one call, so a
        # confirmation that fits in one starts again whole; the earlier rows are kept beside it
        log(f"{tuner.study_name}: {len(earlier['rows'])} confirmation runs of an earlier call set aside")
        set_aside(tuner.study, confirmation_earlier_call=earlier)
        StudyRecord.save(tuner.study, confirmation=None)
    started = bool((StudyRecord.of(tuner.study).confirmation or {}).get("rows"))
    if not started and deadline - time.monotonic() < need <= call_s:
        log(f"{tuner.study_name}: confirmation ({args.confirm} rounds, ~{need:.0f} s) not started with "
            f"{deadline - time.monotonic():.0f} s left: the next call runs it whole")
        return False
    if not started and need > call_s:
        log(f"{tuner.study_name}: confirmation ({args.confirm} rounds at -r {reps}, ~{need:.0f} s) is longer than a "
            f"whole call ({call_s:.0f} s): its rounds will span calls (a larger --time-budget holds it)")
    log(f"{tuner.study_name}: confirmation, {args.confirm} rounds")
    rec = tuner.confirm(args.confirm, n_tg=1, deadline=deadline, ncmoe=confirm_ncmoe, repetitions=reps,
                        progress=lambda done, total: save())
    if not rec:
        log(f"{tuner.study_name}: confirmation stopped before the deadline (the next sample would not end before "
            "it): run again")
    return bool(rec)


class ConfirmPlan(NamedTuple):
    repetitions: int        # per confirmation run
    seconds: float          # the whole confirmation at those repetitions, x1.2
    seconds_whole: float    # the same at the workload's repetitions


def confirm_plan(tuner, args, confirm_ncmoe: bool, confirm_run_s: float | Callable[[], float],
                 call_s: float) -> ConfirmPlan:
    """The repetitions per confirmation run and the seconds the confirmation will take: each contender's own
    stored run time taken to those repetitions (Tuner.confirm_seconds, x1.2), `confirm_run_s` for one without.
    When that is more than 0.8 of a whole call, the most repetitions per run (at least 1) that fit, so that every
    sample of a ratio still comes from one call (a --no-host contender at depth 8192 ran 143 s where --fit ran
    15 s)."""
    per_run = confirm_run_s() if callable(confirm_run_s) else confirm_run_s

    def need(reps: int) -> float:
        return 1.2 * tuner.confirm_seconds(args.confirm, 1, confirm_ncmoe, default=per_run, repetitions=reps)
    whole = reps = tuner.bench.repetitions
    while reps > 1 and need(reps) > 0.8 * call_s:
        reps -= 1
    return ConfirmPlan(reps, need(reps), need(whole))


def cell_row(study, budget_gib: int, depth: int) -> dict[str, Any]:
    """The JSON row of a cell: --fit, best TG and balanced (confirmed medians), their ratios, the -ncmoe line."""
    s = study_summary(study)
    conf = s.confirmed or {}
    by_key = {r["key"]: r for r in conf.get("results", [])}
    df = trials_frame(study)

    def flags(key: str | None) -> str:
        if key == "fit":
            ref = next(b for b in s.baselines if b.get("kind") == "engine-fit")
            return ref["commands"].get("llama-server") or ref["commands"]["llama-bench"]
        if key == "fit-server":
            rec = next(b for b in s.baselines if b.get("kind") == "engine-fit-server")
            return (rec.get("commands") or {}).get("llama-server", "")
        if key == "ncmoe":
            rec = next((b for b in s.baselines if b.get("kind") == "ncmoe"), {})
            return (rec.get("commands") or {}).get("llama-server", "")
        if key and key.startswith("trial:"):
            row = df[df["trial"] == int(key.split(":")[1])]
            return str(row["llama-server"].iloc[0]) if not row.empty else ""
        return ""

    def pick(key: str | None) -> dict[str, Any] | None:
        r = by_key.get(key) if key else None
        if r is None:
            return None
        return {"tg": r["tg"]["median"], "pp": r["pp"]["median"], "tg_range": [r["tg"]["lo"], r["tg"]["hi"]],
                "pp_range": [r["pp"]["lo"], r["pp"]["hi"]], "vram_mib": r["vram_bytes"] / MiB,
                "vram_mib_by_device": {d: b / MiB for d, b in (r.get("vram_device_bytes") or {}).items()},
                "flags": flags(key),
                "name": r["name"], "tg_vs_fit": r.get("tg_vs_fit"), "pp_vs_fit": r.get("pp_vs_fit"),
                "tg_vs_fit_server": r.get("tg_vs_fit_server"), "pp_vs_fit_server": r.get("pp_vs_fit_server"),
                "noisy": r["noisy"], "seen": r["seen"]}
    picks = conf.get("picks", {})
    fit, best, bal = pick("fit"), pick(picks.get("best_tg")), pick(picks.get("balanced"))
    fit_server = pick("fit-server")
    ncmoe_confirmed = pick("ncmoe")
    ncmoe = next((b for b in s.baselines if b.get("kind") == "ncmoe"), None)
    def ratio(a, k, base=None):
        base = base or fit
        return a[k] / base[k] if a and base and base[k] else None
    return {"budget_gib": budget_gib, "depth": depth, "study": study.study_name, "runs": s.engine_runs.total,
            "engine_runs": s.engine_runs.to_dict(), "front_share": s.front_share, "confirmed": bool(conf),
            "confirm_repetitions": conf.get("repetitions"),     # set when confirmed at fewer than the workload's
            "fit": fit, "fit_server": fit_server, "best_tg": best, "balanced": bal, "ncmoe_confirmed": ncmoe_confirmed,
            "best_tg_ratio_vs_fit_server": ratio(best, "tg", fit_server) if fit_server else None,
            "best_tg_ratio": ratio(best, "tg"), "balanced_tg_ratio": ratio(bal, "tg"),
            "balanced_pp_ratio": ratio(bal, "pp"),
            "ncmoe": None if ncmoe is None else {"name": ncmoe["name"], "ok": ncmoe.get("ok"),
                                                 "error": ncmoe.get("error"), "ts": ncmoe.get("ts"),
                                                 "flags": (ncmoe.get("commands") or {}).get("llama-server", ""),
                                                 "vram_mib_by_device": {
                                                     d: b / MiB for d, b in ((ncmoe.get("measured") or {})
                                                                             .get("peak_bytes") or {}).items()},
                                                 **({k: ncmoe["measured"][k] for k in ("tg_tps", "pp_tps")}
                                                    if ncmoe.get("ok") else {}),
                                                 "vram_mib": sum((ncmoe.get("measured") or {}).get("peak_bytes", {})
                                                                 .values()) / MiB},
            "margin_mib": (s.margin_bytes or 0) / MiB,
            "margin_mib_by_ubatch": {k: v / MiB for k, v in s.margin_by_ubatch.items()},
            "front": [{k: r.get(k) for k in ("trial", "tg_tps", "pp_tps", "vram_bytes", "tg_x", "pp_x", "label")}
                      for r in s.pareto],
            "over_budget_runs": int((df["error"].str.contains("over the budget", na=False)).sum())
            if not df.empty else 0}


def _margin_words(row: dict) -> str:
    """The study's margin as its summary states it (report.margin_text), from the row's MiB."""
    from tuner.report import margin_text
    by_ub = {k: v * MiB for k, v in (row.get("margin_mib_by_ubatch") or {}).items()}
    return margin_text(row["margin_mib"] * MiB, by_ub) or "no safety margin"


def runs_jsonl(studies, path: Path) -> int:
    """Every successful llama-bench run of the studies (trials, baselines, confirmation samples are not plans:
    trials only), as the shared calibration data has them."""
    n = 0
    with path.open("w") as f:
        for study in studies:
            for t in study.get_trials(deepcopy=False):
                rec = TrialRecord.from_trial(t)
                m, bench = rec.measured, rec.commands.get("llama-bench", "")
                if m is None or not m.ok or not bench or rec.duplicate_of is not None:
                    continue
                f.write(json.dumps(run_line(bench, m.pp_tps, m.tg_tps, sum(m.peak_bytes.values()) // MiB,
                                            study=study.study_name, trial=t.number)) + "\n")
                n += 1
    return n


def write_report(rows: list[dict[str, Any]], meta: dict[str, Any], out: Path, name: str = "tune_vs_fit") -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "budgets": rows}, indent=2, default=str))
    L = ["# offload-tuner against llama.cpp's own --fit", "",
         f"{meta['date']}; {meta.get('gpu') or 'no GPU (CPU dry run)'}; model {Path(meta['model']).name} "
         f"({meta['model_gib']:.2f} GiB); workload -p {meta['n_prompt']} -n {meta['n_gen']} -r {meta['reps']}; "
         f"at most {meta['runs']} engine runs per budget (baselines, search and {meta['confirm']} rounds of "
         "confirmation); every number below is a confirmed median over interleaved re-runs in one device call, "
         "[min-max] its spread; x: ratio to --fit's median, 'tie' when inside the larger spread.", "",
         "| budget | depth | runs | --fit TG / PP / VRAM MiB | best TG: TG / PP / VRAM MiB | TG x "
         "| balanced: TG / PP / VRAM MiB | TG x | PP x | best -ncmoe: TG / PP / VRAM MiB "
         "| --fit's placement in a server: TG / PP / VRAM MiB | best TG x it |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def cell(p: dict[str, Any] | None) -> str:
        return f"{p['tg']:.2f} / {p['pp']:.0f} / {p['vram_mib']:.0f}" if p else "-"

    def verdict(p: dict[str, Any] | None, k: str) -> str:
        v = (p or {}).get(f"{k}_vs_fit")
        return f"{v['ratio']:.3f} {v['verdict']}" if v else "-"
    for r in sorted(rows, key=lambda r: (r["depth"], r["budget_gib"])):
        nc = r.get("ncmoe") or {}
        ncs = f"{nc['tg_tps']:.2f} / {nc['pp_tps']:.0f} / {nc['vram_mib']:.0f} ({nc['name']})" if nc.get("ok") else \
            (nc.get("error") or "-")
        runs = f"{r['runs']}{'' if r['confirmed'] else ' (unconfirmed)'}" + \
            (f" (confirmed at -r {r['confirm_repetitions']})" if r.get("confirm_repetitions") else "")
        L.append(f"| {r['budget_gib']} GiB | {r['depth']} | {runs} | "
                 f"{cell(r['fit'])} | {cell(r['best_tg'])} | {verdict(r['best_tg'], 'tg')} | {cell(r['balanced'])} | "
                 f"{verdict(r['balanced'], 'tg')} | {verdict(r['balanced'], 'pp')} | {ncs} | "
                 f"{cell(r.get('fit_server'))} | "
                 f"{_vs_server(r['best_tg'])} |")
    L += ["", "Commands (llama-server lines; --fit as llama-bench ran it):", ""]
    for r in sorted(rows, key=lambda r: (r["depth"], r["budget_gib"])):
        for role in ("fit", "fit_server", "best_tg", "balanced"):
            if r.get(role):
                L += [f"- {r['budget_gib']} GiB, depth {r['depth']}, {role}: `{r[role]['flags']}`"]
    L += ["", "Runs per study: " + "; ".join(f"{r['study']}: {r['engine_runs']}, {r['front_share'] or 0:.0%} near the "
                                             f"front, {_margin_words(r)}" for r in rows), ""]
    noisy = [(r["study"], role, r[role]["seen"]) for r in rows for role in ("fit", "best_tg", "balanced")
             if r.get(role) and r[role]["noisy"]]
    if noisy:
        L += ["Noisy runs (a run's CV over its repetitions > 5%):", ""] + [f"- {s} {role}: {'; '.join(seen) or '-'}"
                                                                           for s, role, seen in noisy] + [""]
    if meta.get("note"):
        L += [meta["note"], ""]
    L += [f"![TG and PP against VRAM]({name}.png)", ""]
    (out / f"{name}.md").write_text("\n".join(L))
    plot(rows, out / f"{name}.png")


def _vs_server(p: dict[str, Any] | None) -> str:
    v = (p or {}).get("tg_vs_fit_server")
    return f"{v['ratio']:.3f} {v['verdict']}" if v else "-"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, key, name in ((axes[0], "tg", "TG"), (axes[1], "pp", "PP")):
        for i, depth in enumerate(sorted({r["depth"] for r in rows})):
            sel = sorted((r for r in rows if r["depth"] == depth), key=lambda r: r["budget_gib"])
            for r in sel:
                fr = sorted(r["front"], key=lambda f: f["vram_bytes"] or 0)
                ax.plot([f["vram_bytes"] / GiB for f in fr], [f[f"{key}_tps"] for f in fr], ".-", c=f"C{i}", alpha=0.5,
                        label=f"study fronts, depth {depth}" if r is sel[0] else None)
            pts = [r["fit"] for r in sel if r["fit"]]
            ax.plot([p["vram_mib"] / 1024 for p in pts], [p[key] for p in pts], "X", ms=10, c=f"C{i}", mec="k",
                    label=f"--fit, depth {depth}")
            nc = [r["ncmoe"] for r in sel if r.get("ncmoe") and r["ncmoe"].get("ok")]
            ax.plot([n["vram_mib"] / 1024 for n in nc], [n[f"{key}_tps"] for n in nc], "s--", c=f"C{i}", mfc="none",
                    label=f"best -ncmoe, depth {depth}")
            for role, mk in (("best_tg", "*"), ("balanced", "D")):
                pts = [r[role] for r in sel if r.get(role)]
                ax.plot([p["vram_mib"] / 1024 for p in pts], [p[key] for p in pts], mk, ms=10, c=f"C{i}", mec="k",
                        label=f"{role} (confirmed), depth {depth}")
        ax.set_xlabel("peak VRAM (GiB)")
        ax.set_ylabel(f"{name} (tokens/s)")
        ax.grid(alpha=0.3)
    if axes[0].get_legend_handles_labels()[0]:      # no cell with results yet: no legend (matplotlib warns)
        axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def prepare(args, workdir: Path) -> dict[str, Any]:
    """The engine, model and hardware for the runs (args gets them); the report's meta."""
    import llamacpp_gpu as lg
    from runtime.llamacpp import LlamaCppEngine
    if args.cpu:
        from runtime.llamacpp_build import ensure_built
        bench = args.llama_bench or ensure_built()["llama-bench"]
    else:
        bench = args.llama_bench or lg.DEFAULT_WORKDIR / "llama.cpp-cuda" / "build" / "bin" / "llama-bench"
    model = args.model or (workdir / "tiny-qwen3moe-q4_0.gguf" if args.cpu
                           else lg.DEFAULT_WORKDIR / "qwen3-30b-a3b-q4_0.gguf")
    if not model.exists():
        lg.write_model(model, args.cpu)
    inv = load_inventory(model)
    hw = load_hardware(args.hardware)
    engine = TimedEngine(LlamaCppEngine(bench, timeout_s=args.timeout, model_path=model, cpu_stand_in=args.cpu))
    devs = engine.devices() or {}
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "cpu_mode": args.cpu,
            "gpu": ", ".join(f"{d}: {v['description']}" for d, v in devs.items()) or None,
            "binary": engine.info.to_dict(), "model": str(model), "model_gib": model.stat().st_size / GiB,
            "n_prompt": args.n_prompt, "n_gen": args.n_gen,
            "reps": args.reps, "runs": args.runs, "confirm": args.confirm, "hardware": hw.name}
    args.engine, args.inv, args.hw = engine, inv, hw
    return meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    opts.add_call_options(ap, name="tune_vs_fit", workdir=DEFAULT_WORKDIR, time_budget=WHOLE_CALL_S, min_left=100.0,
                          timeout=240.0, cpu_help="CPU build, tiny model, every plan all-CPU",
                          min_left_help="a cell needs to start (its baselines run in one go)")
    ap.add_argument("--llama-bench", type=Path,
                    help="default <llamacpp_gpu workdir>/llama.cpp-cuda/build/bin/llama-bench")
    ap.add_argument("--model", type=Path, help="default the llamacpp_gpu benchmark's model (written if missing)")
    ap.add_argument("--budgets", default="4,8,12,16", help="GiB (default 4,8,12,16)")
    ap.add_argument("--depths", default="0,8192", help="context depths (default 0,8192)")
    opts.add_study_options(ap, DEFAULTS)
    opts.add_workload_options(ap, DEFAULTS)
    ap.add_argument("--reconfirm", action="store_true", help="cells whose --fit placement in a server never ran "
                    "(refused by an older budget check): run it, then confirm again, all in this call")
    ap.add_argument("--series", default="", help="a suffix for the cells' study names: fresh studies beside the "
                    "confirmed ones (e.g. after the search space changed); the report shows that series")
    ap.add_argument("--note", type=Path, help="with --report-only: a Markdown file of notes for the report")
    ap.add_argument("--report-only", type=Path, metavar="JSON", help="rewrite the report from <workdir>'s studies, "
                    "running nothing, with the meta of this earlier tune_vs_fit.json")
    args = opts.resolve(ap, ap.parse_args(argv), DEFAULTS)
    t0 = time.monotonic()
    deadline = t0 + args.time_budget
    budgets = opts.parse_budgets(ap, args.budgets)
    try:
        depths = [int(d) for d in args.depths.split(",") if d.strip()]
    except ValueError:
        ap.error(f"--depths takes whole token counts, comma separated: {args.depths!r}")
    workdir = args.workdir or (DEFAULT_WORKDIR / "cpu" if args.cpu else DEFAULT_WORKDIR)
    workdir.mkdir(parents=True, exist_ok=True)
    out = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else workdir / "report")
    args.storage = f"sqlite:///{workdir / 'tune_vs_fit.db'}"
    if args.report_only:
        meta = json.loads(args.report_only.read_text())["meta"]
        if args.note:
            meta["note"] = args.note.read_text()
    else:
        meta = prepare(args, workdir)
    finished, ran = True, False
    for depth in depths if not args.report_only else ():
        for b in budgets:
            if deadline - time.monotonic() < args.min_left:     # a baseline run is not stopped once started
                finished = False
                log(f"{cell_name(b, depth, args.series)}: not started, {deadline - time.monotonic():.0f} s left")
                break
            ok = run_cell(args, args.engine, args.inv, args.hw, b, depth, deadline,
                          call_s=max(args.time_budget, WHOLE_CALL_S),
                          confirm_run_s=lambda: args.engine.run_seconds(0.0 if args.cpu else CONFIRM_RUN_S),
                          checkpoint=lambda: save_state(workdir / "tune_vs_fit.db", out / STATE_NAME))
            finished &= ok
            log(f"{cell_name(b, depth, args.series)}: {'confirmed' if ok else 'not finished: run again'}")
            # after every cell: a device call killed later still returns the report and the state ($OUT)
            report(args, budgets, depths, meta, out, workdir, finished)
            ran = True
    if not ran:
        report(args, budgets, depths, meta, out, workdir, finished)
    return 0 if finished else 3


def report(args, budgets: list[int], depths: list[int], meta: dict[str, Any], out: Path, workdir: Path,
           finished: bool) -> None:
    """The report of the cells of this series, and (with a real run) a gzipped copy of the study database beside
    it, STATE_NAME, to carry into the next machine's workdir (`gunzip -c ... > <workdir>/tune_vs_fit.db`)."""
    import optuna
    from tuner.storage import make_storage
    storage = make_storage(args.storage)
    names = {s.study_name for s in storage.get_all_studies()}
    cells = [(b, d) for d in depths for b in budgets if cell_name(b, d, args.series) in names]
    studies = [optuna.load_study(study_name=cell_name(b, d, args.series), storage=storage) for b, d in cells]
    rows = [cell_row(st, b, d) for st, (b, d) in zip(studies, cells)]
    write_report(rows, meta, out, args.name)
    n = runs_jsonl(studies, out / f"{args.name}_runs.jsonl")
    if not args.report_only:
        save_state(workdir / "tune_vs_fit.db", out / STATE_NAME)
    left = not finished or any(not r["confirmed"] for r in rows) or len(rows) < len(budgets) * len(depths)
    log(f"report: {out}/{args.name}.md ({len(rows)} cells, {n} runs in runs.jsonl); "
        f"{'work left: run again' if left else 'all cells confirmed'}")


def save_state(db: Path, dest: Path) -> None:
    """A consistent gzipped copy of an SQLite database that may be open (sqlite3's backup), written to a temporary
    name and renamed: a call killed while it writes leaves the previous copy whole."""
    import gzip
    import shutil
    import tempfile
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / db.name
        opts.copy_sqlite(db, copy)
        part = dest.with_name(dest.name + ".partial")
        with open(copy, "rb") as f, gzip.open(part, "wb", compresslevel=6) as g:
            shutil.copyfileobj(f, g)
        part.replace(dest)


if __name__ == "__main__":
    sys.exit(main())
