"""manifold_param_groups: ManifoldMuon's groups for our GPT, transformers' GPT-2 and Llama, from a
preset, a role spec or glob patterns; the weights start on their manifolds and stay there."""
import os

import pytest
import torch
import torch.distributed as dist

from errors import UserError
from gloo_ranks import end_rank_process, run_ranks
from manifolds import ManifoldMuon, manifold_param_groups, manifold_violation
from manifolds.assignment import parse_assignment
from manifolds.param_groups import assigned_matrices, muon_groups
from model import GPT, GPTConfig

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()  # the tiny vocabulary draws a warning about GPT-2's token ids
from hf_models import tiny_gpt2, tiny_llama  # noqa: E402


def our_gpt(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(2, 2, 32, 16, 64))


def described(model, groups):
    """[(group name, manifold or blocks, [parameter names])]."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [(g["name"], g.get("manifold") or g["blocks"], [names[id(p)] for p in g["params"]]) for g in groups]


def named(model, params):
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for p in params]


def layers(template):
    return [template.format(layer) for layer in range(2)]


HETERO = {
    "gpt2": [("attn.qkv=stiefel", "stiefel", layers("transformer.h.{}.attn.c_attn.weight")),
             ("attn.proj=stiefel", "stiefel", layers("transformer.h.{}.attn.c_proj.weight")),
             ("mlp.fc=dgram", "dgram", layers("transformer.h.{}.mlp.c_fc.weight")),
             ("mlp.proj=dgram", "dgram", layers("transformer.h.{}.mlp.c_proj.weight"))],
    # q, k, v are separate matrices (k and v grouped-query: 16 x 32); gate and up are both the expansion
    "llama": [("attn.q=stiefel", "stiefel", layers("model.layers.{}.self_attn.q_proj.weight")),
              ("attn.k=stiefel", "stiefel", layers("model.layers.{}.self_attn.k_proj.weight")),
              ("attn.v=stiefel", "stiefel", layers("model.layers.{}.self_attn.v_proj.weight")),
              ("attn.proj=stiefel", "stiefel", layers("model.layers.{}.self_attn.o_proj.weight")),
              ("mlp.fc=dgram", "dgram", ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
                                         "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"]),
              ("mlp.proj=dgram", "dgram", layers("model.layers.{}.mlp.down_proj.weight"))],
}
MODELS = {"gpt2": tiny_gpt2, "llama": tiny_llama}


@pytest.mark.parametrize("arch", MODELS)
def test_hetero_puts_attention_on_stiefel_mlp_on_dgram_and_the_rest_aside(arch):
    model = MODELS[arch]()
    groups, rest = manifold_param_groups(model, "hetero")
    assert described(model, groups) == HETERO[arch]
    chosen = {n for _, _, names in HETERO[arch] for n in names}
    # embeddings, norms, biases, the LM head (GPT-2 ties it to wte): every other parameter, in model order
    assert named(model, rest) == [n for n, _ in model.named_parameters() if n not in chosen]
    assert not any(p.dim() == 2 and ("attn" in n or "mlp" in n) for n, p in zip(named(model, rest), rest))


@pytest.mark.parametrize("arch", MODELS)
def test_weights_are_on_their_manifolds_after_the_call_and_after_12_steps(arch):
    model = MODELS[arch]()
    groups, rest = manifold_param_groups(model, "hetero")

    def worst():
        return max(manifold_violation(p.detach(), g["manifold"]) for g in groups for p in g["params"])

    assert worst() <= 1e-5
    muon = ManifoldMuon(groups, lr=0.05)
    adamw = torch.optim.AdamW(rest, lr=3e-3)
    batch = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    matrices = [p for g in groups for p in g["params"]]
    losses, moves = [], []
    for _ in range(12):
        loss = model(batch, labels=batch).loss
        loss.backward()
        before = [p.detach().clone() for p in matrices]
        muon.step()
        moves += [torch.linalg.matrix_norm(p.detach() - old, ord=2).item() / 0.05 for p, old in zip(matrices, before)]
        adamw.step()
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses
    # AdamW alone lowers the loss and an unmoved matrix stays on its manifold: every Muon matrix must
    # also have taken its steps, each of spectral norm lr (0.98-1.005 lr measured)
    assert len(moves) == 12 * len(matrices) and all(0.9 <= move <= 1.1 for move in moves), moves
    assert worst() <= 1e-4


def test_matrices_on_their_manifolds_are_left_bitwise_by_the_groups_the_constructor_and_add_param_group():
    # a resume as PyTorch Lightning runs it: the trained weights are restored, then
    # configure_optimizers builds the groups and the optimizer again (tests/test_torch_clients.py's
    # Lightning run: Llama; here GPT-2's Conv1D weights, stored transposed)
    model = tiny_gpt2()
    groups, _ = manifold_param_groups(model, "hetero", adamw=True)
    muon = ManifoldMuon(groups, lr=0.05)
    batch = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        model(batch, labels=batch).loss.backward()
        muon.step()
        muon.zero_grad()
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert 0 < max(manifold_violation(p.detach(), g["manifold"], transposed=g.get("transposed", False))
                   for g in groups[:-1] for p in g["params"]) <= 1e-4  # on them, not exactly (rounding)
    again, _ = manifold_param_groups(model, "hetero", adamw=True)
    ManifoldMuon(again[:1], lr=0.05).add_param_group(again[1])
    for n, p in model.named_parameters():
        assert torch.equal(p, trained[n]), n
    # one matrix moved off its manifold is projected again, alone
    name = named(model, groups[0]["params"])[0]
    p = model.get_parameter(name)
    with torch.no_grad():
        p.mul_(1.01)
    manifold_param_groups(model, "hetero", adamw=True)
    assert {n for n, q in model.named_parameters() if not torch.equal(q, trained[n])} == {name}


def test_the_projection_moves_only_the_chosen_matrices():
    model = tiny_llama()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    groups, rest = manifold_param_groups(model, "attn.v=dgram")  # the other roles: plain Muon, not projected
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == {"model.layers.0.self_attn.v_proj.weight", "model.layers.1.self_attn.v_proj.weight"}
    assert [g["name"] for g in groups][:3] == ["attn.q=none", "attn.k=none", "attn.v=dgram"]


def test_patterns_choose_matrices_by_name_and_later_patterns_override():
    model = tiny_gpt2()
    groups, rest = manifold_param_groups(model, {"*.weight": "stiefel", "*.ln_*": None,  # None: to rest
                                                 "transformer.h.1.mlp.*.weight": "oblique",
                                                 "transformer.w?e.weight": "dgram"})
    by_name = {n: m for _, m, names in described(model, groups) for n in names}
    assert by_name["transformer.h.0.mlp.c_fc.weight"] == "stiefel"
    assert by_name["transformer.h.1.mlp.c_fc.weight"] == by_name["transformer.h.1.mlp.c_proj.weight"] == "oblique"
    assert by_name["transformer.wte.weight"] == by_name["transformer.wpe.weight"] == "dgram"
    assert [g["name"] for g in groups][0] == "transformer.w?e.weight=dgram"  # model order: wte comes first
    assert all(p.dim() == 1 for p in rest)
    assert "transformer.h.0.ln_1.weight" in named(model, rest) and "transformer.h.0.ln_1.weight" not in by_name
    for group in groups:
        for p in group["params"]:
            assert manifold_violation(p.detach(), group["manifold"]) <= 1e-5


def test_a_pattern_that_matches_nothing_is_an_error_naming_it():
    with pytest.raises(UserError, match=r"'\*\.attn\.q_proj\.weight' matches no parameter"):
        manifold_param_groups(tiny_gpt2(), {"*.attn.c_attn.weight": "stiefel", "*.attn.q_proj.weight": "stiefel"})


def test_a_pattern_matching_a_vector_is_an_error_naming_both():
    with pytest.raises(UserError, match=r"'\*\.attn\.\*' matches transformer\.h\.0\.attn\.c_attn\.bias of shape "
                                        r"\(96,\): ManifoldMuon takes 2-D matrices"):
        manifold_param_groups(tiny_gpt2(), {"*.attn.*": "stiefel"})


def test_an_unknown_manifold_is_an_error_naming_it():
    with pytest.raises(UserError, match="unknown manifold 'sphere' for pattern"):
        manifold_param_groups(tiny_gpt2(), {"*.attn.c_attn.weight": "sphere"})
    with pytest.raises(UserError, match="unknown manifold 'sphere'"):
        manifold_param_groups(tiny_gpt2(), "attn=sphere")


def test_a_role_spec_on_an_unknown_architecture_asks_for_patterns():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    with pytest.raises(UserError, match="Sequential has none of the attention and MLP matrices.*glob patterns"):
        manifold_param_groups(model, "hetero")
    # one role known, one not: the spec cannot be honoured either
    attention_only = torch.nn.ModuleDict({"h": torch.nn.ModuleList([torch.nn.ModuleDict(
        {"attn": torch.nn.ModuleDict({"c_attn": torch.nn.Linear(8, 24), "c_proj": torch.nn.Linear(8, 8)})})])})
    with pytest.raises(UserError, match="assigns mlp.fc, mlp.proj, which ModuleDict does not have.*patterns"):
        manifold_param_groups(attention_only, "hetero")
    assert [g["name"] for g in manifold_param_groups(attention_only, "attn=stiefel")[0]] == \
        ["attn.qkv=stiefel", "attn.proj=stiefel"]


def test_splitting_gpt2s_conv1d_qkv_is_refused_and_llamas_maps_to_its_projections():
    with pytest.raises(UserError, match=r"transformer\.h\.0\.attn\.c_attn\.weight of shape \(32, 96\).*Conv1D"):
        manifold_param_groups(tiny_gpt2(), "hetero-qk")
    model = tiny_llama()
    groups, _ = manifold_param_groups(model, "hetero-qk")
    assert [(name, m) for name, m, _ in described(model, groups)] == [
        ("attn.q=stiefel", "stiefel"), ("attn.k=stiefel", "stiefel"), ("attn.v=dgram", "dgram"),
        ("attn.proj=dgram", "dgram"), ("mlp.fc=dgram", "dgram"), ("mlp.proj=dgram", "dgram")]


OUR_GPT = [  # the trainer's groups before it used manifold_param_groups (2 layers)
    ("hetero", [("attn.qkv=stiefel", "stiefel", layers("blocks.{}.attn.c_attn.weight")),
                ("attn.proj=stiefel", "stiefel", layers("blocks.{}.attn.c_proj.weight")),
                ("mlp.fc=dgram", "dgram", layers("blocks.{}.mlp.c_fc.weight")),
                ("mlp.proj=dgram", "dgram", layers("blocks.{}.mlp.c_proj.weight"))]),
    ("hetero-qk", [("attn.qkv=q:stiefel|k:stiefel|v:dgram",
                    [(0, 32, "stiefel"), (32, 64, "stiefel"), (64, 96, "dgram")], layers("blocks.{}.attn.c_attn.weight")),
                   ("attn.proj=dgram", "dgram", layers("blocks.{}.attn.c_proj.weight")),
                   ("mlp.fc=dgram", "dgram", layers("blocks.{}.mlp.c_fc.weight")),
                   ("mlp.proj=dgram", "dgram", layers("blocks.{}.mlp.c_proj.weight"))]),
    ("attn.v=dgram", [("attn.qkv=q:none|k:none|v:dgram", [(0, 32, "none"), (32, 64, "none"), (64, 96, "dgram")],
                       layers("blocks.{}.attn.c_attn.weight")),
                      ("attn.proj=none", "none", layers("blocks.{}.attn.c_proj.weight")),
                      ("mlp.fc=none", "none", layers("blocks.{}.mlp.c_fc.weight")),
                      ("mlp.proj=none", "none", layers("blocks.{}.mlp.c_proj.weight"))]),
]


@pytest.mark.parametrize("spec,expected", OUR_GPT, ids=[spec for spec, _ in OUR_GPT])
def test_our_gpt_gets_the_trainers_groups(spec, expected):
    model = our_gpt()
    groups, rest = manifold_param_groups(model, spec)
    assert described(model, groups) == expected
    assert named(model, rest) == ["wte.weight", "wpe.weight", "blocks.0.ln_1.weight", "blocks.0.ln_2.weight",
                                  "blocks.1.ln_1.weight", "blocks.1.ln_2.weight", "ln_f.weight"]


def test_per_layer_assignments_as_the_trainers_auto_switch_makes_them():
    # layer 0 switched to Stiefel attention, layer 1 still on the base: one group per layout, in plan order
    model = our_gpt()
    base = parse_assignment("all-dgram")
    switched = {key: "stiefel" if key.startswith("attn.") else m for key, m in base.items()}
    assert [g["name"] for g in muon_groups(assigned_matrices(model, [switched, base]))] == \
        ["attn.qkv=stiefel", "attn.qkv=dgram", "attn.proj=stiefel", "attn.proj=dgram", "mlp.fc=dgram", "mlp.proj=dgram"]
    with pytest.raises(UserError, match="1 per-layer assignments for a model with a layer 1"):
        assigned_matrices(model, [base])


def test_dgram_cap_groups_carry_their_cap():
    groups, _ = manifold_param_groups(our_gpt(), "mlp=dgram-cap", dgram_cap=2.0)
    assert {g["name"]: g.get("dgram_cap") for g in groups}["mlp.fc=dgram-cap"] == 2.0
    assert "dgram_cap" not in groups[0]


# --- under DDP: each rank solves its share of the groups ---------------------------------

STEPS = 4


def train_tiny_llama(rank=0, world_size=1):
    """Final weights after STEPS steps on one fixed batch, the same on every rank (DDP's average of
    equal gradients is exact, so a difference from one process comes from the sharded step). Llama:
    GPT-2's key bias has no gradient but rounding noise, which AdamW scales up to its lr."""
    model = tiny_llama()
    groups, rest = manifold_param_groups(model, "hetero")
    muon = ManifoldMuon(groups, lr=0.05)  # shards the matrices over the ranks when torch.distributed is up
    adamw = torch.optim.AdamW(rest, lr=3e-3)
    step_model = torch.nn.parallel.DistributedDataParallel(model) if world_size > 1 else model
    batch = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(STEPS):
        step_model(batch, labels=batch).loss.backward()
        muon.step()
        adamw.step()
        model.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, muon.world_size


def rank_main(rank, world_size, store, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        torch.save(train_tiny_llama(rank, world_size), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        end_rank_process()


def test_two_gloo_ranks_end_with_the_weights_of_one_process(tmp_path):
    run_ranks(rank_main, lambda rank: (rank, 2, str(tmp_path / "store"), str(tmp_path)), 2, timeout=120)
    (rank0, world0), (rank1, world1) = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: the same sums in the same order
    try:
        alone, _ = train_tiny_llama()
    finally:
        torch.set_num_threads(threads)
    assert world0 == world1 == 2  # the step was sharded
    for name, weight in alone.items():
        assert torch.equal(rank0[name], rank1[name]), name
        assert (rank0[name] - weight).abs().max() <= 1e-6, name
