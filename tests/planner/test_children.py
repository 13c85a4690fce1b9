"""Every process the tuner starts dies with it, kill -9 included (planner/children.py: its own process group, and
PR_SET_PDEATHSIG on Linux). A real `tune` on the CPU llama-bench is killed with SIGKILL while llama-bench runs,
and the processes it left are counted; the same for a plain parent of children.popen and children.run, and for a
child that is a wrapper script with a child of its own (the reaper ends the wrapper's whole group)."""
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
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def _wait_for(mark: dict[str, str], word: str, proc: subprocess.Popen, timeout_s: float = 120,
              has: str = "") -> dict[int, str]:
    """The marked processes once the program `word` runs with `has` in its command line (fails if the parent
    ends first)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        procs = marked(mark)
        if any(_program(cmd) == word and has in cmd for cmd in procs.values()):
            return procs
        assert proc.poll() is None, f"the parent ended ({proc.returncode}) before {word} started"
        time.sleep(0.01)
    pytest.fail(f"no {word} started in {timeout_s} s")


def _program(cmd: str) -> str:
    """The program a command line runs (a child forked but not yet exec'd still shows its parent's)."""
    return Path(cmd.split(" ", 1)[0]).name


@pytest.mark.parametrize("how", ["popen", "run"])
def test_a_child_dies_with_its_parent_killed_with_sigkill(how):
    mark = new_mark()
    code = ("import subprocess, sys\nfrom planner import children\n"
            f"children.{how}(['sleep', '300'], stdin=subprocess.DEVNULL)\n"
            "if sys.argv[0]: children.run(['sleep', '300'])\n")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **mark,
                                                                          "PYTHONPATH": str(ROOT)})
    try:
        procs = _wait_for(mark, "sleep", parent, 60)
        child = next(pid for pid, cmd in procs.items() if _program(cmd) == "sleep")
        assert os.getpgid(child) == child          # its own process group: ended whole by kill_group
        parent.kill()
        parent.wait(10)
        left = survivors(mark)
        assert not left, f"left running after kill -9 of their parent: {left}"
    finally:
        kill_all([parent.pid, *marked(mark)])


@pytest.mark.parametrize("how", ["popen", "run"])
def test_what_a_wrapper_started_dies_with_its_parent_killed_with_sigkill(how, tmp_path):
    """A child that starts its own child (a wrapper script around llama-bench): PR_SET_PDEATHSIG ends the wrapper
    only; the reaper (planner/children.py) ends the rest of its process group."""
    wrapper = tmp_path / "wrapper"
    wrapper.write_text("#!/bin/sh\nsleep 301 &\nwait\n")
    wrapper.chmod(0o755)
    mark = new_mark()
    code = f"import time\nfrom planner import children\nchildren.{how}([{str(wrapper)!r}])\ntime.sleep(300)\n"
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **mark,
                                                                          "PYTHONPATH": str(ROOT)})
    try:
        procs = _wait_for(mark, "sleep", parent, 60)
        assert any("wrapper" in cmd for cmd in procs.values())
        parent.kill()
        parent.wait(10)
        left = survivors(mark)
        assert not left, f"left running after kill -9 of their grandparent: {left}"
    finally:
        kill_all([parent.pid, *marked(mark)])


def test_run_past_its_time_limit_ends_the_childs_whole_group(tmp_path):
    """children.run past its time limit ends the wrapper's own child too (subprocess.run kills the child alone)."""
    wrapper = tmp_path / "wrapper"
    wrapper.write_text("#!/bin/sh\nsleep 302 &\nwait\n")
    wrapper.chmod(0o755)
    mark = new_mark()
    from planner import children
    with pytest.raises(subprocess.TimeoutExpired):
        children.run([str(wrapper)], env={**os.environ, **mark}, timeout=1)
    left = survivors(mark, wait_s=5)
    kill_all(left)
    assert not left, f"left running after the time limit: {left}"


@pytest.mark.slow
@pytest.mark.llamacpp
def test_kill_9_of_a_tune_leaves_no_llama_bench_running(llama_bench, tmp_path):
    """`tune` on the real CPU llama-bench, killed with SIGKILL while llama-bench runs: no process of the tuner's is
    left (it runs no finally: the kernel ends its children)."""
    from runtime.synth import tiny_spec, uniform_recipe, write_gguf
    model = write_gguf(tmp_path / "tiny.gguf", tiny_spec("qwen3moe", n_layer=6, n_expert=8, n_expert_used=2),
                       uniform_recipe("Q4_0"))[0]
    mark = new_mark()
    argv = [sys.executable, "-m", "offload_tuner.cli", "tune", str(model), "--engine", "llamacpp", "--llama-bench",
            str(llama_bench), "--cpu-stand-in", "--gpu", "1GiB", "--keep-free", "0", "--trials", "20", "--n-prompt",
            "64", "--n-gen", "4096", "--reps", "20", "--study", "k", "--storage", f"sqlite:///{tmp_path / 's.db'}",
            "--no-report", "--quiet", "--pool", "20"]
    tuner = subprocess.Popen(argv, cwd=tmp_path, env={**os.environ, **mark, "PYTHONPATH": str(ROOT)},
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        procs = _wait_for(mark, Path(llama_bench).name, tuner, has=" -m ")   # a run, not the --help probe
        assert len(procs) >= 2                     # the tuner and its llama-bench
        tuner.send_signal(signal.SIGKILL)
        tuner.wait(10)
        left = survivors(mark, wait_s=5)          # a llama-bench run here lasts far longer (20 x 4096 tokens)
        assert not left, f"left running after kill -9 of tune: {left}"
    finally:
        kill_all([tuner.pid, *marked(mark)])
