"""Stopping `tune` and `run` while an engine runs (issue 43, item 5): Ctrl-C (SIGINT), SIGTERM and SIGHUP end
the run at once, the --fit reference's included, with the resume line and exit 128 + the signal; and neither
those nor kill -9 leave any process of the engine's group behind, not even what a wrapper script started.

The llama-bench here is a wrapper script: `--help` and `--version` go to the real CPU llama-bench (the engine
probes them), every other call starts `sleep 1000` as the wrapper's own child and waits for it: a run that would
hold the study until its --timeout (900 s by default). A study's first run is the --fit reference
(tuner/baselines.py), so the stop lands there."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from survivors import kill_all, marked, new_mark, survivors

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.llamacpp,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts processes in /proc")]
STOPS = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}
RESUME = "run the same command to resume"


@pytest.fixture
def wrapped(llama_bench, tmp_path) -> tuple[Path, Path]:
    """(the wrapper script named llama-bench, a tiny model)."""
    from runtime.synth import tiny_spec, uniform_recipe, write_gguf
    folder = tmp_path / "bin"
    folder.mkdir()
    wrapper = folder / "llama-bench"
    wrapper.write_text("#!/bin/sh\n"
                       'case " $* " in *" --help "*|*" -h "*|*" --version "*) exec ' + f"'{llama_bench}'" + ' "$@";;\n'
                       "esac\n"
                       "sleep 1000 &\n"
                       "wait\n")
    wrapper.chmod(0o755)
    model = write_gguf(tmp_path / "tiny.gguf", tiny_spec("qwen3moe", n_layer=4, n_expert=4, n_expert_used=2),
                       uniform_recipe("Q4_0"))[0]
    return wrapper, model


def _start(argv: list[str], cwd: Path, mark: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "offload_tuner.cli", *argv], cwd=cwd,
                            env={**os.environ, **mark, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _wait_for_sleep(mark: dict[str, str], proc: subprocess.Popen, timeout_s: float = 120) -> None:
    """Until the wrapper's own child (`sleep 1000`: the engine's run) is up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(cmd.startswith("sleep 1000") for cmd in marked(mark).values()):
            return
        if proc.poll() is not None:
            pytest.fail(f"offload-tuner ended ({proc.returncode}) before its run: {proc.stderr.read()[-2000:]}")
        time.sleep(0.02)
    pytest.fail(f"no run started in {timeout_s} s")


def _stop(proc: subprocess.Popen, sig: int, mark: dict[str, str]) -> tuple[float, str]:
    """Send SIG; (seconds until offload-tuner ended, its stderr); nothing of the mark may be left running."""
    t0 = time.monotonic()
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"offload-tuner still running 60 s after {signal.Signals(sig).name}")
    took = time.monotonic() - t0
    left = survivors(mark, wait_s=5)
    assert not left, f"left running after {signal.Signals(sig).name}: {left}"
    return took, err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGKILL],
                         ids=lambda s: signal.Signals(s).name)
def test_a_stop_during_the_fit_reference_is_at_once_resumable_and_leaves_nothing(sig, wrapped, tmp_path):
    wrapper, model = wrapped
    mark = new_mark()
    db = tmp_path / "s.db"
    proc = _start(["tune", str(model), "--engine", "llamacpp", "--llama-bench", str(wrapper), "--cpu-stand-in",
                   "--gpu", "1GiB", "--keep-free", "0", "--trials", "2", "--n-prompt", "16", "--n-gen", "4",
                   "--reps", "1", "--study", "s", "--storage", f"sqlite:///{db}", "--no-report", "--quiet",
                   "--space", "full"],         # no thread probe: the --fit reference is the study's first run
                  tmp_path, mark)
    try:
        _wait_for_sleep(mark, proc)
        took, err = _stop(proc, sig, mark)
        if sig == signal.SIGKILL:           # no handler runs: the reaper ends the wrapper's group
            assert proc.returncode == -signal.SIGKILL
            return
        assert took < 5, f"{took:.1f} s to stop"
        assert proc.returncode == STOPS[sig], err
        lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("#")]
        assert len(lines) == 1 and lines[0].startswith("offload-tuner: interrupted;") and RESUME in lines[0], err
        assert "Traceback" not in err
        import optuna
        study = optuna.load_study(study_name="s", storage=f"sqlite:///{db}")      # resumable: there, nothing RUNNING
        assert not [t for t in study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.RUNNING]
    finally:
        kill_all([proc.pid, *marked(mark)])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: signal.Signals(s).name)
def test_run_stopped_by_a_signal_ends_the_wrappers_group(sig, wrapped, tmp_path):
    wrapper, model = wrapped
    mark = new_mark()
    proc = _start(["run", str(model), "--engine", "llamacpp", "--llama-bench", str(wrapper), "--", "-ngl", "0",
                   "-p", "16", "-n", "4", "-r", "1"], tmp_path, mark)
    try:
        _wait_for_sleep(mark, proc)
        took, err = _stop(proc, sig, mark)
        assert took < 5 and proc.returncode == STOPS[sig], (took, proc.returncode, err)
        assert err.strip().splitlines()[-1] == "offload-tuner: interrupted" and "Traceback" not in err
    finally:
        kill_all([proc.pid, *marked(mark)])
