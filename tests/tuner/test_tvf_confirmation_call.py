"""benchmarks/tune_vs_fit.py's rule that every ratio comes from one device call (issue 10): a confirmation that a
call left unfinished is not continued by the next call, it is run again whole there (when one call can hold it),
and the earlier samples are kept aside. Found on the H100: a 16 GiB study's confirmation spanned two calls."""
from __future__ import annotations

import argparse
import time

import pytest

from planner.hardware import load_hardware
from planner.presets import load_preset
from runtime.sim import SimEngine


def _cell(tmp_path):
    """A 16 GiB sim cell as tune_vs_fit runs one: the model, the machine, the engine, the cell's arguments."""
    inv = load_preset("Qwen3-30B-A3B:Q4_K_M").inventory()
    hw = load_hardware("gpu-box")
    engine = SimEngine(hw.with_vram([16 * 2**30]))
    args = argparse.Namespace(n_prompt=512, n_gen=16, reps=1, storage=f"sqlite:///{tmp_path / 's.db'}", seed=0,
                              pool=20, runs=14, confirm=2, series="")
    return inv, hw, engine, args


@pytest.mark.slow          # two sim studies (~5 s on 2 cores): make test runs it, make test-fast does not
def test_a_confirmation_left_by_an_earlier_call_runs_again_whole(tmp_path, bench_script):
    tvf = bench_script("tune_vs_fit")
    inv, hw, engine, args = _cell(tmp_path)
    far = time.monotonic() + 3600
    assert tvf.run_cell(args, engine, inv, hw, 16, 0, far, confirm_run_s=1.0, call_s=500)
    import optuna
    study = optuna.load_study(study_name="tvf-16g-d0", storage=args.storage)
    whole = study.user_attrs["confirmation"]["rows"]
    # as a call cut off in its confirmation leaves the study: some rows, nothing confirmed
    study.set_user_attr("confirmation", {**study.user_attrs["confirmation"], "rows": whole[:2]})
    study.set_user_attr("confirmed", None)
    assert tvf.run_cell(args, engine, inv, hw, 16, 0, far, confirm_run_s=1.0, call_s=500)
    assert study.user_attrs["confirmation_earlier_call"]["rows"] == whole[:2]
    again = study.user_attrs["confirmation"]["rows"]
    assert len(again) == len(whole) and study.user_attrs["confirmed"]
    # a confirmation longer than one call can hold goes on where it stopped (else no call would ever end it)
    study.set_user_attr("confirmation", {**study.user_attrs["confirmation"], "rows": again[:2]})
    study.set_user_attr("confirmed", None)
    study.set_user_attr("confirmation_earlier_call", None)
    assert tvf.run_cell(args, engine, inv, hw, 16, 0, far, confirm_run_s=1000.0, call_s=500)
    assert not study.user_attrs["confirmation_earlier_call"]
    assert study.user_attrs["confirmation"]["rows"][:2] == again[:2]


@pytest.mark.slow
def test_a_cell_saves_after_each_phase_and_starts_no_sample_that_would_end_past_the_deadline(tmp_path, bench_script,
                                                                                            monkeypatch):
    """On the H100 (2026-11-24) a call's confirmation ran past --time-budget into the device's kill, and with it
    the cell's baselines and search, never saved: a cell checkpoints after its baselines, its search and each
    confirmation sample, and a sample whose contender's stored run would end past the deadline is not started."""
    tvf = bench_script("tune_vs_fit")
    from tuner import confirm
    inv, hw, engine, args = _cell(tmp_path)
    saves = []
    far = time.monotonic() + 3600
    assert tvf.run_cell(args, engine, inv, hw, 16, 0, far, confirm_run_s=1.0, call_s=500,
                        checkpoint=lambda: saves.append(1))
    import optuna
    study = optuna.load_study(study_name="tvf-16g-d0", storage=args.storage)
    rows = study.user_attrs["confirmation"]["rows"]
    assert len(saves) == 2 + len(rows)          # baselines, search, every sample
    # a confirmation spanning calls, its next sample ~100 s, 50 s left: nothing starts, the call says so
    study.set_user_attr("confirmation", {**study.user_attrs["confirmation"], "rows": rows[:2]})
    study.set_user_attr("confirmed", None)
    monkeypatch.setattr(confirm, "contender_seconds", lambda tuner, c, reps: 100.0)
    assert not tvf.run_cell(args, engine, inv, hw, 16, 0, time.monotonic() + 50, confirm_run_s=100.0, call_s=300)
    assert study.user_attrs["confirmation"]["rows"] == rows[:2] and not study.user_attrs["confirmed"]
    # with the time for it, the same call goes on from there
    assert tvf.run_cell(args, engine, inv, hw, 16, 0, far, confirm_run_s=100.0, call_s=300)
    assert study.user_attrs["confirmation"]["rows"][:2] == rows[:2] and study.user_attrs["confirmed"]
