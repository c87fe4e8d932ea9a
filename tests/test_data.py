"""Shard format, prepare.py on local files, and the trainer's refusal of malformed data."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from data.bpe import gpt2_encoding
from data.shards import EOT_TOKEN, HEADER_BYTES, ShardError, open_tokens, read_header, write_shard
from synthetic import TINY_MODEL, make_shards

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_shard_round_trip_and_header(tmp_path):
    tokens = np.array([EOT_TOKEN, 1, 2, 65535, 0], dtype=np.int64)
    path = str(tmp_path / "train_000000.bin")
    write_shard(path, tokens)
    assert os.path.getsize(path) == HEADER_BYTES + 2 * len(tokens)
    header = np.fromfile(path, dtype="<i4", count=3)
    assert header.tolist() == [20240520, 1, 5]
    assert open_tokens(path).tolist() == tokens.tolist()


@pytest.mark.parametrize("corrupt, message", [
    (lambda p: _write_at(p, 0, 7), "bad magic"),
    (lambda p: _write_at(p, 4, 2), "version"),
    (lambda p: os.truncate(p, os.path.getsize(p) - 2), "truncated"),
    (lambda p: os.truncate(p, 100), "shorter than"),
])
def test_malformed_shards_are_described(tmp_path, corrupt, message):
    path = str(tmp_path / "x.bin")
    write_shard(path, np.arange(10))
    corrupt(path)
    with pytest.raises(ShardError, match=message):
        read_header(path)


def _write_at(path, offset, value):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(np.int32(value).tobytes())


def test_gpt2_encoding_offline():
    encoding, source = gpt2_encoding()
    assert encoding.encode("Hello world") == [15496, 995]
    assert encoding.eot_token == EOT_TOKEN
    assert source


def prepare(*argv):
    return subprocess.run([sys.executable, os.path.join(ROOT, "data", "prepare.py"), *argv],
                          capture_output=True, text=True, timeout=120)


def test_prepare_round_trip_of_local_files(tmp_path):
    docs = ["The first document.\nTwo lines.", "Second one, with unicode: café ☕", "Third."]
    (tmp_path / "a.txt").write_text(docs[0], encoding="utf-8")
    with open(tmp_path / "b.jsonl", "w", encoding="utf-8") as f:
        for d in docs[1:]:
            f.write(json.dumps({"text": d}) + "\n")
    out = tmp_path / "shards"
    result = prepare("--files", str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl"), "--out-dir", str(out),
                     "--val-fraction", "0", "--shard-tokens", "7")
    assert result.returncode == 0, result.stderr
    shards = sorted(p for p in os.listdir(out) if p.startswith("train"))
    assert len(shards) > 1  # small --shard-tokens splits the stream
    tokens = np.concatenate([open_tokens(str(out / p)) for p in shards]).astype(np.int64)
    encoding, _ = gpt2_encoding()
    text = encoding.decode(tokens.tolist())
    assert text == "".join("<|endoftext|>" + d for d in docs)


def run_trainer(data_dir, out_dir, *extra):
    return subprocess.run([sys.executable, os.path.join(ROOT, "train_gpt2.py"), "--data-dir", str(data_dir),
                           "--out-dir", str(out_dir), *TINY_MODEL, "--max-steps", "1", *extra],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("damage, message", [
    (lambda d: [os.remove(os.path.join(d, f)) for f in os.listdir(d) if "val" in f], "no val shards"),
    (lambda d: [os.remove(os.path.join(d, f)) for f in os.listdir(d) if "train" in f], "no train shards"),
    (lambda d: _write_at(os.path.join(d, "val_000000.bin"), 0, 1234), "bad magic"),
    (lambda d: os.truncate(os.path.join(d, "train_000001.bin"), 2000), "truncated"),
    (lambda d: write_shard(os.path.join(d, "val_000000.bin"), np.full(4000, 100)), "vocab-size"),
    (lambda d: [write_shard(os.path.join(d, f"train_00000{i}.bin"), np.arange(60)) for i in (0, 1)],
     "fewer than one batch"),
])
def test_trainer_refuses_malformed_data(tmp_path, damage, message):
    data_dir = make_shards(str(tmp_path / "data"))
    damage(data_dir)
    result = run_trainer(data_dir, tmp_path / "out")
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_trainer_refuses_empty_data_dir(tmp_path):
    (tmp_path / "empty").mkdir()
    result = run_trainer(tmp_path / "empty", tmp_path / "out")
    assert result.returncode == 2 and "no train shards" in result.stderr
