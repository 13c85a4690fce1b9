"""Files that are not regular files, or far larger than their kind, named on the command line (issue 43): a FIFO
blocked `open()` for ever, /dev/zero read until memory ran out. Each is now one line and exit 2, at once, through
planner/files.py; the real CLI in a subprocess with a time limit, so that a hang fails the test instead of hanging
it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = "preset:Qwen3-30B-A3B"


def offload_tuner(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "offload_tuner.cli", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL)


# (argv with FILE where the hostile path goes, the name the one line gives the file)
COMMANDS = [
    (["inspect", "FILE"], "model"),
    (["plan", "FILE", "--gpu", "16GiB"], "model"),
    (["plan", MODEL, "--hardware", "FILE"], "hardware profile"),
    (["plan", MODEL, "--gpu", "16GiB", "--workload", "FILE"], "workload"),
    (["tune", "--spec", "FILE"], "--spec"),
    (["run", MODEL, "--engine", "sim", "--gpu", "16GiB", "--plan", "FILE"], "--plan"),
    (["tune", MODEL, "--engine", "sim", "--gpu", "16GiB", "--trials", "1", "--storage", "sqlite:///FILE"], "storage"),
]
SUFFIX = {"hardware profile": ".json", "workload": ".jsonl", "--spec": ".toml", "--plan": ".json",
          "storage": ".db", "model": ".gguf"}


@pytest.mark.parametrize("argv, what", COMMANDS, ids=[f"{a[0]}-{w}" for a, w in COMMANDS])
@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_file_that_is_not_a_regular_file_is_one_line(tmp_path, argv, what, kind):
    if kind == "fifo":
        path = tmp_path / f"pipe{SUFFIX[what]}"
        os.mkfifo(path)
        words = "a FIFO (named pipe), not a file"
    else:                    # a link named as the option expects (a bare /dev/zero is no workload file name)
        path = tmp_path / f"zero{SUFFIX[what]}"
        path.symlink_to("/dev/zero")
        words = "a character device, not a file"
    r = offload_tuner(*(a.replace("FILE", str(path)) for a in argv), cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"cannot read {what} {path}: {words}" in lines[0], lines[0]


@pytest.mark.parametrize("option, suffix, words", [
    ("--hardware", ".json", "hardware profile {}: over 1 MiB"),
    ("--spec", ".toml", "--spec {}: over 1 MiB"),
])
def test_a_file_far_larger_than_its_kind_is_read_no_further_than_its_bound(tmp_path, option, suffix, words):
    big = tmp_path / f"big{suffix}"
    with open(big, "wb") as f:
        f.truncate(3 << 30)          # 3 GiB, sparse: reading it whole would take the memory the old code took
    argv = ["tune", "--spec", str(big)] if option == "--spec" else ["plan", MODEL, "--hardware", str(big)]
    r = offload_tuner(*argv, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip() == f"offload-tuner: error: {words.format(big)}, more than a " \
        f"{words.split(' {}')[0]} ever is; is it the right file?", r.stderr
