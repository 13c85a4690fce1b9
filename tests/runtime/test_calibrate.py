"""offload-tuner calibrate: host terms measured here, GPU terms where CUDA exists; the JSON loads as --hardware."""
from __future__ import annotations

import json

from planner.hardware import LLAMACPP_SHARES, load_hardware
import pytest

from offload_tuner.cli import main
from runtime.calibrate import busy_note, calibrate_profile, merge_sweeps, sweep_spread


def test_calibrate_writes_a_profile_that_hardware_accepts(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr("runtime.calibrate.SWEEP_PAUSE_S", 0.0)   # 8 MiB sweeps need no settling
    out = tmp_path / "hw.json"
    assert main(["calibrate", "--out", str(out), "--size", "8MiB", "--threads", "1"]) == 0
    profile = load_hardware(str(out))
    assert profile.host.mem_bw > 0 and profile.host.flops > 0 and profile.host.n_threads == 1
    for key, share in LLAMACPP_SHARES.items():     # llama.cpp's shares of the ceilings: not measurable here
        assert getattr(profile.overheads, key) == share
    raw = json.loads(out.read_text())["calibration"]
    assert raw["host"]["copy_bytes_per_s"] > 0
    printed = capsys.readouterr().out
    if raw["gpu"] == "absent":
        assert profile.gpus == () and "gpu: absent" in printed
    else:
        assert profile.gpus[0].mem_bw > 0 and profile.link.h2d_pinned > 0
        assert profile.overheads.sync_s > 0 and profile.link.copy_call_s >= 0
    # two sweeps by default: merged, their spread reported
    assert raw["sweeps"] == 2 and len(raw["load_before"]) == 2
    assert set(raw["sweep_spread"]["host"]) == {"gemv_bytes_per_s", "copy_bytes_per_s", "gemm_flops_b512"}
    assert "2 sweeps, ceilings spread" in printed


def test_sweeps_merge_best_ceiling_and_median_times() -> None:
    a = {"name": "H100", "threads": 16.0, "gemv_bytes_per_s": 100.0, "gemv_bytes_per_s_median": 90.0,
         "gemm_flops": 7.0, "launch_s": 5e-6, "vram_bytes": 80}
    b = {**a, "gemv_bytes_per_s": 120.0, "gemv_bytes_per_s_median": 80.0, "gemm_flops": 6.0, "launch_s": 9e-6}
    c = {**a, "gemv_bytes_per_s": 110.0, "gemv_bytes_per_s_median": 85.0, "launch_s": 6e-6}
    m = merge_sweeps([a, b, c])
    # a ceiling is the best sweep's, a median or a per-op time the median sweep's, the rest the first's
    assert m == {"name": "H100", "threads": 16.0, "gemv_bytes_per_s": 120.0, "gemv_bytes_per_s_median": 85.0,
                 "gemm_flops": 7.0, "launch_s": 6e-6, "vram_bytes": 80}
    assert sweep_spread([a, b, c], ("gemv_bytes_per_s", "gemm_flops")) == pytest.approx(
        {"gemv_bytes_per_s": 0.2, "gemm_flops": 7 / 6 - 1})


def test_busy_host_is_named() -> None:
    assert busy_note([{"load1": 1.0, "cpus": 16.0}, {"load1": 3.9, "cpus": 16.0}]) == ""
    note = busy_note([{"load1": 1.0, "cpus": 16.0}, {"load1": 12.5, "cpus": 16.0}])
    assert note.startswith("1-minute load 12.5 on 16 CPUs") and "idle" in note


def test_calibrate_says_what_it_measures_and_minds_q(capsys, monkeypatch) -> None:
    # minutes of measuring at the default 1 GiB: a line per sweep and stage on stderr, none with -q
    argv = ["calibrate", "--size", "8MiB", "--threads", "1", "--sweeps", "1"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "# calibrate: sweep 1 of 1 (8.00 MiB per bandwidth test" in err and "#   host: GEMV" in err
    assert "#   host: copy, GEMM" in err
    assert main(["-q", *argv]) == 0
    assert capsys.readouterr().err == ""
    main(["calibrate", "--sweeps", "0"])     # a later main in this process: logging at its default again
    capsys.readouterr()


def test_bad_sweeps_is_one_line(capsys) -> None:
    from planner.errors import InputError
    with pytest.raises(InputError, match="--sweeps 0"):
        calibrate_profile(sweeps=0)
    assert main(["calibrate", "--sweeps", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--sweeps 0" in err
