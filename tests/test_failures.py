"""What a misbehaving machine does to a run: corrupt checkpoints, full disks, degenerate data,
unusable loggers, shared run folders. Each case ends in a clean `error:` or a verified fallback."""
import errno
import json
import os
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import train_gpt2
from errors import EXIT_WRITE_FAILED, UserError, WriteError, run_cli
from gloo_ranks import end_rank_process
from synthetic import make_shards, trainer_in_process
from test_reliability import (ENV, RUN, assert_resumed, command, has_checkpoint, has_rows,
                              killed_after_two_checkpoints, run, start_then, train_losses)
from training import checkpoints
from training.run_dir import check_shared_out_dir
from training.run_log import RunLog


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_shards(str(tmp_path_factory.mktemp("data")))


@pytest.fixture(scope="module")
def straight(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    assert run(data_dir, out).returncode == 0
    return out


def one_error_line(result, status=2):
    lines = result.stderr.strip().splitlines()
    assert result.returncode == status, result.stdout[-2000:] + result.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_changed_bytes_inside_the_newest_checkpoint_are_detected_and_skipped(data_dir, straight, tmp_path):
    newest, before = killed_after_two_checkpoints(data_dir, tmp_path)
    size = os.path.getsize(newest)
    with open(newest, "r+b") as f:  # 8 bytes in the middle: the zip stays readable, a tensor changes
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in f.read(8)))
        f.seek(size // 2)
    assert os.path.getsize(newest) == size
    with pytest.raises(ValueError, match="corrupt checkpoint"):
        checkpoints.load_checkpoint(str(newest))
    result = run(data_dir, tmp_path, "--resume", "auto", "--log-every", "1")
    assert result.returncode == 0, result.stderr
    assert "skipping" in result.stdout and "corrupt checkpoint" in result.stdout
    assert "resuming from" in result.stdout and before.name in result.stdout
    # a restart from step 1 reproduces the same losses: only the process's own lines tell it resumed
    assert_resumed(result, int(before.name[5:13]))
    assert train_losses(tmp_path) == train_losses(straight)  # bitwise, from the one before on
    # --resume PATH of a corrupt file is an error, not a silent load
    checkpoints.save_atomic({"format": "manifold-muon-ckpt-1"}, str(tmp_path / "other.pt"))
    with open(tmp_path / "other.pt", "r+b") as f:
        f.seek(40)
        f.write(b"\0" * 8)
    result = subprocess.run(command(1, "--data-dir", data_dir, "--out-dir", str(tmp_path / "r"), *RUN,
                                    "--resume", str(tmp_path / "other.pt")), capture_output=True, text=True,
                            timeout=120, env=ENV)
    assert "corrupt checkpoint" in one_error_line(result)


def test_a_valid_checkpoint_rewritten_with_other_content_is_caught_by_its_manifest_alone(data_dir, straight,
                                                                                        tmp_path):
    """A checkpoint replaced by another complete torch.save file (a weight changed, every zip CRC
    consistent): the CRC check and torch.load pass, so only the SHA-256 manifest can refuse it."""
    for name in os.listdir(straight):  # a copy of the finished run: checkpoints 28 and 30
        (tmp_path / name).write_bytes((straight / name).read_bytes())
    newest = tmp_path / "ckpt_00000030.pt"
    payload = torch.load(newest, map_location="cpu", weights_only=True)
    payload["model"]["wte.weight"][0, 0] += 1.0
    with open(newest, "wb") as f:
        checkpoints.save_with_crc32(payload, f)
    checkpoints.verify_records(str(newest))  # the CRCs hold: the zip check alone would load it
    assert torch.load(newest, map_location="cpu", weights_only=True)["format"] == checkpoints.FORMAT
    with pytest.raises(ValueError, match=r"ckpt_00000030\.pt: corrupt checkpoint \(SHA-256 .* differs"):
        checkpoints.load_checkpoint(str(newest))
    result = subprocess.run(command(1, "--data-dir", data_dir, "--out-dir", str(tmp_path / "r"), *RUN,
                                    "--resume", str(newest)), capture_output=True, text=True, timeout=120, env=ENV)
    line = one_error_line(result)
    assert "corrupt checkpoint (SHA-256" in line and str(newest) in line
    result = run(data_dir, tmp_path, "--resume", "auto", "--log-every", "1")
    assert result.returncode == 0, result.stderr
    assert f"skipping {newest}: corrupt checkpoint (SHA-256" in result.stdout
    assert_resumed(result, 28)  # the one before, then steps 29 and 30 again
    assert train_losses(tmp_path) == train_losses(straight)


def test_the_manifest_is_sha256sum_format():
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"ckpt_{os.getpid():08d}.pt")
    digest = checkpoints.save_atomic({"format": "manifold-muon-ckpt-1", "x": torch.arange(10)}, path)
    try:
        assert open(path + ".sha256").read() == f"{digest}  {os.path.basename(path)}\n"
        assert checkpoints.file_sha256(path) == digest and checkpoints.verify(path) is True
        check = subprocess.run(["sha256sum", "-c", os.path.basename(path) + ".sha256"], cwd=os.path.dirname(path),
                               capture_output=True, text=True)
        assert check.returncode == 0 and check.stdout.strip().endswith("OK")
    finally:
        checkpoints.remove_checkpoint(path)


class FullFile:
    """A file whose writes fail with ENOSPC once `budget` bytes went through (a disk filling up)."""

    def __init__(self, file, budget):
        self.file, self.budget = file, budget

    def write(self, data):
        if len(data) > self.budget:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.budget -= len(data)
        return self.file.write(data)


class FullDisk:
    """The disk fills up `budget` bytes into the `nth` checkpoint written (its HashingWriter)."""

    def __init__(self, monkeypatch, nth, budget):
        self.calls = 0
        original_init = checkpoints.HashingWriter.__init__

        def init(writer, file):
            self.calls += 1
            original_init(writer, FullFile(file, budget) if self.calls == nth else file)

        monkeypatch.setattr(checkpoints.HashingWriter, "__init__", init)


def test_a_full_disk_during_a_checkpoint_is_one_error_and_loses_nothing(data_dir, tmp_path, monkeypatch, capsys):
    FullDisk(monkeypatch, nth=2, budget=20_000)  # the checkpoint of step 8 fails after 20 kB
    argv = ["--data-dir", data_dir, "--out-dir", str(tmp_path), *RUN]
    with pytest.raises(SystemExit) as stop:
        run_cli(train_gpt2.main, argv)
    assert stop.value.code == EXIT_WRITE_FAILED == 5
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: cannot write ") and "ckpt_00000008.pt" in err[0]
    assert "the disk is full" in err[0] and "GiB free in" in err[0]
    assert not list(tmp_path.glob("*.tmp")), list(tmp_path.iterdir())  # no partial file
    assert sorted(p.name for p in tmp_path.glob("ckpt_*")) == ["ckpt_00000004.pt", "ckpt_00000004.pt.sha256"]
    assert checkpoints.load_checkpoint(str(tmp_path / "ckpt_00000004.pt"))["step"] == 4
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["status"] == "write_failed" and "No space left" in summary["error"] and summary["steps"] == 8


def test_a_failing_metrics_write_is_a_write_error(data_dir, tmp_path, monkeypatch):
    rows = {"n": 0}
    original = RunLog.row

    def row(log, **fields):
        rows["n"] += 1
        if rows["n"] == 3:
            log.metrics.close()  # what a lost mount looks like from here: the write fails
            log.metrics = open(os.devnull, "w")
            log.metrics.write = lambda text: (_ for _ in ()).throw(OSError(errno.EIO, "Input/output error"))
        return original(log, **fields)

    monkeypatch.setattr(RunLog, "row", row)
    with pytest.raises(WriteError, match="metrics.jsonl: an I/O error"):
        train_gpt2.main(["--data-dir", data_dir, "--out-dir", str(tmp_path), *RUN])
    assert json.load(open(tmp_path / "summary.json"))["status"] == "write_failed"


def test_leftovers_of_a_killed_writer_are_removed_and_a_stale_lock_does_not_block(data_dir, straight, tmp_path):
    proc = start_then(data_dir, tmp_path, has_checkpoint(8))
    os.killpg(proc.pid, signal.SIGKILL)  # dies holding run.lock
    proc.wait()
    (tmp_path / "ckpt_00000012.pt.tmp").write_bytes(b"half a checkpoint")
    (tmp_path / "summary.json.tmp").write_text("{")
    newest = int(sorted(tmp_path.glob("ckpt_*.pt"))[-1].name[5:13])
    result = run(data_dir, tmp_path, "--resume", "auto", "--log-every", "1")
    assert result.returncode == 0, result.stderr
    assert_resumed(result, newest)
    # the two planted here, and any the killed writer left of its own (it may die inside a write: a
    # checkpoint's .sha256.tmp, seen once)
    said = [line for line in result.stdout.splitlines() if line.startswith("removed ")]
    assert len(said) == 1 and " temporary file(s) of an unfinished write: " in said[0], result.stdout
    removed = said[0].split(": ", 1)[1].split(", ")
    assert {"ckpt_00000012.pt.tmp", "summary.json.tmp"} <= set(removed)
    assert said[0].startswith(f"removed {len(removed)} ") and all(name.endswith(".tmp") for name in removed)
    assert not list(tmp_path.glob("*.tmp"))
    assert train_losses(tmp_path) == train_losses(straight)


def test_a_second_run_into_a_busy_folder_is_refused(data_dir, tmp_path):
    proc = start_then(data_dir, tmp_path, has_rows(2), 1, "--max-steps", "2000", "--ckpt-every", "1")
    try:
        result = run(data_dir, tmp_path, "--resume", "auto")
        line = one_error_line(result)
        assert "is in use by another run" in line and f"pid {proc.pid}" in line
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_degenerate_data_is_an_error_before_training(tmp_path):
    empty_val = make_shards(str(tmp_path / "a"), val_tokens=0)
    result = trainer_in_process("--data-dir", empty_val, "--out-dir", tmp_path / "o", *RUN)
    assert "val_000000.bin: the shard holds no tokens" in one_error_line(result)
    short_val = make_shards(str(tmp_path / "b"), val_tokens=20)  # below one 32-token sequence
    result = trainer_in_process("--data-dir", short_val, "--out-dir", tmp_path / "o", *RUN)
    assert "the val shards hold 20 tokens: fewer than one sequence" in one_error_line(result)
    short_train = make_shards(str(tmp_path / "c"), train_tokens=200)  # 6 sequences < a batch of 8
    result = trainer_in_process("--data-dir", short_train, "--out-dir", tmp_path / "o", *RUN)
    assert "fewer than one batch of 8 sequences" in one_error_line(result)
    assert not (tmp_path / "o" / "metrics.jsonl").exists()


@pytest.mark.parametrize("flags, message", [
    (["--muon-lr", "inf"], "--muon-lr must be a finite number, got inf"),
    (["--grad-clip", "nan"], "--grad-clip must be a finite number, got nan"),
    (["--lr=-inf"], "--lr must be a finite number"),
    (["--auto-saturation", "1.5"], "--auto-saturation is a probability"),
    (["--cuda-graph", "on"], "--cuda-graph needs the sync-free step: --solver-opt capturable=on"),
    (["--cuda-graph", "on", "--solver-opt", "capturable=on", "--assign", "auto"], "--cuda-graph with --assign auto"),
])
def test_non_finite_and_out_of_range_flags_are_refused(data_dir, tmp_path, flags, message):
    result = trainer_in_process("--data-dir", data_dir, "--out-dir", tmp_path / "o", *RUN, *flags)
    assert message in one_error_line(result)


def test_wandb_online_without_credentials_fails_before_training(data_dir, tmp_path):
    env = {k: v for k, v in ENV.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path), NETRC=str(tmp_path / "netrc"), WANDB_CONFIG_DIR=str(tmp_path / "wandb"))
    result = subprocess.run(command(1, "--data-dir", data_dir, "--out-dir", str(tmp_path / "o"), *RUN,
                                    "--wandb", "online"), capture_output=True, text=True, timeout=120, env=env,
                            stdin=subprocess.DEVNULL)
    line = one_error_line(result)
    assert "not logged in" in line and "wandb login" in line and "--wandb offline" in line
    assert not (tmp_path / "o").exists()


def _shared_check_worker(rank, init_file, folders, outcome):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=len(folders))
    try:
        check_shared_out_dir(folders[rank], rank, len(folders))
        outcome[rank] = "ok"
    except UserError as err:
        outcome[rank] = str(err)
    finally:
        end_rank_process()


@pytest.mark.parametrize("shared", [True, False])
def test_an_out_dir_the_ranks_do_not_share_is_an_error_on_every_rank(tmp_path, shared):
    # Two nodes whose --out-dir is a local folder each: the same path, two different folders.
    a, b = tmp_path / "node0", tmp_path / "node1"
    a.mkdir()
    b.mkdir()
    folders = [str(a), str(a if shared else b)]
    outcome = mp.Manager().dict()
    mp.spawn(_shared_check_worker, args=(str(tmp_path / "init"), folders, outcome), nprocs=2)
    if shared:
        assert dict(outcome) == {0: "ok", 1: "ok"}
    else:
        assert all("is not shared: rank 1 on " in outcome[r] for r in (0, 1))  # both ranks stop
        assert "filesystem every node mounts" in outcome[0]
    assert not list(a.iterdir()) and not list(b.iterdir())  # the token is gone


def test_prepare_refuses_a_split_with_no_train_documents(tmp_path):
    src = tmp_path / "one.txt"
    src.write_text("A single short document.")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-m", "data.prepare", "--files", str(src),
                             "--out-dir", str(tmp_path / "shards"), "--val-fraction", "0.999999", "--num-proc", "1"],
                            capture_output=True, text=True, timeout=120, env=ENV, cwd=root)
    assert "every document fell in the validation split" in result.stderr and result.returncode == 2


def test_resuming_on_changed_train_shards_warns(data_dir, tmp_path):
    out = tmp_path / "run"
    assert run(data_dir, out, "--max-steps", "4").returncode == 0
    changed = make_shards(str(tmp_path / "changed"), train_tokens=24000)
    result = run(changed, out, "--max-steps", "6", "--resume", "auto")
    assert result.returncode == 0, result.stderr
    assert "warning: the train shards" in result.stderr
    again = run(changed, out, "--max-steps", "8", "--resume", "auto")
    assert again.returncode == 0 and "warning" not in again.stderr


def test_a_shard_rewritten_shorter_while_training_is_an_error_not_a_crash(tmp_path):
    data = make_shards(str(tmp_path / "data"), train_tokens=40000, train_shards=1)
    stream = train_gpt2.TokenStream(train_gpt2.find_shards(data, "train"), 64)
    assert len(stream.read(39000, 100)) == 100
    os.truncate(os.path.join(data, "train_000000.bin"), 1024 + 2 * 1000)  # another job rewrote it
    with pytest.raises(UserError, match="train_000000.bin changed while the run read it"):
        stream.read(39000, 100)
