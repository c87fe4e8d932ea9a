"""ManifoldMuon under torch.distributed: pieces balanced over the ranks by estimated cost,
one flat all-gather per step."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gloo_ranks import end_rank_process
from manifolds import ManifoldMuon, project_to_manifold
from manifolds.step_cost import balanced_owners
from manifolds.step_cost import piece_cost

LAYOUTS = {  # {module key: manifold or qkv blocks} as train_gpt2's --assign presets give them
    "hetero": {"attn.qkv": "stiefel", "attn.proj": "stiefel", "mlp.fc": "dgram", "mlp.proj": "dgram"},
    "hetero-qk": {"attn.qkv": ("stiefel", "stiefel", "dgram"), "attn.proj": "dgram", "mlp.fc": "dgram",
                  "mlp.proj": "dgram"},
}


def gpt2_matrices(n_embd, n_layer, layout, init=True):
    """(params, groups) shaped like GPT-2's Muon matrices (nn.Linear weights, out x in), one group
    per module key as train_gpt2.muon_groups makes them. init=False: on the meta device (costs only)."""
    C = n_embd
    shapes = {"attn.qkv": (3 * C, C), "attn.proj": (C, C), "mlp.fc": (4 * C, C), "mlp.proj": (C, 4 * C)}
    generator = torch.Generator().manual_seed(0)
    params, groups = [], []
    for key, shape in shapes.items():
        spec = LAYOUTS[layout][key]
        blocks = [(i * C, (i + 1) * C, m) for i, m in enumerate(spec)] if isinstance(spec, tuple) else None
        members = []
        for _ in range(n_layer):
            if not init:
                members.append(torch.nn.Parameter(torch.empty(shape, device="meta")))
                continue
            w = torch.randn(shape, generator=generator) * 0.02
            for lo, hi, m in blocks or [(0, shape[0], spec)]:
                w[lo:hi] = project_to_manifold(w[lo:hi], m)
            members.append(torch.nn.Parameter(w))
        group = {"params": members, "name": f"{key}={layout}"}
        group.update({"blocks": blocks} if blocks else {"manifold": spec})
        groups.append(group)
        params += members
    return params, groups


def set_grads(params, step):
    generator = torch.Generator().manual_seed(100 + step)
    for p in params:  # the same on every rank, as after DDP's all-reduce
        p.grad = torch.randn(p.shape, generator=generator)


def rank_loads(opt, world):
    """[(estimated cost, piece keys) of each rank], computed as each rank would."""
    opt.world_size, loads = world, []
    for rank in range(world):
        opt.rank = rank
        pieces = opt.owned_pieces()
        loads.append((sum(piece_cost(p, opt.plan) for p in pieces), [p.key for p in pieces]))
    return loads


def test_longest_first_onto_the_least_loaded_rank():
    # 3 (piece 1) -> rank 0; 3 (piece 3) -> rank 1; 2 -> rank 0 (tied, lowest); 1 -> rank 1
    assert balanced_owners([1, 3, 2, 3], 2) == [1, 0, 0, 1]
    assert balanced_owners([5, 5, 5], 1) == [0, 0, 0]
    assert balanced_owners([2, 1], 4) == [0, 1]  # ranks 2, 3 own nothing


@pytest.mark.parametrize("n_embd", [32, 768])
@pytest.mark.parametrize("layout", ["hetero", "hetero-qk"])
def test_eight_ranks_each_get_a_balanced_share_and_every_piece_once(layout, n_embd):
    _, groups = gpt2_matrices(n_embd, 12, layout, init=False)
    opt = ManifoldMuon(groups)
    loads = rank_loads(opt, 8)
    keys = [key for _, owned in loads for key in owned]
    assert sorted(keys) == sorted(piece.key for piece in opt.pieces())  # each piece on exactly one rank
    mean = sum(cost for cost, _ in loads) / 8
    assert all(abs(cost - mean) <= 0.25 * mean for cost, _ in loads), [cost / mean for cost, _ in loads]
    # the contiguous share of every bank it replaces left two of eight ranks idle (12 = 6 x 2)
    assert all(owned for _, owned in loads)


def test_costs_order_the_solvers():
    _, groups = gpt2_matrices(32, 1, "hetero", init=False)
    opt = ManifoldMuon(groups)
    cost = {piece.group["name"].split("=")[0]: piece_cost(piece, opt.plan) for piece in opt.pieces()}
    # ADMM (tall, span-reduced) > square Stiefel's exact step; the two MLP orientations equal
    assert cost["mlp.fc"] == cost["mlp.proj"] > cost["attn.qkv"] > cost["attn.proj"] > 0
    plain = ManifoldMuon([{"params": groups[0]["params"], "manifold": "none"}])
    assert 0 < piece_cost(next(plain.pieces()), plain.plan) < cost["attn.proj"]


@pytest.mark.parametrize("scheme", ["online", "admm", "newton"])
def test_cost_model_is_proportional_to_the_counted_solve_across_shapes(scheme):
    # the balancing needs only the ratios between matrices right: matrix_work (less the retraction,
    # which the solve does not run) over the multiply-adds bench.op_count counts in one warm solve
    # stays within 10% across the tall shapes. scheme=newton was priced by ADMM's terms (0.79 at
    # p = 96, 0.55 at 192: its q x q work barely grows with p)
    from bench.op_count import OpCounter
    from manifolds.geometry import geometry
    from manifolds.optimum import random_point
    from manifolds.plan import SolverOptions, plan_for
    from manifolds.solver import solve_tall_banks
    from manifolds.step_cost import matrix_work
    plan = plan_for(SolverOptions(scheme=scheme, clip="polynomial", capturable=True), "cpu")
    ratios = []
    for p in (96, 192, 256):
        W, G = random_point((p, 64), "dgram", seed=1)
        bank = (W[None], G[None], geometry("dgram"))
        cold = solve_tall_banks([(*bank, None)], plan)[0]
        with OpCounter() as counter:
            solve_tall_banks([(*bank, cold.warm_start)], plan)
        work = matrix_work("dgram", p, 64, plan)
        ratios.append((sum(work.values()) - work["retraction"]) / (sum(counter.flops.values()) / 2))
    assert max(ratios) <= 1.10 * min(ratios), ratios


def test_exchange_volume_is_the_largest_rank_padded():
    _, groups = gpt2_matrices(32, 12, "hetero", init=False)
    opt = ManifoldMuon(groups)
    # each piece travels with its q x q warm start where it keeps one (all but the square Stiefel
    # attn.proj, solved exactly): every rank holds the whole state
    volume = lambda piece: piece.weight().numel() + (32 * 32 if piece.group["name"] != "attn.proj=hetero" else 0)  # noqa: E731
    assert opt.all_gather_elements() == sum(volume(piece) for piece in opt.pieces()) + 3 * 3
    opt.world_size = 8
    volumes = []
    for rank in range(8):
        opt.rank = rank
        volumes.append(sum(volume(piece) for piece in opt.owned_pieces()))
    assert opt.all_gather_elements() == 8 * (max(volumes) + 3 * 3)  # 3 banks (qkv, proj, fc+mlp.proj): 3 statistics each
    assert sum(volumes) == sum(p.numel() for g in groups for p in g["params"]) + 3 * 12 * 32 * 32


# --- real processes on gloo -------------------------------------------------------------------

STEPS = 2


def run_one_rank(params, groups, steps, state=None, reassign=False):
    opt = ManifoldMuon(groups, lr=0.05, iterations=4)
    if state is not None:
        opt.load_state_dict(state)
    for step in steps:
        set_grads(params, step)
        opt.step()
    if reassign:
        opt.reassign([{"params": g["params"], "name": g["name"], "manifold": "dgram"} for g in groups])
        set_grads(params, 99)
        opt.step()
    return opt


def weights(params):
    return [p.detach().clone() for p in params]


def _worker(rank, world, init_file, out_dir, reference):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        params, groups = gpt2_matrices(32, 12, "hetero")
        opt = run_one_rank(params, groups, range(STEPS))
        index = {id(p): i for i, p in enumerate(params)}
        owned = [(index[id(piece.param)], piece.lo) for piece in opt.owned_pieces()]
        # every rank holds every matrix's momentum and every warm start (the rest: the main process)
        assert {id(p) for p in opt.state} == {id(p) for p in params}
        state = opt.consolidated_state_dict()
        after = {"weights": weights(params), "state": state, "owned": owned, "stats": opt.stats(),
                 "elements": opt.all_gather_elements()}
        # resume from the one-rank run's state, then a regrouping (a collective)
        ref = torch.load(reference)
        with torch.no_grad():
            for p, w in zip(params, ref["weights"]):
                p.copy_(w)
        opt = run_one_rank(params, groups, [STEPS], state=ref["state"], reassign=True)
        after["resumed"] = weights(params)
        torch.save(after, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        end_rank_process()


def test_ranks_match_one_rank_and_their_states_load_either_way(tmp_path, world=8):
    # 8 ranks only: 2 ranks against 1 are tests/test_distributed.py's (the suite's time budget)
    params, groups = gpt2_matrices(32, 12, "hetero")
    one = run_one_rank(params, groups, range(STEPS))
    reference = {"weights": weights(params), "state": one.state_dict()}
    torch.save(reference, tmp_path / "reference.pt")
    stats = one.stats()
    run_one_rank(params, groups, [STEPS], state=reference["state"], reassign=True)
    resumed = weights(params)
    # forked: the workers inherit the imports (spawned, 8 of them import torch and torch._dynamo,
    # which Optimizer imports lazily, for 20 s and more on two cores)
    mp.start_processes(_worker, args=(world, str(tmp_path / "init"), str(tmp_path), str(tmp_path / "reference.pt")),
                       nprocs=world, start_method="fork")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    owned = [key for r in ranks for key in r["owned"]]
    assert len(owned) == len(set(owned)) == 4 * 12
    for r in ranks:  # every rank holds every weight, equal to the one-rank run's
        for w, ref in zip(r["weights"], reference["weights"]):
            torch.testing.assert_close(w, ref, rtol=0, atol=1e-6)
        for w, ref in zip(r["resumed"], resumed):  # one rank's state loaded into `world`
            torch.testing.assert_close(w, ref, rtol=0, atol=1e-6)
        assert r["stats"].keys() == stats.keys()  # every bank, whichever ranks computed it
        assert r["stats"] == ranks[0]["stats"]
        assert r["elements"] == ranks[0]["elements"]
        # each rank's state alone is the whole state, bitwise the same on every rank
        assert r["state"]["state"].keys() == ranks[0]["state"]["state"].keys()
        for i, state in r["state"]["state"].items():
            assert state.keys() == ranks[0]["state"]["state"][i].keys() == one.state_dict()["state"][i].keys()
            assert all(torch.equal(v, ranks[0]["state"]["state"][i][k]) for k, v in state.items())
    assert all(r["stats"][b]["iterations"] == stats[b]["iterations"] for b in stats)
    # `world` ranks' consolidated state into one rank: the same next step as the one-rank run
    with torch.no_grad():
        for p, w in zip(params, ranks[0]["weights"]):
            p.copy_(w)
    run_one_rank(params, groups, [STEPS], state=ranks[0]["state"], reassign=True)
    for w, ref in zip(weights(params), resumed):
        torch.testing.assert_close(w, ref, rtol=0, atol=1e-6)
