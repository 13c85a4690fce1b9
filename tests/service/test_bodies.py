"""A JSON body -> the use case's request (offload_tuner/service/bodies.py), without a server: the same dataclass the
CLI's flags make, the same message for a bad value, the server's keys refused, the schema from the fields."""
from __future__ import annotations

import re

import pytest

from offload_tuner import cli
from offload_tuner.app import PlanRequest, TuneRequest, plan_outcome
from offload_tuner.app.fields import options
from planner.errors import InputError
from offload_tuner.service import bodies
from offload_tuner.service.security import PathPolicy

M = "preset:Qwen3-30B-A3B"
PATHS = PathPolicy(())


def test_a_body_is_the_request_the_flags_make():
    body = {"model": M, "gpu": ["24GiB", "16GiB"], "ctx": 16384, "kv_type": "q8_0", "objective": "both", "top": "3",
            "dialect": "ik", "build": "ik:4840", "hardware": "rtx4090-ddr5"}
    ns = cli.build_parser().parse_args(["plan", M, "--gpu", "24GiB,16GiB", "--ctx", "16384", "--kv-type", "q8_0",
                                        "--objective", "both", "--top", "3", "--dialect", "ik", "--build", "ik:4840",
                                        "--hardware", "rtx4090-ddr5"])
    assert bodies.request("plan", body, PATHS) == PlanRequest(**cli.common.given(PlanRequest, ns))
    assert bodies.request("plan", {"model": M}, PATHS) == PlanRequest(model=M)       # the request's defaults


def test_keys_in_the_clis_spelling_and_the_old_names():
    body = {"model": M, "n-prompt": 64, "kv-types": ["f16"], "n-trials": 3, "study-name": "x", "timeout": 5,
            "cpu_stand_in": True, "space": "full"}
    assert bodies.request("tune", body, PATHS) == TuneRequest(model=M, n_prompt=64, kv_types=("f16",), trials=3,
                                                              study="x", timeout_s=5.0, cpu_stand_in=True,
                                                              space="full")


@pytest.mark.parametrize("command", ["plan", "explain", "tune"])
def test_a_bad_value_reads_as_the_command_line_says_it(command, capsys):
    """Every typed field (int, float, one of a list): the service's message is the CLI's line, word for word."""
    checked = 0
    for name, o in options(bodies.REQUESTS[command]).items():
        if o.kind not in ("int", "float", "choice") or name in bodies.DENIED:
            continue
        assert cli.main([command, M, f"{o.flag}=bogus"]) == 2
        err = capsys.readouterr().err.strip()
        with pytest.raises(InputError) as e:
            bodies.request(command, {"model": M, name: "bogus"}, PATHS)
        assert err == f"offload-tuner: error: {e.value}", name
        checked += 1
    assert checked


@pytest.mark.parametrize("key", ["llama-bench", "llama_bench", "storage", "out", "no-report", "quiet", "json", "spec",
                                 "oracle"])
def test_the_servers_keys_are_refused(key):
    command = "explain" if key == "oracle" else "tune"
    with pytest.raises(InputError, match="server's configuration"):
        bodies.request(command, {"model": M, key: "x"}, PATHS)


def test_a_field_without_a_json_form_is_not_an_option():
    with pytest.raises(InputError, match="is not an option"):
        bodies.request("tune", {"model": M, "space_limits": {"ubatch": [512]}}, PATHS)


@pytest.mark.parametrize("command", sorted(bodies.REQUESTS))
def test_the_schema_is_the_requests_fields_with_their_help(command):
    s = bodies.schema(command)
    assert list(s["properties"]) == bodies.allowed(command)
    assert not set(s["properties"]) & bodies.DENIED
    for name, prop in s["properties"].items():
        assert prop.get("description"), (command, name)
    assert s["required"] == (["model", "args"] if command == "explain" else ["model"])
    if command == "tune":
        assert s["properties"]["n_prompt"] == {   # a JSON integer or the command line's text
            "oneOf": [{"type": "integer", "minimum": 0}, {"type": "string", "pattern": "^[+-]?[0-9]+$"}],
            "description": options(TuneRequest)["n_prompt"].help}
        assert s["properties"]["engine"]["enum"] == ["sim", "torch", "llamacpp", "llamaserver"]   # the registry


def test_a_workload_over_http_is_a_preset_not_a_file_of_the_servers(tmp_path):
    (tmp_path / "w.toml").write_text('[[request]]\nnew_tokens = 8\n')
    assert bodies.request("plan", {"model": M, "workload": "rag"}, PATHS).workload == "rag"
    assert bodies.request("tune", {"model": M, "workload": "agent"}, PATHS).workload == "agent"
    for command in ("plan", "tune"):
        with pytest.raises(InputError, match="a workload file is the server's"):
            bodies.request(command, {"model": M, "workload": str(tmp_path / "w.toml")}, PATHS)


def test_a_workload_file_under_the_servers_folders_is_taken(tmp_path):
    # what the web forms' workload file field sends: a .toml or .jsonl under --models, nowhere else
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "mine.toml").write_text('[[request]]\nnew_tokens = 800\ngen_tokens = 100\n')
    paths = PathPolicy((tmp_path / "models",))
    req = bodies.request("plan", {"model": M, "gpu": "16GiB", "workload": "mine.toml"}, paths)
    assert req.workload == str((tmp_path / "models" / "mine.toml").resolve())
    assert plan_outcome(req).workload == "mine"
    assert bodies.request("tune", {"model": M, "workload": "mine.toml"}, paths).workload == req.workload
    (tmp_path / "elsewhere.toml").write_text('[[request]]\nnew_tokens = 8\n')
    with pytest.raises(InputError, match="outside the folders this server serves"):
        bodies.request("tune", {"model": M, "workload": str(tmp_path / "elsewhere.toml")}, paths)
    with pytest.raises(InputError, match="a workload file is the server's"):
        bodies.request("plan", {"model": M, "workload": "mine.txt"}, paths)


@pytest.mark.parametrize("body,words", [
    ({"model": M, "gpu": 24}, "gpu: expected a string, got a number"),            # a size is text: 24 is not 24GiB
    ({"model": M, "margin": 0}, "margin: expected a string, got a number"),
    ({"model": M, "ctx": 8192.5}, "ctx: expected an integer (or its text), got a number"),
    ({"model": M, "ctx": True}, "ctx: expected an integer (or its text), got true or false"),
    ({"model": M, "ctx": "1_000"}, "invalid int value: '1_000'"),                 # int() would take these
    ({"model": M, "ctx": "\u0663"}, "invalid int value"),
    ({"model": M, "ctx": " 5"}, "invalid int value"),
    ({"model": M, "gpu": "\u0662\u0664GiB"}, "bad size"),                          # Arabic-Indic 24
    ({"model": M, "gpu": "16GiB", "build": "mainline:\u0661"}, "expected DIALECT[:NUMBER]"),
])
def test_a_value_is_its_json_type_or_the_command_lines_ascii_text(body, words):
    """What the schema says is what the code takes: a string field a string, a number a JSON number or its
    ASCII text (the fuzz's invalid data found each of these accepted)."""
    with pytest.raises(InputError, match=re.escape(words)):
        plan_outcome(bodies.request("plan", body, PATHS))
