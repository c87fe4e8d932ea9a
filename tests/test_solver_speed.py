"""The optimizer's cheap paths against independent references: the 2q x q span reduction, the
eigh and polynomial spectral clips, and the warm-started ADMM."""
import pytest
import torch

from manifolds.solver import admm_iterations, solve_tall, spectral_clip
from manifolds.geometry import geometry
from manifolds.optimum import optimum, quality, random_point
from manifolds.plan import SolverOptions, plan_for
from manifolds.span import StackedSpans


def cpu_plan(**options):
    return plan_for(SolverOptions(**{"scheme": "admm", **options}), "cpu")


def one_span(W, G, geo):
    """StackedSpans of one matrix (a batch of 1)."""
    return StackedSpans([(W[None], G[None], geo, geo.squared_norms(W[None]))])


def lift(span, x):
    """The lifted matrices of span's only bank, and whether each lift is precise."""
    return span.lift(x)[0]


def momentum_sequence(W, seed, steps=4, rank_decay=1.0):
    """Gradients with a power-law spectrum drifting slowly, like a momentum buffer."""
    g = torch.Generator().manual_seed(seed)
    p, q = W.shape
    U = torch.linalg.qr(torch.randn(p, q, generator=g))[0]
    V = torch.linalg.qr(torch.randn(q, q, generator=g))[0]
    base = (U * torch.arange(1, q + 1) ** -rank_decay) @ V.T
    return [base + 0.05 * torch.randn(p, q, generator=g) / q ** 0.5 for _ in range(steps)]


@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
def test_span_reduction_is_an_isometry_onto_span_w_g(manifold):
    W, G = random_point((96, 24), manifold, seed=1)
    geo = geometry(manifold)
    span = one_span(W, G, geo)
    assert bool(span.valid.all())
    # the reduced W is [D; 0] with D the column norms, and the lift maps it and G back
    d = W.norm(dim=0)
    assert torch.allclose(span.W[0, :24], torch.diag(d), atol=1e-5)
    assert span.W[0, 24:].abs().max() == 0
    lifted_W, precise_W = lift(span, span.W)
    lifted_G, precise_G = lift(span, span.G)
    assert bool(precise_W.all()) and bool(precise_G.all())
    assert torch.allclose(lifted_W[0], W, atol=1e-5)
    assert torch.allclose(lifted_G[0], G, atol=1e-5)
    # inner products are kept: X^T Y of lifted coordinates equals x^T y
    x, y = torch.randn(2, 1, 48, 24).unbind(0)
    (X, precise_X), (Y, precise_Y) = lift(span, x), lift(span, y)
    assert bool(precise_X.all()) and bool(precise_Y.all())  # else Proj_T(G) would stand in for them
    assert torch.allclose(X.mT @ Y, x.mT @ y, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
def test_span_projection_equals_the_full_tangent_projection(manifold):
    W, G = random_point((96, 24), manifold, seed=2)
    geo = geometry(manifold)
    span = one_span(W, G, geo)
    x = torch.randn(1, 48, 24)
    X, _ = lift(span, x)
    full = geo.tangent_projection(W[None], X)
    reduced, _ = lift(span, span.project(x))
    assert torch.allclose(reduced, full, atol=1e-4)


@pytest.mark.parametrize("clip", ["eigh", "polynomial"])
def test_spectral_clip_matches_the_svd(clip):
    g = torch.Generator().manual_seed(3)
    U = torch.linalg.qr(torch.randn(3, 64, 32, generator=g, dtype=torch.float64))[0]
    V = torch.linalg.qr(torch.randn(3, 32, 32, generator=g, dtype=torch.float64))[0]
    s = torch.linspace(0.05, 3.0, 32, dtype=torch.float64)  # half below 1, half clipped
    Y = (U * s) @ V.mT
    exact = (U * s.clamp_max(1.0)) @ V.mT
    clipped = spectral_clip(Y.float(), cpu_plan(clip=clip)).double()  # fp32 iterations on a CPU
    tolerance = 1e-4 if clip == "eigh" else 3e-2  # the polynomial clip is approximate near 1
    assert (clipped - exact).abs().max() < tolerance
    # the polynomial clip's minimax signs converge to fp32 over the range they are built for:
    # every clipped singular value away from 1 and from the range's bottom is exact (Polar
    # Express's 5 + 2 steps would leave errors up to 1.4e-3 here)
    per_direction = torch.diagonal(U.mT @ clipped @ V, dim1=-2, dim2=-1)  # u_i^T clip(Y) v_i
    kept = ((s - 1).abs() > 0.1) & (s > 0.2)
    assert (per_direction - s.clamp_max(1.0)).abs()[:, kept].max() < 1e-5


def test_unknown_clip_is_rejected():
    with pytest.raises(ValueError, match="unknown clip"):
        SolverOptions(clip="svd")


@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
def test_warm_start_from_the_optimal_multiplier_is_near_optimal_at_once(manifold):
    # A long cold solve returns the correction Lambda* - Lambda0; restarting from it, one
    # ADMM iteration must already give the optimum. Wrong units or signs of the stored
    # multiplier (or a basis-dependent one) make this first iterate poor. (No pullbacks: they
    # would lift the cold iterate as well, and they do not read the multiplier.)
    W, _ = random_point((96, 24), manifold, seed=4)
    G = momentum_sequence(W, seed=4)[0]
    opt, _ = optimum(W, G, manifold, iters=1500)
    geo = geometry(manifold)
    converged = solve_tall(W[None], G[None], geo, None, cpu_plan(iterations=60, tol=0))
    assert converged.warm_start.shape == (1, 24, 24)
    one_iteration = cpu_plan(iterations=1, pullbacks=0, tol=0)
    one = solve_tall(W[None], G[None], geo, converged.warm_start, one_iteration)
    cold_one = solve_tall(W[None], G[None], geo, None, one_iteration)
    assert quality(W, G, one.A[0], opt) >= 0.999
    assert quality(W, G, one.A[0], opt) > quality(W, G, cold_one.A[0], opt) + 0.01


@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
def test_warm_started_defaults_reach_one_percent_of_the_optimum(manifold):
    # the default warm budget (3 iterations and 2 pullbacks) is chosen for >= 0.99 of the optimum
    W, _ = random_point((128, 32), manifold, seed=5)
    state = None
    for G in momentum_sequence(W, seed=5):
        solution = solve_tall(W[None], G[None], geometry(manifold), state, cpu_plan())
        state = solution.warm_start
    opt, _ = optimum(W, G, manifold, iters=1500)
    assert quality(W, G, solution.A[0], opt) >= 0.99
    H = geometry(manifold).tangent_residual(W.double(), solution.A[0].double())
    assert H.square().mean().sqrt() / W.double().norm(dim=0).mean() <= 2e-3


def test_reduced_and_full_admm_agree():
    # the same iteration on the 2q x q reduced problem and on the p x q matrices
    W, G = random_point((96, 24), "dgram", seed=6)
    geo = geometry("dgram")
    plan = cpu_plan(iterations=5, tol=0)
    G = G / G.norm()
    span = one_span(W, G, geo)
    B_reduced, corr_reduced, _, _ = admm_iterations(span.W, span.G, geo, None, plan, span.d2, span.project)
    B_full, corr_full, _, _ = admm_iterations(W[None], G[None], geo, None, plan, geo.squared_norms(W[None]))
    lifted, precise = lift(span, B_reduced)
    assert bool(precise.all())
    assert torch.allclose(lifted, B_full, atol=2e-4)
    assert torch.allclose(corr_reduced, corr_full, atol=2e-4)


@pytest.mark.parametrize("clip", ["eigh", "polynomial"])
def test_pull_back_lowers_the_singular_values_above_one_and_keeps_the_rest(clip):
    # polynomial: s -> s (3 - s^2) / 2 above 1 (a Newton-Schulz step on the excess), s below 1
    # unchanged; eigh: the exact clip min(s, 1). Directions away from 1 are checked one by one.
    from manifolds.solver import pull_back
    g = torch.Generator().manual_seed(7)
    U = torch.linalg.qr(torch.randn(2, 64, 32, generator=g, dtype=torch.float64))[0]
    V = torch.linalg.qr(torch.randn(2, 32, 32, generator=g, dtype=torch.float64))[0]
    s = torch.linspace(0.05, 1.25, 32, dtype=torch.float64)
    B = pull_back(((U * s) @ V.mT).float(), cpu_plan(clip=clip)).double()
    expected = s.clamp_max(1.0) if clip == "eigh" else torch.where(s > 1, s * (3 - s.square()) / 2, s)
    per_direction = torch.diagonal(U.mT @ B @ V, dim1=-2, dim2=-1)  # u_i^T pull_back(B) v_i
    assert ((U * expected) @ V.mT - B).abs().max() < 3e-3  # near 1 the sign of s^2 - 1 is unsure, and matters little
    away = (s - 1).abs() > 0.05
    assert (per_direction - expected).abs()[:, away].max() < 1e-4
    assert torch.linalg.matrix_norm(B, ord=2).max() <= 1 + 1e-4


@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
def test_pullbacks_bring_the_answer_closer_and_leave_the_warm_start(manifold):
    # the rounds act on the answer only: the correction handed to the next step is the same
    W, _ = random_point((128, 32), manifold, seed=8)
    Gs = momentum_sequence(W, seed=8)
    opt, _ = optimum(W, Gs[-1], manifold, iters=1500)
    results = {}
    for rounds in (0, 2):
        plan = cpu_plan(iterations=3, pullbacks=rounds, tol=0, capturable=True, clip="polynomial")
        state = None
        for G in Gs:
            solution = solve_tall(W[None], G[None], geometry(manifold), state, plan)
            state = solution.warm_start
        results[rounds] = (quality(W, Gs[-1], solution.A[0], opt), solution)
    (plain, without), (pulled, with_rounds) = results[0], results[2]
    assert 1 - pulled < 0.5 * (1 - plain), (plain, pulled)  # here 0.2 and 0.38 of the gap remain
    torch.testing.assert_close(with_rounds.warm_start, without.warm_start, rtol=0, atol=0)
    H = geometry(manifold).tangent_residual(W.double(), with_rounds.A[0].double())
    assert H.square().mean().sqrt() / W.double().norm(dim=0).mean() <= 1e-5
