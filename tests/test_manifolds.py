"""Geometry, steepest direction and optimizer properties of manifolds/."""
import math

import pytest
import torch

from manifolds import ManifoldMuon, manifold_violation, project_to_manifold, steepest_direction
from manifolds.solver import SolverOptions, solve_tall
from manifolds.geometry import MANIFOLDS, geometry
from manifolds.plan import plan_for
from manifolds.optimum import optimum, quality, random_point

SHAPES = {"tall": (48, 16), "wide": (16, 48), "square": (40, 40)}


# every registered manifold that constrains (the registry, not a list of names)
CONSTRAINED = sorted(name for name, manifold in MANIFOLDS.items() if manifold.constrained)


# --- projection, violation, retraction --------------------------------------------------

@pytest.mark.parametrize("manifold", CONSTRAINED)
@pytest.mark.parametrize("shape", [(64, 16), (16, 64), (32, 32), (3, 40, 10)])
def test_projection_lands_on_manifold(manifold, shape):
    W = torch.randn(shape) * 0.02
    P = project_to_manifold(W, manifold)
    assert P.shape == W.shape
    assert manifold_violation(P, manifold) <= 1e-5
    if manifold == "hyperball":  # the sphere through W: the start is on it, its radius kept
        assert torch.equal(P, W)
    else:
        assert manifold_violation(W, manifold) > 1e-2  # the random start was not on it


def test_stiefel_projection_is_the_polar_factor():
    W = torch.randn(40, 12, dtype=torch.float64)
    U, _, Vh = torch.linalg.svd(W, full_matrices=False)
    assert torch.allclose(project_to_manifold(W, "stiefel"), U @ Vh, atol=1e-10)


def test_dgram_projection_keeps_column_norms_and_is_a_fixed_point():
    W = torch.randn(50, 10, dtype=torch.float64) * torch.linspace(0.1, 3.0, 10)
    P = project_to_manifold(W, "dgram")
    # R(X) = msign(X N^-1) N keeps every column norm ...
    assert torch.allclose(P.norm(dim=0), W.norm(dim=0), rtol=1e-10)
    # ... and leaves points of the manifold where they are (a true retraction).
    assert torch.allclose(project_to_manifold(P, "dgram"), P, atol=1e-10)
    # The singular values of a DGram point are its column norms (in their own order).
    sv = torch.linalg.svdvals(P)
    assert torch.allclose(sv, P.norm(dim=0).sort(descending=True).values, rtol=1e-10)


def test_sorted_singular_value_map_is_not_a_retraction():
    # The published "U V^T diag(sorted singular values)" moves points already on DGram; ours does not.
    # column norms not in decreasing order: the sorted map permutes them
    W = project_to_manifold(torch.randn(30, 6, dtype=torch.float64) * torch.linspace(0.5, 2, 6), "dgram")
    U, S, Vh = torch.linalg.svd(W, full_matrices=False)
    published = U @ Vh @ torch.diag(S)
    assert (published - W).abs().max() > 1e-2
    assert (project_to_manifold(W, "dgram") - W).abs().max() < 1e-10


@pytest.mark.parametrize("manifold", CONSTRAINED)
def test_near_retraction_reaches_fp32_accuracy(manifold):
    geo = MANIFOLDS[manifold]
    W, G = random_point((96, 32), manifold, seed=1)
    stepped = W + 0.01 * W.norm(dim=0).mean() * G / G.norm(dim=0)  # 1% of the column scale

    def off(X):  # the Hyperball's set is the sphere of W's radius: every X is on a sphere of its own
        return abs(float(X.double().norm() / W.double().norm()) - 1) if manifold == "hyperball" else geo.violation(X).max()
    assert off(stepped) > 1e-4  # the step leaves the manifold ...
    assert off(geo.retract_from(W, stepped, near=True)) <= 1e-5  # ... and R brings it back


@pytest.mark.parametrize("manifold", CONSTRAINED)
def test_tangent_projection_zeroes_the_residual(manifold):
    geo = MANIFOLDS[manifold]
    W, G = random_point((40, 10), manifold, seed=2)
    W, G = project_to_manifold(W.double(), manifold), G.double()
    T = geo.tangent_projection(W, G)
    assert geo.tangent_residual(W, G).abs().max() > 1e-2
    assert geo.tangent_residual(W, T).abs().max() < 1e-10
    # It is the Euclidean projection: idempotent, and the removed part is orthogonal to T.
    assert torch.allclose(geo.tangent_projection(W, T), T, atol=1e-10)
    assert abs(float(((G - T) * T).sum())) < 1e-10


def test_violation_definitions():
    W = torch.eye(6, 3) * 2.0
    assert manifold_violation(W, "stiefel") == pytest.approx(3.0)  # max |W^T W - I| = 4 - 1
    assert manifold_violation(W, "dgram") == 0.0  # orthogonal columns, any norms
    assert manifold_violation(torch.randn(5, 4), "none") == 0.0


# --- steepest direction against the float64 reference -----------------------------------

# cold-start quality floors: ADMM measured 0.994-1.0 on these points; the online scheme (4 dual
# steps from cold) 0.94-0.96, 0.88 on square DGram (its optimum keeps singular values below 1)
QUALITY_FLOOR = {"admm": 0.97, "online": 0.85}


@pytest.mark.parametrize("scheme", list(QUALITY_FLOOR))
@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
@pytest.mark.parametrize("orientation", list(SHAPES))
@pytest.mark.parametrize("seed", [0, 1])
def test_steepest_direction_quality(manifold, orientation, seed, scheme):
    W, G = random_point(SHAPES[orientation], manifold, seed)
    opt, upper = optimum(W, G, manifold)
    assert (upper - opt) / upper < 1e-6  # the reference is certified optimal
    A = steepest_direction(W, G, manifold, scheme=scheme)
    assert A.shape == G.shape
    assert quality(W, G, A, opt) >= QUALITY_FLOOR[scheme]
    tall_W, tall_A = (W.mT, A.mT) if orientation == "wide" else (W, A)
    H = MANIFOLDS[manifold].tangent_residual(tall_W.double(), tall_A.double())
    relative = H.square().mean().sqrt() / tall_W.double().norm(dim=0).mean()
    assert relative <= 2e-3
    assert torch.linalg.matrix_norm(A.double(), ord=2) <= 1.01


@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
def test_reference_in_span_coordinates_is_the_same_optimum(manifold):
    # The span-coordinate reference (used at GPT-2-small shapes) must agree with the full one.
    W, G = random_point((96, 16), manifold, seed=5)
    full = optimum(W, G, manifold, iters=1500)
    span = optimum(W, G, manifold, iters=1500, in_span=True)
    assert (full[1] - full[0]) / full[1] < 1e-6
    assert abs(span[0] - full[0]) < 1e-9 and abs(span[1] - full[1]) < 1e-9


def test_reference_certifies_an_ill_conditioned_momentum():
    # Momenta of a trained model have fast-decaying spectra, where ADMM at a fixed penalty stalls
    # (gap 1.2e-4 here after 1000 iterations); the reference's residual balancing must get under 1e-5.
    W, _ = random_point((64, 32), "stiefel", seed=0)
    g = torch.Generator().manual_seed(1)
    left = torch.linalg.qr(torch.randn(64, 32, generator=g, dtype=torch.float64)).Q
    right = torch.linalg.qr(torch.randn(32, 32, generator=g, dtype=torch.float64)).Q
    G = (left * torch.logspace(0, -3, 32, dtype=torch.float64)) @ right.T
    value, upper = optimum(W, G, "stiefel", iters=1000)
    assert (upper - value) / upper < 1e-5


def test_square_stiefel_direction_is_exact():
    # Tangent vectors at a square orthogonal W are W K with K skew, so A* = W msign(skew(W^T G)).
    W, G = random_point((20, 20), "stiefel", seed=3)
    W, G = W.double(), G.double()
    C = W.T @ G
    U, _, Vh = torch.linalg.svd(0.5 * (C - C.T))
    exact = W @ U @ Vh
    A = steepest_direction(W, G, "stiefel", scheme="admm").double()  # online drops the polish: 0.9993
    assert quality(W, G, A, float((G / G.norm() * exact).sum())) >= 0.9999


def test_square_dgram_hard_case_ends_tangent():
    # The dual optimum is degenerate here; ADMM's direction (on the full matrices: a square
    # matrix has no smaller span problem) must still be feasible, and near the optimum.
    W, G = random_point((32, 32), "dgram", seed=4)
    opt, _ = optimum(W, G, "dgram")
    A = steepest_direction(W, G, "dgram", scheme="admm")
    H = MANIFOLDS["dgram"].tangent_residual(W.double(), A.double())
    assert H.abs().max() < 1e-5
    assert torch.linalg.matrix_norm(A.double(), ord=2) <= 1.01
    assert quality(W, G, A, opt) >= 0.97


@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
def test_batch_equals_matrix_by_matrix(manifold):
    pairs = [random_point((36, 12), manifold, seed=s) for s in range(3)]
    W = torch.stack([w for w, _ in pairs])
    G = torch.stack([g for _, g in pairs])
    batched = steepest_direction(W, G, manifold, tol=0.0)
    for i, (w, g) in enumerate(pairs):
        single = steepest_direction(w, g, manifold, tol=0.0)
        assert torch.allclose(batched[i], single, atol=1e-5)


def test_direction_ignores_gradient_scale():
    W, G = random_point((36, 12), "dgram", seed=5)
    a = steepest_direction(W, G, "dgram", tol=0.0)
    b = steepest_direction(W, 1e-4 * G, "dgram", tol=0.0)
    assert torch.allclose(a, b, atol=1e-4)


def test_unknown_solver_option_is_rejected():
    W, G = random_point((36, 12), "stiefel", seed=6)
    with pytest.raises(TypeError, match="unknown solver options"):
        steepest_direction(W, G, "stiefel", dual_stepz=3)


def test_square_stiefel_runs_no_iterations():
    W, G = random_point((24, 24), "stiefel", seed=7)  # solved exactly by the first multiplier
    sol = solve_tall(W, G, geometry("stiefel"), None, plan_for(SolverOptions(iterations=20), "cpu"))
    assert sol.iterations == 0 and sol.warm_start is None  # nothing to iterate, no warm start to keep


def test_adaptive_exit_stops_early_when_converged():
    # A cold tall solve has a budget of 2 x iterations = 40; it converges (tol 1e-4) well before.
    # Checked every CHECK_EVERY iterations when not capturable; capturable runs the whole budget
    # with converged matrices frozen, which must give the early exit's answer.
    W, G = random_point((48, 16), "stiefel", seed=7)
    early = solve_tall(W, G, geometry("stiefel"), None,
                       plan_for(SolverOptions(scheme="admm", iterations=20, capturable=False), "cpu"))
    full = solve_tall(W, G, geometry("stiefel"), None,
                      plan_for(SolverOptions(scheme="admm", iterations=20, capturable=True), "cpu"))
    assert early.iterations < 40 and full.iterations == 40
    assert torch.equal(early.A, full.A)


# --- the optimizer ------------------------------------------------------------------------

def make_bank(manifold, shapes, seed=0):
    torch.manual_seed(seed)
    return [torch.nn.Parameter(project_to_manifold(torch.randn(s) * 0.05, manifold)
                               if manifold != "none" else torch.randn(s) * 0.05) for s in shapes]


@pytest.mark.parametrize("manifold", CONSTRAINED)
def test_parameters_stay_on_manifold_over_many_steps(manifold):
    params = make_bank(manifold, [(48, 16), (48, 16), (16, 48), (24, 24)])
    opt = ManifoldMuon([{"params": params, "manifold": manifold}], lr=0.05)
    start = [p.detach().clone() for p in params]
    for _ in range(60):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    for p, p0 in zip(params, start):
        assert manifold_violation(p.detach(), manifold) <= 1e-4
        assert (p.detach() - p0).abs().max() > 1e-2  # it did move


def test_plain_muon_update_with_weight_decay():
    p = torch.nn.Parameter(torch.randn(32, 8))
    w0 = p.detach().clone()
    g = torch.randn(32, 8)
    p.grad = g.clone()
    opt = ManifoldMuon([{"params": [p], "manifold": "none"}], lr=0.1, momentum=0.9,
                       nesterov=True, weight_decay=0.5)
    opt.step()
    # first step: buf = g, G = g + 0.9 g; update = -lr * A after decay (1 - lr * wd), A = msign(G)
    # as the field's Muon computes it: 5 Polar Express steps, no polish, so A's singular values lie
    # in Polar Express's band around 1 ([0.859, 1.141]) and its polar factor is exactly U V^T
    U, _, Vh = torch.linalg.svd(g.double(), full_matrices=False)
    A = (w0.double() * (1 - 0.1 * 0.5) - p.detach().double()) / 0.1
    Ua, Sa, Vha = torch.linalg.svd(A, full_matrices=False)
    assert torch.allclose(Ua @ Vha, U @ Vh, atol=1e-4)
    assert 0.85 <= float(Sa.min()) and float(Sa.max()) <= 1.15, Sa


def test_manifold_step_has_spectral_size_lr():
    params = make_bank("stiefel", [(64, 16)])
    w0 = params[0].detach().clone()
    params[0].grad = torch.randn(64, 16)
    ManifoldMuon([{"params": params, "manifold": "stiefel"}], lr=0.01).step()
    step = torch.linalg.matrix_norm((params[0].detach() - w0).double(), ord=2)
    assert 0.009 < float(step) < 0.0105  # lr, no shape factor (retraction changes it by O(lr^2))


def test_state_dict_resume_is_bitwise():
    def run(steps, resume_at=None):
        params = make_bank("dgram", [(48, 16), (48, 16)], seed=1)
        opt = ManifoldMuon([{"params": params, "manifold": "dgram"}], lr=0.05, iterations=4)
        gen = torch.Generator().manual_seed(2)
        for k in range(steps):
            if k == resume_at:
                saved_p = [p.detach().clone() for p in params]
                saved = opt.state_dict()
                params = [torch.nn.Parameter(s) for s in saved_p]
                opt = ManifoldMuon([{"params": params, "manifold": "dgram"}], lr=0.05, iterations=4)
                opt.load_state_dict(saved)
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        return [p.detach() for p in params]

    straight, resumed = run(6), run(6, resume_at=3)
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)


def test_group_overrides_and_validation():
    a, b = make_bank("stiefel", [(32, 8)]), make_bank("dgram", [(32, 8)])
    opt = ManifoldMuon([{"params": a, "manifold": "stiefel", "lr": 0.1},
                        {"params": b, "manifold": "dgram", "dgram_cap": 2.0}], lr=0.02)
    assert opt.param_groups[0]["lr"] == 0.1 and opt.param_groups[1]["lr"] == 0.02
    assert opt.param_groups[0]["dgram_cap"] == 1.0 and opt.param_groups[1]["dgram_cap"] == 2.0
    with pytest.raises(TypeError, match="unknown solver options"):
        ManifoldMuon([{"params": a, "manifold": "stiefel"}], admm_steps=3)  # a renamed option
    with pytest.raises(ValueError, match="unknown manifold"):
        ManifoldMuon([{"params": make_bank("none", [(4, 4)]), "manifold": "sphere"}])
    with pytest.raises(ValueError, match="matrices"):
        ManifoldMuon([{"params": [torch.nn.Parameter(torch.randn(5))], "manifold": "none"}])


def test_banks_group_same_shapes():
    params = make_bank("stiefel", [(32, 8), (32, 8), (8, 32), (16, 16)])
    opt = ManifoldMuon([{"params": params, "manifold": "stiefel"}])
    sizes = sorted(len(ps) for _, ps in opt.banks())
    assert sizes == [1, 3]  # 32 x 8 and 8 x 32: one bank, solved on the tall orientation
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert set(opt.last_stats) == {"stiefel:32x8", "stiefel:16x16"}
    assert not math.isnan(opt.stats()["stiefel:32x8"]["residual"])


@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
def test_tall_banks_survive_a_nearly_rank_deficient_momentum(manifold):
    # Momenta of low rank (seen in training: an attention matrix at lr 0.2) make span[W, G]
    # nearly singular; its coefficient arithmetic then loses all precision (it returned NaN).
    # The lift must notice, per matrix and in both modes, and return the fallback: the Euclidean
    # tangent projection of G at unit spectral norm, counted. Rank 2 takes it; rank 8 is still
    # solved precisely in span coordinates.
    geo = geometry(manifold)
    for rank, seed, fallback in [(2, 0, True), (8, 1, False)]:
        W, _ = random_point((96, 32), manifold, seed)
        g = torch.Generator().manual_seed(seed)
        G = torch.randn(96, rank, generator=g) @ torch.randn(rank, 32, generator=g)
        G = G + 1e-6 * torch.randn(96, 32, generator=g)
        opt, _ = optimum(W, G, manifold, iters=1500)
        for capturable in (False, True):
            sol = solve_tall(W[None], G[None], geo, None,
                             plan_for(SolverOptions(scheme="admm", capturable=capturable), "cpu"))
            A = sol.A[0]
            assert torch.isfinite(A).all()
            assert int(sol.fallbacks) == int(fallback)
            assert geo.tangent_residual(W.double(), A.double()).abs().max() <= 1e-4
            assert torch.linalg.matrix_norm(A.double(), ord=2) <= 1.01
            if fallback:
                T = geo.tangent_projection(W.double(), G.double())
                T = T / torch.linalg.matrix_norm(T, ord=2)
                torch.testing.assert_close(A.double(), T, rtol=0, atol=1e-5 * T.abs().max().item())
            else:
                assert quality(W, G, A, opt) >= 0.97


def test_finite_is_isfinite_and_constant_patterns_are_made_once_per_mode():
    # solver.finite: isfinite's answer in 2 launches (x * 0 == 0), -0, huge and subnormal values included
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from manifolds import solver
    x = torch.tensor([0.0, -0.0, 3e38, -3.0, float("inf"), -float("inf"), float("nan"), 1e-45])
    assert torch.equal(solver.finite(x), torch.isfinite(x))
    assert torch.equal(solver.finite(x, x.flip(0)), torch.isfinite(x) & torch.isfinite(x.flip(0)))
    # the stand-in is built once per shape (a kept tensor, the same values), and a fake tensor is
    # kept for its own fake mode only
    G = torch.randn(2, 12, 8)
    a, b = solver.stand_in(G), solver.stand_in(G)
    assert a.data_ptr() == b.data_ptr() and a.shape == G.shape
    assert torch.equal(a[1], solver.stand_in_pattern(12, 8, G.dtype, G.device))
    with FakeTensorMode() as mode:
        fake = solver.stand_in(mode.from_tensor(G))
    assert isinstance(fake, FakeTensor) and not isinstance(solver.stand_in(G), FakeTensor)
    # kernels.constants: an identity kept per size, dtype and device; under inference mode one kept
    # is read, none is stored
    from kernels.constants import eye
    assert eye(4, G).data_ptr() == eye(4, G).data_ptr() and torch.equal(eye(4, G), torch.eye(4))
    assert eye(4, G.double()).dtype == torch.float64
    with torch.inference_mode():
        assert eye(4, G).data_ptr() == eye(4, G).data_ptr()
        assert eye(5, G).data_ptr() != eye(5, G).data_ptr()
