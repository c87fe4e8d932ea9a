"""--fsdp builds the model on the meta device and materialises it rank by rank (training/meta_init.py):
the same weights, bit for bit, as the whole model built in one process with the same seed, the
generator left where that build leaves it, and a rank's memory growing by its shards plus one
block, not by the whole model."""
import multiprocessing
import os

import pytest
import torch

import train_gpt2
from gloo_ranks import end_rank_process
from training import meta_init

SEED = 7


def config(n_embd=32, vocab=130, qk_norm=False):
    return train_gpt2.GPTConfig(2, 2, n_embd, 16, vocab, qk_norm=qk_norm)


def rank_main(rank, world, store, out, chunk):
    import resource

    import torch.distributed as dist
    from torch.distributed import fsdp as _  # noqa: F401  (before the process group: train_gpt2.init_distributed says why)
    from training.fsdp import build_sharded
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        meta_init.CHUNK = chunk
        results = {}
        for qk_norm in (False, True):  # an odd vocabulary: rows split unevenly, chunks across rows
            torch.manual_seed(123)  # build_sharded seeds the generator itself
            model = build_sharded(lambda: train_gpt2.GPT(config(qk_norm=qk_norm)), torch.device("cpu"), "float32",
                                  0, SEED)
            results[qk_norm] = {"state": {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
                                          for k, v in model.state_dict().items()},
                                "buffers": {k: v.clone() for k, v in model.named_buffers()},
                                "tied": model.lm_head.weight is model.wte.weight, "next": torch.rand(4)}
        # memory: a wider model, its growth in this process's peak resident bytes while built
        meta_init.CHUNK = 1 << 16
        big = config(n_embd=512, vocab=8192)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        model = build_sharded(lambda: train_gpt2.GPT(big), torch.device("cpu"), "float32", 0, SEED)
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
        shard = sum(p.to_local().numel() * 4 for p in dict.fromkeys(model.parameters()))
        whole = sum(p.numel() * 4 for p in dict.fromkeys(model.parameters()))
        block = sum(p.numel() * 4 for p in model.blocks[0].parameters())
        results["memory"] = {"grown": grown, "shard": shard, "whole": whole, "block": block}
        torch.save(results, out)
    finally:
        end_rank_process()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("meta")
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=rank_main, args=(r, 2, str(tmp / "store"), str(tmp / f"rank{r}.pt"), 48))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    assert [p.exitcode for p in procs] == [0, 0]
    return [torch.load(tmp / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("qk_norm", [False, True])
def test_the_sharded_build_has_the_one_process_weights_bit_for_bit(ranks, qk_norm):
    torch.manual_seed(SEED)
    whole = train_gpt2.GPT(config(qk_norm=qk_norm))
    after = torch.rand(4)  # the generator where the one-process build leaves it
    expected = whole.state_dict()
    for rank in ranks:
        got = rank[qk_norm]
        assert got["state"].keys() == expected.keys()
        differ = [k for k in expected if not torch.equal(got["state"][k], expected[k])]
        assert not differ, differ
        assert all(torch.equal(got["buffers"][k], v) for k, v in whole.named_buffers())
        assert got["tied"] and torch.equal(got["next"], after)


def test_a_rank_grows_by_its_shards_and_one_block_not_the_whole_model(ranks):
    for rank in ranks:
        m = rank["memory"]
        # the whole model is 2.0x a rank's shards here: built whole first, it grew by at least that
        assert m["whole"] > 1.9 * m["shard"]
        assert m["grown"] <= m["shard"] + m["block"], m


def test_a_constructor_the_replay_cannot_follow_is_refused():
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(4, 4))
            torch.nn.init.normal_(self.weight)
            with torch.no_grad():
                self.weight.mul_(0.5)  # read-modify-write: not a whole-tensor initialiser

    with pytest.raises(NotImplementedError, match="mul_"):
        meta_init.record(Scaled)
