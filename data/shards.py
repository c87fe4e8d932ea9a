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
    shard = PartialShard(path)
    shard.append(tokens.astype(TOKEN_DTYPE, copy=False))
    shard.finish()


def header_bytes(count):
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (MAGIC, VERSION, count)
    return header.tobytes()


class PartialShard:
    """A shard being filled under the temporary name `{path}.tmp`; `finish` makes it `path`.

    Until then its header counts 0 tokens and no reader looks at it (readers glob `*.bin`), so a
    file with a shard's final name is always complete. `keep_tokens` reopens an existing
    temporary file and keeps its first `keep_tokens` tokens (what a progress checkpoint recorded).
    """

    def __init__(self, path, keep_tokens=0):
        self.path, self.tmp_path, self.tokens = path, f"{path}.tmp", keep_tokens
        if keep_tokens == 0:
            self.file = open(self.tmp_path, "wb")
            self.file.write(header_bytes(0))
            return
        size = HEADER_BYTES + keep_tokens * TOKEN_DTYPE.itemsize
        if not os.path.exists(self.tmp_path) or os.path.getsize(self.tmp_path) < size:
            raise ShardError(f"{self.tmp_path}: expected at least {keep_tokens} tokens to resume from")
        self.file = open(self.tmp_path, "r+b")
        self.file.truncate(size)  # drop what was written after the checkpoint
        self.file.seek(size)

    def append(self, tokens):
        """Append tokens (a numpy array of ids < 2**16)."""
        self.file.write(tokens.astype(TOKEN_DTYPE, copy=False).tobytes())
        self.tokens += len(tokens)

    def sync(self):
        """Make the tokens appended so far durable (before a checkpoint records them)."""
        self.file.flush()
        os.fsync(self.file.fileno())

    def finish(self):
        """Write the token count into the header, fsync, and rename to the final name."""
        self.file.seek(0)
        self.file.write(header_bytes(self.tokens))
        self.sync()
        self.file.close()
        os.replace(self.tmp_path, self.path)


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


class ShardReader:
    """A shard's tokens read with pread, for a training run that reads it for hours.

    A memory map of a file that shrinks under it (rewritten in place by another job) kills the
    process with SIGBUS at the next read of the lost pages; pread returns short instead, and that
    is reported here as a ShardError naming the file. A shard replaced by a rename goes on being
    read from the file that was opened, consistently.
    """

    def __init__(self, path):
        self.path, self.count = path, read_header(path)
        self.fd = os.open(path, os.O_RDONLY)

    def __len__(self):
        return self.count

    def read(self, start, length):
        """Tokens [start, start + length) as a uint16 array."""
        want = length * TOKEN_DTYPE.itemsize
        data = os.pread(self.fd, want, HEADER_BYTES + start * TOKEN_DTYPE.itemsize)
        if len(data) != want:
            raise ShardError(f"{self.path} changed while the run read it: {len(data)} of {want} bytes at token "
                             f"{start} (the header said {self.count} tokens); do not rewrite shards in use")
        return np.frombuffer(data, dtype=TOKEN_DTYPE)

    def close(self):
        os.close(self.fd)
