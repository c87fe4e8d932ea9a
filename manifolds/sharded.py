"""The geometry of sharded parameters (DTensors split on one dimension over one mesh dimension:
FSDP2's `fully_shard`, Shard(0) on a 1-D mesh; HSDP, (Replicate, Shard(0)) on a 2-D mesh): which
rows or columns each rank holds (`ShardLayout`, `chunk_range`: torch.chunk's split, ceil(n/P)
rows per rank, the last ranks fewer or none), where a piece (a parameter, or a row block of one)
meets a shard (`piece_box`, `dual_rows`), what a part weighs on the wire (`piece_parts`,
`wire_bytes`), exact digests of shards (`digest`), the optimizer state's placements and the
conversion of a whole state_dict into a sharded one (`shard_full_state`).

The step that uses them, who solves which piece and the collectives: manifolds/exchange.py. The
state of a sharded parameter (created by ManifoldMuon when its group is added, so that every rank
has the same keys before the first step, as torch.distributed.checkpoint's get_state_dict needs):
"step" (a CPU tensor), "momentum_buffer" (a DTensor in the parameter's layout) and one "dual" /
"dual@<lo>" per piece that keeps a warm start (q x q, a DTensor split on rows).
"""
import sys
from dataclasses import dataclass

import torch

from manifolds.geometry import geometry


def is_sharded(p):
    """Whether p is a DTensor. torch.distributed.tensor is imported only by code that makes
    DTensors (FSDP2; ~1 s of every process's start otherwise): if it is not loaded, none exists."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(p, module.DTensor)


def local(x):
    """The local part of a DTensor (the tensor itself otherwise)."""
    return x.to_local() if is_sharded(x) else x


def chunk_range(n, parts, index):
    """[lo, hi) of part `index` of n rows split as torch.chunk, FSDP2 and DTensor's Shard split
    them: ceil(n / parts) each, the last parts shorter or empty."""
    size = -(-n // parts)
    lo = min(n, index * size)
    return lo, min(n, lo + size)


@dataclass(frozen=True)
class ShardLayout:
    """How a 2-D DTensor is split: tensor dimension `dim` over mesh dimension `mesh_dim`."""
    mesh: object
    mesh_dim: int
    dim: int

    @property
    def group(self):
        return self.mesh.get_group(self.mesh_dim)

    @property
    def size(self):
        return self.mesh.size(self.mesh_dim)

    @property
    def rank(self):
        return self.mesh.get_local_rank(self.mesh_dim)

    def part(self, shape, index):
        """(rows, cols) slices of the global tensor that shard `index` holds."""
        span = [slice(0, shape[0]), slice(0, shape[1])]
        span[self.dim] = slice(*chunk_range(shape[self.dim], self.size, index))
        return tuple(span)


def shard_layout(p):
    """The ShardLayout of a sharded parameter; ValueError naming any layout it is not."""
    placements = tuple(p.placements)
    shards = [(mesh_dim, placement.dim) for mesh_dim, placement in enumerate(placements) if placement.is_shard()]
    if len(shards) != 1 or not all(pl.is_shard() or pl.is_replicate() for pl in placements) or p.dim() != 2:
        raise ValueError(f"ManifoldMuon steps matrices split on one dimension over one mesh dimension (FSDP2's "
                         f"Shard(0), HSDP's (Replicate, Shard(0))); got a {p.dim()}-D parameter with placements "
                         f"{placements} on a {p.device_mesh.ndim}-D mesh (tensor parallelism and two sharded "
                         f"dimensions are not supported)")
    mesh_dim, dim = shards[0]
    return ShardLayout(p.device_mesh, mesh_dim, dim % 2)


def keeps_warm_start(piece, options):
    """Whether the solver leaves a dual warm start for this piece (solver.solve_tall): ADMM does;
    plain Muon, the exact square Stiefel step and the reference solver do not."""
    geo = geometry(piece.manifold, piece.group.get("dgram_cap", 1.0))
    rows, cols = piece.hi - piece.lo, piece.param.size(1)
    return geo.constrained and not (geo.exact_square_step and rows == cols) and options.solver != "reference"


def radius_key(piece):
    """State key of a piece's stored radius (a manifold with `stores_radius`: the Hyperball's r),
    "radius" for a whole parameter."""
    return "radius" if piece.whole else f"radius@{piece.lo}"


def stores_radius(piece):
    return geometry(piece.manifold, piece.group.get("dgram_cap", 1.0)).stores_radius


def stored_radius(optimizer, param, lo=0):
    """The radius `optimizer` (a ManifoldMuon) keeps for the piece of `param` at row lo
    (ManifoldMuon.stored_radius)."""
    return optimizer.stored_radius(param, lo)


def warm_shape(piece):
    q = min(piece.hi - piece.lo, piece.param.size(1))
    return q, q


def warm_placements(p, layout):
    """The dual's placements: the parameter's, split on rows (its q x q has no columns to follow)."""
    from torch.distributed.tensor import Shard
    return tuple(Shard(0) if mesh_dim == layout.mesh_dim else placement
                 for mesh_dim, placement in enumerate(p.placements))


def local_part(full, p):
    """This rank's part of `full`, a whole tensor shaped as the sharded parameter p (its momentum,
    AdamW's moments), as a DTensor in p's layout."""
    from torch.distributed.tensor import DTensor
    index = full
    for mesh_dim, placement in enumerate(p.placements):
        if placement.is_shard():
            dim = placement.dim % full.dim()
            lo, hi = chunk_range(full.size(dim), p.device_mesh.size(mesh_dim), p.device_mesh.get_local_rank(mesh_dim))
            index = index.narrow(dim, lo, hi - lo)
    return DTensor.from_local(index.clone(), p.device_mesh, p.placements, run_check=False, shape=full.shape,
                              stride=full.stride())


def shard_full_state(optimizer, state_dict):
    """A whole (one-process or consolidated) optimizer state_dict for `optimizer`, whose parameters
    are sharded now: each tensor shaped as its parameter becomes this rank's part of it, each dual
    warm start this rank's rows of it (a DTensor as init_state makes them), and a sharded
    ManifoldMuon parameter that has stepped gets its "step" (its warm start is used). Parameters are
    matched by their position in the optimizer's groups, as load_state_dict matches them."""
    from torch.distributed.tensor import DTensor
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for index, values in state_dict["state"].items():
        p = params[int(index)]
        if not is_sharded(p):
            state[index] = values
            continue
        converted = {}
        for key, value in values.items():
            if torch.is_tensor(value) and tuple(value.shape) == tuple(p.shape):
                converted[key] = local_part(value, p)
            elif key.startswith("dual") and torch.is_tensor(value):
                layout = shard_layout(p)
                lo, hi = chunk_range(value.size(0), layout.size, layout.rank)
                converted[key] = DTensor.from_local(value[lo:hi].clone(), p.device_mesh, warm_placements(p, layout),
                                                    run_check=False, shape=value.shape, stride=value.stride())
            else:
                converted[key] = value
        if "momentum_buffer" in converted and "step" not in converted:  # a ManifoldMuon parameter that stepped
            converted["step"] = torch.tensor(1.0)
        state[index] = converted
    return {**state_dict, "state": state}


@torch.no_grad()
def project_sharded(p, blocks, project_block):
    """Apply `project_block(lo, hi, block) -> new block or None` to the whole of a sharded
    parameter (gathered once, when its group is added) and write back this rank's part."""
    layout = shard_layout(p)
    whole = p.full_tensor()
    changed = False
    for lo, hi, _ in blocks:
        new = project_block(lo, hi, whole[lo:hi])
        if new is not None:
            whole[lo:hi] = new
            changed = True
    if changed:
        local(p).copy_(whole[layout.part(p.shape, layout.rank)])


def piece_box(piece, layout, index):
    """Where a piece meets shard `index`: (rows in the piece, cols, rows in the shard, cols in the
    shard), as slices; empty where they do not meet."""
    rows, cols = layout.part(piece.param.shape, index)
    lo, hi = max(piece.lo, rows.start), min(piece.hi, rows.stop)
    hi = max(lo, hi)
    return (slice(lo - piece.lo, hi - piece.lo), cols,
            slice(lo - rows.start, hi - rows.start), slice(0, cols.stop - cols.start))


def box_numel(box):
    rows, cols = box[0], box[1]
    return (rows.stop - rows.start) * (cols.stop - cols.start)


def dual_rows(piece, layout, index):
    return slice(*chunk_range(warm_shape(piece)[0], layout.size, index))


# integer views of each element size, for digest
INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def digest(x):
    """(2,) int64 of the exact bits of x's elements: their sum, and their sum weighted by position
    (odd weights 1, 3, 5, ...). Any change of one element changes the first, a swap of two the
    second; integer sums wrap modulo 2^64 and do not depend on the summation's order, so the same
    bits give the same digest on any device and thread count. What a resident copy's validity is
    decided by (resident_flags): unlike version counters it sees every write (p.data, the local
    tensor, torch.distributed.checkpoint's in-place load, collectives)."""
    bits = x.detach().contiguous().view(INT_OF_SIZE[x.element_size()]).reshape(-1).to(torch.int64)
    weights = torch.arange(1, 2 * bits.numel() + 1, 2, dtype=torch.int64, device=bits.device)  # (empty shard: none)
    return torch.stack([bits.sum(), (bits * weights).sum()])


def wire_bytes(numel, dtype):
    """Bytes a part of `numel` elements of `dtype` takes in the exchange: padded to a multiple of
    4, so that every part starts where an fp32 view of it may."""
    return -(-numel * dtype.itemsize // 4) * 4


def piece_parts(piece, layout, rank, matrices, dual):
    """[(name, numel, dtype)] of rank `rank`'s part of `piece`: its box of each of `matrices`
    ((name, dtype) pairs), then (where `dual`) its rows of the warm start Lambda."""
    box = box_numel(piece_box(piece, layout, rank))
    rows = dual_rows(piece, layout, rank)
    return [(name, box, dtype) for name, dtype in matrices] + \
        ([("dual", (rows.stop - rows.start) * warm_shape(piece)[1], torch.float32)] if dual else [])
