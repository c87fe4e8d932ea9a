"""The last step of norm_bound.top_eigenvalue_bound: from the moments of P = (S / m)^N / C, N =
2^squarings (t = tr P, f = ||P||_F^2, per matrix) to the bound on lam_1(S),

    mu = min(t / q + sqrt(max(0, (q - 1) / q (f - t^2 / q))), sqrt(f))     (Wolkowicz-Styan)
    lam_1(S) <= m exp(log C + log(mu) / N),                                  log C = log_scale

fifteen elementwise ops on (n,) vectors: as torch ops fifteen kernel launches for a few hundred
numbers, as the Triton kernel (moment_bound_triton.py) one. The torch twin is the reference and
runs off CUDA.
"""
import torch


def bound_from_moments_torch(t, f, m, log_scale, q, squarings):
    mu = torch.minimum(t / q + ((q - 1) / q * (f - t * t / q)).clamp_min(0).sqrt(), f.sqrt())
    return m * (log_scale + mu.log() / 2 ** squarings).exp()


def bound_from_moments(t, f, m, log_scale, q, squarings, backend="auto"):
    """The bound above for t, f, m, log_scale (n,) of one dtype, by `backend` (kernels.BACKENDS)."""
    from kernels import triton_selected, vectors_take_triton  # the same dispatch as the products
    if not triton_selected(backend, t) or not vectors_take_triton(t, f, m, log_scale):
        return bound_from_moments_torch(t, f, m, log_scale, q, squarings)
    from kernels import moment_bound_triton
    return moment_bound_triton.bound_from_moments(t, f, m, log_scale, q, squarings)
