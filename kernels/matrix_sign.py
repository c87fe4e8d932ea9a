"""Matrix sign (polar factor) by polynomial iterations, written once over a backend's products.

msign(X) = U V^T for X = U S V^T. We approximate it with odd matrix polynomials applied to
X normalised so that every singular value lies in (0, 1]:

    X <- a X + (b S + c S^2) X,    S = X X^T   (wide orientation, so S is the small Gram)

The normalisation divides by ||S||_F^(1/2) = (sum_i s_i^4)^(1/4), an upper bound on the largest
singular value s_1 that is never looser than ||X||_F = (sum_i s_i^2)^(1/2) and far tighter when
many singular values are comparable (a flat spectrum of n values: n^(1/4) s_1 against n^(1/2) s_1):
the small singular values start nearer 1 and fewer steps reach it. S is the Gram the first step
needs anyway, so the bound costs no product.

Schedules of (a, b, c), each step's polynomial the minimax approximation of 1 on the interval
the previous steps left (Polar Express):
- POLAR_EXPRESS, for any input: five steps drive all singular values in [~1e-3, 1] into a band
  around 1; a few Newton-Schulz steps (a, b, c) = (1.5, -0.5, 0) then polish them to 1 with
  quadratic convergence. The polish is what makes a result fp32-accurate.
- CLIP_SCHEDULE, for inputs whose singular values, after the normalisation, are >= CLIP_LOWER =
  0.02 (the spectral clip's two signs in ADMM, manifolds/solver.py): five steps take [0.02, 1] to
  within 2e-8 of 1 where POLAR_EXPRESS and its polish spend seven on a range they do not need.
  Smaller singular values are not lost, only left short of 1 (each step multiplies them by its
  a; one at 0.01 ends at 0.988). `minimax_schedule` computes such schedules;
  tests/test_kernels.py checks these coefficients against it.

`ops` is the module of products that computes a step: `products_torch` (separate torch ops, the
reference) or `products_triton` (fused kernels). One step is three products:

    S = X X^T                  sym_product(X)                upper-triangle tiles only
    B = b S + c S^2            sym_product(S, c, S, b)       S S^T = S^2, upper tiles only
    X <- a X + B X             matmul_add(B, X, X, 1, a)     the identity term in the epilogue
"""
import torch

from kernels.constants import eye as kept_eye, scalar
from kernels.precision import tf32_products

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
# The minimax schedules below are minimax_schedule(lower, steps, SCHEDULE_SAFETY): each step after
# the first designed for an interval 0.5% above the band the step before leaves. Without it, TF32
# products (rounding ~5e-4) push the top singular values past a step's interval, the next steps
# amplify the excess, and the [0.001, 1] schedule diverged on 37 of 300 random inputs at TF32;
# the cost is a last-step error of ~2e-8 instead of ~1e-10, below fp32's rounding at 1.
SCHEDULE_SAFETY = 1.005
# minimax_schedule(CLIP_LOWER, 5, SCHEDULE_SAFETY): after step k every singular value of [0.02, 1]
# lies within 0.846, 0.518, 0.095, 5.8e-4, 1.8e-8 of 1
CLIP_LOWER = 0.02
CLIP_SCHEDULE = (
    (7.710969245868, -22.113754790481, 16.248743017738),
    (3.204058108711, -2.380748958869, 0.490188411329),
    (2.215524917662, -1.581126649211, 0.403600009400),
    (1.879979506869, -1.250903825199, 0.371015575562),
    (1.870331429834, -1.240677279642, 0.370345855238),
)
# minimax_schedule(POLAR_LOWER, 6, SCHEDULE_SAFETY): ADMM's starting polar factor (solver.polar),
# from Y's singular values in [0.005, 1] after the normalisation; after step k they lie within
# 0.959, 0.840, 0.502, 0.086, 4.3e-4, 1.6e-8 of 1 (Polar Express + polish: 7 steps)
POLAR_LOWER = 0.005
POLAR_SCHEDULE = (
    (8.298703491438, -24.430498148218, 18.090304193079),
    (3.897674786256, -2.879711009401, 0.545852483743),
    (3.167227430088, -2.353273005595, 0.487142240712),
    (2.189099689524, -1.556960681984, 0.401097775071),
    (1.878138229865, -1.248924001090, 0.370853276775),
    (1.870331174890, -1.240677636323, 0.370346462536),
)
# minimax_schedule(EXACT_LOWER, 7, SCHEDULE_SAFETY): square Stiefel's exact step
# (manifolds/solver.exact_square_stiefel), whose skew(W^T G) keeps singular values down to ~1e-3 of its bound
# on real momenta; all 7 steps run at TF32 there (the last still lifts those below 1e-3); after
# step k [0.001, 1] lies within 0.992, 0.965, 0.861, 0.55, 0.117, 1.1e-3, 2.9e-8 of 1
EXACT_LOWER = 0.001
EXACT_SCHEDULE = (
    (8.470328803848, -25.108074706662, 18.629275599118),
    (4.162472147225, -3.062974554597, 0.566394387931),
    (3.945163767487, -2.912822915197, 0.549561700740),
    (3.281466971848, -2.438116661881, 0.496557091832),
    (2.276546324322, -1.636059792469, 0.409327909647),
    (1.885163435364, -1.256478175343, 0.371488470573),
    (1.870332623749, -1.240676499649, 0.370343897154),
)
# ||S||_F^(1/2) is an exact bound; 1% covers the rounding of S (TF32 operands: ~1e-3 relative)
BOUND_SAFETY = 1.01


def polar_express_coefficients(steps):
    """Coefficients for `steps` Polar Express iterations (the last one repeats past five)."""
    return [POLAR_EXPRESS[min(i, len(POLAR_EXPRESS) - 1)] for i in range(steps)]


def minimax_schedule(lower, steps, safety=1.0):
    """[(a, b, c)] of `steps` odd quintics, each the minimax approximation of 1 on the interval
    [l, u] the steps before it leave (start: [lower, 1]), and the largest distance from 1 after
    each step. Remez exchange on four alternation points: the ends and the two interior extrema
    of p(x) = a x + b x^3 + c x^5 (p'(x) = 0 is a quadratic in x^2). Once the interval is within
    1e-3 of 1 the minimax polynomial is the limit (15 x - 10 x^3 + 3 x^5) / 8, whose error there
    is of order (u - l)^3.

    safety > 1 widens each interval's upper end after the first, u = (1 + error) x safety: a
    minimax step maps its upper end to the top of its band with a steep slope (10-40), so a
    value that rounding pushed past the end grows step after step, and at TF32 with the
    aggressive [0.001, 1] schedule, some inputs diverge (SCHEDULE_SAFETY)."""
    import numpy as np
    schedule, errors, l, u = [], [], lower, 1.0
    for _ in range(steps):
        if u - l < 1e-3:
            a, b, c = 1.875, -1.25, 0.375
        else:
            xs = np.array([l, l + 0.25 * (u - l), l + 0.75 * (u - l), u])
            for _ in range(100):
                system = np.stack([xs, xs ** 3, xs ** 5, (-1.0) ** np.arange(4)], axis=1)
                a, b, c, _ = np.linalg.solve(system, np.ones(4))
                roots = np.roots([5 * c, 3 * b, a])
                inner = sorted(np.sqrt(r.real) for r in roots if abs(r.imag) < 1e-12 and l ** 2 < r.real < u ** 2)
                if len(inner) != 2 or np.allclose(inner, xs[1:3], rtol=1e-15, atol=0):
                    break
                xs = np.array([l, *inner, u])
        grid = np.linspace(l, u, 100001)
        values = a * grid + b * grid ** 3 + c * grid ** 5
        error = float(np.abs(1 - values).max())
        schedule.append((float(a), float(b), float(c)))
        errors.append(error)
        l, u = 1 - error, (1 + error) * safety
    return schedule, errors


def normalized(X, ops):
    """(X / bound, S = X X^T of the result) for wide X, with bound >= its largest singular
    value: ||S||_F^(1/2) (see the module docstring); a zero matrix stays zero.

    S is the Gram of X as given: fp32 and bf16 share a range in which it stays for any X with
    ||X||_F below ~1e18 (the solvers pass O(1) matrices: unit gradients, ADMM iterates), so X
    needs no prior scaling, and 1 / bound comes from one reciprocal square root: seven launches
    per matrix sign where ten were (it runs a dozen times a step)."""
    S = ops.sym_product(X)
    # the clamp acts on zero matrices only (their S stays 0; 1e-30 keeps rsqrt finite)
    inverse = (S.norm(dim=(-2, -1), keepdim=True) * BOUND_SAFETY ** 2).clamp_min(1e-30).rsqrt()
    return X * inverse, S * inverse.square()


def polynomial_step(X, S, a, b, c, ops):
    """One step X <- a X + (b S + c S^2) X, S = X X^T given; X is wide (rows <= cols)."""
    if c == 0.0:
        return ops.matmul_add(S, X, X, alpha=b, beta=a)   # a X + b S X
    B = ops.sym_product(S, alpha=c, C=S, beta=b)           # c S S^T + b S
    return ops.matmul_add(B, X, X, alpha=1.0, beta=a)


def msign(X, steps, polish_steps, ops, schedule=None):
    """Polar factor of X (..., m, n), either orientation, computed in X's dtype.

    `steps` steps of `schedule` (default POLAR_EXPRESS; its last triple repeats), then
    `polish_steps` Newton-Schulz iterations, from the normalisation above. Zero matrices map
    to zero.
    """
    transpose = X.size(-2) > X.size(-1)
    if transpose:
        X = X.mT
    schedule = POLAR_EXPRESS if schedule is None else schedule
    coefficients = [schedule[min(i, len(schedule) - 1)] for i in range(steps)] + [NEWTON_SCHULZ] * polish_steps
    X, S = normalized(X, ops)
    for i, (a, b, c) in enumerate(coefficients):
        if i > 0:
            S = ops.sym_product(X)
        X = polynomial_step(X, S, a, b, c, ops)
    return X.mT if transpose else X


def orthonormalize_near(X, steps, ops, tf32_correction=False):
    """Polar factor of an X that is already close to orthonormal (singular values near 1).

    No Frobenius normalisation (it would push singular values to 1/sqrt(n) and cost many
    iterations): Newton-Schulz converges quadratically from s in (0, sqrt(3)). To stay inside
    that basin for inputs further away, X is scaled by 1/sqrt(1 + ||S - I||_F) when the bound
    s_max^2 <= 1 + ||S - I||_F could exceed 2.

    A step is X <- 1.5 X - 0.5 S X = X - 0.5 (S - I) X. With tf32_correction the product
    (S - I) X reads TF32 operands (kernels.precision; S and the sum stay fp32): near the
    manifold S - I is small (a retraction after a step of lr eta: ~eta^2), so the product's
    relative error of ~5e-4 is ~5e-4 eta^2 of X, below fp32's rounding, at a third of the cost
    of the fp32 (3xTF32) product on a GPU.

    For X with at least twice as many columns as rows (wide orientation: a tall bank's matrices)
    all steps but the last run in Gram space (`_gram_steps`): one Gram of X and one product
    with X replace a Gram and a product per step, the rest is q x q; the last step, from a
    Gram computed afresh, corrects whatever those left (their rounding included) as before.
    Under tf32_correction the Gram-space steps read TF32 operands throughout: the last step's
    fp32 Gram sees their error (~5e-4 of the distance from the manifold) and squares it away.
    """
    transpose = X.size(-2) > X.size(-1)
    if transpose:
        X = X.mT
    a, b, _ = NEWTON_SCHULZ
    in_gram_space = steps >= 2 and X.size(-1) >= 2 * X.size(-2)
    with tf32_products(in_gram_space and tf32_correction):
        S = ops.sym_product(X)
    eye = kept_eye(S.size(-1), S)
    distance = (S - eye).norm(dim=(-2, -1), keepdim=True)
    scale = torch.where(distance > 1.0, (1.0 + distance).rsqrt(), scalar(1.0, distance))
    X, S = X * scale, S * scale.square()
    if in_gram_space:
        with tf32_products(tf32_correction):
            X = _gram_steps(X, S, steps - 1, ops)
        S, steps = ops.sym_product(X), 1
    for step in range(steps):
        if step > 0:
            S = ops.sym_product(X)
        if tf32_correction:
            with tf32_products():
                X = ops.matmul_add(S - eye, X, X, alpha=b, beta=a + b)   # X + b (S - I) X, a + b = 1
        else:
            X = ops.matmul_add(S, X, X, alpha=b, beta=a)   # a X + b S X
    return X.mT if transpose else X


def _gram_steps(X, S, steps, ops):
    """Z X after `steps` Newton-Schulz steps from wide X with S = X X^T, Z computed on q x q:
    X_k = Z_k X gives X_k X_k^T = Z_k S Z_k = S Z_k^2 (Z_k is a polynomial in S), so
    Z_{k+1} = Z_k - Z_k R_k / 2 with R_k = S Z_k^2 - I, Z_0 = I.

    Near the manifold S = I + E and Z = I + F with E, F small (~ the step's lr^2); the iteration
    runs on F, so that every product is one of small matrices and rounds relative to them
    (products of Z and S themselves leave ~1e-6 in Z S Z - I at q = 768, fp32):
        F_1 = -E / 2;   H = Z^2 - I = 2 F + F^2,  R = E + H + E H,  F <- F - R / 2 - F R / 2."""
    E = S - kept_eye(S.size(-1), S)
    F = -0.5 * E
    for _ in range(steps - 1):
        H = ops.sym_product(F, alpha=1.0, C=F, beta=2.0)   # F F^T + 2 F = 2 F + F^2 (F symmetric)
        R = ops.matmul_add(E, H, E + H)                     # E + H + E H
        F = ops.matmul_add(F, R, F - 0.5 * R, alpha=-0.5)   # F - R / 2 - F R / 2
    return ops.matmul_add(F, X, X)                          # X + F X
