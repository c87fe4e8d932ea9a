"""The optimizer's exchange: who solves which piece, in which bucket, the collectives that bring
each owner its pieces and every rank the new values, the owners' resident copies and the solver's
statistics. One loop (`Exchange.step`) for three layouts:

  local       one process: every piece solved here, all banks in one call;
  replicated  DDP (parameters whole on every rank): each bucket's pieces balanced over the N ranks;
              each owner solves its share from what it holds, and one all-gather per bank of the
              bucket, posted as soon as the solve has finished that bank, brings every rank every
              new W, each followed by its new warm start (fp32, padded to the largest rank's
              share), so that every rank holds the whole state;
  sharded     FSDP2 / HSDP DTensors (manifolds/sharded.py has their geometry): each bucket's pieces
              balanced over ALL R x S ranks of the mesh (R replica groups of S shards; R = 1 under
              FSDP2), owner (r, s);
                out:  in each replica's shard group, one all_to_all_single brings each owner every
                      shard's part of G (and of W and the warm start, unless resident) of the
                      pieces it owns, and carries only the pieces this replica owns;
                back: (a) in the shard group, one all_to_all_single returns each shard its part of
                      every new W and warm start of those pieces, written in place into the
                      shards (so checkpoints always hold current values); (b) under HSDP, one
                      all-gather across the replica group (the R ranks of one shard index) copies
                      those new parts into every replica.
              Every matrix is solved once per job and the replicas are equal by construction: they
              copy the same bytes (training/fsdp.check_replicas still compares them).

Sharded buckets (`buckets`, EXCHANGE_BUCKET elements of W per owner) bound what an owner holds
whole at once; DDP's (`replicated_buckets`: whole banks) bound nothing, every rank holding every
weight, and are cut only at bank boundaries, few, so that the solver keeps its batching. Buckets
are the unit of overlap: every collective is posted async (a handle whose `.wait()` is
called where its result is needed); with ExchangeOptions.overlap (the default) the next bucket's
out exchange and the previous bucket's return are in flight while one bucket solves (a return is
waited and written after the next bucket has solved and posted its own). A bucket's pieces are
other rows than every other bucket's and each send is packed into a buffer of its own when
posted, so the order changes no bit (tests/test_exchange.py, overlap on and off, every bank cut).

Sizes come from the shapes (and, with resident copies, the agreed flags): every rank computes
every size, so there is no size handshake. The statistics of every bank (largest iterations and
residual, summed fallbacks) are packed once and reduced once a step: in the tail of the last
replicated all-gather, or else one small all-gather over every rank.

The optimizer hands the exchange what it needs (`StepInputs`): a solve function, the momenta G,
the warm starts' tensors, a way to store replicated warm starts, whether a parameter has stepped.
The exchange never reads the optimizer's state itself.
"""
from collections import OrderedDict
from dataclasses import dataclass, fields
from typing import Callable

import torch
import torch.distributed as dist

from manifolds import step_cost
from manifolds.solver import STAT_FIELDS, STATS
from manifolds.sharded import (digest, dual_rows, is_sharded, keeps_warm_start, local, piece_box,
                               piece_parts, shard_layout, warm_shape, wire_bytes)
from manifolds.step_cost import piece_cost

# The sharded exchange goes in buckets of pieces, each at most this many elements of W per owner
# (or one piece): what an owner holds at once (W, G and Lambda received, the same assembled, the
# new W and Lambda sent back: about 3 (2 |W| + |Lambda|) fp32) is bounded by a bucket, not by all
# of its matrices. Each bucket is one solver call, which repeats the solver's per-bank launches, so
# the size trades memory for launches (docs/distributed.md): 2^25 elements (128 MiB of fp32 W) per
# rank; GPT-2 XL --fsdp at 8 ranks (python -m bench.cost_model --fake --fsdp --model gpt2-xl
# --world-size 8 --exchange-bucket N; python -m bench.memory): 2^24 16 buckets, R 0.339, 3341 MiB
# per rank (899 in flight); 2^25 6 buckets, R 0.293, 3936 MiB (1494); 2^26 3 buckets, R 0.282,
# 5196 MiB (2754). tests/test_sharded_plan.py pins the buckets of the GPT-2 presets.
EXCHANGE_BUCKET = 1 << 25


# --- settings ------------------------------------------------------------------------------------

WIRE_DTYPES = ("auto", "fp32", "bf16")


@dataclass(frozen=True)
class ExchangeOptions:
    """The exchange's settings (the trainer's --exchange-opt KEY=VALUE; ManifoldMuon takes them as
    keyword arguments beside the solver's). None changes a result bit except exchange_grad=bf16
    (G rounded on the sharded wire); docs/distributed.md has the measured choices."""
    overlap: bool = True         # the next bucket's out exchange and the last bucket's return in flight
                                 # while a bucket solves (off: the serial order; bitwise the same)
    exchange_grad: str = "auto"  # G's dtype on the sharded wire: fp32, bf16, auto (bf16 on CUDA: its
                                 # 2^-9 rounding is below what the bf16 signs of a GPU's step round)
    resident: bool = False       # owners keep each sharded piece's W and Lambda between steps, so that
                                 # only G travels to them, checked by digests (one all-reduce and one
                                 # host sync a step; off, the default: W and Lambda travel every step)

    def __post_init__(self):
        if self.exchange_grad not in WIRE_DTYPES:
            raise ValueError(f"unknown exchange_grad {self.exchange_grad!r}; valid: {', '.join(WIRE_DTYPES)}")

    @classmethod
    def keys(cls):
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_kwargs(cls, **kwargs):
        from manifolds.plan import parse_option
        unknown = sorted(set(kwargs) - set(cls.keys()))
        if unknown:
            raise TypeError(f"unknown exchange options {unknown}; valid: {list(cls.keys())}")
        return cls(**{key: parse_option(key, value, cls) for key, value in kwargs.items()})

    def grad_dtype(self, device):
        """G's dtype on the sharded wire for parameters on `device` (a torch.device or its type)."""
        cuda = torch.device(device).type == "cuda"
        bf16 = self.exchange_grad == "bf16" or (self.exchange_grad == "auto" and cuda)
        return torch.bfloat16 if bf16 else torch.float32


def parse_exchange_opts(items):
    """--exchange-opt KEY=VALUE, ... -> {key: value} (the trainer's flag, parsed as --solver-opt is);
    a ValueError names the bad item and the valid keys."""
    from manifolds.plan import SOLVER_VALUE_TEXT, parse_solver_value, show_value, solver_value_kind
    defaults = {f.name: f.default for f in fields(ExchangeOptions)}
    valid = ", ".join(defaults)
    options = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or key not in defaults:
            raise ValueError(f"--exchange-opt {item}: unknown key {key!r}; KEY=VALUE with KEY one of {valid}")
        kind = solver_value_kind(key, defaults[key], ExchangeOptions)
        value = parse_solver_value(kind, text)
        if value is None:
            raise ValueError(f"--exchange-opt {item}: {key} takes {SOLVER_VALUE_TEXT[kind]}, got {text!r} "
                             f"(default {show_value(defaults[key])}; keys: {valid})")
        options[key] = value
    try:
        ExchangeOptions(**options)
    except ValueError as err:
        raise ValueError(f"--exchange-opt: {err}") from None
    return options


# --- buckets and owners --------------------------------------------------------------------------

def piece_numel(piece):
    return (piece.hi - piece.lo) * piece.param.size(1)


def buckets(banks, ranks):
    """The banks [(name, pieces)] cut into buckets, each a list of (name, pieces), such that each
    bucket's owners can be balanced exactly (bucket_owners): a bank's pieces (one shape) go in
    runs of k x ranks, k the pieces one rank may hold within EXCHANGE_BUCKET elements (at least
    one: a larger piece gets a bucket row of its own), the last run the largest multiple of
    `ranks` left, then the pieces left over (fewer than `ranks` per bank). Where every piece
    fits in half a bucket (`ranks` x EXCHANGE_BUCKET / 2 elements, or `ranks` largest pieces)
    they are one bucket: a second would not pay for its solver call (GPT-2 small --fsdp at 8
    ranks: 0.250 of forward+backward in one, 0.321 cut). Otherwise the pieces left over fill
    buckets of their own first, then the runs (each filling buckets up to the whole limit), so
    that the pieces of several shapes left over are balanced together, not beside a run that
    gives each rank one piece already: HSDP 8 x 8 GPT-2 XL, where 48 QKV, 48 attention
    projections and 32 of the 96 MLP pieces are left over for 64 owners, cut this way is two
    buckets whose owners' sum of most loaded loads is that of one bucket (1.065 of the mean;
    cut as runs then pieces in one sequence: worst bucket 1.416), and the first bucket's
    exchange overlaps the second's solve (python -m bench.cost_model --fake --fsdp
    --fsdp-shard-ranks 8 --model gpt2-xl --world-size 64: 0.462 -> 0.429; the pieces left over
    last: 0.438). Buckets cut by element count alone split banks anywhere, and their owners
    waited on the most loaded one (GPT-2 XL hetero at 8 ranks: 17 QKV pieces landing 3 vs 2 per
    rank); a bucket of whole runs gives every rank the same pieces of each bank."""
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

    def fill(items):
        out, current, size = [], OrderedDict(), 0
        for name, unit in items:
            numel = sum(piece_numel(piece) for piece in unit)
            if size and size + numel > limit:
                out.append(list(current.items()))
                current, size = OrderedDict(), 0
            current.setdefault(name, []).extend(unit)
            size += numel
        if current:
            out.append(list(current.items()))
        return out

    if 2 * sum(piece_numel(piece) for _, pieces in banks for piece in pieces) <= limit:
        return fill(units + rest)
    return fill(rest) + fill(units)


def replicated_buckets(banks, ranks):
    """DDP's buckets: whole banks, in bank order, a bucket closed as soon as its pieces are a
    multiple of `ranks` (so that its owners can be balanced exactly), the last one the banks left;
    then the largest bucket (elements of W) first, the smallest last.

    Every rank holds every weight under DDP, so its buckets bound no memory: they exist only so
    that a bucket's all-gather overlaps the next bucket's solve. Each bucket is one solver call,
    and the solver's launches are per bank and per call (a bank cut over 16 buckets repeats
    them 16 times: GPT-2 XL at 8 ranks, 3,787 launches where one call takes 820), so a bank is
    never cut; the last bucket's gathers (one per bank) are the ones left exposed, hence the smallest last.
    GPT-2 small hetero at 8 ranks: [dgram 3072x768 x 24], [stiefel 2304x768 x 12 + 768x768 x 12];
    GPT-2 XL: one bucket per bank (48, 48 and 96 pieces)."""
    out, current = [], []
    for name, pieces in banks:
        current.append((name, pieces))
        if sum(len(p) for _, p in current) % ranks == 0:
            out.append(current)
            current = []
    if current:
        out.append(current)
    size = lambda bucket: sum(piece_numel(piece) for _, pieces in bucket for piece in pieces)  # noqa: E731
    return sorted(out, key=lambda bucket: -size(bucket))  # stable: ties stay in bank order


def balanced(pieces, plan, ranks):
    owners = step_cost.balanced_owners([piece_cost(piece, plan) for piece in pieces], ranks)
    return {piece.key: rank for piece, rank in zip(pieces, owners)}


def bucket_owners(bucketed, plan, ranks):
    """{piece.key: rank}: each bucket's pieces balanced over the ranks by their cost
    (step_cost.balanced_owners, longest first), bucket by bucket, so that no bucket waits on one
    owner while others idle. By multiply-adds alone, although an owner also pays its solver's
    launches once per bank it touches (python -m bench.cost_model --bank-launches): that fixed
    cost in the balance changed none of issue 59's figures (docs/distributed.md, "Owners")."""
    owners = {}
    for bucket in bucketed:
        owners.update(balanced([piece for _, pieces in bucket for piece in pieces], plan, ranks))
    return owners


def bucket_loads(bucketed, owners, plan, ranks):
    """[[step_cost.piece_cost owned by each rank] for each bucket]."""
    loads = []
    for bucket in bucketed:
        loads.append([0] * ranks)
        for _, pieces in bucket:
            for piece in pieces:
                loads[-1][owners[piece.key]] += piece_cost(piece, plan)
    return loads


def bucket_balance(bucketed, owners, plan, ranks):
    """The worst bucket's most loaded owner over its mean load (1 = every bucket balanced exactly),
    by step_cost.piece_cost."""
    return max([1.0] + [max(load) * ranks / sum(load) for load in bucket_loads(bucketed, owners, plan, ranks)
                        if sum(load)])


@dataclass(frozen=True)
class Replicated:
    """The layout of whole parameters: `size` ranks (the default group), this one `rank`."""
    size: int
    rank: int


def replicas(layout):
    """(R, this rank's replica index, the replica group or None) of a ShardLayout: HSDP's other
    mesh dimension on a 2-D mesh; R = 1 on a 1-D mesh (and on a larger one, whose replica groups
    each solve every piece, as before)."""
    if layout.mesh.ndim != 2:
        return 1, 0, None
    dim = 1 - layout.mesh_dim
    size = layout.mesh.size(dim)
    if size == 1:
        return 1, 0, None
    return size, layout.mesh.get_local_rank(dim), layout.mesh.get_group(dim)


@dataclass
class Group:
    """The pieces of one layout stepped together: banks [(name, pieces)], cut into `buckets`, each
    balanced over `slots` owners (`owners` {piece.key: slot}); `me` is this rank's slot. Sharded:
    slot = r S + s for replica r, shard s."""
    layout: object  # Replicated or sharded.ShardLayout
    banks: list
    buckets: list
    owners: dict
    slots: int
    me: int

    @property
    def sharded(self):
        return not isinstance(self.layout, Replicated)


def bucket_group(layout, banks, plan):
    """The Group of these banks under `layout`: every rank derives the same (step_agreement compares)."""
    if isinstance(layout, Replicated):
        slots, me = layout.size, layout.rank
    else:
        R, r, _ = replicas(layout)
        slots, me = R * layout.size, r * layout.size + layout.rank
    if not isinstance(layout, Replicated):
        bucketed = buckets(banks, slots)
    elif slots == 1:  # one process solves every bank in one call (the solver batches banks of one column count)
        bucketed = [banks]
    else:
        bucketed = replicated_buckets(banks, slots)
    owners = bucket_owners(bucketed, plan, slots)
    return Group(layout, banks, bucketed, owners, slots, me)


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


# --- what the optimizer hands the exchange -------------------------------------------------------

@dataclass
class StepInputs:
    """What one step's exchange needs from the optimizer (it reads nothing else of it).
    solve(banks, matrices) -> [(pieces, [new W of each, its orientation], new warm starts stacked
    or None, stats)] for banks [(name, pieces)], matrices(piece) -> (W, G, warm start or None);
    replicated(piece) -> (W, G, warm start or None) of a whole parameter's piece on this rank;
    momenta {id(param): G} (local for sharded ones); warm(piece) -> the tensor holding this rank's
    rows of a sharded piece's warm start; store_warm(pieces, states or None) keeps replicated
    pieces' warm starts (in place where there is one); started(piece): its parameter has stepped
    (its warm start travels)."""
    solve: Callable
    replicated: Callable
    momenta: dict
    warm: Callable
    store_warm: Callable
    started: Callable


# --- collectives ---------------------------------------------------------------------------------

def all_gather_rows(tensor, size, group=None, async_op=False):
    """Every rank's `tensor` (the same shape on each) stacked: (size, *tensor.shape), through one
    flat all-gather (gloo takes no stacked output); with async_op, (rows, work handle)."""
    flat = torch.empty(size * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    handle = gather(flat, tensor.reshape(-1), group=group, async_op=async_op)
    rows = flat.view((size,) + tuple(tensor.shape))
    return (rows, handle) if async_op else rows


def all_to_all(sends, in_sizes, out_sizes, group, device):
    """One all_to_all_single of the parts in `sends` (tensors of any dtype, in_sizes[r] bytes of
    them for rank r, each padded as wire_bytes pads it), posted async; returns (bytes that will
    arrive, out_sizes[r] from rank r in rank order; the send buffer; the handle)."""
    flat = []
    for part in sends:
        raw = part.contiguous().reshape(-1).view(torch.uint8)
        flat.append(raw)
        pad = wire_bytes(part.numel(), part.dtype) - raw.numel()
        if pad:
            flat.append(torch.zeros(pad, dtype=torch.uint8, device=device))
    send = torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8, device=device)
    received = torch.empty(sum(out_sizes), dtype=torch.uint8, device=device)
    handle = dist.all_to_all_single(received, send, out_sizes, in_sizes, group=group, async_op=True)
    return received, send, handle


class Stage:
    """A collective in flight: finish() waits for it, then runs `done` (which writes what arrived
    and may post the next collective of the same return: its Stage, or None)."""

    def __init__(self, handle, done, held=0):
        self.handle, self.done, self.held = handle, done, held

    def finish(self):
        self.handle.wait()
        return self.done()


def drain(stages):
    for stage in stages:
        while stage is not None:
            stage = stage.finish()


# --- the exchange --------------------------------------------------------------------------------

class Exchange:
    """One optimizer's exchange (module docstring), with its state: the owners' resident copies
    (`resident_record` {piece.key: (owner slot, digest of this rank's shard and warm start)},
    `resident_cache` {piece.key: (W, warm start)} of the pieces this rank owns), this step's
    `counts` (bytes sent and received, collectives, pieces solved here, "held": the most bytes of
    sharded exchange buffers held at once) and `stats` {bank: {iterations, residual, fallbacks}}."""

    def __init__(self, options, plan):
        """options: ExchangeOptions; plan: the optimizer's SolverPlan (its device sets G's wire dtype,
        its options which pieces keep a warm start)."""
        self.options, self.plan = options, plan
        self.grad_dtype = options.grad_dtype(plan.device)
        self.resident_record, self.resident_cache = {}, {}
        self.counts, self.stats = {}, {}

    def forget(self):
        """Drop the resident copies: the next step sends every W and warm start again."""
        self.resident_record.clear()
        self.resident_cache.clear()

    @property
    def overlap(self):
        return self.options.overlap

    def step(self, groups, io, world):
        """One step of every piece in `groups` (sharded groups first, the replicated one last), on
        `world` ranks (the statistics' collective)."""
        self.counts = {"sent": 0, "received": 0, "collectives": 0, "solved": 0, "held": 0}
        self.stats = {}
        names = list(OrderedDict.fromkeys(name for group in groups for name, _ in group.banks))
        reduced = False
        for index, group in enumerate(groups):
            if group.sharded:
                self._sharded(group, io)
            else:
                last = index == len(groups) - 1 and group.slots > 1
                self._replicated(group, io, names if last else None)
                reduced = reduced or last
        if not reduced and world > 1 and names:
            device = next(local(piece.param).device for group in groups for _, pieces in group.banks
                          for piece in pieces)
            self._unpack_stats(names, all_gather_rows(self._pack_stats(names, device), world))

    # statistics: packed once, reduced once

    def _merge(self, name, new):
        """A bank cut by buckets: the largest iterations and residual, all fallbacks."""
        old = self.stats.get(name)
        self.stats[name] = new if old is None else {
            "iterations": torch.maximum(torch.as_tensor(old["iterations"]), torch.as_tensor(new["iterations"])),
            "residual": torch.maximum(torch.as_tensor(old["residual"]), torch.as_tensor(new["residual"])),
            "fallbacks": torch.as_tensor(old["fallbacks"]) + torch.as_tensor(new["fallbacks"])}

    def _pack_stats(self, names, device):
        """(len(names), STATS) of this rank's share of each bank (-inf where it solved none): one
        stack of the values (tensors, not floats: no device sync; each distinct Python number, the
        solver's fixed iteration counts and the -inf, one 0-dim fill made here, not kept across
        steps, so that a step's launches do not depend on the steps before it) and one cast to
        fp32, not a fill and an element write per value (10 launches for GPT-2's 3 banks). The
        stack promotes exactly (integers and fp32 to at most fp64) and the cast rounds to fp32 as
        the element writes did."""
        numbers = {}
        values = []
        for name in names:
            stats = self.stats.get(name)
            for field in STAT_FIELDS:
                value = stats[field] if stats is not None else -float("inf")
                if not torch.is_tensor(value):
                    if value not in numbers:
                        numbers[value] = torch.full((), float(value), dtype=torch.float32, device=device)
                    value = numbers[value]
                if value.device != torch.device(device):  # the reference solver's host statistics
                    value = value.to(device)
                values.append(value.reshape(()))
        return torch.stack(values).view(len(names), STATS).to(torch.float32)

    def _unpack_stats(self, names, shares):
        """shares: (ranks, len(names), STATS), every rank's _pack_stats."""
        largest, fallbacks = shares[..., :2].amax(dim=0), shares[..., 2].clamp_min(0).sum(dim=0)
        self.stats = {name: {"iterations": largest[i, 0], "residual": largest[i, 1], "fallbacks": fallbacks[i]}
                      for i, name in enumerate(names)}

    def _solve(self, io, banks, matrices, each=None):
        """io.solve's answers, bank by bank, their statistics merged; each(k, answer) is called as
        bank k's answer exists (the solve yields one bank's finished answer before it finishes the
        next: a gather posted there travels while the next bank retracts)."""
        solved = []
        for k, ((name, _), answer) in enumerate(zip(banks, io.solve(banks, matrices) if banks else [])):
            self._merge(name, answer[3])
            solved.append(answer)
            if each is not None:
                each(k, answer)
        return solved

    def _count(self, sent, received, solved=0):
        self.counts["sent"] += sent
        self.counts["received"] += received
        self.counts["collectives"] += 1
        self.counts["solved"] += solved

    def _returns(self, pending, stage):
        """After a bucket posted its return `stage`: with overlap, every earlier return moves on
        by one collective (waited, written, its next one posted) and this one stays in flight
        while the next bucket solves; without, this one is finished now (the serial order)."""
        if not self.overlap:
            drain([stage])
            return []
        moved = [nxt for nxt in (s.finish() for s in pending) if nxt is not None]
        return moved + [stage]

    # replicated parameters (DDP, or one process)

    def _replicated(self, group, io, stats_names):
        """Each bucket: the owners solve their pieces in one call; one all-gather per bank, posted
        as the call yields that bank's answers (in flight while it retracts the next bank), brings
        every rank the new W and warm starts; the last one carries every bank's statistics
        (stats_names). GPT-2 small hetero at 8 ranks (python -m bench.cost_model --fake): the
        last bucket's two Stiefel banks gathered apart, exposed transfer 0.40 -> 0.26 ms (wire
        56.6 -> 59.0 MB a rank: each bank padded to its own largest share), ratio 0.265 -> 0.258."""
        matrices = io.replicated
        if group.slots == 1:  # one process: every bank in one call, as the solver batches them
            for pieces, new_W, states, _ in self._solve(io, group.banks, matrices):
                torch._foreach_copy_([piece.weight() for piece in pieces], new_W)
                self._keep_own(io, pieces, states)
            return
        pending = []
        for index, bucket in enumerate(group.buckets):
            last = index == len(group.buckets) - 1
            mine = [(name, [p for p in pieces if group.owners[p.key] == group.me]) for name, pieces in bucket]
            solving = [j for j, (_, pieces) in enumerate(mine) if pieces]
            answers, posted = {}, []

            def post_through(j, bucket=bucket, last=last, answers=answers, posted=posted):
                # one gather per bank, in bucket order on every rank (a bank this rank solves none
                # of is posted with the next one it does, or after the solve); the statistics ride
                # on the last bank's of the last bucket, once every bank has merged them
                nonlocal pending
                while len(posted) <= j:
                    k = len(posted)
                    stage = self._gather(group, io, [bucket[k]], [answers[k]] if k in answers else [],
                                         stats_names if last and k == len(bucket) - 1 else None)
                    posted.append(k)
                    if len(posted) == 1 or not self.overlap:
                        pending = self._returns(pending, stage)
                    else:
                        pending.append(stage)

            def each(k, answer, answers=answers, solving=solving, post_through=post_through):
                answers[solving[k]] = answer
                post_through(solving[k])

            self._solve(io, [mine[j] for j in solving], matrices, each)
            post_through(len(bucket) - 1)
        drain(pending)

    def _keep_own(self, io, pieces, states):
        keeps = [keeps_warm_start(piece, self.plan.options) for piece in pieces]
        if states is None and any(keeps):
            raise RuntimeError(f"ManifoldMuon: the solver left no warm start for a {pieces[0].manifold} piece that "
                               "keeps one (sharded.keeps_warm_start): the exchange cannot send it")
        io.store_warm(pieces, states)

    def _gather(self, group, io, bucket, solved, stats_names):
        """Post one bucket's all-gather and write this rank's own pieces; returns its Stage."""
        by_slot = [[] for _ in range(group.slots)]
        for _, pieces in bucket:
            for piece in pieces:
                by_slot[group.owners[piece.key]].append(piece)
        warm = lambda piece: warm_shape(piece)[0] * warm_shape(piece)[1] if keeps_warm_start(  # noqa: E731
            piece, self.plan.options) else 0
        volume = max(sum(piece.weight().numel() + warm(piece) for piece in pieces) for pieces in by_slot)
        tail = STATS * len(stats_names) if stats_names else 0
        width = volume + tail
        device = bucket[0][1][0].param.device
        parts = []
        for pieces, new_W, states, _ in solved:
            self._keep_own(io, pieces, states)
            for i, (piece, w) in enumerate(zip(pieces, new_W)):
                parts.append(w.reshape(-1).float())
                if warm(piece):
                    parts.append(states[i].reshape(-1))
        # the send in one cat: this rank's answers, zeros up to the widest share, the statistics
        # (not a zero buffer, the answers' cat copied into it and the statistics copied after:
        # 1 to 2 launches fewer a gather; the same fp32 values)
        filled = sum(part.numel() for part in parts)
        if filled < volume:
            parts.append(torch.zeros(volume - filled, dtype=torch.float32, device=device))
        if stats_names:
            parts.append(self._pack_stats(stats_names, device).reshape(-1))
        # a buffer of its own (an answer alone would be sent as a view of it), unless only zeros
        send = parts[0] if not solved and not stats_names else torch.cat(parts).to(torch.float32)
        received, handle = all_gather_rows(send, group.slots, async_op=True)
        self._count(4 * width * (group.slots - 1), 4 * width * (group.slots - 1),
                    sum(len(pieces) for pieces, *_ in solved))
        for pieces, new_W, _, _ in solved:  # this rank's own pieces need not wait
            torch._foreach_copy_([piece.weight() for piece in pieces], new_W)

        def done():
            targets, sources, keep, states = [], [], [], []
            for slot, pieces in enumerate(by_slot):
                if slot == group.me:
                    continue
                offset = 0
                for piece in pieces:
                    n = piece.weight().numel()
                    targets.append(piece.weight())
                    sources.append(received[slot, offset:offset + n].view(piece.weight().shape))
                    offset += n
                    if warm(piece):
                        keep.append(piece)
                        states.append(received[slot, offset:offset + warm(piece)].view(warm_shape(piece)))
                        offset += warm(piece)
            if keep:  # every other rank's warm starts in one call (one foreach copy once they exist)
                io.store_warm(keep, states)
            if targets:
                torch._foreach_copy_(targets, sources)
            if stats_names:
                self._unpack_stats(stats_names, received[:, volume:].view(group.slots, len(stats_names), STATS))

        return Stage(handle, done)

    # sharded parameters (FSDP2, HSDP)

    def _sharded(self, group, io):
        layout = group.layout
        pieces = [piece for _, bank in group.banks for piece in bank]
        # the resident flags read before any writes (a parameter whose pieces lie in two buckets
        # is written by the first)
        resident = self.resident_flags(group, io, pieces)
        steps = [ShardedBucket(self, group, bucket, resident, io) for bucket in group.buckets]
        pending, out = [], steps[0].send_out() if steps else None
        for index, step in enumerate(steps):
            following = steps[index + 1] if index + 1 < len(steps) else None
            received = out.finish()
            if following is not None and self.overlap:
                # the next bucket's out exchange in flight while this one solves (its parts are
                # other pieces' rows, which this bucket does not write)
                out = following.send_out()
            stage = step.solve_and_return(received, in_flight=(out.held if following is not None and self.overlap
                                                               else 0) + sum(s.held for s in pending))
            pending = self._returns(pending, stage)
            if following is not None and not self.overlap:
                out = following.send_out()
        drain(pending)
        self.record_resident(group, io, pieces)

    # resident copies (ExchangeOptions.resident)

    def shard_digests(self, io, pieces):
        """{piece.key: (2,) or (4,) int64}: the digest of this rank's local shard of the piece's
        parameter (one per parameter) and, where it keeps one, of its local rows of the warm start."""
        of_param, out = {}, {}
        for piece in pieces:
            if id(piece.param) not in of_param:
                of_param[id(piece.param)] = digest(local(piece.param))
            warm = io.warm(piece)
            out[piece.key] = torch.cat([of_param[id(piece.param)]] + ([digest(warm)] if torch.is_tensor(warm) else []))
        return out

    def resident_flags(self, group, io, pieces):
        """{piece.key: whether its owner's resident copy of W and the warm start (from the last step)
        is what the shards hold now}, the same on every rank of the shard group. A copy is valid where
        the owner is the same as when it was kept and, on every rank, the digest of the local shard and
        warm start equals the one taken after that step wrote them (record_resident): one small
        all-reduce of the stale flags over the group, and one host sync to read them (the exchange's
        sizes depend on them). Without resident copies (the default): none, no collective."""
        if not self.options.resident:
            return {piece.key: False for piece in pieces}
        device = local(pieces[0].param).device
        current = self.shard_digests(io, pieces)
        stale = []
        for piece in pieces:  # one flag per piece, in bank order: the same length on every rank
            kept = self.resident_record.get(piece.key)
            if kept is None or kept[0] != group.owners[piece.key] or kept[1].shape != current[piece.key].shape:
                stale.append(torch.ones((), dtype=torch.int32, device=device))
            else:
                stale.append((kept[1] != current[piece.key]).any().to(torch.int32))
        stale = torch.stack(stale)
        dist.all_reduce(stale, op=dist.ReduceOp.MAX, group=group.layout.group)
        flags = {piece.key: not bad for piece, bad in zip(pieces, stale.tolist())}
        for piece in pieces:
            if flags[piece.key] and group.owners[piece.key] == group.me and piece.key not in self.resident_cache:
                raise RuntimeError(f"internal: resident piece {piece.key} missing from its owner's cache")
        return flags

    def record_resident(self, group, io, pieces):
        """After a group's step wrote the shards: every piece's owner and the digest of this rank's
        shard and warm start (checked by resident_flags next step); the owner's cache keeps only
        what it owns."""
        if not self.options.resident:
            return
        digests = self.shard_digests(io, pieces)
        for piece in pieces:
            self.resident_record[piece.key] = (group.owners[piece.key], digests[piece.key])
            if group.owners[piece.key] != group.me:
                self.resident_cache.pop(piece.key, None)


class ShardedBucket:
    """One bucket of a sharded group's step (module docstring: out, solve, back (a) and (b))."""

    def __init__(self, exchange, group, bucket, resident, io):
        self.ex, self.group, self.bucket, self.io = exchange, group, bucket, io
        self.layout = layout = group.layout
        self.R, self.r, self.replica_group = replicas(layout)
        self.S, self.s = layout.size, layout.rank
        every = [piece for _, pieces in bucket for piece in pieces]
        self.by_slot = [[piece for piece in every if group.owners[piece.key] == slot] for slot in range(group.slots)]
        self.keeps = {piece.key: keeps_warm_start(piece, exchange.plan.options) for piece in every}
        # the warm start travels once the parameter has stepped (until then it is zero)
        self.warm = {piece.key: self.keeps[piece.key] and io.started(piece) for piece in every}
        self.resident = {piece.key: resident[piece.key] for piece in every}
        self.grad_dtype = exchange.grad_dtype
        self.device = local(every[0].param).device

    def pieces_of(self, shard, replica=None):
        """The pieces owner (replica, shard) solves (replica: this rank's by default), in bank order."""
        return self.by_slot[(self.r if replica is None else replica) * self.S + shard]

    # what one rank sends to another, in order, both ways (sizes from the shapes alone)

    def out_parts(self, piece, sender):
        """What shard `sender` sends the owner of `piece`: its part of G and, unless the owner
        holds them from the last step (`resident`), of W and, once warm, of Lambda."""
        if self.resident[piece.key]:
            return piece_parts(piece, self.layout, sender, (("G", self.grad_dtype),), False)
        return piece_parts(piece, self.layout, sender, (("W", torch.float32), ("G", self.grad_dtype)),
                           self.warm[piece.key])

    def back_parts(self, piece, receiver):
        """What the owner of `piece` sends shard `receiver`: its part of the new W and, if kept, Lambda."""
        return piece_parts(piece, self.layout, receiver, (("W", torch.float32),), self.keeps[piece.key])

    def out_bytes(self, pieces, shard):
        return sum(wire_bytes(n, dt) for piece in pieces for _, n, dt in self.out_parts(piece, shard))

    def back_bytes(self, pieces, shard):
        return sum(wire_bytes(n, dt) for piece in pieces for _, n, dt in self.back_parts(piece, shard))

    def send_out(self):
        """out: my part of each piece my replica owns, to its owner, in the owner's order; returns
        the exchange in flight (a Stage whose finish() gives the bytes received)."""
        layout, me, io = self.layout, self.s, self.io
        sends = []
        for dest in range(self.S):
            for piece in self.pieces_of(dest):
                _, _, rows, cols = piece_box(piece, layout, me)
                if not self.resident[piece.key]:
                    sends.append(local(piece.param)[rows, cols].float())
                sends.append(io.momenta[id(piece.param)][rows, cols].to(self.grad_dtype))
                if self.warm[piece.key] and not self.resident[piece.key]:
                    sends.append(io.warm(piece))
        in_sizes = [self.out_bytes(self.pieces_of(dest), me) for dest in range(self.S)]
        out_sizes = [self.out_bytes(self.pieces_of(me), src) for src in range(self.S)]
        received, send, handle = all_to_all(sends, in_sizes, out_sizes, layout.group, self.device)
        self.ex._count(sum(n for rank, n in enumerate(in_sizes) if rank != me),
                       sum(n for rank, n in enumerate(out_sizes) if rank != me), len(self.pieces_of(me)))
        buffers = [send, received]

        def done():
            buffers.clear()  # the send buffer freed; the received one goes to solve_and_return
            return received
        return Stage(handle, done, held=send.numel() + received.numel())

    def solve_and_return(self, received, in_flight=0):
        """Assemble my pieces from the out exchange's bytes, solve them as one process does, keep
        resident copies, and post the return; returns its Stage. Records in counts["held"] the most
        bytes of exchange buffers held at once (bench/memory.py's exchange_held estimates it):
        what was received and the pieces assembled from it, then (the received bytes freed) the
        pieces and what they send and receive back, plus `in_flight` (others' exchanges posted)."""
        ex, layout, io, me = self.ex, self.layout, self.io, self.s
        device = received.device
        whole = {}
        for piece in self.pieces_of(me):
            rows, cols = piece.hi - piece.lo, piece.param.size(1)
            G = torch.empty(rows, cols, dtype=torch.float32, device=device)
            if self.resident[piece.key]:
                whole[piece.key] = [ex.resident_cache[piece.key][0], G, ex.resident_cache[piece.key][1]]
                continue
            whole[piece.key] = [torch.empty(rows, cols, dtype=torch.float32, device=device), G,
                                torch.empty(warm_shape(piece), dtype=torch.float32, device=device)
                                if self.warm[piece.key] else None]
        offset, chunk = 0, None
        for src in range(self.S):
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
        mine = [(name, [piece for piece in pieces if self.group.owners[piece.key] == self.group.me])
                for name, pieces in self.bucket]
        mine = [(name, pieces) for name, pieces in mine if pieces]
        new_W, new_duals = {}, {}
        for pieces, ws, states, _ in ex._solve(io, mine, lambda piece: whole[piece.key]):
            for i, (piece, w) in enumerate(zip(pieces, ws)):
                new_W[piece.key] = w
                new_duals[piece.key] = None if states is None else states[i]
                if (states is None) == self.keeps[piece.key]:
                    raise RuntimeError(f"internal: the solver's warm start for a {piece.manifold} piece does not "
                                       f"match keeps_warm_start")
        if ex.options.resident:  # kept for the next step (resident_flags)
            for piece in self.pieces_of(me):
                # rounded as the shards store them (a bf16 parameter holds bf16(new W)), so that
                # the next step solves from what it would receive without the copy
                W, dual = new_W[piece.key], new_duals.get(piece.key)
                W = W.to(piece.param.dtype).to(torch.float32)
                if dual is not None:
                    dual = dual.to(io.warm(piece).dtype).to(torch.float32)
                ex.resident_cache[piece.key] = (W, dual)
        # back (a): each shard its part of every new W and Lambda I computed
        sends = []
        for dest in range(self.S):
            for piece in self.pieces_of(me):
                piece_rows, piece_cols, _, _ = piece_box(piece, layout, dest)
                sends.append(new_W[piece.key][piece_rows, piece_cols].float())
                if self.keeps[piece.key]:
                    sends.append(new_duals[piece.key][dual_rows(piece, layout, dest)])
        in_sizes = [self.back_bytes(self.pieces_of(me), dest) for dest in range(self.S)]
        out_sizes = [self.back_bytes(self.pieces_of(src), me) for src in range(self.S)]
        back, send, handle = all_to_all(sends, in_sizes, out_sizes, layout.group, self.device)
        ex._count(sum(n for rank, n in enumerate(in_sizes) if rank != me),
                  sum(n for rank, n in enumerate(out_sizes) if rank != me))
        held = max(held, assembled + sum(in_sizes) + sum(out_sizes))
        ex.counts["held"] = max(ex.counts["held"], held + in_flight)
        del whole, new_W, new_duals
        buffers = [send]

        def done():
            buffers.clear()
            self.write(back, self.r)
            return self.replicate(back)
        return Stage(handle, done, held=send.numel() + back.numel())

    def write(self, back, replica):
        """Write the parts that shard `back`'s bytes hold (this shard's rows of the new W and warm
        starts of the pieces `replica` owns, from each of its shards in turn) into this rank's shards."""
        targets, sources, offset = [], [], 0
        for src in range(self.S):
            for piece in self.pieces_of(src, replica):
                _, _, rows, cols = piece_box(piece, self.layout, self.s)
                for name, n, dtype in self.back_parts(piece, self.s):
                    target = local(piece.param)[rows, cols] if name == "W" else self.io.warm(piece)
                    targets.append(target)
                    sources.append(back[offset:offset + n * dtype.itemsize].view(dtype).view(target.shape))
                    offset += wire_bytes(n, dtype)
        if targets:
            torch._foreach_copy_(targets, sources)

    def replicate(self, back):
        """HSDP's back (b): this shard's new parts of the pieces my replica owns (what back (a)
        brought, all fp32) to the same shard of every other replica, by one all-gather over the
        replica group, padded to the largest replica's; returns its Stage (None without replicas)."""
        if self.R == 1:
            return None
        size = [sum(self.back_bytes(self.pieces_of(src, replica), self.s) for src in range(self.S)) // 4
                for replica in range(self.R)]
        width = max(size)
        send = torch.zeros(width, dtype=torch.float32, device=self.device)
        send[:size[self.r]] = back.view(torch.float32)
        rows, handle = all_gather_rows(send, self.R, self.replica_group, async_op=True)
        self.ex._count(4 * width * (self.R - 1), 4 * width * (self.R - 1))

        def done():
            for replica in range(self.R):
                if replica != self.r:
                    self.write(rows[replica, :size[replica]].view(torch.uint8), replica)
        return Stage(handle, done, held=4 * width * (self.R + 1))


def steady_received_bytes(optimizer):
    """Bytes this rank receives from the others in a steady sharded step (every matrix with a
    gradient, the owners holding valid resident copies where resident copies are on): the G
    parts (and, without resident copies, the W and warm start parts) of the pieces it owns, its
    parts of the new W and warm starts of the pieces others of its replica own and, under HSDP,
    those of the pieces other replicas own. From the shapes and the plan."""
    options, grad = optimizer.plan.options, optimizer.exchange.grad_dtype
    resident = optimizer.exchange.options.resident
    total = 0
    out = (("G", grad),) if resident else (("W", torch.float32), ("G", grad))
    for layout, banks in sharded_banks(optimizer).items():
        group = bucket_group(layout, banks, optimizer.plan)
        R, r, _ = replicas(layout)
        S, s = layout.size, layout.rank
        back = lambda piece: sum(wire_bytes(n, dt) for _, n, dt in piece_parts(  # noqa: E731
            piece, layout, s, (("W", torch.float32),), keeps_warm_start(piece, options)))
        for _, pieces in banks:
            for piece in pieces:
                owner = group.owners[piece.key]
                if owner == group.me:  # out: ShardedBucket.out_parts of a warm piece
                    warm = not resident and keeps_warm_start(piece, options)
                    total += sum(wire_bytes(n, dt) for other in range(S) if other != s
                                 for _, n, dt in piece_parts(piece, layout, other, out, warm))
                elif owner // S == r:  # back (a)
                    total += back(piece)
        if R == 1:
            continue
        # back (b): the other replicas' parts, one all-gather per bucket padded to the largest
        for bucket in group.buckets:
            sizes = [0] * R
            for _, pieces in bucket:
                for piece in pieces:
                    sizes[group.owners[piece.key] // S] += back(piece)
            total += (R - 1) * max(sizes)
    return total
