"""A bench's JSON results file, rewritten after every measurement.

A bench run under a time limit (bench/gpu_check.sh) can be killed at any point; rewriting the
whole file after each figure keeps everything measured so far. Each write goes to a temporary
name first and is renamed over the file, so a kill mid-write never leaves a truncated JSON.
"""
import json
import os


class Results:
    """The dict `data`, saved to `path` (if any) on every `put` / `append` and on `save`."""

    def __init__(self, path, **fields):
        self.path, self.data = path, dict(fields)
        self.save()

    def put(self, *keys, value):
        """data[k1][k2]...[kn] = value (missing levels created), then save; returns value."""
        node = self.data
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
        self.save()
        return value

    def append(self, key, row):
        """data[key].append(row), then save."""
        self.data.setdefault(key, []).append(row)
        self.save()
        return row

    def save(self):
        if not self.path:
            return
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=str)  # default=str: dtypes, devices in configs
        os.replace(tmp, self.path)
