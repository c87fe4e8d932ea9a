"""The Hyperball {W : ||W||_F = r}: a Gram projector that is not a mask (P(S) = (tr S / q) I).
Its projector and tangent projection, the solver's direction against the reference and the
certified float64 optimum (both schemes), the radius kept to 1e-6 after every step by
ManifoldMuon and by the trainer, and the reference solver training as the fast one."""
import os

import pytest
import torch

import train_gpt2
from bench.optimizer import momentum_like
from manifolds import ManifoldMuon, manifold_param_groups
from manifolds.solver import solve_tall
from manifolds.geometry import geometry
from manifolds.optimum import optimum, quality, random_point
from manifolds.plan import SolverOptions, plan_for
from manifolds.reference import steepest_direction_reference
from model import GPT, GPTConfig
from synthetic import TINY_MODEL, make_shards, train_in_process

HYPERBALL = geometry("hyperball")
SHAPES = [(64, 32), (96, 32), (32, 32), (40, 10)]


def test_the_projector_keeps_the_trace_and_the_projection_removes_the_w_component():
    g = torch.Generator().manual_seed(0)
    S, T = (torch.randn(2, 7, 7, dtype=torch.float64, generator=g) for _ in range(2))
    S, T = S + S.mT, T + T.mT
    P = HYPERBALL.gram_projector
    assert torch.allclose(P(P(S)), P(S)) and torch.allclose((P(S) * T).sum(), (S * P(T)).sum())  # self-adjoint
    assert torch.allclose(torch.diagonal(P(S), dim1=-2, dim2=-1).sum(-1), torch.diagonal(S, dim1=-2, dim2=-1).sum(-1))
    with pytest.raises(TypeError, match="not a mask"):
        HYPERBALL.gram_mask(7, "cpu")
    W, G = (torch.randn(3, 20, 7, dtype=torch.float64, generator=g) for _ in range(2))
    T = HYPERBALL.tangent_projection(W, G)
    trace = (W * G).sum(dim=(-2, -1), keepdim=True)
    assert torch.allclose(T, G - trace / W.square().sum(dim=(-2, -1), keepdim=True) * W, atol=1e-12)
    assert (W * T).sum(dim=(-2, -1)).abs().max() < 1e-12  # tr(W^T T) = 0


def trajectory(W, seed, steps=5):
    """Momentum-like gradients drifting as the optimizer sees them (the warm start's use)."""
    g = torch.Generator().manual_seed(seed)
    base = momentum_like(W.shape, g)
    return [0.9 * base + 0.1 * momentum_like(W.shape, g) for _ in range(steps)]


@pytest.fixture(scope="module")
def cases():
    """[(W, gradients, certified optimum of the last, the reference direction's quality)] of the
    tests' shapes, 2 seeds each: computed once for every scheme and precision."""
    out = []
    for shape in SHAPES:
        for seed in range(2):
            W, _ = random_point(shape, "hyperball", seed)
            Gs = trajectory(W, seed)
            best, upper = optimum(W, Gs[-1], "hyperball", tol=1e-9)
            assert (upper - best) / upper < 1e-6  # certified
            reference, _ = steepest_direction_reference(W.double(), Gs[-1].double(), "hyperball")
            out.append((W, Gs, best, quality(W, Gs[-1], reference, best)))
    return out


@pytest.mark.parametrize("scheme", ["online", "admm"])
@pytest.mark.parametrize("precision", ["fp32", "tf32"])
def test_the_direction_is_tangent_bounded_and_near_the_optimum(cases, scheme, precision):
    plan = plan_for(SolverOptions(scheme=scheme, precision=precision, clip="polynomial", capturable=True), "cpu")
    for W, Gs, best, want in cases:
        state = None
        for G in Gs:  # warm-started step after step, as in training
            solution = solve_tall(W[None], G[None], HYPERBALL, state, plan)
            state = solution.warm_start
        A = solution.A[0].double()
        W64 = W.double()
        assert abs(float((W64 * A).sum())) / float(W64.norm() * A.norm()) < 1e-5
        assert float(torch.linalg.matrix_norm(A, ord=2)) <= 1 + 1e-3
        assert want > 0.99999
        got = quality(W, G, A, best)
        # fp32: the fast path within 1e-3 of the reference (measured: online 6e-5, ADMM 4.4e-4);
        # TF32 with bf16 matrix signs: the signs' rounding (online 0.9944, ADMM 0.9967 worst)
        assert got >= want - (1e-3 if precision == "fp32" else 1e-2), (tuple(W.shape), got, want)


def test_one_rms_step_per_training_step_would_not_reach_it():
    # the manifold's facts are what reach 0.9999: without the secant steps the same solver stays
    # near 0.98 (mutation check of geo.online_steps / geo.secant_dual)
    class RmsOnly(type(HYPERBALL)):
        online_steps, secant_dual = 1, False
    plan = plan_for(SolverOptions(capturable=True, clip="polynomial"), "cpu")
    worst = {}
    for name, geo in (("hyperball", HYPERBALL), ("rms", RmsOnly())):
        values = []
        for seed in range(3):
            W, _ = random_point((64, 32), "hyperball", seed)
            state = None
            for G in trajectory(W, seed):
                solution = solve_tall(W[None], G[None], geo, state, plan)
                state = solution.warm_start
            values.append(quality(W, G, solution.A[0], optimum(W, G, "hyperball", tol=1e-10)[0]))
        worst[name] = min(values)
    assert worst["hyperball"] > 0.9999 and worst["rms"] < 0.99, worst


def linear_stack(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(24, 64, bias=False), torch.nn.Tanh(), torch.nn.Linear(64, 64, bias=False),
                               torch.nn.Tanh(), torch.nn.Linear(64, 24, bias=False))


@pytest.mark.parametrize("precision", ["fp32", "tf32"])
def test_every_step_keeps_each_matrix_on_its_initial_radius(precision):
    model = linear_stack()
    start = [layer.weight.detach().double().norm() for layer in model if isinstance(layer, torch.nn.Linear)]
    groups, _ = manifold_param_groups(model, {"*.weight": "hyperball"})
    opt = ManifoldMuon(groups, lr=0.1, precision=precision, clip="polynomial", capturable=True)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 24, generator=g), torch.randn(32, 24, generator=g)
    worst, losses = 0.0, []
    for _ in range(40):
        loss = (model(x) - y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        norms = [layer.weight.detach().double().norm() for layer in model if isinstance(layer, torch.nn.Linear)]
        worst = max(worst, max(abs(float(n / r) - 1) for n, r in zip(norms, start)))
    assert worst <= 1e-6, worst  # measured: ~1e-8 (fp32 rounding of each entry)
    assert losses[-1] < 0.8 * losses[0], losses  # it trains on the spheres


# --- through the trainer ----------------------------------------------------------------------

RUN = ["--max-steps", "30", "--warmup-steps", "5", "--lr", "3e-3", "--min-lr", "3e-4", "--muon-lr", "0.05",
       "--eval-every", "30", "--eval-tokens", "1024", "--ckpt-every", "30"]


def train(data_dir, out_dir, assign, *flags):
    losses = train_in_process(data_dir, out_dir, "--assign", assign, *RUN, *flags)
    return losses, torch.load(os.path.join(out_dir, "ckpt_00000030.pt"), weights_only=False)["model"]


def initial_model(seed=1337):
    args = train_gpt2.parse_args(TINY_MODEL)
    torch.manual_seed(seed)  # as train_gpt2.setup builds it
    return GPT(GPTConfig(args.n_layer, args.n_head, args.n_embd, args.seq_len,
                         args.vocab_size)).state_dict()


def test_the_trainer_keeps_the_radii_and_the_reference_trains_as_the_fast_solver(tmp_path):
    data = make_shards(str(tmp_path / "data"))
    fast, weights = train(data, tmp_path / "fast", "all-hyperball")
    reference, _ = train(data, tmp_path / "reference", "all-hyperball", "--solver-opt", "solver=reference")
    start = initial_model()
    for name in ("blocks.0.attn.c_attn.weight", "blocks.0.attn.c_proj.weight", "blocks.0.mlp.c_fc.weight",
                 "blocks.0.mlp.c_proj.weight"):
        assert abs(float(weights[name].double().norm() / start[name].double().norm()) - 1) <= 1e-6, name
        assert (weights[name] - start[name]).norm() > 0.1 * start[name].norm()  # it moved on its sphere
    assert fast[-1] < fast[0] - 0.3  # it trains
    # measured 30-step gap to the reference: online 5.2e-4, --solver-opt scheme=admm 1.3e-3
    assert max(abs(a - b) for a, b in zip(fast, reference)) <= 2e-3


def test_a_fixed_radius_subclass_as_docs_api_shows_it():
    from manifolds import MANIFOLDS, manifold_violation, register_manifold
    from manifolds.geometry import Hyperball, frobenius64

    class FixedHyperball(Hyperball):  # docs/api.md, "A Hyperball of a fixed radius"
        name = "hyperball-fixed"
        c = 1.0

        def radius(self, W):
            return self.c * W.size(-2) ** 0.5

        def retract(self, X, near=True, backend="auto", tf32_correction=False):
            scale = self.radius(X) / frobenius64(X)
            return (X.double() * scale[..., None, None]).to(X.dtype)

        def retract_from(self, W, X, near=True, backend="auto", tf32_correction=False):
            return self.retract(X)

        def violation(self, W):
            return (frobenius64(W) / self.radius(W) - 1).abs().to(W.dtype)

    register_manifold(FixedHyperball())
    try:
        model = linear_stack()
        groups, _ = manifold_param_groups(model, {"*.weight": "hyperball-fixed"})
        weights = [layer.weight for layer in model if isinstance(layer, torch.nn.Linear)]
        for W in weights:  # projected at the start: norm sqrt(max(rows, cols))
            assert abs(float(W.detach().double().norm()) - max(W.shape) ** 0.5) < 1e-5
        opt = ManifoldMuon(groups, lr=0.1)
        x = torch.randn(32, 24, generator=torch.Generator().manual_seed(1))
        for _ in range(10):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            assert max(manifold_violation(W.detach(), "hyperball-fixed") for W in weights) <= 1e-6
    finally:
        MANIFOLDS.pop("hyperball-fixed", None)


# --- the radius in the optimizer's state (issue 58) ---------------------------------------------

def hyperball_stack(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8, bias=False), torch.nn.Tanh(), torch.nn.Linear(8, 4, bias=False))
    return model.to(dtype), [model[0].weight, model[2].weight]


def hyperball_steps(model, opt, steps, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 4, generator=g).to(dtype), torch.randn(16, 4, generator=g)
    for _ in range(steps):
        (model(x).float() - y).square().mean().backward()
        opt.step()
        opt.zero_grad()
        yield


def test_bf16_weights_stay_on_the_stored_radius_over_many_steps():
    """Each step retracts to the radius kept in the state, so a bf16 weight's norm is one rounding
    of its entries from r (at most bf16's unit roundoff 2^-8 relative), however many steps.
    Retracting to the current norm instead let the roundings walk: 2.2e-2 after 150 steps here
    (measured; the issue's 2.6e-3 in 3,000 steps on larger matrices); with the stored radius the
    worst step was 1.6e-3."""
    from manifolds.sharded import stored_radius
    model, weights = hyperball_stack(dtype=torch.bfloat16)
    start = [W.detach().double().norm() for W in weights]
    groups, _ = manifold_param_groups(model, {"*.weight": "hyperball"})
    opt = ManifoldMuon(groups, lr=0.1)
    assert [float(stored_radius(opt, W)) for W in weights] == [float(r) for r in start]
    worst = 0.0
    for _ in hyperball_steps(model, opt, 150, torch.bfloat16):
        worst = max(worst, max(abs(float(W.detach().double().norm() / r) - 1) for W, r in zip(weights, start)))
    assert worst <= 2.0 ** -8, worst


def test_violation_measures_against_the_stored_radius_and_the_step_corrects_it():
    from manifolds import manifold_violation
    from manifolds.sharded import stored_radius
    model, weights = hyperball_stack()
    groups, _ = manifold_param_groups(model, {"*.weight": "hyperball"})
    opt = ManifoldMuon(groups, lr=0.1)
    steps = hyperball_steps(model, opt, 4)
    next(steps), next(steps)
    violation = lambda W: manifold_violation(W.detach(), "hyperball", radius=stored_radius(opt, W))  # noqa: E731
    assert max(violation(W) for W in weights) <= 1e-6
    assert manifold_violation(weights[0].detach(), "hyperball") == 0.0  # no radius: its own sphere
    with torch.no_grad():
        weights[0].mul_(1.01)  # off its sphere, by an edit outside the step
    assert abs(violation(weights[0]) - 0.01) <= 1e-6
    next(steps)
    assert max(violation(W) for W in weights) <= 1e-6  # retracted to r, not to the edited norm


def test_the_radius_survives_state_dict_and_load_state_dict():
    from manifolds.sharded import stored_radius
    model, weights = hyperball_stack()
    groups, _ = manifold_param_groups(model, {"*.weight": "hyperball"})
    opt = ManifoldMuon(groups, lr=0.1)
    for _ in hyperball_steps(model, opt, 2):
        pass
    saved = opt.state_dict()
    assert all("radius" in saved["state"][i] for i in range(2))
    other, other_weights = hyperball_stack(seed=1)  # other weights, other norms
    groups, _ = manifold_param_groups(other, {"*.weight": "hyperball"})
    resumed = ManifoldMuon(groups, lr=0.1)
    resumed.load_state_dict(saved)
    for W, W_saved in zip(other_weights, weights):
        assert torch.equal(stored_radius(resumed, W), stored_radius(opt, W_saved))
        assert stored_radius(resumed, W).dtype == torch.float64
    for _ in hyperball_steps(other, resumed, 1):
        pass
    for W, W_saved in zip(other_weights, weights):  # the step retracts to the loaded radius
        assert abs(float(W.detach().double().norm() / stored_radius(opt, W_saved)) - 1) <= 1e-6


def test_the_trainer_reports_a_hyperball_violation_against_the_stored_radius():
    """The trainer's summary (max_violations) and eval rows (diagnostics.matrix_stats) measure a
    Hyperball matrix against the radius ManifoldMuon keeps, not against its own norm (always 0)."""
    from manifolds.param_groups import Matrix
    from training.diagnostics import matrix_stats, stored_radii
    model, weights = hyperball_stack()
    groups, _ = manifold_param_groups(model, {"*.weight": "hyperball"})
    opt = ManifoldMuon(groups, lr=0.1)
    next(hyperball_steps(model, opt, 1))
    matrices = [Matrix(f"w{i}", W, "*.weight", [(f"w{i}", 0, W.size(0), "hyperball")]) for i, W in enumerate(weights)]
    args = train_gpt2.parse_args(["--assign", "hetero"])
    assert max(train_gpt2.max_violations(matrices, args, opt).values()) <= 1e-6
    with torch.no_grad():
        weights[1].mul_(1.02)  # off its sphere, by an edit outside the step
    radii = stored_radii(opt, matrices)
    assert sorted(radii) == [("w0", 0), ("w1", 0)]
    assert abs(train_gpt2.max_violations(matrices, args, opt)["hyperball"] - 0.02) <= 1e-6
    assert abs(matrix_stats(matrices, radii=radii)["manifold_violation"]["w1"] - 0.02) <= 1e-6
    assert train_gpt2.max_violations(matrices, args)["hyperball"] == 0.0  # without the optimizer: no radius
