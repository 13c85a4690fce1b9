"""The app layer's requests (offload_tuner/app/requests.py): TuneRequest renders the `tune` command line that the CLI
parses back into the same options (how the service starts a tune worker), and every field of every request is an
option of its command with the request's own help text."""
from __future__ import annotations

from dataclasses import replace
from typing import get_args

import pytest

from offload_tuner import cli
from planner import defaults as D
from offload_tuner.app import (DemoRequest, ExplainRequest, InspectRequest, PlanRequest, ReportRequest, ServerConfig,
                         TuneRequest)
from offload_tuner.app.fields import options
from offload_tuner.app.requests import SpaceMode
from planner.errors import InputError

M = "preset:Qwen3-30B-A3B"
SPEC = """\
model = "preset:Qwen3-30B-A3B:Q4_K_M"
engine = "sim"
budget = "16GiB"
n_trials = 3
pool = 0
cpu_stand_in = true

[space]
kv_types = ["f16", "q8_0"]
ubatch = [256, 512]
"""

ROUND_TRIP = {
    "defaults": TuneRequest(model=M),
    "every field": TuneRequest(
        model="/models/q.gguf", engine="llamacpp", gpu="24GiB,16GiB", hardware="rtx4090-ddr5", trials=7, study="s1",
        storage="sqlite:////tmp/x y.db", objective="tg + 0.1*pp", n_prompt=0, n_gen=64, depth=4096, reps=1,
        ctx=16384, dialect="ik", llama_bench="/opt/ik/llama-sweep-bench", margin="0", cpu_stand_in=True, confirm=0,
        space="full", kv_types=("q8_0", "q4_0"), seed=3, pool=0, timeout_s=12.5, fresh=True, out="rep dir",
        no_report=True, quiet=True, json=True),
    "values that start with a dash": TuneRequest(model=M, objective="-pp", storage="--weird", study="-s",
                                                 out="-o"),
    "a service worker's": replace(TuneRequest(model=M, trials=5), study="api", storage="sqlite:////srv/api.db",
                                  json=True, quiet=True, no_report=True),
}


def _parsed(argv: list[str]) -> TuneRequest:
    return cli.tune_options(cli.build_parser().parse_args(argv))


@pytest.mark.parametrize("opts", ROUND_TRIP.values(), ids=ROUND_TRIP)
def test_tune_options_round_trip_through_the_command_line(opts):
    argv = opts.to_argv()
    assert argv[:2] == ["tune", opts.model]
    assert _parsed(argv) == opts


def test_a_specd_study_round_trips_with_every_value_written(tmp_path):
    spec = tmp_path / "s.toml"
    spec.write_text(SPEC)
    # a flag back at the default over the spec's value (pool 200 over 0), and the spec's switch on
    opts = _parsed(["tune", "--spec", str(spec), "--pool", str(D.TUNE_POOL), "--trials", "9"])
    assert (opts.pool, opts.trials, opts.cpu_stand_in, opts.space_limits) == (D.TUNE_POOL, 9, True,
                                                                              {"ubatch": (256, 512)})
    argv = opts.to_argv()
    assert f"--spec={spec}" in argv and f"--pool={D.TUNE_POOL}" in argv
    assert _parsed(argv) == opts


def test_what_no_flag_carries_is_refused_or_respelled():
    with pytest.raises(InputError, match="space limits"):
        TuneRequest(model=M, space_limits={"ubatch": (512,)}).to_argv()
    argv = TuneRequest(model="-odd.gguf").to_argv()        # a positional that starts with '-' reads as a flag
    assert _parsed(argv).model == "./-odd.gguf"


def test_the_choices_are_the_listed_ones():
    """The space modes are a Literal of the defaults' list; the engines are the registry's names."""
    from offload_tuner.app.fields import options
    from planner.engine_registry import names
    assert get_args(SpaceMode) == D.SPACE_MODES
    assert options(TuneRequest)["engine"].choices == names()


COMMANDS = {"inspect": InspectRequest, "plan": PlanRequest, "explain": ExplainRequest, "tune": TuneRequest,
            "report": ReportRequest, "demo": DemoRequest, "serve": ServerConfig}
POSITIONAL = {"model", "study"}
NO_FLAG = {"args", "space_limits", "workdir", "max_body", "compute_threads", "max_waiting"}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_request_field_is_an_option_of_its_command_with_its_help(command, capsys):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    text = "".join(capsys.readouterr().out.split())     # argparse wraps the help: compare without whitespace
    for name, o in options(COMMANDS[command]).items():
        if name in NO_FLAG:
            continue
        assert (name if name in POSITIONAL else o.flag) in text, (command, name)
        assert o.help and "".join(o.help.split()) in text, (command, name)


# a number out of its range (offload_tuner/app/fields.py Bounds; the maxima in planner/defaults.py): refused by the
# request itself, so the command line, a JSON body and a study spec all get the same one line (issue 43, item 3)
OUT_OF_RANGE = [("seed", -1), ("seed", 2**32), ("pool", 10**12), ("trials", 10**12), ("reps", 10**9),
                ("n_prompt", 10**20), ("depth", -1), ("ctx", 0), ("confirm", 10**9), ("timeout_s", float("nan")),
                ("timeout_s", float("inf")), ("timeout_s", 0.0), ("timeout_s", -1.0)]


@pytest.mark.parametrize("name, value", OUT_OF_RANGE, ids=[f"{n}={v}" for n, v in OUT_OF_RANGE])
def test_a_number_out_of_range_is_refused_by_the_request_itself(name, value):
    flag = options(TuneRequest)[name].flag
    with pytest.raises(InputError, match=flag):               # the Python API, the values a JSON body gives
        TuneRequest.from_values({"model": M, name: value})
    from offload_tuner.service import bodies
    from offload_tuner.service.security import PathPolicy
    with pytest.raises(InputError, match=flag):               # a JSON body through the service's reader
        bodies.request("tune", {"model": M, name: value}, PathPolicy(()))


@pytest.mark.parametrize("line", ["timeout_s = inf", "timeout_s = nan", "seed = 4294967296", "confirm = 1000000000",
                                  "[workload]\nreps = 1000000000"])
def test_a_spec_out_of_range_is_refused(line, tmp_path):
    spec = tmp_path / "s.toml"
    spec.write_text(SPEC.replace("[space]", f"{line}\n\n[space]") if not line.startswith("[") else SPEC + line)
    with pytest.raises(InputError, match=r"--(timeout|seed|confirm|reps) .*(finite|at most)"):
        TuneRequest.from_values({"spec": str(spec)})


def test_the_other_requests_check_their_numbers():
    with pytest.raises(InputError, match="--ubatch 4096 is more than --batch 512.*give --batch 4096"):
        PlanRequest(model=M, ubatch=4096, batch=512)
    with pytest.raises(InputError, match="--threads"):
        PlanRequest(model=M, threads=10**6)
    with pytest.raises(InputError, match="--pool"):
        DemoRequest(pool=10**12)
    with pytest.raises(InputError, match="--request-limit"):
        ServerConfig(request_limit_s=float("inf"))
    assert PlanRequest(model=M, ubatch=512, batch=512).batch == 512       # equal is fine
