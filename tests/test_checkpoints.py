"""training/checkpoints.py: a checkpoint verifies itself wherever it is copied.

torch.save writes a zip archive whose records carry CRC-32s; every load checks them before
anything is unpickled, so a checkpoint copied without its .sha256 manifest and changed on the way
is one `error:` line naming it from every tool that reads checkpoints (the trainer's --resume,
sample.py, export_hf.py, tools/hellaswag.py), and nothing of it is loaded. Files of another
program (another payload format) are refused the same way.
"""
import os
import shutil
import zipfile

import pytest
import torch

import export_hf
import sample
import train_gpt2
from errors import run_cli
from synthetic import make_shards
from tiny_gpt import train_checkpoints
from tools import hellaswag
from training import checkpoints

HELLASWAG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hellaswag_mini.jsonl")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(data folder, the trainer's checkpoint after 2 steps of a 50304-token model, its flags)."""
    root = tmp_path_factory.mktemp("trained")
    data = make_shards(str(root / "data"))
    run_dir = train_checkpoints(data, root / "run")
    path = os.path.join(run_dir, "ckpt_00000002.pt")
    return data, path, torch.load(path, weights_only=True)["args"]


def changed_copy(path, folder, offset=None, n=8):
    """`path` copied alone into `folder` (no manifest beside it), `n` bytes at `offset` (default:
    the middle, inside a tensor's record) inverted."""
    os.makedirs(folder, exist_ok=True)
    copy = os.path.join(folder, os.path.basename(path))
    shutil.copyfile(path, copy)
    size = os.path.getsize(copy)
    offset = size // 2 if offset is None else offset
    with open(copy, "r+b") as f:
        f.seek(offset)
        data = f.read(n)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))
    assert os.path.getsize(copy) == size and not os.path.exists(copy + checkpoints.MANIFEST)
    return copy


@pytest.fixture
def nothing_unpickled(monkeypatch):
    """Fails the test if a checkpoint is unpickled (torch.load reached from training.checkpoints)."""
    loads = []
    monkeypatch.setattr(checkpoints.torch, "load", lambda *a, **k: loads.append(a) or pytest.fail("torch.load ran"))
    return loads


def trainer_flags(flags, data, out_dir):
    """The trainer's command line of the run that wrote a checkpoint with `flags` (its saved args)."""
    argv = ["--data-dir", data, "--out-dir", str(out_dir)]
    for key in ("n_layer", "n_head", "n_embd", "seq_len", "vocab_size", "total_batch_size", "batch_size", "assign",
                "device", "eval_tokens", "warmup_steps"):
        argv += [f"--{key.replace('_', '-')}", str(flags[key])]
    return argv + ["--max-steps", "4", "--wandb", "off"]


def one_error_line(capsys, stop, status=2):
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == status and len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_a_changed_checkpoint_copied_without_its_manifest_is_refused_by_every_tool(trained, tmp_path, capsys,
                                                                                   nothing_unpickled):
    data, path, flags = trained
    copy = changed_copy(path, str(tmp_path / "copied"))
    tools = {
        "trainer": (train_gpt2.main, [*trainer_flags(flags, data, tmp_path / "resumed"), "--resume", copy]),
        "sample.py": (sample.main, ["--checkpoint", copy, "--prompt", "Hello", "--device", "cpu"]),
        "export_hf.py": (export_hf.main, ["--checkpoint", copy, "--hf-dir", str(tmp_path / "hf")]),
        "hellaswag": (hellaswag.main, ["--checkpoint", copy, "--jsonl", HELLASWAG, "--device", "cpu"]),
    }
    for name, (main, argv) in tools.items():
        with pytest.raises(SystemExit) as stop:
            run_cli(main, argv)
        line = one_error_line(capsys, stop)
        assert copy in line and "corrupt checkpoint" in line and "CRC-32" in line, (name, line)
    assert not nothing_unpickled
    assert not (tmp_path / "resumed" / "config.json").exists() and not (tmp_path / "hf").exists()


def test_the_check_covers_every_record_and_truncation(trained, tmp_path):
    _, path, _ = trained
    with zipfile.ZipFile(path) as archive:
        records = {info.filename: info for info in archive.infolist()}
    pickle = next(info for name, info in records.items() if name.endswith("data.pkl"))
    with open(path, "rb") as f:  # the pickle's own bytes (the payload's structure, the flags) follow its local header
        f.seek(pickle.header_offset)
        header = f.read(30)
    pickle_data = pickle.header_offset + 30 + int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30],
                                                                                                       "little")
    for i, offset in enumerate((pickle_data + 8, None, os.path.getsize(path) * 3 // 4)):
        copy = changed_copy(path, str(tmp_path / f"c{i}"), offset=offset, n=1)
        with pytest.raises(ValueError, match="corrupt checkpoint|unreadable checkpoint"):
            checkpoints.load_checkpoint(copy)
    truncated = changed_copy(path, str(tmp_path / "t"), n=0)
    os.truncate(truncated, os.path.getsize(truncated) - 100)
    with pytest.raises(ValueError, match="unreadable checkpoint"):
        checkpoints.load_checkpoint(truncated)
    assert checkpoints.load_checkpoint(changed_copy(path, str(tmp_path / "intact"), n=0))["step"] == 2


def test_resume_auto_with_only_corrupt_checkpoints_is_an_error_not_a_fresh_start(trained, tmp_path, capsys):
    data, path, flags = trained
    run_dir = tmp_path / "run"
    changed_copy(path, str(run_dir))
    with pytest.raises(SystemExit) as stop:
        run_cli(train_gpt2.main, [*trainer_flags(flags, data, run_dir), "--resume", "auto"])
    line = one_error_line(capsys, stop)
    assert "none of the 1 checkpoint(s)" in line and "loads" in line
    assert not (run_dir / "config.json").exists()


def test_save_atomic_writes_the_crcs_even_when_torch_is_told_not_to(tmp_path):
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        path = str(tmp_path / "ckpt_00000001.pt")
        checkpoints.save_atomic({"format": checkpoints.FORMAT, "w": torch.randn(4096)}, path)
        assert torch.serialization.get_crc32_options() is False  # the caller's setting is left as it was
    finally:
        torch.serialization.set_crc32_options(before)
    checkpoints.verify_records(path)
    with pytest.raises(ValueError, match="CRC-32"):
        checkpoints.verify_records(changed_copy(path, str(tmp_path / "c")))


@pytest.mark.parametrize("payload, found", [
    ({"model": {"w": torch.zeros(3)}}, "format None"),                   # a bare state dict
    ({"format": "someone-elses-ckpt-3", "step": 1}, "format 'someone-elses-ckpt-3'"),
    ([torch.zeros(2)], "format 'list'"),
])
def test_a_payload_of_another_format_is_refused(trained, tmp_path, capsys, payload, found):
    data, _, flags = trained
    path = str(tmp_path / "other.pt")
    torch.save(payload, path)
    for main, argv in ((train_gpt2.main, [*trainer_flags(flags, data, tmp_path / "o"), "--resume", path]),
                       (sample.main, ["--checkpoint", path, "--prompt", "Hi", "--device", "cpu"])):
        with pytest.raises(SystemExit) as stop:
            run_cli(main, argv)
        line = one_error_line(capsys, stop)
        assert f"{path}: not a checkpoint of this trainer ({found}, expected 'manifold-muon-ckpt-1')" in line, line
