"""Triton kernel of kernels/signal.py: the tangent signal from three per-matrix sums, n matrices
in one launch. The factors are the twin's, rounded to the sums' dtype first (fp32), so that the
comparisons are the twin's."""
import functools

import torch
import triton
import triton.language as tl

from kernels.signal import EXACT_FACTOR

BLOCK = 128


@triton.jit
def _signal_kernel(G2, M2, Y2, Out, n, inv_probes, sketch_factor, exact_factor, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g2 = tl.load(G2 + offs, mask=mask, other=0.0).to(tl.float32)
    m2 = tl.load(M2 + offs, mask=mask, other=0.0).to(tl.float32)
    y2 = tl.load(Y2 + offs, mask=mask, other=0.0).to(tl.float32)
    t2 = g2 - 0.5 * m2
    s2 = y2 * inv_probes  # probes a power of two: exact, as the twin's division
    finite = (s2 * 0.0 == 0.0) & (t2 * 0.0 == 0.0) & (g2 * 0.0 == 0.0)
    signal = finite & ((s2 > sketch_factor * g2) | (t2 > exact_factor * g2)) & (g2 > 0.0)
    tl.store(Out + offs, signal, mask=mask)


@functools.lru_cache(maxsize=None)
def factors(tol, dtype):
    """(tol^2, EXACT_FACTOR) as the twin holds them: float64 rounded to the sums' dtype (host
    numbers, worked out once per tolerance and dtype, not each step)."""
    return tuple(float(torch.tensor(x, dtype=torch.float64).to(dtype)) for x in (tol * tol, EXACT_FACTOR))


def signal_from_sums(g2, m2, y2, probes, tol):
    n = g2.numel()
    out = torch.empty(g2.shape, dtype=torch.bool, device=g2.device)
    if n:
        sketch, exact = factors(tol, g2.dtype)
        _signal_kernel[(triton.cdiv(n, BLOCK),)](g2, m2, y2, out, n, 1.0 / probes, sketch, exact, BLOCK=BLOCK,
                                                num_warps=4)
    return out
