"""A tall problem (W, G: p x q, p >= 2q) solved as an equivalent 2q x q one, in span[W, G].

The optimum and every iterate of the solvers are right combinations of W and G: tangent
projections subtract W M, matrix signs and spectral clips multiply on the right by q x q
matrices, updates add iterates. So they stay in span[W, G], the column space of V = [W, G]
(p x 2q). Write V = Q R with Q orthonormal (p x 2q) and R upper triangular (2q x 2q). For
X = Q x every quantity the solvers use is the same in the coordinates x:

    W^T X = R_W^T x,  X^T X = x^T x,  ||X||_F = ||x||_F,  W M = Q (R_W M)

with R_W = R[:, :q] (its Gram R_W^T R_W = W^T W, so it is on the manifold exactly when W
is; on it R_W = [D; 0], see StackedSpans), R_G = R[:, q:]. The problem (W, G) is the
problem (R_W, R_G), 2q x q: the iterations cost O(q^3) whatever p is, and the row count enters only through K = V^T V = R^T R (its
blocks W^T G and G^T G) and the final lift A = Q x = V (R^(-1) x), both products of the kernels.

Precision: R comes from the Cholesky factor of K in fp32. When G is nearly rank-deficient
or nearly inside span[W], V is nearly singular and the lift needs huge coefficients
c = R^(-1) x; V c then carries a rounding error of about eps ||c|| ||K||^(1/2) against ||V c||
(the solve's error in c lies along R's small directions, which V = Q R shrinks back).
`lift` reports, per matrix, whether that error is below 1e-3 of the signal, and lifts the
Euclidean tangent projection of G instead where it is not (seen in training: an attention
matrix at lr 0.2).
"""
import torch

import kernels
from manifolds.geometry import MaskedGram
from manifolds.norm_bound import power_steps


SCHUR_SHIFT = 1e-6     # see StackedSpans.__init__
LIFT_TOLERANCE = 1e-3  # the lifted answer's estimated relative rounding error (StackedSpans.lift)


class StackedSpans:
    """The 2q x q problems (W', G') equivalent to tall banks (W, G: (n_i, p_i, q)) of one q,
    each W on its manifold, stacked into one batch of sum(n_i) problems.

    On the manifold W^T W = D^2 is diagonal (Stiefel: D = I), so the Cholesky factor of K
    starts with R_W = [D; 0]: W' = [D; 0] and the tangent operations at W' are elementwise
    (`project`). The rest is a block Cholesky step:

        R_12 = D^-1 W^T G,   R_22^T R_22 = G^T G - R_12^T R_12   (q x q)

    Only K = V^T V (and the final lift V c) touch the p_i rows, bank by bank; everything else
    is 2q x q whatever p_i, and Stiefel and DGram problems differ only in the Gram projector's
    mask (geometry.MaskedGram) and in d2: one batch, each product one launch for all.
    Off the manifold by rounding (W^T W = D^2 + O(eps)) the reduced problem differs from the
    original by as much: the lifted answer is tangent at W to about that (relative ~1e-6; a
    projection on the full matrices would cost two products at p rows), and the retraction
    absorbs it.
    `valid` is False for matrices whose Schur complement has no Cholesky factor in this
    precision (G nearly inside span[W]).
    """

    def __init__(self, banks, backend="torch"):
        """banks: [(W, G, geo, d2)], d2 the metric's squared column norms of W (geo.squared_norms;
        Stiefel: 1); `backend` computes the Grams K (kernels.sym_product)."""
        q = banks[0][0].size(-1)
        self.sizes = [W.size(0) for W, *_ in banks]
        self.backend = backend
        # G scaled to columns of unit mean norm, like W's: K then measures the conditioning
        # of V, not G's scale. The reduced G is scaled back (the solution does not depend on
        # G's scale, a warm-start multiplier does).
        scales = [q ** 0.5 / G.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-30) for _, G, _, _ in banks]
        self.V = [torch.cat([W, G * scale], dim=-1) for (W, G, _, _), scale in zip(banks, scales)]
        # K = V^T V by blocks: of W^T W only the diagonal D^2 is used (the rest is 0 on the
        # manifold), so it is never formed: W^T G and G^T G (upper tiles) are half of K's FLOPs
        WG = torch.cat([kernels.matmul(V[..., :q].mT, V[..., q:], backend=backend) for V in self.V])
        self.scale = torch.cat(scales)
        self.WG = WG
        GG = torch.cat([kernels.sym_product(V[..., q:].mT, backend=backend) for V in self.V])
        GG = 0.5 * (GG + GG.mT)
        d2_W = torch.cat([V[..., :q].square().sum(dim=-2) for V in self.V])
        self.d = d2_W.clamp_min(1e-30).sqrt()
        self.d2 = torch.cat([d2 for *_, d2 in banks])  # Stiefel: 1, which d^2 is up to rounding
        pair = self.d2.unsqueeze(-1) + self.d2.unsqueeze(-2)
        self.R12 = WG / self.d.unsqueeze(-1)
        schur = GG - self.R12.mT @ self.R12
        # + SCHUR_SHIFT I: G is often rank-deficient by construction (a matrix that reads LayerNorm
        # outputs has a gradient with the exact null vector 1 / gamma), which leaves the Schur
        # complement singular. The shift makes the reduced problem that of a G~ with
        # G~^T G~ = G^T G + shift I (G has unit mean column norm here: a relative change of
        # ~1e-3 / sqrt(q)); the lift V c drops the shifted direction again (V [0; u] = G u = 0),
        # and its pivot sqrt(shift) amplifies rounding by at most 1e3, which `lift` still measures.
        eye = torch.eye(q, dtype=GG.dtype, device=GG.device)
        L, info = torch.linalg.cholesky_ex(0.5 * (schur + schur.mT) + SCHUR_SHIFT * eye)
        self.valid = (info == 0) & torch.isfinite(L).all(dim=(-2, -1))
        self.R22 = torch.where(self.valid[..., None, None], L.mT, eye)
        self.W = torch.cat([torch.diag_embed(self.d), torch.zeros_like(self.R12)], dim=-2)
        self.G = torch.cat([self.R12, self.R22], dim=-2) / torch.cat(scales)
        # ||K||_op from a few plain power steps (O(q^2) each), for `lift`'s precision test
        K = torch.cat([torch.cat([torch.diag_embed(d2_W), WG], dim=-1), torch.cat([WG.mT, GG], dim=-1)], dim=-2)
        v = power_steps(K, torch.ones(K.shape[:-1] + (1,), dtype=K.dtype, device=K.device), 8, every=4)
        self.K_norm = (v * (K @ v)).sum(dim=(-2, -1))
        geos = [geo for _, _, geo, _ in banks]
        if len({geo.kernel_name for geo in geos}) == 1 and geos[0].kernel_name is not None:
            self.geo = geos[0]  # one manifold the kernels know: its own projector, no mask
        else:
            self.geo = MaskedGram(torch.cat([geo.gram_mask(q, W.device).expand(W.shape[:-2] + (q, q))
                                             for (W, _, geo, _) in banks]))
        # P(S) / (d_i^2 + d_j^2) = S * (P(J) / (d_i^2 + d_j^2)), J all ones: every Gram projector
        # here keeps or zeroes entries, so `project` pays one product for P and the metric
        self.projector_scale = self.geo.gram_projector(torch.ones_like(pair)) / pair

    def multiplier(self, Y):
        """M = P(W'^T Y + Y^T W') / (d_i^2 + d_j^2) at W' = [D; 0]: W'^T Y = D y, y the top q
        rows of Y. O(q^2)."""
        Dy = self.d.unsqueeze(-1) * Y[..., :self.d.size(-1), :]
        return (Dy + Dy.mT) * self.projector_scale

    def times_W(self, M, Y, alpha):
        """Y + alpha W' M: only the top q rows change, by alpha D M. O(q^2)."""
        q = self.d.size(-1)
        return torch.cat([Y[..., :q, :] + alpha * self.d.unsqueeze(-1) * M, Y[..., q:, :]], dim=-2)

    def project(self, Y):
        """Euclidean projection onto the tangent space at W' = [D; 0]: Y - W' M. O(q^2)."""
        return self.times_W(self.multiplier(Y), Y, -1.0)

    def split(self, X):
        return torch.split(X, self.sizes)

    def tangent_coefficients(self):
        """c with V c = Proj_T(G) = G - W M, M = P(W^T G + G^T W) / (d_i^2 + d_j^2) (G as given,
        not scaled): the Euclidean tangent projection of G from the Gram block W^T G that K
        already holds, and an exact lift (its coefficients are O(1)): c = [-M; I / scale]."""
        q = self.d.size(-1)
        WG = self.WG / self.scale  # W^T G of the unscaled G
        M = (WG + WG.mT) * self.projector_scale
        eye = torch.eye(q, dtype=M.dtype, device=M.device) / self.scale
        return torch.cat([-M, eye], dim=-2)

    def lift(self, x):
        """[(X = V c with R c = x, precise)] bank by bank: the full p_i x q matrices of the
        coordinates x, and whether each is accurate to about three digits (per matrix). An
        imprecise matrix gets Proj_T(G) instead (tangent_coefficients), in the same product:
        the choice costs no host sync and no product of its own."""
        q = self.d.size(-1)
        c_G = torch.linalg.solve_triangular(self.R22, x[..., q:, :], upper=True)
        c_W = (x[..., :q, :] - self.R12 @ c_G) / self.d.unsqueeze(-1)
        c = torch.cat([c_W, c_G], dim=-2)
        eps = torch.finfo(c.dtype).eps
        # relative error ~ eps sqrt(growth): the solve's error lies along R's small directions,
        # which V = Q R shrinks back
        growth = c.square().sum(dim=(-2, -1)) * self.K_norm / x.square().sum(dim=(-2, -1)).clamp_min(1e-30)
        precise = self.valid & torch.isfinite(growth) & (growth.sqrt() * eps <= LIFT_TOLERANCE)
        c = torch.where(precise[..., None, None], c, self.tangent_coefficients())
        return [(kernels.matmul(V, c_i, backend=self.backend), ok)
                for V, c_i, ok in zip(self.V, self.split(c), self.split(precise))]
