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

import kernels
from kernels.products_torch import off_diagonal, pair_scale


def polar_svd(X):
    """Exact polar factor U V^T by SVD: used once per matrix at initialisation, where the
    input can be far from orthonormal (square random matrices have tiny singular values that
    iterative msign leaves far from 1)."""
    U, _, Vh = torch.linalg.svd(X.double() if X.device.type == "cpu" else X.float(),
                                full_matrices=False)
    return (U @ Vh).to(X.dtype)


class Manifold:
    """Interface shared by every manifold; `none` is the degenerate case.

    The tangent operations run through `kernels` (fused Triton kernels on CUDA, torch
    elsewhere, as `backend` says); d2 are the squared column norms d_i^2 (..., q), which a
    solver computes once per bank and passes along.
    """

    name = "abstract"

    def gram_projector(self, S):
        """P(S) for symmetric S (..., q, q)."""
        raise NotImplementedError

    def squared_norms(self, W):
        """d_i^2 as a (..., q) tensor (Stiefel: d = 1)."""
        return torch.ones(W.shape[:-2] + W.shape[-1:], dtype=W.dtype, device=W.device)

    def pair_scale(self, W):
        """(d_i^2 + d_j^2) as a (..., q, q) tensor: the Gram-space metric at W."""
        return pair_scale(self.squared_norms(W))

    def tangent_residual(self, W, A, backend="auto"):
        """H = P(W^T A + A^T W): zero exactly when A is tangent at W."""
        return kernels.tangent_residual(W, A, self.name, backend)

    def tangent_projection(self, W, A, d2=None, backend="auto"):
        """Euclidean projection of A onto the tangent space at W (W on the manifold).

        A_T = A - W M with M_ij = H_ij / (d_i^2 + d_j^2), which makes P(W^T A_T + A_T^T W) = 0.
        """
        d2 = self.squared_norms(W) if d2 is None else d2
        return kernels.tangent_projection(W, A, self.name, d2, backend)

    def retract(self, X, near=True, backend="auto"):
        """Map X back onto the manifold; near=True assumes X is already close to it."""
        raise NotImplementedError

    def violation(self, W):
        """Per-matrix distance from the manifold (a tensor of W's leading shape)."""
        raise NotImplementedError


class Stiefel(Manifold):
    name = "stiefel"

    def gram_projector(self, S):
        return S

    def retract(self, X, near=True, backend="auto"):
        # R(X) = msign(X): the closest matrix with orthonormal columns.
        return kernels.orthonormalize_near(X, backend=backend) if near else polar_svd(X)

    def violation(self, W):
        # max |W^T W - I|
        gram = W.mT @ W
        eye = torch.eye(W.size(-1), dtype=W.dtype, device=W.device)
        return (gram - eye).abs().amax(dim=(-2, -1))


class DGram(Manifold):
    name = "dgram"

    def gram_projector(self, S):
        return off_diagonal(S)

    def squared_norms(self, W):
        return W.square().sum(dim=-2)

    def retract(self, X, near=True, backend="auto"):
        # R(X) = msign(X N^-1) N, N = diag(column norms of X). On the manifold X = Q D, so
        # X N^-1 = Q and R(X) = X: a true retraction that keeps each column's norm.
        norms = X.norm(dim=-2, keepdim=True).clamp_min(torch.finfo(X.dtype).tiny ** 0.5)
        unit = X / norms
        Q = kernels.orthonormalize_near(unit, backend=backend) if near else polar_svd(unit)
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

    def retract(self, X, near=True, backend="auto"):
        return X

    def violation(self, W):
        return torch.zeros(W.shape[:-2], dtype=W.dtype, device=W.device)


MANIFOLDS = {m.name: m for m in (Stiefel(), DGram(), Unconstrained())}
