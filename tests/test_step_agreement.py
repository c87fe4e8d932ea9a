"""step_agreement: ranks that build different optimizer steps stop, every one of them, with one error
naming what differs, before any exchange (under NCCL such a step hangs). Two gloo ranks started as
fresh interpreters (not forked from pytest's threads), rank 1 altered on purpose: its owners
(replicated and FSDP2-sharded parameters) or, after a resume, its warm-start flags."""
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from manifolds import step_agreement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = textwrap.dedent('''
    import os, sys, torch, torch.distributed as dist
    rank, world, store, mode, out = int(sys.argv[1]), 2, sys.argv[2], sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    if mode != "replicated":
        from torch.distributed import fsdp as _fsdp, tensor as _tensor  # noqa: F401 (before the group)
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
    import manifolds.step_cost as work_module
    from manifolds import ManifoldMuon, manifold_param_groups
    from manifolds.step_agreement import StepMismatch
    from model import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, seq_len=8, vocab_size=32))
    if mode != "replicated":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    if rank == 1 and mode in ("replicated", "sharded"):  # a rank whose owners differ
        balanced = work_module.balanced_owners
        work_module.balanced_owners = lambda costs, n: [n - 1 - r for r in balanced(costs, n)]
    if mode == "balanced":  # groups by hand: the sharded matrices reach ManifoldMuon off their manifolds
        import json
        from manifolds import manifold_violation
        matrices = [b.attn.c_attn.weight for b in model.blocks] + [b.mlp.c_fc.weight for b in model.blocks]
        before = [manifold_violation(w.full_tensor().detach(), "stiefel") for w in matrices]
        opt = ManifoldMuon([{"params": matrices, "manifold": "stiefel"}], lr=0.05)
        after = [manifold_violation(w.full_tensor().detach(), "stiefel") for w in matrices]
        x = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(rank))
        model(x[:, :-1], x[:, 1:]).backward()
        opt.step()
        json.dump({"before": before, "after": after, "counts": opt.exchange_counts,
                   "stepped": [manifold_violation(w.full_tensor().detach(), "stiefel") for w in matrices]},
                  open(out, "w"))
        sys.exit(0)
    groups, _ = manifold_param_groups(model, "hetero", adamw={"lr": 1e-3})
    opt = ManifoldMuon(groups, lr=0.05)

    def step():
        x = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(rank))
        model(x[:, :-1], x[:, 1:]).backward()
        if mode == "replicated":  # DDP's gradient average, by hand
            for p in model.parameters():
                dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()

    try:
        step()
        if mode == "resume":  # a resume in which rank 1's state says one matrix never stepped
            state = opt.state_dict()
            if rank == 1:
                first = next(i for i, s in state["state"].items() if "dual" in s)
                state["state"][first]["step"] = torch.tensor(0.0)
            opt.load_state_dict(state)
            step()
    except StepMismatch as error:
        open(out, "w").write(str(error))
        code = 3
    else:
        code = 0
    # freed, the group left, and no interpreter teardown (gloo_ranks says why: one "resume" run
    # ended in SIGABRT on rank 0 after its error was written)
    from gloo_ranks import end_rank_process
    del model, opt
    end_rank_process(code)
''')


def launch(tmp_path, mode):
    """(exit codes, stderr tails, each rank's out file or None) of the worker on 2 ranks."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])}
    ranks = [subprocess.Popen([sys.executable, "-c", WORKER, str(rank), str(tmp_path / "store"), mode,
                               str(tmp_path / f"out{rank}")], env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    try:
        codes = [process.wait(timeout=120) for process in ranks]
    finally:
        for process in ranks:
            process.kill()
    errors = [process.stderr.read()[-3000:] for process in ranks]
    outs = [open(tmp_path / f"out{rank}").read() if os.path.exists(tmp_path / f"out{rank}") else None
            for rank in range(2)]
    return codes, errors, outs


@pytest.mark.parametrize("mode,component", [("replicated", "owners"), ("sharded", "owners"),
                                            ("resume", "warm starts")])
def test_a_rank_with_another_step_stops_every_rank_with_the_digest_error(tmp_path, mode, component):
    start = time.time()
    codes, errors, messages = launch(tmp_path, mode)
    assert codes == [3, 3], errors  # both ranks stopped on the mismatch, neither hung nor crashed
    assert time.time() - start < 90  # seconds after the start (mostly imports), not a collective's timeout
    assert messages[0] == messages[1]
    assert f"{component} (ranks 1 differ from rank 0)" in messages[0]
    others = [name for name in step_agreement.COMPONENTS if name != component]
    assert not any(f"{name} (ranks" in messages[0] for name in others), messages[0]


def test_digests_name_each_component():
    same = {name: "x" for name in step_agreement.COMPONENTS}
    assert len({step_agreement.digest(text) for text in ("a", "b", "a ")}) == 3
    assert all(step_agreement.digest(text) == step_agreement.digest(text) for text in same.values())


def test_sharded_matrices_are_projected_by_the_optimizer_and_both_ranks_solve(tmp_path):
    codes, errors, outs = launch(tmp_path, "balanced")
    assert codes == [0, 0], errors
    ranks = [json.loads(out) for out in outs]
    for rank in ranks:
        assert min(rank["before"]) > 1e-2  # GPT-2's init is off Stiefel...
        assert max(rank["after"]) <= 1e-5  # ...and ManifoldMuon put the sharded matrices on it
        assert max(rank["stepped"]) <= 1e-5
    # 4 pieces balanced over 2 ranks: each rank solves 2 and receives the others' parts
    assert [rank["counts"]["solved"] for rank in ranks] == [2, 2]
    assert all(rank["counts"]["received"] > 0 and rank["counts"]["collectives"] == 2 for rank in ranks)
