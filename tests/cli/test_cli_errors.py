"""Every bad-input path gives one clear line on stderr and exit code 2, never a traceback."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from offload_tuner.cli import main
from runtime.synth import encode_header

ROOT = Path(__file__).resolve().parents[2]


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("offload-tuner: error: ")
    for n in needles:
        assert n in lines[0], lines[0]


def test_not_a_gguf(tmp_path, capsys):
    p = tmp_path / "model.gguf"
    p.write_bytes(b"PK\x03\x04 this is a zip file, not a model" * 4)
    code, _, err = run_cli(capsys, "inspect", str(p))
    assert_one_line_error(code, err, "not a GGUF")


def test_truncated_gguf(tiny_gguf, tmp_path, capsys):
    good = tiny_gguf("qwen3moe").read_bytes()
    for cut in (3, 20, 200, len(good) // 10):
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(good[:cut])
        code, _, err = run_cli(capsys, "inspect", str(p))
        assert_one_line_error(code, err, str(p))


def test_unknown_architecture(tmp_path, capsys):
    p = tmp_path / "mamba.gguf"
    p.write_bytes(encode_header({"general.architecture": "mamba", "mamba.block_count": 2}, []))
    code, _, err = run_cli(capsys, "inspect", str(p))
    assert_one_line_error(code, err, "unknown architecture 'mamba'", "qwen3moe")


def test_missing_file_and_directory(tmp_path, capsys):
    code, _, err = run_cli(capsys, "inspect", str(tmp_path / "nope.gguf"))
    assert_one_line_error(code, err, "no such model file")
    code, _, err = run_cli(capsys, "inspect", str(tmp_path))
    assert_one_line_error(code, err, "directory")


@pytest.mark.parametrize("size", ["24 parsecs", "-3G", "lots"])
def test_bad_size_string(size, capsys):
    code, _, err = run_cli(capsys, "plan", "preset:Qwen3-30B-A3B", f"--gpu={size}")
    assert_one_line_error(code, err, "bad size", size)


def test_budget_nothing_fits(capsys):
    code, _, err = run_cli(capsys, "plan", "preset:Qwen3-30B-A3B", "--gpu", "600MiB")
    assert_one_line_error(code, err, "nothing fits")


def test_unknown_preset(capsys):
    code, _, err = run_cli(capsys, "inspect", "preset:Qwen9-1T")
    assert_one_line_error(code, err, "unknown preset", "Qwen3-30B-A3B")


def test_plan_without_hardware(capsys):
    code, _, err = run_cli(capsys, "plan", "preset:Qwen3-30B-A3B")
    assert_one_line_error(code, err, "--gpu")


def test_bad_argparse_usage_is_one_line(capsys):
    code, _, err = run_cli(capsys, "plan", "preset:Qwen3-30B-A3B", "--gpu", "24GiB", "--ctx", "many")
    assert_one_line_error(code, err, "--ctx")
    code, _, err = run_cli(capsys, "frobnicate")
    assert_one_line_error(code, err, "frobnicate")


def test_errors_through_the_real_console_script(tmp_path):
    # the same path as a user: a separate process, stderr one line, exit 2
    p = tmp_path / "x.gguf"
    p.write_bytes(b"GGUF\x03\x00\x00\x00")
    r = subprocess.run([sys.executable, "-m", "offload_tuner.cli", "inspect", str(p)], capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_small_first_hour_items(capsys):
    """Issue 'first hour' 6: a pattern's backslashes printed once; explain's arguments without -- get a hint; plan
    warns of a context past the model's training context, as explain does."""
    code, _, err = run_cli(capsys, "explain", "preset:Qwen3-30B-A3B", "--gpu", "8GiB", "--", "-ngl", "99", "-ot",
                           r"blk\.(1[0-9]\.ffn=CPU")
    assert_one_line_error(code, err, r"-ot pattern 'blk\.(1[0-9]\.ffn' is not a valid regex")
    assert r"\\." not in err
    code, _, err = run_cli(capsys, "explain", "preset:Qwen3-30B-A3B", "--gpu", "8GiB", "-ngl", "99")
    assert_one_line_error(code, err, "unrecognized arguments: -ngl 99", "go after --")
    code, out, _ = run_cli(capsys, "plan", "preset:Qwen3-30B-A3B", "--gpu", "24GiB", "--ctx", "100000")
    assert code == 0 and "warning: W029 -c 100000 is more than the model's training context (40960)" in out
    code, out, _ = run_cli(capsys, "plan", "preset:Qwen3-30B-A3B", "--gpu", "24GiB")
    assert code == 0 and "W029" not in out


def test_serve_on_a_taken_port_is_one_line(capsys, tmp_path):
    """Issue 'first hour' 6: uvicorn logged its errno text and exited 3; now one line, exit 2, before the banner."""
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out, err = run_cli(capsys, "serve", "--port", str(port), "--storage", f"sqlite:///{tmp_path / 's.db'}")
    assert_one_line_error(code, err, f"--port {port}: 127.0.0.1:{port} cannot be bound", "give another --port")
    assert out == ""


@pytest.fixture(scope="module")
def sim_study(tmp_path_factory) -> str:
    """The storage URL of a real 3-run sim study."""
    d = tmp_path_factory.mktemp("study")
    url = f"sqlite:///{d / 's.db'}"
    r = subprocess.run([sys.executable, "-m", "offload_tuner.cli", "tune", "preset:Qwen3-30B-A3B", "--engine", "sim",
                        "--gpu", "16GiB", "--trials", "3", "--study", "s", "--storage", url, "--pool", "0", "--quiet",
                        "--no-report"], cwd=d, capture_output=True, text=True, timeout=400,
                       env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-2000:]
    return url


@pytest.mark.parametrize("out", ["{tmp}/readonly/rep", "{tmp}/readonly", "/proc/offload-tuner-report",
                                 "/sys/offload-tuner-report"])
def test_report_into_a_folder_that_cannot_be_written_is_one_line(sim_study, out, tmp_path, capsys):
    """Issue 31: report --out into a folder the user cannot write ended in 18 lines of traceback. /proc and /sys
    refuse even root (who writes into a read-only folder: those two cases are skipped as root)."""
    import os
    if "readonly" in out and os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    (tmp_path / "readonly").mkdir()
    (tmp_path / "readonly").chmod(0o555)
    folder = out.format(tmp=tmp_path)
    code, _, err = run_cli(capsys, "report", "s", "--storage", sim_study, "--out", folder)
    assert_one_line_error(code, err, folder)
