"""A tune says it is still running when nothing was said for STILL_RUNNING_S (30 s) and no progress bar shows the
time: a llama-bench run of a big model takes minutes, a log (the service's workers, a redirected stderr) would
otherwise stay silent. The thread that says so ends with the tune."""
from __future__ import annotations

import logging
import time

from offload_tuner.cli import tune as tune_cli


def _wait_for(cond, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)
    return cond()


def test_silence_is_broken_by_a_still_running_line_and_a_line_resets_it(monkeypatch, caplog):
    monkeypatch.setattr(tune_cli, "STILL_RUNNING_S", 0.3)
    monkeypatch.setattr(tune_cli, "TICK_S", 0.02)
    caplog.set_level(logging.INFO, logger="offload_tuner")

    def still() -> list[str]:
        return [r.getMessage() for r in caplog.records if "still running" in r.getMessage()]
    console = tune_cli._Console(40, quiet=True)              # no bar: as where stderr is not a terminal
    try:
        assert _wait_for(lambda: len(still()) == 1)
        assert still()[0].startswith("# tune: still running, 0 s in; 0 of 40 runs done"), still()
        console.note("# a line of the tune's own")
        time.sleep(0.15)                                      # under 0.3 s since that line: nothing more
        assert len(still()) == 1
        assert _wait_for(lambda: len(still()) == 2)           # 0.3 s of silence again
    finally:
        console.close()
    console.ticker.join(timeout=5)
    n = len(caplog.records)
    time.sleep(0.4)
    assert len(caplog.records) == n and not console.ticker.is_alive()     # over with the tune


def test_minutes_read_as_minutes():
    assert tune_cli._minutes(12.4) == "12 s" and tune_cli._minutes(130) == "2 min 10 s"


def test_the_line_says_what_is_left_and_how_long_at_this_pace():
    assert tune_cli.still_running_line(130, 10, 40) == ("# tune: still running, 2 min 10 s in; 10 of 40 runs done; "
                                                        "about 6 min 30 s more at this pace")
    assert tune_cli.still_running_line(30, 0, 40) == "# tune: still running, 30 s in; 0 of 40 runs done"
