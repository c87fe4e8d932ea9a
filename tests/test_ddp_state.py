"""ManifoldMuon's state under DDP, and at the edges of what it is given (issue 58):

* every rank holds the whole optimizer state of replicated parameters (each rank updates every
  momentum; the warm starts travel with the new weights), so a state_dict saved by one rank alone
  resumes bitwise on the same ranks and to the one-process distance on another number;
* load_state_dict keeps the state's dtype (fp32 momentum and warm start of a bf16 parameter);
* a matrix whose gradient is not finite is left as it was (weight, momentum, warm start), with no
  host sync, and the other matrices step."""
import copy
import multiprocessing
import os

import pytest
import torch
import torch.distributed as dist

from gloo_ranks import end_rank_process
from manifolds import ManifoldMuon, project_to_manifold
from manifolds.sharded import keeps_warm_start
from manifolds.step_graph import Recorded

WARM, MORE = 3, 2  # steps before the snapshot, steps after it


def matrices(seed=0, dtype=torch.float32):
    """(params, groups): a bank of two tall Stiefel matrices, a square Stiefel one (solved exactly:
    no warm start), a DGram one stored wide, a plain Muon ("none") one and an AdamW group."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {"stiefel": [(48, 16), (48, 16), (16, 16)], "dgram": [(16, 40)], "none": [(24, 16)]}
    params, groups = [], []
    for manifold, group_shapes in shapes.items():
        group = []
        for shape in group_shapes:
            W = torch.randn(*shape, generator=generator) / shape[1] ** 0.5
            if manifold != "none":
                W = project_to_manifold(W, manifold)
            group.append(torch.nn.Parameter(W.to(dtype)))
        params += group
        groups.append({"params": group, "manifold": manifold})
    extra = [torch.nn.Parameter(torch.randn(16, generator=generator).to(dtype)),
             torch.nn.Parameter(torch.randn(8, 16, generator=generator).to(dtype))]
    groups.append({"params": extra, "algorithm": "adamw", "lr": 1e-2})
    return params + extra, groups


def set_grads(params, step):
    """The same gradients on every rank (as DDP's all-reduce leaves them)."""
    generator = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)


def train(params, opt, steps):
    for step in steps:
        set_grads(params, step)
        opt.step()


def weights(params):
    return [p.detach().clone() for p in params]


def load_weights(params, values):
    with torch.no_grad():
        for p, w in zip(params, values):
            p.copy_(w)


def run_resumed(snapshot, **options):
    """A fresh optimizer on the snapshot's weights and state, stepped MORE times."""
    params, groups = matrices(seed=9)  # other values: all of them come from the snapshot
    load_weights(params, snapshot["weights"])
    opt = ManifoldMuon(groups, lr=0.05, **options)
    opt.load_state_dict(snapshot["state"])
    train(params, opt, range(WARM, WARM + MORE))
    return weights(params)


def rank_main(rank, world, store, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        params, groups = matrices()
        opt = ManifoldMuon(groups, lr=0.05)
        train(params, opt, range(WARM))
        # each rank's own state_dict, no collective: rank 1 saves while rank 0 does not
        snapshot = {"weights": weights(params), "state": copy.deepcopy(opt.state_dict())}
        torch.save(snapshot, os.path.join(out_dir, f"snapshot{rank}.pt"))
        train(params, opt, range(WARM, WARM + MORE))
        dist.barrier()
        # every rank resumes from the state rank 0 saved alone
        resumed = run_resumed(torch.load(os.path.join(out_dir, "snapshot0.pt")))
        torch.save({"straight": weights(params), "resumed": resumed}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        end_rank_process()


def launch(target, tmp_path, world=2, timeout=180):
    context = multiprocessing.get_context("spawn")  # not fork: see bench/memory.py's live()
    ranks = [context.Process(target=target, args=(rank, world, str(tmp_path / "store"), str(tmp_path)))
             for rank in range(world)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=timeout)
    assert [process.exitcode for process in ranks] == [0] * world


def test_each_rank_holds_the_whole_state_and_one_ranks_state_resumes_on_two_and_on_one(tmp_path):
    launch(rank_main, tmp_path)
    snapshots = [torch.load(tmp_path / f"snapshot{r}.pt") for r in range(2)]
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    # the whole state on each rank, bitwise the same: every parameter's momentum or AdamW moments,
    # every warm start a piece keeps (all but the square Stiefel matrix, solved exactly)
    params, groups = matrices()
    opt = ManifoldMuon(groups, lr=0.05)
    index = {id(p): i for i, p in enumerate(params)}
    expected = {i: {"momentum_buffer"} for i in range(5)} | {5: {"step", "exp_avg", "exp_avg_sq"},
                                                            6: {"step", "exp_avg", "exp_avg_sq"}}
    for piece in opt.pieces():
        if keeps_warm_start(piece, opt.options):
            expected[index[id(piece.param)]].add(piece.dual_key)
    assert sum("dual" in keys for keys in expected.values()) == 3
    for snapshot in snapshots:
        assert {i: set(s) for i, s in snapshot["state"]["state"].items()} == expected
    for i, state in snapshots[0]["state"]["state"].items():
        for key, value in state.items():
            assert torch.equal(value, snapshots[1]["state"]["state"][i][key]), (i, key)
    # both ranks, resumed from rank 0's state: bitwise the uninterrupted run
    for result in results:
        for straight, resumed, other in zip(result["straight"], result["resumed"], results[0]["straight"]):
            assert torch.equal(straight, resumed) and torch.equal(straight, other)
    # one process from the same state: the one-process distance (the banks solved whole instead of
    # in shares: float roundings; 0 measured here after two steps), not a lost state (8e-3 when each
    # rank's state held only its own pieces)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = run_resumed(snapshots[0])
    finally:
        torch.set_num_threads(threads)
    gap = max((a - b).abs().max().item() for a, b in zip(alone, results[0]["straight"]))
    assert gap <= 1e-6, gap


# --- one process ----------------------------------------------------------------------------------

def test_load_state_dict_keeps_the_fp32_state_of_bf16_parameters():
    params, groups = matrices(dtype=torch.bfloat16)
    opt = ManifoldMuon(groups, lr=0.05)
    train(params, opt, range(WARM))
    saved = copy.deepcopy(opt.state_dict())
    twins, twin_groups = matrices(seed=3, dtype=torch.bfloat16)
    load_weights(twins, weights(params))
    twin = ManifoldMuon(twin_groups, lr=0.05)
    twin.load_state_dict(saved)
    loaded = twin.state_dict()["state"]
    assert sum(key.startswith("dual") for state in loaded.values() for key in state) == 3
    for i, state in saved["state"].items():
        for key, value in state.items():
            if key in ("momentum_buffer",) or key.startswith("dual"):
                assert value.dtype == torch.float32, (i, key)
            assert loaded[i][key].dtype == value.dtype, (i, key)  # AdamW's moments: bf16, as torch's
            assert torch.equal(loaded[i][key], value), (i, key)
    # and the two continue as one
    train(params, opt, range(WARM, WARM + MORE))
    train(twins, twin, range(WARM, WARM + MORE))
    assert all(torch.equal(p, q) for p, q in zip(params, twins))


@pytest.mark.parametrize("capturable", [False, True])
def test_a_matrix_with_a_non_finite_gradient_is_left_as_it_was(capturable):
    params, groups = matrices()
    if capturable:  # torch's capturable AdamW takes device tensors only: no "adamw" group on a CPU
        params, groups = params[:5], groups[:-1]
    opt = ManifoldMuon(groups, lr=0.05, capturable=capturable)
    train(params, opt, range(WARM))
    twin_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    index = {id(p): i for i, p in enumerate(params)}
    twin_groups = [{**g, "params": [twin_params[index[id(p)]] for p in g["params"]]} for g in groups]
    twin = ManifoldMuon(twin_groups, lr=0.05, capturable=capturable)
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    bad = {0: float("nan"), 3: float("inf"), 4: -float("inf")}  # a tall Stiefel, the DGram, the "none"
    before = weights(params)
    state = copy.deepcopy(opt.state_dict()["state"])
    set_grads(params, WARM)
    set_grads(twin_params, WARM)
    for i, value in bad.items():
        params[i].grad[1, 2] = value
        twin_params[i].grad = None  # the twin: those matrices have no gradient, the others step
    if capturable:  # sync-free: a recorded CUDA graph would take this step
        with Recorded():
            opt.step()
    else:
        opt.step()
    twin.step()
    after = opt.state_dict()["state"]
    for i in bad:
        assert torch.equal(params[i], before[i]), i
        assert after[i].keys() == state[i].keys()
        assert all(torch.equal(after[i][k], v) for k, v in state[i].items()), i
    assert "dual" in state[0] and "dual" in state[3]
    for i, (p, q) in enumerate(zip(params, twin_params)):
        if i not in bad:  # stepped, as without the bad matrices (a bank of other size: 0 measured)
            assert not torch.equal(p, before[i]), i
            assert (p - q).abs().max() <= 1e-6, i
    assert all(torch.isfinite(v).all() for s in after.values() for v in s.values() if torch.is_tensor(v))
