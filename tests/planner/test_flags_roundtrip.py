"""Property tests: render(plan) parses back to exactly plan.assignment and the knobs the dialect can express.

Plans are random over tiny inventories of several architectures and full-size ones (DeepSeek-V3: 61 blocks, 256
experts; GLM-4.5: 92 blocks + 1 NextN; gpt-oss-120b: 36 blocks with expert biases). A plan starts from a random
-ngl/-ts layout (1-3 GPUs) and then moves expert tensors per layer and per up/gate/down, parts of layers,
token_embd and the output layer at random; knobs are random within what the dialect can say.
"""
from __future__ import annotations

import random
import re
import shlex

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.archs import ArchSpec, build_inventory
from planner.flags import home_devices, int_set_regex, knob_fields, parse, render
from planner.flags.cmdline import moot_knobs
from planner.flags.common import SLOT_RULES, base_assignment, slot_devices
from planner.model import Hparams, ModelInventory
from planner.plan import FULL_PRECISION_KV, KV_TYPES, Knobs, OffloadPolicy, OpRule, Plan
from planner.presets import load_preset, preset_names


def _inv(arch: str, n: int, *, embd: int, vocab: int, heads: int, kv: int, hd: int, ff: int, experts: int,
         used: int, ff_exp: int, shared: int = 0, lead: int = 0, nextn: int = 0, tied: bool = False,
         mla: bool = False, features: frozenset[str] = frozenset()) -> ModelInventory:
    hp = Hparams(arch=arch, n_layer=n, n_embd=embd, n_vocab=vocab, n_head=heads, n_head_kv=(kv,) * n,
                 head_dim_k=192 if mla else hd, head_dim_v=128 if mla else hd, n_ctx_train=4096, n_ff=ff,
                 n_expert=experts, n_expert_used=used, n_ff_exp=ff_exp, n_expert_shared=shared,
                 n_ff_shexp=ff_exp * shared, moe_layers=tuple(experts > 0 and i >= lead for i in range(n)),
                 mla_kv_lora_rank=512 if mla else 0, n_rot=64, n_nextn=nextn)
    spec = ArchSpec(hp, features, q_lora_rank=1536 if mla else 0, head_dim_k_mla=192 if mla else 0,
                    head_dim_v_mla=128 if mla else 0)
    return build_inventory(spec, lambda name, shape, layer: "F16", tied_output=tied)


TINY = [
    _inv("qwen3moe", 4, embd=64, vocab=256, heads=4, kv=2, hd=16, ff=0, experts=8, used=2, ff_exp=32, lead=1),
    _inv("qwen3moe", 12, embd=64, vocab=256, heads=4, kv=2, hd=16, ff=0, experts=8, used=2, ff_exp=32),
    _inv("glm4moe", 6, embd=64, vocab=256, heads=4, kv=2, hd=16, ff=128, experts=8, used=2, ff_exp=32, shared=1,
         lead=1, nextn=1),
    _inv("deepseek2", 5, embd=64, vocab=256, heads=4, kv=4, hd=16, ff=128, experts=8, used=2, ff_exp=32, shared=1,
         lead=2, tied=True, mla=True, features=frozenset({"probs_b"})),
    _inv("gpt-oss", 4, embd=64, vocab=256, heads=4, kv=2, hd=16, ff=0, experts=8, used=2, ff_exp=64),
    _inv("llama", 3, embd=64, vocab=256, heads=4, kv=2, hd=16, ff=128, experts=0, used=0, ff_exp=0),
]
LARGE = [
    _inv("deepseek2", 61, embd=7168, vocab=129280, heads=128, kv=128, hd=128, ff=18432, experts=256, used=8,
         ff_exp=2048, shared=1, lead=3, mla=True, features=frozenset({"probs_b"})),
    _inv("glm4moe", 93, embd=5120, vocab=151552, heads=96, kv=8, hd=128, ff=12288, experts=160, used=8,
         ff_exp=1536, shared=1, lead=3, nextn=1),
    _inv("gpt-oss", 36, embd=2880, vocab=201088, heads=64, kv=8, hd=64, ff=0, experts=128, used=4, ff_exp=2880),
]
# every preset, at its real size and quant recipe
PRESETS = [load_preset(name).inventory() for name in preset_names()]
EXPERT_ROLES = ("exps_up", "exps_gate", "exps_down")


@st.composite
def knobs_for(draw, dialect: str, tool: str) -> Knobs:
    k = dict(
        n_ctx=draw(st.sampled_from([512, 4096, 32768, 131072])),
        n_batch=draw(st.sampled_from([512, 2048, 4096])),
        n_ubatch=draw(st.sampled_from([128, 512, 1024, 4096])),
        n_threads=draw(st.sampled_from([0, 8, 32])),
        flash_attn=draw(st.booleans()),
        type_k=draw(st.sampled_from(KV_TYPES[1:])), type_v=draw(st.sampled_from(KV_TYPES[1:])),
        no_kv_offload=draw(st.booleans()), mmap=draw(st.booleans()),
    )
    if k["type_v"] not in FULL_PRECISION_KV:
        k["flash_attn"] = True            # both engines refuse a quantized V cache without flash attention
    if tool != "bench":
        k["n_seq"] = draw(st.sampled_from([1, 1, 2, 4]))
    mb = draw(st.sampled_from([32, 32, 64, 512]))
    if dialect == "mainline":
        k["offload"] = OffloadPolicy.all(draw(st.booleans()), mb)
        k["no_host"] = draw(st.booleans())
        if tool != "bench":
            k["swa_full"] = draw(st.booleans())
    else:
        on = {op: (draw(st.booleans()) if tool != "bench" else True)
              for op in ("dense_matmul", "moe_matmul", "moe_fused_up_gate")}
        k["offload"] = OffloadPolicy(**{op: OpRule(v, mb) for op, v in on.items()},
                                     output=OpRule(on["dense_matmul"], mb))
        k["only_active_experts"] = draw(st.booleans())
        k["mla"] = draw(st.sampled_from([1, 2, 3]))
        k["amb"] = draw(st.sampled_from([0, 256, 512]))
        k["fmoe"] = draw(st.booleans())
        if draw(st.integers(0, 9)) == 0:
            k["rtr"], k["mmap"] = True, False
    return Knobs(**k)


@st.composite
def plans(draw, pool: list[ModelInventory], dialect: str) -> tuple[ModelInventory, Plan, str]:
    inv = draw(st.sampled_from(pool))
    tool = draw(st.sampled_from(["server", "cli", "bench"]))
    rnd = random.Random(draw(st.integers(0, 2**32 - 1)))   # bulk choices: cheap; the structure stays shrinkable
    n_layer = inv.hparams.n_layer
    n_gpus = draw(st.sampled_from([0, 1, 1, 1, 2, 2, 3]))
    gpus = [f"CUDA{i}" for i in range(n_gpus)]
    devices = ["CPU"] + gpus
    ngl = draw(st.integers(0, n_layer + 1))
    ts = [rnd.randint(0, 4) for _ in gpus] if n_gpus > 1 else None
    if ts and not any(ts):
        ts[0] = 1
    slots = slot_devices(n_layer, ngl, SLOT_RULES[dialect], gpus, ts) if gpus else ["CPU"] * (n_layer + 1)
    a = base_assignment(inv, slots)
    # experts: per layer and per up/gate/down, in one of a few styles
    style = draw(st.sampled_from(["keep", "prefix", "suffix", "per_layer", "per_tensor"]))
    moe = inv.moe_layers()
    cut = rnd.randint(0, len(moe))
    for i, layer in enumerate(moe):
        if style == "keep":
            break
        layer_dev = rnd.choice(devices)
        for t in inv.by_layer[layer]:
            if not t.is_expert:
                continue
            if style == "prefix":
                dev = "CPU" if i < cut else a[t.name]
            elif style == "suffix":
                dev = "CPU" if i >= cut else a[t.name]
            elif style == "per_layer":
                dev = layer_dev
            else:
                dev = rnd.choice(devices) if t.role in EXPERT_ROLES and rnd.random() < 0.5 else a[t.name]
            a[t.name] = dev
    # partial layers: a few random tensors elsewhere
    names = list(a)
    for _ in range(draw(st.sampled_from([0, 0, 1, 3, 10]))):
        a[rnd.choice(names)] = rnd.choice(devices)
    if gpus and rnd.random() < 0.05:
        a["token_embd.weight"] = rnd.choice(gpus)
    if rnd.random() < 0.1:
        for n in ("output.weight", "output_norm.weight"):
            if n in a:
                a[n] = rnd.choice(devices)
    knobs = draw(knobs_for(dialect, tool))
    return inv, Plan("m", a, knobs, dialect), tool   # type: ignore[arg-type]


def check_round_trip(inv: ModelInventory, plan: Plan, tool: str) -> None:
    rc = render(plan, inv, tool)
    back = parse(rc, inv, plan.dialect, tool=tool)
    assert back.assignment == plan.assignment
    moot = moot_knobs(plan.knobs, inv.hparams.is_mla)       # ik's -mla without MLA: not written, read as default
    for f in knob_fields(plan.dialect, tool) - moot:
        assert getattr(back.knobs, f) == getattr(plan.knobs, f), f
    # every -ot pattern we wrote: no comma, compiles, and the whole line survives the shell
    for ov in back.overrides:
        assert "," not in ov.pattern and "=" not in ov.pattern
        re.compile(ov.pattern)
    assert parse(shlex.split(rc.shell()), inv, plan.dialect).assignment == plan.assignment
    if not any(n.startswith("W101") for n in rc.notes):     # layer homes expressible: KV lands where planned
        homes = home_devices(plan.assignment, inv)
        assert all(h is None or h == d for h, d in zip(homes, back.layer_devices))


ROUNDTRIP = settings(max_examples=1000, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.slow
@pytest.mark.parametrize("dialect", ["mainline", "ik"])
@ROUNDTRIP
@given(data=st.data())
def test_round_trip_tiny(dialect, data):
    check_round_trip(*data.draw(plans(TINY, dialect)))


@pytest.mark.slow
@pytest.mark.parametrize("dialect", ["mainline", "ik"])
@ROUNDTRIP
@given(data=st.data())
def test_round_trip_large(dialect, data):
    check_round_trip(*data.draw(plans(LARGE, dialect)))


@pytest.mark.slow
@pytest.mark.parametrize("dialect", ["mainline", "ik"])
@ROUNDTRIP
@given(data=st.data())
def test_round_trip_every_preset(dialect, data):
    check_round_trip(*data.draw(plans(PRESETS, dialect)))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.sets(st.integers(0, 150), min_size=1, max_size=40))
def test_int_set_regex_matches_exactly_and_never_uses_commas(values):
    rx = int_set_regex(values)
    assert "," not in rx and "{" not in rx
    compiled = re.compile(f"blk\\.({rx})\\.")
    assert {i for i in range(0, 200) if compiled.search(f"blk.{i}.x")} == values
