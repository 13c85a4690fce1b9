"""Confirmation: re-measure a study's finalists and the engine's own `--fit` interleaved, and judge by the median.

A study picks its winners from one run each, and two runs of one config on these machines differ by 10% or more
between machines and by a few percent within one. So before a study reports, its finalists and the `--fit`
baseline are run again in rounds, A B C A B C ..., the order rotated each round (no contender always runs first,
after a cold GPU), and each is summarised by the median of its samples with their spread. A finalist whose edge
over `--fit` is inside the noise of either side is a tie, not a win.

    # C contenders, R rounds: R x C engine runs, samples[c] = R values of TG and of PP

`confirmed_record` turns the samples into what studies store and report: medians, spreads, ratios to --fit (and
to --fit's placement in a server) with their verdicts, and the picks by median.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Literal
from collections.abc import Sequence

Verdict = Literal["win", "tie", "loss"]
CONFIRM_ROUNDS = 3        # interleaved re-measurements of each finalist and of --fit
NOISY_CV = 0.05           # a measurement whose repetitions vary more than this is flagged in the report
MIN_NOISE = 0.01          # never call an edge under 1% a win, however tight the samples
BALANCED_PP = 1.5         # "balanced": the best TG among configs with at least this x --fit's PP


@dataclass(frozen=True)
class Spread:
    """Samples of one speed: median, range and coefficient of variation."""
    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return float(statistics.median(self.samples)) if self.samples else 0.0

    @property
    def lo(self) -> float:
        return min(self.samples) if self.samples else 0.0

    @property
    def hi(self) -> float:
        return max(self.samples) if self.samples else 0.0

    @property
    def cv(self) -> float:
        """Standard deviation over mean (0 for fewer than two samples)."""
        if len(self.samples) < 2:
            return 0.0
        mean = statistics.fmean(self.samples)
        return statistics.stdev(self.samples) / mean if mean > 0 else 0.0

    @property
    def rel_range(self) -> float:
        """(max - min) / median: how far apart the samples are, as a share."""
        m = self.median
        return (self.hi - self.lo) / m if m > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"samples": list(self.samples), "median": self.median, "lo": self.lo, "hi": self.hi, "cv": self.cv}


@dataclass(frozen=True)
class Contender:
    """One config to re-measure: a trial's plan (by trial number) or the engine's own --fit (by arguments)."""
    key: str                          # "fit", "fit-server", "ncmoe" or "trial:N"
    name: str                         # what the report calls it
    roles: tuple[str, ...] = ()       # "fit", "fit_server", "ncmoe", "best_tg", "balanced", "runner_up"
    trial: int | None = None


@dataclass(frozen=True)
class Confirmed:
    """A contender after the rounds: its speeds and peak VRAM over every sample, failures kept."""
    contender: Contender
    tg: Spread
    pp: Spread
    vram_bytes: int                   # the largest peak over its runs, all GPUs
    run_cv: tuple[float, ...] = ()    # each run's own coefficient of variation over its repetitions (worst of TG/PP)
    errors: tuple[str, ...] = ()
    seen: tuple[str, ...] = ()        # what the engine saw around noisy runs (other GPU processes, clocks, load)
    vram_device_bytes: dict[str, int] = field(default_factory=dict)   # the largest peak over its runs, per GPU

    @property
    def ok(self) -> bool:
        return bool(self.tg.samples or self.pp.samples)

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.contender.key, "name": self.contender.name, "roles": list(self.contender.roles),
                "trial": self.contender.trial, "tg": self.tg.to_dict(), "pp": self.pp.to_dict(),
                "vram_bytes": self.vram_bytes, "vram_device_bytes": dict(self.vram_device_bytes),
                "run_cv": list(self.run_cv), "noisy": self.noisy,
                "errors": list(self.errors), "seen": list(self.seen)}

    @property
    def noisy(self) -> bool:
        return any(cv > NOISY_CV for cv in self.run_cv) or self.tg.cv > NOISY_CV or self.pp.cv > NOISY_CV


@dataclass(frozen=True)
class Ratio:
    """A contender against --fit on one speed: the ratio of medians and whether it is outside the noise."""
    ratio: float
    noise: float
    verdict: Verdict

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compare(a: Spread, ref: Spread) -> Ratio | None:
    """a against ref (both medians); a tie when the edge is within the larger relative range of the two
    (at least MIN_NOISE). None when either side has no sample."""
    if not a.samples or not ref.samples or ref.median <= 0:
        return None
    ratio = a.median / ref.median
    noise = max(a.rel_range, ref.rel_range, MIN_NOISE)
    verdict: Verdict = "win" if ratio > 1 + noise else "loss" if ratio < 1 - noise else "tie"
    return Ratio(ratio, noise, verdict)


def schedule(contenders: Sequence[Contender], rounds: int) -> list[tuple[int, Contender]]:
    """The interleaved order: round r runs every contender once, starting r places further along."""
    n = len(contenders)
    return [(r, contenders[(r + i) % n]) for r in range(rounds) for i in range(n)]


@dataclass
class SampleLog:
    """Samples as they come (stored after each run, so a killed confirmation resumes where it stopped)."""
    rows: list[dict[str, Any]] = field(default_factory=list)

    def done(self, rnd: int, key: str) -> bool:
        return any(r["round"] == rnd and r["key"] == key for r in self.rows)

    def add(self, rnd: int, key: str, m: dict[str, Any]) -> None:
        self.rows.append({"round": rnd, "key": key, **m})

    def summarise(self, c: Contender) -> Confirmed:
        mine = [r for r in self.rows if r["key"] == c.key]
        good = [r for r in mine if r.get("ok")]
        return Confirmed(
            c, Spread(tuple(r["tg_tps"] for r in good if r.get("tg_tps"))),
            Spread(tuple(r["pp_tps"] for r in good if r.get("pp_tps"))),
            max((sum((r.get("peak_bytes") or {}).values()) for r in good), default=0),
            tuple(r["cv"] for r in good if r.get("cv") is not None),
            tuple(r.get("error", "") for r in mine if not r.get("ok")),
            tuple(dict.fromkeys(r["seen"] for r in good if r.get("seen") and (r.get("cv") or 0) > NOISY_CV)),
            _per_device_max(r.get("peak_bytes") or {} for r in good))


def _per_device_max(peaks) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in peaks:
        for d, b in p.items():
            out[d] = max(out.get(d, 0), int(b))
    return dict(sorted(out.items()))


def vram_of(measured: dict[str, Any]) -> int:
    """The VRAM a stored measurement stands for: its peaks at the emitted context, else as measured, all GPUs."""
    return sum((measured.get("peak_at_ctx") or measured.get("peak_bytes") or {}).values())


def confirmed_record(results: list[Confirmed], rounds: int) -> dict[str, Any]:
    """Each contender's medians and spreads, its ratios to the reference (win / tie / loss), and the picks by
    median: the best TG at no more VRAM than the reference, and the best TG with >= BALANCED_PP x its PP."""
    ref = next((r for r in results if "fit" in r.contender.roles), None)
    server = next((r for r in results if "fit_server" in r.contender.roles), None)
    rows = []
    for r in results:
        d = r.to_dict()
        for tag, base in (("fit", ref), ("fit_server", server)):
            if base is not None and r is not base:
                for name, a, b in (("tg", r.tg, base.tg), ("pp", r.pp, base.pp)):
                    cmp = compare(a, b)
                    d[f"{name}_vs_{tag}"] = cmp.to_dict() if cmp else None
                d[f"vram_vs_{tag}"] = r.vram_bytes / base.vram_bytes if base.vram_bytes else None
        rows.append(d)
    # baselines measured beside --fit (the best -ncmoe, role "ncmoe") get ratios, never a pick
    others = [r for r in results if r is not ref and r is not server and r.tg.samples
              and "ncmoe" not in r.contender.roles]
    picks: dict[str, Any] = {}
    cap = ref.vram_bytes if ref is not None and ref.vram_bytes else math.inf
    tg_ok = [r for r in others if r.vram_bytes <= cap]
    if tg_ok:
        picks["best_tg"] = max(tg_ok, key=lambda r: r.tg.median).contender.key
    elif others:      # nothing at or under the reference's VRAM: the fastest, named so
        picks["best_tg_over_fit_vram"] = max(others, key=lambda r: r.tg.median).contender.key
    floor = BALANCED_PP * ref.pp.median if ref is not None else 0.0
    bal = [r for r in others if r.pp.median >= floor]
    if bal:
        picks["balanced"] = max(bal, key=lambda r: r.tg.median).contender.key
    return {"rounds": rounds, "results": rows, "picks": picks, "reference": ref.contender.key if ref else None}
