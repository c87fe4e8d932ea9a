"""The largest causal attention logit of each head, without materialising the logits.

QK-Clip (training/qk_clip.py) needs, per head h, max over the batch and the causal pairs
j <= i of q_i . k_j. Written out, that is a (T x T) product per head and sequence: at GPT-2
small (T = 1024, 12 heads, 8 sequences) 100 M fp32 logits (400 MB) written and read again per
layer and micro-step, where the fused attention (SDPA) writes none. The Triton kernel keeps each (BLOCK x BLOCK) tile of
q k^T in registers, masks the future, and writes one maximum per query block; the reduction
over blocks and sequences is a small torch amax. The torch twin computes the same maximum
from explicit logits, one sequence at a time (H T^2 extra floats), and is the reference.

Both return the UNSCALED maximum in fp32; scale by 1 / sqrt(d_head) and soft-cap afterwards:
both maps are increasing, so they commute with the maximum.
"""
import torch

BLOCK = 64  # query and key tile; d_head is padded to a power of two (GPT-2: 64)


def causal_logit_max_torch(q, k):
    """(H,) fp32: max over b and j <= i of q[b, h, i] . k[b, h, j], for q, k (B, H, T, D)."""
    T = q.size(-2)
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    best = torch.full((q.size(1),), -float("inf"), dtype=torch.float32, device=q.device)
    with torch.autocast(q.device.type, enabled=False):
        for b in range(q.size(0)):
            logits = (q[b].float() @ k[b].float().mT).masked_fill(future, -float("inf"))
            best = torch.maximum(best, logits.amax(dim=(-2, -1)))
    return best


def causal_logit_max(q, k, backend="auto"):
    """The per-head maximum of causal_logit_max_torch, by `backend` (kernels.BACKENDS): "triton"
    (CUDA tensors, or the interpreter), "torch", or "auto" (triton on CUDA).

    A torch custom op: torch.compile sees one opaque op with a known output shape, so a compiled
    model's attention neither breaks its graph here nor traces into the kernel launch."""
    return _causal_logit_max_op(q, k, backend)


@torch.library.custom_op("manifold_muon::causal_logit_max", mutates_args=())
def _causal_logit_max_op(q: torch.Tensor, k: torch.Tensor, backend: str) -> torch.Tensor:
    from kernels import triton_selected  # the same dispatch as the optimizer's products
    if not triton_selected(backend, q):
        return causal_logit_max_torch(q, k)
    from kernels import logit_max_triton
    return logit_max_triton.causal_logit_max(q, k)


@_causal_logit_max_op.register_fake
def _(q, k, backend):
    return q.new_empty((q.size(1),), dtype=torch.float32)
