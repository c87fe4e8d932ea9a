"""Welch's two-sample t-test, the paired t-test and the Student t distribution, in plain Python
(no scipy).

The t distribution's CDF is written through the regularized incomplete beta function
I_x(a, b), evaluated by its continued fraction (modified Lentz's method); quantiles are found by
bisection on the CDF. Degrees of freedom need not be whole numbers (Welch's are not).
"""
import math
import statistics

TINY = 1e-300  # stands in for a zero denominator in Lentz's method
EPS = 1e-15    # relative change at which the continued fraction has converged
MAX_TERMS = 10_000


def betainc(a, b, x):
    """The regularized incomplete beta function I_x(a, b) = B(x; a, b) / B(a, b), for a, b > 0.

    I_x(a, b) = x^a (1-x)^b / (a B(a, b)) * 1 / (1 + d1 / (1 + d2 / (1 + ...))) with
        d_{2m+1} = -(a + m)(a + b + m) x / ((a + 2m)(a + 2m + 1)),
        d_{2m}   =  m (b - m) x / ((a + 2m - 1)(a + 2m)).
    The fraction converges fast for x < (a + 1) / (a + b + 2); above that, use the symmetry
    I_x(a, b) = 1 - I_{1-x}(b, a).
    """
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"betainc: x = {x} is outside [0, 1]")
    if x == 0.0 or x == 1.0:
        return x
    if x > (a + 1.0) / (a + b + 2.0):
        return 1.0 - betainc(b, a, 1.0 - x)
    # log of x^a (1-x)^b / (a B(a, b)), with B(a, b) = Γ(a) Γ(b) / Γ(a + b)
    log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                 + a * math.log(x) + b * math.log1p(-x) - math.log(a))
    return math.exp(log_front) * beta_fraction(a, b, x)


def beta_term(k, a, b, x):
    """d_k of the continued fraction in betainc (k >= 1)."""
    m = k // 2
    if k % 2:  # odd: k = 2m + 1
        return -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
    return m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))


def beta_fraction(a, b, x):
    """1 / (1 + d1 / (1 + d2 / (1 + ...))) by the modified Lentz method.

    Lentz evaluates f = b0 + a1 / (b1 + a2 / (b2 + ...)) front to back: with C_0 = f_0 = b0 and
    D_0 = 0, each term j updates D_j = 1 / (b_j + a_j D_{j-1}), C_j = b_j + a_j / C_{j-1} and
    f_j = f_{j-1} C_j D_j, stopping when C_j D_j is 1 to within EPS. A zero b0, C or D is replaced
    by TINY. Here b0 = 0, a1 = 1, a_{j+1} = d_j and every b_j = 1.
    """
    f = c = TINY
    d = 0.0
    for j in range(1, MAX_TERMS):
        numerator = 1.0 if j == 1 else beta_term(j - 1, a, b, x)
        d = 1.0 + numerator * d
        d = 1.0 / (d if abs(d) > TINY else TINY)
        c = 1.0 + numerator / c
        c = c if abs(c) > TINY else TINY
        f *= c * d
        if abs(c * d - 1.0) < EPS:
            return f
    raise ArithmeticError(f"betainc({a}, {b}, {x}): the continued fraction did not converge")


def t_cdf(t, df):
    """P(T <= t) for Student's t with df > 0 degrees of freedom.

    With x = df / (df + t^2), P(|T| > |t|) = I_x(df/2, 1/2); the distribution is symmetric, so
    P(T <= t) = 1 - I_x / 2 for t >= 0 and I_x / 2 for t < 0.
    """
    if df <= 0:
        raise ValueError(f"t_cdf: df = {df} must be positive")
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_two_sided_p(t, df):
    """P(|T| >= |t|): computed from the tail directly, so tiny p-values keep their digits."""
    if math.isinf(t):
        return 0.0
    return betainc(df / 2.0, 0.5, df / (df + t * t))


def t_quantile(p, df):
    """The t with P(T <= t) = p (0 < p < 1), by bisection on t_cdf (monotone, so it cannot miss)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"t_quantile: p = {p} must be in (0, 1)")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:  # bracket: the upper end doubles until it is past the quantile
        lo, hi = hi, 2.0 * hi
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):  # no double in between: converged
            break
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


class TTest:
    """What both tests report: diff, se, t, df, the two-sided p and a `level` confidence interval
    diff ± t_quantile(1 - (1 - level)/2, df) se; or `problem` (why there is no test), every
    number then NaN."""

    def __init__(self, level):
        self.level = level
        self.diff = self.se = self.t = self.df = self.p = self.low = self.high = math.nan
        self.problem = None

    def conclude(self, diff, se, df):
        self.diff, self.se, self.df = diff, se, df
        self.t = diff / se
        self.p = t_two_sided_p(self.t, df)
        half = t_quantile(1.0 - (1.0 - self.level) / 2.0, df) * se
        self.low, self.high = diff - half, diff + half


class Welch(TTest):
    """Welch's t-test of mean(a) - mean(b) (unequal variances), two-sided, with a confidence interval.

    se = sqrt(s_a^2/n_a + s_b^2/n_b), t = (mean_a - mean_b) / se, and the Welch–Satterthwaite
    degrees of freedom df = se^4 / ((s_a^2/n_a)^2/(n_a-1) + (s_b^2/n_b)^2/(n_b-1)).
    Needs at least 2 values each and some spread (se > 0).
    """

    def __init__(self, a, b, level=0.95):
        super().__init__(level)
        self.n_a, self.n_b = len(a), len(b)
        if min(self.n_a, self.n_b) < 2:
            self.problem = f"needs at least 2 runs each (n = {self.n_a} and {self.n_b})"
            return
        self.diff = statistics.fmean(a) - statistics.fmean(b)
        va, vb = statistics.variance(a) / self.n_a, statistics.variance(b) / self.n_b
        if va + vb == 0:
            self.problem = "no spread in either group (every run the same): no test"
            return
        df = (va + vb) ** 2 / (va ** 2 / (self.n_a - 1) + vb ** 2 / (self.n_b - 1))
        self.conclude(self.diff, math.sqrt(va + vb), df)


class Paired(TTest):
    """The paired t-test of mean(a_i - b_i) over matched pairs (a_i, b_i), two-sided.

    With d_i = a_i - b_i: se = sd(d) / sqrt(n), t = mean(d) / se, df = n - 1. Pairs that share
    what makes runs differ (here: the seed, i.e. initialisation and data order) cancel it in
    d_i, so this test is tighter than Welch's when that shared part is large. Needs at least 2
    pairs and differences that are not all equal.
    """

    def __init__(self, a, b, level=0.95):
        super().__init__(level)
        if len(a) != len(b):
            raise ValueError(f"Paired: {len(a)} values against {len(b)}; pairs need one each")
        d = [x - y for x, y in zip(a, b)]
        self.n = len(d)
        if self.n < 2:
            self.problem = f"needs at least 2 pairs (n = {self.n})"
            return
        self.diff = statistics.fmean(d)
        sd = statistics.stdev(d)
        if sd == 0:
            self.problem = "every pair differs by the same amount: no test"
            return
        self.conclude(self.diff, sd / math.sqrt(self.n), self.n - 1)
