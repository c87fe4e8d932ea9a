"""The sharded step's resident copies (manifolds/sharded.py: resident_flags, record_resident)
cannot go stale: weights and warm starts written outside the step, by any route, are seen.

One launch of 2 gloo ranks, a tiny Llama (hetero) under FSDP2 (fully_shard per layer and at the
root over a CPU mesh). Each case trains 2 steps, changes the shards in place, and trains 2 more,
once with resident copies (--exchange-opt resident=on) and once without (every W and warm start
sent each step): the two must end bit for bit equal, and the run with copies must have used them
(fewer bytes received in a steady step). The edits are the ones version counters do not see:
p.data.mul_, the local tensor's .data, torch.distributed.checkpoint's in-place load of the model
(and of the optimizer alone: the warm starts), a QK-Clip-like scaling of some rows through
param.data; and bf16-stored parameters, unedited (the shards round every new W to bf16).
"""
import os

import pytest
import torch
import torch.distributed as dist

from gloo_ranks import end_rank_process, run_ranks
from manifolds import ManifoldMuon, manifold_param_groups
from manifolds.exchange import ExchangeOptions
from manifolds.plan import SolverOptions

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB, SEQ, BATCH = 64, 8, 4
EDITS = ["none", "data", "local", "dcp-model", "dcp-optim", "qk-clip", "bf16"]


def build(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, bos_token_id=0, eos_token_id=0))
    return model.to(dtype)


def step(model, opt, index, rank):
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(10 + index))
    rows = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
    logits = model(tokens[rows, :-1]).logits.float()
    torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[rows, 1:].reshape(-1)).backward()
    opt.step()
    opt.zero_grad()
    return dict(opt.exchange_counts)


def edit(kind, model, opt, path):
    """Change the shards in place, on every rank, by a route that moves no version counter."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from manifolds.sharded import chunk_range
    target = model.model.layers[1].self_attn.k_proj.weight  # (16, 32): 8 rows a rank
    with torch.no_grad():
        if kind == "data":
            target.data.mul_(0.9)
        elif kind == "local":
            target.to_local().data.mul_(0.9)
        elif kind == "qk-clip":  # training/qk_clip.py scales rows of W through param.data
            q = model.model.layers[0].self_attn.q_proj.weight
            lo, hi = chunk_range(q.size(0), 2, dist.get_rank())
            rows = torch.arange(lo, hi)
            local = q.data.to_local()
            local[rows < 8] *= 0.8  # the first heads' rows, wherever they lie
        elif kind.startswith("dcp"):  # the step-0 state, loaded in place (the idiom before set_state_dict)
            model_state, optim_state = get_state_dict(model, opt)
            state = {"model": model_state} if kind == "dcp-model" else {"optim": optim_state}  # the warm starts alone
            dcp.load(state, checkpoint_id=path)


def run(kind, resident, rank, mesh, out_dir):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard
    model = build(torch.bfloat16 if kind == "bf16" else torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    groups, _ = manifold_param_groups(model, "hetero", adamw={"lr": 3e-3})
    opt = ManifoldMuon(groups, lr=0.05, resident=resident)
    path = os.path.join(out_dir, f"{kind}-{resident}")
    counts = [step(model, opt, 0, rank)]
    if kind.startswith("dcp"):  # a checkpoint of step 1 (its warm starts are not zero)
        model_state, optim_state = get_state_dict(model, opt)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    counts.append(step(model, opt, 1, rank))
    edit(kind, model, opt, path)
    counts += [step(model, opt, index, rank) for index in (2, 3)]
    weights = {name: p.full_tensor().float().clone() for name, p in model.named_parameters()}
    return {"weights": weights, "counts": counts}


def hyperball_radius(rank, mesh, out_dir):
    """The Hyperball's radius of sharded matrices: stored from the whole matrix when the group is
    added, kept by the steps, saved by DCP and loaded into a fresh model's optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard
    from manifolds.sharded import stored_radius

    def sharded_model(seed):
        model = build(seed=seed)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        groups, _ = manifold_param_groups(model, {"*_proj.weight": "hyperball"}, adamw={"lr": 3e-3})
        return model, ManifoldMuon(groups, lr=0.05)

    model, opt = sharded_model(0)
    matrices = {name: p for name, p in model.named_parameters() if name.endswith("_proj.weight")}
    out = {"start": {name: (float(stored_radius(opt, p)), float(p.detach().full_tensor().double().norm()))
                     for name, p in matrices.items()}}
    for index in range(2):
        step(model, opt, index, rank)
    out["after"] = {name: (float(stored_radius(opt, p)), float(p.detach().full_tensor().double().norm()))
                    for name, p in matrices.items()}
    model_state, optim_state = get_state_dict(model, opt)
    path = os.path.join(out_dir, "hyperball")
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    fresh, fresh_opt = sharded_model(1)
    out["fresh"] = {name: float(stored_radius(fresh_opt, p)) for name, p in fresh.named_parameters() if name in matrices}
    model_state, optim_state = get_state_dict(fresh, fresh_opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    out["loaded"] = {name: stored_radius(fresh_opt, p).clone() for name, p in fresh.named_parameters() if name in matrices}
    return out


def rank_main(rank, store, out_dir):
    torch.set_num_threads(1)
    from torch.distributed import checkpoint as _dcp, fsdp as _fsdp  # noqa: F401  (before the group)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (2,))
        results = {f"{kind}/{resident}": run(kind, resident, rank, mesh, out_dir)
                   for kind in EDITS for resident in ("on", "off")}
        results["radius"] = hyperball_radius(rank, mesh, out_dir)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        end_rank_process()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("resident"))
    run_ranks(rank_main, lambda rank: (rank, os.path.join(out_dir, "store"), out_dir), 2, timeout=300)
    return [torch.load(os.path.join(out_dir, f"rank{rank}.pt")) for rank in range(2)]


@pytest.mark.parametrize("kind", EDITS)
def test_resident_copies_see_every_in_place_write(results, kind):
    on, off = results[0][f"{kind}/on"], results[0][f"{kind}/off"]
    gaps = {name: (on["weights"][name] - off["weights"][name]).abs().max().item() for name in on["weights"]}
    assert max(gaps.values()) == 0.0, {name: gap for name, gap in gaps.items() if gap}
    # bytes received per step, both ranks together
    received = {run: [sum(rank[f"{kind}/{run}"]["counts"][step]["received"] for rank in results) for step in range(4)]
                for run in ("on", "off")}
    # the copies were used: steady steps receive less with them
    assert received["on"][1] < received["off"][1] and received["on"][3] < received["off"][3], received
    # the step after an edit sent the edited matrices again (and only after an edit)
    assert (received["on"][2] > received["on"][3]) == (kind not in ("none", "bf16")), received


# --- options given to the Python API as strings: parsed as --solver-opt parses them -----------------

@pytest.mark.parametrize("text, value", [("off", False), ("on", True), ("False", False), ("true", True)])
def test_a_switch_given_as_a_string_is_parsed_as_the_cli_parses_it(text, value):
    assert ExchangeOptions.from_kwargs(resident=text).resident is value
    assert SolverOptions.from_kwargs(sharpen=text).sharpen is value
    assert ManifoldMuon([torch.nn.Parameter(torch.zeros(4, 2))], overlap=text).exchange.options.overlap is value


def test_other_options_given_as_strings_are_parsed_or_refused():
    options = SolverOptions.from_kwargs(iterations="4", dual_step="0.5", capturable="off", scheme="admm")
    assert (options.iterations, options.dual_step, options.capturable, options.scheme) == (4, 0.5, False, "admm")
    assert SolverOptions.from_kwargs(capturable="auto").capturable == "auto"
    for bad in ({"resident": "no"}, {"resident": "1"}, {"iterations": "three"}, {"iterations": "2.5"},
                {"dual_step": "nan"}, {"capturable": "yes"}, {"iterations": "-1"}, {"resident": 1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            (ExchangeOptions if "resident" in bad else SolverOptions).from_kwargs(**bad)
    with pytest.raises(ValueError, match="resident"):
        ManifoldMuon([torch.nn.Parameter(torch.zeros(4, 2))], resident="of")


def test_the_hyperball_radius_of_sharded_matrices_is_kept_and_goes_through_dcp(results):
    for rank in results:
        out = rank["radius"]
        assert out["start"] == results[0]["radius"]["start"]  # the same on every rank
        for name, (radius, norm) in out["start"].items():  # the whole matrix's norm (float64 sums)
            assert abs(radius / norm - 1) <= 1e-12, name
        for name, (radius, norm) in out["after"].items():
            assert radius == out["start"][name][0] and abs(norm / radius - 1) <= 1e-6, name
        for name, loaded in out["loaded"].items():  # the saved radius, not the fresh model's own
            assert loaded.dtype == torch.float64 and float(loaded) == out["start"][name][0], name
            assert out["fresh"][name] != out["start"][name][0], name


def test_the_digest_sees_every_change_of_bits_and_takes_empty_shards():
    from manifolds.sharded import digest
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))
    y = x.clone()
    y[0, 0], y[3, 2] = x[3, 2], x[0, 0]  # a swap: the plain sum of bits stays, the weighted one moves
    assert digest(y)[0] == digest(x)[0] and digest(y)[1] != digest(x)[1]
    z = x.clone()
    z[5, 4] = torch.nextafter(z[5, 4], torch.tensor(float("inf")))  # one ulp of one entry
    assert not torch.equal(digest(z), digest(x))
    assert torch.equal(digest(x.bfloat16()), digest(x.bfloat16().clone()))
    assert torch.equal(digest(torch.zeros(0, 5)), torch.zeros(2, dtype=torch.int64))  # a rank with no rows
