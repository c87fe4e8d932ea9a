"""The three matrix products of the optimizer's hot loop, in plain torch.

This is the reference twin of `products_triton.py`: the same functions with the same
arguments, written as the separate torch ops the Triton kernels fuse. Every tensor is batched
over leading dimensions and computed in its own dtype (torch decides the accumulation).

    sym_product(X, alpha, C, beta)   = alpha X X^T + beta C                      (C symmetric)
    matmul_add(B, X, C, alpha, beta) = beta C + alpha B X
    symmetric_gram(X, Y, ...)        = base + alpha P(X^T Y + Y^T X) / (d_i^2 + d_j^2),  ||P(.)||_F^2

P is the identity or, with zero_diagonal=True, zeroes the diagonal (the DGram projector).
C and base must be symmetric: the Triton twin reads them on the upper-triangle tiles only.
Inside kernels.precision.tf32_products() the fp32 operands (not C or base) are rounded to TF32,
as the Triton twin's tensor cores would read them.
"""
import torch

from kernels.precision import operand


def off_diagonal(S):
    """Off(S): S with its diagonal zeroed."""
    return S - torch.diag_embed(torch.diagonal(S, dim1=-2, dim2=-1))


def pair_scale(d2):
    """(d_i^2 + d_j^2) as a (..., q, q) tensor from the squared column norms d2 (..., q)."""
    return d2.unsqueeze(-1) + d2.unsqueeze(-2)


def sym_product(X, alpha=1.0, C=None, beta=0.0):
    X = operand(X)
    out = X @ X.mT
    if alpha != 1.0:
        out = alpha * out
    return out if C is None else out + beta * C


def matmul_add(B, X, C, alpha=1.0, beta=1.0):
    product = operand(B) @ operand(X)
    if alpha == -1.0 and beta == 1.0:
        return C - product
    if beta == 0.0:  # C is not read (kernels.matmul passes a stride-0 zero)
        return product if alpha == 1.0 else alpha * product
    if alpha != 1.0:
        product = alpha * product
    return (C if beta == 1.0 else beta * C) + product


def symmetric_gram(X, Y, zero_diagonal=False, d2=None, alpha=1.0, want_sumsq=False):
    """(out, sumsq): T = P(X^T Y + Y^T X) for X, Y (..., p, q); out = alpha T / pair
    (or alpha T without d2); sumsq = ||T||_F^2 per matrix, at least fp32 (None unless asked)."""
    XtY = operand(X).mT @ operand(Y)
    T = XtY + XtY.mT
    if zero_diagonal:
        T = off_diagonal(T)
    sumsq = None
    if want_sumsq:
        sumsq = T.to(torch.promote_types(T.dtype, torch.float32)).square().sum(dim=(-2, -1))
    out = T if d2 is None else T / pair_scale(d2)
    if isinstance(alpha, torch.Tensor):  # one factor per matrix
        out = alpha.to(out.dtype)[..., None, None] * out
    elif alpha != 1.0:
        out = alpha * out
    return out, sumsq
