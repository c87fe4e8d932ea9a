"""The benches on CPU, tiny shapes (bench/gpu_check.sh runs the GPU ones on a GPU)."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from bench import results as results_module
from bench.published import published_step
from errors import UserError
from data.shards import open_tokens
from manifolds import project_to_manifold

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("shape", [(96, 32), (32, 96)])  # tall and wide DGram matrices
def test_published_step_runs_on_bf16_dgram(shape):
    # svdvals has no bf16 kernel: the published DGram retraction computes them in fp32
    torch.manual_seed(0)
    W = project_to_manifold(torch.randn(shape), "dgram")
    G = torch.randn(shape)
    new = published_step(W.bfloat16(), G.bfloat16(), "dgram", 0.02)
    assert new.dtype == torch.bfloat16 and new.shape == W.shape
    reference = published_step(W, G, "dgram", 0.02)
    assert torch.isfinite(new.float()).all()
    # bf16 arithmetic through the published step's iterations: 3.4-5.2% of the largest entry, by the
    # CPU's bf16 matmul (AMX, AVX-512, AVX2: measured under DNNL_MAX_CPU_ISA / MKL_ENABLE_INSTRUCTIONS);
    # a step that leaves W where it was is 19-23% off
    assert float((new.float() - reference).abs().max() / reference.abs().max()) < 0.08


def test_results_rewrite_the_file_atomically(tmp_path):
    path = tmp_path / "r.json"
    res = results_module.Results(str(path), config={"n": 1})
    assert json.loads(path.read_text()) == {"config": {"n": 1}}
    res.put("a", "b", value=1.5)
    res.append("rows", {"x": 1})
    res.put("dtype", value=torch.bfloat16)  # not JSON: written as its str
    assert json.loads(path.read_text()) == {"config": {"n": 1}, "a": {"b": 1.5}, "rows": [{"x": 1}],
                                            "dtype": "torch.bfloat16"}
    assert os.listdir(tmp_path) == ["r.json"]  # no temporary file left
    results_module.Results(None).put("a", value=1)  # no path: nothing written, no error


@pytest.fixture
def snapshots(monkeypatch):
    """The JSON file's content after every save, in order."""
    seen = []
    save = results_module.Results.save

    def recording_save(self):
        save(self)
        with open(self.path) as f:
            seen.append(json.load(f))
    monkeypatch.setattr(results_module.Results, "save", recording_save)
    return seen


def test_step_time_writes_after_every_measurement(tmp_path, snapshots):
    from bench import step_time
    out = str(tmp_path / "step_time.json")
    step_time.main(["--assign", "hetero", "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--batch", "2",
                    "--micro-batch", "1", "--seq-len", "16", "--kernels", "torch", "--clips", "auto", "eigh",
                    "--repeat", "1", "--out", out])
    # config, then forward+backward alone, then one setting more per save
    assert [sorted(s.get("hetero", {})) for s in snapshots] == [
        [], ["forward_backward_ms"], ["forward_backward_ms", "torch"], ["forward_backward_ms", "torch", "torch+eigh"]]
    final = json.load(open(out))
    assert final["hetero"]["torch+eigh"]["muon_step_ms"] > 0 and final["config"]["seq_len"] == 16


def test_optimizer_bench_writes_after_every_measurement_in_bf16(tmp_path, snapshots):
    from bench import optimizer
    out = str(tmp_path / "optimizer.json")
    optimizer.main(["--n-embd", "32", "--n-layer", "1", "--steps", "1", "--warmup", "1", "--dtype", "bfloat16",
                    "--out", out])
    timed = [list(s.get("seconds_per_step", {})) for s in snapshots]
    assert ["published"] in timed and ["published", "ours"] in timed  # each saved before the next ran
    final = json.load(open(out))
    assert list(final["seconds_per_step"]) == ["published", "ours", "ours-20"]
    assert all(math.isfinite(v) for v in final["violation_after_steps"]["published"].values())


def test_throughput_writes_after_every_round(tmp_path, snapshots):
    from bench import throughput
    out = str(tmp_path / "throughput.json")
    throughput.main(["--settings", "adamw", "hetero", "--n-layer", "1", "--n-embd", "32", "--n-head", "2",
                     "--batch", "2", "--seq-len", "16", "--rounds", "2", "--device", "cpu", "--out", out])
    assert [s["rounds"] for s in snapshots] == [0, 1, 2]
    assert set(snapshots[1]["tokens_per_s"]) == {"adamw", "hetero"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU bench/gpu_check.sh runs the real bench")
def test_kernels_bench_rows_on_cpu_interpreter(tmp_path, monkeypatch, snapshots):
    # The bench's loop with the Triton kernels in the interpreter (conftest) on a tiny bank, the
    # CUDA timing replaced: rows are written one by one, bf16 first, and a failing case is a row.
    from bench import kernels as bench
    calls = []

    def fake_measure(fns, rep_ms):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("simulated failure")
        return {mode: {k: 1.0 for k in fns} for mode in ("eager", "graph")}
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "BANKS", {"tiny": (2, 32, 64)})
    monkeypatch.setattr(bench, "measure", fake_measure)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    out = str(tmp_path / "kernels.json")
    assert bench.main(["--ops", "msign,project", "--banks", "tiny", "--dtypes", "bf16,fp32", "--out", out]) == 0
    assert [len(s["rows"]) for s in snapshots] == [0, 1, 2, 3, 4]
    rows = json.load(open(out))["rows"]
    assert [(r["dtype"], r["op"]) for r in rows] == [("bf16", "msign"), ("bf16", "project"),
                                                     ("fp32", "msign"), ("fp32", "project")]
    assert "simulated failure" in rows[1]["error"]
    assert rows[2]["max_rel_err"] < 1e-3 and rows[0]["graph_speedup"] == 1.0


def test_pattern_shards_are_a_noisy_cycle(tmp_path):
    from data.make_synthetic_shards import VOCAB, cycle_tokens, main
    tokens = cycle_tokens(200_000, VOCAB, seed=0, jump=0.1)
    assert tokens.min() >= 0 and tokens.max() < VOCAB
    steps = (tokens[1:] - tokens[:-1]) % VOCAB
    assert 0.88 < np.mean(steps == 1) < 0.92  # +1 except at the jumps (and a jump may land on +1)
    assert np.array_equal(tokens, cycle_tokens(200_000, VOCAB, seed=0, jump=0.1))
    counts = np.bincount(tokens, minlength=VOCAB)
    assert counts[0] > 100 * np.median(counts)  # Zipf: the low ids are frequent
    main([str(tmp_path), "--tokens", "5000", "--mode", "pattern"])
    train = np.asarray(open_tokens(str(tmp_path / "train_000000.bin")))
    val = np.asarray(open_tokens(str(tmp_path / "val_000000.bin")))
    assert len(train) == 5000 and len(val) == 500 and not np.array_equal(val, train[:500])  # another seed


def test_gpu_check_dry_run(tmp_path):
    # The whole script on CPU with tiny shapes: every step passes, the verdict reads every file,
    # and $OUT holds at most the 8 files the device tool returns.
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "GPU_CHECK_DRY": "1", "OUT": str(out), "GPU_CHECK_WORK": str(work),
           "PYTHON": sys.executable}
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu_check.sh")], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    summary = (out / "summary.txt").read_text()
    assert result.returncode == 0, summary + result.stdout[-3000:]
    for name in ("tests", "kernels", "step_time", "optimizer", "train", "fsdp"):
        assert any(line.startswith(name) and "exit   0" in line for line in summary.splitlines()), summary
    assert "no verdict" not in summary and "tests collected" in summary
    assert "train: 12 steps" in summary and "no NaN" in summary and "train: status completed" in summary
    files = sorted(os.listdir(out))
    assert len(files) <= 8 and not any(f.endswith(".tmp") for f in files), files
    assert {"gpu_check.log", "summary.txt", "step_time.json", "optimizer.json", "train_metrics.jsonl",
            "train_summary.json"} <= set(files)
    assert not (work / "run").exists() and not (work / "fsdp").exists()  # the checkpoints are deleted


def test_memory_counts_agree_with_a_live_step_and_fsdp_holds_under_a_sixth_of_ddp_for_xl_at_8_ranks():
    from bench import memory
    flags = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--seq-len", "16", "--vocab-size", "64",
             "--total-batch-size", "2", "--batch-size", "1"]
    args = memory.train_gpt2.parse_args(["--device", "cpu", *flags])
    memory.train_gpt2.validate_args(args, world_size=2)
    for (fsdp, rank), held in memory.live(flags).items():
        exchange = held.pop("exchange_held")
        held.pop("build")  # the build's memory: tests/test_meta_init.py
        assert held == memory.counted_rank(args, 2, rank, fsdp), (fsdp, rank)
        assert all(held[c] > 0 for c in memory.CATEGORIES)
        # the exchange's buffers at their most, measured in the step, as the in-flight estimate has them
        assert exchange == (memory.first_step_exchange(args, 2, rank) if fsdp else 0), (fsdp, rank, exchange)
    xl = memory.trainer_args("gpt2-xl")
    ddp, fsdp = (memory.count(xl, 8, sharded) for sharded in (False, True))
    total = lambda held: sum(held.values())  # noqa: E731
    assert total(fsdp) <= total(ddp) / 6, total(fsdp) / total(ddp)
    assert fsdp["parameters"] * 8 >= ddp["parameters"] > fsdp["parameters"] * 7.9  # 1/8, rows rounded up


def test_scheme_report_tables_final_losses_and_tests_them(tmp_path):
    # bench.experiments.scheme_report reads scheme_compare.sh's layout and compares the schemes by seed
    from bench.experiments.scheme_report import final_losses, report
    values = {("online", 1): 5.40, ("online", 2): 5.42, ("online", 3): 5.41,
              ("admm", 1): 5.50, ("admm", 2): 5.53, ("admm", 3): 5.51}
    for (scheme, seed), loss in values.items():
        run = tmp_path / "guard" / scheme / f"seed{seed}" / "hetero"
        run.mkdir(parents=True)
        (run / "summary.json").write_text(json.dumps({"status": "completed", "final_val_loss": loss}))
    table = final_losses(str(tmp_path))
    assert table[("guard", "online", "hetero")] == {1: 5.40, 2: 5.42, 3: 5.41}
    text = report(table, "online", "admm")
    row = [line for line in text.splitlines() if line.startswith("| guard | hetero")][0]
    assert "5.4100 (0.0100), 3" in row and "-0.1033" in row  # means, sd, n and A − B
    welch_p = float(row.split("|")[6])
    assert welch_p < 0.01  # a 0.1 gap over a 0.01 spread


def test_equal_time_steps_fit_the_base_runs_estimated_time():
    """bench/experiments/equal_time.py: a scheme whose step the cost model prices dearer gets fewer steps
    in the base scheme's time, N (1 + r_base) / (1 + r), and the options reach the cost model."""
    from bench.experiments import equal_time
    assert equal_time.equal_time_steps(300, 0.0963, 0.2333) == 267  # issue 60's guard: online -> ADMM
    assert equal_time.equal_time_steps(200, 0.2333, 0.0963) == 225  # and the other way
    assert equal_time.solver_opts("online:dual_step=0.1,sharpen=off") == [
        "--solver-opt", "scheme=online", "--solver-opt", "dual_step=0.1", "--solver-opt", "sharpen=off"]
    with pytest.raises(UserError):
        equal_time.equal_time_steps(0, 0.1, 0.1)
    tiny = ("--n-layer", "1", "--n-embd", "64")
    online, admm = (equal_time.estimated_ratio(s, model_args=tiny) for s in ("online", "admm"))
    assert 0 < online < admm  # ADMM's 3 iterations + 2 pullbacks cost more than one dual step
    with pytest.raises(UserError):
        equal_time.estimated_ratio("online:no_such_option=1", model_args=tiny)


def test_warm_sweep_replays_recorded_momenta_for_every_scheme(tmp_path, monkeypatch, capsys):
    """bench/experiments/warm_sweep.py --momenta: a recorded window (bench/dump_momenta.py's format) is
    replayed with each scheme's warm starts chained, each bank's cell a quality in (0, 1] of its float64
    optimum. Guards the replay path that no other test runs (it read Solution.state after the rename
    to warm_start, and offered no newton row)."""
    from bench.experiments import warm_sweep
    g = torch.Generator().manual_seed(0)
    banks = []
    for step in range(2):
        step_banks = []
        for name, manifold in (("attn", "stiefel"), ("mlp", "dgram")):
            W = project_to_manifold(torch.randn(2, 40, 12, generator=g), manifold)
            step_banks.append((name, manifold, W, torch.randn(2, 40, 12, generator=g)))
        banks.append(step_banks)
    path = tmp_path / "momenta.pt"
    torch.save({"steps": [9, 10], "banks": banks, "dgram_cap": 1.0}, path)
    monkeypatch.setattr(sys, "argv", ["warm_sweep", "--momenta", str(path), "--scheme", "online", "newton",
                                      "--iterations", "1", "--reference-iters", "200", "--reference-tol", "1e-5"])
    warm_sweep.main()
    rows = {line.split(" | ")[0].split()[0]: line for line in capsys.readouterr().out.splitlines()
            if line.startswith(("online ", "newton "))}
    assert set(rows) == {"online", "newton"}
    for line in rows.values():
        cells = line.split(" | ")[1:]
        assert len(cells) == 2  # the window's two banks
        for cell in cells:
            worst, mean = (float(x) for x in cell.split(" / "))
            assert 0.5 < worst <= mean <= 1.0 + 1e-4


def test_warm_sweep_online_diagnostics_take_effect_and_are_undone(tmp_path, monkeypatch, capsys):
    """--online-steps and --dual-step change the online scheme's answers on a recorded window,
    --exact-sign signs by an SVD, and the patched sign and step counts are restored after the run."""
    from bench.experiments import warm_sweep
    from manifolds import solver
    from manifolds.geometry import geometry
    g = torch.Generator().manual_seed(1)
    banks = [[("mlp", "dgram", project_to_manifold(torch.randn(2, 40, 12, generator=g), "dgram"),
               torch.randn(2, 40, 12, generator=g))] for _ in range(2)]
    path = tmp_path / "momenta.pt"
    torch.save({"steps": [9, 10], "banks": banks, "dgram_cap": 1.0}, path)
    polar, steps = solver.polar, geometry("dgram").online_steps

    def row(*flags):
        monkeypatch.setattr(sys, "argv", ["warm_sweep", "--momenta", str(path), "--scheme", "online",
                                          "--iterations", "1", "--reference-iters", "200", *flags])
        warm_sweep.main()
        assert solver.polar is polar and geometry("dgram").online_steps == steps
        return [line for line in capsys.readouterr().out.splitlines() if line.startswith("online ")][0]

    svds = []
    svd = torch.linalg.svd
    monkeypatch.setattr(torch.linalg, "svd", lambda *a, **k: svds.append(1) or svd(*a, **k))
    row()  # the float64 optima, cached beside the file for the runs below
    svds.clear()
    plain = row()
    assert row("--online-steps", "3") != plain and row("--dual-step", "0.5") != plain
    assert not svds
    row("--exact-sign")  # at this size the polynomial sign is as exact (the same four digits): its SVD ran
    assert svds


def test_solver_quality_scores_the_one_shot_default_as_users_call_it(capsys):
    """bench.solver_quality's last column is steepest_direction with no scheme named (the one-shot
    default, ADMM to convergence-sized budgets): at least 0.99 where the online scheme's own cold
    solve is short of it; it once always named a scheme, so the default was never scored."""
    from bench import solver_quality
    solver_quality.main(["--schemes", "online", "--shapes", "96x32:dgram", "--decays", "1", "--seeds", "0",
                         "--reference-iters", "1000"])
    header, _, row = capsys.readouterr().out.strip().splitlines()[-3:]
    assert header.endswith("| default cold")
    worst = [float(cell.split("/")[0]) for cell in row.split("(")[0].split("|")[1:]]
    online_cold, default_cold = worst[1], worst[2]
    assert default_cold >= 0.99 > online_cold


def test_exact_dual_replays_a_window_and_frees_only_zero_directions(tmp_path, capsys):
    """bench/experiments/exact_dual.py: the online dual in float64 on a recorded window. Its freed sign
    stays in the nuclear norm's subdifferential where X is singular (<A, X> = ||X||_*, ||A||_op <= 1)
    and is no less tangent than the plain sign there; many small exact dual steps reach the optimum
    (the iteration is the scheme's, not a broken copy); the CLI prints a row per setting."""
    from bench.experiments import exact_dual
    from manifolds.geometry import geometry
    from manifolds.optimum import optimum, quality
    g = torch.Generator().manual_seed(0)
    W = project_to_manifold(torch.randn(24, 8, generator=g, dtype=torch.float64), "stiefel")
    geo = geometry("stiefel")
    multiplier = lambda Y: geo.preconditioned(W, Y, geo.squared_norms(W), 1.0, "torch")  # noqa: E731
    U, _ = torch.linalg.qr(torch.randn(24, 8, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(8, 8, generator=g, dtype=torch.float64))
    X = U @ torch.diag(torch.tensor([3.0, 2, 1.5, 1, 0.7, 0.4, 0.2, 0.0], dtype=torch.float64)) @ V.mT
    plain, _ = exact_dual.exact_sign(X, 0, multiplier)
    freed, _ = exact_dual.exact_sign(X, 1, multiplier)
    nuclear = torch.linalg.matrix_norm(X, ord="nuc")
    assert torch.allclose((freed * X).sum(), nuclear, rtol=1e-10)
    assert torch.linalg.matrix_norm(freed, ord=2) <= 1 + 1e-10
    assert multiplier(freed).norm() <= multiplier(plain).norm() + 1e-12

    problems = []
    for _ in range(3):
        G = torch.randn(24, 8, generator=g, dtype=torch.float64)
        problems.append(exact_dual.span_problem(W, G))
    Ws, Gs = problems[-1]  # span coordinates (16 x 8 here): the same optimum and qualities
    value, _ = optimum(Ws, Gs, "stiefel", iters=2000, tol=1e-8)
    one, _ = exact_dual.replay(problems, "stiefel", 1, 0.25, 0, True)
    many, _ = exact_dual.replay(problems, "stiefel", 200, 0.25, 0, False)
    assert quality(Ws, Gs, many, value) > 0.999
    assert quality(Ws, Gs, one, value) < quality(Ws, Gs, many, value)

    banks = [[("attn", "stiefel", project_to_manifold(torch.randn(1, 30, 6, generator=g), "stiefel"),
               torch.randn(1, 30, 6, generator=g))] for _ in range(2)]
    path = tmp_path / "momenta.pt"
    torch.save({"steps": [4, 5], "banks": banks, "dgram_cap": 1.0}, path)
    exact_dual.main(["--momenta", str(path), "--free-directions", "0", "2", "--reference-iters", "300",
                     "--spectrum"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("1 0.25 0 |", "1 0.25 2 |"))]
    assert len(rows) == 2 and all(0.5 < float(line.split("|")[1]) <= 1.0 + 1e-4 for line in rows)
    assert "smallest" in out
