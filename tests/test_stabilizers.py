"""The attention-logit stabilizers: --qk-norm, --qk-clip TAU, --attn-softcap C, combinable with any --assign."""
import json

import pytest
import torch
import torch.nn.functional as F

import train_gpt2
from errors import UserError
from manifolds import manifold_violation
from model import GPT, GPTConfig
from test_reliability import data_dir, rows, run, train_losses  # noqa: F401 (fixture)
from training.diagnostics import AttentionProbe
from training.qk_clip import QKClip

BASE = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--seq-len", "16", "--vocab-size", "64"]


def build(assign="unconstrained", *flags, scale=1.0, seed=0):
    """(model, matrices) of a tiny GPT whose weights are projected onto their manifolds, the
    attention weights `scale` times their initial size (large logits)."""
    args = train_gpt2.parse_args(BASE + ["--assign", assign, *flags])
    train_gpt2.validate_args(args, world_size=1)
    torch.manual_seed(seed)
    cfg = GPTConfig(args.n_layer, args.n_head, args.n_embd, args.seq_len, args.vocab_size,
                    qk_norm=args.qk_norm, attn_softcap=args.attn_softcap)
    model = GPT(cfg)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.c_attn.weight.mul_(scale)
    matrices = train_gpt2.assigned_matrices(model, train_gpt2.layer_assignments(args, None))
    if assign != "unconstrained":
        train_gpt2.project_matrices(matrices, args.dgram_cap)
    return model, matrices, args


def probe_logit_max(model, x):
    probe = AttentionProbe([b.attn.c_attn for b in model.blocks], model.cfg.n_head, [b.attn for b in model.blocks])
    with probe, torch.no_grad():
        model.eval()
        model(x, x)
    return probe.results()


def tokens(seed=0):
    return torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(seed))


def test_flags_parse_and_bad_values_are_user_errors():
    args = train_gpt2.parse_args(BASE + ["--qk-clip", "50", "--attn-softcap", "30"])
    train_gpt2.validate_args(args, world_size=1)
    assert (args.qk_norm, args.qk_clip, args.attn_softcap) == (False, 50.0, 30.0)
    assert train_gpt2.parse_args(BASE + ["--qk-norm"]).qk_norm
    for flags, message in [(["--qk-clip", "-1"], "--qk-clip must be positive"),
                           (["--attn-softcap", "-3"], "--attn-softcap must be positive"),
                           (["--qk-clip", "5", "--optimizer", "adamw"], "needs --optimizer muon"),
                           (["--qk-clip", "5", "--qk-norm"], "use one of them")]:
        with pytest.raises(UserError, match=message):
            train_gpt2.validate_args(train_gpt2.parse_args(BASE + flags), world_size=1)


def test_softcap_bounds_the_logits_and_is_attention_otherwise():
    model, _, _ = build("unconstrained", "--attn-softcap", "2", scale=30.0)
    uncapped, _, _ = build("unconstrained", scale=30.0)
    stats = probe_logit_max(model, tokens())
    assert max(stats["attn_logit_max_raw"]) > 10  # large raw logits ...
    assert max(stats["attn_logit_max"]) <= 2.0     # ... capped at C
    assert min(stats["softcap_fraction"]) > 0.1    # the cap acts on many of them
    # layer 0 sees the same input with and without the cap: its raw logits are the plain ones
    assert probe_logit_max(uncapped, tokens())["attn_logit_max"][0] == pytest.approx(
        stats["attn_logit_max_raw"][0], rel=1e-5)
    # the explicit-logit path is the fused kernel's attention when the cap never acts
    attention = build("unconstrained", "--attn-softcap", "1e6")[0].blocks[0].attn
    x = torch.randn(2, 16, 32)
    q, k, v = attention.heads(attention.c_attn(x))
    expected = attention.c_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True)
                                .transpose(1, 2).reshape(2, 16, 32))
    torch.testing.assert_close(attention(x), expected, rtol=1e-5, atol=1e-5)


def test_qk_norm_bounds_the_logits_by_sqrt_d_head():
    model, _, _ = build("unconstrained", "--qk-norm", scale=30.0)
    plain, _, _ = build("unconstrained", scale=30.0)
    d_head = 16
    assert max(probe_logit_max(plain, tokens())["attn_logit_max"]) > d_head ** 0.5
    # |q| = |k| = sqrt(d_head) after RMS normalisation with unit gains: |q.k| / sqrt(d) <= sqrt(d)
    assert max(probe_logit_max(model, tokens())["attn_logit_max"]) <= d_head ** 0.5 * (1 + 1e-5)
    assert any("q_norm" in name for name, _ in model.named_parameters())  # learned gains (AdamW's)


def clipped(assign, tau, scale=5.0):
    """(logit maxima per layer before, after one QK-Clip step, the clip, model, matrices). Layer 0
    sees the same input before and after; later layers see what the clipped layers made."""
    model, matrices, _ = build(assign, scale=scale)
    clip = QKClip([b.attn for b in model.blocks], matrices, tau)
    x = tokens(1)
    model.train()
    with torch.no_grad():
        model(x, x)  # a training forward: the per-head maxima QK-Clip compares with tau
    before = torch.stack([b.attn.logit_max.clone() for b in model.blocks])
    clip.step()
    model.train()
    with torch.no_grad():
        model(x, x)
    after = torch.stack([b.attn.logit_max.clone() for b in model.blocks])
    return before, after, clip, model, matrices


def test_qk_clip_rescales_the_heads_over_tau_plain_muon():
    before, after, clip, _, _ = clipped("unconstrained", tau=1.0)
    over = before > 1.0
    first, after0 = before[0], after[0]
    assert over[0].any() and (~over[0]).any()  # some heads over tau, some under: per head
    # logits are bilinear in W_q, W_k: a head over tau lands on tau, one under is untouched
    torch.testing.assert_close(after0[over[0]], torch.ones_like(after0[over[0]]), rtol=1e-4, atol=0)
    torch.testing.assert_close(after0[~over[0]], first[~over[0]], rtol=1e-5, atol=0)
    stats = clip.stats()
    assert stats["qk_clip_heads"] == over.sum(dim=1).tolist() and stats["qk_clip_events"] == 1


def test_qk_clip_keeps_dgram_on_its_manifold_and_skips_stiefel():
    before, after, clip, model, matrices = clipped("all-dgram", tau=0.03, scale=1.0)
    assert (before[0] > 0.03).all()
    assert after[0].max() == pytest.approx(0.03, rel=1e-4)  # the layer's worst head sets the matrix's factor
    assert (after[0] < before[0]).all()  # every head of the layer scaled with it
    for _, p, key, blocks, _ in matrices:
        for _, lo, hi, manifold in blocks:
            assert manifold_violation(p.detach()[lo:hi], manifold) <= 1e-5
    before, after, clip, _, _ = clipped("all-stiefel", tau=0.05, scale=1.0)
    assert (before > 0.05).all()
    torch.testing.assert_close(after, before)  # a Stiefel matrix has no rescaling on its manifold
    assert clip.stats()["qk_clip_skipped"] == [1, 1] and clip.stats()["qk_clip_heads"] == [2, 2]


def test_qk_clip_with_split_blocks_scales_the_free_side_fully():
    # q on Stiefel (not scalable), k plain Muon: k's rows take the whole factor gamma
    before, after, clip, _, _ = clipped("attn.q=stiefel,attn.k=none,attn.v=none", tau=0.3, scale=1.0)
    over = before[0] > 0.3
    assert over.any()
    torch.testing.assert_close(after[0][over], torch.full_like(after[0][over], 0.3), rtol=1e-4, atol=0)


CLIP_RUN = ["--assign", "unconstrained", "--qk-clip", "0.05", "--ckpt-every", "4", "--keep-ckpts", "9"]


def test_qk_clip_shows_in_diagnostics_and_survives_a_resume(data_dir, tmp_path_factory):  # noqa: F811
    straight = tmp_path_factory.mktemp("clip_straight")
    result = run(data_dir, straight, *CLIP_RUN, "--attn-softcap", "20")
    assert result.returncode == 0, result.stderr
    evals = [r for r in rows(straight) if "val_loss" in r]
    assert evals[-1]["qk_clip_events"] > 0 and sum(evals[-1]["qk_clip_heads"]) > 0
    assert len(evals[-1]["softcap_fraction"]) == 1  # one layer: soft-capping's diagnostics too
    assert max(evals[-1]["attn_logit_max"]) <= 0.05 * 3  # clipped on each train batch; val batches differ
    resumed = tmp_path_factory.mktemp("clip_resumed")
    result = run(data_dir, resumed, *CLIP_RUN, "--attn-softcap", "20",
                 "--resume", str(straight / "ckpt_00000008.pt"))
    assert result.returncode == 0, result.stderr
    assert [l for s, l in train_losses(resumed)] == [l for s, l in train_losses(straight) if s > 8]
    last = [r for r in rows(resumed) if "val_loss" in r][-1]
    assert (last["qk_clip_heads"], last["qk_clip_events"]) == (evals[-1]["qk_clip_heads"], evals[-1]["qk_clip_events"])
    # a stabilizer is part of what is trained: resuming without it is refused
    result = run(data_dir, tmp_path_factory.mktemp("clip_refused"), *CLIP_RUN, "--resume",
                 str(straight / "ckpt_00000008.pt"))
    assert result.returncode == 2 and "--attn-softcap" in result.stderr
    assert json.load(open(straight / "summary.json"))["status"] == "completed"
    # sample.py / export_hf.py rebuild the model with its stabilizers
    from training.model_io import load_model
    model = load_model(torch.load(straight / "ckpt_00000008.pt", weights_only=False))
    assert model.cfg.attn_softcap == 20.0 and model.blocks[0].attn.softcap == 20.0


def test_qk_clip_tracks_the_logit_the_softmax_sees_with_and_without_a_cap():
    # the training forward's per-head maxima (kernels.causal_logit_max, then scale and cap) against
    # every head's explicit capped logits in float64, from each layer's captured input
    for flags in ([], ["--attn-softcap", "2"]):
        model, _, _ = build("unconstrained", *flags, scale=30.0)
        inputs = []
        for block in model.blocks:
            block.attn.track_logits = True
            block.attn.logit_max.fill_(-float("inf"))
            block.attn.register_forward_pre_hook(lambda module, args: inputs.append(args[0].detach()))
        model.train()
        with torch.no_grad():
            model(tokens(), tokens())
        for block, x in zip(model.blocks, inputs):
            attention = block.attn
            q, k, _ = attention.heads(attention.c_attn(x))
            logits = q.double() @ k.double().mT / attention.d_head ** 0.5
            if attention.softcap:
                logits = attention.softcap * torch.tanh(logits / attention.softcap)
            T = x.size(1)
            expected = logits.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -float("inf")).amax(dim=(0, 2, 3))
            torch.testing.assert_close(attention.logit_max.double(), expected, rtol=1e-5, atol=1e-6)
        if flags:
            assert max(block.attn.logit_max.max().item() for block in model.blocks) <= 2.0
