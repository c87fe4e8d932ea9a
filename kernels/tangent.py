"""Gram-space tangent operations at a bank W (tall: (..., p, q), p >= q), over a backend's products.

The tangent space of a manifold at W is {A : P(W^T A + A^T W) = 0}, P its Gram projector:
identity for Stiefel, Off (zero the diagonal) for DGram; `none` has no constraint (P = 0).
With d_i^2 the squared column norms (Stiefel: d = 1) the Gram-space metric is
(d_i^2 + d_j^2): for symmetric M in range(P), W^T (W M) + (W M)^T W = (d_i^2 + d_j^2) M_ij on
the manifold. Each operation below is one `symmetric_gram` (one fused pass over the q x q tiles
on the Triton backend), at most followed by one `matmul_add`:

    tangent_residual     H = P(W^T A + A^T W)         and ||H||_F^2 for the stopping test
    preconditioned       alpha P(W^T A + A^T W) / (d_i^2 + d_j^2)
    tangent_projection   A - W M,  M = P(W^T A + A^T W) / (d_i^2 + d_j^2)
    symmetric_part       (A^T X + X^T A) / 2
"""
import torch

from kernels.precision import tf32_products

# The Gram projectors the fused kernels apply themselves (a manifold's `kernel_name`; the manifolds
# are manifolds/geometry.py's, which run any other mask on the "stiefel" kernel and mask after it)
ZERO_DIAGONAL = {"stiefel": False, "dgram": True}  # P = identity / P = Off
KERNEL_MASKS = (*ZERO_DIAGONAL, "none")            # "none": P = 0


def _zero_diagonal(manifold):
    if manifold not in KERNEL_MASKS:
        raise ValueError(f"no fused kernel for the Gram mask {manifold!r}; valid: {', '.join(KERNEL_MASKS)}")
    return ZERO_DIAGONAL.get(manifold)


def tangent_residual(W, A, manifold, ops, with_norm=False):
    """H = P(W^T A + A^T W), zero exactly when A is tangent at W; with_norm: (H, ||H||_F^2)."""
    zero_diagonal = _zero_diagonal(manifold)
    if zero_diagonal is None:  # none: P = 0
        H = W.new_zeros(W.shape[:-2] + (W.size(-1), W.size(-1)))
        return (H, W.new_zeros(W.shape[:-2], dtype=torch.float32)) if with_norm else H
    H, sumsq = ops.symmetric_gram(W, A, zero_diagonal, want_sumsq=with_norm)
    return (H, sumsq) if with_norm else H


def preconditioned(W, A, manifold, d2, alpha, ops):
    """alpha P(W^T A + A^T W) / (d_i^2 + d_j^2); alpha a float or one per matrix."""
    zero_diagonal = _zero_diagonal(manifold)
    if zero_diagonal is None:
        return W.new_zeros(W.shape[:-2] + (W.size(-1), W.size(-1)))
    return ops.symmetric_gram(W, A, zero_diagonal, d2=d2, alpha=alpha)[0]


def tangent_projection(W, A, manifold, d2, ops, tf32_correction=False):
    """Euclidean projection A - W M of A onto the tangent space at W (W on the manifold).
    tf32_correction: the product W M reads TF32 operands (M and the sum stay fp32), for an A
    already tangent up to rounding, whose M is that small (see correction_product)."""
    if _zero_diagonal(manifold) is None:
        return A
    return correction_product(W, preconditioned(W, A, manifold, d2, 1.0, ops), A, -1.0, ops, tf32_correction)


def correction_product(B, X, C, alpha, ops, tf32_correction):
    """C + alpha B X, where B X is a small correction to C: with tf32_correction its operands are
    read at TF32 (relative error ~5e-4 of a term that is itself ~eps of C: below fp32's rounding
    of C, at a third of the cost of an fp32 product on GPU tensor cores); C is added in fp32."""
    if not tf32_correction:
        return ops.matmul_add(B, X, C, alpha=alpha)
    with tf32_products():
        return ops.matmul_add(B, X, C, alpha=alpha)


def symmetric_part(A, X, ops):
    """(A^T X + X^T A) / 2 for A, X (..., p, q)."""
    return ops.symmetric_gram(A, X, alpha=0.5)[0]
