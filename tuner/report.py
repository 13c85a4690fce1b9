"""The autotuner's study reports (Markdown, HTML, CSV, JSON, plots); the plain text tables are planner/tables.py's."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .confirm import BALANCED_PP, NOISY_CV, reference, vram_of
from .cost_fit import CostFit
from .failures import no_result_text
from .options import Settings
from .records import StudyRecord, TrialRecord
from .report_plots import write_plots      # the plots: their own module
from planner.hardware import fmt_bytes


# ---- study reports (the autotuner's) ----------------------------------------------------------------------------
#
# Everything comes from the study's storage: each trial's user attrs hold its plan id, label, rendered commands,
# predicted and measured speeds and peak bytes (planner/search.py), so a report needs neither the model file nor
# the engine. Layout of reports/<study>/: summary.md, summary.html, report.json, trials.csv and, as PNG and SVG,
# throughput_vs_vram (TG and PP against peak VRAM, the VRAM-Pareto front highlighted, baselines marked),
# pareto (TG against PP) and history (objective per trial, best so far).

TOOLS_ORDER = ("llama-server", "llama-cli", "llama-bench")


def trials_frame(study: Any) -> Any:
    """One row per trial (pandas DataFrame): state, source, plan, measured and predicted speeds, peak bytes."""
    import pandas as pd
    rows = []
    names = StudyRecord.of(study).objective_names
    for t in study.get_trials(deepcopy=False):
        rec = TrialRecord.from_trial(t)
        m = rec.measured
        ok = m is not None and m.ok
        pred = rec.candidate.predicted if rec.candidate is not None else None
        peak = m.command_peak_bytes if m is not None else {}     # at the emitted context (search.peaks_at_ctx)
        predicted_gpu = rec.candidate.gpu_bytes if rec.candidate is not None else {}
        row: dict[str, Any] = {
            "trial": t.number, "state": t.state.name.lower(), "source": rec.source,
            "plan_id": rec.plan_id, "label": rec.label,
            "ok": ok and t.state.name == "COMPLETE",
            "tg_tps": m.tg_tps if ok else None, "pp_tps": m.pp_tps if ok else None,
            "pred_tg_tps": pred.tg_tps if pred else None, "pred_pp_tps": pred.pp_tps if pred else None,
            "prior_tg_tps": pred.prior_tg_tps if pred else None, "prior_pp_tps": pred.prior_pp_tps if pred else None,
            "vram_bytes": sum(peak.values()) if peak else (sum(predicted_gpu.values()) or None),
            "vram_source": "measured" if peak else "predicted",
            "host_bytes": m.host_bytes if m is not None else None, "cv": m.cv if m is not None else None,
            **_host_parts(rec.candidate.memory if rec.candidate is not None else None),
            "engine_run": rec.engine_run,
            "duplicate_of": rec.duplicate_of,
            "error": (m.error if m is not None else "") or rec.pruned_reason or "",
        }
        if t.state.name == "FAIL" and not row["error"]:
            row["error"] = "no result recorded (interrupted, or the worker died)"
        if t.state.name == "COMPLETE" and rec.duplicate_of is not None:
            row["ok"] = True
            vals = t.values or []
            if names == ["tg_tps", "pp_tps"] and len(vals) == 2:
                row["tg_tps"], row["pp_tps"] = vals
        for d, v in sorted(peak.items()):
            row[f"peak_{d}"] = v
        for d, v in sorted(predicted_gpu.items()):
            row[f"pred_bytes_{d}"] = v
        if t.values is not None:
            for i, v in enumerate(t.values):
                row[f"value{i}"] = v
        for k, v in sorted(t.params.items()):
            row[f"param.{k}"] = v
        commands = rec.commands
        for tool in TOOLS_ORDER:
            row[tool] = commands.get(tool, "")
        rows.append(row)
    return pd.DataFrame(rows)


BEST_TIE = 0.005     # runs within 0.5% of the best speed tie on it: the other speed, then less VRAM, decides


def _best(df: Any, col: str, vram_max: float | None = None) -> dict[str, Any] | None:
    """The run with the best `col` (tg_tps or pp_tps), among those within BEST_TIE of it the one with the best other
    speed, then the least VRAM: a TG 0.0006% higher is no reason to give up 9.5x the PP (as a 30-trial sim study of
    gpt-oss-120b at 24 GiB once picked), and the web view's top point is the same run."""
    ok = df[df["ok"] & df[col].notna() & (df["duplicate_of"].isna())]
    if vram_max is not None:
        ok = ok[ok["vram_bytes"].notna() & (ok["vram_bytes"] <= vram_max)]
    if ok.empty:
        return None
    other = "pp_tps" if col == "tg_tps" else "tg_tps"
    top = ok[col].max()
    ok = ok[ok[col] >= top * (1 - BEST_TIE)]
    ok = ok.assign(_v=ok["vram_bytes"].fillna(float("inf")))
    r = ok.sort_values([other, "_v", col], ascending=[False, True, False]).iloc[0]
    return _row(r)


def _row(r: Any) -> dict[str, Any]:
    out = {"trial": int(r["trial"]), "plan_id": r["plan_id"], "label": r["label"], "source": r["source"],
           "tg_tps": _num(r["tg_tps"]), "pp_tps": _num(r["pp_tps"]), "vram_bytes": _num(r["vram_bytes"]),
           "cv": _num(r.get("cv")),
           "commands": {tool: r[tool] for tool in TOOLS_ORDER if r.get(tool)}}
    host = {k: _num(r.get(f"host_{k}")) for k in HOST_PARTS}
    if all(v is not None for v in host.values()):
        out["host"] = host
    return out


# The host's bill of a trial's candidate (planner/host.py HostBill's parts), columns host_<part> of trials.csv
HOST_PARTS = ("weights_mapped", "weights_pinned", "kv", "compute", "process")


def _host_parts(memory: dict[str, Any] | None) -> dict[str, Any]:
    if not memory:
        return {}
    from planner.host import HostBill
    bill = HostBill.from_memory_dict(memory, 0)
    return {f"host_{k}": getattr(bill, k) for k in HOST_PARTS}


def host_text(r: dict[str, Any], ram: int | None) -> str | None:
    """The host row of a best config (planner/host.py host_line), its prompt cache at the --cache-ram its server
    line got; None without the parts or the study's RAM."""
    if not r.get("host") or not ram:
        return None
    from planner.host import HostBill, cache_ram_for, host_line, with_prompt_cache
    bill = HostBill(int(ram), **{k: int(v) for k, v in r["host"].items()})
    return host_line(with_prompt_cache(bill, cache_ram_for(bill)))


def _num(v: Any) -> Any:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if f != f else (int(f) if f.is_integer() and abs(f) > 1e6 else f)


def _front_rows(df: Any) -> list[dict[str, Any]]:
    """Trials on the TG/PP Pareto front (measured, both maximised), one per distinct point, by TG."""
    ok = df[df["ok"] & df["tg_tps"].notna() & df["pp_tps"].notna() & df["duplicate_of"].isna()]
    ok = ok.sort_values(["tg_tps", "pp_tps", "vram_bytes"], ascending=[False, False, True])
    out, best_pp = [], -1.0
    for _, r in ok.iterrows():
        if r["pp_tps"] > best_pp:
            out.append(_row(r))
            best_pp = r["pp_tps"]
    return out


# One configuration of a report, as its JSON has it: trial, plan_id, label, source, tg_tps, pp_tps, vram_bytes,
# cv, commands; the ratios to the reference (tg_x, pp_x, vram_x, budget_share) where there is one; a best row also
# its memory per device ("devices") and its stored measurement ("measurement"); the objective's best its "value"
# (as stored: a time study's is the workload's tokens per second) and, under time, "mean_request_s" (what it means).
Row = dict[str, Any]


@dataclass(frozen=True)
class EngineRuns:
    """Engine runs the study made: the baselines', the search's (trials that ran), the confirmation's."""
    baselines: int
    trials: int
    confirmation: int

    @property
    def total(self) -> int:
        return self.baselines + self.trials + self.confirmation

    def to_dict(self) -> dict[str, int]:
        return {"baselines": self.baselines, "trials": self.trials, "confirmation": self.confirmation,
                "total": self.total}


@dataclass(frozen=True)
class BudgetBest:
    """The best TG and the best PP among the runs that used at most `budget_bytes` of VRAM (all GPUs)."""
    budget_bytes: int
    tg: Row | None
    pp: Row | None

    def to_dict(self) -> dict[str, Any]:
        return {"budget_bytes": self.budget_bytes, "tg": self.tg, "pp": self.pp}


@dataclass(frozen=True)
class FailedTrial:
    trial: int
    error: str

    def to_dict(self) -> dict[str, Any]:
        return {"trial": self.trial, "error": self.error}


@dataclass(frozen=True)
class StudySummary:
    """A study's report: what `report --json`, report.json, `tune --json` and the service's study page give
    (to_dict, the same keys in the same order as ever), and what the Markdown and the plots are written from.
    The study's own records (settings, confirmation, cost fit, baselines) are kept as the study stores them."""
    study: str
    settings: Settings                          # what the study was made for (to_dict: as stored)
    engine_runs: EngineRuns
    budget_bytes: int | None                    # all GPUs' memory less what is kept free and the margin asked for
    reference: str | None                       # the baseline ratios are to: --fit, else its imitation
    confirmed: dict[str, Any] | None            # tuner.confirm's record, when confirmation ran
    front_share: float | None                   # share of the runs within 10% of the front
    counts: dict[str, int]                      # trials per state
    n_trials: int
    margin_bytes: int | None
    margin_events: list[dict[str, Any]]
    cost_fit: dict[str, Any] | None             # CostFit.to_dict() as stored
    best: dict[str, Row | None]                 # tg, pp (and objective, for an expression)
    pareto: list[Row]                           # the TG/PP front, by TG
    per_budget: list[BudgetBest]
    baselines: list[dict[str, Any]]             # the study's baseline records, with their ratios
    failed: list[FailedTrial]
    files: tuple[str, ...] | None = None        # what write_study_report wrote (not in the JSON before that)
    margin_by_ubatch: dict[str, int] = field(default_factory=dict)   # a learnt margin's per-ubatch values
    headline: str | None = None                 # a time-objective study's first line (what it recommends)
    served: dict[str, Any] | None = None        # tuner.served's record, when the finalists were served
    keep_free_bytes: int = 0                    # GPU memory kept free on each GPU (--keep-free)
    no_result: str | None = None                # a study without a complete trial: what it holds (failures.py)
    threads: str | None = None                  # the thread probe's line (tuner/threads.py), when one ran
    request_time: dict[str, Any] | None = None  # a time study's RequestTime as stored (its plots read seconds off
                                                # it); not in the JSON, whose best objective row says them

    def to_dict(self) -> dict[str, Any]:
        # a time-objective study says what it recommends first (the JSON's first key, the report's first line)
        out: dict[str, Any] = {"headline": self.headline} if self.headline else {}
        out |= {"study": self.study, "settings": self.settings.to_dict(), "engine_runs": self.engine_runs.to_dict(),
               "budget_bytes": self.budget_bytes, "reference": self.reference, "confirmed": self.confirmed,
               "front_share": self.front_share, "counts": self.counts, "n_trials": self.n_trials,
               "margin_bytes": self.margin_bytes, "margin_events": self.margin_events, "cost_fit": self.cost_fit,
               "best": self.best, "pareto": self.pareto, "per_budget": [b.to_dict() for b in self.per_budget],
               "baselines": self.baselines, "failed": [f.to_dict() for f in self.failed],
               "margin_by_ubatch": self.margin_by_ubatch, "keep_free_bytes": self.keep_free_bytes}
        if self.served is not None:
            out["served"] = self.served
        if self.no_result is not None:
            out["no_result"] = self.no_result
        if self.threads is not None:
            out["threads"] = self.threads
        if self.files is not None:
            out["files"] = list(self.files)
        return out


def study_summary(study: Any, df: Any | None = None) -> StudySummary:
    """A study's report: settings, counts, best config per objective and per VRAM budget, baselines."""
    from .pool import budget_levels
    df = trials_frame(study) if df is None else df
    record = StudyRecord.of(study)
    settings = record.settings or Settings.from_dict({})      # a study another worker is still creating
    total_vram = sum(v for _, v in settings.hardware.get("gpus", [])) or 0
    counts = df["state"].value_counts().to_dict() if not df.empty else {}
    rt_dict = record.request_time.to_dict() if record.request_time is not None else None
    best: dict[str, Any] = {}
    if not df.empty:
        best = {"tg": _best(df, "tg_tps"), "pp": _best(df, "pp_tps")}
        if settings.objective not in ("tg", "pp", "both") and "value0" in df:
            ok = df[df["ok"] & df["value0"].notna() & df["duplicate_of"].isna()]
            if not ok.empty:
                best["objective"] = _row(ok.sort_values("value0", ascending=False).iloc[0]) | {
                    "value": float(ok["value0"].max())}
                seconds = request_seconds(settings, rt_dict, best["objective"])
                if seconds is not None:      # time: what the stored tokens per second mean, lower is better
                    best["objective"]["mean_request_s"] = seconds
    per_budget = [BudgetBest(lv, _best(df, "tg_tps", lv), _best(df, "pp_tps", lv))
                  for lv in (budget_levels(total_vram) if total_vram and not df.empty else [])]
    by_number: dict[int, list[Row]] = {}
    for r in [*best.values(), *(x for b in per_budget for x in (b.tg, b.pp))]:
        if r:
            by_number.setdefault(r["trial"], []).append(r)
    for t in study.get_trials(deepcopy=False):     # memory per device and the measurement, as --json promises
        if t.number not in by_number:
            continue
        rec = TrialRecord.from_trial(t)
        memory = (rec.candidate.memory if rec.candidate is not None else None) or {}
        for r in by_number[t.number]:
            r["devices"] = memory.get("devices", {})
            r["measurement"] = rec.measured.to_dict() if rec.measured is not None else {}
    baselines = record.baselines or []
    ref = reference(baselines)
    budget = _budget_bytes(settings, record)
    front = _front_rows(df) if not df.empty else []
    for r in [*front, *best.values(), *(x for b in per_budget for x in (b.tg, b.pp))]:
        if r:
            r.update(_ratios(r, ref, budget))
    for b in baselines:
        if b.get("ok") and b is not ref:
            b.update(_ratios({"tg_tps": b["measured"]["tg_tps"], "pp_tps": b["measured"]["pp_tps"],
                              "vram_bytes": vram_of(b["measured"])}, ref, budget))
    failed = ([FailedTrial(int(r["trial"]), r["error"]) for _, r in df[df["state"] == "fail"].iterrows()]
              if not df.empty else [])
    runs = EngineRuns(baselines=int(sum(b.get("runs", 1 if b.get("measured") else 0) for b in baselines)),
                      trials=int(df["engine_run"].sum()) if not df.empty else 0,
                      confirmation=len((record.confirmation or {}).get("rows", [])))
    return StudySummary(
        study=study.study_name, settings=settings, engine_runs=runs, budget_bytes=budget,
        reference=ref["name"] if ref else None, confirmed=record.confirmed,
        front_share=_front_share(df, ref) if not df.empty else None,
        counts={str(k): int(v) for k, v in counts.items()}, n_trials=int(len(df)),
        margin_bytes=record.margin_bytes, margin_events=record.margin_events,
        margin_by_ubatch={str(k): v for k, v in record.margin_by_ubatch.items()}, best=best,
        cost_fit=record.cost_fit.to_dict() if record.cost_fit is not None else None,
        pareto=front, per_budget=per_budget, baselines=baselines, failed=failed,
        headline=_headline(settings, record, best, ref), served=record.served,
        keep_free_bytes=keep_free_of(settings), no_result=no_result_text(counts, [f.error for f in failed]),
        threads=record.threads_probe.line() if record.threads_probe is not None else None,
        request_time=rt_dict if settings.objective == "time" else None)


def request_seconds(settings: Settings, request_time: dict[str, Any] | None, row: dict[str, Any]
                    ) -> float | None:
    """A time study's row in seconds per mean request (RequestTime.mean_s of its TG and PP): what a time study
    shows, where it stores the workload's tokens per second (old studies read the same). None under another
    objective, without the stored request classes, or where the row cannot serve the workload."""
    if (settings.objective != "time" or not request_time or row.get("tg_tps") is None
            or row.get("pp_tps") is None):
        return None
    from .objectives import RequestTime
    seconds = RequestTime.from_dict(request_time).mean_s(float(row["tg_tps"]), float(row["pp_tps"]))
    return seconds if math.isfinite(seconds) else None


def keep_free_of(settings: Settings) -> int:
    """The GPU memory a study keeps free on each GPU (none in a study stored before --keep-free)."""
    return int(settings.hardware.get("keep_free", 0))


def _headline(settings: Settings, rec: StudyRecord, best: dict[str, Any], ref: dict[str, Any] | None
              ) -> str | None:
    """A time-objective study's first line: the served verdict when its finalists were served
    (tuner.served.headline), else its best trial's mean request time from the benchmark runs, with what it
    gives up against the reference baseline's speeds said first."""
    if settings.objective != "time":
        return None
    from .served import PP_GIVE_UP, TG_GIVE_UP, headline
    if rec.served:
        return headline(rec.served)
    row = best.get("objective")
    req = rec.request_time
    if row is None or req is None:
        return f"{req.workload if req is not None else 'workload'}: no config measured yet"
    text = (f"{req.workload}: trial {row['trial']} answers in {req.mean_s(row['tg_tps'], row['pp_tps']):.2f} s mean "
            "(from its benchmark run; served on llama-server: not yet)")
    if ref is not None:
        m = ref["measured"]
        text += f"; {ref['name']}: {req.mean_s(m['tg_tps'], m['pp_tps']):.2f} s"
        given = [f"{k.upper()} {row[f'{k}_tps'] / m[f'{k}_tps']:.2f}x {ref['name']}'s"
                 for k, floor in (("pp", PP_GIVE_UP), ("tg", TG_GIVE_UP))
                 if m.get(f"{k}_tps") and row[f"{k}_tps"] < floor * m[f"{k}_tps"]]
        if given:
            text = f"gives up {'; '.join(given)}: " + text
    return text


def margin_text(margin: float | None, by_ubatch: dict[str, float]) -> str:
    """A study's safety margin in words, per ubatch where it was learnt so ('' when it has none); bytes."""
    if by_ubatch:
        each = ", ".join(f"{fmt_bytes(int(v))} at ubatch {k}"
                         for k, v in sorted(by_ubatch.items(), key=lambda kv: int(kv[0])))
        return f"safety margin learnt per ubatch: {each}; {fmt_bytes(int(margin or 0))} at any other"
    return f"safety margin {fmt_bytes(int(margin))}" if margin else ""


def _budget_bytes(settings: Settings, rec: StudyRecord) -> int | None:
    """All GPUs' memory less what is kept free and the margin asked for (none when it is learnt): what a config
    may use."""
    total = sum(v for _, v in settings.hardware.get("gpus", []))
    if not total:
        return None
    n = len(settings.hardware.get("gpus", []))
    asked = 0 if rec.margin_rule == "learnt" else int(rec.margin_bytes or 0)
    return total - n * (asked + keep_free_of(settings))


def _ratios(r: dict[str, Any], ref: dict[str, Any] | None, budget: int | None) -> dict[str, Any]:
    """TG x, PP x and VRAM x of a config against the reference (--fit), from single runs; and its budget use."""
    out: dict[str, Any] = {}
    if budget and r.get("vram_bytes"):
        out["budget_share"] = r["vram_bytes"] / budget
    if ref is not None:
        m = ref["measured"]
        for key, have, base in (("tg_x", r.get("tg_tps"), m.get("tg_tps")), ("pp_x", r.get("pp_tps"), m.get("pp_tps")),
                                ("vram_x", r.get("vram_bytes"), vram_of(m))):
            out[key] = have / base if have is not None and base else None
    return out


def _front_share(df: Any, ref: dict[str, Any] | None) -> float | None:
    """Share of the engine runs that landed near the placement front: within 10% of the best TG or of the best
    PP measured at no more VRAM (the rest went to configs far below it)."""
    import numpy as np
    runs = df[df["engine_run"] & df["ok"] & df["vram_bytes"].notna()]
    if runs.empty:
        return None
    # the best speed at no more VRAM than each run's: running maxima over the runs sorted by VRAM (NaN skipped),
    # read at the last run of no more VRAM (one pass, not a filter per run: the web view asks on every trial)
    vram = runs["vram_bytes"].to_numpy(float)
    order = np.argsort(vram, kind="stable")
    last = np.searchsorted(vram[order], vram, side="right") - 1
    near = np.zeros(len(runs), dtype=bool)
    for col in ("tg_tps", "pp_tps"):
        speed = runs[col].to_numpy(float)
        best = np.fmax.accumulate(speed[order])[last]
        with np.errstate(invalid="ignore"):
            near |= speed >= 0.9 * best
    return int(near.sum()) / len(runs)


def _fmt_row(r: dict[str, Any] | None) -> tuple[str, str, str]:
    from planner.hardware import fmt_bytes
    if not r:
        return "-", "-", "-"
    vram = fmt_bytes(r["vram_bytes"]) if r.get("vram_bytes") else "-"
    return (f"{r['tg_tps']:.2f}" if r.get("tg_tps") is not None else "-",
            f"{r['pp_tps']:.1f}" if r.get("pp_tps") is not None else "-", vram)


# one piece: the report's sections top to bottom, in the order a reader meets them (the confirmed and served ones
# are their own functions)
def summary_markdown(s: StudySummary) -> str:
    from planner.hardware import fmt_bytes, kept_free_text
    st = s.settings
    w, hw = st.bench, st.hardware
    L = [f"# offload-tuner study `{s.study}`", "", *([s.headline, ""] if s.headline else []),
         *([f"**{s.no_result}**", ""] if s.no_result else []), *([s.threads, ""] if s.threads else []),
         f"- model: `{st.model}`; engine: {st.engine}; dialect: {st.dialect}",
         f"- hardware: {hw.get('name', '')}: "
         + ", ".join(f"{n} {fmt_bytes(b)}" for n, b in hw.get("gpus", []))
         + f"; {kept_free_text(s.keep_free_bytes)} per GPU"
         + (f"; host {fmt_bytes(ram)} RAM" if (ram := hw.get("host_ram")) else ""),
         f"- objective: `{st.objective}` at prompt {w.n_prompt} tokens, {w.n_gen} generated, "
         f"depth {w.depth}; context {st.n_ctx}",
         f"- trials: {s.n_trials} (" + ", ".join(f"{k} {v}" for k, v in sorted(s.counts.items())) + ")"
         + (f"; {m}" if (m := margin_text(s.margin_bytes, s.margin_by_ubatch)) else ""), ""]
    runs = s.engine_runs
    L.append(f"- engine runs: {runs.total} (baselines {runs.baselines}, search {runs.trials}, confirmation "
             f"{runs.confirmation})"
             + (f"; {s.front_share:.0%} of the search and baseline runs landed within 10% of the front"
                if s.front_share is not None else ""))
    if s.budget_bytes:
        ctx_note = (" VRAM is the peak the emitted command uses at its context: measured at the engine's own "
                    "context, plus the memory model's difference to the emitted one where it is larger.")
        L.append(f"- budget: {fmt_bytes(s.budget_bytes)} of VRAM (all GPUs, less what is kept free and any margin "
                 "asked for);" + ctx_note)
    fit = s.cost_fit or {}
    if fit.get("err_prior"):
        L.append(f"- cost model refit on {fit.get('n')} runs: mean error TG {fit['err_prior'].get('tg', 0):.1%} -> "
                 f"{fit['err_fit'].get('tg', 0):.1%}, PP {fit['err_prior'].get('pp', 0):.1%} -> "
                 f"{fit['err_fit'].get('pp', 0):.1%}; terms moved: {CostFit.from_dict(fit).describe_moves()}")
        L.append("")
    L += ["![throughput vs VRAM](throughput_vs_vram.png)", "", "![TG vs PP](pareto.png)", ""]
    L += _served_markdown(s)
    L += _confirmed_markdown(s)
    L += ["## Best configurations (single runs)", ""]
    if not any(s.best.values()):
        L += ["None: no trial ran to a result.", ""]
    sections = [("Best TG", s.best.get("tg")), ("Best PP", s.best.get("pp"))]
    if s.best.get("objective"):
        o = s.best["objective"]
        value = (f"{o['mean_request_s']:.2f} s per mean request ({o['value']:.4g} t/s of the workload)"
                 if o.get("mean_request_s") is not None else f"{o['value']:.4g}")
        sections.insert(0, (f"Best `{st.objective}` = {value}", o))
    for title, r in sections:
        if not r:
            continue
        tg, pp, vram = _fmt_row(r)
        L += [f"### {title}: TG {tg} t/s, PP {pp} t/s, VRAM {vram} (trial {r['trial']}, {r['label']})", ""]
        if (host := host_text(r, hw.get("host_ram"))) is not None:
            L += [f"{host} (predicted)", ""]
        for tool, cmd in r["commands"].items():
            L += [f"{tool}:", "", "```", cmd, "```", ""]
    if s.pareto:
        ref = s.reference or "the reference"
        L += ["## TG/PP Pareto front", "", f"Ratios are to {ref}, from single runs.", "",
              "| trial | TG t/s | PP t/s | VRAM | of budget | TG x | PP x | VRAM x | run CV | placement |",
              "|---|---|---|---|---|---|---|---|---|---|"]
        for r in s.pareto:
            tg, pp, vram = _fmt_row(r)
            cv = r.get("cv")
            noisy = "-" if cv is None else f"{cv:.1%}" + (" noisy" if cv > NOISY_CV else "")
            L.append(f"| {r['trial']} | {tg} | {pp} | {vram} | {_pct(r.get('budget_share'))} | {_x(r.get('tg_x'))} | "
                     f"{_x(r.get('pp_x'))} | {_x(r.get('vram_x'))} | {noisy} | {r['label']} |")
        L.append("")
    if s.per_budget:
        L += ["## Best per VRAM budget", "", "| VRAM budget | best TG (t/s, trial) | best PP (t/s, trial) |",
              "|---|---|---|"]
        for b in s.per_budget:
            tg = f"{b.tg['tg_tps']:.2f} (#{b.tg['trial']})" if b.tg else "-"
            pp = f"{b.pp['pp_tps']:.1f} (#{b.pp['trial']})" if b.pp else "-"
            L.append(f"| {fmt_bytes(b.budget_bytes)} | {tg} | {pp} |")
        L.append("")
        for b in s.per_budget:
            for key, r in (("tg", b.tg), ("pp", b.pp)):
                if r and r["commands"].get("llama-server"):
                    L += [f"- {fmt_bytes(b.budget_bytes)}, best {key.upper()} (trial {r['trial']}):", "",
                          "  ```", "  " + r["commands"]["llama-server"], "  ```"]
        L.append("")
    if s.baselines:
        L += ["## Baselines", "", "| baseline | TG t/s | PP t/s | VRAM | TG x | PP x | note |",
              "|---|---|---|---|---|---|---|"]
        for b in s.baselines:
            m = b.get("measured") or {}
            vram = vram_of(m)
            note = b.get("error") or b.get("note") or ""
            if b.get("over_budget"):
                note = (note + "; " if note else "") + f"over the budget: {b['over_budget']}"
            L.append(f"| {b['name']} | {m.get('tg_tps', 0):.2f} | {m.get('pp_tps', 0):.1f} | "
                     f"{fmt_bytes(vram) if vram else '-'} | {_x(b.get('tg_x'))} | {_x(b.get('pp_x'))} | {note} |")
        L.append("")
        for b in s.baselines:
            for tool in ("llama-server", "llama-bench"):
                if b.get("commands", {}).get(tool):
                    L += [f"- {b['name']} ({tool}): `{b['commands'][tool]}`"]
                    break
        L.append("")
    if s.failed:
        L += ["## Failed trials", ""] + [f"- trial {f.trial}: {f.error}" for f in s.failed[:20]] + [""]
    L += ["![history](history.png)", "", "Files: trials.csv (every trial), report.json, *.png / *.svg plots.", ""]
    return "\n".join(L)


def _x(v: Any) -> str:
    return f"{v:.2f}x" if isinstance(v, (int, float)) else "-"


def _pct(v: Any) -> str:
    return f"{v:.0%}" if isinstance(v, (int, float)) else "-"


ROLE_NAMES = {"fit": "reference", "fit_server": "--fit's placement as a server runs it",
              "best_tg": "best TG at <= its VRAM", "runner_up": "TG runner-up",
              "balanced": "balanced (PP >= 1.5x)", "best_pp": "best PP",
              "best_tg_over_fit_vram": "best TG (all over its VRAM)", "ncmoe": "best -ncmoe (a baseline)"}


def _served_markdown(s: StudySummary) -> list[str]:
    """The finalists and the --fit references served on the workload: median mean request time [spread], time to
    first token, PP, TG, VRAM per GPU as the server used it, llama-bench against llama-server."""
    v = s.served
    if not v:
        return []
    L = [f"## Served on llama-server: the `{v.get('workload')}` workload, {v.get('rounds')} interleaved rounds", "",
         "| config | mean request s | TTFT s | PP t/s | TG t/s | VRAM (server) | llama-bench vs server | command |",
         "|---|---|---|---|---|---|---|---|"]
    for r in v.get("results", []):
        rs = r["request_s"]
        mark = " (reference)" if r["key"] == v.get("reference") else ""
        mark += " **pick**" if r["key"] == v.get("pick") else ""
        if r.get("dropped"):
            mark += f" (not served again: {r['dropped']:.2f}x behind)"
        got = (f"{rs['median']:.2f} [{rs['lo']:.2f}-{rs['hi']:.2f}] | {r['ttft_s']['median']:.2f} | "
               f"{r['pp']['median']:.0f} | {r['tg']['median']:.1f}" if rs["samples"]
               else f"failed: {(r['errors'] or ['?'])[0][:120]} | - | - | -")
        vram = ", ".join(f"{d} {fmt_bytes(b)}" for d, b in r["vram_device_bytes"].items()) or "-"
        L.append(f"| {r['name']}{mark} | {got} | {vram} | {'; '.join(r.get('bench_vs_server') or []) or '-'} | "
                 f"`{r.get('command') or ''}` |")
    return L + [""]


def _confirmed_markdown(s: StudySummary) -> list[str]:
    """The confirmed finalists against the reference: medians, spread, ratios with their verdicts, noisy runs."""
    from planner.hardware import fmt_bytes
    c = s.confirmed or {}
    if not c.get("results"):
        return []
    L = ["## Confirmed against " + (s.reference or "the reference"), "",
         f"Each config re-measured {c['rounds']} times, interleaved with the others (A B C A B C ..., the order "
         "rotated each round); medians with [min-max]. A ratio whose edge is inside the larger relative spread of "
         "the two sides (at least 1%) is a tie.", "",
         "| config | role | TG t/s | PP t/s | VRAM | TG x | PP x | TG x (server --fit) | runs noisy (CV > 5%) |",
         "|---|---|---|---|---|---|---|---|---|"]
    def sp(r: dict, k: str) -> str:
        d = r[k]
        return f"{d['median']:.2f} [{d['lo']:.2f}-{d['hi']:.2f}]" if d["samples"] else "-"

    def vs(r: dict, k: str, tag: str = "fit") -> str:
        v = r.get(f"{k}_vs_{tag}")
        return f"{v['ratio']:.3f}x {v['verdict']}" if v else "-"
    for r in c["results"]:
        roles = ", ".join(ROLE_NAMES.get(x, x) for x in r["roles"])
        noisy = ("yes" + (": " + "; ".join(r["seen"])[:120] if r["seen"] else "")) if r["noisy"] else "no"
        vram = fmt_bytes(r["vram_bytes"]) if r["vram_bytes"] else "-"
        L.append(f"| {r['name']} | {roles} | {sp(r, 'tg')} | {sp(r, 'pp')} | {vram} "
                 f"| {vs(r, 'tg')} | {vs(r, 'pp')} | {vs(r, 'tg', 'fit_server')} | {noisy} |")
    L.append("")
    names = {r["key"]: r["name"] for r in c["results"]}
    for role, key in c.get("picks", {}).items():
        L.append(f"- picked by median, {ROLE_NAMES.get(role, role)}: {names.get(key, key)}")
    if c.get("reference") and "balanced" not in c.get("picks", {}):
        # the search's balanced finalist can fall under the PP bar in the confirmation: say by how much
        near = [(r["pp_vs_fit"]["ratio"], r["name"]) for r in c["results"] if r.get("pp_vs_fit")
                and r["key"] != c["reference"] and "ncmoe" not in r["roles"] and "fit_server" not in r["roles"]]
        best = max(near, default=None)
        L.append(f"- no balanced pick: no finalist kept {BALANCED_PP}x the reference's PP by median"
                 + (f" (the most: {best[1]}, {best[0]:.2f}x)" if best else ""))
    L.append("")
    return L


def summary_html(s: StudySummary, markdown: str) -> str:
    """A self-contained page: the same content as the Markdown, with the SVG plots inline by reference."""
    import html
    body = []
    in_code = False
    for line in markdown.splitlines():
        if line.strip().startswith("```"):
            body.append("</pre>" if in_code else "<pre>")
            in_code = not in_code
            continue
        if in_code:
            body.append(html.escape(line.strip()))
            continue
        if line.startswith("!["):
            alt, src = line[2:].split("](", 1)
            body.append(f'<p><img alt="{html.escape(alt)}" src="{html.escape(src[:-1].replace(".png", ".svg"))}" '
                        'style="max-width:100%"></p>')
        elif line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            body.append(f"<h{level}>{_inline(line[level:].strip())}</h{level}>")
        elif line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if all(set(c) <= {"-"} for c in cells):
                continue
            tag = "th" if not body or not body[-1].startswith("<tr") and not body[-1].startswith("<table") else "td"
            if not body or not (body[-1].startswith("<tr") or body[-1].startswith("<table")):
                body.append("<table>")
                tag = "th"
            body.append("<tr>" + "".join(f"<{tag}>{_inline(c)}</{tag}>" for c in cells) + "</tr>")
        else:
            if body and body[-1].startswith("<tr"):
                body.append("</table>")
            if line.strip():
                body.append(f"<p>{_inline(line.lstrip('- ').strip()) if line.startswith('- ') else _inline(line)}</p>")
    if body and body[-1].startswith("<tr"):
        body.append("</table>")
    style = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}pre{background:#f4f4f4;"
             "padding:.6em;overflow-x:auto;white-space:pre-wrap}table{border-collapse:collapse}td,th{border:1px solid "
             "#ccc;padding:.2em .6em;text-align:left}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>offload-tuner {html.escape(s.study)}</title>"
            f"<style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def _inline(text: str) -> str:
    import html
    import re
    out = html.escape(text)
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", out)


def write_study_report(study: Any, out: Path) -> StudySummary:
    """Write reports/<study>/ (see the layout above); returns the summary with the list of files written. The files
    are written into a temporary folder beside OUT and moved into place once all are written: a failure (or
    Ctrl-C) leaves no half-written report, and neither the folder nor the folders above it that it created."""
    import shutil
    import tempfile
    made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        summary = _write_report_files(study, tmp, out)
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for folder in made:                # the deepest first
            try:
                folder.rmdir()
            except OSError:
                break
        raise
    return summary


def _write_report_files(study: Any, tmp: Path, out: Path) -> StudySummary:
    """The report's files written into TMP; the summary lists them as they will be in OUT. What the files say
    names the model and the programs by their file names (`shown_paths`): a report is read, and its commands
    pasted, where the model is, not on the machine that made it."""
    df = trials_frame(study)
    summary = study_summary(study, df)
    model = summary.settings.model

    def write(name: str, text: str) -> None:
        (tmp / name).write_text(shown_paths(text, model))
    write("trials.csv", df.to_csv(index=False))
    files = ["trials.csv"] + write_plots(df, summary, tmp)
    md = summary_markdown(summary)
    write("summary.md", md)
    write("summary.html", summary_html(summary, md))
    files += ["summary.md", "summary.html", "report.json"]
    write("report.json", json.dumps(replace(summary, files=tuple(files)).to_dict(), indent=2, default=_json_default))
    return replace(summary, files=tuple(str(out / f) for f in files))


# an absolute path to a llama.cpp program, as a served run's command or an error names it
_PROGRAM_PATH = re.compile(r"(?<![\w.])/(?:[^\s'\"`<>,/]+/)+(llama-[a-z-]+)(?![\w/.-])")


def shown_paths(text: str, model: str) -> str:
    """TEXT with the study's model named by its file name (a split model's shards too: the model's folder is
    dropped) and every llama.cpp program by its name (`llama-server`), so a report carries no path of the machine
    that made it (issue 40 item 10). The study itself keeps the paths it resumes with."""
    if model.startswith("/"):
        folder = str(Path(model).parent)
        text = text.replace(model, Path(model).name)
        if folder != "/":
            text = text.replace(folder + "/", "")
    return _PROGRAM_PATH.sub(r"\1", text)


def shown_dict(obj: Any, model: str) -> Any:
    """OBJ (JSON-like) with its strings as `shown_paths` shows them: what a report's JSON or the web view shows."""
    return json.loads(shown_paths(json.dumps(obj, default=_json_default), model))


def _move_into_place(tmp: Path, out: Path) -> None:
    """TMP becomes OUT: renamed whole when OUT does not exist, else each file replaces its namesake in OUT (a
    rename each; other files in OUT stay)."""
    import os
    if not out.exists():
        try:
            os.rename(tmp, out)
            return
        except OSError:
            if not out.is_dir():       # another report made it meanwhile: the files go in one by one
                raise
    for f in sorted(tmp.iterdir()):
        os.replace(f, out / f.name)
    tmp.rmdir()


def _json_default(o: Any) -> Any:
    try:
        import numpy as np
        if isinstance(o, np.generic):
            return o.item()
    except ImportError:
        pass
    return str(o)
