"""The CLI's logging (offload_tuner/cli/logs.py), through the real command line: progress lines at INFO by default,
the global -q keeps only warnings and errors, -v adds the library's debug lines; results stay on stdout."""
from __future__ import annotations

import logging

import pytest

from offload_tuner.cli import main
from offload_tuner.cli.logs import OURS

RUN = ["run", "preset:Qwen3-30B-A3B", "--engine", "sim", "--gpu", "24GiB", "--", "-ngl", "99", "-ot", "exps=CPU"]
PROGRESS = "# sim: measuring plan "          # run's progress line, on stderr
DEBUG = "offload-tuner: DEBUG: planner.loader: model preset:Qwen3-30B-A3B"


@pytest.fixture(autouse=True)
def _reset_levels():
    yield
    for name in OURS:    # the next test's logging as if no -v / -q had been given
        logging.getLogger(name).setLevel(logging.NOTSET)


def test_default_shows_the_progress_line_and_no_debug(capsys) -> None:
    assert main(RUN) == 0
    out, err = capsys.readouterr()
    assert err.startswith(PROGRESS) and err.count("\n") == 1 and "DEBUG" not in err
    assert "result:  ok" in out and PROGRESS not in out


def test_quiet_silences_the_progress_line(capsys) -> None:
    assert main(["-q", *RUN]) == 0
    out, err = capsys.readouterr()
    assert err == "" and "result:  ok" in out          # the result is still printed


def test_verbose_shows_a_debug_line(capsys, caplog) -> None:
    assert main(["--verbose", *RUN]) == 0
    out, err = capsys.readouterr()
    assert DEBUG in err and PROGRESS in err and "result:  ok" in out
    assert any(r.levelno == logging.DEBUG and r.name == "planner.loader" for r in caplog.records)


def test_verbose_and_quiet_exclude_each_other(capsys) -> None:
    assert main(["-v", "-q", *RUN]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not allowed with argument" in err


def test_a_warning_reads_as_before(capsys) -> None:
    """A library warning is one `offload-tuner: WARNING:` line at every level but -q drops nothing of it."""
    assert main(["-q", *RUN]) == 0
    capsys.readouterr()
    logging.getLogger("runtime.torch_engine.kernels").warning("fast path dropped, running its fallback: x")
    assert capsys.readouterr().err == "offload-tuner: WARNING: fast path dropped, running its fallback: x\n"
