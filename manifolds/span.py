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
from kernels.constants import eye as kept_eye
from manifolds.geometry import MaskedGram


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


def top_eigenvalue_bound(S, squarings, backend="torch", tf32=False):
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
        log_scale = torch.zeros(S.shape[:-2], dtype=S.dtype, device=S.device)
        for k in range(1, squarings):
            if k % 3 == 1:  # top eigenvalue >= 1 / sqrt(q) here, >= q^-4 three squarings on
                norm = P.norm(dim=(-2, -1)).clamp_min(1e-30)
                # log_scale + log(norm) / 2^k, the division by 2^k exact: one launch for two
                P, log_scale = P / norm[..., None, None], torch.add(log_scale, norm.log(), alpha=2.0 ** -k)
            P = kernels.sym_product(P, backend=backend)
    t = torch.diagonal(P, dim1=-2, dim2=-1).sum(dim=-1)
    f = P.square().sum(dim=(-2, -1))
    mu = torch.minimum(t / q + ((q - 1) / q * (f - t * t / q)).clamp_min(0).sqrt(), f.sqrt())
    return m * (log_scale + mu.log() / 2 ** squarings).exp()


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
