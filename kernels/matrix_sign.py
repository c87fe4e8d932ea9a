"""Matrix sign (polar factor) by polynomial iterations, written once over a backend's products.

msign(X) = U V^T for X = U S V^T. We approximate it with odd matrix polynomials applied to
X normalised so that every singular value lies in (0, 1]:

    X <- a X + (b S + c S^2) X,    S = X X^T   (wide orientation, so S is the small Gram)

Polar Express coefficients drive all singular values in [~1e-3, 1] into a band around 1 in five
steps; a few Newton-Schulz steps (a, b, c) = (1.5, -0.5, 0) then polish them to 1 with quadratic
convergence. The polish is what makes a result fp32-accurate.

`ops` is the module of products that computes a step: `products_torch` (separate torch ops, the
reference) or `products_triton` (fused kernels). One step is three products:

    S = X X^T                  sym_product(X)                upper-triangle tiles only
    B = b S + c S^2            sym_product(S, c, S, b)       S S^T = S^2, upper tiles only
    X <- a X + B X             matmul_add(B, X, X, 1, a)     the identity term in the epilogue
"""
import torch

# Polar Express (5 steps, tuned for inputs normalised by 1.02 * ||X||_F).
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
# Classic cubic Newton-Schulz: f(s) = 1.5 s - 0.5 s^3, fixed point s = 1, f'(1) = 0.
NEWTON_SCHULZ = (1.5, -0.5, 0.0)


def polar_express_coefficients(steps):
    """Coefficients for `steps` Polar Express iterations (the last one repeats past five)."""
    return [POLAR_EXPRESS[min(i, len(POLAR_EXPRESS) - 1)] for i in range(steps)]


def polynomial_step(X, a, b, c, ops):
    """One step X <- a X + (b S + c S^2) X with S = X X^T; X is wide (rows <= cols)."""
    if c == 0.0:
        B = ops.sym_product(X, alpha=b)                # b S
    else:
        S = ops.sym_product(X)
        B = ops.sym_product(S, alpha=c, C=S, beta=b)   # c S S^T + b S
    return ops.matmul_add(B, X, X, alpha=1.0, beta=a)


def msign(X, steps, polish_steps, ops):
    """Polar factor of X (..., m, n), either orientation, computed in X's dtype.

    `steps` Polar Express iterations from a Frobenius normalisation, then `polish_steps`
    Newton-Schulz iterations. Zero matrices map to zero.
    """
    transpose = X.size(-2) > X.size(-1)
    if transpose:
        X = X.mT
    # ||X||_op <= ||X||_F, so every singular value of the scaled X is <= 1/1.02.
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * 1.02 + 1e-12)
    for a, b, c in polar_express_coefficients(steps):
        X = polynomial_step(X, a, b, c, ops)
    for _ in range(polish_steps):
        X = polynomial_step(X, *NEWTON_SCHULZ, ops)
    return X.mT if transpose else X


def orthonormalize_near(X, steps, ops):
    """Polar factor of an X that is already close to orthonormal (singular values near 1).

    No Frobenius normalisation (it would push singular values to 1/sqrt(n) and cost many
    iterations): Newton-Schulz converges quadratically from s in (0, sqrt(3)). To stay inside
    that basin for inputs further away, X is scaled by 1/sqrt(1 + ||S - I||_F) when the bound
    s_max^2 <= 1 + ||S - I||_F could exceed 2.
    """
    transpose = X.size(-2) > X.size(-1)
    if transpose:
        X = X.mT
    a, b, _ = NEWTON_SCHULZ
    S = ops.sym_product(X)
    eye = torch.eye(S.size(-1), dtype=S.dtype, device=S.device)
    distance = (S - eye).norm(dim=(-2, -1), keepdim=True)
    scale = torch.where(distance > 1.0, (1.0 + distance).rsqrt(), torch.ones_like(distance))
    X, S = X * scale, S * scale.square()
    for step in range(steps):
        if step > 0:
            S = ops.sym_product(X)
        X = ops.matmul_add(S, X, X, alpha=b, beta=a)   # a X + b S X
    return X.mT if transpose else X
