"""ADMM for the steepest direction, run in the coefficients of span[W, G] (tall matrices).

Every ADMM iterate is a right combination of W and G: the tangent projection subtracts W M,
the spectral clip multiplies on the right by a q x q matrix, and the updates add iterates. So
with V = [W, G] (p x 2q) each iterate is X = V c, c = [a; b] (2q x q), and all the algebra
needs only K = V^T V (2q x 2q, computed once):

    W^T X = K_W c           (K_W: the first q rows of K)
    X^T X = c^T K c         (q x q)
    Proj_T(X) = X - W M     ->  a <- a - M,  M = P(W^T X + X^T W) / (d_i^2 + d_j^2)
    clip(X) = X h           ->  c <- c h,    h = S^(-1/2) min(S^(1/2), I), S = X^T X

The clip factor h comes from a Polar Express iteration run on the Gram matrix itself: with
X_k = X R_k, S_k = X_k^T X_k, a step X_(k+1) = X_k (a + b S_k + c S_k^2) is
R <- R P, S <- P S P with P = a + b S + c S^2 (all q x q), so R -> S^(-1/2) = msign's right
factor. Then P = R S = S^(1/2), min(P, I) = (P + I - |P - I|) / 2 and |E| = sign(E) E with
sign(E) the polar factor of the symmetric q x q matrix E = P - I.

An iteration costs O(q^3), independent of the row count p: for the MLP banks (p = 4q) about a
third of the same iteration on p x q matrices. The row count enters only through K and the
final A = V c. Worth it when p >= 2q (below that V's columns are dependent and K singular).
"""
import torch

import kernels
from kernels.matrix_sign import NEWTON_SCHULZ, polar_express_coefficients


def gram_polar_factor(S, steps, polish_steps):
    """R with X R ~= msign(X), from S = X^T X alone (q x q, symmetric PSD)."""
    eye = torch.eye(S.size(-1), dtype=S.dtype, device=S.device)
    # Frobenius normalisation of X: ||X||_F^2 = tr(S); the 1.02 of the Polar Express tuning
    scale = (torch.diagonal(S, dim1=-2, dim2=-1).sum(-1) * 1.02 ** 2).clamp_min(1e-30)[..., None, None]
    S = S / scale
    R = eye.expand_as(S) / scale.sqrt()
    for a, b, c in list(polar_express_coefficients(steps)) + [NEWTON_SCHULZ] * polish_steps:
        P = a * eye + b * S + (c * (S @ S) if c else 0.0)
        R = R @ P
        S = P @ S @ P
        S = 0.5 * (S + S.mT)  # keep it symmetric against rounding
    return R


def clip_factor(S, opts):
    """h with X h = the projection of X onto the unit spectral-norm ball, from S = X^T X."""
    R = gram_polar_factor(S, opts.msign_steps, opts.polish_steps)
    eye = torch.eye(S.size(-1), dtype=S.dtype, device=S.device)
    P = R @ S
    P = 0.5 * (P + P.mT)  # S^(1/2)
    E = P - eye
    sign_E = kernels.msign(E, opts.msign_steps, opts.polish_steps, opts.backend)
    absE = sign_E @ E
    absE = 0.5 * (absE + absE.mT)
    return R @ (0.5 * (P + eye - absE))


class SpanBasis:
    """The coefficient calculus of span[W, G] for a bank of tall W, G (..., p, q)."""

    def __init__(self, W, G, geo):
        self.q = W.size(-1)
        self.p = W.size(-2)
        self.V = torch.cat([W, G], dim=-1)
        self.K = self.V.mT @ self.V
        self.K = 0.5 * (self.K + self.K.mT)
        self.geo = geo
        d2 = torch.diagonal(self.K[..., : self.q, : self.q], dim1=-2, dim2=-1)
        if geo.name == "stiefel":
            d2 = torch.ones_like(d2)
        self.pair = d2.unsqueeze(-1) + d2.unsqueeze(-2)
        eye = torch.eye(self.q, dtype=W.dtype, device=W.device).expand(W.shape[:-2] + (self.q, self.q))
        self.G = torch.cat([torch.zeros_like(eye), eye], dim=-2)  # G = V [0; I]
        # ||K||_op from a few plain power steps (O(q^2) each), for `precise`
        v = torch.ones(self.K.shape[:-1] + (1,), dtype=self.K.dtype, device=self.K.device)
        for _ in range(8):
            v = self.K @ v
            v = v / v.norm(dim=-2, keepdim=True).clamp_min(1e-30)
        self.K_norm = (v * (self.K @ v)).sum(dim=(-2, -1))

    def gram(self, c):
        return c.mT @ (self.K @ c)

    def sumsq(self, c):
        """||V c||_F^2 per matrix."""
        return (c * (self.K @ c)).sum(dim=(-2, -1)).clamp_min(0)

    def project(self, c):
        WtX = self.K[..., : self.q, :] @ c
        M = self.geo.gram_projector(WtX + WtX.mT) / self.pair
        return torch.cat([c[..., : self.q, :] - M, c[..., self.q:, :]], dim=-2)

    def matrix(self, c):
        return self.V @ c

    def precise(self, c, digits=3):
        """Per matrix: is c^T K c accurate to about `digits` digits? Its rounding error is about
        eps ||c||_F^2 ||K||_op against ||V c||_F^2."""
        eps = torch.finfo(c.dtype).eps
        growth = c.square().sum(dim=(-2, -1)) * self.K_norm / self.sumsq(c).clamp_min(1e-30)
        return torch.isfinite(growth) & (growth * eps <= 10.0 ** -digits)


def span_admm(W, G, geo, opts):
    """(B, Z, iterations, valid): ADMM of dual.py's `admm`, in span[W, G] coefficients; B = V c_B.

    `valid` (one bool per matrix) is False where the coefficients lost the precision the
    iteration needs. When G is nearly rank-deficient or nearly inside span[W], so is V, and
    msign(Proj_T G) puts unit singular values on directions that V reaches only through huge
    coefficients; a coefficient c carries a rounding error of about eps ||c||^2 ||K|| into
    c^T K c. The caller then solves the bank on the full matrices.
    """
    # G scaled to columns of unit mean norm, like W's: the coefficients then measure the
    # conditioning of V rather than G's scale (the ADMM iterates do not depend on G's scale).
    G = G * (W.size(-1) ** 0.5 / G.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-30))
    basis = SpanBasis(W, G, geo)
    rms = lambda c: (basis.sumsq(c) / (basis.p * basis.q)).sqrt()  # noqa: E731
    GT = basis.project(basis.G)
    S = basis.gram(GT)
    # rho = admm_rho x ||Proj_T G||_op, from the top eigenvalue of its Gram
    rho = (opts.admm_rho * top_eigenvalue(S, opts.norm_iters).sqrt()).clamp_min(1e-30)[..., None, None]
    Z = GT @ gram_polar_factor(S, opts.msign_steps, opts.polish_steps)  # msign(Proj_T G)
    U = torch.zeros_like(Z)
    alpha = opts.admm_relax
    active = torch.ones(W.shape[:-2], dtype=torch.bool, device=W.device)
    k = 0
    for k in range(opts.admm_steps):
        B = basis.project(Z - U + basis.G / rho)
        relaxed = alpha * B + (1 - alpha) * Z
        Y = relaxed + U
        Z_new = Y @ clip_factor(basis.gram(Y), opts)
        U_new = U + relaxed - Z_new
        change = torch.maximum(rms(B - Z_new), rms(Z_new - Z)) / rms(B).clamp_min(1e-30)
        keep = active.reshape(active.shape + (1, 1))
        Z, U = torch.where(keep, Z_new, Z), torch.where(keep, U_new, U)
        active = active & (change > opts.tol)
        if (k + 1) % opts.check_every == 0 and not bool(active.any()):
            break
    B = basis.project(Z - U + basis.G / rho)
    return basis.matrix(B), basis.matrix(Z), k + 1, basis.precise(Z) & basis.precise(B)


def top_eigenvalue(S, iters):
    """Largest eigenvalue of symmetric PSD S (..., q, q) by power iteration on S^32.

    Five squarings, normalised as they go, make it converge like 32 x iters plain power steps:
    the top of a near-msign Gram is a tight cluster (within 1% needs a power in the hundreds).
    The Rayleigh quotient on S itself is a lower bound, tight once v is in the top cluster.
    """
    power = S
    for _ in range(5):
        power = power / power.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-30)
        power = power @ power
    v = torch.ones(S.shape[:-1] + (1,), dtype=S.dtype, device=S.device)
    v[..., 0, :] = 2.0  # break symmetry with an all-ones vector that might be degenerate
    for _ in range(iters):
        v = power @ v
        v = v / v.norm(dim=-2, keepdim=True).clamp_min(1e-30)
    return (v * (S @ v)).sum(dim=(-2, -1)).clamp_min(0)
