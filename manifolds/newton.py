"""The multiplier of the steepest direction by damped Newton steps in q x q (`--solver-opt scheme=newton`).

For tall W (p x q) and the multiplier Lambda (symmetric, in range(P)), the dual iterate and its
answer are

    X = G + 2 W Lambda,    A = msign(X) = X N,    N = (X^T X)^(-1/2),

and the optimum is the Lambda at which A is tangent:  F(Lambda) = P(W^T A + A^T W) = 0.  F is the
gradient of the convex dual phi(Lambda) = ||G + 2 W Lambda||_* (d phi = <A, 2 W dLambda>), so its
Jacobian J is phi's Hessian: symmetric, positive semi-definite. Once

    S = W^T G,   Q = G^T G,   Wg = W^T W      (q x q; Wg = diag(d^2) on Stiefel and DGram)

are formed, everything but the final answer lives in q x q:

    K = W^T X = S + 2 Wg Lambda
    Y = X^T X = Q + 2 (S^T Lambda + Lambda S) + 4 Lambda Wg Lambda
    F = P(K N + N K^T)

Its Jacobian in a direction V (symmetric, in range(P)):  dX = 2 W V, so

    dK = 2 Wg V
    dY = X^T dX + dX^T X = 2 (K^T V + V K)
    dN = N'(Y)[dY]                               (the Frechet derivative of Y -> Y^(-1/2))
    J V = P(dK N + N dK^T + K dN + dN K^T)

The K dN term is what a first-order dual step leaves out (the online scheme's step is
J ~ 2 (d_i^2 + d_j^2) / s, s the rms singular value of X). N'(Y) has eigenvalues
~ 1 / (s_i s_j (s_i + s_j)): on a nearly low-rank X, J is huge along its small singular
directions and Newton's step there is short and unreliable; Levenberg-Marquardt damping
(J + mu Dg) V = -F with Dg = 2 (d_i^2 + d_j^2) / s, the first-order model, keeps it within reach.

No eigendecomposition (on a GPU it reads LAPACK's status on the host and is sequential): N is the
polar iteration of the matrix sign (kernels.matrix_sign.POLAR_SCHEDULE) run on the Gram,

    Z_0 = Y / f,   M_0 = f^(-1/2) I,   f = ||Y||_F;
    P_k = a_k I + b_k Z_k + c_k Z_k^2,   M_(k+1) = M_k P_k,   Z_(k+1) = P_k Z_k P_k,

so that X M_k is the k-th iterate of the polar iteration on X (X_k^T X_k = Z_k), and N = M_end;
dN is the same recursion differentiated (forward mode, f held fixed: the limit Y^(-1/2) does not
depend on it):

    dP = b dZ + c (Z dZ + dZ Z),   dM' = dM P + M dP,   dZ' = dP Z P + P dZ P + P Z dP.

The Newton system is solved by a fixed number of preconditioned conjugate-gradient steps (Dg as
the preconditioner), every step a few q x q products; no step reads a value on the host, and a
converged or degenerate step is made harmless by guarded divisions, not by a branch.

Measured (bench/solver_quality.py, fp32 CPU, worst of 3 seeds at 96 x 32 and 192 x 64, decays 1 and 2):
warm 0.9875-0.9998 (online 0.937-0.981, ADMM 0.993-0.9999), cold 0.9984-1.0000. Cheaper budgets
fall short: 1 warm step 0.968-0.984 (4 CG steps), 2 CG steps 0.975-0.995 (2 warm steps).
What it costs, and where it falls short (not yet the training default):
* FLOPs: 8.95x the field's Muon for hetero (python -m bench.cost_model --fake --solver-opt
  scheme=newton; online 2.35x); 61% of it is dN: the derivative of the 6-step polar iteration
  costs ~33 q x q products a Jacobian product (the primal N 22). Under a TF32 plan (a GPU's
  default) J V's products run at TF32 (JACOBIAN_TF32; quality unchanged at emulated TF32:
  python -m bench.solver_quality --schemes newton --seeds 0 1 2 --precision tf32, warm
  0.9875-0.9998, cold 0.9980-1.0000); the estimate on one H200 is then 0.869 of a forward+backward
  (1.831 with them at IEEE fp32; online 0.103): still 8x the online step. N, F and the answer stay
  IEEE fp32 (the Gram squares X's condition). An eigendecomposition of Y would make J V a few
  products, but on a GPU it reads LAPACK's status on the host and runs sequentially.
* Cheaper warm budgets (TF32 plan; quality: bench.solver_quality --schemes newton --seeds 0 1 2
  --precision tf32 on 96x32 Stiefel/DGram and 192x64 DGram, decays 1 and 2, worst of 3 seeds;
  cost: bench.cost_model --fake --solver-opt scheme=newton with NEWTON_WARM / CG_STEPS set):
      warm steps x CG   warm quality    FLOPs vs Muon   launches   one-H200 ratio
      2 x 4 (default)   0.9875-0.9998   8.95x           2827       0.869
      2 x 2             0.9744-0.9909   5.95x           1947       0.675
      1 x 4             0.9633-0.9781   5.42x           1715       0.552
      1 x 2             0.9430-0.9661   3.92x           1275       0.455
      online            0.936-0.977     2.35x            473       0.103
  None reaches the target (>= 0.99 at <= 2.5x, ratio <= 0.10): the two IEEE fp32 N evaluations
  (~22 q x q products each, ~16 ms) alone cost more than the online step.
* The price floor of any warm scheme with one evaluation per step (float64, 96 x 32, the drifting
  sequence from a converged multiplier): the answer formed at the carried multiplier before its
  update scores 0.915-0.924 however the multiplier is updated (first-order 0.915, EXACT Newton
  0.921-0.924): the momentum's drift between steps moves the optimum that far. An exact Newton
  step followed by a second sign at the updated multiplier scores 0.971-0.974. >= 0.99 warm
  needs the multiplier re-solved at this step's G before the answer is formed: at least two
  evaluations (N) plus the Jacobian work, which is what 2 warm Newton steps buy.
* Momenta of rank << q (rank 4 of 16 plus noise): X* then keeps singular values below the polar
  schedule's band (0.005 of the top), where N is not Y^(-1/2); Newton converges to the fixed point
  of that approximate map, 0.84-0.87 of the optimum cold (online 0.91-0.95, ADMM 0.99).
"""
import torch

from kernels.matrix_sign import POLAR_SCHEDULE


# --- the Gram-space model of one bank -----------------------------------------------------------

class GramModel:
    """The q x q data of a batch of problems (W, G): S = W^T G, Q = G^T G and W's Gram, with P.

    d2: the metric's squared column norms (..., q) (the pair d_i^2 + d_j^2 of geometry.py's
    identity). Wg: None where W^T W = diag(d2) (Stiefel, DGram), else the full W^T W (..., q, q)
    of a manifold whose multipliers are diagonal (Oblique, the Hyperball's m I): then
    Wg V = Wg diag(V) is a column scaling. projector: P on symmetric q x q matrices."""

    def __init__(self, S, Q, d2, projector, Wg=None):
        self.S, self.Q, self.d2, self.projector, self.Wg = S, Q, d2, projector, Wg
        self.pair = d2[..., :, None] + d2[..., None, :]  # d_i^2 + d_j^2

    def gram_times(self, V):
        """Wg V (V in range(P))."""
        if self.Wg is not None:
            return self.Wg * torch.diagonal(V, dim1=-2, dim2=-1)[..., None, :]
        return self.d2[..., :, None] * V

    def cross(self, Lam):
        """K = W^T X = S + 2 Wg Lambda."""
        return self.S + 2.0 * self.gram_times(Lam)

    def gram(self, Lam):
        """Y = X^T X = Q + 2 (S^T Lambda + Lambda S) + 4 Lambda Wg Lambda (symmetrised)."""
        T = self.S.mT @ Lam
        U = Lam @ self.gram_times(Lam)
        return self.Q + 2.0 * (T + T.mT) + 2.0 * (U + U.mT)

    def residual(self, K, N):
        """F = P(K N + N K^T)."""
        T = K @ N
        return self.projector(T + T.mT)


# --- N = Y^(-1/2) and its derivative by the polar iteration on the Gram -------------------------

def inverse_sqrt(Y, schedule=POLAR_SCHEDULE, scale=None):
    """(N, trace) with N ~ Y^(-1/2) (the polar iteration's, see the module docstring) and the
    primal iterates (M_k, Z_k, P_k) that `inverse_sqrt_jvp` differentiates. scale: f (..., 1, 1),
    ||Y||_F by default (then every eigenvalue of Z_0 is <= 1)."""
    if scale is None:
        scale = torch.linalg.matrix_norm(Y).clamp_min(torch.finfo(Y.dtype).tiny)[..., None, None]
    eye = torch.eye(Y.size(-1), dtype=Y.dtype, device=Y.device)
    Z = Y / scale
    M = eye * scale.rsqrt()
    trace = []
    for k, (a, b, c) in enumerate(schedule):
        Z2 = Z @ Z
        P = a * eye + b * Z + c * 0.5 * (Z2 + Z2.mT)
        PZ = P @ Z if k + 1 < len(schedule) else None
        trace.append((M, Z, P, PZ))
        M = M @ P
        if PZ is not None:
            Z = PZ @ P
            Z = 0.5 * (Z + Z.mT)
    return M, (trace, scale, schedule)


def inverse_sqrt_jvp(dY, cache, mm=torch.matmul):
    """dN = N'(Y)[dY] of the map inverse_sqrt computes (its scale f held fixed). mm: the product
    (kernels.matmul at TF32 under a TF32 plan: newton_step)."""
    trace, scale, schedule = cache
    dZ = dY / scale
    dM = torch.zeros_like(dY)
    for k, ((M, Z, P, PZ), (a, b, c)) in enumerate(zip(trace, schedule)):
        ZdZ = mm(Z, dZ)
        dP = b * dZ + c * (ZdZ + ZdZ.mT)  # Z and dZ symmetric: dZ Z = (Z dZ)^T
        dM_next = mm(M, dP) if k == 0 else mm(dM, P) + mm(M, dP)  # dM_0 = 0
        if PZ is not None:
            T = mm(dP, PZ.mT)  # dP Z P; P Z dP is its transpose (Z, P, dP symmetric)
            dZ = T + T.mT + mm(mm(P, dZ), P)
        dM = dM_next
    return dM


# --- the damped Newton step -------------------------------------------------------------------

def rms_singular(Y):
    """s = (tr(Y) / q)^(1/2): the rms singular value of X (Y = X^T X), (..., 1, 1)."""
    q = Y.size(-1)
    return (torch.diagonal(Y, dim1=-2, dim2=-1).sum(dim=-1) / q).clamp_min(torch.finfo(Y.dtype).tiny).sqrt()[
        ..., None, None]


def jacobian_product(model, K, N, cache, V, mm=torch.matmul):
    """J V = P(dK N + N dK^T + K dN + dN K^T), dK = 2 Wg V, dN = N'(Y)[2 (K^T V + V K)]."""
    KtV = mm(K.mT, V)
    dN = inverse_sqrt_jvp(2.0 * (KtV + KtV.mT), cache, mm)
    T = 2.0 * mm(model.gram_times(V), N) + mm(K, dN)
    return model.projector(T + T.mT)


def newton_step(model, Lam, cg_steps, damping, schedule=POLAR_SCHEDULE, kappa=0.0, jacobian_mm=torch.matmul):
    """(Lambda + V, F, N) : V from cg_steps of preconditioned CG on (J + mu Dg) V = -F at Lambda,
    Dg = 2 (d_i^2 + d_j^2) / s (elementwise; the first-order model of J), mu = damping.

    jacobian_mm: the products of J V (dN's recursion and its two outer products), the CG's only
    q x q work: at TF32 (kernels.matmul inside kernels.tf32_products) they cost a quarter of IEEE
    fp32's time on a GPU (198 vs 50 TFLOP/s). Rounding J V by ~1e-3 makes the step an inexact
    Newton step: the residual F it solves for, N and the answer stay fp32, so the fixed point is
    unchanged and the next step corrects the rounding of this one."""
    K, Y = model.cross(Lam), model.gram(Lam)
    N, cache = inverse_sqrt(Y, schedule)
    F = model.residual(K, N)
    Dg = 2.0 * model.pair / rms_singular(Y)
    precondition = lambda R: model.projector(R / ((1.0 + damping) * Dg))  # noqa: E731
    apply = lambda V: jacobian_product(model, K, N, cache, V, jacobian_mm) + damping * Dg * V  # noqa: E731
    tiny = torch.finfo(Lam.dtype).tiny
    dot = lambda A, B: (A * B).sum(dim=(-2, -1), keepdim=True)  # noqa: E731
    V = torch.zeros_like(Lam)
    R = -F
    Zr = precondition(R)
    D = Zr
    rz = dot(R, Zr)
    for _ in range(cg_steps):
        JD = apply(D)
        curvature = dot(D, JD)
        # a converged (rz = 0) or non-convex (curvature <= 0: rounding) direction takes no step
        alpha = torch.where(curvature > tiny, rz / curvature.clamp_min(tiny), 0.0)
        V = V + alpha * D
        R = R - alpha * JD
        Zr = precondition(R)
        rz_next = dot(R, Zr)
        beta = torch.where(rz > tiny, rz_next / rz.clamp_min(tiny), 0.0)
        D = Zr + beta * D
        rz = rz_next
    # damped Newton: the step t = 1 / (1 + kappa (delta^2 / phi)^(1/2)), delta^2 = -<F, V> the Newton
    # decrement, phi = tr(N Y) = ||X||_* (both scale as G: the ratio is scale-free)
    if kappa:
        phi = (N * Y).sum(dim=(-2, -1), keepdim=True)
        decrement = (-(F * V).sum(dim=(-2, -1), keepdim=True)).clamp_min(0)
        V = V / (1 + kappa * (decrement / phi.clamp_min(tiny)).sqrt())
    return Lam + V, F, N


# --- the bank: what solver.online_direction runs under scheme "newton" ---------------------------

NEWTON_WARM = 2     # Newton steps from the previous step's multiplier
NEWTON_COLD = 6     # ... from the Euclidean projection's (the first step, steepest_direction)
CG_STEPS = 4        # conjugate-gradient steps per Newton step
DAMPING = 0.2       # Levenberg-Marquardt mu, relative to the first-order model Dg
STEP_DAMPING = 3.0  # kappa of the damped step 1 / (1 + kappa (delta^2 / phi)^(1/2))
JACOBIAN_TF32 = True  # J V's products at TF32 under a TF32 plan (newton_step's jacobian_mm)


def bank_model(W, G, geo, d2, backend):
    """(GramModel, M0) of a bank: the tall products W^T G, G^T G (and W^T W where the Gram is not
    diagonal) and the Euclidean projection's multiplier M0 = P(S + S^T) / (d_i^2 + d_j^2)."""
    import kernels
    S = kernels.matmul(W.mT, G, backend=backend)
    Q = kernels.sym_product(G.mT, backend=backend)
    Wg = None if geo.orthogonal_columns else kernels.sym_product(W.mT, backend=backend)
    model = GramModel(S, Q, d2, geo.gram_projector, Wg)
    return model, geo.gram_projector((S + S.mT) / model.pair)


def newton_direction(W, G, geo, correction, plan, warm_steps=None, cold_steps=None):
    """(B, d2, correction, residual, iterations) as solver.online_direction returns them, the
    multiplier by damped Newton steps in q x q (module docstring). G: unit Frobenius norm.

    The correction kept across steps is solver.py's: C = Lambda - Lambda0 with Lambda0 = -M0 / 2
    (the online scheme's and ADMM's warm starts mean the same). The answer is
    B = X N - W M with M = F / (d_i^2 + d_j^2) the exact tangent projection of A = X N (geometry.py's
    identity, in q x q), formed as G N + W (2 Lambda N - M): two tall products."""
    from manifolds.solver import bounded_correction, relative_residual, silence, tangent_signal
    import kernels
    if W.dtype in (torch.bfloat16, torch.float16):
        # the Gram squares X's condition: its iterations need fp32 whatever the weights' dtype
        B, d2, C, residual, steps = newton_direction(W.float(), G.float(), geo, None if correction is None else
                                                     correction.float(), plan, warm_steps, cold_steps)
        return B.to(W.dtype), d2.to(W.dtype), C.to(W.dtype), residual.to(W.dtype), steps
    d2 = geo.squared_norms(W)
    model, M0 = bank_model(W, G, geo, d2, plan.backend)
    signal = tangent_signal(W, G, M0, model.pair, plan)
    # no signal (0, normal, non-finite G): a finite stand-in problem (S = 0, Q = I), its answer discarded
    live = signal[..., None, None]
    eye = torch.eye(W.size(-1), dtype=W.dtype, device=W.device)
    model.S = torch.where(live, model.S, 0.0)
    model.Q = torch.where(live, model.Q, eye)
    M0 = torch.where(live, M0, 0.0)
    warm = correction is not None
    incoming = bounded_correction(correction, d2) if warm else torch.zeros_like(M0)
    Lam = incoming - 0.5 * M0
    steps = (NEWTON_WARM if warm_steps is None else warm_steps) if warm else (
        NEWTON_COLD if cold_steps is None else cold_steps)
    # under a TF32 plan (a GPU's default) J V's products read TF32 operands (newton_step); F, N and
    # the answer stay IEEE fp32
    low = plan.tf32 and JACOBIAN_TF32
    jacobian_mm = (lambda A, B: kernels.matmul(A, B, backend=plan.backend)) if low else torch.matmul  # noqa: E731
    with kernels.tf32_products(low):
        for _ in range(steps):
            Lam, _, _ = newton_step(model, Lam, CG_STEPS, DAMPING, kappa=STEP_DAMPING, jacobian_mm=jacobian_mm)
    K, Y = model.cross(Lam), model.gram(Lam)
    N, _ = inverse_sqrt(Y)
    F = model.residual(K, N)
    M = F / model.pair
    G = torch.where(live, G, 0.0)
    B = kernels.matmul_add(W, 2.0 * (Lam @ N) - M, kernels.matmul(G, N, backend=plan.backend), backend=plan.backend)
    C = torch.where(live, Lam + 0.5 * M0, incoming)
    return silence(signal, B), d2, C, silence(signal, relative_residual(W, F.square().sum(dim=(-2, -1)))), steps
