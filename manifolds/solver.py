"""Steepest descent under the spectral norm in a manifold's tangent space: the fast path.

    A* = argmax <G, A>   subject to   ||A||_op <= 1   and   P(W^T A + A^T W) = 0

manifolds/reference.py states the same computation in plain torch; this module computes it
batched, through `kernels`, as a `SolverPlan` (manifolds/plan.py) says. Work is on the tall
orientation (W, G: (..., p, q), p >= q) and G is normalised first (the direction ignores its
scale, the multiplier does not). By shape and scheme:

* square Stiefel (`exact_square_stiefel`): the optimum is msign(G + 2 W Lambda0) with
  Lambda0 = -P(W^T G + G^T W) / (2 (d_i^2 + d_j^2)): G + 2 W Lambda0 = W skew(W^T G) is already
  tangent, and its polar factor is too. One matrix sign.
* everything else, scheme "online" (the default): one step of dual descent per training step
  from the previous step's multiplier (`online_iterations`), its answer sharpened
  (`FullProblem.sharpened`) on manifolds of orthogonal columns; banks of one shape and manifold
  stacked (`online_banks`). One matrix sign per matrix and step.
* everything else, scheme "admm": ADMM on  max <G, B>,  B tangent,  Z in the unit spectral ball,  B = Z:
      B <- Proj_T(Z - U + G / rho);   Z <- clip(B + U);   U <- U + B - Z
  (`admm_iterations`), `clip` capping singular values at 1 (`spectral_clip`). Tall banks
  (rows >= 2 cols) on a manifold of orthogonal columns run it as the equivalent 2q x q problem
  in span[W, G] (span.py), all such banks of one q stacked into one batch (`admm_in_span`);
  near-square and Oblique banks on the full matrices (`admm_full`). Each step after the first starts from the previous step's
  multiplier, kept as the correction Lambda - Lambda0 (a q x q matrix, the same in any basis).

Every answer ends tangent (an exact projection) and divided by an upper bound on its ||A||_op
(`finalize_banks`): ||A||_op <= 1, and within ~1e-3 of it.

Under `plan.capturable` nothing reads a device value on the host: every loop runs its fixed
budget (finished matrices are frozen by a mask, so the result equals an early exit's), and the
span reduction's precision fallback is chosen per matrix on the device. Otherwise convergence
is checked every CHECK_EVERY iterations, one host sync per check.
"""
from dataclasses import dataclass, replace
from functools import cached_property

import torch

import kernels
from kernels.constants import eye, kept, scalar
from kernels.products_torch import pair_scale
from kernels.matrix_sign import CLIP_SCHEDULE, EXACT_SCHEDULE, POLAR_SCHEDULE
from manifolds.geometry import geometry
from manifolds.plan import (CHECK_EVERY, EXACT_PE_STEPS, MUON_STEPS, NORM_ITERS, NORM_SQUARINGS, ONLINE_COLD, RHO_MAX,
                            SolverOptions, plan_for)
from manifolds.norm_bound import top_eigenvalue, top_eigenvalue_bound
from manifolds.span import StackedSpans

__all__ = ["SolverOptions", "Solution", "solve_tall_banks", "steepest_direction"]


@dataclass
class Solution:
    A: torch.Tensor             # tall orientation, tangent, 1 - ~1e-3 <= ||A||_op <= 1
    warm_start: object          # warm start: the multiplier's correction Lambda - Lambda0 (q x q), or None
    residual: torch.Tensor      # per-matrix relative tangent residual of the iterate before the answer
    iterations: int             # iterations run (the same for the whole batch)
    fallbacks: object = 0       # matrices that took the span's precision fallback (a tensor, or 0)


# per-bank statistics of a step (ManifoldMuon.stats): iterations and residual are maxima over
# matrices and ranks, fallbacks a count
STAT_FIELDS = ("iterations", "residual", "fallbacks")
STATS = len(STAT_FIELDS)


# --- small helpers --------------------------------------------------------------------------

def exact_rescale(G):
    """G scaled per matrix by a power of two so that its largest |entry| lies in [0.5, 1): exact
    (no mantissa bit changes, so a G of ordinary size gives the same bits downstream), and what
    follows forms squares and norms that neither overflow (a G near fp32's largest value: its
    squares are inf, and the step read as no signal) nor underflow (a G of 1e-30: squares of
    1e-60 are 0 in fp32). A zero or non-finite matrix is left as it is (frexp's exponent 0); the
    exponent is clamped so that the factor 2^-e itself stays finite (a subnormal G is lifted to
    2^-12 at least, not to [0.5, 1))."""
    # the largest |entry| by one reduction (vector_norm's inf-norm: max |x|, exact), not abs then amax
    _, exponent = torch.frexp(torch.linalg.vector_norm(G, float("inf"), dim=(-2, -1), keepdim=True))
    return torch.ldexp(G, (-exponent).clamp(-120, 120)).to(G.dtype)


def unit(G):
    """G / ||G||_F per matrix: the direction does not depend on G's scale, the multiplier does."""
    return G / G.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-30)


def frobenius(M):
    return torch.linalg.matrix_norm(M)


def masked_update(active, old, new):
    return torch.where(active.reshape(active.shape + (1, 1)), new, old)


# --- no signal, no motion -------------------------------------------------------------------
#
# The direction depends on G only through its tangent part Proj_T G: X = G + W (2 C - M0) =
# Proj_T G + 2 W C, G = unit(G) (a change of G's scale leaves the warm start C meaning the same).
# Keeping C in units of ||Proj_T G||_F instead (converted by t = ||Proj_T G|| / ||G||) was tried:
# it moved the tiny model's golden losses by 1.2e-4 (hetero) and 1.2e-3 (all-dgram), the last ten
# steps' mean 0.0008 higher for all-dgram, and synthetic quality not at all; not kept. A matrix whose tangent part is below SIGNAL_TOL of ||G||_F (a zero gradient,
# G = W S with S in P's range, a non-finite G) has no direction: its answer is 0 and its warm
# start is kept as it came in. The carried correction is bounded (CORRECTION_CAP) and a
# non-finite one dropped, so a bad state cannot become a full step.

SIGNAL_TOL = {"tf32": 3e-3}  # ||Proj_T G||_F / ||G||_F below this is no signal; other precisions:
SIGNAL_TOL_FP32 = 1e-4       # the tangent part's rounding: ~2e-7 in fp32, ~3e-4 with TF32 products
SKETCH_COLUMNS = 16          # probes of the tangent-norm sketch (its relative spread ~ (2 / 16)^(1/2))
CORRECTION_CAP = 8.0         # ||2 W C||_F <= CORRECTION_CAP for the carried correction (G of unit norm;
                             # warm steps measured 0.06-0.4 on synthetic momenta, online and ADMM)


def signal_tolerance(plan):
    return SIGNAL_TOL.get(plan.precision, SIGNAL_TOL_FP32)


def finite(*xs):
    """Per entry, whether each of xs (one shape) is finite, and-ed: torch.isfinite's answer in fewer
    launches (x * 0 is 0 for a finite x, NaN for an infinite or NaN one: 2 launches where isfinite
    decomposes into 5, abs, ne, eq, mul and bitwise_and; several values stacked: 4 in all)."""
    x = xs[0] if len(xs) == 1 else torch.stack(xs)
    ok = x * 0 == 0
    return ok if len(xs) == 1 else ok.all(dim=0)


def sketch_probes(q, dtype, device, columns=SKETCH_COLUMNS):
    """A fixed q x columns matrix of +-1 (a hash of the indices; made on the device, no host data)."""
    i = torch.arange(q, device=device, dtype=torch.int64)[:, None]
    j = torch.arange(columns, device=device, dtype=torch.int64)[None, :]
    bits = ((i * 2654435761 + (j + 1) * 40503 + i * j * 97) >> 7) & 1
    return (1 - 2 * bits).to(dtype)


def tangent_signal(W, G, M0, pair, plan):
    """Per matrix, whether G has a tangent part above rounding (signal_tolerance), from
    M0 = P(W^T G + G^T W) / (d_i^2 + d_j^2) (Proj_T G = G - W M0) without forming Proj_T G, by
    two estimates of ||Proj_T G||_F^2:

    * in q x q, ||Proj_T G||_F^2 = ||G||_F^2 - <W^T G, M0> = ||G||_F^2 - <M0, pair M0> / 2 (the
      pair identity of geometry.py), exact to ~1e-7 ||G||_F^2: it cancels when G is nearly normal
      (its square root then reads ~3e-4 ||G||_F for a G with none);
    * a sketch, ||(G - W M0) Om||_F^2 / k with Om a fixed q x k sign matrix: unbiased, its
      difference taken entry by entry (no cancellation: ~2e-7 for a normal G in fp32), its spread
      ~35% at k = 16; O(p q k), 2% of a p x q x q product at q = 768.

    The decision reads the sketch (a random tangent part 10x the tolerance would need a 16-probe
    chi-square below 1e-2 of its mean to be missed) or the q x q value where that is precise.
    (It returned an estimate of the norm too, which no caller read: 4 launches a bank, dropped.)"""
    g2 = G.square().sum(dim=(-2, -1))
    m2 = (pair * M0.square()).sum(dim=(-2, -1))  # <M0, pair M0>
    probes = kept("probes", (G.size(-1), SKETCH_COLUMNS), G, lambda: sketch_probes(G.size(-1), G.dtype, G.device))
    Y = G @ probes - W @ (M0 @ probes)
    # t2 = g2 - m2 / 2 and s2 = ||Y||_F^2 / k against multiples of g2 (kernels/signal.py: one launch
    # on CUDA): s2 > tol^2 g2 or t2 > 1e-4 g2 (either estimate may see the signal: the q x q one
    # wherever it is precise, t > 1e-2 ||G||_F, 10x its TF32 noise, which also covers a tangent
    # part the q - k null directions of the fixed probes would hide from the sketch), and g2 > 0
    return kernels.signal_from_sums(g2, m2, Y.square().sum(dim=(-2, -1)), probes.size(-1), signal_tolerance(plan),
                                    plan.backend)


def stand_in(G):
    """A fixed +-1 pattern of unit Frobenius norm, G's shape: the problem a matrix without signal
    is solved on instead of its own (0, normal or non-finite: its iterations would divide by 0 or
    hand eigh a NaN); its answer is then discarded (silence)."""
    p, q = G.shape[-2:]
    return kept("stand_in", (p, q), G, lambda: stand_in_pattern(p, q, G.dtype, G.device)).expand(G.shape)


def stand_in_pattern(p, q, dtype, device):
    i = torch.arange(p, device=device, dtype=torch.int64)[:, None]
    j = torch.arange(q, device=device, dtype=torch.int64)[None, :]
    bits = ((i * 2654435761 + j * 40503 + i * j * 97) >> 5) & 1
    return (1 - 2 * bits).to(dtype) / (p * q) ** 0.5


def bounded_correction(C, d2):
    """The carried correction C (q x q) made safe to start from: 0 where it is not finite, and
    scaled down where ||2 W C||_F = 2 ||D C||_F exceeds CORRECTION_CAP (for a unit G an
    optimum's is well below 1: a larger one is stale or corrupt, and it would outweigh G)."""
    C = torch.where(finite(C).all(dim=(-2, -1), keepdim=True), C, scalar(0.0, C))
    size = 2 * (C.square() * d2[..., :, None]).sum(dim=(-2, -1), keepdim=True).sqrt()
    return C * (CORRECTION_CAP / size.clamp_min(CORRECTION_CAP))


def with_signal(W, G, geo, d2, plan):
    """(G, signal) for the solvers that do not form M0 themselves (ADMM, whose span coordinates
    shift G's Gram and cannot tell a normal G from a tangent one): one fp32 product W^T G more.
    G is kept where it has a signal (ADMM runs on the G it always ran on: its span reduction
    decides its precision fallback by a Cholesky that a rounding can flip), a stand-in elsewhere."""
    M0 = geo.preconditioned(W, G, d2, 1.0, plan.backend)
    signal = tangent_signal(W, G, M0, pair_scale(d2), plan)
    return torch.where(signal[..., None, None], G, stand_in(G)), signal


def silence(signal, X):
    """X where the matrix has a signal, 0 elsewhere (a NaN computed from no signal included)."""
    return torch.where(signal.reshape(signal.shape + (1,) * (X.dim() - signal.dim())), X, scalar(0.0, X))


def relative_residual(W, sumsq):
    """rms(H) / mean column norm of W, from sumsq = ||H||_F^2: the scale-free tangent residual."""
    rms_H = (sumsq.to(W.dtype) / W.size(-1) ** 2).sqrt()
    return rms_H / W.norm(dim=-2).mean(dim=-1).clamp_min(1e-30)


def spectral_norm(A, backend, squarings=5):
    """||A||_op per matrix: the square root of the top eigenvalue of A^T A (q x q)."""
    return top_eigenvalue(kernels.sym_product(A.mT, backend=backend), NORM_ITERS, backend, squarings).sqrt()


def in_sign_dtype(f, X, plan):
    """f(X) with X in the plan's matrix-sign dtype, returned in X's."""
    return f(X.to(plan.sign_torch_dtype)).to(X.dtype)


# --- the matrix functions of ADMM -----------------------------------------------------------

def gram_function(Y, f):
    """Y Q f(lam) Q^T for Y^T Y = Q diag(lam) Q^T: a function of Y's singular values s =
    lam^(1/2) applied on the right (f(lam) = lam^(-1/2): the polar factor)."""
    Y32 = Y.float()  # eigh has no bf16; its q x q work is small next to the products
    lam, Q = torch.linalg.eigh(Y32.mT @ Y32)
    return (Y32 @ ((Q * f(lam.clamp_min(1e-30)).unsqueeze(-2)) @ Q.mT)).to(Y.dtype)


def polar(Y, plan, steps=None):
    """msign(Y) = U V^T for tall Y = U S V^T: ADMM's starting Z (steps: of POLAR_SCHEDULE, the
    plan's by default)."""
    if plan.clip == "eigh":
        # singular values below 1e-3 of the largest are rounding noise in Y^T Y (fp32) and would be
        # blown up to 1: they are scaled as if they were 1e-3
        return gram_function(Y, lambda lam: lam.clamp_min(1e-6 * lam.amax(dim=-1, keepdim=True)).rsqrt())
    # every step of POLAR_SCHEDULE at every precision: the last lifts singular values below its lower end
    steps = plan.polar_steps if steps is None else steps
    return in_sign_dtype(lambda X: kernels.msign(X, steps, 0, plan.backend, POLAR_SCHEDULE), Y, plan)


def clip_sign(X, plan):
    """msign of the clip's and pullbacks' inputs, whose singular values (after msign's
    normalisation) stay above CLIP_LOWER, the range CLIP_SCHEDULE is built for."""
    return kernels.msign(X, plan.clip_steps, 0, plan.backend, CLIP_SCHEDULE)


def spectral_clip(Y, plan):
    """Project Y onto the unit spectral-norm ball: U min(S, 1) V^T for Y = U S V^T.

    eigh: Y Q diag(min(1, lam^(-1/2))) Q^T. Polynomial: with O = msign(Y) and
    P = O^T Y = V S V^T (q x q, PSD), min(P, I) = (P + I - |P - I|) / 2 and
    |P - I| = sign(P - I)(P - I), the sign of a symmetric matrix being its polar factor.
    """
    if plan.clip == "eigh":
        return gram_function(Y, lambda lam: lam.rsqrt().clamp_max(1.0))
    O = in_sign_dtype(lambda X: clip_sign(X, plan), Y, plan)
    E, absE = minus_identity_and_abs(kernels.symmetric_part(O, Y, plan.backend), plan)  # P = sym(O^T Y)
    # O min(P, I) = O (I + (E - |E|) / 2): one product with O added in the epilogue
    return kernels.matmul_add(O, E - absE, O, alpha=0.5, backend=plan.backend)


def minus_identity_and_abs(S, plan):
    """(E, |E|) for E = S - I, S symmetric (q x q): |E| = sym(sign(E) E). Its least accurate
    eigenvalues, those near 0, matter least to both callers: they change min(P, I) in the clip
    and E+ in the pullback by about themselves."""
    E = S - eye(S.size(-1), S)
    sign_E = in_sign_dtype(lambda X: clip_sign(X, plan), E, plan)
    return E, kernels.symmetric_part(sign_E.mT, E, plan.backend)


def pull_back(B, plan):
    """B with its singular values above 1 brought to (about) 1, those below unchanged.

    eigh: the exact spectral clip. Polynomial: for B = U S V^T and E = B^T B - I, the positive
    part E+ = (E + |E|) / 2 gives B (I - E+ / 2) = U f(S) V^T with f(s) = s for s <= 1 and
    f(s) = s (3 - s^2) / 2 above (a Newton-Schulz step on the excess only: f(1.02) = 0.9994)."""
    if plan.clip == "eigh":
        return spectral_clip(B, plan)
    E, absE = minus_identity_and_abs(kernels.sym_product(B.mT, backend=plan.backend), plan)  # B^T B
    # B (I - E+ / 2) = B - (B (E + |E|)) / 4: one product with B added in the epilogue
    return kernels.matmul_add(B, E + absE, B, alpha=-0.25, backend=plan.backend)


def pull_back_answer(B, project, plan):
    """B <- Proj_T(pull_back(B)), plan.options.pullbacks times: a few ADMM iterations leave many
    singular values of the tangent answer a little above 1, for which the final renormalisation
    would shrink the whole direction; each round leaves fewer and smaller excesses."""
    for _ in range(plan.options.pullbacks):
        B = project(pull_back(B, plan))
    return B


# --- ADMM -----------------------------------------------------------------------------------

def admm_budget(W, warm, options):
    """Iterations of one solve: doubled from a cold start (the first step, or a stateless
    steepest_direction), doubled again for near-square matrices (rows < 2 cols), whose optimum is
    degenerate (many singular values of A* below 1) and converges more slowly."""
    return options.iterations * (1 if warm else 2) * (2 if W.size(-2) < 2 * W.size(-1) else 1)


def admm_iterations(W, G, geo, correction, plan, d2, project=None):
    """(B, correction, residual, iterations) of ADMM on  max <G, B>, B tangent, ||B||_op <= 1.

    Warm start: at the fixed point the scaled multiplier is rho U* = G + 2 W Lambda*, so the
    previous step's correction Lambda* - Lambda0 restarts the iteration at U = X / rho,
    Z = msign(X), X = Proj_T(G) + 2 W (Lambda* - Lambda0) (Proj_T G = G + 2 W Lambda0). Cold:
    U = 0, Z = msign(Proj_T G). `project` is the tangent projection at W when a cheaper one than
    the generic is known (span.py); d2 the metric's squared column norms.
    """
    options = plan.options
    if project is None:
        project = lambda Y: geo.tangent_projection(W, Y, d2, plan.backend)  # noqa: E731
    GT = project(G)
    # rho ~ ||Proj_T G||_op balances G / rho against the unit ball for flat and spiky spectra
    # alike; two squarings find the top of a momentum's spiky spectrum well enough for a penalty
    warm = correction is not None
    penalty = options.rho_warm if warm else options.rho
    rho = (penalty * spectral_norm(GT, plan.backend, squarings=2)).clamp_min(1e-30)[..., None, None]
    if warm:
        X = kernels.matmul_add(W, correction, GT, alpha=2.0, backend=plan.backend)
        Z, U = polar(X, plan), X / rho
    else:
        Z, U = polar(GT, plan), torch.zeros_like(G)
    # From a warm start the penalty grows each iteration (up to RHO_MAX): the first, small, takes
    # the long dual step a warm start allows; the later pull B and Z together. rho U is kept, so
    # the fixed point is unchanged.
    growth = options.rho_growth if warm else 1.0
    active = torch.ones(W.shape[:-2], dtype=torch.bool, device=W.device)
    for k in range(admm_budget(W, warm, options)):
        if k > 0 and growth != 1.0 and penalty * growth ** (k - 1) < RHO_MAX:
            factor = min(growth, RHO_MAX / (penalty * growth ** (k - 1)))
            rho, U = rho * factor, U / factor
        B = project(Z - U + G / rho)
        # over-relaxation relax B + (1 - relax) Z: the same fixed point, fewer iterations
        relaxed = torch.lerp(Z, B, options.relax)
        Z_new = spectral_clip(relaxed + U, plan)
        U_new = U + relaxed - Z_new
        # primal residual ||B - Z|| and dual residual ||Z - Z_prev||, relative to ||B||
        change = torch.maximum(frobenius(B - Z_new), frobenius(Z_new - Z)) / frobenius(B).clamp_min(1e-30)
        Z = masked_update(active, Z, Z_new)
        U = masked_update(active, U, U_new)
        active = active & (change > options.tol)
        if not plan.capturable and (k + 1) % CHECK_EVERY == 0 and not bool(active.any()):
            break
    # The answer: with pullbacks they start from Proj_T(Z), inside the ball already; without,
    # B itself, which the final renormalisation scales into the ball
    B = pull_back_answer(project(Z) if options.pullbacks else project(Z - U + G / rho), project, plan)
    _, sumsq = geo.tangent_residual(W, Z, plan.backend, with_norm=True)
    # rho U - Proj_T G = 2 W (Lambda - Lambda0), solved exactly in Gram space:
    # P(W^T Y + Y^T W) / (d_i^2 + d_j^2) = 2 (Lambda - Lambda0)  for Y = rho U - Proj_T G
    new_correction = geo.preconditioned(W, rho * U - GT, d2, 0.5, plan.backend)
    if warm and options.warm_average:
        # the next step starts from an average over steps: a few iterations leave each correction noisy
        new_correction = torch.lerp(new_correction, correction, options.warm_average)
    return B, new_correction, relative_residual(W, sumsq), k + 1


# --- the online scheme: one dual step per training step -----------------------------------

class FullProblem:
    """The tangent geometry of full p x q matrices W (on their manifold) in the form
    online_iterations uses; span.StackedSpans has the same two operations in span coordinates."""

    def __init__(self, W, geo, d2, backend):
        self.W, self.geo, self.d2, self.backend = W, geo, d2, backend

    def multiplier(self, Y):
        """M = P(W^T Y + Y^T W) / (d_i^2 + d_j^2): Y - W M is Y's tangent projection."""
        return self.geo.preconditioned(self.W, Y, self.d2, 1.0, self.backend)

    def times_W(self, M, Y, alpha):
        """Y + alpha W M."""
        return kernels.matmul_add(self.W, M, Y, alpha=alpha, backend=self.backend)

    def cross(self, Y):
        """S = W^T Y (q x q), for sharpened; multiplier(Y) is multiplier_of_cross(S)."""
        return kernels.matmul(self.W.mT, Y, backend=self.backend)

    @cached_property
    def pair(self):
        """(d_i^2 + d_j^2), (..., q, q)."""
        return pair_scale(self.d2)

    def multiplier_of_cross(self, S):
        """P(S + S^T) / (d_i^2 + d_j^2) from S = W^T Y: multiplier(Y) in q x q."""
        return self.geo.gram_projector((S + S.mT) / self.pair)

    def sharpened(self, A, S, M, low=False):
        """A Newton-Schulz step on the answer B = A - W M, then its tangent projection, in q x q
        but for one product: A'' = A R - W (M R + M'), with S = W^T A and M = multiplier(A).

        B = Proj_T(msign(X)) is tangent but its singular values spread well below 1 while the
        dual is not converged (median 0.80 at GPT-2 small's c_attn on recorded momenta, where the
        optimum's are 0.99), and the norm bound scales the whole answer by its largest: the step
        is short in every direction G weighs little (docs/solver-tuning.md). The cubic
        s -> 1.5 s - 0.5 s^3 lifts them (its maximum: 1 at s = 1). For W with diagonal Gram
        D = W^T W = diag(d_i^2) and A^T A = I (A a polar factor):
            H = B^T B = I - T - T^T + M D M,  T = S^T M;   R = 1.5 I - 0.5 H = I + R1;   A' = B R,
            W^T A' = K R,  K = S - D M;   M' = P(K R + R K^T) / (d_i^2 + d_j^2);   A'' = A' - W M'.
        A^T A is I only as well as the sign converged; R is a step, not an identity that must
        hold: A'' is tangent whatever R is, and finalize_banks bounds its norm exactly.
        Products as matmul_add (C + B X), so that no identity is formed.

        low (sign_reads_bf16: A is a bf16 sign's result, its values bf16 already): the tall product
        A R1 reads bf16 operands (kernels.bf16_products: A exactly, R1 rounded, ~2e-3 of R1 <= 0.5,
        under the sign's own error; the sum A + A R1 in fp32), at twice TF32's rate; the projection
        by W stays at the plan's precision, so the answer is as tangent as before (GPT-2 small hetero,
        one H200, python -m bench.cost_model --fake: 14.26 -> 13.97 ms, docs/solver-tuning.md)."""
        d2 = self.d2
        T = kernels.matmul(S.mT, M, backend=self.backend)
        R1 = kernels.matmul_add(M * d2[..., None, :], M, T + T.mT, alpha=-0.5, beta=0.5, backend=self.backend)
        K = torch.addcmul(S, d2[..., :, None], M, value=-1.0)
        M1 = self.multiplier_of_cross(kernels.matmul_add(K, R1, K, backend=self.backend))
        N = kernels.matmul_add(M, R1, M + M1, backend=self.backend)  # M R + M'
        with kernels.bf16_products(low):
            lifted = kernels.matmul_add(A, R1, A, backend=self.backend)  # A + A R1
        return kernels.matmul_add(self.W, N, lifted, alpha=-1.0, backend=self.backend)


def sharpens(geo, plan):
    """Whether the online scheme sharpens this manifold's answers (FullProblem.sharpened: W^T W
    must be diagonal). Their matrix sign is then one POLAR_SCHEDULE step shorter: after 5 steps
    it is within 4.3e-4 of 1 on [0.005, 1], under a bf16 sign's own rounding, sharpen lifts what
    the sixth step would, and the exact projection after it makes the answer tangent whatever the
    sign's error. The Hyperball (3 dual steps per training step, converging) keeps all 6: with 5
    its worst quality under bf16 signs fell from 0.994 to 0.989 (tests/test_hyperball.py)."""
    return plan.options.sharpen and geo.orthogonal_columns


def online_sign_steps(geo, plan):
    """POLAR_SCHEDULE steps of the online scheme's matrix sign for this manifold (sharpens)."""
    return plan.polar_steps - (1 if sharpens(geo, plan) else 0)


def sign_reads_bf16(plan):
    """Whether the online scheme's matrix sign reads its input X in bf16 (polynomial signs in bf16:
    a GPU's TF32 plan). Then X = G + W (2C - M0) is formed from bf16-rounded W and 2C - M0 (fp32
    sum): its rounding, 2^-9 of each operand, is that of the cast the sign makes of X anyway, and
    the product runs at twice TF32's rate."""
    return plan.clip != "eigh" and plan.sign_torch_dtype == torch.bfloat16


def online_iterations(problem, G, correction, plan):
    """(B, correction, residual, iterations) of dual descent on ||G + 2 W Lambda||_*, one step
    per training step from the previous step's multiplier (ONLINE_COLD steps from a cold start;
    a manifold may ask for more, geo.online_steps).

    With Lambda = Lambda0 + C (Lambda0 the Euclidean projection's multiplier, C the correction
    kept across steps, q x q), each step is

        X = Proj_T(G) + 2 W C = G + W (2 C - M0);   A = msign(X);   M = P(W^T A + A^T W) / (d_i^2 + d_j^2)
        C <- C - dual_step (s / 2) M,   s = ||X||_F / sqrt(q)

    M is the preconditioned dual gradient. The step is Newton's for a polar factor that
    moves by dX / s: then H = P(W^T A + A^T W) moves by 2 (d_i^2 + d_j^2) dLambda / s, and
    dLambda = -s M / 2 cancels it; s, the rms singular value of X, stands in for all of them.
    The answer is Proj_T(A) = A - W M: tangent exactly, with ||.||_op about 1 (finalize_banks
    bounds it). Lambda changes slowly from step to step, so a step from the last one tracks the
    optimum at the cost of one matrix sign: ADMM spends two per iteration and 3 iterations.

    A manifold whose multiplier is one number per matrix (geo.secant_dual: the Hyperball's)
    takes every step after the first inside one call as a secant step, the Barzilai-Borwein
    length <dC, dM> / <dM, dM> (for a scalar C exactly the secant on M(C) = 0), kept within
    [0.1, 10] times the rms step: the rms step alone converges slowly where small singular values
    make the true Newton step shorter (tests/test_hyperball.py).
    """
    W, geo = problem.W, problem.geo
    q = W.size(-1)
    M0 = problem.multiplier(G)  # Proj_T(G) = G - W M0
    signal = tangent_signal(W, G, M0, problem.pair, plan)
    G = torch.where(signal[..., None, None], G, stand_in(G))
    # (a stand-in's X = G + 2 W C need not be its tangent part: only its answer's finiteness matters)
    M0 = torch.where(signal[..., None, None], M0, scalar(0.0, M0))
    warm = correction is not None
    incoming = (bounded_correction(correction, problem.d2) if warm
                else torch.zeros(W.shape[:-2] + (q, q), dtype=W.dtype, device=W.device))
    C = incoming
    steps = geo.online_steps if warm else max(ONLINE_COLD, geo.online_steps)
    previous = None
    sharpen, sign_steps = sharpens(geo, plan), online_sign_steps(geo, plan)
    low_x = sign_reads_bf16(plan)
    for k in range(steps):
        # Proj_T(G) + 2 W C = G - W (M0 - 2 C) in one product (M0 - 2 C: one launch, exactly -(2 C - M0));
        # its operands read in bf16 where the sign reads X in bf16 anyway (sign_reads_bf16)
        with kernels.bf16_products(low_x):
            X = problem.times_W(torch.sub(M0, C, alpha=2.0), G, -1.0)
        A = polar(X, plan, sign_steps)
        if sharpen and k == steps - 1:
            S = problem.cross(A)
            M = problem.multiplier_of_cross(S)
        else:
            M = problem.multiplier(A)
        rms = (X.square().sum(dim=(-2, -1)) / q).sqrt()[..., None, None]
        step = (0.5 * getattr(plan.options, geo.online_dual_option)) * rms
        if geo.secant_dual and previous is not None:
            dC, dM = C - previous[0], M - previous[1]
            secant = (dC * dM).sum(dim=(-2, -1), keepdim=True) / dM.square().sum(dim=(-2, -1), keepdim=True).clamp_min(
                torch.finfo(W.dtype).tiny)
            step = torch.where(secant > 0, torch.minimum(torch.maximum(secant, 0.1 * step), 10 * step), step)
        previous = (C, M)
        C = C - step * M
    H = M * problem.pair  # P(W^T A + A^T W) of the last sign
    B = problem.sharpened(A, S, M, low_x) if sharpen else problem.times_W(M, A, -1.0)
    if geo.secant_dual:
        B = better_answer(problem, G, B, projected_sign(problem, G, plan, sign_steps), plan)
    # no signal: no answer, and the warm start as it came (a step of G = 0 teaches it nothing)
    C = torch.where(signal[..., None, None], C, incoming)
    return silence(signal, B), C, silence(signal, relative_residual(W, H.square().sum(dim=(-2, -1)))), steps


def projected_sign(problem, G, plan, sign_steps):
    """Proj_T(msign(G)): the projected Muon step. The matrix sign keeps G's rank (its zero singular
    values stay 0), which the dual's msign(G - lambda W) does not."""
    A = polar(G, plan, sign_steps)
    return problem.times_W(problem.multiplier(A), A, -1.0)


def better_answer(problem, G, B, other, plan):
    """Per matrix, whichever of the tangent answers B and `other` makes more progress
    <G, A> / ||A||_op (the norm by norm_bound.top_eigenvalue_bound, an upper bound: the score a lower
    bound on what finalize_banks makes of it). The Hyperball's secant dual, one multiplier for the
    whole matrix, stalls on a rank-deficient G at 0.64-0.85 of the optimum where the projected
    Muon step takes 0.98-1.0 (tests/test_no_signal.py); on full-rank momenta the dual's wins."""
    pair = torch.stack([B, other])
    grams = kernels.sym_product(pair.mT, backend=problem.backend)
    norms = top_eigenvalue_bound(grams.reshape((-1,) + grams.shape[-2:]), NORM_SQUARINGS, problem.backend,
                                 tf32=plan.tf32, late_dtype=plan.sign_torch_dtype).reshape(grams.shape[:-2]).sqrt()
    score = (G * pair).sum(dim=(-2, -1)) / norms.clamp_min(torch.finfo(G.dtype).tiny)
    take = (score[1] > score[0]) & finite(score[1])
    return torch.where(take[..., None, None], other, B)


def span_iterations(spans, correction, plan):
    """admm_iterations on stacked span problems, their products at plan.precision: under tf32 they
    read TF32 operands (kernels.tf32_products), under bf16 the iterates themselves are bf16. The
    reduction before, the span's elementwise projection (the last operation on B), the lift, the
    renormalisation and the retraction stay fp32, so the answer is feasible to fp32 accuracy
    whatever the iterations' rounding."""
    if plan.precision != "bf16" or spans.W.dtype == torch.bfloat16:
        with kernels.tf32_products(plan.tf32):
            return admm_iterations(spans.W, spans.G, spans.geo, correction, plan, spans.d2, spans.project)
    low = torch.bfloat16
    project = lambda Y: spans.project(Y.float()).to(low)  # noqa: E731
    B, correction, residual, iterations = admm_iterations(
        spans.W.to(low), spans.G.to(low), spans.geo, None if correction is None else correction.to(low),
        plan, spans.d2.to(low), project)
    # projected again in fp32: bf16 rounding leaves B ~4e-3 off the tangent space, and the lift
    # adds no projection of its own
    return spans.project(B.float()), correction.float(), residual.float(), iterations


def admm_in_span(problems, plan):
    """[Solution] of tall banks [(W, G, geo, correction)] (rows >= 2 cols, one q, all warm or all
    cold) solved as ONE batched ADMM in span coordinates (span.StackedSpans), whatever their rows
    and manifolds, then lifted and finalised bank by bank.

    Precision fallback: a matrix whose span has no Cholesky factor or whose lift would be
    imprecise (G nearly inside span[W]; rare) gets the Euclidean tangent projection of G instead,
    a descent direction at the same step length, chosen on the device by the lift's coefficients
    (no host sync, no product of its own) and counted in `Solution.fallbacks`.
    """
    if len({correction is None for *_, correction in problems}) > 1:
        raise ValueError("admm_in_span takes banks that are all warm-started or all cold")
    d2s = [geo.squared_norms(W) for W, _, geo, _ in problems]
    checked = [with_signal(W, G, geo, d2, plan) for (W, G, geo, _), d2 in zip(problems, d2s)]
    spans = StackedSpans([(W, G, geo, d2) for (W, _, geo, _), (G, _), d2 in zip(problems, checked, d2s)],
                         plan.backend)
    signal = torch.cat([signal for _, signal in checked])
    corrections = [None if correction is None else bounded_correction(correction, d2)
                   for (*_, correction), d2 in zip(problems, d2s)]
    correction = None if corrections[0] is None else torch.cat(corrections)
    incoming = torch.zeros_like(spans.R12) if correction is None else correction
    B, correction, residual, iterations = span_iterations(spans, correction, plan)
    # no signal: no answer (B = 0 lifts to 0) and the warm start as it came
    B, residual = silence(signal, B), silence(signal, residual)
    correction = torch.where(signal[..., None, None], correction, incoming)
    lifted = spans.lift(B)
    # The lifted answers are tangent without a projection on the full matrices: B left ADMM
    # through the span's exact fp32 projection, and the lift keeps that to its rounding (which it
    # bounds); the fallback Proj_T(G) is lifted from exact coefficients
    directions = finalize_banks([(W, X, geo, d2) for (W, _, geo, _), (X, _), d2 in zip(problems, lifted, d2s)],
                                plan, project=False)
    solutions = []
    for A, (_, ok), c, r, live in zip(directions, lifted, spans.split(correction), spans.split(residual),
                                      spans.split(signal)):
        ok = ok | ~live  # a silenced matrix took no fallback: its 0 lifts exactly
        solutions.append(Solution(silence(live, A), masked_update(ok, torch.zeros_like(c), c), r, iterations,
                                  (~ok).sum()))
    return solutions


def admm_full(W, G, geo, correction, plan):
    """ADMM on the full p x q matrices (near-square and Oblique banks), products at fp32; only
    the matrix signs follow the plan's sign dtype."""
    d2 = geo.squared_norms(W)
    G, signal = with_signal(W, G, geo, d2, plan)
    incoming = None if correction is None else bounded_correction(correction, d2)
    B, correction, residual, iterations = admm_iterations(W, G, geo, incoming, plan, d2)
    correction = torch.where(signal[..., None, None], correction, 0.0 if incoming is None else incoming)
    return Solution(finalize_banks([(W, silence(signal, B), geo, d2)], plan)[0], correction,
                    silence(signal, residual), iterations)


def online_full(W, G, geo, correction, plan):
    """The online scheme (online_iterations) on full p x q matrices of any shape: no span
    reduction (whose Grams and lift need fp32 products: on a GPU they would cost more than the
    one sign they save). Under tf32 the products with W read TF32 operands: the answer is then
    tangent to ~5e-4 of its size, which the fp32 retraction absorbs; in fp32 it is exact."""
    B, d2, correction, residual, iterations = online_direction(W, G, geo, correction, plan)
    return Solution(finalize_banks([(W, B, geo, d2)], plan, project=False)[0], correction, residual, iterations)


def online_direction(W, G, geo, correction, plan):
    """(B, d2, correction, residual, iterations) of online_full before finalize_banks (B is
    tangent: finalize need not project it)."""
    if plan.options.scheme == "newton" and not geo.secant_dual:
        from manifolds.newton import newton_direction  # damped Newton on the multiplier, in q x q
        return newton_direction(W, G, geo, correction, plan)
    d2 = geo.squared_norms(W)
    with kernels.tf32_products(plan.tf32):
        B, correction, residual, iterations = online_iterations(FullProblem(W, geo, d2, plan.backend), G,
                                                                correction, plan)
    return B, d2, correction, residual, iterations


def admm(W, G, geo, correction, plan):
    """ADMM on one bank of any batch shape: in span coordinates for rows >= 2 cols."""
    if not reducible(W, geo):
        return admm_full(W, G, geo, correction, plan)
    batch = W.shape[:-2]  # admm_in_span stacks banks of one batch dimension
    flat = lambda X: X.reshape((-1,) + X.shape[len(batch):])  # noqa: E731
    pinned = getattr(geo, "pinned", None)
    flat_geo = geo.pin(flat(pinned)) if pinned is not None else geo
    s = admm_in_span([(flat(W), flat(G), flat_geo, None if correction is None else flat(correction))], plan)[0]
    return Solution(s.A.reshape(W.shape), s.warm_start.reshape(batch + s.warm_start.shape[-2:]), s.residual.reshape(batch),
                    s.iterations, s.fallbacks)


def reducible(W, geo):
    """Solved in span[W, G] (2q x q) rather than on the p x q matrices: rows >= 2 cols, on a
    manifold whose Gram is diagonal (span.py needs W^T W = D^2)."""
    return geo.orthogonal_columns and W.size(-2) >= 2 * W.size(-1)


# --- square Stiefel and the final answer ----------------------------------------------------

def exact_square_stiefel(W, G, geo, plan):
    """A* = msign(G + 2 W Lambda0) for square Stiefel W: exact, nothing to iterate or check.

    At TF32 its matrix sign is EXACT_SCHEDULE (7 minimax steps for singular values down to 1e-3
    of the bound: skew(W^T G) keeps such small ones) with TF32 products; else Polar Express and its
    polish. Two fp32 Newton-Schulz steps and the exact final projection then make it tangent and
    unit to fp32 accuracy either way."""
    A, d2, residual = exact_square_direction(W, G, geo, plan)
    return Solution(finalize_banks([(W, A, geo, d2)], plan)[0], None, residual, 0)


def exact_square_direction(W, G, geo, plan):
    """(A, d2, residual) of exact_square_stiefel before finalize_banks (which must project it)."""
    d2 = geo.squared_norms(W)
    Lambda0 = geo.preconditioned(W, G, d2, -0.5, plan.backend)
    X = kernels.matmul_add(W, Lambda0, G, alpha=2.0, backend=plan.backend)  # G + 2 W Lambda0
    # X is Proj_T G itself, formed entry by entry: a G without a tangent part (W S, 0) gives no answer
    g2, x2 = G.square().sum(dim=(-2, -1)), X.square().sum(dim=(-2, -1))
    tol = signal_tolerance(plan)
    signal = finite(g2, x2) & (x2 > tol * tol * g2) & (g2 > 0)
    if plan.exact_sign[0] == "minimax":
        with kernels.tf32_products():
            A = kernels.msign(X, plan.exact_sign[1], 0, plan.backend, schedule=EXACT_SCHEDULE)
    else:
        A = kernels.msign(X, *EXACT_PE_STEPS, plan.backend)
    if plan.options.scheme != "online":
        # the online scheme skips this polish: the final projection makes A tangent and the
        # bound unit; the sign's own accuracy (~1e-3 at TF32) is what the quality loses
        A = kernels.orthonormalize_near(A, steps=2, backend=plan.backend)
    A = silence(signal, A)
    return A, d2, relative_residual(W, geo.tangent_residual(W, A, plan.backend, with_norm=True)[1])


def finalize_banks(banks, plan, project=True):
    """[A / b] for banks [(W, A, geo, d2)] of one q (any rows, any batch shape), each A first
    projected exactly onto the tangent space at W (project=False: already tangent to fp32
    rounding, the span's lift; or one bool per bank), and b^2 >= ||A||_op^2 = lam_1(A^T A) an upper bound
    (norm_bound.top_eigenvalue_bound on A^T A to the power 2^NORM_SQUARINGS): ||A||_op <= 1, at most
    ~6e-4 below it (bench/unit_norm.py). One stack of q x q Grams for all; 10 squarings where the
    power iteration before ran 5 and 8 matrix-vector products, whose Rayleigh quotient is a lower
    bound: ||A||_op reached 1.0048 on near-square shapes.

    The answers that reach here are tangent up to their solver's rounding, so the projection's
    correction W M is small: at TF32 it reads TF32 operands (kernels/tangent.py); so do the Grams,
    the exact Grams of A rounded to TF32: their noise (~5e-4 relative) lifts the bound on a flat
    spectrum (A up to 7e-4 short of 1) and moves a lone top little (||A||_op <= 1 + 8e-5, measured);
    fp32 Grams would cost 3x (+0.7 ms of ~32 ms, bench.cost_model)."""
    flags = project if isinstance(project, (list, tuple)) else [project] * len(banks)
    projected = [geo.tangent_projection(W, A, d2, plan.backend, tf32_correction=plan.tf32) if flag else A
                 for (W, A, geo, d2), flag in zip(banks, flags)]
    with kernels.tf32_products(plan.tf32):
        grams = [kernels.sym_product(A.mT, backend=plan.backend).reshape((-1,) + A.shape[-1:] * 2) for A in projected]
    stacked = grams[0] if len(grams) == 1 else torch.cat(grams)  # one: not copied
    bounds = top_eigenvalue_bound(stacked, NORM_SQUARINGS, plan.backend, tf32=plan.tf32, late_dtype=plan.sign_torch_dtype)
    norms = bounds.sqrt().clamp_min(1e-30)
    return [A / n.reshape(A.shape[:-2] + (1, 1)) for A, n in zip(projected, torch.split(norms, [len(g) for g in grams]))]


# --- entry points ---------------------------------------------------------------------------

def scheme_solver(plan):
    """The solver of one constrained bank under the plan's scheme (the same signature)."""
    return online_full if plan.options.scheme in ("online", "newton") else admm


def solve_tall(W, G, geo, state, plan):
    """One bank on the tall orientation (W, G: (..., p, q), p >= q); G need not be normalised."""
    G = unit(G)
    if not geo.constrained:
        # plain Muon as the field runs it: Polar Express in the sign dtype (bf16 on a GPU), no polish
        A = in_sign_dtype(lambda X: kernels.msign(X, *MUON_STEPS, plan.backend), G, plan)
        g2 = G.square().sum(dim=(-2, -1))
        A = silence(finite(g2) & (g2 > 0), A)  # a zero or non-finite G: no step
        return Solution(A, None, torch.zeros(W.shape[:-2], dtype=W.dtype, device=W.device), 0)
    if geo.exact_square_step and W.size(-2) == W.size(-1):
        return exact_square_stiefel(W, G, geo, plan)
    solution = scheme_solver(plan)(W, G, geo, state, plan)
    if geo.has_boundary:
        solution = solve_capped(W, G, geo, state, plan, solution)
    return solution


def solve_tall_banks(banks, plan):
    """[Solution] for banks [(W, G, geo, state)] (tall orientation) under one plan.

    The banks ADMM solves in span coordinates (Stiefel or DGram, rows >= 2 cols) are solved
    together, one batched ADMM per column count q and warm/cold start: GPT-2 small HETERO's
    c_attn, c_fc and mlp.c_proj of all layers are 36 problems of 1536 x 768, each product of an
    iteration one launch for all. Every other bank goes through solve_tall.
    """
    # every bank's G on one scale (exact): gradients near fp32's range ends step as any other
    banks = [(W, exact_rescale(G), geo, state) for W, G, geo, state in banks]
    if plan.options.scheme in ("online", "newton"):
        return online_banks(banks, plan)
    solutions = [None] * len(banks)
    stacks = {}
    for i, (W, G, geo, state) in enumerate(banks):
        if geo.kernel_name is not None and not geo.has_boundary and reducible(W, geo):
            key = (W.size(-1), state is None, W.dtype, W.device)
            stacks.setdefault(key, []).append((i, (W, unit(G), geo, state)))
        else:
            solutions[i] = solve_tall(W, G, geo, state, plan)
    for members in stacks.values():
        for (i, _), solution in zip(members, admm_in_span([problem for _, problem in members], plan)):
            solutions[i] = solution
    return solutions


def online_banks(banks, plan):
    """solve_tall_banks under the online scheme: banks of one shape, manifold and warm/cold start
    are one batch (GPT-2's c_fc and mlp.c_proj on DGram, both 3072 x 768 tall, solve together)."""
    solutions = [None] * len(banks)
    stacks, squares = {}, []
    for i, (W, G, geo, state) in enumerate(banks):
        if geo.exact_square_step and W.size(-2) == W.size(-1):
            squares.append(i)
        elif geo.constrained and geo.kernel_name is not None and not geo.has_boundary:
            # by name: a registered subclass shares its parent's kernel but may differ in its norms
            key = (W.shape[1:], geo.name, state is None, W.dtype, W.device)
            stacks.setdefault(key, []).append(i)
        else:
            solutions[i] = solve_tall(W, G, geo, state, plan)
    # every answer of one q is finalised together: one stack of Grams, one norm bound
    unfinished = {}  # q -> [(members, W, A, geo, d2, project, state, residual, iterations)]
    for members in stacks.values():
        # one member (GPT-2's banks: one per shape): its own tensors, not a copy (torch.cat of
        # one tensor copies it: 0.27 ms of memory traffic a step for GPT-2 small, bench.cost_model)
        cat = lambda k: banks[members[0]][k] if len(members) == 1 else torch.cat([banks[i][k] for i in members])  # noqa: E731
        W, geo, warm = cat(0), banks[members[0]][2], banks[members[0]][3] is not None
        B, d2, state, residual, iterations = online_direction(W, unit(cat(1)), geo, cat(3) if warm else None, plan)
        unfinished.setdefault(W.size(-1), []).append((members, W, B, geo, d2, False, state, residual, iterations))
    for i in squares:
        W, G, geo, _ = banks[i]
        A, d2, residual = exact_square_direction(W, unit(G), geo, plan)
        unfinished.setdefault(W.size(-1), []).append(([i], W, A, geo, d2, True, None, residual, 0))
    for group in unfinished.values():
        directions = finalize_banks([(W, A, geo, d2) for _, W, A, geo, d2, *_ in group], plan,
                                    project=[flag for *_, flag, _, _, _ in group])
        for (members, W, _, _, _, _, state, residual, iterations), A in zip(group, directions):
            sizes = [banks[i][0].size(0) for i in members]
            states = state.split(sizes) if state is not None else [None] * len(members)
            for i, a, c, r in zip(members, A.split(sizes), states, residual.split(sizes)):
                solutions[i] = Solution(a, c, r, iterations)
    return solutions


def solve_capped(W, G, geo, state, plan, solution, rounds=3):
    """The tangent cone of dgram-cap by an active set (geometry.DGramCap).

    The first solve is DGram's. A column at the cap whose direction would grow it (the step is
    W - eta A, so (W^T A)_ii < 0) is pinned ((W^T A)_ii = 0) and the bank solved again; pinning
    can make other capped columns grow, hence a few rounds. One host sync per round, and none
    when no column is at the cap; capturable: every round runs, no syncs.
    """
    at_cap = geo.at_cap(W)
    if not plan.capturable and not bool(at_cap.any()):
        return solution
    pinned = torch.zeros_like(at_cap)
    solve = scheme_solver(plan)
    for _ in range(rounds):
        growing = at_cap & ~pinned & (torch.diagonal(W.mT @ solution.A, dim1=-2, dim2=-1) < 0)
        if not plan.capturable and not bool(growing.any()):
            break
        pinned = pinned | growing
        solution = solve(W, G, geo.pin(pinned), state, plan)
    return solution


# --- the one-shot API ------------------------------------------------------------------------

ONE_SHOT_ITERATIONS = 8  # ADMM iterations of steepest_direction's default (x2 cold, x2 again near-square)


def one_shot_options(solver_opts):
    """SolverOptions of steepest_direction: the caller's, and where the caller names no scheme,
    ADMM to ONE_SHOT_ITERATIONS (the caller's `iterations` if named). A scheme the caller names
    runs as ManifoldMuon would run its first step."""
    if "scheme" not in solver_opts:
        solver_opts = {"scheme": "admm", "iterations": ONE_SHOT_ITERATIONS, **solver_opts}
    return SolverOptions.from_kwargs(**solver_opts)


def one_shot_plan(plan, dtype):
    """The plan of steepest_direction's default: fp32 matrix signs (their products TF32 under a
    TF32 plan) where the plan's would be bf16 for fp32 weights. bf16 signs leave every singular
    value of the answer ~4e-3 off, and the division by the largest costs that much progress: with
    them the GPU flow (precision tf32, polynomial clip) scored 3.4e-3 to 4e-3 below the CPU's fp32
    flow (tests/test_cold_direction.py), its worst over a wider table 0.9912 against 0.9951 with
    fp32 signs. bf16 weights, or precision bf16, keep the plan's."""
    if dtype != torch.float32 or plan.precision not in ("fp32", "tf32") or plan.sign_dtype == "float32":
        return plan
    return replace(plan, sign_dtype="float32", clip_steps=len(CLIP_SCHEDULE))


def steepest_direction(W, G, manifold, dgram_cap=1.0, **solver_opts):
    """Ascent direction A of one manifold Muon step (the update is W - lr * A), solved cold to the
    optimum: A* = argmax <G, A> s.t. ||A||_op <= 1 and A in the tangent space at W (the tangent
    cone for dgram-cap), the module docstring's problem.

    W, G: (..., m, n), one matrix or a batch, either orientation (a wide pair is solved
    transposed); solver_opts: SolverOptions fields. Returns A shaped like G with ||A||_op <= 1
    (within ~1e-3 of it; `finalize_banks`) and P(W^T A + A^T W) = 0 (fp accuracy). A one-shot
    solve: no warm start is kept.

    How, where no `scheme` is named (one_shot_options, one_shot_plan): square Stiefel in closed
    form (exact_square_stiefel, with its polish); everything else by ADMM from a cold start to
    2 x ONE_SHOT_ITERATIONS = 16 iterations (32 near-square, rows < 2 cols): tall Stiefel, DGram and
    dgram-cap in span[W, G] (2q x q), near-square, square, Oblique and Hyperball matrices on the
    full p x q; matrix signs in fp32 (TF32 products under precision tf32); under capturable the
    whole budget runs, else it stops at `tol`. An iteration is a tangent projection (2 products
    p x q x q) and a spectral clip (eigh: a Gram, a q x q eigh, 2 products; polynomial: 5-step signs
    of the p x q iterate and of a q x q matrix, 3 products a step); two pullbacks and the final
    norm bound follow. What that costs, in FLOPs of the GPU flow (bench.op_count under
    FakeTensorMode) against the field's Muon (5 Polar Express steps) on the same matrix: 18.5x for
    DGram 3072 x 768 (in span), 31x for Oblique and the Hyperball 3072 x 768, 74-80x near-square
    and square (1024 x 768, 768 x 768); the online scheme's cold solve is 5.4-8x. A one-shot call
    spends that for its accuracy: worst over 3 seeds of fp32 and tf32, capturable on and off,
    tall, near-square, square and wide shapes (96 x 32 to 64 x 64), momentum-like decays 1 and 2,
    rank q/4 plus 1e-3 noise and Gaussian gradients (`PYTHONPATH=. python
    tests/test_cold_direction.py`), 0.9943 of the certified float64 optimum (manifolds/optimum.py)
    or more on every manifold, where the online scheme scored 0.62-0.99 and cold Newton 0.69-1.0 (it
    fails where the optimum is degenerate: near-square, square, low rank).

    A `scheme` the caller names (online, admm, newton) runs as the optimizer's first step would,
    its plan unchanged (e.g. the online scheme's ONLINE_COLD dual steps)."""
    accurate = "scheme" not in solver_opts
    plan = plan_for(one_shot_options(solver_opts), W.device, W.dtype)
    if accurate:
        plan = one_shot_plan(plan, W.dtype)
    wide = W.size(-2) < W.size(-1)
    if wide:
        W, G = W.mT, G.mT
    A = solve_tall(W, exact_rescale(G), geometry(manifold, dgram_cap), None, plan).A
    return A.mT if wide else A
