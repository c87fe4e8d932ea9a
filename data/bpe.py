"""GPT-2 BPE through tiktoken, from the rank file bundled with this repository.

Compute clusters are often offline, and tiktoken downloads the GPT-2 vocabulary on first
use. So the ranks ship here as data/gpt2.tiktoken (835,554 bytes, sha256 below; the file
OpenAI distributes with tiktoken and whisper, MIT licence: data/GPT2_BPE_LICENSE) and every
tool reads them from disk; --bpe-file PATH picks another copy. Token ids are tiktoken's
"gpt2" encoding's, id for id (tests/test_data.py).
"""
import base64
import hashlib
import os

import tiktoken

from errors import UserError

GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOT = "<|endoftext|>"
BUNDLED_RANK_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpt2.tiktoken")


def encoding_from_rank_file(path):
    """A tiktoken Encoding for GPT-2 built from a verified local rank file."""
    try:
        with open(path, "rb") as f:
            contents = f.read()
    except OSError as err:
        raise UserError(f"cannot read the BPE rank file {path}: {err.strerror}") from None
    digest = hashlib.sha256(contents).hexdigest()
    if digest != GPT2_RANKS_SHA256:
        raise UserError(f"{path}: sha256 {digest} is not the GPT-2 rank file ({GPT2_RANKS_SHA256})")
    ranks = {}
    for line in contents.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return tiktoken.Encoding(name="gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={EOT: 50256}, explicit_n_vocab=50257)


def gpt2_encoding(bpe_file=None):
    """(encoding, source description): --bpe-file if given, else the bundled rank file (no network)."""
    path = bpe_file or BUNDLED_RANK_FILE
    source = f"rank file {path}" if bpe_file else "bundled rank file data/gpt2.tiktoken"
    return encoding_from_rank_file(path), source
