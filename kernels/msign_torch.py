"""Matrix sign (polar factor) in plain torch: the reference twin of the Triton kernels.

msign(X) = U V^T for X = U S V^T. We approximate it with odd matrix polynomials applied to
X normalised so that every singular value lies in (0, 1]:

    X <- a X + (b S + c S^2) X,    S = X X^T   (wide orientation, so S is the small Gram)

Polar Express coefficients drive all singular values in [~1e-3, 1] into a band around 1 in five
steps; a few Newton-Schulz steps (a, b, c) = (1.5, -0.5, 0) then polish them to 1 with quadratic
convergence. The polish is what makes a result fp32-accurate.
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


def polynomial_step(X, a, b, c):
    """One step X <- a X + (b S + c S^2) X with S = X X^T; X is wide (rows <= cols)."""
    S = X @ X.mT
    B = b * S + c * (S @ S) if c != 0.0 else b * S
    return a * X + B @ X


def msign_torch(X, steps=5, polish_steps=0):
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
        X = polynomial_step(X, a, b, c)
    for _ in range(polish_steps):
        X = polynomial_step(X, *NEWTON_SCHULZ)
    return X.mT if transpose else X


def orthonormalize_near(X, steps=3):
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
    S = X @ X.mT
    eye = torch.eye(S.size(-1), dtype=S.dtype, device=S.device)
    distance = (S - eye).norm(dim=(-2, -1), keepdim=True)
    scale = torch.where(distance > 1.0, (1.0 + distance).rsqrt(), torch.ones_like(distance))
    X, S = X * scale, S * scale.square()
    for step in range(steps):
        if step > 0:
            S = X @ X.mT
        X = a * X + (b * S) @ X
    return X.mT if transpose else X
