"""kernels/logit_max.py: the per-head causal maximum of q . k that QK-Clip compares with tau,
against an independent float64 reference, on both backends (Triton in the interpreter on CPU),
and the kernel compiled for the GPUs (kernels/aot.py)."""
import pytest
import torch

from kernels import aot
from kernels.logit_max import BLOCK, causal_logit_max
from kernels.logit_max_triton import num_warps

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # bench/gpu_check.sh runs this file on a GPU
cpu_only = pytest.mark.skipif(DEVICE == "cuda", reason="CPU work (builds, inductor on CPU): CI runs it")


def reference(q, k):
    """max over b and j <= i of q_i . k_j, in float64 from every pair's logit."""
    logits = torch.einsum("bhid,bhjd->bhij", q.cpu().double(), k.cpu().double())
    T = q.size(-2)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    return logits.masked_fill(future, -float("inf")).amax(dim=(0, 2, 3))


def heads(B, H, T, D, dtype=torch.float32, seed=0):
    """q, k as the model makes them: strided views of one fused projection's output."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, 3 * H * D, generator=gen).to(device=DEVICE, dtype=dtype)
    q, k, _ = (t.view(B, T, H, D).transpose(1, 2) for t in x.split(H * D, dim=2))
    return q, k


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("B, H, T, D", [(2, 3, 40, 16), (1, 2, BLOCK + 6, 24), (2, 1, 2 * BLOCK, 64)])
def test_causal_logit_max_matches_the_float64_reference(backend, B, H, T, D):
    # T below, just above and at multiples of the tile; D not a power of two (padded)
    q, k = heads(B, H, T, D)
    assert not q.is_contiguous()
    got = causal_logit_max(q, k, backend=backend)
    assert got.dtype == torch.float32 and got.shape == (H,)
    torch.testing.assert_close(got.cpu().double(), reference(q, k), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bf16_operands_are_multiplied_exactly_and_summed_in_fp32(backend):
    q, k = heads(2, 2, BLOCK + 3, 32, dtype=torch.bfloat16)
    torch.testing.assert_close(causal_logit_max(q, k, backend=backend).cpu().double(), reference(q, k),
                               rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_future_pairs_do_not_count(backend):
    # the largest product pairs the first query with the last key (j > i: masked); the largest
    # allowed one is the last query with itself
    B, H, T, D = 1, 1, BLOCK + 10, 16
    q, k = torch.zeros(B, H, T, D, device=DEVICE), torch.zeros(B, H, T, D, device=DEVICE)
    q[..., 0, 0], k[..., -1, 0] = 100.0, 100.0  # 10^4, in the future of query 0
    q[..., -1, 1], k[..., -1, 1] = 3.0, 4.0     # 12, on the diagonal
    assert causal_logit_max(q, k, backend=backend).item() == 12.0


@cpu_only
def test_the_kernel_compiles_for_both_gpus():
    """fp32 and bf16 operands (GPT-2 small: d_head 64) on sm_80 and sm_90, launched as the
    wrapper launches them, without register spills."""
    specs = []
    for target in aot.TARGETS:
        for dtype in ("fp32", "bf16"):
            signature = {"Q": f"*{dtype}", "K": f"*{dtype}", "Out": "*fp32", "T": "i32", "D": "i32", "H": "i32",
                         "n_blocks": "i32", "sqb": "i32", "sqh": "i32", "sqt": "i32", "sqd": "constexpr",
                         "skb": "i32", "skh": "i32", "skt": "i32", "skd": "constexpr",
                         "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_D": "constexpr",
                         "CAST_FP32": "constexpr", "PRECISION": "constexpr"}
            constexprs = {"sqd": 1, "skd": 1, "BLOCK_M": BLOCK, "BLOCK_N": BLOCK, "BLOCK_D": 64, "CAST_FP32": False,
                          "PRECISION": "ieee" if dtype == "fp32" else "tf32"}
            specs.append(dict(module="kernels.logit_max_triton", function="_causal_max_kernel", signature=signature,
                              constexprs=constexprs, target=target, num_warps=num_warps(aot.TORCH_DTYPES[dtype]),
                              num_stages=2, dtype=dtype))
    results = aot.run(specs, n_jobs=2, builder=aot.build_function)
    for result in results:
        assert result["ok"], f"{result['target']} {result['dtype']}: {result.get('error')}"
        assert result["spill_stores"] == 0, result


@cpu_only
def test_a_compiled_attention_tracks_the_same_maximum_without_a_graph_break():
    # --compile --qk-clip: the custom op keeps the compiled forward one graph (fullgraph raises on
    # a break) and gives the eager maximum (inductor on CPU here)
    from model import CausalSelfAttention, GPTConfig
    torch.manual_seed(0)
    attention = CausalSelfAttention(GPTConfig(1, 2, 32, 16, 64)).train()
    attention.track_logits = True
    x = torch.randn(2, 16, 32)
    maxima = []
    for module in (attention, torch.compile(attention, fullgraph=True)):
        attention.logit_max.fill_(-float("inf"))
        with torch.no_grad():
            module(x)
        maxima.append(attention.logit_max.clone())
    assert torch.isfinite(maxima[0]).all()
    torch.testing.assert_close(maxima[1], maxima[0], rtol=1e-6, atol=1e-6)
