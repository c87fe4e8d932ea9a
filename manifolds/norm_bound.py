"""Bounds on the largest eigenvalue of symmetric PSD q x q matrices, batched and sync-free: the
spectral norm ||A||_op = lam_1(A^T A)^(1/2) by which the solver divides its answer (an upper bound,
so that ||A||_op <= 1 holds; solver.finalize_banks) and by which it scores candidates, and the
power steps that span coordinates use (span.StackedSpans).
"""
import torch

import kernels
from kernels.constants import eye as kept_eye


def top_eigenvalue(S, iters, backend="torch", squarings=5):
    """Largest eigenvalue of symmetric PSD S (..., q, q) by power iteration on S^32.

    Five squarings (by default), rescaled every third, make it converge like 32 x iters plain power steps:
    the top of a near-msign Gram is a tight cluster (within 1% needs a power in the hundreds).
    The Rayleigh quotient on S itself is a lower bound, tight once v is in the top cluster.
    The squarings (S S^T = S^2: kernels.sym_product, upper tiles) only steer v: inside
    kernels.tf32_products() they read TF32 operands; the quotient is a plain fp32
    matrix-vector product either way.
    """
    power = S
    for k in range(squarings):
        # Rescaled to ||power||_F = 1 every third squaring (launches: three per rescale): then its top
        # eigenvalue is >= 1 / sqrt(q), and three squarings leave it >= q^-4 (3e-12 at q = 768), far
        # inside fp32's and bf16's range; the smaller ones may underflow, which only helps
        if k % 3 == 0:
            power = power / power.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-30)
        power = kernels.sym_product(power, backend=backend)
    v = torch.ones(S.shape[:-1] + (1,), dtype=S.dtype, device=S.device)
    v[..., 0, :] = 2.0  # break symmetry with an all-ones vector that might be degenerate
    v = power_steps(power, v, iters, every=4)
    return (v * (S @ v)).sum(dim=(-2, -1)).clamp_min(0)


LATE_FROM = 3  # top_eigenvalue_bound's squarings from this one on (S^16 onwards) may run in late_dtype


def top_eigenvalue_bound(S, squarings, backend="torch", tf32=False, late_dtype=None):
    """An upper bound on the largest eigenvalue lam_1 of symmetric PSD S (..., q, q) of any scale
    (S is divided by its largest diagonal entry first), from P = S^N, N = 2^squarings, and its moments
    t = tr P = sum mu_i, f = ||P||_F^2 >= sum mu_i^2 (Schur; equal for symmetric P):

        lam_1^N = mu_1 <= t / q + sqrt((q - 1) / q (f - t^2 / q))   (Wolkowicz-Styan)

    from Cauchy-Schwarz on the other q - 1 eigenvalues, (t - mu_1)^2 <= (q - 1)(f - mu_1^2);
    also mu_1 <= f^(1/2). Exact for a flat spectrum (an orthogonal A's Gram) and for a lone top
    eigenvalue; otherwise above lam_1 by at most a factor c^(1/2N), c = sum_i (lam_i / lam_1)^(2N)
    (about the eigenvalues within 1/N of the top; k zeros under a flat top: about (1 + k^(1/2))^(1/N)).
    At N = 1024 on the solvers' answers: up to 1.1e-3 above lam_1 (mean 3e-4). A power iteration's Rayleigh
    quotient is a lower bound instead: on the tight top clusters of near-square answers it fell
    up to 1% short.

    P is rescaled to ||P||_F = 1 every third squaring, the scales kept as logarithms
    (P = S^(2^k) / C: lam_1(S) = (lam_1(P) C)^(2^-k)). Rounding: squaring k's relative error
    reaches lam_1 divided by 2^k. Under `tf32` the squarings read TF32 operands, the first from
    E = S - I (S^2 = E E^T + 2 E + I, E and I added in fp32): TF32 rounds an S ~ I by up to 5e-4
    coherently on the diagonal, E only relative to its own small entries.

    late_dtype (bf16 under a GPU's TF32 plan: the plan's sign dtype): the squarings from LATE_FROM
    on (those forming S^16 ... S^N) run in it, at twice TF32's rate. A relative rounding eps of the
    squaring that forms S^(2^j) moves the bound by eps / 2^j, so bf16's (~2e-3 on a diagonal-heavy
    P, coherently) moves it by at most ~eps / 8 = 2.5e-4 summed over j = 4 ... squarings; the
    moments t and f are read in fp32 (their rounding is divided by N). GPT-2 small hetero, one H200
    (python -m bench.cost_model --fake): the squarings were 391 of 2022 TF32 GFLOP.
    """
    q = S.size(-1)
    eye = kept_eye(q, S)
    # S / m first, m = its largest diagonal entry (lam_1 / q <= m <= lam_1): the top of S / m lies
    # in [1, q], whatever S's scale, so the form below (made for S ~ I) holds for every answer. On
    # S itself, a small S (a short answer: c B, c = 1e-2) gave E ~ -I, and E E^T + 2 E + I cancelled
    # to nothing: the "bound" fell 10% under lam_1 in fp32 and up to 100x at TF32. The result is
    # m times the bound of S / m: exactly covariant with S's scale.
    m = torch.diagonal(S, dim1=-2, dim2=-1).amax(dim=-1).clamp_min(torch.finfo(S.dtype).tiny)
    S = S / m[..., None, None]
    E = S - eye
    with kernels.tf32_products(tf32):
        P = kernels.products_for(backend, E).sym_product(E, 1.0, E, 2.0) + eye  # S^2
        log_scale = None  # 0 until the first rescaling (no fill: 0 + x / 2^k is x / 2^k exactly)
        for k in range(1, squarings):
            if late_dtype is not None and k == LATE_FROM and late_dtype != P.dtype:
                P = P.to(late_dtype)
            if k % 3 == 1:  # top eigenvalue >= 1 / sqrt(q) here, >= q^-4 three squarings on
                norm = P.norm(dim=(-2, -1)).clamp_min(1e-30)
                # log_scale + log(norm) / 2^k, the division by 2^k exact: one launch for two (a bf16
                # norm is the exact divisor; its log is taken in fp32)
                lognorm = norm.to(S.dtype).log()  # .to: no copy where norm is S's dtype already
                P, log_scale = P / norm[..., None, None], (lognorm * 2.0 ** -k if log_scale is None else
                                                           torch.add(log_scale, lognorm, alpha=2.0 ** -k))
            P = kernels.sym_product(P, backend=backend)
        if log_scale is None:
            log_scale = torch.zeros(S.shape[:-2], dtype=S.dtype, device=S.device)
    t = torch.diagonal(P, dim1=-2, dim2=-1).sum(dim=-1, dtype=S.dtype)
    f = torch.linalg.vector_norm(P, dim=(-2, -1), dtype=S.dtype).square() if P.dtype != S.dtype else P.square().sum(
        dim=(-2, -1))
    # mu and the bound from the moments: one Triton launch on CUDA for what are 15 torch ops
    return kernels.bound_from_moments(t, f, m, log_scale, q, squarings, backend)


def power_steps(M, v, steps, every):
    """`steps` power steps v <- M v (..., n, 1), v normalised after every `every` of them and
    at the end: fewer launches, and v grows by at most ||M||^every in between (top_eigenvalue's
    M has ||M||_F <= 1; K of span[W, G] has trace 2q for unit columns: far from fp32's range; an
    overflow would make `lift` report the matrix imprecise, not pass silently)."""
    for k in range(steps):
        v = M @ v
        if (k + 1) % every == 0 or k == steps - 1:
            v = v / v.norm(dim=-2, keepdim=True).clamp_min(1e-30)
    return v
