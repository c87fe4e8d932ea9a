"""scheme=newton (manifolds/newton.py): the damped Newton update of the multiplier in q x q."""
import pytest
import torch

import manifolds.newton as newton
from bench.op_count import HostReads
from bench.optimizer import momentum_like
from manifolds import ManifoldMuon, manifold_violation, project_to_manifold, steepest_direction
from manifolds.solver import solve_tall
from manifolds.geometry import geometry
from manifolds.newton import GramModel, inverse_sqrt, inverse_sqrt_jvp, jacobian_product
from manifolds.optimum import optimum, quality
from manifolds.plan import SolverOptions, plan_for

MANIFOLDS = ("stiefel", "dgram", "oblique")


def point(p, q, manifold, seed, dtype=torch.float32, spread=0.3):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(p, q, generator=g, dtype=torch.float64)
    W = W * torch.exp(spread * torch.randn(q, generator=g, dtype=torch.float64))
    return project_to_manifold(W, manifold).to(dtype), g


def drifting(p, q, g, steps, decay=1.0):
    """Momentum-like gradients drifting from step to step (bench.solver_quality's cases)."""
    G = momentum_like((p, q), g, decay)
    out = []
    for _ in range(steps):
        G = 0.9 * G + 0.1 * momentum_like((p, q), g, decay)
        out.append(G)
    return out


def gram_model(W, G, manifold):
    geo = geometry(manifold)
    Wg = None if geo.orthogonal_columns else W.mT @ W
    return GramModel(W.mT @ G, G.mT @ G, geo.squared_norms(W), geo.gram_projector, Wg), geo


def symmetric_in_range(geo, q, g):
    V = torch.randn(q, q, generator=g, dtype=torch.float64)
    return geo.gram_projector(V + V.mT)


@pytest.mark.parametrize("manifold", MANIFOLDS)
def test_jacobian_matches_finite_differences(manifold):
    # F(Lambda) = P(K N + N K^T) with N = Y^(-1/2) by the polar iteration on the Gram; J V from
    # jacobian_product (dK N and the K dN term) against central differences, float64
    p, q = 24, 8
    W, g = point(p, q, manifold, 0, torch.float64)
    G = torch.randn(p, q, generator=g, dtype=torch.float64)
    G = G / G.norm()
    model, geo = gram_model(W, G, manifold)
    Lam = 0.05 * symmetric_in_range(geo, q, g) - 0.25 * geo.gram_projector(model.S + model.S.mT) / model.pair
    V = symmetric_in_range(geo, q, g)
    Y = model.gram(Lam)
    # the Gram is X^T X, W^T X is K
    X = G + 2 * W @ Lam
    assert torch.allclose(Y, X.mT @ X, atol=1e-12) and torch.allclose(model.cross(Lam), W.mT @ X, atol=1e-12)
    scale = torch.linalg.matrix_norm(Y)[None, None]  # f held fixed, as the derivative holds it
    N, cache = inverse_sqrt(Y, scale=scale)
    lam, Qv = torch.linalg.eigh(Y)
    assert torch.allclose(N, (Qv * lam.rsqrt()) @ Qv.mT, rtol=1e-6, atol=1e-6 * float(N.norm()))

    def F(L):
        return model.residual(model.cross(L), inverse_sqrt(model.gram(L), scale=scale)[0])

    h = 1e-6
    fd = (F(Lam + h * V) - F(Lam - h * V)) / (2 * h)
    jv = jacobian_product(model, model.cross(Lam), N, cache, V)
    assert float((jv - fd).norm() / fd.norm()) < 1e-6
    dY = symmetric_in_range(geometry("stiefel"), q, g)
    fd = (inverse_sqrt(Y + h * dY, scale=scale)[0] - inverse_sqrt(Y - h * dY, scale=scale)[0]) / (2 * h)
    assert float((inverse_sqrt_jvp(dY, cache) - fd).norm() / fd.norm()) < 1e-6
    # J is the Hessian of the convex ||G + 2 W Lambda||_*: symmetric, positive
    U = symmetric_in_range(geo, q, g)
    JU = jacobian_product(model, model.cross(Lam), N, cache, U)
    assert abs(float((jv * U).sum() - (JU * V).sum())) < 1e-6 * float(jv.norm() * U.norm())
    assert float((jv * V).sum()) > 0


def newton_plan():
    return plan_for(SolverOptions(scheme="newton", capturable=True), "cpu")


@pytest.mark.parametrize("manifold", MANIFOLDS)
def test_warm_and_cold_directions_reach_the_optimum(manifold):
    # a drifting momentum sequence: the step carried from the previous step's multiplier (warm), and
    # steepest_direction's one-shot solve (cold), each >= 0.99 of the float64 optimum (fp32)
    p, q = 48, 16
    W, g = point(p, q, manifold, 1)
    Gs = drifting(p, q, g, 3)
    geo, plan, state = geometry(manifold), newton_plan(), None
    for G in Gs:
        solution = solve_tall(W[None], G[None], geo, state, plan)
        state = solution.warm_start
    opt, upper = optimum(W, Gs[-1], manifold, in_span=manifold != "oblique")
    assert (upper - opt) / upper < 1e-6
    warm = quality(W, Gs[-1], solution.A[0], opt)
    cold = quality(W, Gs[-1], steepest_direction(W, Gs[-1], manifold, scheme="newton"), opt)
    assert warm >= 0.99 and cold >= 0.99, (warm, cold)
    # the answer is tangent and of unit spectral norm (finalize_banks)
    A = solution.A[0].double()
    assert float(geo.tangent_residual(W.double(), A).abs().max()) < 1e-5
    assert 0.998 < float(torch.linalg.matrix_norm(A, ord=2)) <= 1 + 1e-5


def test_damping_carries_a_nearly_low_rank_momentum():
    # singular values ~ i^-2 (bench.solver_quality's decay 2: X's spectrum spans three decades):
    # undamped Newton steps (mu = 0, full steps) leave the region where the quadratic model holds
    # and end far from the optimum; the damped ones reach it
    p, q = 48, 16
    W, g = point(p, q, "dgram", 2)
    G = drifting(p, q, g, 1, decay=2.0)[0]
    opt, _ = optimum(W, G, "dgram", in_span=True)
    damped = quality(W, G, steepest_direction(W, G, "dgram", scheme="newton"), opt)
    saved = newton.DAMPING, newton.STEP_DAMPING
    try:
        newton.DAMPING, newton.STEP_DAMPING = 0.0, 0.0
        undamped = quality(W, G, steepest_direction(W, G, "dgram", scheme="newton"), opt)
    finally:
        newton.DAMPING, newton.STEP_DAMPING = saved
    assert damped >= 0.99 and not undamped >= 0.95, (damped, undamped)


def groups(d=16, seed=0):
    torch.manual_seed(seed)
    shapes = {"stiefel": [(3 * d, d)], "dgram": [(4 * d, d), (d, 4 * d)], "oblique": [(2 * d, d)]}
    return [{"params": [torch.nn.Parameter(project_to_manifold(torch.randn(s) * 0.05, manifold)) for s in ss],
             "manifold": manifold} for manifold, ss in shapes.items()]


def test_steps_stay_on_the_manifold_and_read_nothing_on_the_host():
    gs = groups()
    params = [p for group in gs for p in group["params"]]
    opt = ManifoldMuon(gs, lr=0.05, scheme="newton", capturable=True)
    g = torch.Generator().manual_seed(3)
    reads = HostReads()
    for step in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) + (p.grad if p.grad is not None else 0)
        if step == 2:
            with reads:
                opt.step()
        else:
            opt.step()
        for group in gs:
            for p in group["params"]:
                assert manifold_violation(p.detach(), group["manifold"]) < 1e-6
    assert reads.count == 0


def test_jacobian_products_run_at_tf32_under_a_tf32_plan_and_still_reach_the_optimum():
    # a GPU's default plan (precision tf32): the CG's Jacobian products read TF32 operands (emulated
    # here by kernels.precision's rounding; a quarter of IEEE fp32's time in bench.cost_model), while
    # F, N and the answer stay fp32: the step is inexact Newton and still reaches the optimum
    from bench.op_count import OpCounter, triton_attribution
    p, q = 48, 16
    W, g = point(p, q, "dgram", 4)
    Gs = drifting(p, q, g, 3)
    geo = geometry("dgram")
    plan = plan_for(SolverOptions(scheme="newton", capturable=True, precision="tf32"), "cpu")
    state = None
    for G in Gs[:-1]:
        state = solve_tall(W[None], G[None], geo, state, plan).warm_start
    counter = OpCounter()
    with counter, triton_attribution(counter):
        solution = solve_tall(W[None], Gs[-1][None], geo, state, plan)
    tf32 = sum(f for label, f in counter.flops.items() if "tf32" in label and "x3" not in label)
    assert tf32 > 0.5 * sum(counter.flops.values()), dict(counter.flops)
    opt, _ = optimum(W, Gs[-1], "dgram", in_span=True)
    warm = quality(W, Gs[-1], solution.A[0], opt)
    cold = quality(W, Gs[-1], steepest_direction(W, Gs[-1], "dgram", scheme="newton", precision="tf32"), opt)
    assert warm >= 0.99 and cold >= 0.99, (warm, cold)


def test_the_run_log_names_the_scheme_that_runs():
    """SolverPlan.summary(), the trainer's "solver on ..." line: each scheme states its own settings
    (a newton run's log once described ADMM's budget, the else branch of a two-way choice)."""
    from manifolds.plan import SolverOptions, plan_for
    lines = {scheme: plan_for(SolverOptions(scheme=scheme), "cpu").summary() for scheme in ("online", "admm", "newton")}
    assert "online dual:" in lines["online"] and "ADMM" not in lines["online"]
    assert "ADMM 3 warm" in lines["admm"]
    assert "newton: 2 damped Newton steps" in lines["newton"] and "ADMM" not in lines["newton"]
