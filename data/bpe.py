"""GPT-2 BPE through tiktoken, with an offline fallback to a local rank file.

Compute clusters are often offline, and tiktoken downloads the GPT-2 vocabulary on first
use. The same ranks ship in the `openai-whisper` package (whisper/assets/gpt2.tiktoken);
we locate that file without importing whisper (its import pulls in numba) and verify it.
"""
import base64
import hashlib
import importlib.util
import os

import tiktoken

from errors import UserError

GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOT = "<|endoftext|>"


def whisper_rank_file():
    """Path of whisper's bundled gpt2.tiktoken, or None if whisper is not installed."""
    spec = importlib.util.find_spec("whisper")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "assets", "gpt2.tiktoken")
    return path if os.path.exists(path) else None


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
    """(encoding, source description). Order: --bpe-file, tiktoken (cache or download), whisper."""
    if bpe_file:
        return encoding_from_rank_file(bpe_file), f"rank file {bpe_file}"
    try:
        return tiktoken.get_encoding("gpt2"), "tiktoken (cache or download)"
    except Exception as err:  # offline: requests raises ConnectionError, others vary
        download_error = err
    path = whisper_rank_file()
    if path is None:
        raise UserError("cannot load the GPT-2 BPE: tiktoken could not download it "
                        f"({type(download_error).__name__}) and openai-whisper is not installed; "
                        "pass --bpe-file PATH to a gpt2.tiktoken rank file")
    return encoding_from_rank_file(path), f"offline rank file {path}"
