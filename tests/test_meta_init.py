"""--fsdp builds the model on the meta device and materialises it rank by rank (training/meta_init.py):
the same weights, bit for bit, as the whole model built in one process with the same seed, the
generator left where that build leaves it, and a rank's memory growing by its shards plus one
block, not by the whole model."""
import pytest
import torch

from gloo_ranks import end_rank_process, run_ranks
from model import GPT, GPTConfig
from training import meta_init

SEED = 7


def config(n_embd=32, vocab=130, qk_norm=False):
    return GPTConfig(2, 2, n_embd, 16, vocab, qk_norm=qk_norm)


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
            model = build_sharded(lambda: GPT(config(qk_norm=qk_norm)), torch.device("cpu"), "float32",
                                  0, SEED)
            results[qk_norm] = {"state": {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
                                          for k, v in model.state_dict().items()},
                                "buffers": {k: v.clone() for k, v in model.named_buffers()},
                                "tied": model.lm_head.weight is model.wte.weight, "next": torch.rand(4)}
        # memory: a wider model, its growth in this process's peak resident bytes while built
        meta_init.CHUNK = 1 << 16
        big = config(n_embd=512, vocab=8192)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        model = build_sharded(lambda: GPT(big), torch.device("cpu"), "float32", 0, SEED)
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
    run_ranks(rank_main, lambda r: (r, 2, str(tmp / "store"), str(tmp / f"rank{r}.pt"), 48), 2, timeout=240)
    return [torch.load(tmp / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("qk_norm", [False, True])
def test_the_sharded_build_has_the_one_process_weights_bit_for_bit(ranks, qk_norm):
    torch.manual_seed(SEED)
    whole = GPT(config(qk_norm=qk_norm))
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


# --- what the replay records and what it refuses (one process: unsharded, the same replay) ---

def built_both_ways(build, seed=SEED):
    """(eager state, its next draw, meta-built state, its next draw) of `build()` from `seed`."""
    torch.manual_seed(seed)
    eager = build()
    eager_next = torch.rand(4)
    torch.manual_seed(123)  # materialize seeds the generator itself
    model, steps = meta_init.record(build)
    replayed = meta_init.materialize(model, steps, torch.device("cpu"), seed)
    return eager.state_dict(), eager_next, replayed.state_dict(), torch.rand(4)


class InitAfterDefault(torch.nn.Module):
    """A layer's default init (kaiming_uniform_) overwritten by an nn.init function that returns
    early on a meta tensor: a replay that misses it keeps the default's values."""

    def __init__(self, init, conv=False):
        super().__init__()
        self.layer = torch.nn.Conv1d(6, 4, 3) if conv else torch.nn.Linear(24, 40)
        self.other = torch.nn.Linear(8, 8)  # drawn after: the generator must be where eager leaves it
        init(self.layer.weight)
        torch.nn.init.normal_(self.other.weight, std=0.02)


@pytest.mark.parametrize("name", ["trunc_normal_", "orthogonal_", "sparse_", "dirac_", "eye_"])
def test_nn_inits_that_return_early_on_meta_are_recorded_and_replayed_bit_for_bit(name):
    from torch.nn import init as nn_init
    inits = {"trunc_normal_": lambda w: nn_init.trunc_normal_(w, std=0.02, a=-0.03, b=0.03),
             "orthogonal_": lambda w: nn_init.orthogonal_(w, gain=0.5),
             "sparse_": lambda w: nn_init.sparse_(w, sparsity=0.3),
             "dirac_": nn_init.dirac_, "eye_": nn_init.eye_}
    eager, eager_next, replayed, replayed_next = built_both_ways(lambda: InitAfterDefault(inits[name],
                                                                                          conv=name == "dirac_"))
    assert eager.keys() == replayed.keys()
    differ = [k for k in eager if not torch.equal(eager[k], replayed[k])]
    assert not differ, differ
    assert torch.equal(eager_next, replayed_next)


def test_an_init_imported_by_name_is_recorded_too():
    from torch.nn.init import orthogonal_  # the same function object: the record sees its code

    eager, _, replayed, _ = built_both_ways(lambda: InitAfterDefault(orthogonal_))
    assert torch.equal(eager["layer.weight"], replayed["layer.weight"])


def test_the_trainers_gpt_built_on_meta_equals_the_eager_build_in_one_process():
    for qk_norm in (False, True):
        eager, eager_next, replayed, replayed_next = built_both_ways(lambda: GPT(config(qk_norm=qk_norm)))
        assert not [k for k in eager if not torch.equal(eager[k], replayed[k])]
        assert torch.equal(eager_next, replayed_next)


class Computed(torch.nn.Module):
    """Tensors computed from other tensors in __init__: the replay does not see the computation."""

    def __init__(self):
        super().__init__()
        self.fine = torch.nn.Linear(4, 4)
        self.scale = torch.nn.Parameter(torch.randn(8) * 0.02)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)))
        self.register_buffer("mask", torch.tril(torch.ones(5, 5)), persistent=False)
        self.raw = torch.nn.Parameter(torch.empty(3))  # never initialised
        self.register_buffer("steps", torch.zeros(()))  # a factory writes it: fine


def test_tensors_no_recorded_op_writes_are_refused_in_one_error_naming_each():
    with pytest.raises(meta_init.ReplayRefused) as refused:
        meta_init.record(Computed)
    message = str(refused.value)
    assert message.count("meta-device build") == 1
    named = [name for name in ("scale", "inv_freq", "mask", "raw", "fine.weight", "fine.bias", "steps")
             if name in message.split("(")[0]]
    assert named == ["scale", "inv_freq", "mask", "raw"], message


@pytest.mark.parametrize("via", ["nn.init", "tensor"])
def test_an_init_with_a_generator_of_its_own_is_refused(via):
    class Seeded(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(4, 4))
            generator = torch.Generator().manual_seed(0)
            if via == "nn.init":
                torch.nn.init.orthogonal_(self.weight, generator=generator)
            else:
                self.weight.data.normal_(generator=generator)

    with pytest.raises(meta_init.ReplayRefused, match="generator"):
        meta_init.record(Seeded)
