"""The GPU benchmark scripts with several steps share their input handling: bad input is one line and exit 2."""
from __future__ import annotations

import pytest


@pytest.mark.parametrize("name", ["ik_gpu", "multi_gpu"])
def test_bad_input_is_one_line_and_exit_2(bench_script, name, tmp_path, capsys):
    bench = bench_script(name)
    assert bench.main(["--workdir", str(tmp_path), "--model", str(tmp_path / "nope.gguf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such file" in err[0]
    with pytest.raises(SystemExit) as e:
        bench.main(["--steps", "memory,bogus"])
    assert e.value.code == 2


@pytest.mark.parametrize("name", ["llamacpp_gpu", "tune_vs_fit", "ik_gpu", "multi_gpu"])
@pytest.mark.parametrize("argv", [["--budgets", "8,x"], ["--steps", "bogus"], ["--reps", "0"], ["--n-gen", "-1"]])
def test_the_shared_options_refuse_bad_values_in_one_line(bench_script, name, argv, capsys):
    """benchmarks/device_options.py: every device benchmark refuses the same bad values the same way (argparse's
    usage and one error line, exit 2), before it builds, writes or measures anything."""
    bench = bench_script(name)
    if name == "tune_vs_fit" and argv[0] == "--steps":
        argv = ["--depths", "0,deep"]          # tune_vs_fit has cells, not steps
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ": error: " in ln]
    assert len(err) == 1


def test_a_benchmarks_defaults_table_gives_both_the_help_and_the_value(bench_script):
    """One table entry per option: the help says the GPU and --cpu values, and resolve() sets them by --cpu."""
    import argparse
    opts = bench_script("device_options")
    defaults = {"n_prompt": (2048, 32), "n_gen": (64, 4), "reps": (3, 1), "runs": (30, 12), "confirm": (3, 3)}
    ap = argparse.ArgumentParser(prog="b")
    ap.add_argument("--cpu", action="store_true")
    opts.add_workload_options(ap, defaults)
    opts.add_study_options(ap, defaults)
    helps = {a.dest: a.help for a in ap._actions}
    assert helps["n_gen"].endswith("(default 64; 4 with --cpu)") and helps["confirm"].endswith("(default 3)")
    gpu = opts.resolve(ap, ap.parse_args([]), defaults)
    cpu = opts.resolve(ap, ap.parse_args(["--cpu", "--runs", "7"]), defaults)
    assert (gpu.n_prompt, gpu.n_gen, gpu.reps, gpu.runs) == (2048, 64, 3, 30)
    assert (cpu.n_prompt, cpu.n_gen, cpu.reps, cpu.runs) == (32, 4, 1, 7)       # given on the line: kept
    assert opts.parse_budgets(ap, "4, 8,16") == [4, 8, 16]
