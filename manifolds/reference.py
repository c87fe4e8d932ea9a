"""Manifold Muon in plain torch: the method as a readable statement, in its symbols: W the weight,
G its momentum, A the step direction, P the Gram projector, Lambda the dual, R the retraction.

One matrix at a time, exact SVDs, ADMM run to convergence, the input's dtype throughout: nothing here is fast, and it can train. `ManifoldMuon(..., solver="reference")` (the
trainer's --solver-opt solver=reference) steps every matrix with `manifold_muon_step_reference`:
the same momentum, Nesterov, lr, weight decay and retraction as the fast path
(manifolds.solver, kernels/), which is tested against it, and it against the certified float64
optimum (manifolds/optimum.py), in tests/test_reference.py.

A manifold is any registered one (manifolds.geometry.MANIFOLDS, or a Manifold object): what is
read from it is its Gram projector P (a linear projector on symmetric q x q matrices: a 0/1 mask,
or the Hyperball's trace), its squared column norms d_i^2 and its retraction R (exact, by SVD).
On the manifold P(W^T W M + M W^T W) = (d_i^2 + d_j^2) M for M in range(P), so the tangent space
{A : P(W^T A + A^T W) = 0} and its projection need only the d_i^2. The built-in ones:

    stiefel    P = all ones      W^T W = I           R(X) = msign(X)
    dgram      P = Off           Off(W^T W) = 0      R(X) = msign(X N^-1) N,  N = diag(column norms of X)
    oblique    P = Diag          diag(W^T W) = 1     R(X) = X N^-1
    dgram-cap  dgram, column norms <= C: a set with a boundary, its tangent a cone (active set below)
    hyperball  P = (tr . / q) I  ||W||_F = r          R(W - eta A) = (W - eta A) ||W||_F / ||W - eta A||_F
    none       P = 0             no constraint       A* = msign(G), W <- (1 - lr wd) W - lr A*
"""
import torch

from manifolds.geometry import Manifold, geometry

ITERATIONS = 1000  # ADMM's budget per matrix (it stops earlier once converged to `tol`)
TOL = 1e-6         # default tol: ADMM stops at relative residuals below max(TOL, 100 roundings of the dtype)
CAP_ROUNDS = 3     # active-set rounds of a manifold with a boundary (dgram-cap)


def as_manifold(manifold):
    """A Manifold from a registered name (or the object itself)."""
    return manifold if isinstance(manifold, Manifold) else geometry(manifold)


def msign(X):
    """U V^T for X = U S V^T (the polar factor), by SVD."""
    U, _, Vh = torch.linalg.svd(X, full_matrices=False)
    return U @ Vh


def spectral_clip(X):
    """U min(S, 1) V^T: the nearest matrix with ||.||_op <= 1."""
    U, S, Vh = torch.linalg.svd(X, full_matrices=False)
    return U @ torch.diag_embed(S.clamp(max=1)) @ Vh


def gram_projector(manifold):
    """P as a function on symmetric q x q matrices (a mask's: its entries kept)."""
    return as_manifold(manifold).gram_projector


def tangent_projection(W, A, manifold):
    """Proj_T(A) = A - W M, M = P(W^T A + A^T W) / (d_i^2 + d_j^2), W tall and on the manifold.

    For M in range(P), P(W^T W M + M W^T W) has entries (d_i^2 + d_j^2) M_ij (Stiefel, DGram:
    W^T W = D^2; oblique: P and M are diagonal, only (W^T W)_ii = d_i^2 enters), so this M
    removes the residual exactly; W M is normal, so this is the Euclidean projection."""
    geo = as_manifold(manifold)
    P = gram_projector(geo)
    d2 = geo.squared_norms(W)                           # d_i^2 = (W^T W)_ii (Hyperball: ||W||_F^2 / q)
    H = P(W.mT @ A + A.mT @ W)                          # tangent residual P(W^T A + A^T W)
    return A - W @ (H / (d2[..., :, None] + d2[..., None, :]))   # A - W M


def tangent_residual(W, A, manifold):
    """||P(W^T A + A^T W)||_F / ||W||_F^2 (W tall): zero when A is tangent at W."""
    P = gram_projector(manifold)
    return float(P(W.mT @ A + A.mT @ W).norm() / W.square().sum())


def admm(W, G, manifold, iterations=ITERATIONS, tol=None):
    """(A*, iterations run): A* = argmax <G, A> s.t. ||A||_op <= 1, P(W^T A + A^T W) = 0, W tall.

    ADMM on the split A = B = Z, B tangent, ||Z||_op <= 1, with the scaled dual U and the penalty
    rho. At its fixed point rho U - G is normal, rho U = G + 2 W Lambda, and Z = msign(rho U): the
    dual problem's answer A(Lambda) = msign(G + 2 W Lambda). rho starts at ||Proj_T G||_op and is
    balanced (doubled or halved, U rescaled to keep rho U) when the primal residual ||B - Z|| and
    the dual one rho ||Z - Z_previous|| drift 10x apart: a fixed rho needs thousands of iterations
    on real momenta. Stops when both are below tol ||Z|| (default max(TOL, 100 roundings of the dtype)),
    or after `iterations`."""
    tol = max(TOL, 100 * torch.finfo(G.dtype).eps) if tol is None else tol
    G = G / G.norm()                                   # the argmax ignores G's scale, rho does not
    rho = torch.linalg.matrix_norm(tangent_projection(W, G, manifold), ord=2)  # rho ~ ||Proj_T G||_op
    Z, U = torch.zeros_like(G), torch.zeros_like(G)
    for iteration in range(1, iterations + 1):
        B = tangent_projection(W, Z - U + G / rho, manifold)  # argmax <G, B> - rho/2 |B - Z + U|^2, B in T
        Z_previous, Z = Z, spectral_clip(B + U)               # argmin |Z - B - U|, ||Z||_op <= 1
        U = U + B - Z                                         # dual ascent on B = Z
        primal, dual = (B - Z).norm(), rho * (Z - Z_previous).norm()
        if max(primal, dual / rho) <= tol * Z.norm():
            break
        if primal > 10 * dual or dual > 10 * primal:          # residual balancing
            factor = 2.0 if primal > dual else 0.5
            rho, U = rho * factor, U / factor
    A = tangent_projection(W, Z, manifold)             # exactly tangent...
    return A / torch.linalg.matrix_norm(A, ord=2), iteration  # ...with ||A||_op = 1


def direction(W, G, manifold, iterations=ITERATIONS, tol=None):
    """(A*, ADMM iterations) for W, G tall. No constraint: A* = msign(G). A manifold with a
    boundary (dgram-cap): its interior's answer, then an active set: a column at the boundary
    that A would push out ((W^T A)_ii < 0: the step is W - lr A) is pinned ((W^T A)_ii = 0, so
    P keeps that diagonal entry) and the problem solved again."""
    geo = as_manifold(manifold)
    if not geo.constrained:
        return msign(G), 0
    A, run = admm(W, G, geo, iterations, tol)
    if geo.has_boundary:
        at_boundary, pinned = geo.at_cap(W), torch.zeros(W.size(-1), dtype=torch.bool, device=W.device)
        for _ in range(CAP_ROUNDS):
            outward = at_boundary & ~pinned & (torch.diagonal(W.mT @ A) < 0)
            if not bool(outward.any()):
                break
            pinned = pinned | outward
            A, more = admm(W, G, geo.pin(pinned), iterations, tol)
            run += more
    return A, run


def steepest_direction_reference(W, G, manifold, iterations=ITERATIONS, tol=None):
    """(A*, tangent residual) for W, G in either orientation: the constraint acts on the tall one
    (the small Gram). Square Stiefel has a closed form, A* = W msign(skew(W^T G)), a check in the
    tests. On random test problems (up to 64 x 32) a few hundred iterations reach fp32 accuracy; a
    fixed rho converges slowly on ill-conditioned ones (optimum.py balances rho and certifies
    the gap)."""
    wide = W.size(-2) < W.size(-1)
    if wide:
        W, G = W.mT, G.mT                              # tall orientation: P acts on the small Gram
    A, _ = direction(W, G, manifold, iterations, tol)
    residual = tangent_residual(W, A, manifold)
    return (A.mT if wide else A), residual


def retract(X, manifold):
    """R(X), X tall: the manifold point R maps it to (R(W) = W on the manifold), exact (SVD)."""
    return as_manifold(manifold).retract(X, near=False)


def step_tall(W, G, manifold, lr, weight_decay=0.0, iterations=ITERATIONS, tol=None):
    """(new W, ADMM iterations, tangent residual of A*) of one step, W and G tall:
    W <- R(W - lr A*); no constraint: plain Muon, W <- (1 - lr weight_decay) W - lr msign(G) (a
    manifold fixes or frees the scale by itself: no weight decay there)."""
    geo = as_manifold(manifold)
    A, run = direction(W, G, geo, iterations, tol)
    if not geo.constrained:
        return W * (1 - lr * weight_decay) - lr * A, run, 0.0
    return geo.retract_from(W, W - lr * A, near=False), run, tangent_residual(W, A, geo)


def manifold_muon_step_reference(W, G, manifold, lr, weight_decay=0.0, iterations=ITERATIONS, tol=None):
    """One manifold Muon step (step_tall) of W, G in either orientation (the tall one is stepped)."""
    wide = W.size(-2) < W.size(-1)
    new, _, _ = step_tall(W.mT if wide else W, G.mT if wide else G, manifold, lr, weight_decay, iterations, tol)
    return new.mT if wide else new
