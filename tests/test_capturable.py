"""ManifoldMuon(scheme="admm", capturable=True): the GPU's sync-free control flow, run and counted on CPU."""
import pytest
import torch

from bench.op_count import HostReads
from manifolds.step_graph import NotCapturable, Recorded
from manifolds import ManifoldMuon, manifold_violation, project_to_manifold, steepest_direction
from manifolds.solver import admm_full, solve_tall, unit
from manifolds.geometry import geometry
from manifolds.plan import SolverOptions, plan_for
from manifolds.optimum import optimum, quality, random_point


def hetero_bank(seed=0, d=32, layers=2):
    """The Muon matrices of a small GPT-2 under HETERO (Stiefel attention, DGram MLP), with
    dgram-cap value rows as the beyond setting uses, as ManifoldMuon groups."""
    torch.manual_seed(seed)
    shapes = {"stiefel": [(3 * d, d), (d, d)], "dgram": [(4 * d, d), (d, 4 * d)], "dgram-cap": [(d, d), (2 * d, d)]}
    groups = []
    for manifold, group_shapes in shapes.items():
        params = [torch.nn.Parameter(project_to_manifold(torch.randn(s) * 0.05, manifold, 0.5))
                  for s in group_shapes for _ in range(layers)]
        groups.append({"params": params, "manifold": manifold, "dgram_cap": 0.5})
    return groups


def run_steps(capturable, steps=4, count_last=False, scheme="admm"):
    groups = hetero_bank()
    params = [p for g in groups for p in g["params"]]
    opt = ManifoldMuon(groups, lr=0.05, scheme=scheme, capturable=capturable)
    g = torch.Generator().manual_seed(1)
    syncs = HostReads()
    for step in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) + (p.grad if p.grad is not None else 0)
        if count_last and step == steps - 1:
            with syncs:
                opt.step()
        else:
            opt.step()
    return params, opt, syncs.count


def test_a_capturable_warm_step_makes_no_host_sync_and_the_default_does():
    _, _, syncing = run_steps(False, steps=2, count_last=True)
    _, _, free = run_steps(True, steps=2, count_last=True)
    assert syncing > 0  # the counter sees the early exits' and fallbacks' checks
    assert free == 0


def test_the_online_scheme_makes_no_host_sync_when_capturable_and_fewer_otherwise():
    # one dual step: no convergence check, no span fallback; the syncing mode reads only
    # dgram-cap's active set (solve_capped), where ADMM also checks its convergence
    assert run_steps(True, steps=2, count_last=True, scheme="online")[2] == 0
    assert 0 < run_steps(False, steps=2, count_last=True, scheme="online")[2] < run_steps(False, steps=2,
                                                                                            count_last=True)[2]


def test_capturable_steps_equal_the_early_exit_ones():
    # the mask freezes finished matrices, so running the whole budget changes nothing
    fixed, opt, _ = run_steps(True)
    early, _, _ = run_steps(False)
    for a, b in zip(fixed, early):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-6)
    for group in opt.param_groups:
        for p in group["params"]:
            assert manifold_violation(p.detach(), group["manifold"], 0.5) <= 1e-4


def test_capturable_cold_directions_match_and_square_stiefel_stays_exact():
    for manifold, shape in [("stiefel", (24, 24)), ("stiefel", (64, 16)), ("dgram", (64, 16)),
                            ("dgram", (24, 24))]:
        W, G = random_point(shape, manifold, seed=3)
        A_free = steepest_direction(W, G, manifold, scheme="admm", capturable=True)
        A_sync = steepest_direction(W, G, manifold, scheme="admm", capturable=False)
        torch.testing.assert_close(A_free, A_sync, rtol=0, atol=1e-5)
    opt, _ = optimum(*random_point((24, 24), "stiefel", seed=3), "stiefel", iters=800)
    W, G = random_point((24, 24), "stiefel", seed=3)
    assert quality(W, G, steepest_direction(W, G, "stiefel", scheme="admm", capturable=True), opt) >= 0.9999


@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
def test_sync_free_precision_fallback_is_a_feasible_descent_direction(manifold):
    # G nearly inside a rank-2 subspace: span[W, G] is nearly singular and the span coefficients
    # lose their precision; without a sync the solver takes Proj_T(G) for that matrix
    W, _ = random_point((96, 32), manifold, 0)
    g = torch.Generator().manual_seed(0)
    G = torch.randn(96, 2, generator=g) @ torch.randn(2, 32, generator=g) + 1e-6 * torch.randn(96, 32, generator=g)
    A = steepest_direction(W, G, manifold, scheme="admm", capturable=True)
    assert torch.isfinite(A).all()
    geo = geometry(manifold)
    plan = plan_for(SolverOptions(scheme="admm", capturable=True), "cpu")
    assert int(solve_tall(W, G, geo, None, plan).fallbacks) == 1
    assert int(admm_full(W, unit(G), geo, None, plan).fallbacks) == 0  # the full matrices need no fallback
    residual = geo.tangent_residual(W.double(), A.double())
    assert residual.abs().max() <= 1e-5
    assert abs(torch.linalg.matrix_norm(A.double(), 2) - 1) <= 1e-3
    assert (G * A).sum() > 0  # W - lr A descends along G
    opt, _ = optimum(W, G, manifold, iters=1500)
    assert quality(W, G, A, opt) >= 0.8  # 0.85 (Stiefel), 0.84 (DGram) here; the full solve: 0.9998, 0.998


@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
def test_layernorm_gradients_stay_in_span_coordinates(manifold):
    # A matrix that reads LayerNorm outputs (zero mean over features) has a gradient with an
    # exact null vector, so span[W, G] is rank-deficient. Before the Schur shift and the sharper
    # precision estimate, the sync-free step sent every such matrix to the fallback (quality
    # 0.33-0.44 on real training momenta); the span answer is as good as the full solve.
    W, _ = random_point((192, 64), manifold, 0)
    g = torch.Generator().manual_seed(0)
    X = torch.randn(64, 512, generator=g, dtype=torch.float64)
    G = torch.randn(192, 512, generator=g, dtype=torch.float64) @ (X - X.mean(dim=0, keepdim=True)).T
    assert torch.linalg.matrix_rank(G) == 63
    opt, _ = optimum(W, G, manifold, iters=1500)
    geo = geometry(manifold)
    span = solve_tall(W.float()[None], G.float()[None], geo, None, plan_for(SolverOptions(scheme="admm", capturable=True), "cpu"))
    full = admm_full(W.float()[None], unit(G.float()[None]), geo, None, plan_for(SolverOptions(scheme="admm", capturable=False), "cpu"))
    assert int(span.fallbacks) == 0
    assert quality(W, G, span.A[0], opt) >= quality(W, G, full.A[0], opt) - 2e-3
    assert quality(W, G, span.A[0], opt) >= 0.99


def test_optimizer_stats_count_the_fallbacks():
    # two matrices in one bank, one with a nearly rank-2 gradient (as above): one fallback
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(project_to_manifold(torch.randn(96, 32, generator=g), "stiefel")) for _ in range(2)]
    params[0].grad = torch.randn(96, 2, generator=g) @ torch.randn(2, 32, generator=g) + 1e-6 * torch.randn(96, 32, generator=g)
    params[1].grad = torch.randn(96, 32, generator=g)
    opt = ManifoldMuon([{"params": params, "manifold": "stiefel"}], lr=0.01, scheme="admm", capturable=True)
    opt.step()
    assert opt.stats()["stiefel:96x32"]["fallbacks"] == 1
    assert all(manifold_violation(p.detach(), "stiefel") <= 1e-4 for p in params)
    opt = ManifoldMuon([{"params": params, "manifold": "stiefel"}], lr=0.01, scheme="admm", capturable=False)
    opt.step()
    assert opt.stats()["stiefel:96x32"]["fallbacks"] == 1  # the syncing step takes the same fallback


def test_capturable_rejects_a_non_boolean():
    W, G = random_point((32, 16), "stiefel", seed=0)
    with pytest.raises(ValueError, match="capturable takes auto, on or off"):
        steepest_direction(W, G, "stiefel", scheme="admm", capturable="yes")


def test_a_warm_capturable_step_of_twelve_gpt2_layers_is_under_643_ops_and_sync_free():
    # the trainer's groups for 12 HETERO layers at GPT-2's aspect ratios (width 64 instead of
    # 768: the op count does not depend on the width); the torch path, as the profiler sees it
    import train_gpt2
    from bench.op_count import OpCounter
    from model import GPT, GPTConfig
    args = train_gpt2.parse_args(["--assign", "hetero", "--n-layer", "12", "--n-embd", "64", "--n-head", "4",
                                  "--seq-len", "64", "--solver-opt", "capturable=on"])
    train_gpt2.validate_args(args)
    torch.manual_seed(0)
    model = GPT(GPTConfig(12, 4, 64, 64, 512))
    muon, _ = train_gpt2.build_optimizers(model, args, torch.device("cpu"))
    assert muon.plan.capturable
    params = [p for group in muon.param_groups for p in group["params"]]
    g = torch.Generator().manual_seed(1)
    for _ in range(2):  # the first step creates the states and warm starts
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        counter = OpCounter()
        with counter:
            muon.step()
    kernels, syncs = sum(counter.kernels.values()), sum(counter.syncs.values())
    assert syncs == 0
    assert sum(counter.literals.values()) == 0  # no host-to-device copies of lr lists (pageable: they block)
    # 642 here: the torch twin's foreach ops counted as CUDA launches them (bench.op_count.foreach_kernel_bytes:
    # the momenta's per-matrix factors, a list of 0-dim tensors, take the slow path, a kernel per matrix, which
    # the count took as one launch before; on a GPU kernels.momentum_update's Triton kernel runs instead). 574
    # before that: the finite mask is one where per matrix (48), where 3 kernels laid the gradients end to end and
    # moved 10 bytes an entry more, which bench.cost_model prices above the 45 launches (bench/RESULTS.md); 529
    # before that, once online_banks stopped copying a lone bank; 535 before, 536 before norm_bound's first
    # rescaling made the log scale without a zero fill; 581 before _momenta's one where over the gradients laid
    # end to end, 714 before solver.finite, kernels.constants and the fused signal tests; 2,137 before the
    # stacked banks
    assert kernels <= 642, counter.kernels.most_common(10)


def test_a_growing_warm_penalty_keeps_the_fixed_point_and_gets_closer_in_the_budget():
    """rho_growth rescales U with rho, so the scaled multiplier rho U, and with it the fixed
    point, is the same: with many iterations growth 1 and 2 reach the same direction. At 4
    iterations (without the pullbacks, which close part of the gap either way) the growing penalty
    is closer to the optimum on a degenerate problem (square DGram: many singular values of A*
    below 1), and long budgets (the penalty capped) converge."""
    def warm(shape, manifold, **options):
        W, G = random_point(shape, manifold, seed=5)
        best, _ = optimum(W.double(), G.double(), manifold, iters=800)
        plan = plan_for(SolverOptions(scheme="admm", tol=0, capturable=True, **options), "cpu")
        noise = 0.05 * torch.randn(G.shape, generator=torch.Generator().manual_seed(1))
        state = solve_tall(W[None], (G + noise)[None], geometry(manifold), None, plan).warm_start
        A = solve_tall(W[None], G[None], geometry(manifold), state, plan).A[0]
        return quality(W.double(), G.double(), A.double(), best), A

    (constant, A1), (growing, A2) = (warm((96, 32), "stiefel", iterations=30, rho_growth=g) for g in (1.0, 2.0))
    assert constant > 0.9999 and growing > 0.9999
    torch.testing.assert_close(A1, A2, rtol=0, atol=2e-3)
    budget = dict(iterations=4, pullbacks=0)
    assert (warm((48, 48), "dgram", rho_growth=2.0, **budget)[0]
            > warm((48, 48), "dgram", rho_growth=1.0, **budget)[0] + 0.02)
    long_run, A = warm((48, 48), "dgram", iterations=100)  # 200 iterations, 190 of them at the cap
    assert torch.isfinite(A).all() and long_run > 0.999


def graph_run(replay, lr_as_tensor, steps=5):
    """The hetero bank stepped `steps` times under a changing lr and fresh gradients, both written
    into the same tensors each step (what a CUDA-graph-replayed training loop does); with
    `replay`, the third step is recorded and the later ones replayed (manifolds/step_graph.py)."""
    groups = hetero_bank()
    for group in groups:
        group["lr"] = torch.tensor(0.05) if lr_as_tensor else 0.05
    params = [p for g in groups for p in g["params"]]
    opt = ManifoldMuon(groups, scheme="admm", capturable=True)
    gen = torch.Generator().manual_seed(1)
    recorded = None
    for step, lr in enumerate([0.05, 0.04, 0.03, 0.02, 0.01][:steps]):
        for p in params:
            grad = torch.randn(p.shape, generator=gen)
            p.grad = grad if p.grad is None else p.grad.copy_(grad)
        for group in opt.param_groups:
            group["lr"].fill_(lr) if lr_as_tensor else group.__setitem__("lr", lr)
        if not replay or step < 2:
            opt.step()  # the cold first step, then the first warm one (it creates the warm starts)
        elif recorded is None:
            with Recorded() as recorded:
                opt.step()
        else:
            recorded.replay()
    return [p.detach().clone() for p in params], len(recorded or ())


def test_the_capturable_step_replays_like_a_cuda_graph_with_the_lr_in_a_tensor():
    """A replay reads the capture's tensors: the warm starts must be updated in place and the
    scheduled lr read from a device tensor. Replayed steps 4 and 5 equal eager ones bitwise;
    with a float lr the replay keeps step 3's lr, which this emulation sees."""
    eager, _ = graph_run(replay=False, lr_as_tensor=True)
    replayed, ops = graph_run(replay=True, lr_as_tensor=True)
    assert ops > 100
    for a, b in zip(eager, replayed):
        assert torch.equal(a, b)
    float_eager, _ = graph_run(replay=False, lr_as_tensor=False)
    float_replayed, _ = graph_run(replay=True, lr_as_tensor=False)
    for a, b in zip(eager, float_eager):  # a tensor lr computes what a float one does
        assert torch.equal(a, b)
    assert max((a - b).abs().max() for a, b in zip(float_eager, float_replayed)) > 1e-3


HOST_READS_OF_A_TENSOR = {
    "bool": lambda X: bool(X.sum() > 0), "float": lambda X: float(X.sum()), "item": lambda X: X.sum().item(),
    "index": lambda X: [0, 1, 2, 3][X.sum().long()], "tolist": lambda X: X.tolist(), "numpy": lambda X: X.numpy(),
    "cpu": lambda X: X.cpu(), "to-cpu": lambda X: X.to("cpu"), "to-device-cpu": lambda X: X.to(device="cpu"),
}


@pytest.mark.parametrize("read", HOST_READS_OF_A_TENSOR.values(), ids=HOST_READS_OF_A_TENSOR.keys())
def test_each_host_read_is_counted_once_and_the_graph_emulation_refuses_it(read):
    # tolist / numpy / cpu / to("cpu") dispatch no aten op that reads (on a CPU tensor none at
    # all); on CUDA each waits for the device, and a graph would freeze the value it read
    from bench.op_count import OpCounter
    X = torch.ones(3)
    with HostReads() as syncs:
        read(X)
    assert syncs.count == 1
    with OpCounter() as counter:
        read(X)
    assert counter.sync_count == 1
    with pytest.raises(NotCapturable):
        with Recorded():
            read(X)
    with HostReads() as syncs:  # device-side work, and copies that do not wait for the device
        X.to(torch.float16), X.to(X), X.to("cpu", non_blocking=True), X.sum() > 0
    assert syncs.count == 0
    with HostReads() as syncs:
        read(X)  # the methods are restored on exit and watched again on the next entry
    assert syncs.count == 1 and not {"tolist", "numpy", "cpu", "to"} & set(vars(torch.Tensor))


def test_a_tolist_moved_into_the_capturable_step_is_reported(monkeypatch):
    # the same warm capturable step as above, with a host read slipped into the solver's masked
    # update (a typical place for a "just check it" debugging line)
    import manifolds.solver
    masked_update = manifolds.solver.masked_update

    def reading(active, old, new):
        active.tolist()
        return masked_update(active, old, new)

    monkeypatch.setattr(manifolds.solver, "masked_update", reading)
    assert run_steps(True, steps=2, count_last=True)[2] > 0
    groups = hetero_bank()
    opt = ManifoldMuon(groups, lr=0.05, scheme="admm", capturable=True)
    for group in groups:
        for p in group["params"]:
            p.grad = torch.randn(p.shape)
    opt.step()
    with pytest.raises(NotCapturable, match="tolist"):
        with Recorded():
            opt.step()


def test_step_time_checks_its_graph_against_an_eager_step():
    """bench/step_time.py --cuda-graph's check, run with the CPU emulation: the replay of the
    captured step from the same state equals the eager step (here exactly)."""
    from bench.step_time import graphed_step
    groups = hetero_bank()
    opt = ManifoldMuon(groups, lr=0.05, scheme="admm", capturable=True)
    for group in groups:
        for p in group["params"]:
            p.grad = torch.randn(p.shape)
    replay, diff = graphed_step(opt, torch.device("cpu"))
    assert diff == 0.0
    before = [p.clone() for g in groups for p in g["params"]]
    replay()
    assert all(not torch.equal(a, p) for a, p in zip(before, (p for g in groups for p in g["params"])))


def test_the_warm_start_kept_averages_the_one_started_from_and_the_new_correction():
    # warm_average changes only what the next step starts from: this step's direction is
    # the same, and the state kept is the given mix of the incoming and the new correction
    W, G = random_point((96, 32), "dgram", seed=4)
    plan = lambda average: plan_for(SolverOptions(scheme="admm", tol=0, capturable=True, warm_average=average), "cpu")  # noqa: E731
    geo = geometry("dgram")
    noise = torch.randn(G.shape, generator=torch.Generator().manual_seed(2), dtype=G.dtype)
    incoming = solve_tall(W[None], (G + 0.5 * noise)[None], geo, None, plan(0.0)).warm_start
    own, mixed = (solve_tall(W[None], G[None], geo, incoming, plan(a)) for a in (0.0, 0.5))
    torch.testing.assert_close(mixed.A, own.A, rtol=0, atol=0)
    torch.testing.assert_close(mixed.warm_start, 0.5 * incoming + 0.5 * own.warm_start, rtol=0, atol=1e-7)
    assert (own.warm_start - incoming).abs().max() > 1e-4  # the two differ, so the mix is a real one
