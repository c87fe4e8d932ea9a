"""ManifoldMuon on sharded parameters: DTensors split on one dimension over one mesh dimension
(FSDP2's `fully_shard`: Shard(0) on a 1-D mesh; HSDP: (Replicate, Shard(0)) on a 2-D mesh, whose
replicas each run the same exchange on their own shard group).

Manifold Muon needs whole matrices, and more than Muon does: the tangent space and the retraction
are W's, and the answer is a new W, not an increment. So each piece (a parameter, or a row block
of one) has an owner among the P ranks of its shard group (work.balanced_owners on
work.piece_cost, as under DDP), and one step is

  1. momentum on the local shards: buf <- mu buf + g, G = g + mu buf (the state "momentum_buffer"
     is a DTensor in the parameter's layout, so it shards, saves and reshards with it);
  2. out, one all_to_all_single: each rank sends its part of every piece's G to the owner (in the
     plan's wire dtype: bf16 on a GPU, fp32 elsewhere; SolverOptions.exchange_grad), of W (fp32)
     and, once warm, of its dual warm start Lambda (q x q, a DTensor split on rows); with
     SolverOptions.resident on, W and Lambda only where the owner holds no valid resident copy of
     them (resident_flags: the first step, after a load or new groups, a shard or warm start
     written outside the step, by any route: digests of what the shards hold decide, not version
     counters);
  3. the owners assemble their pieces and solve each bank's share in one batched call, exactly as
     one process does (optimizer._step_banks), and (resident on) keep the new W, rounded to the
     parameter's dtype as the shards store it, and Lambda as resident copies;
  4. back, one all_to_all_single: each rank receives its part of every new W and new Lambda (fp32)
     and writes it in place into its local shard (FSDP's sharded storage), so that the shards,
     and the checkpoints made from them, always hold the current values.

No rank gathers every matrix. Steps 2-4 run per bucket of pieces (`buckets`, EXCHANGE_BUCKET
elements of W per rank), the next bucket's step 2 in flight while one solves
(SolverOptions.overlap), so that an owner holds one bucket's matrices whole at a time, not all of
its own: two collectives per bucket (GPT-2 small on 8 ranks: one bucket; XL: 16), their number
and sizes fixed by the shapes, not by the data; each bucket's owners balanced on their own
(`buckets`, `bucket_owners`). Per step and rank, summed over the matrices with balanced owners,
a step receives about (P-1)/P^2 ((g + 4) |W| + 4 |Lambda|) out and (P-1)/P^2 4 (|W| + |Lambda|)
back, in bytes, g = 2 for bf16 G, where |Lambda| = q^2 (0 for plain Muon, the exact square
Stiefel step and the reference solver, which keep no warm start); with valid resident copies the
out exchange is (P-1)/P^2 g |W|. For GPT-2 XL hetero at 8 ranks: 1.94 GB a step, 1.13 GB with
resident copies, against 2.26 GB with G in fp32 too (bench/sharded_bytes.py).
The parts travel as bytes (`exchange`), each padded to 4. `optimizer.exchange_counts` counts
what a step sent and received.

Parts are rectangles: rank r holds rows (or columns) torch.chunk-wise, ceil(n/P) each, the last
ranks fewer or none (FSDP2's split); a piece [lo, hi) x all columns meets it in a rectangle,
possibly empty. Every rank computes every size from the shapes and the resident flags alone
(the same on every rank), so the exchange needs no size handshake.

State kept for each sharded parameter from the moment its group is added (so that every rank has
the same keys before the first step, as torch.distributed.checkpoint's get_state_dict needs):
"step" (steps taken, a CPU tensor: the warm start is used once it is positive), "momentum_buffer"
and one "dual" / "dual@<lo>" per piece that keeps a warm start.
"""
import sys
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from manifolds import work
from manifolds.dual import STAT_FIELDS, STATS
from manifolds.geometry import geometry
from manifolds.work import piece_cost


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
    """Whether the solver leaves a dual warm start for this piece (dual.solve_tall): ADMM does;
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


@torch.no_grad()
def keep_radius(optimizer, param, lo, block):
    """Store ||block||_F (float64, on the device of param's local part) as the radius of the
    piece at row lo, the sphere it is put on (ManifoldMuon._project_onto_manifolds: when its
    group is added, or it is unfrozen; every rank, from the whole matrix)."""
    whole = lo == 0 and block.size(0) == param.size(0)
    key = "radius" if whole else f"radius@{lo}"
    optimizer.state[param][key] = block.detach().double().square().sum().sqrt().to(local(param).device)


def stored_radius(optimizer, param, lo=0):
    """The radius the optimizer keeps for the piece of `param` at row lo (a float64 0-dim tensor;
    NaN until known: a parameter without values when its group was added), or None: what
    geometry.manifold_violation(..., radius=) measures a Hyperball matrix against."""
    if param not in optimizer.state:
        return None
    state = optimizer.state[param]
    return state.get("radius" if lo == 0 and "radius" in state else f"radius@{lo}")


def radii(optimizer, pieces, W):
    """(n,) float64 on W's device: the stored radius of each of a bank's pieces (W: their
    stacked weights), for the retraction (geometry.Hyperball.retract_from). One not yet known
    (NaN) becomes ||W||_F now and is kept, on the device, without a sync; a replicated piece
    without the key (a state loaded from before radii were stored) gets one."""
    stored = []
    for piece in pieces:
        state = optimizer.state[piece.param]
        r = state.get(radius_key(piece))
        if r is None:
            r = torch.full((), float("nan"), dtype=torch.float64, device=W.device)
            if not is_sharded(piece.param):  # a sharded piece's keys are every rank's (init_state)
                state[radius_key(piece)] = r
        stored.append(r)
    r = torch.stack([x.to(device=W.device, dtype=torch.float64) for x in stored])
    r = torch.where(torch.isnan(r), W.double().square().sum(dim=(-2, -1)).sqrt(), r)
    torch._foreach_copy_(stored, list(r.unbind(0)))
    return r


def warm_shape(piece):
    q = min(piece.hi - piece.lo, piece.param.size(1))
    return q, q


def warm_placements(p, layout):
    """The dual's placements: the parameter's, split on rows (its q x q has no columns to follow)."""
    from torch.distributed.tensor import Shard
    return tuple(Shard(0) if mesh_dim == layout.mesh_dim else placement
                 for mesh_dim, placement in enumerate(p.placements))


def init_state(optimizer, group, pieces, replicated=False):
    """Create the state of a group's sharded parameters (module docstring), zero, without
    communication; with `replicated`, of its other parameters too (plain tensors, the same keys)."""
    for p in group["params"]:
        if not (replicated or is_sharded(p)):
            continue
        state = optimizer.state[p]
        state.setdefault("step", torch.tensor(0.0))
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
    for piece in pieces:
        if (replicated or is_sharded(piece.param)) and stores_radius(piece):
            # set when the matrix was put on its manifold (keep_radius); NaN: not yet known
            optimizer.state[piece.param].setdefault(radius_key(piece), torch.full(
                (), float("nan"), dtype=torch.float64, device=local(piece.param).device))
        if not (replicated or is_sharded(piece.param)) or not keeps_warm_start(piece, optimizer.options):
            continue  # (before touching optimizer.state, a defaultdict: no empty entries)
        state = optimizer.state[piece.param]
        if piece.dual_key in state:
            continue
        if is_sharded(piece.param):
            from torch.distributed.tensor import zeros as sharded_zeros
            layout = shard_layout(piece.param)
            state[piece.dual_key] = sharded_zeros(warm_shape(piece), dtype=torch.float32, device_mesh=layout.mesh,
                                                  placements=warm_placements(piece.param, layout))
        else:
            state[piece.dual_key] = torch.zeros(warm_shape(piece), dtype=torch.float32, device=piece.param.device)


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


def shard_digests(optimizer, pieces):
    """{piece.key: (2,) or (4,) int64}: the digest of this rank's local shard of the piece's
    parameter (one per parameter) and, where it keeps one, of its local rows of the warm start."""
    of_param, out = {}, {}
    for piece in pieces:
        if id(piece.param) not in of_param:
            of_param[id(piece.param)] = digest(local(piece.param))
        warm = optimizer.state[piece.param].get(piece.dual_key) if piece.param in optimizer.state else None
        parts = [of_param[id(piece.param)]] + ([digest(local(warm))] if torch.is_tensor(warm) else [])
        out[piece.key] = torch.cat(parts)
    return out


def resident_flags(optimizer, layout, pieces, owners):
    """{piece.key: whether its owner's resident copy of W and the warm start (from the last step)
    is what the shards hold now}, the same on every rank of the shard group. A copy is valid where
    the owner is the same as when it was kept and, on every rank, the digest of the local shard and
    warm start equals the one taken after that step wrote them (record_resident): one small
    all-reduce of the stale flags over the group, and one host sync to read them (the exchange's
    sizes depend on them). Without resident copies (SolverOptions.resident off, the default):
    none, no collective."""
    if not optimizer.options.resident:
        return {piece.key: False for piece in pieces}
    record = optimizer.resident_record
    device = local(pieces[0].param).device
    current = shard_digests(optimizer, pieces)
    stale = []
    for piece in pieces:  # one flag per piece, in bank order: the same length on every rank
        kept = record.get(piece.key)
        if kept is None or kept[0] != owners[piece.key] or kept[1].shape != current[piece.key].shape:
            stale.append(torch.ones((), dtype=torch.int32, device=device))
        else:
            stale.append((kept[1] != current[piece.key]).any().to(torch.int32))
    stale = torch.stack(stale)
    dist.all_reduce(stale, op=dist.ReduceOp.MAX, group=layout.group)
    flags = {piece.key: not bad for piece, bad in zip(pieces, stale.tolist())}
    me = layout.rank
    for piece in pieces:
        if flags[piece.key] and owners[piece.key] == me and piece.key not in optimizer.resident_cache:
            raise RuntimeError(f"internal: resident piece {piece.key} missing from its owner's cache")
    return flags


def shard_rank(piece):
    """This process's rank in the shard group of the piece's parameter."""
    return shard_layout(piece.param).rank


def record_resident(optimizer, pieces, owners):
    """After a shard group's step wrote the shards: every piece's owner and the digest of this
    rank's shard and warm start (checked by resident_flags next step); the owner's cache keeps
    only what it owns."""
    if not optimizer.options.resident:
        return
    digests = shard_digests(optimizer, pieces)
    for piece in pieces:
        optimizer.resident_record[piece.key] = (owners[piece.key], digests[piece.key])
        if owners[piece.key] != shard_rank(piece):
            optimizer.resident_cache.pop(piece.key, None)


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


class ShardedStep:
    """One step of the sharded pieces of one shard group (module docstring)."""

    def __init__(self, optimizer, layout, banks, owners, resident):
        """banks: [(name, pieces)] of one bucket of this group's pieces with gradients, in bank
        order (the same on every rank); owners: {piece.key: rank} of the group's pieces; resident:
        {piece.key: whether its owner's resident copy is valid} (resident_flags)."""
        self.opt, self.layout, self.banks = optimizer, layout, banks
        every = [piece for _, pieces in banks for piece in pieces]
        self.owner = {piece.key: owners[piece.key] for piece in every}
        self.by_owner = [[piece for piece in every if self.owner[piece.key] == rank] for rank in range(layout.size)]
        self.keeps = {piece.key: keeps_warm_start(piece, optimizer.options) for piece in every}
        # the warm start travels once the parameter has stepped (until then it is zero)
        self.warm = {piece.key: self.keeps[piece.key] and bool(optimizer.state[piece.param]["step"] > 0)
                     for piece in every}
        self.resident = {piece.key: resident[piece.key] for piece in every}
        self.grad_dtype = optimizer.plan.grad_wire_dtype

    def pieces_of(self, rank):
        """The pieces `rank` owns, in bank order."""
        return self.by_owner[rank]

    # what one rank sends to another, in order, both ways (sizes from the shapes alone)

    def out_parts(self, piece, sender):
        """What `sender` sends the owner of `piece`: its part of G and, unless the owner holds them
        from the last step (`resident`), of W and, once warm, of Lambda."""
        if self.resident[piece.key]:
            return piece_parts(piece, self.layout, sender, (("G", self.grad_dtype),), False)
        return piece_parts(piece, self.layout, sender, (("W", torch.float32), ("G", self.grad_dtype)),
                           self.warm[piece.key])

    def back_parts(self, piece, receiver):
        """What the owner of `piece` sends `receiver`: its part of the new W and, if kept, Lambda
        (so that the shards, and so the checkpoints, always hold the current values)."""
        return piece_parts(piece, self.layout, receiver, (("W", torch.float32),), self.keeps[piece.key])

    def send_out(self, momenta):
        """2. out: my part of each piece (momenta: {id(param): local G}), to its owner, in the
        owner's order; returns the exchange in flight (an InFlight for finish)."""
        opt, layout, me = self.opt, self.layout, self.layout.rank
        device = local(self.banks[0][1][0].param).device
        sends = []
        for dest in range(layout.size):
            for piece in self.pieces_of(dest):
                _, _, rows, cols = piece_box(piece, layout, me)
                if not self.resident[piece.key]:
                    sends.append(local(piece.param)[rows, cols].float())
                sends.append(momenta[id(piece.param)][rows, cols].to(self.grad_dtype))
                if self.warm[piece.key] and not self.resident[piece.key]:
                    sends.append(local(opt.state[piece.param][piece.dual_key]))
        in_sizes = [sum(wire_bytes(n, dt) for piece in self.pieces_of(dest) for _, n, dt in self.out_parts(piece, me))
                    for dest in range(layout.size)]
        out_sizes = [sum(wire_bytes(n, dt) for piece in self.pieces_of(me) for _, n, dt in self.out_parts(piece, src))
                     for src in range(layout.size)]
        count_exchange(opt, in_sizes, out_sizes, me, solved=len(self.pieces_of(me)))
        return exchange(sends, in_sizes, out_sizes, layout.group, device, async_op=True)

    def finish(self, inflight):
        """3.-4. once the out exchange (send_out's InFlight) has arrived; returns the most bytes of
        the exchange's buffers this bucket held at once: what it received and the pieces assembled
        from it, then (the received bytes freed) the pieces and what it sends and receives back;
        bench/memory.py's exchange_held estimates the same from the shapes."""
        opt, layout, me = self.opt, self.layout, self.layout.rank
        received = inflight.wait()
        inflight.send = inflight.received = None  # freed with the last reference below
        device = received.device
        # 3. assemble my pieces and solve them, bank by bank, as one process does
        whole = {}
        for piece in self.pieces_of(me):
            rows, cols = piece.hi - piece.lo, piece.param.size(1)
            G = torch.empty(rows, cols, dtype=torch.float32, device=device)
            if self.resident[piece.key]:
                whole[piece.key] = [opt.resident_cache[piece.key][0], G, opt.resident_cache[piece.key][1]]
                continue
            whole[piece.key] = [torch.empty(rows, cols, dtype=torch.float32, device=device), G,
                                torch.empty(warm_shape(piece), dtype=torch.float32, device=device)
                                if self.warm[piece.key] else None]
        offset, chunk = 0, None
        for src in range(layout.size):
            for piece in self.pieces_of(me):
                piece_rows, piece_cols, _, _ = piece_box(piece, layout, src)
                W, G, dual = whole[piece.key]
                for name, n, dtype in self.out_parts(piece, src):
                    chunk = received[offset:offset + n * dtype.itemsize].view(dtype)
                    offset += wire_bytes(n, dtype)
                    if name == "dual":
                        dual[dual_rows(piece, layout, src)] = chunk.view(-1, dual.size(1))
                    else:
                        target = (W if name == "W" else G)[piece_rows, piece_cols]
                        target.copy_(chunk.view(target.shape))
        assembled = sum(t.numel() * t.element_size() for piece in self.pieces_of(me)
                        for t, kept in zip(whole[piece.key], (True, False, True))
                        if t is not None and not (kept and self.resident[piece.key]))
        held = received.numel() + assembled
        del received, chunk  # copied into the pieces: not held while they solve
        mine = [(name, [piece for piece in pieces if self.owner[piece.key] == me]) for name, pieces in self.banks]
        mine = [(name, pieces) for name, pieces in mine if pieces]
        new_duals = {}

        def keep(pieces, states):
            for i, piece in enumerate(pieces):
                new_duals[piece.key] = None if states is None else states[i]
                if (states is None) == self.keeps[piece.key]:
                    raise RuntimeError(f"internal: the solver's warm start for a {piece.manifold} piece does not "
                                       f"match keeps_warm_start")

        inputs = lambda piece: whole[piece.key]  # noqa: E731
        computed = opt._step_banks(mine, inputs, keep) if mine else []
        new_W = {piece.key: w for pieces, ws in computed for piece, w in zip(pieces, ws)}
        if opt.options.resident:  # kept for the next step (resident_flags)
            for piece in self.pieces_of(me):
                # rounded as the shards store them (a bf16 parameter holds bf16(new W)), so that
                # the next step solves from what it would receive without the copy
                W, dual = new_W[piece.key], new_duals.get(piece.key)
                W = W.to(piece.param.dtype).to(torch.float32)
                if dual is not None:
                    dual = dual.to(opt.state[piece.param][piece.dual_key].dtype).to(torch.float32)
                opt.resident_cache[piece.key] = (W, dual)
        # 4. back: each rank its part of every new W and Lambda I computed
        sends = []
        for dest in range(layout.size):
            for piece in self.pieces_of(me):
                piece_rows, piece_cols, _, _ = piece_box(piece, layout, dest)
                sends.append(new_W[piece.key][piece_rows, piece_cols].float())
                if self.keeps[piece.key]:
                    sends.append(new_duals[piece.key][dual_rows(piece, layout, dest)])
        in_sizes = [sum(wire_bytes(n, dt) for piece in self.pieces_of(me) for _, n, dt in self.back_parts(piece, dest))
                    for dest in range(layout.size)]
        out_sizes = [sum(wire_bytes(n, dt) for piece in self.pieces_of(src) for _, n, dt in self.back_parts(piece, me))
                     for src in range(layout.size)]
        back = exchange(sends, in_sizes, out_sizes, layout.group, device)
        count_exchange(opt, in_sizes, out_sizes, me)
        held = max(held, assembled + sum(in_sizes) + sum(out_sizes))
        targets, sources, offset = [], [], 0
        for src in range(layout.size):
            for piece in self.pieces_of(src):
                _, _, rows, cols = piece_box(piece, layout, me)
                for name, n, dtype in self.back_parts(piece, me):
                    target = (local(piece.param)[rows, cols] if name == "W"
                              else local(opt.state[piece.param][piece.dual_key]))
                    targets.append(target)
                    sources.append(back[offset:offset + n * dtype.itemsize].view(dtype).view(target.shape))
                    offset += wire_bytes(n, dtype)
        if targets:
            torch._foreach_copy_(targets, sources)
        return held


# The exchange goes in buckets of pieces, each at most this many elements of W per rank of the group
# (or one piece): what an owner holds at once (W, G and Lambda received, the same assembled, the new
# W and Lambda sent back: about 3 (2 |W| + |Lambda|) fp32) is bounded by a bucket, not by all of its
# matrices. 2^24 elements (64 MiB of fp32 W) per rank (bench/memory.py counts what it holds;
# tests/test_sharded_plan.py pins the buckets of the GPT-2 presets)
EXCHANGE_BUCKET = 1 << 24


def piece_numel(piece):
    return (piece.hi - piece.lo) * piece.param.size(1)


def buckets(banks, ranks):
    """The banks [(name, pieces)] cut into buckets, each a list of (name, pieces), such that each
    bucket's owners can be balanced exactly (bucket_owners): a bank's pieces (one shape) go in
    runs of k x ranks, k the pieces one rank may hold within EXCHANGE_BUCKET elements (at least
    one: a larger piece gets a bucket row of its own), the last run the largest multiple of
    `ranks` left, then the pieces left over (fewer than `ranks` per bank); runs and pieces fill
    buckets in that order up to `ranks` x EXCHANGE_BUCKET elements (or `ranks` largest pieces).
    Buckets cut by element count alone split banks anywhere, and their owners waited on the most
    loaded one (GPT-2 XL hetero at 8 ranks: 17 QKV pieces landing 3 vs 2 per rank); a bucket of
    whole runs gives every rank the same pieces of each bank."""
    units = []  # runs of one bank (k x ranks pieces), then the pieces left over, in bank order
    rest = []
    for name, pieces in banks:
        per_rank = max(1, EXCHANGE_BUCKET // max(1, piece_numel(pieces[0])))
        start = 0
        while len(pieces) - start >= ranks:
            size = min(per_rank, (len(pieces) - start) // ranks) * ranks
            units.append((name, pieces[start:start + size]))
            start += size
        rest.extend((name, [piece]) for piece in pieces[start:])
    limit = ranks * max([EXCHANGE_BUCKET] + [piece_numel(piece) for _, pieces in banks for piece in pieces])
    out, current, size = [], OrderedDict(), 0
    for name, unit in units + rest:
        numel = sum(piece_numel(piece) for piece in unit)
        if size and size + numel > limit:
            out.append(list(current.items()))
            current, size = OrderedDict(), 0
        current.setdefault(name, []).extend(unit)
        size += numel
    if current:
        out.append(list(current.items()))
    return out


def bucket_owners(bucketed, plan, ranks):
    """{piece.key: rank}: each bucket's pieces balanced over the ranks by their cost
    (work.balanced_owners, longest first), bucket by bucket, so that no bucket waits on one
    owner while others idle."""
    owners = {}
    for bucket in bucketed:
        owners.update(balanced([piece for _, pieces in bucket for piece in pieces], plan, ranks))
    return owners


def bucket_loads(bucketed, owners, plan, ranks):
    """[[work.piece_cost owned by each rank] for each bucket]."""
    loads = []
    for bucket in bucketed:
        loads.append([0] * ranks)
        for _, pieces in bucket:
            for piece in pieces:
                loads[-1][owners[piece.key]] += piece_cost(piece, plan)
    return loads


def bucket_balance(bucketed, owners, plan, ranks):
    """The worst bucket's most loaded owner over its mean load (1 = every bucket balanced exactly),
    by work.piece_cost."""
    return max([1.0] + [max(load) * ranks / sum(load) for load in bucket_loads(bucketed, owners, plan, ranks)
                        if sum(load)])


def sharded_banks(optimizer, keep=lambda piece: True):
    """{ShardLayout: [(bank name, pieces)]} of the optimizer's sharded pieces that `keep`, each bank
    split by layout, in bank order (the same on every rank)."""
    groups = OrderedDict()
    for _, pieces in optimizer.banks():
        by_layout = OrderedDict()
        for piece in pieces:
            if is_sharded(piece.param) and keep(piece):
                by_layout.setdefault(shard_layout(piece.param), []).append(piece)
        for layout, subset in by_layout.items():
            groups.setdefault(layout, []).append((optimizer.bank_name(subset), subset))
    return groups


def steady_received_bytes(optimizer):
    """Bytes this rank receives from the others in a steady sharded step (every matrix with a
    gradient, the owners holding valid resident copies where SolverOptions.resident is on): the G
    parts (and, without resident copies, the W and warm start parts) of the pieces it owns, and
    its parts of the new W and warm starts of the pieces others own. From the shapes and the plan."""
    resident = optimizer.options.resident
    total = 0
    out = (("G", optimizer.plan.grad_wire_dtype),) if resident else \
        (("W", torch.float32), ("G", optimizer.plan.grad_wire_dtype))
    for layout, banks in sharded_banks(optimizer).items():
        owners, _ = shard_plan(optimizer, layout, banks)
        me = layout.rank
        for _, pieces in banks:
            for piece in pieces:
                if owners[piece.key] == me:  # out: ShardedStep.out_parts of a warm piece
                    warm = not resident and keeps_warm_start(piece, optimizer.options)
                    parts = [part for s in range(layout.size) if s != me
                             for part in piece_parts(piece, layout, s, out, warm)]
                else:  # back: ShardedStep.back_parts
                    parts = piece_parts(piece, layout, me, (("W", torch.float32),),
                                        keeps_warm_start(piece, optimizer.options))
                total += sum(wire_bytes(n, dtype) for _, n, dtype in parts)
    return total


def shard_plan(optimizer, layout, banks):
    """(owners {piece.key: rank}, buckets) of one shard group's step: the banks with gradients
    cut into buckets, each balanced over the group's ranks. Every rank must derive the same
    (plan_check compares them)."""
    bucketed = buckets(banks, layout.size)
    return bucket_owners(bucketed, optimizer.plan, layout.size), bucketed


def step_shard_group(optimizer, layout, banks, owners, bucketed, momenta):
    """The step of one shard group's pieces with gradients (banks [(name, pieces)], the same on
    every rank) under its plan (shard_plan: owners, bucketed = the banks cut into buckets)."""
    stats = {}
    # the resident flags read before any writes (a parameter whose pieces lie in two buckets is
    # written by the first)
    resident = resident_flags(optimizer, layout, [piece for _, pieces in banks for piece in pieces], owners)
    steps = [ShardedStep(optimizer, layout, bucket, owners, resident) for bucket in bucketed]
    pending = steps[0].send_out(momenta) if steps else None
    for index, (step, bucket) in enumerate(zip(steps, bucketed)):
        current = pending
        following = steps[index + 1] if index + 1 < len(steps) else None
        overlap = following is not None and optimizer.options.overlap
        if overlap:
            # the next bucket's out exchange in flight while this one solves (its parts are
            # other pieces' rows, which this bucket does not write)
            current.wait()
            pending = following.send_out(momenta)
        held = step.finish(current) + (pending.bytes if overlap else 0)
        del current
        optimizer.exchange_counts["held"] = max(optimizer.exchange_counts.get("held", 0), held)
        if following is not None and not overlap:
            pending = following.send_out(momenta)
        for name, _ in bucket:  # a bank cut by buckets: the largest iterations and residual, all fallbacks
            new = optimizer.last_stats.pop(name, None)
            if new is not None:
                stats[name] = new if name not in stats else merge_stats(stats[name], new)
    optimizer.last_stats.update(stats)
    for param in OrderedDict((id(piece.param), piece.param) for _, pieces in banks for piece in pieces).values():
        optimizer.state[param]["step"] += 1
    record_resident(optimizer, [piece for _, pieces in banks for piece in pieces], owners)
    gather_stats(optimizer, layout, [name for name, _ in banks], local(banks[0][1][0].param).device)


def merge_stats(a, b):
    return {"iterations": torch.maximum(torch.as_tensor(a["iterations"]), torch.as_tensor(b["iterations"])),
            "residual": torch.maximum(torch.as_tensor(a["residual"]), torch.as_tensor(b["residual"])),
            "fallbacks": torch.as_tensor(a["fallbacks"]) + torch.as_tensor(b["fallbacks"])}


def gather_stats(optimizer, layout, names, device):
    """Every bank's statistics from the ranks that solved a share of it: one small all-gather."""
    mine = torch.full((len(names), STATS), -float("inf"), dtype=torch.float32, device=device)
    for i, name in enumerate(names):
        if name in optimizer.last_stats:
            for j, field in enumerate(STAT_FIELDS):
                mine[i, j] = optimizer.last_stats[name][field]
    shares = all_gather_rows(mine, layout.size, layout.group)
    largest, fallbacks = shares[..., :2].amax(dim=0), shares[..., 2].clamp_min(0).sum(dim=0)
    for i, name in enumerate(names):
        optimizer.last_stats[name] = {"iterations": largest[i, 0], "residual": largest[i, 1],
                                      "fallbacks": fallbacks[i]}


def balanced(pieces, plan, world_size):
    owners = work.balanced_owners([piece_cost(piece, plan) for piece in pieces], world_size)
    return {piece.key: rank for piece, rank in zip(pieces, owners)}


def all_gather_rows(tensor, size, group=None, async_op=False):
    """Every rank's `tensor` (the same shape on each) stacked: (size, *tensor.shape), through one
    flat all-gather (gloo takes no stacked output); with async_op, (rows, work handle)."""
    flat = torch.empty(size * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    handle = gather(flat, tensor.reshape(-1), group=group, async_op=async_op)
    rows = flat.view((size,) + tuple(tensor.shape))
    return (rows, handle) if async_op else rows


def count_exchange(optimizer, in_sizes, out_sizes, me, solved=0):
    """Add one all_to_all_single to optimizer.exchange_counts (this step's): bytes sent to and
    received from the other ranks, collectives, pieces solved here (and, from step_shard_group,
    "held": the most bytes of exchange buffers held at once)."""
    counts = optimizer.exchange_counts
    counts["sent"] += sum(n for rank, n in enumerate(in_sizes) if rank != me)
    counts["received"] += sum(n for rank, n in enumerate(out_sizes) if rank != me)
    counts["collectives"] += 1
    counts["solved"] += solved


class InFlight:
    """An exchange posted with async_op: wait() gives the bytes received."""

    def __init__(self, send, received, work):
        self.send, self.received, self.work = send, received, work

    @property
    def bytes(self):
        """Of its buffers (sent and received), held until it completes."""
        return self.send.numel() + self.received.numel()

    def wait(self):
        self.work.wait()
        return self.received


def exchange(sends, in_sizes, out_sizes, group, device, async_op=False):
    """One all_to_all_single of the parts in `sends` (tensors of any dtype, in_sizes[r] bytes of
    them for rank r, each padded as wire_bytes pads it), as bytes; returns what arrived
    (out_sizes[r] bytes from rank r, in rank order), or with async_op an InFlight of it."""
    flat = []
    for part in sends:
        raw = part.contiguous().reshape(-1).view(torch.uint8)
        flat.append(raw)
        pad = wire_bytes(part.numel(), part.dtype) - raw.numel()
        if pad:
            flat.append(torch.zeros(pad, dtype=torch.uint8, device=device))
    send = torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8, device=device)
    received = torch.empty(sum(out_sizes), dtype=torch.uint8, device=device)
    work = dist.all_to_all_single(received, send, out_sizes, in_sizes, group=group, async_op=async_op)
    return InFlight(send, received, work) if async_op else received
