"""A server run says it is still running at least every STILL_RUNNING_S (30 s; on an H200 a 30B model's run took
60-120 s, a 235B model's minutes), and stops saying so when it ends."""
from __future__ import annotations

import time

from planner.engine_contract import Measurement
from tuner import served
from tuner.served import THRIFT, confirm_served, still_running

from test_served_thrift import StandIn, _study  # noqa: E402  (the sim rag study and its stand-in server)


def test_a_line_every_interval_while_the_block_runs_and_none_after():
    lines: list[str] = []
    with still_running(lines.append, "# served 3: trial 1, round 1 of 2: running", 61.4, every_s=0.05):
        time.sleep(0.18)
    n = len(lines)
    time.sleep(0.15)
    assert n >= 2 and len(lines) == n                      # none once the block is over
    assert all(x.startswith("# served 3: trial 1, round 1 of 2: running, ") and x.endswith(
        " s so far (the last like it took 61 s)") for x in lines), lines


class SlowStandIn(StandIn):
    """The stand-in server, each run taking 0.25 s."""

    def measure_workload(self, *a, **k) -> Measurement:
        time.sleep(0.25)
        return super().measure_workload(*a, **k)

    def fit_reference(self, *a, **k) -> Measurement:
        time.sleep(0.25)
        return super().fit_reference(*a, **k)


def test_the_served_stage_says_a_run_is_still_running(tmp_path, monkeypatch):
    monkeypatch.setattr(served, "STILL_RUNNING_S", 0.1)
    lines: list[str] = []
    _, t = _study(tmp_path)
    confirm_served(t.measurer, SlowStandIn(t, left=700 << 20), n_finalists=1, thrift=THRIFT,
                   deadline=time.monotonic() + 3600, say=lines.append)
    running = [i for i, x in enumerate(lines) if x.startswith("# served 1: --fit, round 1 of 2: running, ")]
    ended = [i for i, x in enumerate(lines) if x.startswith("# served 1: --fit, round 1 of 2: loaded in ")]
    assert running and ended and max(running) < ended[0], lines    # said while it ran, before how it went
    assert sum(": running, " in x for x in lines) >= 3              # every run says so: 0.25 s each, a line per 0.1 s
