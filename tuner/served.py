"""Confirmation on the server the user runs: the study's finalists and the `--fit` a knowledgeable user would run,
each started as llama-server and sent the user's workload, interleaved in rounds, judged by the median mean
request time.

llama-bench is not what users run: its -fitt fits another context than the server's, it has no prompt cache and
no parallel slots. So a study whose objective is the workload's request time ends here (tune's `--served`, the
workload_vs_fit benchmark): the engine is the llamaserver engine (runtime/llamaserver.py), which starts the
emitted command, replays the workload over HTTP and measures each request.

The reference is the best of `llama-server --fit on` at the workload's context with the default ubatch (512),
with `-ub 2048` and with `-ub 4096` (ik: its own --fit likewise): the fastest of them on the workload, by median.
It is itself a candidate, so what is recommended is never slower than what the user would have run: when no
finalist beats it, the recommendation is that --fit line.

A finalist's first served run also says how much of the budget the server left unused: the study judged its plans
on llama-bench's memory and a margin, and llama-server at the workload's context uses another amount (the 6 GiB
rag finalists of the H100 benchmark peaked 0.3-1.0 GiB under the budget, where --fit's experts filled it). So each
finalist gets a filled twin ("fill:N"): its plan with experts moved from RAM onto its GPUs until the memory model,
shifted by what the server measured against it, reaches the budget less FILL_LEFT. It is served like the others.

    # C contenders (references + finalists), R rounds: at most R x C server runs, each replaying the whole workload

A contender far behind after its first run is not served again (DROP_BEHIND, far_behind): a reference against the
fastest reference, a finalist against the fastest of all. The fastest of each keeps every round, so the verdict
still rests on repeats and their spread.

The same verdict for less (Thrift; tune's serving, issue 41 item 4; the full check of benchmarks/time_to_answer.py
serves every contender every round, FULL): each server run times each request class once (the rounds give the
spread; the prefixes are warmed once per server start and the load is timed apart: runtime/llamaserver.py);
finalists whose llama-bench run at the workload's sizes answers SCREEN_BEHIND x slower than the best finalist's are
not served (screened: the study's own runs where it measured at those sizes, else one short run each); a twin only
where its finalist's server left TWIN_MIN_LEFT of the budget unused on a GPU; after each round, a contender whose
every sample is slower than every sample of the best contender (the pick so far) by more than the noise
(BEHIND_NOISE, or the wider spread of the two), and a finalist over the budget, are not served again; and the stage
ends once at most one contender is left, whatever rounds remain.

    # C contenders: C runs in round 1, then only those still in the race; one left: done

Speeds are compared only between runs of one machine (GPU machines of one kind differ by 10% or more): each row
names the boot it ran in (machine_id), and a confirmation resumed on another machine sets the rows of the first
aside ("elsewhere" in the stored serving) and serves every contender again.
"""
from __future__ import annotations

import contextlib
import math
import statistics
import threading
import time
from dataclasses import asdict, dataclass, replace
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from planner.errors import InputError
from planner.hardware import MiB, fmt_bytes
from planner.plan import Plan
from planner.propose import Room, fill_experts
from .confirm import Spread, compare, schedule
from .records import ServedRun, StudyRecord, TrialRecord

if TYPE_CHECKING:
    from planner.hardware import HardwareProfile
    from .measurer import Measurer

REFERENCE_UBATCHES = (512, 2048, 4096)     # --fit as llama-server defaults it, and the two a user tries next
SERVED_ROUNDS = 2
STILL_RUNNING_S = 30.0     # a line at least this often while a server run is under way
SERVED_FINALISTS = 3
PP_GIVE_UP = 0.5          # a pick under half the reference's PP says so in its first line
TG_GIVE_UP = 0.95         # ... and one more than 5% under its TG
BENCH_SERVER_GAP = 0.05   # llama-bench and llama-server further apart than this: a warning in the report
FILL_LEFT = 128 * MiB     # a filled twin aims its server peak this far under the budget (run-to-run peaks vary less)
# A contender whose best run is this many times slower than the best it must beat is not served again: it can be
# neither the reference nor the pick, and on a 235B model one server run costs a minute or more of a GPU machine.
# Runs inside one device call differ by a few percent (the H100 rounds: 1-8%), far under this gap.
DROP_BEHIND = 1.3
# Thrift's defaults. One sample has no spread of its own: a contender is behind the best only past BEHIND_NOISE (runs
# inside one device call differed by 1-8% on the H100 rounds; their spreads, when wider, count instead).
BEHIND_NOISE = 0.05
SCREEN_BEHIND = 1.2       # llama-bench's request time this x the best finalist's: not served (bench/server gap ~5%)
TWIN_MIN_LEFT = 256 * MiB  # a twin aims FILL_LEFT under the budget: under this left, it would move next to nothing


@dataclass(frozen=True)
class Thrift:
    """What the served stage leaves out when it cannot change the verdict (the module docstring). None / 0 / False
    turns a rule off; FULL turns every one off (every contender, every twin, every round)."""
    screen_behind: float | None = SCREEN_BEHIND   # finalists screened by llama-bench at the workload's sizes
    twin_min_left: int = TWIN_MIN_LEFT            # a twin only where the finalist's server left this much unused
    behind_noise: float | None = BEHIND_NOISE     # after a round: drop those behind the best by more than this
    stop_early: bool = True                       # end once at most one contender is left
    repetitions: int | None = 1                   # timed requests per class in a run (None: the engine's default)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Thrift | None:
        return None if d is None else cls(**d)


THRIFT = Thrift()
FULL = Thrift(screen_behind=None, twin_min_left=0, behind_noise=None, stop_early=False)


@dataclass(frozen=True)
class Served:
    """One config to serve: a reference (--fit at an ubatch) or a trial's plan."""
    key: str                           # "fit:512", "fit:2048", "fit:4096", "trial:N" or "fill:N"
    name: str
    roles: tuple[str, ...]             # "reference" or "finalist"
    trial: int | None = None
    ubatch: int | None = None
    filled: bool = False               # trial N's plan with experts moved onto the GPU up to the budget
    kv_type: str | None = None         # a reference at the KV type a finalist uses ("fit:UB:TYPE")


def gpu_memory(hw: HardwareProfile) -> dict[str, int]:
    """{"CUDA0": bytes, ...}: each GPU's memory (--gpu) under the device name llama.cpp gives it (a GPU's own
    `name` is its model, "H100", and two of them share it)."""
    return {f"CUDA{i}": g.vram_bytes for i, g in enumerate(hw.gpus)}


def served_budget(hw: HardwareProfile) -> dict[str, int]:
    """{"CUDA0": bytes, ...}: what the served plans may use on each GPU, its memory less what is kept free
    (hw.keep_free_bytes); llama-server's own --fit is told to keep the rest free (-fitt)."""
    return {d: b - hw.keep_free_bytes for d, b in gpu_memory(hw).items()}


def served_of(key: str) -> Served:
    """The contender a stored key stands for: "fit:UB" a reference ("fit:UB:TYPE" at that KV type), "trial:N" a
    finalist, "fill:N" its twin."""
    kind, _, n = key.partition(":")
    if kind == "fit":
        ub_text, _, kv = n.partition(":")
        ub = int(ub_text)
        name = "--fit" + (f" -ub {ub}" if ub != 512 else "") + (f" -ctk/-ctv {kv}" if kv else "")
        return Served(key, name, ("reference",), ubatch=ub, kv_type=kv or None)
    if kind == "fill":
        return Served(key, f"trial {n} filled", ("finalist",), trial=int(n), filled=True)
    return Served(key, f"trial {n}", ("finalist",), trial=int(n))


def filled_plan(measurer: Measurer, plan: Plan, peaks: dict[str, int]) -> Plan | None:
    """`plan` with experts moved from RAM onto its GPUs, as far as the server's measured `peaks` leave room under
    each GPU's budget less FILL_LEFT: the memory model's prediction for the served plan is shifted by what the
    server measured (the model's error at this plan), and planner.propose.fill_experts fills up to it, in the
    order the plan already has (first layers first when those are the ones on the GPU). None when no expert
    moves (no room for one, no measured peak: a CPU-only run)."""
    wl = measurer.requests
    if wl is None or not peaks:
        return None
    served = replace(plan, knobs=replace(plan.knobs, n_ctx=wl.ctx, n_seq=wl.slots))
    pred = measurer.estimate(measurer.inv, served, measurer.hw).devices
    room = {}
    for d, budget in served_budget(measurer.hw).items():
        if d in pred and d not in peaks:
            return None
        if d in pred:
            room[d] = pred[d].total + budget - FILL_LEFT - peaks[d]
    on_gpu = sorted({t.layer for t in measurer.inv.allocated()
                     if t.is_expert and t.layer is not None and plan.assignment.get(t.name, "CPU") != "CPU"})
    order = "first" if on_gpu and on_gpu[0] == min(measurer.inv.moe_layers()) else "last"
    out = fill_experts(measurer.inv, served, Room(room, measurer.hw.host.ram_bytes), measurer.hw, order=order,
                       estimate=measurer.estimate)
    if out.assignment == served.assignment:
        return None
    return replace(out, knobs=plan.knobs, label=f"{plan.label} filled to the served budget".strip())


def partial_record(study: StudyRecord, budget: dict[str, int]) -> dict[str, Any] | None:
    """A confirmation cut off before its last sample, judged on the samples it has (marked "partial"), so a report
    can show it; None when none was started."""
    serving = study.serving or {}
    if not serving.get("rows"):
        return None
    screened = serving.get("screened") or {}
    keys = [*(k for k in serving["keys"] if k not in screened), *serving.get("kv_refs", []),
            *(k for k, p in (serving.get("fills") or {}).items() if p is not None)]
    rt = study.request_time
    rows = [ServedRun.from_dict(r) for r in serving["rows"]]
    rec = served_record([served_of(k) for k in keys], rows, serving.get("rounds", 0), budget,
                        rt.workload if rt else "workload", ttft_limit_s=rt.ttft_limit_s if rt else None,
                        drop_behind=serving.get("drop_behind"), thrift=Thrift.from_dict(serving.get("thrift")),
                        screened=screened)
    return dict(rec, partial=True)


def contenders(measurer: Measurer, n_finalists: int = SERVED_FINALISTS) -> list[Served]:
    """The references, then the study's best trials by its objective (distinct plans, measured ok)."""
    from optuna.trial import TrialState
    out = [served_of(f"fit:{ub}") for ub in REFERENCE_UBATCHES]
    ranked = []
    for t in measurer.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        r = TrialRecord.from_trial(t)
        if (r.measured is not None and r.measured.ok and r.duplicate_of is None and r.plan_json is not None
                and t.values):
            ranked.append((measurer.objective.scalar(r.measured.tg_tps, r.measured.pp_tps), t.number))
    for _, number in sorted(ranked, reverse=True)[:n_finalists]:
        out.append(served_of(f"trial:{number}"))
    return out


def study_threads(measurer: Measurer, n_finalists: int = SERVED_FINALISTS) -> int | None:
    """The thread count of the study's best finalist (None: it sets none), at which every contender is served: the
    server's default can be far from it (on a 64-vCPU four-GPU VM llama.cpp's default -t 64 generated 0.6 t/s where
    -t 32 gave 12.8: docs/llamacpp.md section 13), and a --fit left at it would lose to threads, not to placement."""
    finalists = [c for c in contenders(measurer, n_finalists) if c.trial is not None]
    if not finalists:
        return None
    return TrialRecord.from_trial(measurer.trial(finalists[0].trial)).plan().knobs.n_threads or None


def _plan_of(measurer: Measurer, c: Served, fills: dict[str, str | None]) -> Plan | None:
    """The plan a contender serves: its trial's, or its filled twin's (stored); None for a --fit reference."""
    if c.filled:
        return Plan.from_json(fills[c.key] or "")
    if c.trial is not None:
        return TrialRecord.from_trial(measurer.trial(c.trial)).plan()
    return None


def _sample(measurer: Measurer, server: Any, c: Served, plan: Plan | None, threads: int | None = None,
            repetitions: int | None = None) -> dict[str, Any]:
    """One replay of the workload by one contender, as a stored row; `threads`: -t for every contender (None: the
    plan's own, the server's default for a reference); `repetitions`: timed requests per class (None: the
    server engine's own)."""
    from .interrupt import SIGINT
    budgets = served_budget(measurer.hw)
    if plan is not None and threads:
        plan = replace(plan, knobs=replace(plan.knobs, n_threads=threads))
    reps = {"repetitions": repetitions} if repetitions is not None else {}
    try:
        with SIGINT.engine_run():
            if plan is not None:
                m = server.measure_workload(measurer.inv, plan, measurer.requests, **reps)
            else:
                m = server.fit_reference(measurer.inv, measurer.requests, budgets, c.ubatch, kv_type=c.kv_type,
                                         threads=threads, **reps)
    except InputError:
        raise
    except Exception as e:       # an engine bug is a failed sample, not the end of the study
        return {"ok": False, "error": f"engine raised {type(e).__name__}: {e}"}
    raw = m.raw or {}
    return {"ok": bool(m.ok), "error": m.error, "request_s": raw.get("mean_request_s"), "ttft_s": raw.get("ttft_s"),
            "ttft_max_s": raw.get("ttft_max_s"),
            "pp_tps": m.pp_tps, "tg_tps": m.tg_tps, "peak_bytes": dict(m.peak_bytes),
            "command": raw.get("command"), "seconds": raw.get("wall_s"), "ready_s": raw.get("ready_s")}


@contextlib.contextmanager
def still_running(tell: Callable[[str], None], what: str, expect_s: float | None = None,
                  every_s: float | None = None) -> Iterator[None]:
    """While the block runs (a server run: minutes on a big model), `what` with the seconds so far every `every_s`
    (None: STILL_RUNNING_S), and those a run like it took before (`expect_s`), from a thread that ends with the
    block."""
    done = threading.Event()
    start = time.monotonic()
    every = every_s or STILL_RUNNING_S

    def beat() -> None:
        while not done.wait(every):
            tell(f"{what}, {time.monotonic() - start:.0f} s so far"
                 + (f" (the last like it took {expect_s:.0f} s)" if expect_s else ""))
    thread = threading.Thread(target=beat, name="served-still-running", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def machine_id() -> str:
    """This boot of this machine: the kernel's boot id (a fresh GPU machine has a new one), else the host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        import socket
        return socket.gethostname()


def far_behind(cs: list[Served], rows: list[ServedRun], factor: float | None = DROP_BEHIND) -> dict[str, float]:
    """{key: how many times slower}: the contenders whose best good run is over `factor` x the best they must beat
    (a reference: the fastest reference's best; a finalist: the fastest run of all). Computed from the stored rows
    alone, so a resumed confirmation drops the same ones; {} when `factor` is None."""
    if factor is None:
        return {}
    best: dict[str, float] = {}
    for r in rows:
        if r.ok and r.request_s:
            best[r.key] = min(best.get(r.key, math.inf), float(r.request_s))
    if not best:
        return {}
    refs = [best[c.key] for c in cs if "reference" in c.roles and c.key in best]
    out = {}
    for c in cs:
        bar = min(refs, default=math.inf) if "reference" in c.roles else min(best.values())
        if c.key in best and best[c.key] > factor * bar:
            out[c.key] = best[c.key] / bar
    return out


def screen(measurer: Measurer, finalists: list[Served], factor: float | None) -> dict[str, float]:
    """{key: how many times slower}: the finalists whose llama-bench run at the workload's sizes (bench_for: its mean
    new, cached and generated tokens) answers a mean request over `factor` x the best finalist's, by the study's
    request-time model. The study's own runs where it measured at those sizes (nothing runs: the usual case), else
    one run each at one repetition (a study told other --n-prompt/--n-gen/--depth). {} with fewer than two."""
    from .objectives import bench_for
    if factor is None or len(finalists) < 2 or measurer.requests is None:
        return {}
    bench = bench_for(measurer.requests, repetitions=1)
    w = measurer.bench
    rt = measurer.request_time()
    seconds = {}
    for c in finalists:
        rec = TrialRecord.from_trial(measurer.trial(c.trial))
        m = rec.measured
        if (w.n_prompt, w.n_gen, w.depth) != (bench.n_prompt, bench.n_gen, bench.depth):
            m = measurer.measure(rec.plan(), bench)
        if m is not None and m.ok:
            seconds[c.key] = rt.mean_s(m.tg_tps, m.pp_tps)
    best = min(seconds.values(), default=math.inf)
    if not math.isfinite(best) or best <= 0:
        return {}
    return {k: v / best for k, v in seconds.items() if v > factor * best}


def _round_done(c: Served, rows: list[ServedRun], rnd: int) -> bool:
    return any(r.key == c.key and r.round == rnd for r in rows)


def dropped(cs: list[Served], rows: list[ServedRun], drop_behind: float | None, thrift: Thrift | None,
            budget: dict[str, int], ttft_limit_s: float | None = None) -> dict[str, tuple[float, str]]:
    """{key: (times slower than the best, why)}: the contenders not served again. far_behind after a first run;
    with `thrift`'s behind_noise, after each round that every contender still in the race has run: a finalist over
    the budget on a GPU (its peak only grows with more runs: it cannot be the pick), and one whose every sample is
    slower than every sample of the best (the pick so far, served_record's rule) by more than the noise (the larger
    of behind_noise and the two spreads). Computed from the rows alone, round by round (a contender once dropped
    stays dropped), so a resumed stage drops the same ones."""
    out = {k: (v, f"{v:.2f}x the best run after its first") for k, v in far_behind(cs, rows, drop_behind).items()}
    if thrift is None or thrift.behind_noise is None:
        return out
    for rnd in range(1 + max((r.round for r in rows), default=-1)):
        alive = [c for c in cs if c.key not in out]
        if not all(_round_done(c, rows, rnd) for c in alive):
            break
        s = [_summary(c, [r for r in rows if r.round <= rnd]) for c in alive]
        _, best = _pick_of(s, budget, ttft_limit_s)
        if best is None:
            continue
        top = best["request_s"]
        for x in s:
            mine = x["request_s"]
            if x is best or not mine.samples:
                continue
            ratio = mine.median / top.median
            if "reference" not in x["roles"] and not _within(x, budget):
                out[x["key"]] = (ratio, f"over the budget after round {rnd + 1}")
            elif mine.lo > top.hi * (1 + max(thrift.behind_noise, mine.rel_range, top.rel_range)):
                out[x["key"]] = (ratio, f"every sample behind {best['name']}'s after round {rnd + 1}")
    return out


def run_line(c: Served, row: ServedRun, rnd: int, rounds: int, done: int, left: int, rows: list[ServedRun]) -> str:
    """The line a served run says as it ends: contender, round, load seconds, mean request time, TTFT, VRAM per
    GPU, runs left and the stage's remaining minutes, guessed from the mean of the runs so far."""
    if row.ok:
        vram = ", ".join(f"{d} {fmt_bytes(b)}" for d, b in sorted((row.peak_bytes or {}).items())) or "-"
        what = (f"loaded in {row.ready_s or 0:.0f} s, {row.request_s or 0:.2f} s mean request, TTFT "
                f"{row.ttft_s or 0:.2f} s, VRAM {vram}")
    else:
        what = f"failed: {' '.join(str(row.error or 'no reason given').split())[:160]}"
    took = [r.seconds or 0 for r in rows]
    eta = f", about {math.ceil(left * sum(took) / len(took) / 60)} min" if left and took else ""
    runs = f"{left} run{'' if left == 1 else 's'} left"
    return f"# served {done}: {c.name}, round {rnd + 1} of {rounds}: {what}; {runs}{eta}"


def _go_on_from(stored: dict[str, Any], same: bool, here: str, threads: int | None
                ) -> tuple[list[ServedRun], list[dict[str, Any]]]:
    """The stored runs a served stage goes on from (the same contenders, on this machine, at these threads), and
    the others: rows of another contender set (other finalists), machine or thread count, kept aside as stored
    ("elsewhere"), never dropped."""
    def ours(r: ServedRun) -> bool:
        return r.machine in (None, here) and r.threads == threads     # no machine: stored before it was kept
    rows = [ServedRun.from_dict(r) for r in stored.get("rows", [])]
    return ([r for r in rows if ours(r)] if same else [],
            list(stored.get("elsewhere", [])) + [r.to_dict() for r in rows if not (same and ours(r))])


def confirm_served(measurer: Measurer, server: Any, rounds: int = SERVED_ROUNDS, n_finalists: int = SERVED_FINALISTS,
                   deadline: float | None = None, progress: Any = None, fill: bool = True,
                   drop_behind: float | None = DROP_BEHIND, threads: int | None = None,
                   say: Callable[[str], None] | None = None, thrift: Thrift | None = None) -> dict[str, Any]:
    """Serve the references and the finalists interleaved for `rounds` rounds, and (`fill`) each finalist's filled
    twin from its first good run on (filled_plan; it joins the round under way and the rounds after it); a
    contender `drop_behind` x slower than the best it must beat is not served again (far_behind; None: every
    contender every round). `thrift`: the rules that leave out what cannot change the verdict (Thrift: screened
    finalists, twins only with room, drops after each round, the early end, one timed request per class; tune
    passes THRIFT; None: none of them). `threads`: every contender at -t `threads` (the thread count measured
    best on the machine: placement is compared, not the host's default thread count; None: each its own). Each
    sample is stored as it comes (the study attr "serving"), so a killed confirmation resumes; rows from another
    machine, another `threads` or another set of contenders are set aside ("elsewhere") and not compared with
    these. `say` gets a line as each run ends (run_line) and one for each contender left out, `progress` (done,
    total) after each run. Returns the record (served_record, also stored as "served"), or {} when a sample was
    left because it would not end before `deadline` (call again to go on)."""
    if measurer.requests is None:
        raise InputError("serving a study's finalists needs its workload: tune with --objective time")
    threads = threads or None
    tell = say or (lambda line: None)
    base = contenders(measurer, n_finalists)
    keys = [c.key for c in base]
    stored = StudyRecord.of(measurer.study).serving or {}
    same = stored.get("keys") == keys
    here = machine_id()
    budget = served_budget(measurer.hw)
    ttft_limit = measurer.requests.ttft_limit_s

    rows, elsewhere = _go_on_from(stored, same, here, threads)
    fills: dict[str, str | None] = dict(stored.get("fills", {})) if same else {}   # None: nothing to fill
    kv_refs: list[str] = list(stored.get("kv_refs", [])) if same else []
    if deadline is not None and time.monotonic() >= deadline and not same:
        return {}                     # nothing started, no time: not even the screen's runs
    # screened once (its llama-bench runs are not repeated on resume); no screen, none screened
    screened: dict[str, float] = (
        {} if thrift is None or thrift.screen_behind is None
        else dict(stored["screened"]) if same and stored.get("thrift") and "screened" in stored
        else _screen(measurer, base, thrift, tell))
    base = [c for c in base if c.key not in screened]
    told: set[str] = set()

    def save(**more: Any) -> None:
        StudyRecord.save(measurer.study, serving={
            "keys": keys, "rounds": rounds, "rows": [r.to_dict() for r in rows], "fills": fills, "kv_refs": kv_refs,
            "drop_behind": drop_behind, "elsewhere": elsewhere, "screened": screened,
            "thrift": thrift.to_dict() if thrift is not None else None, **more})
    while True:
        if fill:
            _add_twins(measurer, base, rows, fills, thrift.twin_min_left if thrift else 0, tell)
        _add_kv_references(measurer, base, rows, kv_refs)
        cs = base + [served_of(k) for k in kv_refs] + [served_of(k) for k, p in fills.items() if p is not None]
        todo = _todo(cs, rows, rounds, dropped(cs, rows, drop_behind, thrift, budget, ttft_limit), thrift, told,
                     tell)
        if not todo:
            break
        rnd, c = todo[0]
        # how long this one will take: its own longest run so far, a twin's first its parent's, a first run the
        # longest of any (on a 235B model a run is minutes: one started blind is cut off by the device call's end)
        took = ([r.seconds or 0 for r in rows if r.key in (c.key, f"trial:{c.trial}")]
                or [r.seconds or 0 for r in rows])
        if deadline is not None and time.monotonic() + (max(took) if took else 0) >= deadline:
            return {}
        plan = _plan_of(measurer, c, fills)
        with still_running(tell, f"# served {len(rows) + 1}: {c.name}, round {rnd + 1} of {rounds}: running",
                           max(took) if took else None):
            rows.append(ServedRun.from_dict({
                "round": rnd, "key": c.key, "machine": here, **({"threads": threads} if threads else {}),
                **_sample(measurer, server, c, plan, threads, thrift.repetitions if thrift else None)}))
        save(left=len(todo) - 1, eta_s=(len(todo) - 1) * statistics.fmean(r.seconds or 0 for r in rows))
        tell(run_line(c, rows[-1], rnd, rounds, len(rows), len(todo) - 1, rows))
        if progress is not None:
            progress(len(rows), rounds * len(cs))
    cs = base + [served_of(k) for k in kv_refs] + [served_of(k) for k, p in fills.items() if p is not None]
    record = served_record(cs, rows, rounds, budget, measurer.requests.name, _bench_runs(measurer, cs), ttft_limit,
                           drop_behind=drop_behind, thrift=thrift, screened=screened)
    save(left=0, eta_s=0.0)
    StudyRecord.save(measurer.study, served=record)
    return record


def serving_view(serving: dict[str, Any] | None, served: dict[str, Any] | None) -> dict[str, Any] | None:
    """The served stage as the web view shows it while it runs and after: a row per server run (who, which
    round, its mean request time, TTFT and VRAM, or why it failed), the runs left and the minutes they are likely
    to take (the mean of the runs so far), and the verdict once there is one. None before any server run."""
    rows = [ServedRun.from_dict(r) for r in (serving or {}).get("rows") or []]
    if not rows:
        return None
    out = [{"run": i + 1, "name": served_of(r.key).name, "round": r.round + 1, "ok": bool(r.ok),
            "request_s": r.request_s, "ttft_s": r.ttft_s, "vram_bytes": sum((r.peak_bytes or {}).values()) or None,
            "seconds": r.seconds, "error": " ".join(str(r.error or "").split())[:200]} for i, r in enumerate(rows)]
    return {"rows": out, "rounds": serving.get("rounds"), "left": serving.get("left"),
            "eta_s": serving.get("eta_s"), "done": served is not None,
            "headline": headline(served) if served else None}


def _todo(cs: list[Served], rows: list[ServedRun], rounds: int, drops: dict[str, tuple[float, str]],
          thrift: Thrift | None, told: set[str], tell: Callable[[str], None]) -> list[tuple[int, Served]]:
    """The runs still to serve, in order: none of a dropped contender (each said once, in `told`), and none at all
    once at most one contender is left (thrift.stop_early)."""
    for k in [c.key for c in cs if c.key in drops and c.key not in told]:
        told.add(k)
        tell(f"# served: {served_of(k).name} is not served again: {drops[k][1]}")
    todo = [(rnd, c) for rnd, c in schedule(cs, rounds)
            if c.key not in drops and not _round_done(c, rows, rnd)]
    left = [c for c in cs if c.key not in drops]
    if todo and thrift is not None and thrift.stop_early and len(left) <= 1 and rows:
        tell(f"# served: {left[0].name if left else 'no contender'} is the only one left: no further run can "
             f"change the pick ({len(rows)} of the {rounds} rounds' {rounds * len(cs)} runs served)")
        return []
    return todo


def _screen(measurer: Measurer, base: list[Served], thrift: Thrift | None, tell: Callable[[str], None]
            ) -> dict[str, float]:
    """The finalists `thrift` screens out before any is served (screen), each said in a line."""
    out = screen(measurer, [c for c in base if c.trial is not None], thrift.screen_behind if thrift else None)
    for k, v in out.items():
        tell(f"# served: {served_of(k).name} is not served: llama-bench at the workload's sizes puts its mean "
             f"request {v:.2f}x the best finalist's")
    return out


def _add_kv_references(measurer: Measurer, base: list[Served], rows: list[ServedRun], kv_refs: list[str]) -> None:
    """--fit at a KV type a finalist uses (K and V alike, not f16): once every reference's first round is in, at the
    ubatch of the fastest of them, so the reference a user would run with that KV type is served too."""
    refs = [c for c in base if "reference" in c.roles]
    firsts = [next((r for r in rows if r.key == c.key and r.round == 0), None) for c in refs]
    if kv_refs or not refs or any(r is None for r in firsts):
        return
    good = [(r.request_s, c) for r, c in zip(firsts, refs) if r and r.ok and r.request_s]
    if not good:
        return
    ub = min(good, key=lambda x: x[0])[1].ubatch
    kinds = []
    for c in base:
        if c.trial is not None:
            k = TrialRecord.from_trial(measurer.trial(c.trial)).plan().knobs
            if k.type_k == k.type_v and k.type_k != "f16" and k.type_k not in kinds:
                kinds.append(k.type_k)
    kv_refs += [f"fit:{ub}:{kv}" for kv in kinds]


def _add_twins(measurer: Measurer, base: list[Served], rows: list[ServedRun], fills: dict[str, str | None],
               min_left: int = 0, tell: Callable[[str], None] | None = None) -> None:
    """Each finalist's filled twin, from its first good run with measured peaks (once: None when nothing moves, or
    when its server left under `min_left` of the budget unused on every GPU)."""
    budget = served_budget(measurer.hw)
    for c in base:
        twin = f"fill:{c.trial}"
        if c.trial is None or twin in fills:
            continue
        first = next((r for r in rows if r.key == c.key and r.ok and r.peak_bytes), None)
        if first is None or not first.peak_bytes:
            continue
        unused = max((budget.get(d, 0) - int(b) for d, b in first.peak_bytes.items()), default=0)
        if unused < min_left:
            fills[twin] = None
            if tell is not None:
                tell(f"# served: no filled twin of {c.name}: its server left {fmt_bytes(max(unused, 0))} of the "
                     f"budget unused (under {fmt_bytes(min_left)})")
            continue
        new = filled_plan(measurer, _plan_of(measurer, c, fills), first.peak_bytes)
        fills[twin] = new.to_json() if new is not None else None


def _bench_runs(measurer: Measurer, cs: list[Served]) -> dict[str, dict[str, Any]]:
    """Each finalist's run in the study (its engine's: llama-bench, or the sim engine's prediction, at the study's
    benchmark workload): its speeds and its peaks moved to the emitted context, to set beside the server's."""
    from planner.engine_registry import traits_of
    engine = traits_of(measurer.engine).binary or f"the {measurer.engine.name} engine"
    out = {}
    for c in cs:
        if c.trial is not None and not c.filled:
            m = TrialRecord.from_trial(measurer.trial(c.trial)).measured
            if m is not None:
                out[c.key] = {"pp_tps": m.pp_tps, "tg_tps": m.tg_tps, "engine": engine,
                              "peak_bytes": dict(m.peak_at_ctx or m.peak_bytes)}
    return out


def bench_vs_server(bench: dict[str, Any], served: dict[str, Any]) -> list[str]:
    """Where llama-bench and llama-server disagree by more than BENCH_SERVER_GAP: peak VRAM per GPU (the budget
    is judged on the server's), PP and TG (the benchmark measures at the workload's mean, the server per class)."""
    out, engine = [], bench.get("engine", "llama-bench")
    for d, b in bench.get("peak_bytes", {}).items():
        s = served["vram_device_bytes"].get(d)
        if s and abs(s - b) > BENCH_SERVER_GAP * s:
            out.append(f"{d}: {engine} {fmt_bytes(b)}, llama-server {fmt_bytes(s)}")
    for name, key in (("PP", "pp"), ("TG", "tg")):
        b, s = bench.get(f"{key}_tps") or 0.0, served[key].median
        if s > 0 and abs(b - s) > BENCH_SERVER_GAP * s:
            out.append(f"{name}: {engine} {b:.1f}, llama-server {s:.1f} t/s")
    return out


def _summary(c: Served, rows: list[ServedRun]) -> dict[str, Any]:
    mine = [r for r in rows if r.key == c.key]
    good = [r for r in mine if r.ok and r.request_s]

    def spread(values: list[float | None]) -> Spread:
        return Spread(tuple(float(v) for v in values if v is not None))
    peaks: dict[str, int] = {}
    for r in good:
        for d, b in (r.peak_bytes or {}).items():
            peaks[d] = max(peaks.get(d, 0), int(b))
    return {"key": c.key, "name": c.name, "roles": list(c.roles), "trial": c.trial, "ubatch": c.ubatch,
            "request_s": spread([r.request_s for r in good]), "ttft_s": spread([r.ttft_s for r in good]),
            # the slowest class's TTFT (what --ttft limits); rows before it was recorded: the mean's
            "ttft_max_s": spread([r.ttft_max_s if all(x.ttft_max_s is not None for x in good) else r.ttft_s
                                  for r in good]),
            "pp": spread([r.pp_tps for r in good]), "tg": spread([r.tg_tps for r in good]),
            "vram_device_bytes": dict(sorted(peaks.items())),
            "command": next((r.command for r in good if r.command), None),
            "errors": [r.error if r.error is not None else "" for r in mine if not r.ok]}


def _within(x: dict[str, Any], budget: dict[str, int]) -> bool:
    """A summary's server peaks within the budget on every GPU."""
    return all(b <= budget.get(d, math.inf) for d, b in x["vram_device_bytes"].items())


def _pick_of(s: list[dict[str, Any]], budget: dict[str, int], ttft_limit_s: float | None
             ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(the reference, the pick) among summaries (_summary): the fastest --fit variant; the fastest of all among the
    references and the finalists within the budget; with a TTFT limit both among those whose slowest class's median
    TTFT meets it, where any does."""
    ok = [x for x in s if x["request_s"].samples]

    def first_that_meet(xs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [x for x in xs if ttft_limit_s is None or x["ttft_max_s"].median <= ttft_limit_s] or xs
    refs = first_that_meet([x for x in ok if "reference" in x["roles"]])
    eligible = first_that_meet([x for x in ok if "reference" in x["roles"] or _within(x, budget)])
    return (min(refs, key=lambda x: x["request_s"].median, default=None),
            min(eligible, key=lambda x: x["request_s"].median, default=None))


def served_record(cs: list[Served], rows: list[ServedRun], rounds: int, budget: dict[str, int],
                  workload: str, bench: dict[str, dict[str, Any]] | None = None,
                  ttft_limit_s: float | None = None, drop_behind: float | None = None,
                  thrift: Thrift | None = None, screened: dict[str, float] | None = None) -> dict[str, Any]:
    """Medians and spreads per contender; the reference (the fastest --fit variant); the pick: the fastest of all,
    references included, among the finalists within the budget on every GPU (a reference is what the user would
    run, so its own VRAM never rules it out); its speedup over the reference with a verdict (win / tie / loss by
    the spreads of the request rates, at least BEHIND_NOISE apart where a side has one sample); and what the pick
    gives up, if anything. With a TTFT limit (tune --ttft), the reference and the pick are taken among the
    contenders whose slowest class's median TTFT meets it, where any does (else among all, and the headline says
    the limit was missed). A contender left before the last round (dropped: far_behind at `drop_behind`, `thrift`'s
    rules) says how far behind it was ("dropped": times slower, else None) and why; `screened`: the finalists
    never served ({key: times slower by llama-bench})."""
    s = [_summary(c, rows) for c in cs]
    drops = dropped(cs, rows, drop_behind, thrift, budget, ttft_limit_s)
    for x in s:
        x["dropped"], x["dropped_why"] = drops.get(x["key"], (None, None))
    for x in s:
        if bench and x["key"] in bench:
            x["bench"] = bench[x["key"]]
            x["bench_vs_server"] = bench_vs_server(bench[x["key"]], x) if x["request_s"].samples else []
    ref, pick = _pick_of(s, budget, ttft_limit_s)
    out: dict[str, Any] = {"workload": workload, "rounds": rounds, "budget_bytes": budget,
                           "reference": ref["key"] if ref else None, "pick": pick["key"] if pick else None}
    last = max((r.round for r in rows), default=-1) + 1
    if thrift is not None:
        out["thrift"] = thrift.to_dict()
        out["screened"] = dict(screened or {})
        out["rounds_served"] = last
    if ttft_limit_s is not None:
        out["ttft_limit_s"] = ttft_limit_s
        out["pick_meets_ttft"] = pick is not None and (pick["ttft_max_s"].median <= ttft_limit_s)
    if ref is not None and pick is not None:
        a, b = (Spread(tuple(1 / v for v in x["request_s"].samples)) for x in (pick, ref))
        one = min(len(a.samples), len(b.samples)) < 2 and thrift is not None
        rate = compare(a, b, floor=BEHIND_NOISE if one else None)
        out["speedup"] = rate.to_dict() if rate else None
        out["gives_up"] = gives_up(pick, ref)
    out["results"] = [dict(x, **{k: x[k].to_dict() for k in ("request_s", "ttft_s", "ttft_max_s", "pp", "tg")})
                      for x in s]
    return out


def gives_up(pick: dict[str, Any], ref: dict[str, Any]) -> list[str]:
    """What the pick trades away against the reference: under PP_GIVE_UP x its PP, or under TG_GIVE_UP x its TG."""
    out = []
    for name, floor in (("pp", PP_GIVE_UP), ("tg", TG_GIVE_UP)):
        a = pick[name].median if isinstance(pick[name], Spread) else pick[name]["median"]
        b = ref[name].median if isinstance(ref[name], Spread) else ref[name]["median"]
        if b > 0 and a < floor * b:
            out.append(f"{name.upper()} {a / b:.2f}x the reference's ({a:.1f} vs {b:.1f} t/s)")
    return out


def same_verdict(pick: str | None, full: dict[str, Any]) -> bool:
    """Whether a full confirmation (every contender, every round) agrees with a quicker one's `pick`: the same
    contender, or one the full run serves within the full pick's spread (its median no slower than the full pick's
    slowest sample) and, a finalist, within the budget there."""
    if pick is None or pick == full.get("pick"):
        return pick is not None
    res = {r["key"]: r for r in full.get("results", [])}
    mine, best = res.get(pick), res.get(full.get("pick") or "")
    if mine is None or best is None or not mine["request_s"]["samples"]:
        return False
    budget = full.get("budget_bytes") or {}
    if "reference" not in mine["roles"] and any(b > budget.get(d, math.inf)
                                                for d, b in mine["vram_device_bytes"].items()):
        return False
    return mine["request_s"]["median"] <= best["request_s"]["hi"]


def waiting_finalists(record: dict[str, Any]) -> list[str]:
    """The finalists a partial record (cut off mid-confirmation) has not served yet: while any is left, the
    record gives no verdict."""
    if not record.get("partial"):
        return []
    return [r["name"] for r in record.get("results", [])
            if "finalist" in r["roles"] and not r["request_s"]["samples"] and not r["errors"]]


def headline(record: dict[str, Any]) -> str:
    """The first line a report and --json give: the pick against the reference on the workload, and what it gives
    up (said first, when it gives anything up)."""
    res = {r["key"]: r for r in record.get("results", [])}
    ref, pick = res.get(record.get("reference") or ""), res.get(record.get("pick") or "")
    if ref is None or pick is None:
        return f"{record.get('workload')}: no served result (every server run failed; see the rows)"
    t_ref, t_pick = ref["request_s"]["median"], pick["request_s"]["median"]
    vram = sum(pick["vram_device_bytes"].values())
    waiting = waiting_finalists(record)
    if waiting:       # cut off before every finalist ran: no verdict to give yet
        best = min(record["results"], key=lambda r: r["request_s"]["median"] if r["request_s"]["samples"]
                   else math.inf)
        return (f"{record['workload']}: partial, no verdict yet ({', '.join(waiting)} not served); so far "
                f"{best['name']} is the fastest, {best['request_s']['median']:.2f} s mean request")
    if pick is ref and not any("finalist" in r["roles"] for r in record["results"]):
        text = (f"{record['workload']}: keep {ref['name']}, the fastest of --fit's variants: {t_ref:.2f} s mean "
                f"request ({fmt_bytes(vram)} VRAM); no finalist was served (none of the search's runs finished)")
    elif pick is ref:
        within = f" within the {record['ttft_limit_s']:g} s TTFT limit" if record.get("pick_meets_ttft") else ""
        text = (f"{record['workload']}: keep {ref['name']}: no finalist{within} answered faster than its {t_ref:.2f} s "
                f"mean request ({fmt_bytes(vram)} VRAM)")
    else:
        sp = record.get("speedup") or {}
        text = (f"{record['workload']}: {pick['name']} answers in {t_pick:.2f} s mean, {ref['name']} in {t_ref:.2f} s: "
                f"{t_ref / t_pick:.2f}x ({sp.get('verdict', '?')}), at {fmt_bytes(vram)} VRAM "
                f"(reference {fmt_bytes(sum(ref['vram_device_bytes'].values()))})")
    first = []
    if record.get("pick_meets_ttft") is False:
        worst = (pick.get("ttft_max_s") or pick["ttft_s"])["median"]
        first.append(f"misses the {record['ttft_limit_s']:g} s TTFT limit (no contender met it; slowest class "
                     f"{worst:.2f} s)")
    if record.get("gives_up"):
        first.append(f"gives up {'; '.join(record['gives_up'])}")
    return "; ".join(first) + ": " + text if first else text
