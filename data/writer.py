"""One split's token stream cut into shards at fixed token counts, resumable after a crash.

Shard k of a split holds tokens [k * shard_tokens, (k + 1) * shard_tokens) of that split's
stream (the last shard may be shorter). The boundaries depend only on the stream, so a run
that resumes from a checkpoint writes the same files as one that never stopped. The shard
being filled lives under a temporary name (shards.PartialShard) until it is full.
"""
import os
import re

from data.shards import PartialShard, ShardError, read_header


def shard_path(out_dir, split, index):
    return os.path.join(out_dir, f"{split}_{index:06d}.bin")


class SplitWriter:
    """Appends a split's tokens to `{split}_{index:06d}.bin` shards of exactly shard_tokens tokens.

    Starts from a checkpoint's (shards complete, tokens written): complete shards are kept, the
    partial shard is cut back to what the checkpoint recorded, later files are removed.
    """

    def __init__(self, out_dir, split, shard_tokens, shards=0, tokens=0):
        self.out_dir, self.split, self.shard_tokens = out_dir, split, shard_tokens
        self.shards, self.tokens = shards, tokens
        self.partial = None  # opened on the first token, so an empty split leaves no file
        self._check_complete_shards()
        self._remove_files_after_checkpoint()
        kept = tokens - shards * shard_tokens
        if kept:
            self._restore_partial(kept)

    def append(self, tokens):
        """Append uint16 tokens; returns how many shards this completed."""
        completed = 0
        while len(tokens):
            if self.partial is None:
                self.partial = PartialShard(shard_path(self.out_dir, self.split, self.shards))
            room = self.shard_tokens - self.partial.tokens
            self.partial.append(tokens[:room])
            self.tokens += min(room, len(tokens))
            tokens = tokens[room:]
            if self.partial.tokens == self.shard_tokens:
                self._finish_partial()
                completed += 1
        return completed

    def sync(self):
        """Make everything appended durable; returns the state a checkpoint records."""
        if self.partial is not None:
            self.partial.sync()
        return {"shards": self.shards, "tokens": self.tokens}

    def finish(self):
        """Write the last, possibly short, shard."""
        if self.partial is not None:
            self._finish_partial()

    def _finish_partial(self):
        self.partial.finish()
        self.partial = None
        self.shards += 1

    def _check_complete_shards(self):
        for index in range(self.shards):
            path = shard_path(self.out_dir, self.split, index)
            try:
                count = read_header(path) if os.path.exists(path) else None
            except ShardError as err:
                raise ShardError(f"cannot resume: {err}") from None
            if count != self.shard_tokens:
                raise ShardError(f"cannot resume: {path} should be a complete shard of {self.shard_tokens} "
                                 "tokens but is missing or damaged; delete the output folder and start again")

    def _shard_files(self):
        """(index, file name) of this split's shards and temporary shards in out_dir."""
        pattern = re.compile(rf"{re.escape(self.split)}_(\d{{6}})\.bin(\.tmp)?")
        for name in os.listdir(self.out_dir):
            match = pattern.fullmatch(name)
            if match:
                yield int(match.group(1)), name

    def _remove_files_after_checkpoint(self):
        # Written after the checkpoint: redone identically from the checkpoint's document on.
        kept_partial = self.tokens > self.shards * self.shard_tokens
        for index, name in self._shard_files():
            if index > self.shards or (index == self.shards and not kept_partial):
                os.remove(os.path.join(self.out_dir, name))

    def _restore_partial(self, kept):
        path = shard_path(self.out_dir, self.split, self.shards)
        if os.path.exists(path):  # filled and renamed after the checkpoint: reopen it as partial
            os.replace(path, f"{path}.tmp")
        self.partial = PartialShard(path, keep_tokens=kept)

