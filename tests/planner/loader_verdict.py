"""Our verdict and llama.cpp's on a GGUF file: `explain --dialect mainline -- -ngl 0` accepts it or not, and the CPU
llama-bench (`-ngl 0`) loads and runs it or not. Used by tests/planner/test_loader_agreement.py and
benchmarks/fuzz_acceptance.py."""
from __future__ import annotations

import contextlib
import io
import subprocess
from pathlib import Path

from offload_tuner import cli


def ours(path: Path) -> tuple[bool, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = cli.main(["explain", str(path), "--dialect", "mainline", "--gpu", "24GiB", "--json", "--",
                       "-ngl", "0", "-c", "256"])
    return rc == 0, err.getvalue().strip()


def llama_bench(binary: Path, path: Path, timeout_s: float = 60) -> tuple[bool, str]:
    try:
        p = subprocess.run([str(binary), "-m", str(path), "-ngl", "0", "-p", "4", "-n", "1", "-r", "1", "-t", "1",
                            "-o", "jsonl"], capture_output=True, text=True, timeout=timeout_s, errors="replace")
    except subprocess.TimeoutExpired:
        return False, "timeout"
    ok = p.returncode == 0 and '"avg_ts"' in p.stdout
    why = "" if ok else " | ".join(line for line in p.stderr.splitlines()[-4:] if line.strip())[-300:]
    return ok, f"rc={p.returncode} {why}"
