"""Triton kernel of kernels/logit_max.py: per-head maxima of causal q k^T, tile by tile.

Grid (query blocks, B * H). A program loads its BLOCK queries once, walks the key blocks up
to the diagonal (later ones are all in the future), computes each tile with tl.dot (fp32
accumulation; bf16/fp16 operands on tensor cores, fp32 ones in IEEE fp32 so the maximum is
what an fp32 softmax sees), masks j > i and the padding to -inf, and keeps a running row
maximum. It stores the block's maximum in one fp32 slot; the wrapper reduces the slots.
Under the Triton interpreter tiles are cast to fp32 first (its bf16 arithmetic is wrong).
"""
import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from kernels.logit_max import BLOCK


@triton.jit
def _causal_max_kernel(Q, K, Out, T, D, H, n_blocks,
                       sqb, sqh, sqt, sqd, skb, skh, skt, skd,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                       CAST_FP32: tl.constexpr, PRECISION: tl.constexpr):
    block = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqt + dims[None, :] * sqd,
                mask=(rows[:, None] < T) & (dims[None, :] < D), other=0.0)
    if CAST_FP32:
        q = q.to(tl.float32)
    best = tl.full((BLOCK_M,), -float("inf"), tl.float32)
    end = tl.minimum((block + 1) * BLOCK_M, T)  # keys past the block's last query are all future
    for start in range(0, end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        k = tl.load(K + b * skb + h * skh + cols[None, :] * skt + dims[:, None] * skd,
                    mask=(cols[None, :] < T) & (dims[:, None] < D), other=0.0)  # (BLOCK_D, BLOCK_N): k^T
        if CAST_FP32:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision=PRECISION)
        causal = (cols[None, :] <= rows[:, None]) & (rows[:, None] < T)
        best = tl.maximum(best, tl.max(tl.where(causal, s, -float("inf")), axis=1))
    tl.store(Out + bh * n_blocks + block, tl.max(best, axis=0))


INTERPRETED = isinstance(_causal_max_kernel, InterpretedFunction)


def num_warps(dtype):
    """IEEE fp32 dots hold their tiles in registers: 4 warps spill (255 registers, 32-56 bytes
    spilled on sm_80 / sm_90, kernels/aot.py), 8 do not; bf16 tiles fit 4 warps."""
    return 8 if dtype == torch.float32 else 4


def causal_logit_max(q, k):
    """(H,) fp32 maxima over b and j <= i of q[b, h, i] . k[b, h, j]; q, k (B, H, T, D), any strides."""
    if q.shape != k.shape or q.dim() != 4:
        raise ValueError(f"causal_logit_max: q and k must be (B, H, T, D) of one shape, got {tuple(q.shape)} "
                         f"and {tuple(k.shape)}")
    B, H, T, D = q.shape
    n_blocks = triton.cdiv(T, BLOCK)
    slots = torch.empty(B * H, n_blocks, dtype=torch.float32, device=q.device)
    fp32 = q.dtype == torch.float32 or INTERPRETED
    _causal_max_kernel[(n_blocks, B * H)](
        q, k, slots, T, D, H, n_blocks, *q.stride(), *k.stride(),
        BLOCK_M=BLOCK, BLOCK_N=BLOCK, BLOCK_D=max(16, triton.next_power_of_2(D)),
        CAST_FP32=INTERPRETED, PRECISION="ieee" if fp32 else "tf32", num_warps=num_warps(q.dtype), num_stages=2)
    return slots.view(B, H, n_blocks).amax(dim=(0, 2))
