"""Tokenize a text corpus into the GPT-2 token shards that train_gpt2.py reads.

    python -m data.prepare                                   # OpenWebText from the Hugging Face hub
    python -m data.prepare --dataset NAME [--dataset-config C] [--text-column text]
    python -m data.prepare --files books/*.txt more.jsonl --out-dir data/books --val-fraction 0.1

Every document is preceded by the end-of-text token 50256. A document goes to the validation
split when a hash of (--seed, its index) falls below --val-fraction. Shards are `train_000000.bin`,
..., `val_000000.bin`, ..., of exactly --shard-tokens tokens each (the last of a split shorter).

Documents are read in order by this process, tokenized in chunks by --num-proc worker
processes, and written in order, so the output is the same bytes for any worker count. Memory
holds a few chunks per worker, never the corpus. Progress is checkpointed in
prepare_progress.json; rerunning an interrupted command keeps its complete shards and finishes
the rest, with the same result as an uninterrupted run.
"""
import argparse
import collections
import multiprocessing
import os
import signal
import sys
import time

import numpy as np
from tqdm import tqdm

from data.bpe import gpt2_encoding
from data.progress import PROGRESS_FILE, SPLITS, save_progress, start_or_resume
from data.shards import EOT_TOKEN, ShardError
from data.sources import OPENWEBTEXT, open_source
from data.writer import SplitWriter
from errors import UserError, run_cli

CHECKPOINT_SECONDS = 60  # besides after every completed shard
# Test hook: SIGKILL this process after that many chunks, a crash at a reproducible point.
KILL_AFTER_CHUNKS = int(os.environ.get("PREPARE_KILL_AFTER_CHUNKS", "0"))


def available_cpus():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--dataset", default=None,
                        help=f"Hugging Face dataset: hub name or local dataset folder (default {OPENWEBTEXT})")
    source.add_argument("--files", nargs="+", metavar="PATH",
                        help="local .txt (one document per file), .jsonl (one per line), .parquet (one per row)")
    p.add_argument("--dataset-config", default=None, help="configuration name of --dataset")
    p.add_argument("--dataset-split", default="train", help="split of --dataset to read (default train)")
    p.add_argument("--revision", default=None, help="hub revision (branch, tag or commit) of --dataset")
    p.add_argument("--text-column", default="text", help="field holding the text (datasets, .jsonl, .parquet)")
    p.add_argument("--out-dir", default="data/openwebtext", help="where the shards go")
    p.add_argument("--val-fraction", type=float, default=0.0005,
                   help="fraction of documents in the validation split (default 0.0005)")
    p.add_argument("--seed", type=int, default=2357, help="seed of the train/val split")
    p.add_argument("--num-proc", type=int, default=available_cpus(),
                   help="tokenizer processes (default: all cores); the output does not depend on it")
    p.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard (default 100M)")
    p.add_argument("--chunk-bytes", type=int, default=1 << 21,
                   help="text per unit of parallel work (default 2 MiB); the output does not depend on it")
    p.add_argument("--bpe-file", default=None, help="local gpt2.tiktoken rank file (offline use)")
    args = p.parse_args(argv)
    if not 0.0 <= args.val_fraction < 1.0:
        raise UserError(f"--val-fraction must be in [0, 1), got {args.val_fraction}")
    for name in ("num_proc", "shard_tokens", "chunk_bytes"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.files and (args.dataset_config or args.revision or args.dataset_split != "train"):
        raise UserError("--dataset-config, --dataset-split and --revision apply to --dataset, not --files")
    if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        raise UserError(f"--out-dir {args.out_dir} is a file, not a folder")
    return args


# ----------------------------------------------------------------------------------------
# Train/validation split: a function of (seed, document index) alone


def validation_documents(seed, first, count, fraction):
    """Boolean mask: which of documents first .. first+count-1 belong to the validation split.

    Document i is a validation document when splitmix64(i * golden + mix(seed)), read as a
    uniform number in [0, 1), is below fraction. No random state is carried from document to
    document, so any chunking, worker count or resume point gives the same split.
    """
    golden = np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        seed_key = splitmix64(np.array([seed % 2**64], dtype=np.uint64))[0]
        index = np.arange(first, first + count, dtype=np.uint64)
        draws = splitmix64(index * golden + seed_key)
    return (draws >> np.uint64(11)).astype(np.float64) * 2.0**-53 < fraction


def splitmix64(x):
    """The splitmix64 finalizer: a bijective mix of uint64 values (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def select_documents(tokens, lengths, chosen):
    """The tokens of the chosen documents (lengths[i] tokens each, concatenated), in order."""
    if chosen.all():
        return tokens
    if not chosen.any():
        return tokens[:0]
    return tokens[np.repeat(chosen, lengths)]


# ----------------------------------------------------------------------------------------
# Tokenization: chunks of documents, tokenized by a process pool, results in document order


def document_chunks(texts, first, chunk_bytes):
    """(index of the first document, [texts]) of about chunk_bytes characters each."""
    chunk, size = [], 0
    for text in texts:
        chunk.append(text)
        size += len(text)
        if size >= chunk_bytes:
            yield first, chunk
            first, chunk, size = first + len(chunk), [], 0
    if chunk:
        yield first, chunk


_encoding = None  # the worker's tiktoken encoding, set by start_worker


def start_worker(encoding):
    global _encoding
    _encoding = encoding
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle


def tokenize_chunk(chunk):
    """(first, per-document token counts, uint16 tokens with an EOT before each document)."""
    first, texts = chunk
    tokens, lengths = [], []
    for text in texts:
        before = len(tokens)
        tokens.append(EOT_TOKEN)
        tokens.extend(_encoding.encode_ordinary(text))
        lengths.append(len(tokens) - before)
    return first, np.array(lengths, dtype=np.int64), np.array(tokens, dtype=np.uint16)


def tokenize_in_order(chunks, encoding, num_proc):
    """tokenize_chunk of every chunk, in order, computed by num_proc processes."""
    if num_proc == 1:
        global _encoding
        _encoding = encoding
        yield from map(tokenize_chunk, chunks)
        return
    with multiprocessing.Pool(num_proc, initializer=start_worker, initargs=(encoding,)) as pool:
        pending = collections.deque()
        for chunk in chunks:
            pending.append(pool.apply_async(tokenize_chunk, (chunk,)))
            if len(pending) >= 2 * num_proc:  # bounded read-ahead keeps memory at a few chunks per worker
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


# ----------------------------------------------------------------------------------------
# The run: resume, tokenize, write, checkpoint, report


def open_writers(args, progress):
    try:
        return {split: SplitWriter(args.out_dir, split, args.shard_tokens,
                                   progress["splits"][split]["shards"], progress["splits"][split]["tokens"])
                for split in SPLITS}
    except ShardError as err:
        raise UserError(str(err)) from None


def checkpoint(out_dir, progress, writers):
    for split, writer in writers.items():
        progress["splits"][split].update(writer.sync())
    save_progress(out_dir, progress)


def write_chunk(writers, progress, args, first, lengths, tokens):
    """Route one tokenized chunk's documents to the splits; returns how many shards it completed."""
    is_val = validation_documents(args.seed, first, len(lengths), args.val_fraction)
    completed = 0
    for split, chosen in (("train", ~is_val), ("val", is_val)):
        completed += writers[split].append(select_documents(tokens, lengths, chosen))
        progress["splits"][split]["documents"] += int(chosen.sum())
    progress["next_document"] = first + len(lengths)
    return completed


def tokenize_and_write(args, source, progress, encoding):
    """Tokenize every document from progress["next_document"] on; returns tokens written."""
    writers = open_writers(args, progress)
    start, tokens_before = progress["next_document"], sum(w.tokens for w in writers.values())
    chunks = document_chunks(source.documents(start), start, args.chunk_bytes)
    last_checkpoint = time.monotonic()
    interactive = sys.stderr.isatty()
    with tqdm(total=source.total, initial=start, unit="doc", unit_scale=True, dynamic_ncols=True,
              mininterval=1 if interactive else 30, desc="tokenizing") as bar:
        for chunk_number, (first, lengths, tokens) in enumerate(
                tokenize_in_order(chunks, encoding, args.num_proc), 1):
            completed = write_chunk(writers, progress, args, first, lengths, tokens)
            bar.update(len(lengths))
            if chunk_number == KILL_AFTER_CHUNKS:
                os.kill(os.getpid(), signal.SIGKILL)
            if completed or time.monotonic() - last_checkpoint >= CHECKPOINT_SECONDS:
                checkpoint(args.out_dir, progress, writers)
                last_checkpoint = time.monotonic()
    checkpoint(args.out_dir, progress, writers)  # every document is covered: only finishing is left
    for writer in writers.values():
        writer.finish()
    for split, writer in writers.items():
        progress["splits"][split].update(shards=writer.shards, tokens=writer.tokens)
    return sum(w.tokens for w in writers.values()) - tokens_before


def summary(progress, out_dir):
    splits = progress["splits"]
    documents = sum(s["documents"] for s in splits.values())
    tokens = sum(s["tokens"] for s in splits.values())
    shards = sum(s["shards"] for s in splits.values())
    parts = ", ".join(f"{split} {s['documents']:,} documents / {s['tokens']:,} tokens / {s['shards']} shards"
                      for split, s in splits.items())
    return f"{documents:,} documents, {tokens:,} tokens, {shards} shards in {out_dir} ({parts})"


def main(argv=None):
    args = parse_args(argv)
    source = open_source(args)
    total = f"{source.total:,} documents" if source.total is not None else "documents counted as read"
    print(f"input: {source.describe()}, {total}")
    os.makedirs(args.out_dir, exist_ok=True)
    settings = {"source": source.identity(), "val_fraction": args.val_fraction, "seed": args.seed,
                "shard_tokens": args.shard_tokens}
    progress = start_or_resume(args.out_dir, settings)
    if progress["done"]:
        print(f"already complete: {summary(progress, args.out_dir)}; 0 tokens/s (nothing to do)")
        return
    if progress["next_document"]:
        print(f"resuming at document {progress['next_document']:,} from {PROGRESS_FILE}")
    encoding, bpe_source = gpt2_encoding(args.bpe_file)
    print(f"GPT-2 BPE from {bpe_source}; {args.num_proc} tokenizer process(es)")
    started = time.time()
    try:
        written = tokenize_and_write(args, source, progress, encoding)
    except KeyboardInterrupt:
        raise UserError("interrupted; rerun the same command to resume from the last checkpoint") from None
    if progress["next_document"] == 0:
        raise UserError("the input holds no documents")
    if progress["splits"]["train"]["documents"] == 0:  # not marked done: the trainer could not use it
        raise UserError(f"every document fell in the validation split: {args.out_dir} has no train tokens; "
                        "lower --val-fraction or give more documents")
    progress["done"] = True
    save_progress(args.out_dir, progress)
    if args.val_fraction == 0:
        print("warning: --val-fraction 0 writes no validation split; train_gpt2.py needs one (*val*.bin in "
              "the same folder)", file=sys.stderr)
    elif progress["splits"]["val"]["documents"] == 0:
        print("warning: no document fell in the validation split (the trainer needs one); "
              "raise --val-fraction or change --seed", file=sys.stderr)
    elapsed = time.time() - started
    print(f"done: {summary(progress, args.out_dir)}; {written / max(elapsed, 1e-9):,.0f} tokens/s "
          f"({written:,} tokens in {elapsed:.1f} s this run)")


if __name__ == "__main__":
    run_cli(main)
