"""`tune`: its flags parsed into TuneRequest, the study run by the app layer (offload_tuner/app/tune.py), the outcome
printed: a progress bar on stderr while it runs, then the runs, the refit, the baselines and the best configs."""
from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import threading
import time

from ..app.report import REPORT_FILES
from ..app.requests import TuneRequest, parse_kv_types
from ..app.tune import TuneInterrupted, TuneOutcome, start_tune
from planner.hardware import fmt_bytes, kept_free_text
from . import logs
from .common import add_hw, emit_json, add_option, add_positional, given

log = logging.getLogger(__name__)


STILL_RUNNING_S = 30.0     # a line when nothing was said for this long and no bar shows the time
TICK_S = 1.0               # how often the bar's clock moves, and the silence is looked at


class _Console:
    """What the user sees while a study runs: start and confirmation lines, and a tqdm bar counting engine runs
    (silent when stderr is not a TTY, with --quiet or with the global -q), made at the first trial and closed
    before any line. The lines go through logging (INFO: the global -q silences them too). While no line comes
    (a llama-bench run on a big model takes minutes), a thread moves the bar's clock every TICK_S or, with no bar
    shown, says `# tune: still running` after STILL_RUNNING_S of silence; `close` ends it."""

    def __init__(self, total: int, quiet: bool):
        self.total, self.quiet = total, quiet or not logs.shown()
        self.bar = None
        self.start: int | None = None
        self.done = 0
        self.lock = threading.Lock()              # the bar and the silence, shared with the thread
        self.began = self.said = time.monotonic()
        self.ended = threading.Event()
        self.ticker = threading.Thread(target=self._tick, name="tune-still-running", daemon=True)
        self.ticker.start()

    def note(self, line: str) -> None:
        with self.lock:
            self.said = time.monotonic()
            self._close_bar()
        log.info("%s", line)

    def _tick(self) -> None:
        while not self.ended.wait(TICK_S):
            with self.lock:
                if self.bar is not None and not self.bar.disable:
                    self.bar.refresh()                # a terminal sees its elapsed time move
                    continue
                if time.monotonic() - self.said < STILL_RUNNING_S:
                    continue
                self.said = time.monotonic()
                line = still_running_line(self.said - self.began, self.done, self.total)
            log.info("%s", line)

    def progress(self, tuner, trial) -> None:
        with self.lock:
            self._progress(tuner, trial)

    def _progress(self, tuner, trial) -> None:
        if self.bar is None:
            from tqdm import tqdm
            self.bar = tqdm(total=self.total, desc="tune", unit="run", file=sys.stderr, dynamic_ncols=True,
                            disable=self.quiet or not sys.stderr.isatty())
        if self.start is None:
            from tuner.records import TrialRecord
            self.start = tuner.n_measured - (1 if TrialRecord.from_trial(trial).measured is not None else 0)
        done = self.done = min(self.total, tuner.n_measured - self.start)
        if done > self.bar.n:
            self.bar.update(done - self.bar.n)
        pts = [(tg, pp) for _, tg, pp in tuner.samples]
        if pts:
            self.bar.set_postfix_str(f"best TG {max(p[0] for p in pts):.1f} t/s, PP {max(p[1] for p in pts):.0f} t/s",
                                     refresh=False)
        self.bar.refresh()

    def _close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def close(self) -> None:
        """The end of the tune: no more lines from the thread, the bar closed."""
        self.ended.set()
        with self.lock:
            self._close_bar()


def still_running_line(elapsed_s: float, done: int, total: int) -> str:
    """What ran and what is left, and at the pace so far (the probe and baselines in it) how long the rest takes; a
    --time-limit may end it sooner."""
    pace = (f"; about {_minutes(elapsed_s / done * (total - done))} more at this pace"
            if 0 < done < total else "")
    return f"# tune: still running, {_minutes(elapsed_s)} in; {done} of {total} runs done{pace}"


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {int(seconds % 60)} s" if seconds >= 60 else f"{seconds:.0f} s"


def tune_options(args: argparse.Namespace) -> TuneRequest:
    """TuneRequest from `tune`'s parsed flags (every default None or False, so a flag counts only when given),
    over the spec's values when --spec names one."""
    values = given(TuneRequest, args)
    if "kv_types" in values:
        values["kv_types"] = parse_kv_types(values["kv_types"], "--kv-types")
    return TuneRequest.from_values(values)


def cmd_tune(args: TuneRequest) -> int:
    """`tune`, from options built at the edge (flags, a spec, or the demo's)."""
    console = _Console(args.trials, args.quiet)
    try:
        o = start_tune(args, note=console.note, progress=console.progress)
    except TuneInterrupted as e:          # Ctrl-C, SIGTERM or SIGHUP: exit 128 + the signal (130, 143, 129)
        console.close()
        with contextlib.suppress(OSError):     # SIGHUP: the terminal may be gone
            print(f"offload-tuner: interrupted; {e.finished} finished trials are saved in {e.storage}: run the "
                  "same command to resume", file=sys.stderr)
        return 128 + e.signum
    finally:
        console.close()
    if args.json:
        emit_json(o.to_json())
        return 0
    _print_tune(o)
    return 0


def _print_tune(o: TuneOutcome) -> None:
    """The text outcome of `tune`: runs, the refit, the baselines and the best configs."""
    from tuner.cost_fit import CostFit
    s, result = o.summary, o.run
    counts = ", ".join(f"{v} {k}" for k, v in sorted(s.counts.items()))
    if s.headline:               # a time-objective study says what it recommends first
        print(s.headline)
    if s.threads:                # and the thread count every command carries, when the probe chose one
        print(s.threads)
    print(f"study {s.study}: {result.measured} runs this session in {result.elapsed_s:.1f} s; "
          f"{s.n_trials} trials in all ({counts}); storage {o.storage}")
    if s.budget_bytes:
        print(f"budget: {fmt_bytes(s.budget_bytes)} of GPU memory ({kept_free_text(s.keep_free_bytes)} per GPU)")
    if result.stopped:
        print(f"note: {result.stopped}")
    fit = s.cost_fit or {}
    if fit.get("err_prior"):
        print(f"cost model refit on {fit['n']} runs: mean error TG {fit['err_prior'].get('tg', 0):.1%} -> "
              f"{fit['err_fit'].get('tg', 0):.1%}, PP {fit['err_prior'].get('pp', 0):.1%} -> "
              f"{fit['err_fit'].get('pp', 0):.1%}"
              f"; terms moved: {CostFit.from_dict(fit).describe_moves()}")
    rows = []
    for b in s.baselines:
        m = b.get("measured") or {}
        rows.append([b["name"], f"{m.get('tg_tps', 0):.2f}" if b.get("ok") else "-",
                     f"{m.get('pp_tps', 0):.1f}" if b.get("ok") else "-",
                     fmt_bytes(sum((m.get("peak_bytes") or {}).values())) if b.get("ok") else (b.get("error") or "-")])
    picks = [("best " + k.upper() if k in ("tg", "pp") else f"best {s.settings.objective}"
              + (f" = {r['mean_request_s']:.2f} s" if r.get("mean_request_s") is not None else ""), r)   # time: s
             for k, r in s.best.items() if r]
    for title, r in picks:
        rows.append([f"{title} (trial {r['trial']})", f"{r['tg_tps']:.2f}", f"{r['pp_tps']:.1f}",
                     fmt_bytes(r["vram_bytes"]) if r.get("vram_bytes") else "-"])
    from planner.tables import table
    print()
    print(table(["config", "TG t/s", "PP t/s", "peak VRAM"], rows))
    for title, r in picks:
        print()
        print(f"{title}: {r['label']}")
        for tool, cmd in r["commands"].items():
            print(f"  {tool}: {cmd}")
    if o.out is not None:
        print()
        print(f"report: {o.out}/{REPORT_FILES}")


def add_parser(sub) -> None:
    """Registers `tune` and its options (made from TuneRequest' fields: offload_tuner/app/requests.py)."""
    p = sub.add_parser("tune", help="search placements and knobs with Optuna for the best PP/TG within VRAM",
                       description="Start or resume an Optuna study. --spec studies/NAME.toml reads the study from a "
                       "file (docs in offload_tuner/app/studyspec.py); any flag given on the command line "
                       "overrides the spec's value for it.")
    # every default here is None (or False): TuneRequest holds the real ones, so a flag counts only when given
    add_positional(p, TuneRequest, "model", nargs="?")
    add_option(p, TuneRequest, "spec", metavar="FILE")
    add_option(p, TuneRequest, "engine")
    add_hw(p, TuneRequest)
    for name in ("trials", "study", "storage", "objective", "workload", "ttft", "n_prompt", "n_gen", "depth", "reps",
                 "ctx", "dialect"):
        add_option(p, TuneRequest, name)
    add_option(p, TuneRequest, "llama_bench", metavar="PATH")
    add_option(p, TuneRequest, "llama_server", metavar="PATH")
    for name in ("keep_free", "margin", "cpu_stand_in", "confirm", "space", "kv_types", "seed", "pool", "timeout_s",
                 "time_limit", "fresh", "out", "no_report", "quiet", "json"):
        add_option(p, TuneRequest, name)
    p.set_defaults(func=lambda args: cmd_tune(tune_options(args)))
