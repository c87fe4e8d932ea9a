"""Steepest descent under the spectral norm, restricted to a manifold's tangent space.

    A* = argmax <G, A>   subject to   ||A||_op <= 1   and   P(W^T A + A^T W) = 0

Two solvers, both batched over leading dimensions and both ending in an exact tangent
projection plus a spectral renormalisation, so the returned A is always feasible. G is
normalised first (msign ignores scale, the dual problem does not).

* "dual": the dual problem is min over Lambda = P(Lambda) of ||G + 2 W Lambda||_*, with
  argmax A(Lambda) = msign(G + 2 W Lambda) and gradient H = P(W^T A + A^T W). Start at the
  exact Euclidean tangent projection Lambda0_ij = -R_ij / (2 (d_i^2 + d_j^2)),
  R = P(W^T G + G^T W), plus the previous step's correction Lambda* - Lambda0 (warm start),
  and descend with the step preconditioned per entry by (d_i^2 + d_j^2) and on the right by
  M = (X^T X)^(1/2) = sym(A^T X), the singular-value scale that sets the dual's curvature
  (a fixed scalar step suited to 32 columns overshoots at 256). Exact in one evaluation for
  square Stiefel; fast on flat spectra; slow or stalling elsewhere (see choose_solver).
* "admm": on  max <G, B>  s.t.  B in the tangent space, Z in the unit spectral ball, B = Z:
      B <- Proj_T(Z - U + G / rho);  Z <- clip(B + U);  U <- U + B - Z,
  where clip caps singular values at 1 (`spectral_clip`: an eigendecomposition of the q x q
  Gram on CPU, two polynomial matrix signs on GPU). It converges where the dual optimum
  is degenerate (the optimal A keeps singular values below 1: square DGram, near-square
  Stiefel) or ill-conditioned (spiky gradient spectra). Tall banks (rows >= 2 cols) run it as
  the equivalent 2q x q problem in span[W, G] (span.py), all such banks of one q stacked into
  one batch whatever their rows and manifold (`solve_tall_banks`, `admm_in_span`), and every
  step after the first starts from the previous step's multiplier (`admm_iterations`). The
  answer then gets a few rounds of  A <- Proj_T(pull_back(A))  from A = Proj_T(Z), pull_back
  lowering the singular values above 1 (`pull_back_answer`): what the final renormalisation
  would otherwise take from the whole direction.

Convergence is tested on a per-matrix mask every `check_every` iterations: one host sync
per check, not per iteration, and finished matrices stop changing.

`capturable` (SolverOptions; the name torch optimizers give a CUDA-graph-safe step, default on
CUDA tensors): no host syncs at all. Every loop runs its fixed budget (the mask still freezes
finished matrices, so the result is the one an early exit would give: the extra iterations
change nothing), square Stiefel takes the dual's exact first evaluation without checking it,
the span reduction's precision fallback picks per matrix on the device (`admm_in_span`), and the
dgram-cap active set runs all its rounds. What it costs: the iterations an early exit saves.

Every matrix sign and Gram-space product runs through `kernels` with `opts.backend` (fused
Triton kernels on CUDA under "auto"); the squared column norms d2 are computed once per solve.
"""
from dataclasses import dataclass, fields

import torch

import kernels
from kernels.matrix_sign import CLIP_SCHEDULE, EXACT_SCHEDULE, POLAR_SCHEDULE, steps_for
from kernels.precision import tf32_active
from manifolds.geometry import geometry
from manifolds.span import StackedSpans, top_eigenvalue


@dataclass
class SolverOptions:
    solver: str = "auto"        # "dual", "admm" or "auto" (by shape, see choose_solver)
    dual_steps: int = 8         # at most this many multiplier updates of dual ascent
    admm_steps: int = 3         # at most this many ADMM iterations from a warm start; twice that
                                # from a cold one, and twice again for rows < 2 cols (3 and 2
                                # pullbacks, below: direction quality 0.997 / 0.999 on synthetic
                                # 768 x 256 momenta, 0.96-0.98 on recorded ones, where 4 iterations
                                # without pullbacks reached 0.992 / 0.995 and 0.95-0.97 at 14% more
                                # cost; bench/RESULTS.md, issue 15)
    tol: float = 1e-4           # dual: stop when rms(P(W^T A + A^T W)) / mean column norm <= tol;
                                # admm: when the relative primal and dual residuals are <= tol
    dual_lr: float = 1.0        # dual step, relative to the preconditioned Newton-like scale
    admm_rho: float = 0.5       # ADMM penalty, relative to the spectral norm of Proj_T(G), cold start
    admm_rho_warm: float = 0.07  # the same from a warm start (bench/RESULTS.md: the sweeps; with the
                                 # pullbacks and the answer from Z a long dual step pays: 0.07 x 1.5
                                 # gains 0.005-0.016 on real momenta over the 0.15 x 2.5 tuned without)
    admm_rho_growth: float = 1.5  # from a warm start the penalty grows by this factor per iteration
                                  # (0.07, 0.105, 0.16 x ||Proj_T G|| at the default budget); the later,
                                  # larger, pull B and Z together, which near-square matrices need most
    admm_rho_max: float = 10.0  # ... up to this (relative, like admm_rho_warm): a bound for large
                                # budgets (40 iterations would reach 0.07 x 1.5^39)
    admm_warm_average: float = 0.5  # the warm start kept for the next step: this much of the one the
                                    # step started from, the rest the step's own fixed-point correction
                                    # (an average over steps: each step's correction carries the
                                    # unconverged iterations' noise; 0 = the step's own; 0.5: real
                                    # momenta +0.002-0.010, bench/RESULTS.md)
    admm_relax: float = 1.7     # ADMM over-relaxation (1 = plain ADMM; 1.7 over 1.5 with the pullbacks:
                                # real momenta +0.0005 to +0.002, synthetic the same; bench/RESULTS.md)
    admm_pullbacks: int = 2     # rounds of B <- Proj_T(pull_back(B)) on ADMM's answer (`pull_back_answer`):
                                # singular values above 1 pulled back, then the exact tangent projection;
                                # a third of an iteration each, and each gains about what an iteration
                                # gains at this budget: what the renormalisation would take
                                # (bench/RESULTS.md)
    reduce: bool = True         # ADMM on tall matrices (rows >= 2 cols) as the 2q x q problem in span[W, G]
    msign_steps: int = 5        # Polar Express iterations per matrix sign
    polish_steps: int = 2       # Newton-Schulz polish iterations per matrix sign
    check_every: int = 2        # iterations between convergence checks (host syncs)
    norm_iters: int = 8         # power iterations for the final spectral renormalisation
    backend: str = "auto"       # kernels: "triton" (fused kernels), "torch", or "auto" (triton on CUDA)
    dgram_cap: float = 1.0      # the column-norm cap C of the "dgram-cap" manifold
    clip: str = "auto"          # ADMM's polar factor and spectral clip: "eigh" (eigendecomposition of
                                # the q x q Gram), "polynomial" (Polar Express through `kernels`), or
                                # "auto": eigh on CPU tensors, polynomial on GPUs and under "triton"
    precision: str = "auto"     # ADMM's inner iterations in span coordinates: "fp32" (3xTF32 on GPUs),
                                # "tf32" (TF32 tensor cores, fp32 accumulation; emulated on CPU),
                                # "bf16", or "auto": tf32 for fp32 CUDA tensors, fp32 elsewhere; the
                                # reduction, the last projection, the lift and retraction stay fp32 (under
                                # tf32 the retraction's small corrections are TF32 products added in
                                # fp32: geometry.retract(tf32_correction=True), the same violation)
    capturable: object = "auto"  # True: no host syncs (fixed budgets, decisions on the device; see the
                                 # module docstring); False: early exits; "auto": True on CUDA tensors
    clip_msign: str = "minimax"  # the polynomial clip's two matrix signs and ADMM's starting polar
                                 # factor: "minimax" (kernels.matrix_sign.CLIP_SCHEDULE, 5 steps, and
                                 # POLAR_SCHEDULE, 6; the clip's one fewer at TF32) or "polar-express"
                                 # (msign_steps + polish_steps, 7 by default); the same direction
                                 # quality (bench/RESULTS.md)

    @classmethod
    def from_kwargs(cls, **kwargs):
        names = {f.name for f in fields(cls)}
        unknown = set(kwargs) - names
        if unknown:
            raise TypeError(f"unknown solver options {sorted(unknown)}; valid: {sorted(names)}")
        return cls(**kwargs)


@dataclass
class Solution:
    A: torch.Tensor             # tall orientation, tangent, ||A||_op ~= 1
    state: torch.Tensor         # warm start: the multiplier's correction Lambda - Lambda0 (q x q)
    residual: torch.Tensor      # per-matrix relative tangent residual before the final projection
    iterations: int             # iterations run (the same for the whole batch)
    fallbacks: object = 0       # matrices that took the sync-free precision fallback (a tensor, or 0)


def choose_solver(shape, manifold_name):
    """Dual ascent where it converges fast, ADMM everywhere else.

    Measured against a float64 reference (bench/solver_quality.py): square Stiefel is solved
    exactly by the dual's initial multiplier (the optimum is W msign(skew(W^T G))). Elsewhere
    the dual is fast on flat random spectra (>99.9% in 6-8 steps for rows >= 2.5 x cols) but
    slow when G has a few dominant singular values, as momentum gradients do, and it stalls
    (~85-90%) where the optimal A keeps singular values below 1 (square DGram, Stiefel with
    rows < 2 x cols). ADMM does better on every one of those at equal iterations.
    """
    rows, cols = shape[-2:]
    if manifold_name == "stiefel" and rows == cols:
        return "dual"
    return "admm"


def capturable(opts, W):
    """Does this solve run without host syncs (SolverOptions.capturable)?"""
    if opts.capturable == "auto":
        return W.device.type == "cuda"
    if not isinstance(opts.capturable, bool):
        raise ValueError(f"capturable must be True, False or 'auto'; got {opts.capturable!r}")
    return opts.capturable


def frobenius(M):
    return torch.linalg.matrix_norm(M)


def relative_residual(W, sumsq):
    """rms(H) / mean column norm of W, from sumsq = ||H||_F^2: the scale-free tangent residual."""
    rms_H = (sumsq.to(W.dtype) / W.size(-1) ** 2).sqrt()
    return rms_H / W.norm(dim=-2).mean(dim=-1).clamp_min(1e-30)


def spectral_norm(A, iters, backend="torch", squarings=5):
    """||A||_op per matrix: the square root of the top eigenvalue of A^T A (q x q)."""
    return top_eigenvalue(kernels.sym_product(A.mT, backend=backend), iters, backend, squarings).sqrt()


def use_eigh(opts, Y):
    """Does ADMM take its matrix functions from eigh (see SolverOptions.clip)?"""
    if opts.clip not in ("auto", "eigh", "polynomial"):
        raise ValueError(f"unknown clip {opts.clip!r}; valid: auto, eigh, polynomial")
    if opts.clip == "auto":
        # An eigendecomposition of the q x q Gram costs a few q^3 FLOPs where a Polar Express
        # costs ~50 q^3, and is exact; on a GPU its sequential algorithm is the slower one.
        return Y.device.type == "cpu" and opts.backend != "triton"
    return opts.clip == "eigh"


def gram_function(Y, f):
    """Y Q f(lam) Q^T for Y^T Y = Q diag(lam) Q^T: a function of Y's singular values s =
    lam^(1/2) applied on the right (f(lam) = lam^(-1/2): the polar factor)."""
    Y32 = Y.float()  # eigh has no bf16; its q x q work is small next to the products
    lam, Q = torch.linalg.eigh(Y32.mT @ Y32)
    return (Y32 @ ((Q * f(lam.clamp_min(1e-30)).unsqueeze(-2)) @ Q.mT)).to(Y.dtype)


def polar(Y, opts):
    """msign(Y) = U V^T for tall Y = U S V^T: ADMM's starting Z. Polynomial: the minimax
    schedule for singular values in [0.005, 1] (6 steps at every precision), or Polar Express
    and its polish (7) under clip_msign="polar-express"; the same direction quality
    (bench/RESULTS.md)."""
    if use_eigh(opts, Y):
        # Singular values below 1e-3 of the largest are rounding noise in Y^T Y (fp32) and
        # would be blown up to 1; they are scaled as if they were 1e-3 (Polar Express, from a
        # Frobenius normalisation, likewise leaves such directions short of 1).
        return gram_function(Y, lambda lam: lam.clamp_min(1e-6 * lam.amax(dim=-1, keepdim=True)).rsqrt())
    if opts.clip_msign == "minimax":
        # a starting point, which the iterations correct: in bf16 under tf32 (twice TF32's rate)
        # the direction quality moves by <= 1e-4 (bench/RESULTS.md, issue 15). All 6 steps even
        # there: the last lifts the singular values below POLAR_LOWER, and without it real
        # width-768 momenta lost 0.015 of direction quality (0.9462 against 0.9609 worst c_attn),
        # for 10 q^3 of the step's ~290 q^3 in matrix signs
        return bf16_under_tf32(lambda Z: minimax_msign(Z, POLAR_SCHEDULE, opts, full=True), Y, opts)
    return kernels.msign(Y, opts.msign_steps, opts.polish_steps, opts.backend)


def minimax_msign(Y, schedule, opts, full=False):
    """msign by a minimax schedule of kernels.matrix_sign, one step shorter where the products
    run at TF32 or below (matrix_sign.steps_for) unless `full`."""
    low_precision = tf32_active() or Y.dtype in (torch.bfloat16, torch.float16)
    steps = len(schedule) if full else steps_for(schedule, low_precision)
    return kernels.msign(Y, steps, 0, opts.backend, schedule=schedule)


def spectral_clip(Y, opts):
    """Project Y onto the unit spectral-norm ball: U min(S, 1) V^T for Y = U S V^T.

    eigh: Y Q diag(min(1, lam^(-1/2))) Q^T. polynomial: with O = msign(Y) and
    P = O^T Y = V S V^T (q x q, PSD), min(P, I) = (P + I - |P - I|) / 2 and
    |P - I| = sign(P - I)(P - I), the sign of a symmetric matrix being its polar factor.
    """
    if use_eigh(opts, Y):
        return gram_function(Y, lambda lam: lam.rsqrt().clamp_max(1.0))
    # Under tf32 iterations both matrix signs run in bf16 (twice TF32's rate). msign(Y)'s rounding
    # (~4e-3) leaves the clipped iterates a little off the ball, which the pullbacks and the final
    # projection and renormalisation absorb: ~10% of the step's estimate for -0.003 to -0.006 on
    # real momenta against TF32 with 2 pullbacks from B, which starting them from Proj_T(Z) more
    # than recovers (admm_iterations; without pullbacks bf16 lost 0.007 / 0.016; bench/RESULTS.md).
    O = bf16_under_tf32(lambda X: clip_msign(X, opts), Y, opts)
    E, absE = minus_identity_and_abs(kernels.symmetric_part(O, Y, opts.backend), opts)  # P = sym(O^T Y)
    # O min(P, I) = O (I + (E - |E|) / 2): one product with O added in the epilogue
    return kernels.matmul_add(O, E - absE, O, alpha=0.5, backend=opts.backend)


def pull_back_answer(B, project, opts):
    """opts.admm_pullbacks rounds of alternating projection on ADMM's answer: B <- Proj_T(pull_back(B)).

    After a few iterations ADMM's tangent B has a hundred or so singular values up to ~2% above 1
    (recorded momenta, 4 iterations), and finalize's renormalisation by ||B||_op shrinks the whole
    direction for them: about half of what those iterations leave short of the optimum. Pulling
    those singular values back to 1 and projecting onto the tangent space again leaves fewer
    and smaller excesses each round. The warm start for the next step is not touched."""
    for _ in range(opts.admm_pullbacks):
        B = project(pull_back(B, opts))
    return B


def pull_back(B, opts):
    """B with its singular values above 1 brought to (about) 1, those below unchanged.

    eigh (SolverOptions.clip): the exact spectral clip. Polynomial: for B = U S V^T and
    E = B^T B - I = V (S^2 - I) V^T, the positive part E+ = (E + |E|) / 2 = (E + sign(E) E) / 2
    gives B (I - E+ / 2) = U f(S) V^T with f(s) = s for s <= 1 and f(s) = s (3 - s^2) / 2 above
    (a Newton-Schulz step on the excess only: f <= 1, f(1.02) = 0.9994). One q x q Gram, a
    q x q sign (bf16 under tf32 iterations, as the clip's), two products: about a third of an
    ADMM iteration, which needs msign of the 2q x q Y as well."""
    if use_eigh(opts, B):
        return spectral_clip(B, opts)
    E, absE = minus_identity_and_abs(kernels.sym_product(B.mT, backend=opts.backend), opts)  # B^T B
    # B (I - E+ / 2) = B - (B (E + |E|)) / 4: one product with B added in the epilogue
    return kernels.matmul_add(B, E + absE, B, alpha=-0.25, backend=opts.backend)


def minus_identity_and_abs(S, opts):
    """(E, |E|) for E = S - I, S symmetric (q x q): |E| = sym(sign(E) E), the sign of a symmetric
    matrix being its polar factor (clip_msign; bf16 under tf32 iterations). Its least accurate
    eigenvalues, those near 0, matter least to both callers: they change min(P, I) in the clip and
    E+ in the pullback by about themselves."""
    E = S - torch.eye(S.size(-1), dtype=S.dtype, device=S.device)
    sign_E = bf16_under_tf32(lambda X: clip_msign(X, opts), E, opts)
    return E, kernels.symmetric_part(sign_E.mT, E, opts.backend)


def bf16_under_tf32(f, X, opts):
    """f(X) computed in bf16 (and returned in X's dtype) where the iterations run at tf32 on fp32
    tensors, else f(X): for the matrix functions that tolerate bf16's rounding."""
    if X.dtype == torch.float32 and iteration_precision(opts, X) == "tf32":
        return f(X.to(torch.bfloat16)).to(X.dtype)
    return f(X)


CLIP_MSIGNS = ("minimax", "polar-express")


def clip_msign(Y, opts):
    """msign for spectral_clip (SolverOptions.clip_msign). "minimax": ADMM's clip inputs, after
    the matrix sign's normalisation by ||Y^T Y||_F^(1/2), keep their singular values (and E's
    eigenvalues that matter: those near 0 change min(P, I) little) above ~0.02 (measured on real
    momenta: >= 0.019), so the minimax schedule for [0.02, 1] reaches fp32 in 5 steps, and
    TF32's rounding in 4 (what runs under tf32 iterations), where Polar Express (built for 1e-3)
    and its polish take 7."""
    if opts.clip_msign not in CLIP_MSIGNS:
        raise ValueError(f"unknown clip_msign {opts.clip_msign!r}; valid: {', '.join(CLIP_MSIGNS)}")
    if opts.clip_msign == "minimax":
        return minimax_msign(Y, CLIP_SCHEDULE, opts)
    return kernels.msign(Y, opts.msign_steps, opts.polish_steps, opts.backend)


def masked_update(active, old, new):
    return torch.where(active.reshape(active.shape + (1, 1)), new, old)


def finalize(W, A, geo, d2, opts):
    """Exact tangent projection, then scale so that ||A||_op = 1."""
    return finalize_banks([(W, A, geo, d2)], opts)[0]


def finalize_banks(banks, opts, project=True):
    """finalize for banks [(W, A, geo, d2)] of the same q (any rows, any batch shape): the
    projections bank by bank, the spectral norms of all from one stack of q x q Grams.

    The answers that reach here are tangent up to their solver's rounding or residual (ADMM's
    projected B, dual ascent near its tolerance), so the projection's correction W M is small:
    under tf32 iterations it reads TF32 operands (kernels/tangent.py); the Gram W^T A + A^T W
    that measures the residual stays fp32. project=False: the answers are already tangent to
    fp32 rounding (the span lift of an fp32 projection, admm_in_span), only the norm is taken."""
    tf32 = iteration_precision(opts, banks[0][0]) == "tf32"
    projected = [geo.tangent_projection(W, A, d2, opts.backend, tf32_correction=tf32) if project else A
                 for W, A, geo, d2 in banks]
    # The Grams and the power iteration's squarings at the iterations' precision: TF32 operands
    # move the top singular value by ~1e-5 relative (rounding errors uncorrelated with its singular
    # vectors; measured 3e-6 at 3072 x 768), far below the power iteration's own 2.5e-4 on a
    # near-msign spectrum (bench/RESULTS.md, issue 15)
    with tf32_scope(opts, projected[0]):
        grams = [kernels.sym_product(A.mT, backend=opts.backend).reshape((-1,) + A.shape[-1:] * 2) for A in projected]
        norms = top_eigenvalue(torch.cat(grams), opts.norm_iters, opts.backend).sqrt().clamp_min(1e-30)
    return [A / n.reshape(A.shape[:-2] + (1, 1)) for A, n in zip(projected, torch.split(norms, [len(g) for g in grams]))]


def dual_ascent(W, G, geo, correction, opts):
    d2 = geo.squared_norms(W)  # d_i^2: the metric (d_i^2 + d_j^2) preconditions every step
    # Lambda0 = -P(W^T G + G^T W) / (2 (d_i^2 + d_j^2)) makes G + 2 W Lambda0 the Euclidean
    # tangent projection of G (exact for square Stiefel). The warm start is the correction
    # Lambda* - Lambda0 of the previous step: it changes slowly with the momentum, where
    # Lambda0 itself follows G.
    Lambda0 = geo.preconditioned(W, G, d2, -0.5, opts.backend)
    Lambda = Lambda0 if correction is None else Lambda0 + correction
    batch = W.shape[:-2]
    active = torch.ones(batch, dtype=torch.bool, device=W.device)
    step_size = torch.full(batch, opts.dual_lr, dtype=W.dtype, device=W.device)
    previous = torch.full(batch, float("inf"), dtype=W.dtype, device=W.device)
    sync_free = capturable(opts, W)
    steps = opts.dual_steps
    # square Stiefel: the first evaluation is the exact optimum W msign(skew(W^T G)) (Lambda* =
    # Lambda0, the correction stays 0): nothing to iterate or check
    exact = W.size(-2) == W.size(-1) and geo.name == "stiefel"
    for k in range(steps + 1):
        X = kernels.matmul_add(W, Lambda, G, alpha=2.0, backend=opts.backend)  # G + 2 W Lambda
        if exact:
            A = exact_msign(X, opts)
            break
        A = kernels.msign(X, opts.msign_steps, opts.polish_steps, opts.backend)
        # dual gradient H = P(W^T A + A^T W) and ||H||_F^2, in one pass
        H, sumsq = geo.tangent_residual(W, A, opts.backend, with_norm=True)
        residual = relative_residual(W, sumsq)
        active = active & (residual > opts.tol)
        if k == steps or (not sync_free and k % opts.check_every == 0 and not bool(active.any())):
            break
        # Halve a matrix's step whenever its residual grew: spread-out column norms (DGram)
        # make the Newton-like step overshoot, and this needs no host sync.
        step_size = torch.where(residual > previous, 0.5 * step_size, step_size)
        previous = residual
        # M = sym(A^T X) = (X^T X)^(1/2): larger singular values tolerate larger steps
        M = kernels.symmetric_part(A, X, opts.backend)
        # Lambda <- Lambda - step P(sym(H M)) / (2 (d_i^2 + d_j^2)); a zero step freezes finished matrices
        Lambda = geo.dual_update(Lambda, H, M, d2, step_size * active, opts.backend)
    # The loop's A only needs to be accurate enough to steer Lambda; the answer gets a
    # tighter polish (Newton-Schulz from singular values already near 1 converges in two).
    A = kernels.orthonormalize_near(A, steps=2, backend=opts.backend)
    if exact:  # the residual of the polished answer (what the optimizer's stats report)
        residual = relative_residual(W, geo.tangent_residual(W, A, opts.backend, with_norm=True)[1])
    return Solution(finalize(W, A, geo, d2, opts), Lambda - Lambda0, residual, k)


def exact_msign(X, opts):
    """The matrix sign of square Stiefel's exact step (dual_ascent). Under tf32 iterations its
    products read TF32 operands, with the 7-step minimax schedule for [0.001, 1]
    (matrix_sign.EXACT_SCHEDULE) where Polar Express and its polish take 7 at 3xTF32 (a third
    of the rate); the fp32 polish after it and the exact final projection keep the answer as
    tangent and as unit as before. On recorded momenta (c_proj, 256 x 256) it reaches the fp32
    path's 1.000 of the optimum, where [0.005, 1] in 5 or 6 steps reach 0.9992-0.9998
    (bench/RESULTS.md)."""
    if iteration_precision(opts, X) == "tf32" and opts.clip_msign == "minimax":
        with kernels.tf32_products():
            return kernels.msign(X, len(EXACT_SCHEDULE), 0, opts.backend, schedule=EXACT_SCHEDULE)
    return kernels.msign(X, opts.msign_steps, opts.polish_steps, opts.backend)


def admm(W, G, geo, correction, opts):
    """ADMM on tall banks; rows >= 2 cols as the equivalent 2q x q problem in span[W, G]
    (span.py) unless a matrix's coefficients would lose precision (admm_in_span)."""
    correction = usable_correction(W, correction)
    if not reducible(W, opts):
        return admm_full(W, G, geo, correction, opts)
    batch = W.shape[:-2]  # admm_in_span stacks banks of one batch dimension
    flat = lambda X: X.reshape((-1,) + X.shape[len(batch):])  # noqa: E731
    pinned = getattr(geo, "pinned", None)
    flat_geo = geo.pin(flat(pinned)) if pinned is not None else geo
    s = admm_in_span([(flat(W), flat(G), flat_geo, None if correction is None else flat(correction))], opts)[0]
    return Solution(s.A.reshape(W.shape), s.state.reshape(batch + s.state.shape[-2:]), s.residual.reshape(batch),
                    s.iterations, s.fallbacks)


def usable_correction(W, correction):
    if correction is not None and correction.shape[-2:] != (W.size(-1),) * 2:
        return None  # another solver's state (checkpoints of earlier versions kept (Z, rho U))
    return correction


def reducible(W, opts):
    return opts.reduce and W.size(-2) >= 2 * W.size(-1)


def admm_full(W, G, geo, correction, opts, d2=None):
    """ADMM on the full p x q matrices."""
    d2 = geo.squared_norms(W) if d2 is None else d2
    B, correction, residual, iterations = admm_iterations(W, G, geo, correction, opts, d2)
    return Solution(finalize(W, B, geo, d2, opts), correction, residual, iterations)


def admm_in_span(problems, opts):
    """[Solution] of tall banks [(W, G, geo, correction)] (rows >= 2 cols, the same q, all warm
    or all cold) solved as ONE batched ADMM in span coordinates (span.StackedSpans), whatever
    their row counts and manifolds; lifted and finalised bank by bank.

    Precision fallback: a bank whose span has no Cholesky factor, or whose lifted answer is
    imprecise (span.lift; rare: G nearly inside span[W]), is solved again on the full matrices
    (two host syncs for all banks together). Capturable: no syncs; an imprecise matrix gets
    the Euclidean tangent projection of G instead, a descent direction at the same step
    length, exact but not the spectral-norm steepest one, counted in `Solution.fallbacks`; it is
    chosen by the lift's coefficients (span.StackedSpans.lift), so it costs no product of its own.
    """
    if len({correction is None for *_, correction in problems}) > 1:
        raise ValueError("admm_in_span takes banks that are all warm-started or all cold")
    sync_free = capturable(opts, problems[0][0])
    d2s = [geo.squared_norms(W) for W, _, geo, _ in problems]
    stack = lambda ids: StackedSpans([problems[i][:3] + (d2s[i],) for i in ids], opts.backend)  # noqa: E731
    stacked_ids = list(range(len(problems)))
    spans = stack(stacked_ids)
    if not sync_free:  # one host sync for all: a bank whose span has no Cholesky factor is solved in full
        valid = torch.stack([ok.all() for ok in spans.split(spans.valid)]).tolist()
        if not all(valid):
            stacked_ids = [i for i in stacked_ids if valid[i]]
            spans = stack(stacked_ids) if stacked_ids else None
    solutions = [None] * len(problems)
    if stacked_ids:
        corrections = [problems[i][3] for i in stacked_ids]
        correction = None if corrections[0] is None else torch.cat(corrections)
        B, correction_new, residual, iterations = span_iterations(spans, correction, opts)
        lifted = [(i, X, ok, c, r) for i, (X, ok), c, r in zip(
            stacked_ids, spans.lift(B, fallback=sync_free), spans.split(correction_new), spans.split(residual))]
        precise = ([True] * len(lifted) if sync_free
                   else torch.stack([ok.all() for _, _, ok, _, _ in lifted]).tolist())
        done = []  # (i, X, correction, residual, fallbacks) of the banks whose span answer stands
        for (i, X, ok, c, r), all_ok in zip(lifted, precise):
            if sync_free:  # X is already Proj_T(G) where ~ok (spans.lift)
                done.append((i, X, masked_update(ok, torch.zeros_like(c), c), r, (~ok).sum()))
            elif all_ok:
                done.append((i, X, c, r, 0))
        if done:
            # No projection on the full matrices: B left ADMM through the span's exact fp32 projection
            # (pull_back_answer, or B's own), and the lift keeps it tangent up to its rounding (the
            # lift's precision test bounds it) and W's distance from the manifold (~1e-7 after a
            # retraction); the fallback Proj_T(G) is lifted from exact coefficients. That
            # projection was 2 of the step's 6 products at the p rows (bench/RESULTS.md, issue 15).
            directions = finalize_banks([(problems[i][0], X, problems[i][2], d2s[i]) for i, X, *_ in done], opts,
                                        project=False)
            for (i, _, c, r, fallbacks), A in zip(done, directions):
                solutions[i] = Solution(A, c, r, iterations, fallbacks)
    for i, solution in enumerate(solutions):
        if solution is None:
            W, G, geo, correction = problems[i]
            solutions[i] = admm_full(W, G, geo, correction, opts, d2s[i])
    return solutions


PRECISIONS = ("auto", "fp32", "tf32", "bf16")


def iteration_precision(opts, W):
    """The precision of ADMM's inner iterations (SolverOptions.precision), "auto" resolved: TF32
    where tensor cores run it (fp32 CUDA tensors), fp32 elsewhere (a CPU has no TF32 units; the
    emulation is for checking, not speed)."""
    if opts.precision not in PRECISIONS:
        raise ValueError(f"unknown solver precision {opts.precision!r}; valid: {', '.join(PRECISIONS)}")
    if opts.precision == "auto":
        return "tf32" if W.device.type == "cuda" and W.dtype == torch.float32 else "fp32"
    return opts.precision


def tf32_scope(opts, W):
    """kernels.tf32_products() where the iterations' precision is tf32, else nothing."""
    return kernels.tf32_products(iteration_precision(opts, W) == "tf32")


def span_iterations(spans, correction, opts):
    """admm_iterations on the stacked span problems, in `opts.precision`.

    tf32: every product of the iterations (the kernels' three products, clips and pullbacks
    included) reads its operands at TF32 and accumulates in fp32 (kernels.precision), 3x the
    3xTF32 rate, except the matrix signs (the starting polar factor, the clip's msign(Y) and its
    and the pullbacks' q x q signs), which run in bf16 (`polar`, `spectral_clip`, `pull_back`);
    direction quality on synthetic momenta 0.997 / 0.999 of the optimum (bench/RESULTS.md).
    bf16: the iterates themselves are bf16 (~6x the 3xTF32 rate), at 0.995 / 0.997. Either way
    the span reduction before, the elementwise span projection (the last operation on B: B leaves
    exactly tangent in span coordinates, to fp32 rounding), the lift, the renormalisation and the
    retraction after stay fp32, so the answer is feasible to fp32 accuracy whatever the
    iterations' rounding.
    """
    if iteration_precision(opts, spans.W) != "bf16" or spans.W.dtype == torch.bfloat16:
        with tf32_scope(opts, spans.W):
            return admm_iterations(spans.W, spans.G, spans.geo, correction, opts, spans.d2, spans.project)
    low = torch.bfloat16
    project = lambda Y: spans.project(Y.float()).to(low)  # noqa: E731
    B, correction, residual, iterations = admm_iterations(
        spans.W.to(low), spans.G.to(low), spans.geo, None if correction is None else correction.to(low),
        opts, spans.d2.to(low), project)
    # B projected again in fp32: its bf16 rounding had left it ~4e-3 off the tangent space,
    # and admm_in_span lifts it without a projection on the full matrices
    return spans.project(B.float()), correction.float(), residual.float(), iterations


def admm_iterations(W, G, geo, correction, opts, d2=None, project=None):
    """(B, correction, residual, iterations) of ADMM on  max <G, B>, B tangent, ||B||_op <= 1.

    Warm start: at the fixed point the scaled multiplier is rho U* = G + 2 W Lambda*, the dual
    problem's argument, so the previous step's correction Lambda* - Lambda0 (a q x q matrix,
    the same in any basis) restarts the iteration at U = X / rho, Z = msign(X) with
    X = Proj_T(G) + 2 W (Lambda* - Lambda0) (Proj_T G = G + 2 W Lambda0). Cold: U = 0,
    Z = msign(Proj_T G). The correction returned for the next step is, from a warm start, the
    mix admm_warm_average of the incoming one and this step's own. B is tangent: with
    opts.admm_pullbacks, Proj_T(Z) after those rounds (`pull_back_answer`). `project` is the
    tangent projection at W when a cheaper one than the generic is known (span.py), d2 the
    metric's squared column norms.
    """
    d2 = geo.squared_norms(W) if d2 is None else d2
    if project is None:
        project = lambda Y: geo.tangent_projection(W, Y, d2, opts.backend)  # noqa: E731
    GT = project(G)
    # The penalty scale: rho ~ ||Proj_T G||_op balances G / rho against the unit ball for
    # both flat and spiky spectra (momentum gradients have a few dominant singular values).
    # Started from the previous step's multiplier, a smaller penalty (a longer dual step)
    # converges faster; from nothing it overshoots (measured in bench/RESULTS.md).
    penalty = opts.admm_rho if correction is None else opts.admm_rho_warm
    # (the scale only sets the penalty: two squarings, a power of 4 x norm_iters, find the top of
    # a momentum's spiky spectrum, and a flat one's estimate is off by a few percent, harmlessly)
    rho = (penalty * spectral_norm(GT, opts.norm_iters, opts.backend, squarings=2)).clamp_min(1e-30)[..., None, None]
    if correction is None:
        Z, U = polar(GT, opts), torch.zeros_like(G)
    else:
        X = kernels.matmul_add(W, correction, GT, alpha=2.0, backend=opts.backend)
        Z, U = polar(X, opts), X / rho
    alpha = opts.admm_relax
    sync_free = capturable(opts, W)
    active = torch.ones(W.shape[:-2], dtype=torch.bool, device=W.device)
    # A cold start (the first step, or a stateless steepest_direction) gets twice the budget.
    # Near-square matrices (rows < 2 cols) have a degenerate optimum (many singular values of
    # A* below 1) and converge more slowly: on random 48x48 DGram inputs 8 iterations reach
    # 96.6% of the optimum, 16 reach 98.8%. They get twice the budget again.
    steps = opts.admm_steps * (2 if correction is None else 1) * (2 if W.size(-2) < 2 * W.size(-1) else 1)
    # From a warm start the penalty grows each iteration: the first, small, takes the long dual
    # step a warm start allows; the later, larger, pull B and Z together, which real momenta (a
    # degenerate optimum: many singular values of A* below 1) need. The scaled multiplier rho U
    # is kept, so the fixed point is unchanged.
    growth = 1.0 if correction is None else opts.admm_rho_growth
    for k in range(steps):
        if k > 0 and growth != 1.0 and penalty * growth ** (k - 1) < opts.admm_rho_max:
            factor = min(growth, opts.admm_rho_max / (penalty * growth ** (k - 1)))
            rho, U = rho * factor, U / factor
        B = project(Z - U + G / rho)
        # over-relaxation alpha B + (1 - alpha) Z (one launch): same fixed point, fewer iterations
        relaxed = torch.lerp(Z, B, alpha)
        Z_new = spectral_clip(relaxed + U, opts)
        U_new = U + relaxed - Z_new
        # primal residual ||B - Z|| and dual residual ||Z - Z_prev||, relative to ||B||
        # (Frobenius norms of same-size matrices: their ratio is the ratio of the rms)
        change = torch.maximum(frobenius(B - Z_new), frobenius(Z_new - Z)) / frobenius(B).clamp_min(1e-30)
        Z = masked_update(active, Z, Z_new)
        U = masked_update(active, U, U_new)
        active = active & (change > opts.tol)
        if not sync_free and (k + 1) % opts.check_every == 0 and not bool(active.any()):
            break
    # The answer. Without pullbacks: B = Proj_T(Z - U + G / rho), tangent, which the final
    # renormalisation scales into the ball. With them: Proj_T(Z), Z being in the ball already, so
    # that the rounds start nearer it than from B, which carries the last dual step (recorded
    # momenta +0.001 to +0.005, synthetic +0.003 over B with the same rounds; bench/RESULTS.md).
    B = pull_back_answer(project(Z) if opts.admm_pullbacks else project(Z - U + G / rho), project, opts)
    _, sumsq = geo.tangent_residual(W, Z, opts.backend, with_norm=True)
    # rho U - Proj_T G = 2 W (Lambda - Lambda0): the correction, by the exact Gram-space
    # solve P(W^T Y + Y^T W) / (d_i^2 + d_j^2) = 2 (Lambda - Lambda0) for Y = rho U - Proj_T G
    new_correction = geo.preconditioned(W, rho * U - GT, d2, 0.5, opts.backend)
    if correction is not None and opts.admm_warm_average:
        # the next step starts from an average of the corrections: 4 iterations leave each one
        # noisy, and the momentum moves slowly (real momenta gain 0.002-0.01: bench/RESULTS.md)
        new_correction = torch.lerp(new_correction, correction, opts.admm_warm_average)
    return B, new_correction, relative_residual(W, sumsq), k + 1


def solve_tall(W, G, manifold, state=None, opts=None):
    """Solve on the tall orientation (W, G: (..., p, q), p >= q). G need not be normalised."""
    opts = opts or SolverOptions()
    geo = geometry(manifold, opts.dgram_cap)
    G = unit(G)
    if manifold == "none":
        A = kernels.msign(G, opts.msign_steps, opts.polish_steps, opts.backend)
        zero = torch.zeros(W.shape[:-2], dtype=W.dtype, device=W.device)
        return Solution(A, None, zero, 0)
    solver = choose_solver(W.shape, manifold) if opts.solver == "auto" else opts.solver
    if solver not in ("dual", "admm"):
        raise ValueError(f"unknown solver {solver!r}; valid: auto, dual, admm")
    solve = dual_ascent if solver == "dual" else admm
    solution = solve(W, G, geo, state, opts)
    if manifold == "dgram-cap":
        solution = solve_capped(W, G, geo, state, opts, solve, solution)
    return solution


def unit(G):
    """G / ||G||_F per matrix: the direction does not depend on G's scale, the multiplier does."""
    return G / G.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-30)


def solve_tall_banks(banks, opts=None):
    """[Solution] for banks [(W, G, manifold, state)] (tall orientation) under the same options.

    The banks ADMM solves in span coordinates (Stiefel or DGram, rows >= 2 cols) are solved
    together, one batched ADMM per column count q and warm/cold start (admm_in_span): GPT-2
    small HETERO's c_attn, c_fc and mlp.c_proj of all layers are 36 problems of 1536 x 768,
    each product of an iteration one launch for all. Every other bank goes through solve_tall.
    """
    opts = opts or SolverOptions()
    solutions = [None] * len(banks)
    stacks = {}
    for i, (W, G, manifold, state) in enumerate(banks):
        solver = choose_solver(W.shape, manifold) if opts.solver == "auto" else opts.solver
        if manifold in ("stiefel", "dgram") and solver == "admm" and reducible(W, opts):
            state = usable_correction(W, state)
            key = (W.size(-1), state is None, W.dtype, W.device)
            stacks.setdefault(key, []).append((i, (W, unit(G), geometry(manifold), state)))
        else:
            solutions[i] = solve_tall(W, G, manifold, state, opts)
    for members in stacks.values():
        for (i, _), solution in zip(members, admm_in_span([problem for _, problem in members], opts)):
            solutions[i] = solution
    return solutions


def solve_capped(W, G, geo, state, opts, solve, solution, rounds=3):
    """The tangent cone of dgram-cap by an active set (geometry.DGramCap).

    The first solve is DGram's. A column at the cap whose direction would grow it (the
    step is W - eta A, so (W^T A)_ii < 0) is pinned ((W^T A)_ii = 0) and the bank solved
    again; pinning can make other capped columns grow, hence a few rounds. The set only
    grows within a step and is rebuilt from scratch at the next one. One host sync per round,
    and none when no column is at the cap. Capturable: every round runs (a round that pins
    nothing new solves the same problem again), no syncs.
    """
    at_cap = geo.at_cap(W)
    sync_free = capturable(opts, W)
    if not sync_free and not bool(at_cap.any()):
        return solution
    pinned = torch.zeros_like(at_cap)
    for _ in range(rounds):
        growing = at_cap & ~pinned & (torch.diagonal(W.mT @ solution.A, dim1=-2, dim2=-1) < 0)
        if not sync_free and not bool(growing.any()):
            break
        pinned = pinned | growing
        solution = solve(W, G, geo.pin(pinned), state, opts)
    return solution


def steepest_direction(W, G, manifold, **solver_opts):
    """Ascent direction A of one manifold Muon step (the update is W - lr * A).

    W, G: (..., m, n), one matrix or a batch, either orientation. Returns A shaped like G with
    ||A||_op = 1 (up to the power-iteration estimate) and P(W^T A + A^T W) = 0 (fp accuracy).
    """
    opts = SolverOptions.from_kwargs(**solver_opts)
    wide = W.size(-2) < W.size(-1)
    if wide:
        W, G = W.mT, G.mT
    A = solve_tall(W, G, manifold, None, opts).A
    return A.mT if wide else A
