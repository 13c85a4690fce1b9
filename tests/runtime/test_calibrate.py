"""offload-tuner calibrate: host terms measured here, GPU terms where CUDA exists; the JSON loads as --hardware."""
from __future__ import annotations

import argparse
import json

from planner.hardware import LLAMACPP_SHARES, load_hardware
from runtime.calibrate import add_calibrate_arguments, calibrate_main


def test_calibrate_writes_a_profile_that_hardware_accepts(tmp_path, capsys) -> None:
    ap = argparse.ArgumentParser()
    add_calibrate_arguments(ap)
    out = tmp_path / "hw.json"
    assert calibrate_main(ap.parse_args(["--out", str(out), "--size", "8MiB", "--threads", "1"])) == 0
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
