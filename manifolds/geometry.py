"""The geometry of each manifold a weight matrix can be assigned to.

Everything here works on the tall orientation: W is (..., p, q) with p >= q, so constraints
act on the q x q Gram matrix W^T W. A manifold is described by its Gram projector P (acting on
symmetric q x q matrices) and by the squared column norms d^2 that scale its tangent geometry:

    Stiefel  P = identity       {W : W^T W = I}              d = 1
    DGram    P = Off (zero diag) {W : Off(W^T W) = 0} = {Q D}  d = column norms of W
    none     no constraint (plain Muon)

The tangent space at W is {A : P(W^T A + A^T W) = 0}. On the manifold W^T W = D^2, so
for symmetric M in range(P),  W^T (W M) + (W M)^T W = D^2 M + M D^2,  entry (i, j) being
(d_i^2 + d_j^2) M_ij. That one identity gives the exact tangent projection, the exact
starting multiplier of the dual problem and its per-entry preconditioner.
"""
import torch

from kernels import orthonormalize_near


def polar_svd(X):
    """Exact polar factor U V^T by SVD: used once per matrix at initialisation, where the
    input can be far from orthonormal (square random matrices have tiny singular values that
    iterative msign leaves far from 1)."""
    U, _, Vh = torch.linalg.svd(X.double() if X.device.type == "cpu" else X.float(),
                                full_matrices=False)
    return (U @ Vh).to(X.dtype)


def gram_symmetric(W, A):
    """W^T A + A^T W for tall W, A (..., p, q)."""
    WtA = W.mT @ A
    return WtA + WtA.mT


class Manifold:
    """Interface shared by every manifold; `none` is the degenerate case."""

    name = "abstract"

    def gram_projector(self, S):
        """P(S) for symmetric S (..., q, q)."""
        raise NotImplementedError

    def pair_scale(self, W):
        """(d_i^2 + d_j^2) as a (..., q, q) tensor: the Gram-space metric at W."""
        raise NotImplementedError

    def tangent_residual(self, W, A):
        """H = P(W^T A + A^T W): zero exactly when A is tangent at W."""
        return self.gram_projector(gram_symmetric(W, A))

    def tangent_projection(self, W, A):
        """Euclidean projection of A onto the tangent space at W (W on the manifold).

        A_T = A - W M with M_ij = H_ij / (d_i^2 + d_j^2), which makes P(W^T A_T + A_T^T W) = 0.
        """
        H = self.tangent_residual(W, A)
        return A - W @ (H / self.pair_scale(W))

    def retract(self, X, near=True):
        """Map X back onto the manifold; near=True assumes X is already close to it."""
        raise NotImplementedError

    def violation(self, W):
        """Per-matrix distance from the manifold (a tensor of W's leading shape)."""
        raise NotImplementedError


class Stiefel(Manifold):
    name = "stiefel"

    def gram_projector(self, S):
        return S

    def pair_scale(self, W):
        q = W.size(-1)
        return torch.full((q, q), 2.0, dtype=W.dtype, device=W.device)

    def retract(self, X, near=True):
        # R(X) = msign(X): the closest matrix with orthonormal columns.
        return orthonormalize_near(X) if near else polar_svd(X)

    def violation(self, W):
        # max |W^T W - I|
        gram = W.mT @ W
        eye = torch.eye(W.size(-1), dtype=W.dtype, device=W.device)
        return (gram - eye).abs().amax(dim=(-2, -1))


class DGram(Manifold):
    name = "dgram"

    def gram_projector(self, S):
        return S - torch.diag_embed(torch.diagonal(S, dim1=-2, dim2=-1))

    def pair_scale(self, W):
        d2 = W.square().sum(dim=-2)
        return d2.unsqueeze(-1) + d2.unsqueeze(-2)

    def retract(self, X, near=True):
        # R(X) = msign(X N^-1) N, N = diag(column norms of X). On the manifold X = Q D, so
        # X N^-1 = Q and R(X) = X: a true retraction that keeps each column's norm.
        norms = X.norm(dim=-2, keepdim=True).clamp_min(torch.finfo(X.dtype).tiny ** 0.5)
        unit = X / norms
        Q = orthonormalize_near(unit) if near else polar_svd(unit)
        return Q * norms

    def violation(self, W):
        # max |Off(W^T W)| / max diag(W^T W)
        gram = W.mT @ W
        diag = torch.diagonal(gram, dim1=-2, dim2=-1)
        off = gram - torch.diag_embed(diag)
        return off.abs().amax(dim=(-2, -1)) / diag.amax(dim=-1).clamp_min(1e-30)


class Unconstrained(Manifold):
    name = "none"

    def gram_projector(self, S):
        return torch.zeros_like(S)

    def pair_scale(self, W):
        q = W.size(-1)
        return torch.ones((q, q), dtype=W.dtype, device=W.device)

    def retract(self, X, near=True):
        return X

    def violation(self, W):
        return torch.zeros(W.shape[:-2], dtype=W.dtype, device=W.device)


MANIFOLDS = {m.name: m for m in (Stiefel(), DGram(), Unconstrained())}
