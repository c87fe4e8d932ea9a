"""The token shard format: a 256 x int32 header, then the tokens as little-endian uint16.

Header: [0] magic 20240520, [1] version 1, [2] number of tokens, the rest zero.
Documents are separated by the GPT-2 end-of-text token 50256.
"""
import os

import numpy as np

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
EOT_TOKEN = 50256
TOKEN_DTYPE = np.dtype("<u2")


class ShardError(ValueError):
    """A shard file that is not in the expected format (message says which and why)."""


def write_shard(path, tokens):
    """Write tokens (any int array, values < 2**16) atomically: temp name, fsync, rename."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**16):
        raise ValueError("token ids must fit in uint16")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (MAGIC, VERSION, tokens.size)
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype(TOKEN_DTYPE, copy=False).tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_header(path):
    """Validated token count of a shard; raises ShardError describing what is wrong."""
    size = os.path.getsize(path)
    if size < HEADER_BYTES:
        raise ShardError(f"{path}: {size} bytes is shorter than the {HEADER_BYTES}-byte header")
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    if header[0] != MAGIC:
        raise ShardError(f"{path}: bad magic number {header[0]} (expected {MAGIC}); not a token shard")
    if header[1] != VERSION:
        raise ShardError(f"{path}: unsupported shard version {header[1]} (expected {VERSION})")
    count = int(header[2])
    expected = HEADER_BYTES + count * TOKEN_DTYPE.itemsize
    if size != expected:
        raise ShardError(f"{path}: header says {count} tokens ({expected} bytes) but the file has "
                         f"{size} bytes (truncated or corrupt)")
    return count


def open_tokens(path):
    """Memory-mapped uint16 view of a shard's tokens (header validated)."""
    count = read_header(path)
    return np.memmap(path, dtype=TOKEN_DTYPE, mode="r", offset=HEADER_BYTES, shape=(count,))
