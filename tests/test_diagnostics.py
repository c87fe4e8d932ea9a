"""The eval-row diagnostics: attention logits and saturation, singular values, manifold state."""
import glob
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import train_gpt2
from model import GPT, GPTConfig
from synthetic import TINY_MODEL, make_shards
from training.diagnostics import AttentionProbe, matrix_stats
from training.run_log import flat_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVAL_KEYS = {"attn_logit_max", "softmax_max_prob", "sigma_max", "sigma_min", "manifold_violation",
             "col_norm_min", "col_norm_max", "eval_ms", "diagnostics_ms"}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_shards(str(tmp_path_factory.mktemp("data")))


def reference_attention_stats(qkv, n_head):
    """Pair by pair in float64: max |q_i.k_j|/sqrt(d) over j <= i, mean over queries of max_j softmax."""
    B, T, three_C = qkv.shape
    C = three_C // 3
    d = C // n_head
    x = qkv.double()
    logit_max, prob_sum = 0.0, 0.0
    for b in range(B):
        for h in range(n_head):
            q, k = x[b, :, h * d:(h + 1) * d], x[b, :, C + h * d:C + (h + 1) * d]
            for i in range(T):
                logits = torch.stack([q[i] @ k[j] for j in range(i + 1)]) / math.sqrt(d)
                logit_max = max(logit_max, float(logits.abs().max()))
                prob_sum += float(torch.softmax(logits, dim=0).max())
    return logit_max, prob_sum / (B * n_head * T)


@pytest.mark.parametrize("chunk", [AttentionProbe.CHUNK_ELEMENTS, 2 * 6 * 6])  # one chunk; one sequence each
def test_attention_stats_match_a_pair_by_pair_reference(chunk):
    torch.manual_seed(0)
    qkv = 3 * torch.randn(3, 6, 3 * 8)
    probe = AttentionProbe([], n_head=2)
    probe.CHUNK_ELEMENTS = chunk
    logit_max, max_prob, _ = probe.attention_stats(qkv)
    want_logit, want_prob = reference_attention_stats(qkv, 2)
    assert float(logit_max) == pytest.approx(want_logit, rel=1e-5)
    assert float(max_prob) == pytest.approx(want_prob, rel=1e-5)


def test_attention_stats_are_fp32_inside_bf16_autocast():
    # The eval runs the probe inside the forward pass's autocast; its q.k must not be a bf16 product
    # (relative error ~4e-3 against the fp64 reference; fp32 gives ~1e-7).
    torch.manual_seed(0)
    qkv = 3 * torch.randn(2, 6, 3 * 8)
    probe = AttentionProbe([], n_head=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logit_max, max_prob, _ = probe.attention_stats(qkv)
    want_logit, want_prob = reference_attention_stats(qkv, 2)
    assert logit_max.dtype == torch.float32
    assert float(logit_max) == pytest.approx(want_logit, rel=1e-5)
    assert float(max_prob) == pytest.approx(want_prob, rel=1e-5)


def tiny_model_and_val(data_dir):
    args = train_gpt2.parse_args(["--data-dir", data_dir, *TINY_MODEL, "--n-layer", "2", "--eval-tokens", "512"])
    train_gpt2.validate_args(args)
    torch.manual_seed(0)
    model = GPT(GPTConfig(2, 2, 32, 32, 64))
    stream = train_gpt2.TokenStream(train_gpt2.find_shards(data_dir, "val"), 64)
    device, _, autocast = train_gpt2.resolve_device(args)
    return args, model, stream, device, autocast


def test_probe_reads_the_models_own_logits_without_changing_the_loss(data_dir):
    args, model, stream, device, autocast = tiny_model_and_val(data_dir)
    plain, _ = train_gpt2.evaluate(model, stream, args, device, autocast)
    probe = AttentionProbe([b.attn.c_attn for b in model.blocks], n_head=2)
    probed, _ = train_gpt2.evaluate(model, stream, args, device, autocast, probe=probe)
    assert probed == plain  # the model still runs SDPA; the probe only watches
    before = probe.results()
    assert len(before["attn_logit_max"]) == 2 and not probe.handles  # hooks removed afterwards
    # The mechanism: scaling W_Q by c scales every logit by c, and sharpens the softmax.
    with torch.no_grad():
        for block in model.blocks:
            block.attn.c_attn.weight[:32] *= 8.0
    probe = AttentionProbe([b.attn.c_attn for b in model.blocks], n_head=2)
    train_gpt2.evaluate(model, stream, args, device, autocast, probe=probe)
    after = probe.results()
    assert after["attn_logit_max"][0] == pytest.approx(8 * before["attn_logit_max"][0], rel=1e-4)
    assert after["softmax_max_prob"][0] > before["softmax_max_prob"][0]
    assert all(1 / 32 < p <= 1 for p in before["softmax_max_prob"] + after["softmax_max_prob"])


def test_matrix_stats_against_svd_and_the_manifolds():
    torch.manual_seed(0)
    n = 16
    qkv = torch.randn(3 * n, n)
    fc = torch.linalg.qr(torch.randn(4 * n, n))[0] * torch.linspace(0.5, 3.0, n)  # DGram: Q diag(d)
    proj = torch.linalg.qr(torch.randn(4 * n, n))[0].T  # Stiefel, wide
    matrices = [("b.attn.c_attn.weight", qkv, "attn.qkv", [("b.attn.c_attn.weight", 0, 3 * n, "none")]),
            ("b.mlp.c_fc.weight", fc, "mlp.fc", [("b.mlp.c_fc.weight", 0, 4 * n, "dgram")]),
            ("b.mlp.c_proj.weight", proj, "mlp.proj", [("b.mlp.c_proj.weight", 0, n, "stiefel")])]
    stats = matrix_stats(matrices)
    for name, W in [("b.attn.c_attn.weight", qkv), ("b.attn.c_attn.weight[q]", qkv[:n]),
                    ("b.attn.c_attn.weight[k]", qkv[n:2 * n]), ("b.mlp.c_fc.weight", fc)]:
        sigma = torch.linalg.svdvals(W.double())
        assert stats["sigma_max"][name] == pytest.approx(float(sigma[0]), rel=1e-6)
        assert stats["sigma_min"][name] == pytest.approx(float(sigma[-1]), rel=1e-6)
    # on DGram the column norms are the singular values; Stiefel has all of them 1
    assert stats["col_norm_max"]["b.mlp.c_fc.weight"] == pytest.approx(3.0, rel=1e-5)
    assert stats["col_norm_min"]["b.mlp.c_fc.weight"] == pytest.approx(0.5, rel=1e-5)
    assert set(stats["col_norm_max"]) == {"b.mlp.c_fc.weight"}
    assert stats["sigma_max"]["b.mlp.c_proj.weight"] == pytest.approx(1.0, abs=1e-5)
    assert stats["sigma_min"]["b.mlp.c_proj.weight"] == pytest.approx(1.0, abs=1e-5)
    assert stats["manifold_violation"]["b.attn.c_attn.weight"] == 0.0
    assert stats["manifold_violation"]["b.mlp.c_fc.weight"] < 1e-5
    assert stats["manifold_violation"]["b.mlp.c_proj.weight"] < 1e-5
    # a blown-up matrix reports NaN instead of stopping the run
    stats = matrix_stats([("w", torch.full((4 * n, n), float("nan")), "mlp.fc", [("w", 0, 4 * n, "none")])])
    assert math.isnan(stats["sigma_max"]["w"])


def test_matrix_stats_of_a_split_qkv():
    # q, k Stiefel and v DGram blocks of one fused matrix: each block is its own matrix
    torch.manual_seed(1)
    n = 8
    q, k = (torch.linalg.qr(torch.randn(n, n))[0] for _ in range(2))
    v = torch.linalg.qr(torch.randn(n, n))[0] * torch.linspace(0.2, 2.0, n)
    name = "b.attn.c_attn.weight"
    blocks = [(f"{name}[q]", 0, n, "stiefel"), (f"{name}[k]", n, 2 * n, "stiefel"), (f"{name}[v]", 2 * n, 3 * n, "dgram")]
    stats = matrix_stats([(name, torch.cat([q, k, v]), "attn.qkv", blocks)])
    assert set(stats["manifold_violation"]) == {label for label, *_ in blocks}
    assert max(stats["manifold_violation"].values()) < 1e-5
    assert stats["sigma_max"][f"{name}[v]"] == pytest.approx(2.0, rel=1e-5)
    assert stats["sigma_min"][f"{name}[q]"] == pytest.approx(1.0, abs=1e-5)
    assert set(stats["col_norm_max"]) == {f"{name}[v]"}


def rows(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def finite_values(field):
    values = field.values() if isinstance(field, dict) else field if isinstance(field, list) else [field]
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def test_eval_and_train_rows_carry_every_diagnostic(data_dir, tmp_path):
    # attention on Stiefel, MLP on DGram, one matrix plain: every kind of field appears
    train_gpt2.main(["--data-dir", data_dir, "--out-dir", str(tmp_path), *TINY_MODEL, "--n-layer", "2",
                     "--assign", "attn=stiefel,mlp.fc=dgram", "--max-steps", "4", "--eval-every", "2",
                     "--eval-tokens", "512", "--warmup-steps", "1"])
    all_rows = rows(tmp_path)
    evals = [r for r in all_rows if "val_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    names = {f"blocks.{i}.{m}.weight" for i in range(2) for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc",
                                                                    "mlp.c_proj")}
    for r in evals:
        assert EVAL_KEYS <= set(r)
        assert all(finite_values(r[k]) for k in EVAL_KEYS)
        assert len(r["attn_logit_max"]) == len(r["softmax_max_prob"]) == 2
        qk_blocks = {f"blocks.{i}.attn.c_attn.weight[{b}]" for i in range(2) for b in "qk"}
        assert set(r["sigma_max"]) == set(r["sigma_min"]) == names | qk_blocks
        assert set(r["manifold_violation"]) == names
        assert set(r["col_norm_max"]) == set(r["col_norm_min"]) == {"blocks.0.mlp.c_fc.weight",
                                                                    "blocks.1.mlp.c_fc.weight"}
        assert r["sigma_max"]["blocks.0.attn.c_proj.weight"] == pytest.approx(1.0, abs=1e-4)  # Stiefel
        assert r["eval_ms"] > 0 and r["diagnostics_ms"] > 0
    for r in (r for r in all_rows if "train_loss" in r):
        assert "opt_ms" in r and set(r["solver_iterations"]) == set(r["solver_residual"])
        assert len(r["solver_iterations"]) == 4  # one bank per module key in a 2-layer model
        # within the solver's budgets (ADMM doubles its own from a cold start and for near-square banks)
        assert all(isinstance(k, int) and 0 <= k <= 16 for k in r["solver_iterations"].values())
        assert all(math.isfinite(x) and x >= 0 for x in r["solver_residual"].values())
        assert r["solver_iterations"]["mlp.proj=none:32x128"] == 0  # plain Muon solves nothing


def test_wandb_offline_logs_the_diagnostics_and_off_never_imports_it(data_dir, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(OMP_NUM_THREADS="1", WANDB_SILENT="true")
    script = (
        "import sys, train_gpt2\n"
        "train_gpt2.main(sys.argv[2:])\n"
        "assert ('wandb' in sys.modules) == (sys.argv[1] == 'offline'), 'wandb imported when off'\n")
    for mode in ("off", "offline"):
        argv = ["--data-dir", data_dir, "--out-dir", str(tmp_path / mode), *TINY_MODEL, "--max-steps", "2",
                "--eval-every", "2", "--eval-tokens", "256", "--wandb", mode, "--run-name", "probe-run"]
        result = subprocess.run([sys.executable, "-c", script, mode, *argv], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-3000:]
    assert not (tmp_path / "off" / "wandb").exists()
    records = glob.glob(str(tmp_path / "offline" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(records) == 1
    data = open(records[0], "rb").read()
    for key in (b"attn_logit_max/0", b"softmax_max_prob/0", b"sigma_max/blocks.0.attn.c_attn.weight[q]",
                b"col_norm_max/blocks.0.mlp.c_fc.weight", b"solver_residual/", b"train_loss", b"probe-run"):
        assert key in data, key


def test_flat_metrics_names_every_leaf():
    flat = flat_metrics({"a": 1.0, "b": [2.0, 3.0], "c": {"x": 4.0, "y": {"z": 5}}})
    assert flat == {"a": 1.0, "b/0": 2.0, "b/1": 3.0, "c/x": 4.0, "c/y/z": 5}
