"""The data pipeline: shard format, shard writer, val split, BPE, prepare.py end to end (local
files, interrupted runs, Hugging Face datasets), and the trainer's refusal of malformed data."""
import glob
import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data import prepare
from data.bpe import BUNDLED_RANK_FILE, gpt2_encoding
from data.progress import PROGRESS_FILE
from data.shards import (EOT_TOKEN, HEADER_BYTES, PartialShard, ShardError, open_tokens, read_header,
                         write_shard)
from data.writer import SplitWriter
from errors import UserError
from synthetic import TINY_MODEL, make_shards, trainer_in_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARD_TOKENS = 997  # prime, so documents straddle shard boundaries
SMALL_CHUNKS = "1500"  # characters per unit of parallel work: dozens of chunks in the test corpus


# ----------------------------------------------------------------------------------------
# Shard format


def test_shard_round_trip_and_header(tmp_path):
    tokens = np.array([EOT_TOKEN, 1, 2, 65535, 0], dtype=np.int64)
    path = str(tmp_path / "train_000000.bin")
    write_shard(path, tokens)
    assert os.path.getsize(path) == HEADER_BYTES + 2 * len(tokens)
    header = np.fromfile(path, dtype="<i4", count=3)
    assert header.tolist() == [20240520, 1, 5]
    assert open_tokens(path).tolist() == tokens.tolist()
    assert not os.path.exists(path + ".tmp")


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


def test_partial_shard_resumes_from_its_checkpointed_prefix(tmp_path):
    path = str(tmp_path / "train_000000.bin")
    shard = PartialShard(path)
    shard.append(np.arange(10, dtype=np.uint16))
    shard.sync()  # the checkpoint covers these 10 tokens
    shard.append(np.full(5, 999, dtype=np.uint16))  # written after it, then the process dies
    shard.file.close()
    assert not os.path.exists(path)  # an unfinished shard never has its final name
    resumed = PartialShard(path, keep_tokens=10)
    resumed.append(np.array([7, 8, 9], dtype=np.uint16))
    resumed.finish()
    assert open_tokens(path).tolist() == list(range(10)) + [7, 8, 9]
    with pytest.raises(ShardError, match="at least 20 tokens"):
        PartialShard(str(tmp_path / "val_000000.bin"), keep_tokens=20)


@pytest.mark.parametrize("shard_tokens", [1, 7, 1000])
def test_split_writer_cuts_fixed_shards_and_loses_nothing(tmp_path, shard_tokens):
    rng = np.random.default_rng(shard_tokens)
    pieces = [rng.integers(0, 50257, rng.integers(0, 40)).astype(np.uint16) for _ in range(60)]
    writer = SplitWriter(str(tmp_path), "train", shard_tokens)
    completed = sum(writer.append(piece) for piece in pieces)
    writer.finish()
    stream = np.concatenate(pieces)
    paths = sorted(glob.glob(str(tmp_path / "train_*.bin")))
    sizes = [read_header(p) for p in paths]
    assert sizes[:-1] == [shard_tokens] * (len(paths) - 1) and 0 < sizes[-1] <= shard_tokens
    assert completed == len(stream) // shard_tokens
    assert np.array_equal(np.concatenate([open_tokens(p) for p in paths]), stream)
    assert writer.tokens == len(stream) and writer.shards == len(paths)


# ----------------------------------------------------------------------------------------
# Train/validation split and BPE


def test_validation_split_depends_only_on_seed_and_document_index():
    whole = prepare.validation_documents(2357, 0, 20000, 0.1)
    pieces = [prepare.validation_documents(2357, a, b - a, 0.1) for a, b in [(0, 1), (1, 7000), (7000, 20000)]]
    assert np.array_equal(whole, np.concatenate(pieces))  # any chunking or resume point agrees
    assert abs(whole.mean() - 0.1) < 0.01
    other_seed = prepare.validation_documents(1, 0, 20000, 0.1)
    assert (whole != other_seed).mean() > 0.1
    assert not prepare.validation_documents(2357, 0, 20000, 0.0).any()
    assert prepare.validation_documents(-5, 10**12, 100, 0.5).any()  # negative seeds, large indices


def test_gpt2_encoding_offline(monkeypatch):
    def no_download(name):
        raise AssertionError("gpt2_encoding asked tiktoken for a download")
    monkeypatch.setattr("tiktoken.get_encoding", no_download)
    encoding, source = gpt2_encoding()
    assert "bundled" in source
    # GPT-2's ids (tiktoken's "gpt2" encoding): a merge, a leading space, digits, the special token
    assert encoding.encode("Hello world") == [15496, 995]
    assert encoding.encode(" the 2024") == [262, 48609]
    assert encoding.eot_token == EOT_TOKEN
    assert encoding.n_vocab == 50257


def test_bpe_rank_file_is_verified(tmp_path):
    bundled = BUNDLED_RANK_FILE
    encoding, source = gpt2_encoding(bundled)
    assert encoding.encode("Hello world") == [15496, 995] and bundled in source
    damaged = tmp_path / "gpt2.tiktoken"
    damaged.write_bytes(open(bundled, "rb").read()[:-10])
    with pytest.raises(UserError, match="sha256"):
        gpt2_encoding(str(damaged))
    with pytest.raises(UserError, match="cannot read"):
        gpt2_encoding(str(tmp_path / "missing.tiktoken"))


# ----------------------------------------------------------------------------------------
# prepare.py on local files


@pytest.fixture(scope="module")
def encoding():
    return gpt2_encoding()[0]


def corpus_documents(count=240, seed=0):
    """Distinct documents with unicode, emoji, odd whitespace, a literal <|endoftext|> and one empty."""
    rng = np.random.default_rng(seed)
    words = ["the", "manifold", "Muon", "café", "naïve", "日本語", "🙂", "don't", "12345", "\n", "\n\n", "  ",
             "\t", "<|endoftext|>", "Stiefel", "--", "x^2", "\r\n", "é"]
    documents = [f"document {i}: " + " ".join(rng.choice(words, rng.integers(0, 150))) for i in range(count)]
    documents[3] = ""
    return documents


def write_corpus(folder, documents):
    """The documents as two .txt files, a .jsonl (with blank lines between records) and a .parquet."""
    os.makedirs(folder, exist_ok=True)
    paths = []
    for i in (0, 1):
        paths.append(os.path.join(folder, f"doc{i}.txt"))
        with open(paths[-1], "w", encoding="utf-8", newline="") as f:
            f.write(documents[i])
    paths.append(os.path.join(folder, "docs.jsonl"))
    with open(paths[-1], "w", encoding="utf-8") as f:
        for i, text in enumerate(documents[2:150]):
            f.write(json.dumps({"id": i, "text": text}) + ("\n\n" if i % 10 == 0 else "\n"))
    paths.append(os.path.join(folder, "docs.parquet"))
    pq.write_table(pa.table({"text": documents[150:], "n": list(range(len(documents) - 150))}), paths[-1],
                   row_group_size=25)
    return paths


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    documents = corpus_documents()
    return documents, write_corpus(str(tmp_path_factory.mktemp("corpus")), documents)


def run_prepare(*argv, env=None):
    return subprocess.run([sys.executable, "-m", "data.prepare", *map(str, argv)],
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)


def local_argv(paths, out_dir, *extra):
    return ["--files", *paths, "--out-dir", str(out_dir), "--val-fraction", "0.2",
            "--shard-tokens", str(SHARD_TOKENS), *extra]


@pytest.fixture(scope="module")
def clean_run(corpus, tmp_path_factory):
    """One uninterrupted single-process run over the corpus: the reference output."""
    out = str(tmp_path_factory.mktemp("clean"))
    result = run_prepare(*local_argv(corpus[1], out, "--num-proc", "1"))
    assert result.returncode == 0, result.stderr
    return out, result.stdout


def shard_files(out_dir):
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(out_dir, "*.bin*")))


def assert_same_output(out_dir, reference_dir):
    assert shard_files(out_dir) == shard_files(reference_dir)
    for name in shard_files(reference_dir) + [PROGRESS_FILE]:
        with open(os.path.join(out_dir, name), "rb") as a, open(os.path.join(reference_dir, name), "rb") as b:
            assert a.read() == b.read(), name


def decoded_documents(out_dir, split, encoding):
    """The documents of a split's shards: the text between consecutive end-of-text tokens."""
    paths = sorted(glob.glob(os.path.join(out_dir, f"{split}_*.bin")))
    tokens = np.concatenate([open_tokens(p) for p in paths]).astype(np.int64)
    assert tokens[0] == EOT_TOKEN
    starts = np.flatnonzero(tokens == EOT_TOKEN).tolist() + [len(tokens)]
    return [encoding.decode(tokens[a + 1:b].tolist()) for a, b in zip(starts, starts[1:])]


def is_in_order_within(part, whole):
    positions = {text: i for i, text in enumerate(whole)}
    return [positions[text] for text in part] == sorted(positions[text] for text in part)


def test_round_trip_gives_back_every_document_exactly_once(clean_run, corpus, encoding):
    out, stdout = clean_run
    documents = corpus[0]
    train = decoded_documents(out, "train", encoding)
    val = decoded_documents(out, "val", encoding)
    assert sorted(train + val) == sorted(documents)  # nothing lost, nothing duplicated
    assert is_in_order_within(train, documents) and is_in_order_within(val, documents)
    assert 20 < len(val) < 80  # about 0.2 of 240 documents
    for split in ("train", "val"):
        sizes = [read_header(os.path.join(out, f"{split}_{i:06d}.bin"))
                 for i in range(len(glob.glob(os.path.join(out, f"{split}_*.bin"))))]
        assert sizes[:-1] == [SHARD_TOKENS] * (len(sizes) - 1) and 0 < sizes[-1] <= SHARD_TOKENS
    assert len(glob.glob(os.path.join(out, "train_*.bin"))) > 5
    assert not glob.glob(os.path.join(out, "*.tmp"))
    total_tokens = sum(read_header(p) for p in glob.glob(os.path.join(out, "*.bin")))
    last_line = stdout.strip().splitlines()[-1]
    assert last_line.startswith(f"done: {len(documents)} documents, {total_tokens:,} tokens")
    assert "tokens/s" in last_line and "GPT-2 BPE from" in stdout


def test_output_is_bitwise_identical_for_any_worker_count_and_chunking(clean_run, corpus, tmp_path):
    result = run_prepare(*local_argv(corpus[1], tmp_path, "--num-proc", "2", "--chunk-bytes", SMALL_CHUNKS))
    assert result.returncode == 0, result.stderr
    assert_same_output(tmp_path, clean_run[0])


def complete_shards_at_checkpoint(out_dir):
    with open(os.path.join(out_dir, PROGRESS_FILE)) as f:
        progress = json.load(f)
    assert not progress["done"]
    return {os.path.join(out_dir, f"{split}_{i:06d}.bin")
            for split, state in progress["splits"].items() for i in range(state["shards"])}


@pytest.mark.parametrize("kill_after_chunks", [[1], [20], [45], [20, 15]])
def test_killed_runs_finish_like_a_clean_run(clean_run, corpus, tmp_path, kill_after_chunks):
    argv = local_argv(corpus[1], tmp_path, "--num-proc", "2", "--chunk-bytes", SMALL_CHUNKS)
    kept = {}
    for chunks in kill_after_chunks:  # SIGKILL: no cleanup, unflushed writes lost, like a crash
        result = run_prepare(*argv, env={**os.environ, "PREPARE_KILL_AFTER_CHUNKS": str(chunks)})
        assert result.returncode == -signal.SIGKILL, result.stderr
        kept = {p: os.stat(p).st_mtime_ns for p in complete_shards_at_checkpoint(tmp_path)}
    assert glob.glob(str(tmp_path / "*.tmp")), "the kill should leave unfinished work"
    result = run_prepare(*argv)
    assert result.returncode == 0, result.stderr
    assert_same_output(tmp_path, clean_run[0])
    assert {p: os.stat(p).st_mtime_ns for p in kept} == kept  # complete shards were kept, not redone


def test_crash_between_last_shard_and_done_mark_is_finished(clean_run, tmp_path, corpus):
    """The state after the final checkpoint: every document covered, the short last shards
    renamed, but the manifest not yet marked done."""
    out = str(tmp_path / "out")
    shutil.copytree(clean_run[0], out)
    with open(os.path.join(out, PROGRESS_FILE)) as f:
        progress = json.load(f)
    progress["done"] = False
    for state in progress["splits"].values():
        state["shards"] = state["tokens"] // SHARD_TOKENS  # the short last shard was still partial
    with open(os.path.join(out, PROGRESS_FILE), "w") as f:
        json.dump(progress, f, indent=1)
    prepare.main(local_argv(corpus[1], out, "--num-proc", "1"))
    assert_same_output(out, clean_run[0])


def test_rerun_of_a_finished_folder_rewrites_nothing(clean_run, corpus, capsys):
    out = clean_run[0]
    before = {p: os.stat(p).st_mtime_ns for p in glob.glob(os.path.join(out, "*"))}
    prepare.main(local_argv(corpus[1], out, "--num-proc", "1"))
    assert "already complete" in capsys.readouterr().out
    assert {p: os.stat(p).st_mtime_ns for p in glob.glob(os.path.join(out, "*"))} == before


def test_rerun_with_other_settings_or_into_foreign_shards_is_refused(clean_run, corpus, tmp_path):
    with pytest.raises(UserError, match="different seed"):
        prepare.main(local_argv(corpus[1], clean_run[0], "--num-proc", "1", "--seed", "1"))
    with pytest.raises(UserError, match="different shard_tokens"):
        prepare.main([*local_argv(corpus[1], clean_run[0], "--num-proc", "1"), "--shard-tokens", "5000"])
    make_shards(str(tmp_path))
    with pytest.raises(UserError, match="already holds shards"):
        prepare.main(local_argv(corpus[1], str(tmp_path), "--num-proc", "1"))


def write_text(path, text):
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return str(path)


@pytest.mark.parametrize("make_input, message", [
    (lambda d: [str(d / "missing.txt")], "no such file"),
    (lambda d: [write_text(d / "notes.md", "hi")], "unsupported file type"),
    (lambda d: [write_text(d / "a.jsonl", '{"text": "ok"}\n\n{"text": "cut\n')], r"a\.jsonl:3: not valid JSON"),
    (lambda d: [write_text(d / "a.jsonl", '{"body": "x"}\n')], "a.jsonl:1: not a JSON object with a 'text'"),
    (lambda d: [write_text(d / "a.jsonl", '{"text": 5}\n')], "int, not a string"),
    (lambda d: [write_text(d / "a.jsonl", "\n\n")], "no documents"),
    (lambda d: [_write_bytes(d / "latin.txt", "café".encode("latin-1"))], "not UTF-8"),
    (lambda d: [_write_parquet(d / "a.parquet", {"body": ["x"]})], "no column 'text' .columns: body"),
    (lambda d: [_write_parquet(d / "a.parquet", {"text": [1, 2]})], "holds int64, not text"),
    (lambda d: [_write_parquet(d / "a.parquet", {"text": ["x", None]})], "row 1: the text is NoneType"),
    (lambda d: [write_text(d / "a.parquet", "not parquet")], "not a readable parquet file"),
])
def test_input_mistakes_are_described(tmp_path, make_input, message):
    with pytest.raises(UserError, match=message):
        prepare.main(["--files", *make_input(tmp_path), "--out-dir", str(tmp_path / "out"), "--num-proc", "1"])


def _write_bytes(path, data):
    path.write_bytes(data)
    return str(path)


def _write_parquet(path, columns):
    pq.write_table(pa.table(columns), str(path))
    return str(path)


@pytest.mark.parametrize("argv, message", [
    (["--val-fraction", "1"], "--val-fraction"),
    (["--num-proc", "0"], "--num-proc must be positive"),
    (["--shard-tokens", "0"], "--shard-tokens must be positive"),
    (["--files", "a.txt", "--dataset-config", "en"], "apply to --dataset"),
    (["--bpe-file", "/nonexistent/gpt2.tiktoken", "--files", "CORPUS"], "cannot read the BPE rank file"),
])
def test_flag_mistakes_are_described(tmp_path, corpus, argv, message):
    argv = [a if a != "CORPUS" else corpus[1][0] for a in argv]
    with pytest.raises(UserError, match=message):
        prepare.main([*argv, "--out-dir", str(tmp_path / "out")])


def test_cli_reports_a_mistake_as_one_error_line(tmp_path):
    bad = write_text(tmp_path / "a.jsonl", '{"text": "fine"}\n' * 50 + "{oops\n")
    result = run_prepare("--files", bad, "--out-dir", tmp_path / "out", "--num-proc", "2")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "a.jsonl:51: not valid JSON" in result.stderr and "Traceback" not in result.stderr


# ----------------------------------------------------------------------------------------
# prepare.py on Hugging Face datasets


def test_default_source_is_openwebtext_through_load_dataset(monkeypatch, tmp_path, encoding):
    import datasets
    documents = corpus_documents(30, seed=1)
    calls = []

    def fake_load_dataset(path, name=None, **kwargs):
        calls.append((path, name, kwargs))
        return datasets.Dataset.from_dict({"text": documents, "url": ["u"] * len(documents)})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    out = str(tmp_path / "owt")
    prepare.main(["--out-dir", out, "--num-proc", "1", "--val-fraction", "0.3"])
    assert calls == [("Skylion007/openwebtext", None, {"split": "train", "revision": None, "num_proc": None})]
    train, val = decoded_documents(out, "train", encoding), decoded_documents(out, "val", encoding)
    assert sorted(train + val) == sorted(documents) and is_in_order_within(train, documents)
    assert len(val) > 0


@pytest.mark.parametrize("failure, message", [
    (ConnectionError("Couldn't reach 'x' on the Hub"), "cannot load dataset 'x'.*Couldn't reach"),
    (RuntimeError("Dataset scripts are no longer supported, but found x.py"), "--revision"),
    (None, "has no column 'text' .columns: content"),
])
def test_dataset_problems_are_described(monkeypatch, tmp_path, failure, message):
    import datasets

    def fake_load_dataset(path, name=None, **kwargs):
        if failure is not None:
            raise failure
        return datasets.Dataset.from_dict({"content": ["a"]})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    with pytest.raises(UserError, match=message):
        prepare.main(["--dataset", "x", "--out-dir", str(tmp_path / "out"), "--num-proc", "1"])


def test_datasets_pipeline_over_a_local_folder_matches_files(tmp_path):
    """The real load_dataset on a local parquet folder gives the same shards as --files."""
    documents = corpus_documents(60, seed=2)
    folder = tmp_path / "dataset"
    folder.mkdir()
    parts = [str(folder / "train-00000.parquet"), str(folder / "train-00001.parquet")]
    pq.write_table(pa.table({"text": documents[:25]}), parts[0])
    pq.write_table(pa.table({"text": documents[25:]}), parts[1])
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "hf_cache")}
    common = ["--val-fraction", "0.2", "--shard-tokens", "500", "--num-proc", "2"]
    from_dataset = run_prepare("--dataset", folder, "--out-dir", tmp_path / "a", *common, env=env)
    assert from_dataset.returncode == 0, from_dataset.stderr
    assert "dataset " + str(folder) in from_dataset.stdout and "60 documents" in from_dataset.stdout
    prepare.main(["--files", *parts, "--out-dir", str(tmp_path / "b"), *common[:-1], "1"])
    assert shard_files(tmp_path / "a") == shard_files(tmp_path / "b") and shard_files(tmp_path / "a")
    for name in shard_files(tmp_path / "a"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


# ----------------------------------------------------------------------------------------
# The trainer refuses malformed data


def run_trainer(data_dir, out_dir, *extra):
    return trainer_in_process("--data-dir", data_dir, "--out-dir", out_dir, *TINY_MODEL, "--max-steps", "1", *extra)


def _mark_unfinished(data_dir):
    with open(os.path.join(data_dir, PROGRESS_FILE), "w") as f:
        json.dump({"done": False}, f)


@pytest.mark.parametrize("damage, message", [
    (lambda d: [os.remove(os.path.join(d, f)) for f in os.listdir(d) if "val" in f], "no val shards"),
    (lambda d: [os.remove(os.path.join(d, f)) for f in os.listdir(d) if "train" in f], "no train shards"),
    (lambda d: _write_at(os.path.join(d, "val_000000.bin"), 0, 1234), "bad magic"),
    (lambda d: _write_at(os.path.join(d, "train_000000.bin"), 4, 3), "unsupported shard version 3"),
    (lambda d: os.truncate(os.path.join(d, "train_000001.bin"), 2000), "truncated"),
    (lambda d: write_shard(os.path.join(d, "val_000000.bin"), np.full(4000, 100)), "vocab-size"),
    (lambda d: [write_shard(os.path.join(d, f"train_00000{i}.bin"), np.arange(60)) for i in (0, 1)],
     "fewer than one batch"),
    (_mark_unfinished, "unfinished data/prepare.py run"),
    (lambda d: shutil.rmtree(d), "does not exist"),
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


# ----------------------------------------------------------------------------------------
# The trainer's loader: train_gpt2.TrainBatches


def window_order(batches_by_rank, steps):
    """The window of each global sequence the ranks' TrainBatches read in `steps`, in order:
    step s, micro-step m, rank r, row b is sequence s*(world*accum*B) + (m*world + r)*B + b. The
    stream is arange, so a window's first token / T is its index; each row is checked to be the
    T + 1 consecutive tokens of one window."""
    order = []
    for step in steps:
        for micro in range(batches_by_rank[0].accum):
            for batches in batches_by_rank:
                for row in batches.windows_of(step, micro).tolist():
                    T = batches.T
                    assert row == list(range(row[0], row[0] + T + 1)) and row[0] % T == 0
                    order.append(row[0] // T)
    return order


def test_train_batches_visit_each_window_once_per_epoch_reshuffled_and_resume_in_place(tmp_path):
    import train_gpt2
    T, windows = 8, 21  # 4 sequences a step (2 ranks x accumulation 2): epochs end inside steps 5 and 10
    write_shard(str(tmp_path / "train_000000.bin"), np.arange(T * windows + 1))
    stream = train_gpt2.TokenStream([str(tmp_path / "train_000000.bin")], 2 ** 16)

    def ranks(seed=7):
        return [train_gpt2.TrainBatches(stream, T, 1, grad_accum=2, seed=seed, rank=r, world_size=2) for r in (0, 1)]

    order = window_order(ranks(), range(11))  # 44 sequences: epochs 0 and 1, two of epoch 2
    first, second = order[:windows], order[windows:2 * windows]
    assert sorted(first) == sorted(second) == list(range(windows))
    assert first != second and first != list(range(windows))  # each epoch its own shuffle
    assert window_order(ranks(seed=8), range(11)) != order
    # a resumed run builds new TrainBatches and starts at its checkpoint's step: inside epoch 1
    # (step 6 reads sequences 24-27), at the step that crosses into epoch 1 (step 5: 20-23), in epoch 2
    for resume in (5, 6, 10):
        assert window_order(ranks(), range(resume, 11)) == order[4 * resume:]
