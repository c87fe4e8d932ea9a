"""Beyond the paper: per-projection assignment, the capped DGram manifold, automatic assignment."""
import json
import os
import signal

import pytest
import torch

from errors import UserError
from manifolds import ManifoldMuon, manifold_violation, project_to_manifold, steepest_direction
from manifolds.assignment import PRESETS, parse_assignment, qkv_blocks
from manifolds.optimum import cone_optimum, random_point
from test_reliability import data_dir, rows, run, start_then, train_losses  # noqa: F401 (fixture)

# --- spec parsing -----------------------------------------------------------------------


def test_projection_keys_split_the_fused_qkv():
    a = parse_assignment("attn.qk=stiefel,attn.v=dgram,attn.proj=dgram,mlp=dgram")
    assert a == {"attn.q": "stiefel", "attn.k": "stiefel", "attn.v": "dgram", "attn.proj": "dgram",
                 "mlp.fc": "dgram", "mlp.proj": "dgram"}
    assert parse_assignment("hetero-qk") == a and "hetero-qk" in PRESETS
    assert qkv_blocks(a) == [("attn.q", "stiefel"), ("attn.k", "stiefel"), ("attn.v", "dgram")]
    # blocks not named keep the fused value; later entries override earlier ones
    b = parse_assignment("attn=stiefel,attn.v=dgram-cap")
    assert [b[k] for k in ("attn.q", "attn.k", "attn.v", "attn.proj")] == ["stiefel", "stiefel", "dgram-cap", "stiefel"]
    assert parse_assignment("attn.q=dgram,attn=none")["attn.q"] == "none"
    # without a block key the QKV matrix stays one (fused) matrix
    assert qkv_blocks(parse_assignment("hetero")) is None
    assert parse_assignment("mlp=dgram-cap")["mlp.fc"] == "dgram-cap"


@pytest.mark.parametrize("spec, message", [("attn.x=stiefel", "unknown module 'attn.x'"),
                                           ("attn.q=cap", "unknown manifold 'cap'"),
                                           ("attn.qk", "unknown --assign")])
def test_bad_projection_specs_name_the_choices(spec, message):
    with pytest.raises(UserError, match=message) as err:
        parse_assignment(spec)
    assert "attn.qk" in str(err.value) and "dgram-cap" in str(err.value)


# --- the capped DGram manifold -----------------------------------------------------------


def capped_point(shape, seed, cap=None):
    """A DGram point with column norms spread around `cap` and clipped to it, and a random G."""
    W, G = random_point(shape, "dgram", seed, spread=0.5)
    norms = W.norm(dim=-2)
    cap = float(norms.median()) if cap is None else cap
    return W / norms * norms.clamp_max(cap), G, cap


def test_capped_retraction_fixed_point_and_cap():
    W, _, cap = capped_point((48, 12), seed=0)
    below = W * 0.9  # every column strictly below the cap
    assert torch.allclose(project_to_manifold(below, "dgram-cap", cap), below, atol=1e-6)
    # far from the set: a random matrix with large columns comes back within the cap
    X = 3 * torch.randn(48, 12)
    R = project_to_manifold(X, "dgram-cap", cap)
    assert float(R.norm(dim=-2).max()) <= cap * (1 + 1e-6)
    assert manifold_violation(R, "dgram-cap", cap) <= 1e-5
    # columns below the cap keep their norm (DGram's retraction there)
    small = X / X.norm(dim=-2) * torch.linspace(0.1, 2 * cap, 12)
    R = project_to_manifold(small, "dgram-cap", cap)
    assert torch.allclose(R.norm(dim=-2), torch.linspace(0.1, 2 * cap, 12).clamp_max(cap), rtol=1e-5)
    # the violation measures an excess over the cap
    assert manifold_violation(W * 1.5, "dgram-cap", cap) == pytest.approx(0.5, rel=1e-4)


@pytest.mark.parametrize("shape", [(64, 16), (24, 16), (16, 16)])
def test_capped_direction_is_optimal_in_the_tangent_cone(shape):
    for seed in range(2):
        W, G, cap = capped_point(shape, seed)
        capped = W.norm(dim=-2) >= cap * (1 - 1e-4)
        A = steepest_direction(W, G, "dgram-cap", dgram_cap=cap, scheme="admm")  # the optimal scheme
        # the cone: the DGram tangent constraints, and capped columns do not grow (step W - lr A)
        gram = W.mT @ A + A.mT @ W
        off = gram - torch.diag_embed(torch.diagonal(gram))
        assert float(off.abs().max()) / float(W.norm(dim=-2).mean()) <= 2e-3
        assert float(torch.diagonal(W.mT @ A)[capped].min()) >= -1e-5
        # without the cone the plain DGram direction grows capped columns: the test has teeth
        plain = steepest_direction(W, G, "dgram", scheme="admm")
        assert float(torch.diagonal(W.mT @ plain)[capped].min()) < -1e-2
        opt, upper = cone_optimum(W, G, capped)
        assert upper - opt <= 1e-4 * upper, (shape, seed, opt, upper)  # the reference is certified
        quality = float((G / G.norm() * A).sum() / torch.linalg.matrix_norm(A.double(), ord=2)) / opt
        assert quality >= 0.97, (shape, seed, quality)


def test_capped_optimizer_keeps_the_cap():
    torch.manual_seed(0)
    cap = 0.8
    params = [torch.nn.Parameter(project_to_manifold(torch.randn(40, 10) * 0.1, "dgram-cap", cap)) for _ in range(3)]
    opt = ManifoldMuon([{"params": params, "manifold": "dgram-cap"}], lr=0.3, dgram_cap=cap)
    for _ in range(15):  # gradients that push every column outwards: -W (grow) plus noise
        for p in params:
            p.grad = -p.detach() + 0.05 * torch.randn_like(p)
        opt.step()
    norms = torch.stack([p.detach().norm(dim=-2) for p in params])
    assert float(norms.max()) <= cap * (1 + 1e-4)
    assert float(norms.min()) >= cap * 0.99  # they did reach the cap
    assert max(manifold_violation(p.detach(), "dgram-cap", cap) for p in params) <= 1e-4


# --- blocks of one parameter as separate matrices -----------------------------------------


def test_row_blocks_are_separate_matrices_in_shared_banks():
    torch.manual_seed(0)
    n = 8
    qkv = [torch.nn.Parameter(torch.randn(3 * n, n) * 0.2) for _ in range(2)]
    proj = [torch.nn.Parameter(torch.randn(n, n) * 0.2) for _ in range(2)]
    blocks = [(0, n, "stiefel"), (n, 2 * n, "stiefel"), (2 * n, 3 * n, "dgram")]
    with torch.no_grad():
        for p in qkv:
            for lo, hi, m in blocks:
                p[lo:hi] = project_to_manifold(p[lo:hi], m)
        for p in proj:
            p.copy_(project_to_manifold(p, "dgram"))
    opt = ManifoldMuon([{"params": qkv, "blocks": blocks, "name": "qkv"},
                        {"params": proj, "manifold": "dgram", "name": "proj", "lr": 0.01}], lr=0.05)
    sizes = {key[0]: len(pieces) for key, pieces in opt.banks()}
    assert sizes == {"stiefel": 4, "dgram": 4}  # q, k of both layers; v and proj of both, across groups
    for _ in range(3):
        for p in qkv + proj:
            p.grad = torch.randn_like(p)
        opt.step()
    for p in qkv:
        for lo, hi, m in blocks:
            assert manifold_violation(p.detach()[lo:hi], m) <= 1e-4
        assert manifold_violation(p.detach(), "stiefel") > 0.1  # the fused matrix is not Stiefel
    assert set(opt.last_stats) == {"qkv/stiefel:8x8", "qkv+proj/dgram:8x8"}
    with pytest.raises(ValueError, match="tile"):
        ManifoldMuon([{"params": qkv, "blocks": [(0, n, "stiefel"), (2 * n, 3 * n, "dgram")]}])


def test_reassign_keeps_momentum_and_drops_the_changed_warm_start():
    torch.manual_seed(0)
    # tall: ADMM keeps a warm start (square Stiefel's exact step keeps none)
    a, b = (torch.nn.Parameter(project_to_manifold(torch.randn(16, 8), "stiefel")) for _ in range(2))
    opt = ManifoldMuon([{"params": [a, b], "manifold": "stiefel"}])
    for p in (a, b):
        p.grad = torch.randn_like(p)
    opt.step()
    momentum, dual = opt.state[a]["momentum_buffer"].clone(), opt.state[a]["dual"].clone()
    assert "dual" in opt.state[a] and "dual" in opt.state[b]
    with torch.no_grad():
        b.copy_(project_to_manifold(b, "dgram"))
    opt.reassign([{"params": [a], "manifold": "stiefel"}, {"params": [b], "manifold": "dgram"}])
    assert torch.equal(opt.state[a]["momentum_buffer"], momentum) and torch.equal(opt.state[a]["dual"], dual)
    assert "momentum_buffer" in opt.state[b] and "dual" not in opt.state[b]
    with pytest.raises(ValueError, match="same parameters"):
        opt.reassign([{"params": [a], "manifold": "stiefel"}])


# --- the trainer ------------------------------------------------------------------------


def test_trainer_with_per_projection_and_capped_assignment(data_dir, tmp_path):  # noqa: F811
    spec = "attn.qk=stiefel,attn.v=dgram-cap,attn.proj=dgram,mlp=dgram"
    result = run(data_dir, tmp_path, "--assign", spec, "--dgram-cap", "0.5", "--max-steps", "10")
    assert result.returncode == 0, result.stderr
    summary = json.load(open(tmp_path / "summary.json"))
    assert set(summary["max_manifold_violation"]) == {"stiefel", "dgram", "dgram-cap"}
    assert max(summary["max_manifold_violation"].values()) <= 1e-4
    evals = [r for r in rows(tmp_path) if "val_loss" in r]
    name = "blocks.0.attn.c_attn.weight"
    assert {f"{name}[q]", f"{name}[k]", f"{name}[v]"} <= set(evals[-1]["manifold_violation"])
    assert evals[-1]["sigma_max"][f"{name}[q]"] == pytest.approx(1.0, abs=1e-4)
    assert evals[-1]["col_norm_max"][f"{name}[v]"] <= 0.5 * (1 + 1e-4)


AUTO = ["--assign", "auto", "--auto-logit-max", "1e-3", "--eval-every", "10", "--ckpt-every", "4", "--keep-ckpts", "9"]


def test_auto_switch_is_logged_and_survives_a_resume(data_dir, tmp_path_factory):  # noqa: F811
    straight = tmp_path_factory.mktemp("auto_straight")
    result = run(data_dir, straight, *AUTO)
    assert result.returncode == 0, result.stderr
    assert "auto: layer 0 attention -> stiefel" in result.stdout
    switches = json.load(open(straight / "summary.json"))["auto_switches"]
    assert [(s["step"], s["layer"]) for s in switches] == [(10, 0)]
    assert "attention logit max" in switches[0]["reason"]
    assert [r["step"] for r in rows(straight) if r.get("event") == "auto_switch"] == [10]
    assert json.load(open(straight / "summary.json"))["max_manifold_violation"]["stiefel"] <= 1e-4
    # interrupted after the switch, resumed: the same trajectory and the same single switch
    resumed = tmp_path_factory.mktemp("auto_resumed")
    proc = start_then(data_dir, resumed, lambda d: os.path.exists(os.path.join(d, "ckpt_00000012.pt")), 1, *AUTO)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert proc.returncode == 4
    result = run(data_dir, resumed, *AUTO, "--resume", "auto")
    assert result.returncode == 0, result.stderr
    assert train_losses(resumed) == train_losses(straight)
    assert json.load(open(resumed / "summary.json"))["auto_switches"] == switches
    # from a checkpoint before the switch: the switch is taken again, at the same step
    again = tmp_path_factory.mktemp("auto_again")
    result = run(data_dir, again, *AUTO, "--resume", str(straight / "ckpt_00000008.pt"))
    assert result.returncode == 0, result.stderr
    assert json.load(open(again / "summary.json"))["auto_switches"] == switches
    assert [l for s, l in train_losses(again)] == [l for s, l in train_losses(straight) if s > 8]
