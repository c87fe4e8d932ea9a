"""End-to-end behaviour of train_gpt2.py on tiny synthetic data."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import train_gpt2
from manifolds.assignment import PRESETS
from model import GPT, GPTConfig
from synthetic import TINY_MODEL, make_shards, trainer_in_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_shards(str(tmp_path_factory.mktemp("data")))


def train(data_dir, out_dir, *extra):
    argv = ["--data-dir", data_dir, "--out-dir", str(out_dir), *TINY_MODEL, *extra]
    return train_gpt2.main(argv)


def read_rows(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def muon_moves_recorded(monkeypatch):
    """Each ManifoldMuon step of a run, as {manifold: [||W_after - W_before||_op / lr]} over its
    pieces (a block of the fused QKV matrix is a piece of its own)."""
    from manifolds import ManifoldMuon
    moves, step = [], ManifoldMuon.step

    def recorded(self, *args, **kwargs):
        pieces = [(p, lo, hi, manifold, float(g["lr"])) for g in self.param_groups if g.get("algorithm") != "adamw"
                  for p in g["params"] for lo, hi, manifold in g.get("blocks") or [(0, p.size(0), g["manifold"])]]
        before = [p[lo:hi].detach().clone() for p, lo, hi, _, _ in pieces]
        loss = step(self, *args, **kwargs)
        this_step = {}
        for (p, lo, hi, manifold, lr), old in zip(pieces, before, strict=True):
            move = torch.linalg.matrix_norm(p[lo:hi].detach() - old, ord=2).item()
            this_step.setdefault(manifold, []).append(move / lr)
        moves.append(this_step)
        return loss

    monkeypatch.setattr(ManifoldMuon, "step", recorded)
    return moves


@pytest.mark.parametrize("preset", list(PRESETS))
def test_loss_decreases_for_every_preset(preset, data_dir, tmp_path, monkeypatch):
    moves = muon_moves_recorded(monkeypatch)
    summary = train(data_dir, tmp_path, "--assign", preset, "--max-steps", "40", "--warmup-steps", "5",
                    "--lr", "3e-3", "--min-lr", "3e-4", "--muon-lr", "0.05", "--eval-every", "20",
                    "--eval-tokens", "1024")
    rows = [r for r in read_rows(tmp_path) if "train_loss" in r]
    evals = [r for r in read_rows(tmp_path) if "val_loss" in r]
    first = sum(r["train_loss"] for r in rows[:3]) / 3
    last = sum(r["train_loss"] for r in rows[-3:]) / 3
    assert last < first - 0.5, (first, last)
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    assert summary["status"] == "completed"
    for manifold, violation in summary["max_manifold_violation"].items():
        assert violation <= 1e-4, (manifold, violation)
    # AdamW alone lowers the loss, and a matrix never stepped stays on its manifold: every matrix
    # must also have moved by its lr in spectral norm at every step (measured 0.98-1.05 lr; the
    # DGram retraction goes to 2.1 lr at times)
    assert len(moves) == 40
    assert {manifold for step in moves for manifold in step} == set(summary["max_manifold_violation"])
    for step, by_manifold in enumerate(moves):
        for manifold, ratios in by_manifold.items():
            assert all(0.9 <= r <= 2.5 for r in ratios), (step, manifold, ratios)


def test_adamw_only_baseline_trains_every_matrix_with_adamw(data_dir, tmp_path):
    args = train_gpt2.parse_args(["--data-dir", data_dir, *TINY_MODEL, "--optimizer", "adamw",
                                  "--assign", "unconstrained"])
    train_gpt2.validate_args(args)
    model = GPT(GPTConfig(args.n_layer, args.n_head, args.n_embd, args.seq_len,
                          args.vocab_size))
    muon, adamw = train_gpt2.build_optimizers(model, args, torch.device("cpu"))
    assert not any(group["params"] for group in muon.param_groups)
    in_adamw = {id(p) for group in adamw.param_groups for p in group["params"]}
    assert in_adamw == {id(p) for p in model.parameters()}
    summary = train(data_dir, tmp_path, "--optimizer", "adamw", "--assign", "unconstrained", "--max-steps", "30",
                    "--warmup-steps", "5", "--lr", "3e-3", "--eval-every", "10", "--eval-tokens", "1024")
    assert summary["status"] == "completed"
    # The data's tokens are uniform in their marginal, so the untrained model (and any model that
    # ignores the context) sits at ln 64 = 4.16; only the cycle t -> t+1 (90% of the steps,
    # 0.73 nats) brings the loss lower. 30 AdamW steps reach 3.07 here.
    untrained = next(r["train_loss"] for r in read_rows(tmp_path) if "train_loss" in r)
    assert abs(untrained - math.log(64)) < 0.1
    val = [r["val_loss"] for r in read_rows(tmp_path) if "val_loss" in r]
    assert len(val) == 3 and val[0] > val[1] > val[2] == summary["final_val_loss"]
    assert summary["final_val_loss"] < math.log(64) - 0.8, val


def test_outputs_and_their_fields(data_dir, tmp_path):
    summary = train(data_dir, tmp_path, "--assign", "hetero", "--max-steps", "6", "--eval-every", "3",
                    "--eval-tokens", "512", "--warmup-steps", "2")
    config = json.load(open(tmp_path / "config.json"))
    assert config["assign"] == "hetero" and config["n_embd"] == 32
    rows = read_rows(tmp_path)
    train_rows = [r for r in rows if "train_loss" in r]
    eval_rows = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in train_rows] == list(range(1, 7))
    assert [r["step"] for r in eval_rows] == [3, 6]
    for r in train_rows:
        assert {"step", "train_loss", "lr", "tokens_per_s", "step_ms", "opt_ms"} <= set(r)
        assert 0 < r["opt_ms"] < r["step_ms"]
    on_disk = json.load(open(tmp_path / "summary.json"))
    assert on_disk == json.loads(json.dumps(summary))
    assert on_disk["status"] == "completed" and on_disk["steps"] == 6
    assert on_disk["tokens"] == 6 * 8 * 32
    assert on_disk["final_val_loss"] == eval_rows[-1]["val_loss"]
    assert on_disk["final_train_loss"] == train_rows[-1]["train_loss"]
    assert set(on_disk["max_manifold_violation"]) == {"stiefel", "dgram"}


def test_validation_loss_is_a_fixed_token_set(data_dir, tmp_path):
    # Same weights, same --eval-tokens: the same number, however often it is computed.
    args = train_gpt2.parse_args(["--data-dir", data_dir, *TINY_MODEL, "--eval-tokens", "640"])
    train_gpt2.validate_args(args)
    torch.manual_seed(0)
    model = GPT(GPTConfig(1, 2, 32, 32, 64))
    stream = train_gpt2.TokenStream(train_gpt2.find_shards(data_dir, "val"), 64)
    device, _, autocast = train_gpt2.resolve_device(args)
    first = train_gpt2.evaluate(model, stream, args, device, autocast)
    second = train_gpt2.evaluate(model, stream, args, device, autocast)
    assert first == second and first[1] == 640


def test_training_is_deterministic(data_dir, tmp_path):
    a = train(data_dir, tmp_path / "a", "--max-steps", "4", "--eval-every", "4", "--eval-tokens", "256")
    b = train(data_dir, tmp_path / "b", "--max-steps", "4", "--eval-every", "4", "--eval-tokens", "256")
    assert a["final_train_loss"] == b["final_train_loss"] and a["final_val_loss"] == b["final_val_loss"]


def optimizer_steps_recorded(monkeypatch):
    """Each AdamW and ManifoldMuon step of a run, as (group lrs, sum of the squared gradients it
    steps with), in the order they ran."""
    from manifolds import ManifoldMuon
    seen = {"adamw": [], "muon": []}

    def recording(name, step):
        def recorded(self, *args, **kwargs):
            grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
            seen[name].append(([float(g["lr"]) for g in self.param_groups],
                               float(sum(grad.double().square().sum() for grad in grads))))
            return step(self, *args, **kwargs)
        return recorded

    monkeypatch.setattr(torch.optim.AdamW, "step", recording("adamw", torch.optim.AdamW.step))
    monkeypatch.setattr(ManifoldMuon, "step", recording("muon", ManifoldMuon.step))
    return seen


def test_the_lr_schedule_warms_up_decays_on_a_cosine_to_the_floor_and_muon_follows_it(data_dir, tmp_path,
                                                                                       monkeypatch):
    args = train_gpt2.parse_args(["--lr", "1e-3", "--min-lr", "1e-4", "--warmup-steps", "4", "--max-steps", "24"])
    lrs = [train_gpt2.lr_at(step, args) for step in range(30)]
    assert lrs[:5] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])  # linear to --lr, then the cosine's top
    # cosine over the 20 steps after the warmup: min + (lr - min)(1 + cos(pi k / 20)) / 2
    assert lrs[9] == pytest.approx(1e-4 + 9e-4 * (1 + math.cos(math.pi * 5 / 20)) / 2)
    assert lrs[14] == pytest.approx(5.5e-4)  # halfway: the mean of --lr and --min-lr
    assert all(a > b for a, b in zip(lrs[4:24], lrs[5:24]))
    assert lrs[24:] == pytest.approx([1e-4] * 6)  # the floor from --max-steps on
    # in a run: AdamW's groups take lr_at, every Muon group --muon-lr / --lr times it (the same shape)
    seen = optimizer_steps_recorded(monkeypatch)
    flags = ["--max-steps", "8", "--warmup-steps", "3", "--lr", "3e-3", "--min-lr", "3e-4", "--muon-lr", "0.05",
             "--eval-every", "8", "--eval-tokens", "256"]
    train(data_dir, tmp_path, *flags)
    args = train_gpt2.parse_args(flags)
    want = [train_gpt2.lr_at(step, args) for step in range(8)]
    assert len(seen["adamw"]) == len(seen["muon"]) == 8
    for (adamw, _), (muon, _), lr in zip(seen["adamw"], seen["muon"], want, strict=True):
        assert adamw == pytest.approx([lr] * len(adamw), rel=1e-6)
        assert muon and muon == pytest.approx([0.05 * lr / 3e-3] * len(muon), rel=1e-6)
    assert [r["lr"] for r in read_rows(tmp_path) if "train_loss" in r] == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("clip", [0.05, 0.0])
def test_grad_clip_scales_the_global_gradient_norm_down_to_the_bound(clip, data_dir, tmp_path, monkeypatch):
    # the optimizers step with gradients of global norm min(norm, --grad-clip); the metrics' grad_norm
    # is the norm before the clip (0.5-0.7 here, so 0.05 clips every step); --grad-clip 0 is no clip
    seen = optimizer_steps_recorded(monkeypatch)
    train(data_dir, tmp_path, "--max-steps", "3", "--grad-clip", str(clip), "--eval-every", "3",
          "--eval-tokens", "256")
    before = [r["grad_norm"] for r in read_rows(tmp_path) if "train_loss" in r]
    after = [math.sqrt(a + m) for (_, a), (_, m) in zip(seen["adamw"], seen["muon"], strict=True)]
    assert len(before) == len(after) == 3
    for norm, stepped in zip(before, after, strict=True):
        if clip:
            assert norm > 2 * clip and stepped == pytest.approx(clip, rel=1e-4)
        else:
            assert stepped == pytest.approx(norm, rel=1e-4)


def test_batches_partition_the_global_batch_across_ranks(data_dir):
    # N ranks x accumulation K read exactly the sequences of 1 rank x accumulation N*K.
    stream = train_gpt2.TokenStream(train_gpt2.find_shards(data_dir, "train"), 64)
    single = train_gpt2.TrainBatches(stream, 32, 4, grad_accum=4, seed=3)
    ranks = [train_gpt2.TrainBatches(stream, 32, 4, grad_accum=2, seed=3, rank=r, world_size=2)
             for r in range(2)]
    for step in range(3):
        want = torch.cat([single.get(step, m)[0] for m in range(4)])
        got = torch.cat([ranks[r].get(step, m)[0] for m in range(2) for r in range(2)])
        assert torch.equal(want, got)


def run_cli(*argv, env=None):
    return subprocess.run([sys.executable, os.path.join(ROOT, "train_gpt2.py"), *argv],
                          capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("spec", ["hetro", "attn=sphere", "ffn=stiefel"])
def test_bad_assign_is_a_clean_error(spec, data_dir, tmp_path):
    result = trainer_in_process("--assign", spec, "--data-dir", data_dir, "--out-dir", str(tmp_path / "o"), *TINY_MODEL)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ")
    assert "Traceback" not in result.stderr
    assert "hetero" in result.stderr and "stiefel" in result.stderr  # lists the valid choices
    assert not (tmp_path / "o").exists()  # nothing written


@pytest.mark.parametrize("flags, message", [
    (["--n-embd", "30", "--n-head", "4"], "not divisible"),
    (["--muon-lr", "0"], "--muon-lr must be positive"),
    (["--lr", "-1"], "--lr must be positive"),
    (["--data-dir", "/nonexistent/shards"], "does not exist"),
    (["--optimizer", "adamw"], "pass --assign unconstrained"),
])
def test_bad_flags_are_clean_errors(flags, message, data_dir, tmp_path):
    result = trainer_in_process("--data-dir", data_dir, "--out-dir", tmp_path / "o", *TINY_MODEL, *flags)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


def test_triton_kernels_on_cpu_are_a_clean_error(data_dir, tmp_path):
    # No CUDA and no Triton interpreter: --kernels triton cannot run, and says so before training.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = run_cli("--device", "cpu", "--kernels", "triton", "--data-dir", data_dir,
                     "--out-dir", str(tmp_path / "o"), *TINY_MODEL, env=env)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith("error: kernel backend 'triton' needs CUDA tensors")


def test_default_batch_is_the_published_64_sequences_on_any_world_size():
    args = train_gpt2.parse_args([])
    assert (args.total_batch_size, args.batch_size) == (64, 8)
    for world, accumulation in [(1, 8), (2, 4), (4, 2), (8, 1)]:
        assert train_gpt2.grad_accum_steps(args, world) == accumulation
        assert args.batch_size * world * accumulation == 64


@pytest.mark.parametrize("flags, world, message", [
    ([], 3, "not a multiple of --batch-size 8 x 3 processes = 24 sequences: 64 sequences cannot be split"),
    ([], 16, "not a multiple of --batch-size 8 x 16 processes = 128"),
    (["--batch-size", "5"], 1, "--batch-size must divide 64"),
    (["--total-batch-size", "0"], 1, "--total-batch-size must be positive"),
])
def test_a_total_batch_that_does_not_divide_is_a_user_error(flags, world, message):
    args = train_gpt2.parse_args(flags)
    with pytest.raises(train_gpt2.UserError, match=message):
        train_gpt2.validate_args(args, world_size=world)


def test_prefetched_batches_are_the_loops_batches_in_order(data_dir):
    stream = train_gpt2.TokenStream(train_gpt2.find_shards(data_dir, "train"), 64)
    batches = train_gpt2.TrainBatches(stream, 32, 4, grad_accum=3, seed=5)
    prefetch = train_gpt2.Prefetcher(batches, start_step=7, device=torch.device("cpu"))
    for step in range(7, 10):
        for micro in range(3):
            got, want = prefetch.next(step, micro), batches.get(step, micro)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(AssertionError, match="out of loop order"):
        prefetch.next(10, 1)
    prefetch.close()


def test_the_muon_step_replayed_from_a_graph_trains_as_the_eager_one(data_dir, tmp_path):
    """--cuda-graph on: the Muon step captured at the third step and replayed after (on CPU by
    the emulation of manifolds/step_graph.py): lr in device tensors, gradients kept in place.
    The same losses to the last bit as the eager sync-free step, through warm-up and decay."""
    common = ["--max-steps", "8", "--warmup-steps", "3", "--eval-every", "8", "--eval-tokens", "1024",
              "--solver-opt", "capturable=on", "--log-every", "1"]
    eager = train(data_dir, tmp_path / "eager", *common)
    graphed = train(data_dir, tmp_path / "graph", *common, "--cuda-graph", "on")
    losses = lambda d: [r["train_loss"] for r in read_rows(d) if "train_loss" in r]  # noqa: E731
    assert len(losses(tmp_path / "eager")) == 8
    assert losses(tmp_path / "graph") == losses(tmp_path / "eager")
    assert graphed["final_val_loss"] == eager["final_val_loss"]


def test_model_presets_give_the_gpt2_family_and_explicit_sizes_override_them():
    # parameter counts of the published GPT-2 sizes (50257-token vocabulary, 1024 positions, tied head,
    # with biases, which our blocks do not have): 124M, 355M, 774M, 1558M
    published = {"gpt2": 124.4e6, "gpt2-medium": 354.8e6, "gpt2-large": 774.0e6, "gpt2-xl": 1557.6e6}
    for name, count in published.items():
        args = train_gpt2.parse_args(["--model", name, "--vocab-size", "50257"])
        with torch.device("meta"):
            model = GPT(GPTConfig(args.n_layer, args.n_head, args.n_embd, args.seq_len,
                                  args.vocab_size))
        n = sum(p.numel() for p in model.parameters())
        assert 0.995 * count <= n <= count, (name, n)
    args = train_gpt2.parse_args(["--model", "gpt2-medium", "--n-layer", "2"])
    assert (args.n_layer, args.n_head, args.n_embd) == (2, 16, 1024)
    assert (lambda a: (a.n_layer, a.n_head, a.n_embd))(train_gpt2.parse_args([])) == (12, 12, 768)
