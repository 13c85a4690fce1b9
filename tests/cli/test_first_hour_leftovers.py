"""Issue 29, item 6, the leftovers: `--version` from the package metadata; `run`'s repetitions as its help says;
`plan`'s output-layer message in the bytes `inspect` shows (calibrate's progress: tests/runtime/test_calibrate.py)."""
from __future__ import annotations

import json
from importlib.metadata import version

import pytest

from offload_tuner import cli
from planner import defaults as D
from planner.hardware import fmt_bytes
from planner.loader import load_model

MODEL = "preset:Qwen3-30B-A3B"


def test_version_is_the_installed_packages(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"offload-tuner {version('offload-tuner')}\n"


def test_run_repeats_as_its_help_says(capsys):
    reps = D.RUN_WORKLOAD.repetitions
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    assert f"repetitions (default {reps}, or -r)" in " ".join(capsys.readouterr().out.split())
    # a llama-bench command line without -r: run's default, not llama-bench's own 5
    assert cli.main(["run", MODEL, "--engine", "sim", "--gpu", "24GiB", "--json", "--", "-ngl", "99"]) == 0
    assert json.loads(capsys.readouterr().out)["workload"]["repetitions"] == reps
    assert cli.main(["run", MODEL, "--engine", "sim", "--gpu", "24GiB", "--json", "--", "-ngl", "99", "-r", "5"]) == 0
    assert json.loads(capsys.readouterr().out)["workload"]["repetitions"] == 5
    assert cli.main(["run", MODEL, "--engine", "sim", "--gpu", "24GiB", "--reps", "2", "--json", "--", "-ngl", "99",
                     "-r", "5"]) == 0
    assert json.loads(capsys.readouterr().out)["workload"]["repetitions"] == 2      # the flag wins


def test_plan_on_a_tiny_gpu_names_the_output_layers_own_bytes(capsys):
    # the output layer is 243 MiB as inspect counts it; with the CUDA context and the compute buffers it needs
    # 1.02 GiB, which 1.5 GiB less the 1 GiB kept free cannot hold
    inv = load_model(MODEL)
    out_bytes = sum(t.nbytes for t in inv.allocated() if t.name in ("output.weight", "output_norm.weight"))
    assert cli.main(["plan", MODEL, "--gpu", "1.5GiB"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "after 1.00 GiB kept free" in err
    assert f"its weights {fmt_bytes(out_bytes)} (output and its norm)" in err and "CUDA context" in err
    assert cli.main(["inspect", MODEL]) == 0
    assert fmt_bytes(out_bytes - 8 * 1024)[:5] in capsys.readouterr().out      # output.weight alone: 243.4x MiB


def test_plan_warns_of_a_million_token_context_as_explain_does(capsys):
    assert cli.main(["plan", MODEL, "--gpu", "24GiB", "--ctx", "1000000"]) == 0
    assert "warning: W029 -c 1000000 is more than the model's training context (40960)" in capsys.readouterr().out


@pytest.mark.parametrize("gpu, says", [
    ("24", "bad --gpu 24: a size without a unit is bytes (24 B is no GPU); did you mean --gpu 24GiB?"),
    ("24GiB,", "bad --gpu '24GiB,': an empty size between commas; did you mean --gpu 24GiB?"),
    ("24GiB,,16GiB", "an empty size between commas; did you mean --gpu 24GiB,16GiB?"),
])
def test_a_gpu_size_a_user_mistyped_is_answered_with_the_fix(gpu, says, capsys):
    """Issue 40 item 11: `--gpu 24` (bytes) and `--gpu 24GiB,` get one line with the command that was meant."""
    assert cli.main(["plan", MODEL, "--gpu", gpu]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1


def test_a_gpu_size_in_bytes_is_still_read():
    from planner.hardware import resolve
    assert resolve(None, str(24 << 30)).gpus[0].vram_bytes == 24 << 30


@pytest.mark.parametrize("argv, says", [
    (["tnue", MODEL], "invalid choice: 'tnue' (choose from 'inspect', 'plan'"),
    (["plan", MODEL, "--gpu", "16GiB", "--objetcive", "tg"], "unrecognized arguments: --objetcive tg; did you mean "
                                                               "--objective?"),
    (["plan", MODEL, "--gpu", "16GiB", "--objective", "tgg"], "plan: argument --objective: invalid choice: 'tgg'"),
])
def test_a_mistyped_command_or_option_says_what_was_meant(argv, says, capsys):
    """Issue 40 item 11: argparse's errors with "did you mean" where a name is close; none where none is."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1
    assert err.rstrip().endswith(("did you mean 'tune'?", "did you mean --objective?", "did you mean 'tg'?"))
    assert cli.main(["plan", MODEL, "--gpu", "16GiB", "--zzz"]) == 2
    assert capsys.readouterr().err.rstrip().endswith("unrecognized arguments: --zzz")


@pytest.mark.parametrize("argv, says", [
    (["plan", MODEL, "--gpu", "16GiB", "--trails", "3"],
     "--trails 3; --trials is an option of tune, demo, not of plan"),
    (["inspect", MODEL, "--llama-servr", "x"], "--llama-servr x; --llama-server is an option of tune, not of inspect"),
    (["plan", MODEL, "--gpu", "16GiB", "--verbose"], "--verbose; --verbose goes before the command: offload-tuner "
                                                     "--verbose plan ..."),
    (["plan", MODEL, "--gpuu", "16GiB"], "--gpuu 16GiB; did you mean --gpu?"),
])
def test_an_option_of_another_command_is_named_as_such(argv, says, capsys):
    """An unknown option matched against every command's: the command's own is suggested; another command's is
    said to be that command's (plan has no --trials: suggesting it would only fail again); the program's own -v/-q
    belong before the command."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.rstrip().endswith(says) and err.count("\n") == 1
