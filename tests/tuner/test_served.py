"""tuner/served.py's judgement: the reference is the fastest --fit variant, the pick the fastest config of
all (references included) within the budget, and what a pick gives up is said first."""
from __future__ import annotations

from dataclasses import replace

import pytest

from tuner.records import ServedRun
from tuner.served import Served, headline, served_record

MiB = 1 << 20
REFS = [Served("fit:512", "--fit", ("reference",), ubatch=512), Served("fit:2048", "--fit -ub 2048", ("reference",),
                                                                        ubatch=2048)]


def rows(key: str, secs: list[float], pp: float, tg: float, vram_mib: int, ok: bool = True) -> list[ServedRun]:
    return [ServedRun.from_dict({"round": i, "key": key, "ok": ok, "request_s": s, "ttft_s": s / 3, "pp_tps": pp,
                                 "tg_tps": tg, "peak_bytes": {"CUDA0": vram_mib * MiB}, "error": "" if ok else "boom"})
            for i, s in enumerate(secs)]


def test_the_fastest_reference_is_the_reference_and_a_faster_trial_in_budget_is_the_pick():
    cs = REFS + [Served("trial:3", "trial 3", ("finalist",), trial=3), Served("trial:5", "trial 5", ("finalist",),
                                                                              trial=5)]
    r = (rows("fit:512", [10.0, 10.4], 3000, 50, 6200) + rows("fit:2048", [8.0, 8.2], 5000, 50, 6300)
         + rows("trial:3", [5.0, 5.1], 9000, 49, 6000)       # fastest within the 6144 MiB budget
         + rows("trial:5", [4.0, 4.1], 12000, 49, 6500))     # faster still, but over the budget on the server
    rec = served_record(cs, r, 2, {"CUDA0": 6144 * MiB}, "rag")
    assert rec["reference"] == "fit:2048" and rec["pick"] == "trial:3"
    # the ratio of the median request rates (two samples: their means)
    rate = ((1 / 5.0 + 1 / 5.1) / 2) / ((1 / 8.0 + 1 / 8.2) / 2)
    assert rec["speedup"]["ratio"] == pytest.approx(rate) and rec["speedup"]["verdict"] == "win"
    assert rec["gives_up"] == []
    line = headline(rec)
    assert line.startswith("rag: trial 3 answers in 5.05 s mean, --fit -ub 2048 in 8.10 s: 1.60x (win)")


def test_when_nothing_beats_the_reference_the_reference_is_the_pick():
    cs = REFS + [Served("trial:1", "trial 1", ("finalist",), trial=1)]
    r = rows("fit:512", [6.0, 6.2], 3000, 50, 7000) + rows("fit:2048", [7.0, 7.1], 3000, 50, 7000) \
        + rows("trial:1", [6.5, 6.6], 3000, 50, 5000)
    rec = served_record(cs, r, 2, {"CUDA0": 6144 * MiB}, "chat")
    # the reference ran over the study's budget (llama.cpp's own fit), but it is what the user would run
    assert rec["reference"] == rec["pick"] == "fit:512"
    assert headline(rec).startswith("chat: keep --fit: no finalist answered faster than its 6.10 s mean request")


def test_a_pick_that_gives_up_speed_says_so_first():
    cs = REFS[:1] + [Served("trial:2", "trial 2", ("finalist",), trial=2)]
    r = rows("fit:512", [10.0, 10.0], 4000, 60, 6000) + rows("trial:2", [9.0, 9.0], 1500, 55, 6000)
    rec = served_record(cs, r, 2, {"CUDA0": 6144 * MiB}, "chat")
    assert rec["pick"] == "trial:2"
    assert rec["gives_up"] == ["PP 0.38x the reference's (1500.0 vs 4000.0 t/s)",
                               "TG 0.92x the reference's (55.0 vs 60.0 t/s)"]
    assert headline(rec).startswith("gives up PP 0.38x the reference's (1500.0 vs 4000.0 t/s); TG 0.92x")


def test_failed_samples_are_kept_and_never_picked():
    cs = REFS[:1] + [Served("trial:9", "trial 9", ("finalist",), trial=9)]
    r = rows("fit:512", [10.0, 11.0], 4000, 60, 6000) + rows("trial:9", [1.0, 1.0], 0, 0, 0, ok=False)
    rec = served_record(cs, r, 2, {"CUDA0": 6144 * MiB}, "rag")
    assert rec["pick"] == "fit:512"
    t9 = next(x for x in rec["results"] if x["key"] == "trial:9")
    assert t9["errors"] == ["boom", "boom"] and t9["request_s"]["samples"] == []


def test_a_partial_record_gives_no_verdict_while_a_finalist_waits():
    """Cut off after the references' runs (the four-H100 rag cell's first call): the first line says which
    finalist is still to serve and which contender is fastest so far, not "keep --fit"."""
    from tuner.served import waiting_finalists
    cs = REFS + [Served("trial:20", "trial 20", ("finalist",), trial=20)]
    r = rows("fit:512", [244.6], 590, 1.2, 24443) + rows("fit:2048", [137.5], 1210, 2.0, 24525)
    rec = dict(served_record(cs, r, 2, {"CUDA0": 23552 * MiB}, "rag"), partial=True)
    assert waiting_finalists(rec) == ["trial 20"]
    assert headline(rec) == ("rag: partial, no verdict yet (trial 20 not served); so far --fit -ub 2048 is the "
                             "fastest, 137.50 s mean request")
    # once it has run (or failed), the partial record judges as a whole one does
    done = dict(served_record(cs, r + rows("trial:20", [150.0], 1400, 1.9, 23000), 2, {"CUDA0": 23552 * MiB},
                              "rag"), partial=True)
    assert waiting_finalists(done) == [] and headline(done).startswith("rag: keep --fit -ub 2048")
    assert waiting_finalists(dict(rec, partial=False)) == []


def test_with_no_finalist_the_verdict_says_only_fit_was_compared():
    """A search that finished no run in its time (8 GiB rag on an H200 at --time-limit 7m): --fit's variants are
    still served, and the fastest of them is the answer, said as such, not as a finalist that lost."""
    r = rows("fit:512", [10.6, 10.5], 3000, 50, 7300) + rows("fit:2048", [8.0, 7.6], 5000, 50, 7360)
    rec = served_record(REFS, r, 2, {"CUDA0": 7168 * MiB}, "rag")
    assert rec["pick"] == rec["reference"] == "fit:2048"
    assert headline(rec).startswith("rag: keep --fit -ub 2048, the fastest of --fit's variants: 7.80 s mean request")
    assert "no finalist was served" in headline(rec) and "no finalist answered faster" not in headline(rec)
    with_one = served_record(REFS + [Served("trial:3", "trial 3", ("finalist",), trial=3)],
                             r + rows("trial:3", [9.0, 9.1], 4000, 49, 7000), 2, {"CUDA0": 7168 * MiB}, "rag")
    assert "no finalist answered faster than its 7.80 s" in headline(with_one)


def test_no_served_result_is_one_line():
    rec = served_record(REFS, rows("fit:512", [1.0], 1, 1, 1, ok=False), 1, {"CUDA0": 1}, "rag")
    assert rec["pick"] is None and "no served result" in headline(rec)


def test_a_time_study_says_what_it_recommends_first(tmp_path):
    """report --json's first key and summary.md's first line: the best trial's mean request time before any
    serving, the served verdict after (served_record's headline)."""
    import optuna

    from planner.hardware import resolve
    from planner.loader import load_model
    from tuner.objectives import bench_for
    from tuner.report import study_summary, summary_markdown
    from tuner.search import Tuner, StudyConfig
    from planner.workload import preset
    from runtime.sim import SimEngine
    inv, hw = load_model("preset:Qwen3-30B-A3B:Q4_K_M"), resolve("rtx4090-ddr5", "12GiB")
    w = preset("rag")
    t = Tuner(inv, hw, SimEngine(hw), StudyConfig(
        objective="time", bench=bench_for(w), requests=w, n_ctx=16640, pool_size=20, study_name="s",
        storage=f"sqlite:///{tmp_path / 's.db'}"))
    t.run(3)
    s = study_summary(t.study)
    assert list(s.to_dict())[0] == "headline" and s.headline.startswith("rag: trial ")
    assert "s mean (from its benchmark run; served on llama-server: not yet)" in s.headline
    assert summary_markdown(s).splitlines()[2] == s.headline
    rec = served_record(REFS[:1] + [Served("trial:0", "trial 0", ("finalist",), trial=0)],
                        rows("fit:512", [9.0, 9.5], 3000, 50, 6000) + rows("trial:0", [6.0, 6.1], 6000, 50, 6000),
                        2, {"CUDA0": 12 << 30}, "rag")
    optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 's.db'}").set_user_attr("served", rec)
    s = study_summary(optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 's.db'}"))
    assert s.headline == headline(rec) and s.to_dict()["served"]["pick"] == "trial:0"
    md = summary_markdown(s)
    assert "## Served on llama-server: the `rag` workload, 2 interleaved rounds" in md and "**pick**" in md
    # any other objective: no headline, the JSON as before
    t2 = Tuner(inv, hw, SimEngine(hw), StudyConfig(objective="tg", pool_size=20, study_name="s2"))
    t2.run(2)
    assert study_summary(t2.study).headline is None and "headline" not in study_summary(t2.study).to_dict()


def test_budgets_are_keyed_by_device_name():
    """Two H100s share the GPU name "H100": the budgets --fit and the pick are held to are per CUDA device."""
    from planner.hardware import from_gpu_sizes
    from tuner.served import gpu_memory
    hw = from_gpu_sizes("6GiB,8GiB")
    assert gpu_memory(hw) == {"CUDA0": 6 << 30, "CUDA1": 8 << 30}
    cs = REFS[:1] + [Served("trial:1", "trial 1", ("finalist",), trial=1)]
    r = rows("fit:512", [9.0, 9.0], 3000, 50, 6000) + rows("trial:1", [5.0, 5.0], 3000, 50, 6200)
    # 6200 MiB on CUDA0 is over its 6 GiB: the faster trial is not eligible
    assert served_record(cs, r, 2, gpu_memory(hw), "rag")["pick"] == "fit:512"


class GpuStandIn:
    """llama-server on a GPU, which this machine lacks (the real CPU server's runs carry no VRAM peaks, so no twin
    is ever made there: tests/runtime/test_tune_served.py): its peak is the memory model's prediction for the
    served plan less SERVER_LESS (the H100 finalists' servers used 0.3-1.0 GiB less than llama-bench), its request
    time falls as expert bytes move onto the GPU, and --fit fills the budget."""
    SERVER_LESS = 700 * MiB

    def __init__(self, tuner):
        self.t, self.runs, self.threads = tuner, [], []

    def measure_workload(self, inv, plan, workload):
        from dataclasses import replace

        from planner.engine_contract import Measurement
        served = replace(plan, knobs=replace(plan.knobs, n_ctx=workload.ctx, n_seq=workload.slots))
        peak = self.t.estimate(inv, served, self.t.hw).devices["CUDA0"].total - self.SERVER_LESS
        on_gpu = sum(t.nbytes for t in inv.allocated() if t.is_expert and plan.assignment[t.name] != "CPU")
        secs = 10.0 - on_gpu / (1 << 30)
        self.runs.append(("plan", plan.id))
        self.threads.append(plan.knobs.n_threads)
        return Measurement(1000.0, 40.0, {"CUDA0": peak}, raw={"mean_request_s": secs, "ttft_s": 1.0,
                                                                "command": "llama-server ...", "wall_s": 1.0})

    def fit_reference(self, inv, workload, budgets, ubatch, kv_type=None, threads=None):
        from planner.engine_contract import Measurement
        self.runs.append(("fit", ubatch, kv_type))
        self.threads.append(threads)
        return Measurement(900.0, 41.0, {"CUDA0": budgets["CUDA0"] + 100 * MiB},
                           raw={"mean_request_s": 9.0 + ubatch / 4096, "ttft_s": 2.0, "wall_s": 1.0})


def rag_tuners(tmp_path, kv_type: str):
    """A maker of one rag time study (Qwen3-30B-A3B Q4_K_M, an 8 GiB RTX 4090 box, the sim engine): each call
    opens it anew, as a resumed process would."""
    from planner.hardware import resolve
    from planner.loader import load_model
    from tuner.objectives import bench_for
    from tuner.options import StudyConfig
    from tuner.search import Tuner
    from tuner.space import SpaceConfig
    from planner.workload import preset
    from runtime.sim import SimEngine
    inv, hw = load_model("preset:Qwen3-30B-A3B:Q4_K_M"), resolve("rtx4090-ddr5", "8GiB")
    w = preset("rag")
    storage = f"sqlite:///{tmp_path / 's.db'}"

    def tuner():
        return Tuner(inv, hw, SimEngine(hw), StudyConfig(objective="time", bench=bench_for(w), requests=w,
                                                          n_ctx=16640, margin=1 << 30, pool_size=20, study_name="s",
                                                          storage=storage, config=SpaceConfig(kv_types=(kv_type,))))
    return tuner


def test_a_finalist_gets_a_filled_twin_that_uses_the_budget_the_server_left(tmp_path):
    """The server peaked under the budget: the twin moves experts onto the GPU up to the budget less FILL_LEFT
    (by the model shifted by the server's own peak), is served in every round, and can be the pick."""
    import time

    from planner.plan import Plan
    from tuner.records import StudyRecord
    from tuner.served import FILL_LEFT, confirm_served, filled_plan
    tuner = rag_tuners(tmp_path, "q8_0")
    t = tuner()
    t.run(4)
    server = GpuStandIn(t)
    budget = 8 << 30

    class Killed(Exception):
        pass

    def kill_at_4(done, total):
        if done == 4:
            raise Killed
    # killed after 4 samples, then resumed by a new process's tuner: nothing runs twice, nothing is lost
    with pytest.raises(Killed):
        confirm_served(t.measurer, server, rounds=2, n_finalists=1, progress=kill_at_4, drop_behind=None)
    assert len(server.runs) == 4
    rec = confirm_served(tuner().measurer, server, rounds=2, n_finalists=1, deadline=time.monotonic() + 3600,
                         drop_behind=None)
    assert len(server.runs) == 2 * len(rec["results"])
    keys = [r["key"] for r in rec["results"]]
    twin = next(k for k in keys if k.startswith("fill:"))
    parent = "trial:" + twin.split(":")[1]
    # a finalist with a quantized KV cache brings --fit at that KV type, at the fastest --fit's ubatch (512 here)
    kt = Plan.from_json(StudyRecord.of(t.study).serving["fills"][twin]).knobs.type_k
    assert kt == "q8_0"
    assert keys == ["fit:512", "fit:2048", "fit:4096", parent, "fit:512:q8_0", twin]
    serving = StudyRecord.of(t.study).serving
    assert sorted(r["key"] for r in serving["rows"]) == sorted(keys * 2)      # every contender, both rounds
    assert server.runs.count(("fit", 512, "q8_0")) == 2
    assert next(r for r in rec["results"] if r["key"] == "fit:512:q8_0")["name"] == "--fit -ctk/-ctv q8_0"
    p_plan = Plan.from_json(serving["fills"][twin])
    gpu_exps = [n for n, d in p_plan.assignment.items() if d != "CPU" and ".ffn_" in n and "_exps" in n]
    parent_plan = next(r for r in rec["results"] if r["key"] == parent)
    twin_res = next(r for r in rec["results"] if r["key"] == twin)
    assert len(gpu_exps) > 0
    # the twin's server peak is at the budget less FILL_LEFT, within one expert layer (its 48 layers: ~360 MiB)
    assert budget - FILL_LEFT - 400 * MiB <= twin_res["vram_device_bytes"]["CUDA0"] <= budget - FILL_LEFT
    assert twin_res["vram_device_bytes"]["CUDA0"] > parent_plan["vram_device_bytes"]["CUDA0"]
    assert rec["pick"] == twin and rec["results"][-1]["name"].endswith("filled")
    # nothing left to fill: the twin of the twin is the twin itself; a CPU run (no peaks) makes none
    assert filled_plan(t.measurer, p_plan, {"CUDA0": budget - FILL_LEFT}) is None
    assert filled_plan(t.measurer, p_plan, {}) is None
    # resumed: the stored samples and twin are taken, nothing runs again
    n = len(server.runs)
    again = confirm_served(tuner().measurer, server, rounds=2, n_finalists=1)
    assert len(server.runs) == n and again["pick"] == twin


def test_a_contender_far_behind_is_not_served_again():
    """far_behind: a reference against the fastest reference, a finalist against the fastest run of all; the
    fastest of each is never dropped, nor one inside the factor; a failed run is no run."""
    from tuner.served import far_behind
    cs = REFS + [Served("fit:4096", "--fit -ub 4096", ("reference",), ubatch=4096),
                 Served("trial:3", "trial 3", ("finalist",), trial=3), Served("fill:3", "trial 3 filled",
                                                                             ("finalist",), trial=3, filled=True)]
    r = (rows("fit:512", [14.0], 3000, 50, 6200) + rows("fit:2048", [10.0], 5000, 50, 6300)
         + rows("fit:4096", [12.9], 5000, 50, 6300) + rows("trial:3", [8.0], 9000, 49, 6000)
         + rows("fill:3", [5.0], 9000, 49, 6000, ok=False))
    # 14/10 > 1.3; 12.9/10 is not; trial 3 is the fastest run of all
    assert far_behind(cs, r) == {"fit:512": pytest.approx(1.4)}
    # its twin's good run at 5 s makes trial 3 1.6x behind the fastest of all; references still race each other
    r += [ServedRun.from_dict({"round": 1, "key": "fill:3", "ok": True, "request_s": 5.0})]
    assert far_behind(cs, r) == {"fit:512": pytest.approx(1.4), "trial:3": pytest.approx(1.6)}
    assert far_behind(cs, r, None) == {}
    rec = served_record(cs, r, 2, {"CUDA0": 6144 * MiB}, "rag", drop_behind=1.3)
    assert {x["key"]: x["dropped"] for x in rec["results"]}["fit:512"] == pytest.approx(1.4)
    assert rec["reference"] == "fit:2048" and rec["pick"] == "fill:3"


def test_confirm_served_drops_the_far_behind_and_resumes_the_same(tmp_path):
    """With the stand-in server: contenders far behind after their first round are not served in the second; a
    resumed confirmation serves nothing again and keeps the same record."""
    import time

    from tuner.served import DROP_BEHIND, confirm_served
    tuner = rag_tuners(tmp_path, "f16")
    t = tuner()
    t.run(4)
    server = GpuStandIn(t)
    rec = confirm_served(t.measurer, server, rounds=2, n_finalists=1, deadline=time.monotonic() + 3600)
    times = {x["key"]: x["request_s"]["samples"] for x in rec["results"]}
    best = min(min(v) for v in times.values())
    dropped = {x["key"] for x in rec["results"] if x["dropped"]}
    assert dropped, times                          # the stand-in's finalist is far behind its filled twin
    for x in rec["results"]:
        bar = min(min(times[k]) for k in ("fit:512", "fit:2048", "fit:4096")) if x["roles"] == ["reference"] \
            else best
        assert (len(x["request_s"]["samples"]) == 1) == (x["key"] in dropped)
        assert (min(x["request_s"]["samples"]) > DROP_BEHIND * bar) == (x["key"] in dropped)
    assert len(server.runs) == 2 * len(rec["results"]) - len(dropped)
    n = len(server.runs)
    again = confirm_served(tuner().measurer, server, rounds=2, n_finalists=1)
    assert len(server.runs) == n and again["results"] == rec["results"]


def test_a_confirmation_resumed_on_another_machine_serves_everything_again(tmp_path, monkeypatch):
    """Rows of a machine that is gone (a GPU machine given back between sessions) are set aside, not compared with
    the new machine's: every contender is served again there, and the old rows stay in the record."""
    import time

    from tuner import served
    from tuner.records import StudyRecord
    tuner = rag_tuners(tmp_path, "f16")
    t = tuner()
    t.run(4)
    server = GpuStandIn(t)
    assert served.machine_id() == served.machine_id() != ""
    monkeypatch.setattr(served, "machine_id", lambda: "machine-a")
    served.confirm_served(t.measurer, server, rounds=2, n_finalists=1, deadline=time.monotonic() + 3600,
                          drop_behind=None)
    first = StudyRecord.of(t.study).serving
    assert first["rows"] and {r["machine"] for r in first["rows"]} == {"machine-a"} and first["elsewhere"] == []
    n = len(server.runs)
    monkeypatch.setattr(served, "machine_id", lambda: "machine-b")
    rec = served.confirm_served(tuner().measurer, server, rounds=2, n_finalists=1, drop_behind=None)
    again = StudyRecord.of(t.study).serving
    assert len(server.runs) == 2 * n and {r["machine"] for r in again["rows"]} == {"machine-b"}
    assert again["elsewhere"] == first["rows"] and rec["pick"] is not None


def test_served_at_one_thread_count_every_contender_runs_with_it_and_another_count_serves_again(tmp_path):
    """threads=N: the references and the finalists (twins too) all at -t N, each row marked; a confirmation at
    another count (here: each its own) compares none of those rows and serves everything again."""
    import time

    from tuner import served
    from tuner.records import StudyRecord
    tuner = rag_tuners(tmp_path, "f16")
    t = tuner()
    t.run(4)
    server = GpuStandIn(t)
    served.confirm_served(t.measurer, server, rounds=1, n_finalists=1, deadline=time.monotonic() + 3600, threads=24)
    first = StudyRecord.of(t.study).serving["rows"]
    assert set(server.threads) == {24} and {r["threads"] for r in first} == {24}
    assert ("plan" in {r[0] for r in server.runs}) and ("fit" in {r[0] for r in server.runs})
    n = len(server.runs)
    served.confirm_served(tuner().measurer, server, rounds=1, n_finalists=1, deadline=time.monotonic() + 3600)
    again = StudyRecord.of(t.study).serving
    assert len(server.runs) == 2 * n and all("threads" not in r for r in again["rows"])
    assert again["elsewhere"] == first and None in server.threads[n:]


def test_a_confirmation_with_other_finalists_keeps_the_first_rows_aside(tmp_path):
    """Another number of finalists is another set of contenders: everything is served again, and the rows of the
    first set stay in the record ("elsewhere"), not dropped."""
    import time

    from tuner import served
    from tuner.records import StudyRecord
    tuner = rag_tuners(tmp_path, "f16")
    t = tuner()
    t.run(4)
    server = GpuStandIn(t)
    served.confirm_served(t.measurer, server, rounds=1, n_finalists=2, deadline=time.monotonic() + 3600,
                          drop_behind=None)
    first = StudyRecord.of(t.study).serving
    assert first["keys"] != [c.key for c in served.contenders(tuner().measurer, 1)]
    served.confirm_served(tuner().measurer, server, rounds=1, n_finalists=1, deadline=time.monotonic() + 3600,
                          drop_behind=None)
    again = StudyRecord.of(t.study).serving
    assert again["elsewhere"] == first["rows"] and again["rows"] and again["rows"] != first["rows"]


def test_a_ttft_limit_picks_among_the_contenders_that_meet_it():
    cs = REFS + [Served("trial:3", "trial 3", ("finalist",), trial=3), Served("trial:5", "trial 5", ("finalist",),
                                                                              trial=5)]

    def with_ttft(rs: list[ServedRun], worst: float) -> list[ServedRun]:
        return [replace(r, ttft_max_s=worst) for r in rs]
    r = (with_ttft(rows("fit:512", [10.0, 10.4], 3000, 50, 6000), 2.5)
         + with_ttft(rows("fit:2048", [8.0, 8.2], 5000, 50, 6000), 3.5)      # the fastest --fit misses 3 s
         + with_ttft(rows("trial:3", [7.0, 7.1], 9000, 49, 6000), 2.0)
         + with_ttft(rows("trial:5", [5.0, 5.1], 4000, 55, 6000), 4.0))      # fastest of all, misses 3 s
    rec = served_record(cs, r, 2, {"CUDA0": 6144 * MiB}, "rag", ttft_limit_s=3.0)
    assert rec["reference"] == "fit:512" and rec["pick"] == "trial:3" and rec["pick_meets_ttft"]
    assert rec["results"][2]["ttft_max_s"]["median"] == 2.0
    assert headline(rec).startswith("rag: trial 3 answers in 7.05 s mean, --fit in 10.20 s")
    # without the limit: the fastest of all
    assert served_record(cs, r, 2, {"CUDA0": 6144 * MiB}, "rag")["pick"] == "trial:5"
    # nobody meets 1 s: the fastest, and the first line says the limit was missed
    rec = served_record(cs, r, 2, {"CUDA0": 6144 * MiB}, "rag", ttft_limit_s=1.0)
    assert rec["pick"] == "trial:5" and rec["pick_meets_ttft"] is False
    assert headline(rec).startswith("misses the 1 s TTFT limit (no contender met it; slowest class 4.00 s): rag: "
                                    "trial 5 answers in 5.05 s mean")


def test_every_served_run_says_a_line_as_it_ends(tmp_path):
    """Issue 41: a line per server run (contender, round r of R, load and request seconds, TTFT, VRAM per GPU,
    runs left and the minutes they take by the runs so far), the last with none left."""
    import re
    import time

    from tuner.served import confirm_served
    t = rag_tuners(tmp_path, "f16")()
    t.run(4)
    server, lines = GpuStandIn(t), []
    rec = confirm_served(t.measurer, server, rounds=2, n_finalists=1, deadline=time.monotonic() + 3600,
                         drop_behind=None, say=lines.append)
    assert rec and len(lines) == len(server.runs)
    line = re.compile(r"# served (\d+): (.+), round ([12]) of 2: loaded in \d+ s, (\d+\.\d\d) s mean request, "
                      r"TTFT \d+\.\d\d s, VRAM CUDA0 [\d.]+ [GM]iB; (\d+) runs? left(, about \d+ min)?")
    parsed = [line.fullmatch(x) for x in lines]
    assert all(parsed), "\n".join(x for x, m in zip(lines, parsed) if not m)
    assert [int(m[1]) for m in parsed] == list(range(1, len(lines) + 1))
    assert {m[2] for m in parsed} >= {"--fit", "--fit -ub 2048", "--fit -ub 4096"}
    assert int(parsed[-1][5]) == 0 and parsed[-1][6] is None            # the last: nothing left, no estimate
    assert int(parsed[0][5]) > 0 and parsed[0][6] == ", about 1 min"     # 1 s a run here: rounded up to a minute
