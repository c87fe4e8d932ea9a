"""A faithful re-statement of the published manifold Muon step, for comparison only.

What the published implementation does, per matrix, in a Python loop (the problem it solves is
stated in README.md):
  - input G: the (Nesterov) momentum, not normalised;
  - Lambda0 = -(1/4) P(W^T G + G^T W);
  - 20 dual steps: A = msign(G + 2 W Lambda) by 10 Polar-Express iterations,
    H = P(W^T A + A^T W), a tolerance test with a host sync, Lambda -= 0.1 (1 - k/20) H;
  - A = msign(G + 2 W Lambda);  X = W - eta A;
  - Stiefel: W <- msign(X) (10 iterations);  DGram: W <- msign(X) diag(sorted singular values
    of X), which is not a retraction (it reorders column norms).
Nothing here is used by the trainer.
"""
import torch

from kernels.matrix_sign import polar_express_coefficients
from manifolds.geometry import MANIFOLDS

PUBLISHED = dict(dual_steps=20, dual_lr=0.1, msign_iters=10, tol=1e-6)


def published_flops(p, q, dual_steps=PUBLISHED["dual_steps"], msign_iters=PUBLISHED["msign_iters"]):
    """FLOPs (2 per multiply-add, symmetric products counted in full) of one published step of a
    p x q matrix (p >= q), every dual step run: dual_steps + 2 matrix signs (the dual steps, the
    final direction, the retraction), each msign_iters quintic steps on the q x q Gram
    (4 p q^2 + 2 q^3 each), and per dual step the products of G + 2 W Lambda and
    P(W^T A + A^T W) (6 p q^2 x 2). DGram's svdvals are not counted."""
    msign = msign_iters * (4 * p * q * q + 2 * q ** 3)
    return (dual_steps + 2) * msign + 2 * dual_steps * 6 * p * q * q


def msign(X, steps):
    """The published matrix sign: X / (1.02 ||X||_F), then `steps` Polar Express steps (the
    fifth repeating; no polish) on the wide orientation, in X's dtype."""
    transpose = X.size(-2) > X.size(-1)
    if transpose:
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * 1.02 + 1e-12)
    for a, b, c in polar_express_coefficients(steps):
        S = X @ X.mT
        X = a * X + (b * S + c * S @ S) @ X
    return X.mT if transpose else X


def published_direction(W, G, manifold, dual_steps=20, dual_lr=0.1, msign_iters=10, tol=1e-6):
    """(A, dual steps run) on the tall orientation."""
    geo = MANIFOLDS[manifold]
    Lambda = -0.25 * geo.gram_projector(W.mT @ G + G.mT @ W)
    steps = 0
    for k in range(dual_steps):
        A = msign(G + 2 * W @ Lambda, steps=msign_iters)
        H = geo.tangent_residual(W, A)
        if float(H.norm() / H.numel() ** 0.5) < tol:  # the published host sync, every step
            break
        Lambda = Lambda - dual_lr * (1 - k / dual_steps) * H
        steps += 1
    return msign(G + 2 * W @ Lambda, steps=msign_iters), steps


def published_retract(X, manifold, msign_iters=10):
    polar = msign(X, steps=msign_iters)
    if manifold == "stiefel":
        return polar
    # polar factor x sorted singular values; svdvals has no bf16 kernel (CPU or CUDA), so fp32
    sigma = torch.linalg.svdvals(X.float()).to(X.dtype)
    return polar * sigma.unsqueeze(-2)


def published_step(W, G, manifold, eta):
    """New W (original orientation) for one matrix."""
    wide = W.size(-2) < W.size(-1)
    if wide:
        W, G = W.mT, G.mT
    A, _ = published_direction(W, G, manifold, **PUBLISHED)
    new = published_retract(W - eta * A, manifold)
    return new.mT if wide else new
