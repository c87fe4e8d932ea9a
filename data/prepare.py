"""Tokenize text into the GPT-2 token shards that train_gpt2.py reads.

    python data/prepare.py --files books/*.txt --out-dir data/books --val-fraction 0.1

Each .txt file is one document; each .jsonl line is one document (its --text-column field).
Every document is preceded by the end-of-text token 50256. Documents are assigned to the
validation split by a seeded draw per document, so the split does not depend on file order
within a document list that is the same.
"""
import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data.bpe import gpt2_encoding  # noqa: E402
from data.shards import EOT_TOKEN, write_shard  # noqa: E402
from errors import UserError, run_cli  # noqa: E402


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", nargs="+", required=True, metavar="PATH",
                   help="local .txt (one document per file) or .jsonl (one document per line) files")
    p.add_argument("--out-dir", default="data/openwebtext", help="where the shards go")
    p.add_argument("--val-fraction", type=float, default=0.0005,
                   help="fraction of documents in the validation split (default 0.0005)")
    p.add_argument("--seed", type=int, default=2357, help="seed of the train/val split")
    p.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard")
    p.add_argument("--text-column", default="text", help="field holding the text in .jsonl files")
    p.add_argument("--bpe-file", default=None, help="local gpt2.tiktoken rank file (offline use)")
    args = p.parse_args(argv)
    if not 0.0 <= args.val_fraction < 1.0:
        raise UserError(f"--val-fraction must be in [0, 1), got {args.val_fraction}")
    if args.shard_tokens < 1:
        raise UserError(f"--shard-tokens must be positive, got {args.shard_tokens}")
    return args


def iter_documents(paths, text_column):
    for path in paths:
        if not os.path.isfile(path):
            raise UserError(f"no such file: {path}")
        if path.endswith(".jsonl"):
            with open(path, encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            yield json.loads(line)[text_column]
                        except (json.JSONDecodeError, KeyError, TypeError) as err:
                            raise UserError(f"{path}:{lineno}: not a JSON object with a "
                                            f"{text_column!r} field ({err})") from None
        elif path.endswith(".txt"):
            with open(path, encoding="utf-8", errors="replace") as f:
                yield f.read()
        else:
            raise UserError(f"{path}: unsupported file type (use .txt or .jsonl)")


class ShardWriter:
    """Accumulates tokens and writes `{split}_{index:06d}.bin` shards of shard_tokens each."""

    def __init__(self, out_dir, split, shard_tokens):
        self.out_dir, self.split, self.shard_tokens = out_dir, split, shard_tokens
        self.buffer, self.buffered, self.shards, self.tokens = [], 0, 0, 0

    def add(self, tokens):
        self.buffer.append(tokens)
        self.buffered += len(tokens)
        while self.buffered >= self.shard_tokens:
            self._flush(self.shard_tokens)

    def _flush(self, count):
        joined = np.concatenate(self.buffer)
        path = os.path.join(self.out_dir, f"{self.split}_{self.shards:06d}.bin")
        write_shard(path, joined[:count])
        self.buffer = [joined[count:]]
        self.buffered = len(joined) - count
        self.shards += 1
        self.tokens += count

    def close(self):
        if self.buffered:
            self._flush(self.buffered)


def main(argv=None):
    args = parse_args(argv)
    encoding, source = gpt2_encoding(args.bpe_file)
    print(f"GPT-2 BPE from {source}")
    os.makedirs(args.out_dir, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    writers = {s: ShardWriter(args.out_dir, s, args.shard_tokens) for s in ("train", "val")}
    start, documents = time.time(), 0
    for text in iter_documents(args.files, args.text_column):
        split = "val" if rng.random() < args.val_fraction else "train"
        tokens = np.array([EOT_TOKEN] + encoding.encode_ordinary(text), dtype=np.uint16)
        writers[split].add(tokens)
        documents += 1
    for w in writers.values():
        w.close()
    tokens = sum(w.tokens for w in writers.values())
    elapsed = time.time() - start
    print(f"{documents} documents, {tokens} tokens (train {writers['train'].tokens}, "
          f"val {writers['val'].tokens}), {sum(w.shards for w in writers.values())} shards "
          f"in {args.out_dir}, {tokens / max(elapsed, 1e-9):.0f} tokens/s")


if __name__ == "__main__":
    run_cli(main)
