"""The torch engine on a real GPU: the same logits as the reference and as the CPU, CUDA-graph decode equal to
eager decode, the GPU expert kernels equal to the plain loop, uploads counted as on logical GPUs."""
from __future__ import annotations

import pytest
import torch

from planner.engine_contract import BenchRun
from runtime.torch_engine import TorchEngine
from runtime.torch_engine import kernels as K
from torch_plans import ARCHS, PLACEMENTS, experts_in_ram, knobs, plan_for, rel, tiny_inventory, untied_prompt

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GPU_PLACEMENTS = [p for p in PLACEMENTS if p[0] != "two_gpus" or torch.cuda.device_count() > 1]
# the kernels on cuda:0 and, where there is one, on cuda:1 while cuda:0 is current: Triton launches on the current
# device, so a launch not guarded by the tensors' device reads another GPU's addresses (kernels.on_device)
KERNEL_DEVICES = ["cuda:0"] + (["cuda:1"] if torch.cuda.is_available() and torch.cuda.device_count() > 1 else [])


@pytest.fixture(params=KERNEL_DEVICES)
def dev(request) -> torch.device:
    torch.cuda.set_device(0)
    return torch.device(request.param)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype,tol", [("fp32", 1e-5), ("bf16", 1e-2)])
def test_gpu_logits_match_reference_under_every_placement(arch: str, dtype: str, tol: float) -> None:
    inv = tiny_inventory(arch)
    engine = TorchEngine(compute_dtype=dtype, compile=False)
    prompt = ref = None
    for label, assign, k in GPU_PLACEMENTS:
        model = engine.load(inv, plan_for(inv, assign, k), min_cells=64)
        if prompt is None:
            prompt, ref = untied_prompt(inv, model, 8)
        logits, _ = model.forward(prompt, 0, n_out=8)
        assert rel(logits, ref) < tol, f"{arch} {dtype} {label}"
        model.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_graph_decode_equals_eager_decode(arch: str) -> None:
    inv = tiny_inventory(arch)
    plan = plan_for(inv, experts_in_ram, knobs())
    eager = TorchEngine(compute_dtype="fp32", use_cuda_graphs=False).load(inv, plan, min_cells=300)
    # torch.compile'd decode helpers on one arch (compiling is slow; the others run the same graphs uncompiled)
    graphs = TorchEngine(compute_dtype="fp32", compile=arch == "qwen3moe").load(inv, plan, min_cells=300)
    assert graphs.use_graphs
    # 270 steps cross a 256-cell decode bucket (a second graph) and wrap gpt-oss's sliding-window ring
    a = eager.generate([3, 1, 4, 1, 5], n_gen=270)
    b = graphs.generate([3, 1, 4, 1, 5], n_gen=270)
    assert a == b
    for m in (eager, graphs):
        m.close()


@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek2"])
def test_prompt_ubatch_graphs_equal_eager(arch: str) -> None:
    """A ubatch without uploads replays CUDA graphs from its second run on: same logits as eager runs."""
    inv = tiny_inventory(arch)
    plan = plan_for(inv, PLACEMENTS[0][1], knobs())
    # bf16: the grouped expert path (fp32 takes the per-expert loop, which reads counts on the host: eager)
    eager = TorchEngine(use_cuda_graphs=False).load(inv, plan, min_cells=256)
    graphs = TorchEngine().load(inv, plan, min_cells=256)
    for seed in range(3):
        tok = torch.randint(0, inv.hparams.n_vocab, (64,), generator=torch.Generator().manual_seed(seed))
        a, _ = eager.forward(tok, 0, n_out=4)
        b, _ = graphs.forward(tok, 0, n_out=4)
        assert rel(b, a) < 1e-3, seed
    program = graphs.program(64, 4, 256)
    assert program.graphs is not None and not program.graph_failed
    for m in (eager, graphs):
        m.close()


def test_moe_kernels_equal_the_loop(dev: torch.device) -> None:
    torch.manual_seed(0)
    E, D, N, A = 16, 256, 384, 4
    table = torch.randn(E, N, D, device=dev, dtype=torch.bfloat16) / 16          # [E, 2F, D] as ffn_*_exps
    down = torch.randn(E, D, N // 2, device=dev, dtype=torch.bfloat16) / 16
    for T in (1, 3, 8, 64):
        x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(E, device=dev)[:A] for _ in range(T)])
        w = torch.rand(T, A, device=dev)
        ref_up = K._loop_up(x, ids, [table])
        got_up = K.experts_up(x, ids, [table], [None]).float()
        assert rel(got_up, ref_up) < 1e-2, T
        h = K.activation(got_up.to(torch.bfloat16), N // 2, "silu")
        assert rel(K.experts_down(h, ids, w, down), K._loop_down(h, ids, w, down)) < 1e-2, T


@pytest.mark.parametrize("gating,norm,scale,with_bias", [("softmax", True, 0.0, False), ("sigmoid", True, 2.5, True),
                                                         ("softmax_weight", False, 0.0, True)])
def test_triton_routing_equals_route(gating: str, norm: bool, scale: float, with_bias: bool, dev: torch.device) -> None:
    torch.manual_seed(1)
    x = torch.randn(3, 256, device=dev, dtype=torch.bfloat16)
    w = torch.randn(64, 256, device=dev) / 16
    bias = torch.randn(64, device=dev) / 4 if with_bias else None
    probs_b = torch.rand(64, device=dev) / 10 if gating == "sigmoid" else None
    ids, wt = K.route_fast(x, w, bias, 8, gating, norm, scale, probs_b)
    logits = torch.nn.functional.linear(x.float(), w, bias)
    ids2, wt2 = K.route(logits, 8, gating, norm, scale, probs_b)
    assert torch.equal(ids.sort(-1).values, ids2.sort(-1).values)
    order, order2 = ids.argsort(-1), ids2.argsort(-1)
    assert torch.allclose(wt.gather(-1, order), wt2.gather(-1, order2), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("H,Hkv,Dk,Dv,pos", [(8, 2, 64, 64, 0), (6, 3, 40, 24, 77), (32, 4, 128, 128, 300)])
def test_decode_attention_kernel_equals_attention(H: int, Hkv: int, Dk: int, Dv: int, pos: int,
                                                  dev: torch.device) -> None:
    """The Triton decode kernels write the token's k/v into cell pos and attend to cells 0..pos, as
    index_copy_ + attention() with the causal mask do."""
    torch.manual_seed(3)
    cells = 512
    ck = torch.randn(Hkv, cells, Dk, device=dev)
    cv = torch.randn(Hkv, cells, Dv, device=dev)
    q, k, v = torch.randn(H, Dk, device=dev), torch.randn(Hkv, Dk, device=dev), torch.randn(Hkv, Dv, device=dev)
    p = torch.tensor([pos], device=dev)
    ck2, cv2 = ck.clone(), cv.clone()
    got = K.decode_attention(q, k, v, ck, cv, p, 0.125, cells)
    ck2[:, pos], cv2[:, pos] = k, v
    want = K.attention(q[None], ck2, cv2, K.causal_mask(p, cells), 0.125)[0]
    assert torch.equal(ck, ck2) and torch.equal(cv, cv2)
    assert rel(got, want) < 1e-5


def test_grouped_experts_on_gpu_match_the_loop(dev: torch.device) -> None:
    torch.manual_seed(2)
    T, E, A, D, F = 64, 16, 4, 256, 128
    x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device=dev)[:A] for _ in range(T)])
    w = torch.rand(T, A, device=dev)
    up = torch.randn(E, 2 * F, D, device=dev, dtype=torch.bfloat16) / 16
    down = torch.randn(E, D, F, device=dev, dtype=torch.bfloat16) / 16
    want = K._loop_down(K.activation(K._loop_up(x, ids, [up]), F, "silu").to(torch.bfloat16), ids, w, down)
    for combine_fn in (K.unsort_combine, K.combine):        # the Triton weighted sum and the torch one
        got = K.grouped_experts(x, ids, w, [up], down, F, "silu", combine_fn=combine_fn)
        assert rel(got, want) < 2e-2


@pytest.mark.parametrize("kind,n_rot,normed", [("neox", 128, True), ("norm", 64, True), ("neox", 64, False)])
def test_qk_rope_kernel_equals_rms_norm_then_rope(kind: str, n_rot: int, normed: bool, dev: torch.device) -> None:
    torch.manual_seed(5)
    T, H, Dk = 100, 6, 128
    qkv = torch.randn(T, H * Dk + 64, device=dev, dtype=torch.bfloat16)
    q = qkv[:, :H * Dk].view(T, H, Dk)                   # a strided view, as the fused QKV output gives
    qn = torch.rand(Dk, device=dev) + 0.5 if normed else None
    cos, sin = K.rope_tables(4096, n_rot, 1e6, dev)
    pos = torch.randint(0, 4096, (T,), device=dev)
    got = K.qk_rope(q, qn, pos, cos, sin, 1e-6, n_rot, kind)
    x = K.rms_norm(q, qn, 1e-6) if normed else q
    want = K.rope(x, cos.index_select(0, pos), sin.index_select(0, pos), n_rot, kind)
    assert rel(got, want) < 1e-2          # bf16: one rounding apart at most


def test_combine_kernel_equals_the_torch_weighted_sum(dev: torch.device) -> None:
    torch.manual_seed(3)
    T, A, D = 300, 8, 2048 + 64          # D not a multiple of the column block: the masked tail
    y = torch.randn(T * A, D, device=dev, dtype=torch.bfloat16)
    inverse = torch.randperm(T * A, device=dev).to(torch.int32)
    w = torch.rand(T, A, device=dev)
    assert rel(K.combine(y, inverse, w), K.unsort_combine(y, inverse, w)) < 1e-6


@pytest.mark.parametrize("gating,norm,scale,probs", [("softmax", True, 1.0, False), ("softmax", False, 2.5, False),
                                                     ("sigmoid", True, 2.5, True),
                                                     ("softmax_weight", True, 1.0, False)])
def test_select_kernel_matches_route(gating: str, norm: bool, scale: float, probs: bool, dev: torch.device) -> None:
    """The prompt-ubatch selection kernel against route(): the same experts, the same weights."""
    torch.manual_seed(4)
    T, E, A = 512, 128, 8
    logits = torch.randn(T, E, device=dev)
    pb = torch.randn(E, device=dev) * 0.1 if probs else None
    ids, w = K.select(logits, None, A, gating, norm, scale, pb)
    ids_ref, w_ref = K.route(logits, A, gating, norm, scale, pb)
    assert torch.equal(ids.sort(-1).values, ids_ref.sort(-1).values)
    assert rel(w.gather(-1, ids.argsort(-1)), w_ref.gather(-1, ids_ref.argsort(-1))) < 1e-5


def test_measure_on_gpu_reports_cuda_peaks_and_counters() -> None:
    inv = tiny_inventory("qwen3moe")
    m = TorchEngine(compile=False).measure(inv, plan_for(inv, experts_in_ram, knobs()),
                                           BenchRun(n_prompt=64, n_gen=8, repetitions=2))
    assert m.ok, m.error
    assert m.raw["logical_gpus"] is False and m.raw["cuda_graphs"] is True
    assert m.peak_bytes["CUDA0"] > 0 and m.raw["pp_counters_per_run"]["upload_bytes"] > 0
