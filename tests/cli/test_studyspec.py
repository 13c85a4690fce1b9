"""Study specs (studies/NAME.toml, `tune --spec`): a spec is the same study as the equivalent flags, resumes by
running it again with its database beside it, flags given override it, and a bad spec is one line naming the key
and the file (exit 2)."""
from __future__ import annotations

import contextlib
import io
import json
from dataclasses import replace
from pathlib import Path

import pytest

from offload_tuner import cli
from offload_tuner.app import DEMO, TuneRequest
from offload_tuner.app.studyspec import load_spec

ROOT = Path(__file__).resolve().parents[2]
SPEC = """\
model = "preset:Qwen3-30B-A3B:Q4_K_M"
engine = "sim"
budget = "16GiB"
objective = "tg"
n_trials = 3
pool = 0
ctx = 8192

[workload]
n_prompt = 1024
n_gen = 64
depth = 0
reps = 1

[space]
kv_types = ["f16", "q8_0"]
ubatch = [256, 512, 1024]
"""
# the same study as flags (ubatch limits have no flag: the flags' space is the spec's only without them)
FLAGS = ["preset:Qwen3-30B-A3B:Q4_K_M", "--engine", "sim", "--gpu", "16GiB", "--objective", "tg", "--trials", "3",
         "--pool", "0", "--ctx", "8192", "--n-prompt", "1024", "--n-gen", "64", "--depth", "0", "--reps", "1",
         "--kv-types", "f16,q8_0"]


def _options(argv: list[str]) -> TuneRequest:
    return cli.tune_options(cli.build_parser().parse_args(["tune", *argv]))


def _tune(argv: list[str]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["tune", *argv, "--quiet", "--no-report", "--json"]) == 0
    return json.loads(out.getvalue())


def _trials(url: str, name: str) -> tuple[dict, list[tuple[dict, tuple[float, ...]]]]:
    import optuna
    from tuner.storage import make_storage
    study = optuna.load_study(study_name=name, storage=make_storage(url))
    done = [(t.params, tuple(t.values)) for t in study.get_trials(deepcopy=False) if t.values]
    return study.user_attrs["settings"], done


@pytest.mark.slow
def test_spec_is_the_same_study_as_the_equivalent_flags(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = tmp_path / "studies" / "s.toml"
    spec.parent.mkdir()
    spec.write_text(SPEC.replace('ubatch = [256, 512, 1024]\n', ''))
    from_spec = _options(["--spec", str(spec)])
    from_flags = _options(FLAGS)
    assert replace(from_spec, spec=None, study=None) == from_flags

    _tune(["--spec", str(spec)])
    _tune([*FLAGS, "--study", "f", "--storage", f"sqlite:///{tmp_path / 'f.db'}"])
    settings_spec, trials_spec = _trials(f"sqlite:///{tmp_path / 'studies' / 's.db'}", "s")
    settings_flags, trials_flags = _trials(f"sqlite:///{tmp_path / 'f.db'}", "f")
    assert settings_spec == settings_flags
    assert trials_spec == trials_flags and len(trials_spec) >= 3


def test_spec_resumes_beside_itself_from_any_folder(tmp_path, monkeypatch):
    spec = tmp_path / "studies" / "r.toml"
    spec.parent.mkdir()
    spec.write_text(SPEC)
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    first = _tune(["--spec", str(spec)])
    assert first["storage"] == f"sqlite:///{spec.parent / 'r.db'}" and (spec.parent / "r.db").exists()
    assert first["settings"]["space"]["ubatch"] == [256, 512, 1024]        # the spec's limit reached the space
    second = _tune(["--spec", str(spec), "--trials", "2"])
    assert second["study"] == "r" and second["run"]["measured"] == 2
    assert second["counts"]["complete"] > first["counts"]["complete"]      # the same study, resumed
    assert not (elsewhere / "studies").exists()          # nothing in the working directory


def test_flags_given_override_the_spec(tmp_path):
    spec = tmp_path / "o.toml"
    spec.write_text(SPEC)
    o = _options(["--spec", str(spec), "--trials", "7", "--objective", "pp", "--gpu", "24GiB", "--study", "x"])
    assert (o.trials, o.objective, o.gpu, o.study) == (7, "pp", "24GiB", "x")
    assert (o.n_prompt, o.reps, o.pool, o.space_limits) == (1024, 1, 0, {"ubatch": (256, 512, 1024)})
    assert _options(["--spec", str(spec)]).study == "o"       # the file's name


def test_shipped_specs_load_and_demo_toml_is_what_demo_runs():
    specs = sorted((ROOT / "studies").glob("*.toml"))
    assert {p.name for p in specs} >= {"demo.toml", "qwen3-30b-llamacpp-16g.toml", "deepseek-2x24g.toml"}
    for p in specs:
        assert load_spec(p)["study"] == p.stem
    demo = TuneRequest(**load_spec(ROOT / "studies" / "demo.toml"))
    assert replace(demo, spec=None) == DEMO
    assert "demo --spec studies/demo.toml" in (ROOT / "Makefile").read_text()


BAD = [
    ("unknown key", 'budgt = "16GiB"\n', "budgt"),
    ("unknown table key", '[workload]\nn_promt = 5\n', "workload.n_promt"),
    ("table not a table", 'workload = 5\n', "workload"),
    ("reps 0", '[workload]\nreps = 0\n', "workload.reps"),
    ("string for int", 'n_trials = "ten"\n', "n_trials"),
    ("bool for int", 'ctx = true\n', "ctx"),
    ("engine", 'engine = "vllm"\n', "engine"),
    ("budget", 'budget = ["16GiB", "lots"]\n', "budget"),
    ("hardware", 'hardware = "no-such-box"\n', "hardware"),
    ("objective", 'objective = "tg ** 2"\n', "objective"),
    ("margin", 'margin = "some"\n', "margin"),
    ("ubatch not pow2", '[space]\nubatch = [300]\n', "space.ubatch"),
    ("kv type", '[space]\nkv_types = ["q9"]\n', "space.kv_types"),
    ("space mode", '[space]\nmode = "half"\n', "space.mode"),
    ("model file", 'model = "nowhere.gguf"\n', "model"),
    ("not toml", 'model = preset\n', "not TOML"),
]


@pytest.mark.parametrize("name, text, needle", BAD, ids=[b[0] for b in BAD])
def test_bad_spec_is_one_line_naming_key_and_file(name, text, needle, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = tmp_path / "bad.toml"
    spec.write_text(('' if text.startswith("model") else 'model = "preset:Qwen3-30B-A3B"\n') + text)
    assert cli.main(["tune", "--spec", str(spec), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("offload-tuner: error:") and "\n" not in err
    assert str(spec) in err and needle in err
    assert [p.name for p in tmp_path.iterdir()] == ["bad.toml"]       # nothing written


def test_missing_spec_and_missing_model(tmp_path, capsys):
    assert cli.main(["tune", "--spec", str(tmp_path / "none.toml")]) == 2
    assert "cannot read --spec" in capsys.readouterr().err
    assert cli.main(["tune", "--gpu", "16GiB"]) == 2
    assert "say which model" in capsys.readouterr().err


def test_gpu_key_and_its_older_spelling_budget(tmp_path: Path) -> None:
    """`gpu` (tune --gpu's name) and the older key `budget` read the same; both at once is one error."""
    new, old, both = tmp_path / "new.toml", tmp_path / "old.toml", tmp_path / "both.toml"
    new.write_text(SPEC.replace('budget = "16GiB"', 'gpu = ["16GiB", "8GiB"]'))
    old.write_text(SPEC.replace('budget = "16GiB"', 'budget = ["16GiB", "8GiB"]'))
    both.write_text(SPEC.replace('budget = "16GiB"', 'budget = "16GiB"\ngpu = "16GiB"'))
    assert load_spec(new)["gpu"] == load_spec(old)["gpu"] == "16GiB,8GiB"
    assert {k: v for k, v in load_spec(new).items() if k not in ("spec", "study")} == \
        {k: v for k, v in load_spec(old).items() if k not in ("spec", "study")}
    from planner.errors import InputError
    with pytest.raises(InputError, match="give gpu or its older spelling budget, not both"):
        load_spec(both)



def test_bench_table_and_its_older_name_workload(tmp_path: Path) -> None:
    """`[bench]` (the benchmark run) and its older name `[workload]` read the same, beside a `workload` string (the
    user's requests); both tables at once is one error, and a bad key names the table as the file spells it."""
    new, old, both, bad = (tmp_path / f"{n}.toml" for n in ("new", "old", "both", "bad"))
    new.write_text(SPEC.replace("[workload]", "[bench]"))
    old.write_text(SPEC)
    both.write_text(SPEC + "\n[bench]\nreps = 2\n")
    bad.write_text(SPEC.replace("[workload]", "[bench]").replace("depth = 0", "deepth = 0"))
    assert load_spec(new)["n_prompt"] == load_spec(old)["n_prompt"] == 1024
    assert {k: v for k, v in load_spec(new).items() if k not in ("spec", "study")} == \
        {k: v for k, v in load_spec(old).items() if k not in ("spec", "study")}
    from planner.errors import InputError
    with pytest.raises(InputError, match=r"give \[bench\] or its older name \[workload\], not both"):
        load_spec(both)
    with pytest.raises(InputError, match=r"unknown key bench.deepth \(known in \[bench\]: n_prompt"):
        load_spec(bad)
