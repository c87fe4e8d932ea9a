"""Every rank must build the same step: the same pieces in the same banks, the same owners, the
same exchange buckets, the same shard splits and the same warm-start flags. Each rank derives
them from its own parameters and state, and the collectives' sizes come from them: under NCCL
ranks that disagree hang or exchange garbage (gloo raises, late and unclearly).

So at the first step, after a state_dict is loaded (a resume) and after the groups change,
ManifoldMuon compares a digest of each of these five components over all ranks: one all-gather
of 5 integers, whose size does not depend on the step, so a disagreement cannot hang it. Every
rank then raises the same StepMismatch naming the components that differ and the ranks that
differ from rank 0.
"""
import hashlib

import torch
import torch.distributed as dist

from manifolds.exchange import all_gather_rows
from manifolds.sharded import chunk_range, is_sharded, keeps_warm_start, shard_layout

COMPONENTS = ("pieces", "owners", "buckets", "splits", "warm starts")


class StepMismatch(RuntimeError):
    """The ranks built different optimizer steps (step_agreement's module docstring)."""


def describe(pieces, param_index, started, options, groups):
    """{component: text} of the step this rank built, from what the optimizer hands it: its pieces, each
    parameter's position in group order ({id(param): i}), whether each piece's parameter has
    stepped ({piece.key: bool}: its warm start travels), the solver options, and the step's
    exchange.Groups (layout, banks, buckets, owners)."""
    ids = {piece.key: (param_index[id(piece.param)], piece.lo, piece.hi) for piece in pieces}
    described, splits, warm = [], [], []
    for piece in pieces:
        layout = shard_layout(piece.param) if is_sharded(piece.param) else None
        shape = tuple(piece.param.shape)
        described.append((ids[piece.key], piece.manifold, shape, piece.param.grad is not None,
                          None if layout is None else (tuple(layout.mesh.shape), layout.mesh_dim, layout.dim)))
        if layout is not None:
            splits.append((ids[piece.key], [chunk_range(shape[layout.dim], layout.size, r) for r in range(layout.size)]))
        warm.append((ids[piece.key], keeps_warm_start(piece, options), started[piece.key]))
    owners, buckets = [], []
    for group in groups:
        kind = "shard" if group.sharded else "replicated"
        owners += [(kind, ids[key], rank) for key, rank in sorted(group.owners.items(), key=lambda kv: ids[kv[0]])]
        buckets.append([[(name, [ids[piece.key] for piece in bank]) for name, bank in bucket]
                        for bucket in group.buckets])
    return {"pieces": repr(described), "owners": repr(owners), "buckets": repr(buckets), "splits": repr(splits),
            "warm starts": repr(warm)}


def digest(text):
    """A signed 64-bit integer of a text (the first 8 bytes of its sha256)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)


def check(components, device, group=None):
    """All-gather this rank's digests; StepMismatch on every rank if any component differs."""
    mine = torch.tensor([digest(components[name]) for name in COMPONENTS], dtype=torch.int64, device=device)
    world = dist.get_world_size(group)
    every = all_gather_rows(mine, world, group).cpu()
    differ = []
    for j, name in enumerate(COMPONENTS):
        ranks = [r for r in range(world) if every[r, j] != every[0, j]]
        if ranks:
            differ.append(f"{name} (ranks {', '.join(map(str, ranks))} differ from rank 0)")
    if differ:
        raise StepMismatch("ManifoldMuon: the ranks built different optimizer steps: " + "; ".join(differ)
                           + ". Every rank must construct the optimizer with the same parameters, groups and "
                           "options in the same order (and load the same state); the step stopped before "
                           "any exchange.")
