"""tools/report.py: the ablation table and figure from run folders."""
import json
import os
import subprocess
import sys

from tools import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fake_run(folder, assign, evals, summary, started):
    """A run folder as train_gpt2.py writes it: 10 train rows (opt_ms a quarter of step_ms)."""
    os.makedirs(folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"assign": assign, "tokens_per_step": 1000}, f)
    os.utime(os.path.join(folder, "config.json"), (started, started))
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for step in range(1, 11):
            f.write(json.dumps({"step": step, "train_loss": 5.0, "tokens_per_s": 1000.0 * step,
                                "step_ms": 100.0, "opt_ms": 25.0}) + "\n")
        for step, val, logit, sigma_attn, sigma_mlp in evals:
            f.write(json.dumps({
                "step": step, "val_loss": val, "attn_logit_max": [logit / 2, logit],
                "softmax_max_prob": [0.3, 0.9],
                "sigma_max": {"blocks.0.attn.c_attn.weight": sigma_attn, "blocks.0.attn.c_attn.weight[q]": 0.5,
                              "blocks.0.mlp.c_fc.weight": sigma_mlp, "blocks.0.mlp.c_proj.weight": 0.1},
                "eval_ms": 100.0, "diagnostics_ms": 2.0}) + "\n")
    if summary is not None:
        with open(os.path.join(folder, "summary.json"), "w") as f:
            json.dump(summary, f)


def add_event(folder, row):
    with open(os.path.join(folder, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")


def two_runs(root):
    fake_run(root / "hetero", "hetero", [(5, 6.0, 3.0, 1.0, 2.0), (10, 5.5, 4.0, 1.0, 2.5)],
             {"status": "completed", "steps": 10, "tokens": 10000, "final_val_loss": 5.5, "diverged": None},
             started=1000)
    fake_run(root / "hetero-inv", "hetero-inv", [(5, 6.2, 40.0, 7.0, 1.0)],
             {"status": "diverged", "steps": 7, "tokens": 7000, "final_val_loss": 6.2,
              "diverged": {"step": 7, "train_loss": 99.0}}, started=2000)


def table_rows(text):
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| `")]


def test_report_of_two_runs_gives_the_table_and_a_figure(tmp_path):
    two_runs(tmp_path)
    report.write_report([str(tmp_path)])
    text = (tmp_path / "report.md").read_text()
    rows = table_rows(text)
    assert [r[0] for r in rows] == ["`hetero`", "`hetero-inv`"]  # the order they started in
    hetero, inverse = rows
    # assignment, final val loss, steps, tokens, tokens/s, optimizer share, max logit, max sigma attn, MLP
    assert hetero == ["`hetero`", "5.5000", "10", "10,000", "5,500", "25%", "4.00", "1.000", "2.500"]
    assert inverse[1] == "diverged at step 7" and inverse[2] == "7" and inverse[6] == "40.00"
    assert inverse[7] == "7.000" and inverse[8] == "1.000"
    assert "2.0 ms, 2.0% of the validation-loss pass" in text
    png = (tmp_path / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


def test_report_cli_on_run_folders_and_its_mistakes(tmp_path):
    two_runs(tmp_path / "runs")
    fake_run(tmp_path / "killed", "all-dgram", [], None, started=3000)  # no summary.json
    cli = [sys.executable, "-m", "tools.report"]
    result = subprocess.run([*cli, str(tmp_path / "runs" / "hetero"), str(tmp_path / "killed"),
                             "--out", str(tmp_path / "cmp")], capture_output=True, text=True, timeout=120,
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr
    rows = table_rows(result.stdout)
    assert [r[0] for r in rows] == ["`hetero`", "`all-dgram`"]
    assert rows[1][1] == "no summary.json (running or killed) at step 10" and rows[1][6] == "n/a"
    assert (tmp_path / "cmp" / "report.png").exists()
    for args, message in [([str(tmp_path / "cmp")], "holds no run"),
                          ([str(tmp_path / "runs"), str(tmp_path / "killed")], "--out"),
                          ([str(tmp_path / "nothing")], "is not a folder")]:
        result = subprocess.run([*cli, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert result.returncode == 2 and result.stderr.startswith("error: ") and message in result.stderr


def test_seeds_of_one_assignment_are_summarised(tmp_path):
    for i, (seed, final) in enumerate([("s1", 5.5), ("s2", 5.7)]):
        fake_run(tmp_path / seed / "hetero", "hetero", [(10, final, 4.0, 1.0, 2.0)],
                 {"status": "completed", "steps": 10, "tokens": 10000, "final_val_loss": final, "diverged": None},
                 started=1000 + i)
        fake_run(tmp_path / seed / "auto", "auto", [(10, 6.0, 9.0, 1.0, 2.0)],
                 {"status": "completed", "steps": 10, "tokens": 10000, "final_val_loss": 6.0, "diverged": None,
                  "auto_switches": [{"step": 5, "layer": 1, "reason": "x"}]}, started=2000 + i)
        add_event(tmp_path / seed / "auto", {"step": 5, "layer": 1, "reason": "x", "event": "auto_switch"})
    report.write_report([str(tmp_path / "s1"), str(tmp_path / "s2")], str(tmp_path))
    text = (tmp_path / "report.md").read_text()
    rows = table_rows(text)
    hetero = next(r for r in rows if r[0] == "`hetero`")
    # assignment, runs, mean ± sd, min – max, diverged, median max logit, median final max prob
    assert hetero == ["`hetero`", "2", "5.6000 ± 0.1414", "5.5000 – 5.7000", "0/2", "4.0", "0.90"]
    assert "6.0000 (auto: layer 1 at step 5)" in text
    assert "`hetero (s1)`" in text and "`hetero (s2)`" in text


def test_solver_guard_table_gives_the_setting_gap_and_the_seed_spread(tmp_path):
    from bench import solver_guard_plot
    finals = {("default", "seed1"): 5.40, ("default", "seed2"): 5.43,
              ("iters20", "seed1"): 5.41, ("iters20", "seed2"): 5.42}
    for (setting, seed), val in finals.items():
        fake_run(tmp_path / setting / seed / "hetero", "hetero", [(5, 6.0, 3.0, 1.0, 2.0), (10, val, 3.0, 1.0, 2.0)],
                 {"status": "completed", "steps": 10, "tokens": 10000, "final_val_loss": val, "diverged": None},
                 started=1000)
    solver_guard_plot.main([str(tmp_path)])
    row = open(tmp_path / "guard.md").read().splitlines()[-1]
    # gap: max over seeds of |default - iters20| = 0.01; spread: max over settings of max - min = 0.03
    assert row == "| hetero | 5.4000, 5.4300 | 5.4100, 5.4200 | 0.0100 | 0.0300 |"
    assert (tmp_path / "guard.png").stat().st_size > 0


def test_runs_with_attention_stabilizers_are_their_own_rows(tmp_path):
    done = {"status": "completed", "steps": 10, "tokens": 10000, "final_val_loss": 6.0, "diverged": None}
    fake_run(tmp_path / "a", "all-dgram", [(10, 6.0, 9.0, 1.0, 2.0)], done, started=1000)
    fake_run(tmp_path / "b", "all-dgram", [(10, 5.8, 9.0, 1.0, 2.0)], done, started=2000)
    with open(tmp_path / "b" / "config.json", "w") as f:
        json.dump({"assign": "all-dgram", "tokens_per_step": 1000, "qk_clip": 100.0, "attn_softcap": 50.0,
                   "qk_norm": False}, f)
    labels = [r.label for r in report.find_runs([str(tmp_path)])]
    assert labels == ["all-dgram", "all-dgram +qk-clip 100 +softcap 50"]
