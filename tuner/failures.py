"""Why runs failed, in a few words: failed runs' errors counted by kind (crashed, timed out, out of memory, other)
with their commonest reasons, for the end of a study whose every run failed (RunsFailed: it names the real cause
rather than asking for more GPU memory when the runs crashed) and for the report of a study without a finished
trial (no_result_text: what the study holds).

The kinds follow the engines' failure texts (runtime/llamacpp_output.py classify_failure: "crashed with SIGSEGV:
...", "timed out after ...", "out of memory: ..."; the sim's "out of memory on CUDA0 ..."); a measured peak over
the budget (tuner.margin) is a memory failure too."""
from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from planner.errors import InputError

OOM = re.compile(r"out of memory|\boom\b|cudaMalloc|failed to allocate|CUBLAS_STATUS_ALLOC_FAILED", re.I)
MEMORY = "out of memory"
KINDS = ("crashed", "timed out", "failed", MEMORY)     # the order a message names them in
REASON_CHARS = 120


class RunsFailed(InputError):
    """Every run of a study failed, and not (only) for memory: the message counts the failures by kind."""


def failure_kind(error: str) -> str:
    """One of KINDS for a failed run's error text."""
    e = (error or "").strip()
    if e.startswith("crashed with"):          # before OOM: a SIGKILL's text mentions the host's memory
        return "crashed"
    if e.startswith("timed out"):
        return "timed out"
    if OOM.search(e) or "over the budget" in e:
        return MEMORY
    return "failed"


def _reason(kind: str, error: str) -> str:
    e = " ".join((error or "").split()) or "no error message"
    if kind == "crashed":
        e = e[len("crashed with"):].strip() or e
    return e if len(e) <= REASON_CHARS else e[:REASON_CHARS - 3] + "..."


@dataclass(frozen=True)
class Failures:
    """Failed runs' reasons by kind (KINDS), each list in the order the runs failed."""
    by_kind: dict[str, list[str]]

    @classmethod
    def of(cls, errors: Iterable[str]) -> Failures:
        out: dict[str, list[str]] = {k: [] for k in KINDS}
        for e in errors:
            kind = failure_kind(e)
            out[kind].append(_reason(kind, e))
        return cls(out)

    def count(self, kind: str) -> int:
        return len(self.by_kind.get(kind, []))

    @property
    def total(self) -> int:
        return sum(len(v) for v in self.by_kind.values())

    def text(self) -> str:
        """E.g. "12 crashed (SIGSEGV: ggml_cuda_error ...), 0 out of memory": each kind that happened with its
        commonest reasons (two at most), and always the out-of-memory count."""
        parts = []
        for kind in KINDS:
            reasons = self.by_kind.get(kind, [])
            if not reasons:
                if kind == MEMORY:
                    parts.append(f"0 {MEMORY}")
                continue
            common = Counter(reasons).most_common()
            shown = [(f"{n}x " if n > 1 and len(common) > 1 else "") + r for r, n in common[:2]]
            more = f"; {len(common) - 2} other reasons" if len(common) > 2 else ""
            parts.append(f"{len(reasons)} {kind} ({'; '.join(shown)}{more})")
        return ", ".join(parts)


def run_failures(study: Any) -> Failures:
    """The failures of the study's trials that ran (a measurement stored, not ok)."""
    from optuna.trial import TrialState

    from .records import TrialRecord
    errors = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,)):
        m = TrialRecord.from_trial(t).measured
        if m is not None and not m.ok:
            errors.append(m.error)
    return Failures.of(errors)


def check_some_run_worked(study: Any, storage: str | None) -> None:
    """RunsFailed when the study has no complete trial, some of its runs failed and not every failure was memory:
    the message names the real cause (crashes, time limits, ...) and counts the out-of-memory ones. A study whose
    failures are all memory (or that ran nothing) passes: its caller's "no config fitted" is the right advice."""
    from optuna.trial import TrialState
    if study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        return
    f = run_failures(study)
    if not f.total or f.count(MEMORY) == f.total:
        return
    from .storage import shown_url, sqlite_path
    name = getattr(study, "study_name", "")
    shown = storage if storage and sqlite_path(storage) else shown_url(storage or "")     # no password shown
    see = f"; each trial's error: offload-tuner report {name} --storage {shown}" if storage else ""
    oom = (" (for the out-of-memory ones: more --gpu memory, a smaller --keep-free or a smaller --margin)"
           if f.count(MEMORY) else "")
    raise RunsFailed(f"every run failed, none completed: {f.text()}{oom}{see}")


def no_result_text(counts: dict[str, int], errors: list[str]) -> str | None:
    """What a study without a complete trial holds, e.g. "no finished trial: 0 complete, 2 waiting, 1 running,
    3 failed; the failures: 3 crashed (SIGSEGV: ...), 0 out of memory"; None when a trial completed."""
    if counts.get("complete"):
        return None
    held = [f"{counts.get(state, 0)} {word}" for state, word in
            (("complete", "complete"), ("waiting", "waiting"), ("running", "running"), ("fail", "failed"))]
    held += [f"{n} {state}" for state, n in sorted(counts.items())
             if state not in ("complete", "waiting", "running", "fail") and n]
    text = "no finished trial: " + ", ".join(held)
    n = sum(counts.values())
    if not n:
        return text + " (the study holds no trial yet)"
    if errors:
        every = "every trial failed" if counts.get("fail") == n else "the failures"
        text += f"; {every}: {Failures.of(errors).text()}"
    if counts.get("waiting") or counts.get("running"):
        text += ("; a tune worker on this study runs the waiting trials (and fails and retries one left running "
                 "by a worker that died)")
    return text
