"""Manifold Muon in plain torch: the method as a readable statement, in its symbols: W the weight,
G its momentum, A the step direction, P the Gram projector, Lambda the dual, R the retraction.

One matrix at a time, exact SVDs, a fixed number of ADMM iterations, the input's dtype
throughout: nothing here is fast. The fast path (manifolds.steepest_direction, ManifoldMuon)
is tested against it, and it against the certified float64 optimum (manifolds/optimum.py), in
tests/test_reference.py.

A manifold is its Gram projector P, a symmetric 0/1 mask on the n x n Gram matrix. On the
manifold W^T W = D^2 (diagonal), so the tangent space {A : P(W^T A + A^T W) = 0} and its
projection need only the squared column norms d_i^2. dgram-cap (column norms capped: a set
with a boundary, whose tangent space at the cap is a cone) is left out here; its optimum is
manifolds.optimum.cone_optimum.
"""
import torch

GRAM_MASKS = {  # P(S) = mask * S
    "stiefel": lambda n: torch.ones(n, n),           # W^T W = I: every entry
    "dgram": lambda n: 1 - torch.eye(n),             # Off(W^T W) = 0: off the diagonal
    "oblique": lambda n: torch.eye(n),               # diag(W^T W) = 1: the diagonal
    "none": lambda n: torch.zeros(n, n),             # no constraint
}


def msign(X):
    """U V^T for X = U S V^T (the polar factor), by SVD."""
    U, _, Vh = torch.linalg.svd(X, full_matrices=False)
    return U @ Vh


def spectral_clip(X):
    """U min(S, 1) V^T: the nearest matrix with ||.||_op <= 1."""
    U, S, Vh = torch.linalg.svd(X, full_matrices=False)
    return U @ torch.diag(S.clamp(max=1)) @ Vh


def tangent_projection(W, A, manifold):
    """Proj_T(A) = A - W M, M = P(W^T A + A^T W) / (d_i^2 + d_j^2), W tall and on the manifold.

    For M in range(P), P(W^T W M + M W^T W) has entries (d_i^2 + d_j^2) M_ij (Stiefel, DGram:
    W^T W = D^2; oblique: P and M are diagonal, only (W^T W)_ii = d_i^2 enters), so this M
    removes the residual exactly; W M is normal, so this is the Euclidean projection."""
    P = GRAM_MASKS[manifold](W.size(-1)).to(W)
    d2 = W.square().sum(dim=-2)                         # d_i^2 = (W^T W)_ii
    H = P * (W.mT @ A + A.mT @ W)                       # tangent residual P(W^T A + A^T W)
    return A - W @ (H / (d2[:, None] + d2[None, :]))    # A - W M


def tangent_residual(W, A, manifold):
    """||P(W^T A + A^T W)||_F / ||W||_F^2 (W tall): zero when A is tangent at W."""
    P = GRAM_MASKS[manifold](W.size(-1)).to(W)
    return float((P * (W.mT @ A + A.mT @ W)).norm() / W.square().sum())


def steepest_direction_reference(W, G, manifold, iterations=1000):
    """(A*, tangent residual): A* = argmax <G, A> s.t. ||A||_op <= 1, P(W^T A + A^T W) = 0.

    ADMM on the split A = B = Z, B tangent, ||Z||_op <= 1, with the scaled dual U and a fixed
    penalty rho. At its fixed point rho U - G is normal, rho U = G + 2 W Lambda, and
    Z = msign(rho U): the dual problem's answer A(Lambda) = msign(G + 2 W Lambda).
    On random test problems (up to 64 x 32) a few hundred iterations reach fp32 accuracy; a
    fixed rho converges slowly on ill-conditioned ones (optimum.py balances rho and certifies
    the gap). Square Stiefel has a closed form, A* = W msign(skew(W^T G)), a check in the tests.
    manifold "none": A* = msign(G)."""
    wide = W.size(-2) < W.size(-1)
    if wide:
        W, G = W.mT, G.mT                              # tall orientation: P acts on the small Gram
    G = G / G.norm()                                   # the argmax ignores G's scale, rho does not
    rho = torch.linalg.matrix_norm(tangent_projection(W, G, manifold), ord=2)  # rho ~ ||Proj_T G||_op
    Z, U = torch.zeros_like(G), torch.zeros_like(G)
    for _ in range(iterations):
        B = tangent_projection(W, Z - U + G / rho, manifold)  # argmax <G, B> - rho/2 |B - Z + U|^2, B in T
        Z = spectral_clip(B + U)                              # argmin |Z - B - U|, ||Z||_op <= 1
        U = U + B - Z                                         # dual ascent on B = Z
    A = tangent_projection(W, Z, manifold)             # exactly tangent...
    A = A / torch.linalg.matrix_norm(A, ord=2)         # ...with ||A||_op = 1
    residual = tangent_residual(W, A, manifold)
    return (A.mT if wide else A), residual


def retract(X, manifold):
    """R(X), X tall: the manifold point R maps it to (R(W) = W on the manifold)."""
    N = X.norm(dim=-2, keepdim=True)                   # N = diag(column norms of X)
    if manifold == "stiefel":
        return msign(X)                                # R(X) = msign(X)
    if manifold == "dgram":
        return msign(X / N) * N                        # R(X) = msign(X N^-1) N
    if manifold == "oblique":
        return X / N                                   # R(X) = X N^-1
    return X                                           # none


def manifold_muon_step_reference(W, G, manifold, lr, iterations=1000):
    """One manifold Muon step W <- R(W - lr A*) (none: plain Muon, W - lr msign(G), no weight decay)."""
    A, _ = steepest_direction_reference(W, G, manifold, iterations)
    wide = W.size(-2) < W.size(-1)
    X = (W - lr * A).mT if wide else W - lr * A
    return retract(X, manifold).mT if wide else retract(X, manifold)
