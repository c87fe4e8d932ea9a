"""--manifold-module: a manifold defined in a file of its own trains through the trainer under
torchrun (every rank imports it), `--resume auto` imports it again from config.json without the
flag, and a missing or broken module is one `error:` line naming it."""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import train_gpt2
from errors import UserError
from manifolds import MANIFOLDS, manifold_violation
from synthetic import TINY_MODEL, make_shards

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# W^T W = c^2 I with c = 0.5: a manifold no preset knows, written as README's "Adding a manifold" says
MANIFOLD_FILE = textwrap.dedent('''
    import torch
    from manifolds import Manifold, register_manifold
    from manifolds.geometry import polar_svd

    SCALE = 0.5

    class HalfStiefel(Manifold):
        name = "half-stiefel"
        orthogonal_columns = True

        def gram_mask(self, q, device):
            return torch.ones(q, q, dtype=torch.bool, device=device)

        def squared_norms(self, W):
            return torch.full(W.shape[:-2] + W.shape[-1:], SCALE ** 2, dtype=W.dtype, device=W.device)

        def retract(self, X, near=True, backend="auto", tf32_correction=False):
            return SCALE * polar_svd(X)

        def violation(self, W):
            eye = torch.eye(W.size(-1), dtype=W.dtype, device=W.device)
            return (W.mT @ W / SCALE ** 2 - eye).abs().amax(dim=(-2, -1))

    register_manifold(HalfStiefel())
''')


def torchrun(out_dir, data_dir, *extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "train_gpt2.py"), "--data-dir", data_dir, "--out-dir", str(out_dir), *TINY_MODEL,
           "--batch-size", "4", "--max-steps", "6", "--ckpt-every", "3", "--eval-every", "3",
           "--eval-tokens", "512", "--warmup-steps", "2", *extra]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            cwd=str(out_dir.parent))  # not the repository: the file is found by its path
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return {row["step"]: row["train_loss"] for row in map(json.loads, open(out_dir / "metrics.jsonl"))
            if "train_loss" in row}


def test_a_manifold_file_trains_on_two_ranks_and_resumes_without_the_flag(tmp_path):
    data = make_shards(str(tmp_path / "data"))
    (tmp_path / "half_stiefel.py").write_text(MANIFOLD_FILE)
    straight = torchrun(tmp_path / "run", data, "--assign", "attn=half-stiefel,mlp=dgram",
                        "--manifold-module", "half_stiefel.py")  # relative to the launch folder
    config = json.load(open(tmp_path / "run" / "config.json"))
    assert config["manifold_module"] == [str(tmp_path / "half_stiefel.py")]
    assert config["assignment"]["attn.qkv"] == "half-stiefel"
    weights = torch.load(tmp_path / "run" / "ckpt_00000006.pt", weights_only=False)["model"]
    qkv = weights["blocks.0.attn.c_attn.weight"].float()  # (96, 32): tall as stored
    assert manifold_violation(qkv, "dgram") < 1e-5  # W^T W = c^2 I is diagonal...
    assert (qkv.norm(dim=0).square() - 0.25).abs().max() < 1e-5  # ...with c^2 = 1/4

    # --resume auto from step 3, launched without --manifold-module: config.json brings it back
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "run", resumed)
    os.remove(resumed / "ckpt_00000006.pt")
    os.remove(resumed / "summary.json")
    after = torchrun(resumed, data, "--assign", "attn=half-stiefel,mlp=dgram", "--resume", "auto")
    assert [after[s] for s in (4, 5, 6)] == [straight[s] for s in (4, 5, 6)]  # bitwise


def validate(tmp_path, *flags):
    args = train_gpt2.parse_args(["--data-dir", str(tmp_path), "--out-dir", str(tmp_path / "out"), *TINY_MODEL,
                                  *flags])
    train_gpt2.validate_args(args, world_size=1)
    return args


@pytest.mark.parametrize("source,message", [
    (None, "no such file"),
    ("import torch\nx = 1 / 0\n", r"failed to import: ZeroDivisionError: division by zero \(.*broken\.py, line 2\)"),
    ("import torch\n", "registered no manifold"),
], ids=["missing", "raises", "registers-nothing"])
def test_a_missing_or_broken_file_is_one_error_naming_it(tmp_path, source, message):
    path = tmp_path / "broken.py"
    if source is not None:
        path.write_text(source)
    with pytest.raises(UserError, match=message) as caught:
        validate(tmp_path, "--assign", "hetero", "--manifold-module", str(path))
    assert str(path) in str(caught.value)


def test_an_unknown_module_name_and_the_cli_line(tmp_path):
    with pytest.raises(UserError, match="no module of that name"):
        validate(tmp_path, "--manifold-module", "no_such_manifolds_module")
    # what a user sees: one error line, status 2, no traceback
    result = subprocess.run([sys.executable, os.path.join(ROOT, "train_gpt2.py"), "--device", "cpu",
                             "--manifold-module", str(tmp_path / "absent.py")], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: --manifold-module {tmp_path / 'absent.py'}: no such file"


def test_a_file_registers_once_per_process(tmp_path):
    path = tmp_path / "once.py"
    path.write_text(MANIFOLD_FILE.replace("half-stiefel", "once-stiefel"))
    try:
        for _ in range(2):  # a second validate_args in the same process does not register it twice
            args = validate(tmp_path, "--assign", "attn=once-stiefel", "--manifold-module", str(path))
        assert args.assignment["attn.qkv"] == "once-stiefel" and args.manifold_module == [str(path)]
    finally:
        MANIFOLDS.pop("once-stiefel", None)
