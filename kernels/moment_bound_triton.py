"""Triton kernel of kernels/moment_bound.py: the bound from the moments, n matrices in one launch
(BLOCK per program), in fp32 whatever the vectors' dtype (the torch twin computes in theirs: the
solver's are fp32)."""
import torch
import triton
import triton.language as tl

BLOCK = 128


@triton.jit
def _bound_kernel(T, F, M, L, Out, n, inv_q, shrink, inv_power, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    t = tl.load(T + offs, mask=mask, other=1.0).to(tl.float32)
    f = tl.load(F + offs, mask=mask, other=1.0).to(tl.float32)
    m = tl.load(M + offs, mask=mask, other=1.0).to(tl.float32)
    log_scale = tl.load(L + offs, mask=mask, other=0.0).to(tl.float32)
    spread = tl.maximum(shrink * (f - t * t * inv_q), 0.0)  # (q - 1) / q (f - t^2 / q), at least 0
    mu = tl.minimum(t * inv_q + tl.sqrt(spread), tl.sqrt(f))
    out = m * tl.exp(log_scale + tl.log(mu) * inv_power)
    tl.store(Out + offs, out.to(Out.dtype.element_ty), mask=mask)


def bound_from_moments(t, f, m, log_scale, q, squarings):
    n = t.numel()
    out = torch.empty_like(t)
    if n:
        _bound_kernel[(triton.cdiv(n, BLOCK),)](t, f, m, log_scale, out, n, 1.0 / q, (q - 1) / q,
                                               2.0 ** -squarings, BLOCK=BLOCK, num_warps=4)
    return out
