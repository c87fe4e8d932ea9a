"""The plain reference (manifolds/reference.py) against the certified float64 optimum, and the
fast path (manifolds.steepest_direction, ManifoldMuon) against the reference."""
import pytest
import torch

from manifolds import ManifoldMuon, manifold_violation, steepest_direction
from manifolds.optimum import optimum, random_point
from manifolds.reference import (manifold_muon_step_reference, msign, retract, steepest_direction_reference,
                                 tangent_projection, tangent_residual)


def value(G, A):
    """<G/|G|_F, A> / ||A||_op in float64."""
    G, A = G.double(), A.double()
    return float((G / G.norm() * A).sum() / torch.linalg.matrix_norm(A, ord=2))


def tall(M):
    return M.mT if M.size(-2) < M.size(-1) else M


@pytest.mark.parametrize("manifold", ["stiefel", "dgram", "oblique", "none"])
def test_tangent_projection_is_the_euclidean_projection(manifold):
    # Proj_T(A) is tangent, Proj_T is idempotent, and A - Proj_T(A) is orthogonal to the tangent space
    g = torch.Generator().manual_seed(0)
    W = retract(torch.randn(40, 12, generator=g, dtype=torch.float64), manifold)
    A, B = torch.randn(2, 40, 12, generator=g, dtype=torch.float64)
    TA, TB = tangent_projection(W, A, manifold), tangent_projection(W, B, manifold)
    assert tangent_residual(W, TA, manifold) < 1e-14
    assert torch.allclose(tangent_projection(W, TA, manifold), TA, atol=1e-12)
    assert abs(float(((A - TA) * TB).sum())) < 1e-10 * float(A.norm() * TB.norm())


@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
def test_retraction_is_onto_the_manifold_and_fixes_its_points(manifold):
    g = torch.Generator().manual_seed(1)
    X = torch.randn(40, 12, generator=g, dtype=torch.float64) * torch.linspace(0.5, 2, 12, dtype=torch.float64)
    W = retract(X, manifold)
    assert manifold_violation(W, manifold) < 1e-12
    assert torch.allclose(retract(W, manifold), W, atol=1e-12)
    if manifold == "dgram":  # R keeps each column's norm
        assert torch.allclose(W.norm(dim=0), X.norm(dim=0), atol=1e-12)


@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
@pytest.mark.parametrize("shape", [(24, 8), (8, 24), (16, 16)])
def test_reference_reaches_the_certified_optimum(manifold, shape):
    W, G = random_point(shape, manifold, seed=2)
    opt, upper = optimum(W, G, manifold)
    assert upper - opt <= 1e-6 * upper  # the optimum is certified
    A, residual = steepest_direction_reference(W, G, manifold)
    assert A.shape == G.shape and A.dtype == G.dtype
    assert abs(value(G, A) - opt) <= 1e-3 * opt
    assert residual < 1e-6
    assert torch.linalg.matrix_norm(A.double(), ord=2) <= 1 + 1e-5


def test_square_stiefel_reference_matches_the_closed_form():
    # the tangent space at a square orthogonal W is {W S : S skew}, so A* = W msign(skew(W^T G))
    W, G = random_point((16, 16), "stiefel", seed=3)
    W, G = W.double(), G.double()
    closed = W @ msign((W.mT @ G - G.mT @ W) / 2)
    A, _ = steepest_direction_reference(W, G, "stiefel")
    assert abs(value(G, A) - value(G, closed)) <= 1e-6 * value(G, closed)


SHAPES = [(64, 16), (16, 64), (48, 32), (32, 32)]


@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
@pytest.mark.parametrize("shape", SHAPES)
def test_steepest_direction_reaches_the_reference(manifold, shape):
    W, G = random_point(shape, manifold, seed=4)
    reference, _ = steepest_direction_reference(W, G, manifold, iterations=300)
    A = steepest_direction(W, G, manifold)
    assert A.shape == G.shape and A.dtype == torch.float32
    assert value(G, A) >= 0.99 * value(G, reference)
    assert tangent_residual(tall(W).double(), tall(A).double(), manifold) < 1e-4


# The fast path's ||A||_op overshoots 1 + 1e-3 on near-square shapes (1.0014 Stiefel, 1.0011 DGram
# at 48 x 32 here; up to 1.0035 on other seeds): its norm is a power-iteration estimate. Strict, so
# that a fix shows up as a failure to remove the mark.
OVERSHOOT = pytest.mark.xfail(strict=True, reason="fast path ||A||_op above 1 + 1e-3 on near-square shapes")


@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
@pytest.mark.parametrize("shape", [pytest.param(s, marks=OVERSHOOT) if s == (48, 32) else s for s in SHAPES])
def test_steepest_direction_has_unit_spectral_norm(manifold, shape):
    W, G = random_point(shape, manifold, seed=4)
    assert torch.linalg.matrix_norm(steepest_direction(W, G, manifold).double(), ord=2) <= 1 + 1e-3


def test_manifold_muon_step_matches_the_reference_step():
    # One step from a fresh state (the Nesterov momentum (1 + mu) g has g's direction), compared
    # relative to the step W_new - W (about 5% of W at lr 0.05). The shapes are ones whose optimum
    # is sharp: near-square ones have directions 10% apart that all reach 0.998 of the optimum,
    # which the direction test above covers.
    lr = 0.05
    shapes = {"stiefel": [(64, 16), (32, 32)], "dgram": [(64, 16), (16, 64)]}
    problems = {m: [random_point(shape, m, seed=5 + i) for i, shape in enumerate(s)] for m, s in shapes.items()}
    params = {m: [torch.nn.Parameter(W.clone()) for W, _ in pairs] for m, pairs in problems.items()}
    opt = ManifoldMuon([{"params": params[m], "manifold": m} for m in problems], lr=lr)
    for m, pairs in problems.items():
        for p, (_, G) in zip(params[m], pairs):
            p.grad = G.clone()
    opt.step()
    for m, pairs in problems.items():
        for p, (W, G) in zip(params[m], pairs):
            expected = manifold_muon_step_reference(W, G, m, lr, iterations=300)
            new = p.detach()
            assert manifold_violation(new, m) < 1e-5 and manifold_violation(expected, m) < 1e-5
            assert (new - expected).norm() <= 1e-2 * (expected - W).norm(), (m, tuple(W.shape))
