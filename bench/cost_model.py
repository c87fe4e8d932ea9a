"""What one ManifoldMuon step of a GPT-2 would cost on a GPU, counted on a CPU.

    python -m bench.cost_model --fake                           # GPT-2 small, hetero, world sizes 1 and 8
    python -m bench.cost_model --fake --solver-opt iterations=4 --solver-opt pullbacks=1   # other budgets
    python -m bench.cost_model --solver-opt capturable=off      # the syncing step (early exits)
    python -m bench.cost_model --n-layer 2 --n-embd 64 --out /tmp/cost.json
    python -m bench.cost_model --fake --fsdp --model gpt2-xl --world-size 8   # + the sharded step's line
    python -m bench.cost_model --fake --fsdp --fsdp-shard-ranks 8 --model gpt2-xl --world-size 64   # HSDP 8 x 8
    python -m bench.cost_model --fake --fsdp --model gpt2-xl --world-size 8 --exchange-bucket 67108864   # what if

It builds the trainer's Muon groups exactly (train_gpt2.build_optimizers, --kernels torch, fp32
on CPU) with the solver a GPU runs by default (its "auto" choices: polynomial clip, sync-free
step, TF32 iterations; --solver-opt KEY=VALUE, --exchange-opt KEY=VALUE and --solver-precision go to the trainer as given,
after those), gives every matrix a momentum-like gradient (bench/optimizer.py), runs one untimed
step (momenta and warm starts created), then counts ONE warm step op by op (bench/op_count.py):
kernel launches (torch ops; each call of the three kernel products is one Triton launch),
host syncs, dense-product FLOPs by the precision they would run at on a GPU, the bytes each
kernel that is not a product reads and writes (priced at HBM's rate where that outlasts its
launch: MEMORY_NOTE), and the linear-algebra ops. For world size N > 1 the same step is counted N times, once "as rank r"
(opt.world_size / opt.rank set on an optimizer built without torch.distributed, collectives
replaced by no-ops that record their bytes), each from the same state: what each rank of an
N-GPU run computes and sends.

From those counts and the constants in H200 (printed with the result) it gives an ESTIMATE of
the step's time on one H200 against forward+backward of the same tokens. Estimates only:
until a GPU measures them (bench/step_time.py, bench/gpu_check.sh). The collectives overlap as the
code posts and waits them (OVERLAP_NOTE): each simulated collective records where the step stands
when it is posted and when its handle's wait() is called, its bytes go over one link at
H200["link_bytes_per_s"], and only the part of a transfer that outlasts the compute recorded
between its post and its wait adds to the step (a synchronous collective adds all of it).
Ranks that own the same shapes (work_signature) run the same ops: one of them is counted and the
others share its counts (--count-every-rank counts each).

--fake runs everything under FakeTensorMode (no arithmetic; minutes become seconds). The counts
are the same as a real run's as long as the step makes no data-dependent host decision: the
sync-free step makes none; the syncing one (capturable=off: convergence checks) does, and then
it reports so and counts a real run instead (unless --fake-only).

--fsdp ends with one line per world size N > 1 for the sharded step (manifolds/exchange.py):
`sharded: bucket balance B, bytes per rank G GB, optimizer R of forward+backward`, B the worst
exchange bucket's most loaded owner over its mean (exchange.bucket_balance, step_cost.piece_cost), G
what a rank receives per step (bench/sharded_bytes.py's count), R an ESTIMATE: the counted ranks'
compute summed, spread over the buckets as their owners carry it (each bucket waits for its most
loaded owner), and the exchange's bytes at the same link bandwidth, each bucket's out and back
async and double-buffered (the next bucket's out and this one's back in flight while the next
solves: the larger of compute and transfer per bucket), the serial figure and DDP's R beside it.
This line is analytical (no sharded step runs here): it prices the exchange issue 59 describes.
--fsdp-shard-ranks S: HSDP, N / S replicas of S-rank shard groups (issue 59's design): owners
over all N ranks (each matrix solved once per job), out and back inside the shard group 1/R of
FSDP-over-S's bytes, plus the replica all-gather of the shard's new W and warm starts,
(R - 1) / R x 4 bytes an element; forward+backward per rank from the same global batch over N.
Links: a collective among at most H200["node_gpus"] ranks runs at NVLink's rate, one among more
crosses nodes and runs at one 400 Gb/s InfiniBand NIC per GPU's (link_rate; DDP's gathers at
world size 64 included). Under HSDP the replica all-gather (each bucket's, after its shard-group
return) has a link of its own: the NIC when the job spans nodes. The sharded line also gives the
figure with every byte on one NVLink link, as it was priced before.
"""
import argparse
import contextlib
import copy
import os
import subprocess
import sys
import time
from collections import defaultdict

import torch
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,
                                           FakeTensorMode)

from bench.op_count import OpCounter, simulated_collectives, triton_attribution
from bench.optimizer import momentum_like
from bench.results import Results
from errors import run_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Stated constants of one H200 for the estimate. Measured: dense bf16 at 790 TFLOP/s on a large
# product; the rest are assumptions, not measurements.
H200 = {
    "bf16_flops": 395e12,            # half the 790 TFLOP/s of a large product: these shapes are small
    "tf32_flops": 395e12 / 2,        # TF32 tensor cores: half of bf16's rate
    "tf32x3_flops": 395e12 / 6,      # 3xTF32: three TF32 products per product
    "ieee_fp32_flops": 50e12,        # fp32 on CUDA cores (cuBLAS without TF32)
    "fp64_flops": 25e12,             # (not expected in the step)
    "launch_s": 5e-6,                # per kernel launch, Triton or torch, not overlapped with compute
    "sync_s": 20e-6,                 # per host sync (the queue drains, the host waits, relaunches)
    "literal_s": 20e-6,              # per tensor literal: a blocking H2D copy waits for the stream
    "linalg_flops": 50e12,           # eigh / cholesky / triangular solve: a rough guess, see below
    "fwd_bwd_flops": 395e12,         # forward + backward at half of bf16 peak
    "link_bytes_per_s": 350e9,       # a rank's link (NVLink ring bus bandwidth, assumed), every collective's bytes
    # HBM3e's peak (NVIDIA's H200 SXM figure, 4.8 TB/s): kernels that are not products move bytes
    "hbm_bytes_per_s": 4.8e12,
    # across nodes (a collective over more than one node: HSDP's replica all-gather, DDP beyond 8
    # ranks): one 400 Gb/s InfiniBand NIC per GPU, 8 GPUs a node (an H200 SXM x 8 system: MLCommons
    # inference v4.1, closed/NVIDIA/systems/H200-SXM-141GBx8_TRT_MaxQ.json: "18x 4th Gen NVLink,
    # 900GB/s", "10x 400Gbe Infiniband", 8 of them for the GPUs), its line rate, no protocol overhead
    "node_gpus": 8,
    "internode_bytes_per_s": 400e9 / 8,
}
OVERLAP_NOTE = ("overlap: each collective's bytes on its rank's link at 350 GB/s (NVLink; 50 GB/s, one 400 Gb/s "
                "InfiniBand NIC per GPU, where its ranks span nodes of 8) (ring all-gather (n-1) x its input, "
                "reduce-scatter (n-1)/n, all-reduce 2(n-1)/n, all-to-all the others' parts), collectives one after "
                "another in the order posted; an async one overlaps the compute (products, launches, syncs, linalg) "
                "the step records between its post and its wait(), a synchronous one overlaps nothing; the step "
                "ends when its compute and every transfer are done; compute is not slowed by a transfer")
MEMORY_NOTE = ("memory: a kernel that is not a product (elementwise, reductions, copies, outside the Triton "
               "products) takes the longer of its launch and its bytes read and written (a broadcast input "
               "once) at 4.8 TB/s, HBM3e's peak: optimistic for large tensors (real kernels reach less than "
               "the peak), pessimistic for small ones (L2 may hold them between kernels)")
LINALG_NOTE = ("linalg ops (eigh ~9 q^3, cholesky q^3/3, triangular solve q^2 k FLOPs) at 50 TFLOP/s plus "
               "a launch each: a rough guess and likely optimistic (cuSOLVER's batched factorizations are "
               "sequential panel algorithms, often milliseconds at q = 768)")
RATE_OF = {"triton:bf16": "bf16_flops", "bf16": "bf16_flops", "triton:tf32": "tf32_flops", "tf32": "tf32_flops",
           "triton:tf32x3": "tf32x3_flops", "ieee-fp32": "ieee_fp32_flops", "float64": "fp64_flops"}
FAKE_ERRORS = (DataDependentOutputException, DynamicOutputShapeException)
# What SolverOptions' "auto" resolves to on a GPU where this CPU would choose otherwise
# (manifolds/plan.py: eigh and the syncing step on a CPU); --solver-precision's default is the third
GPU_SOLVER_OPTS = ("clip=polynomial", "capturable=on")  # what auto picks on a GPU
# (the exchange's settings, --exchange-opt, are resolved for a GPU where the sharded line prices
# them: exchange_grad auto is bf16 there)


MODEL_SHAPES = {"gpt2": (12, 768), "gpt2-medium": (24, 1024), "gpt2-large": (36, 1280), "gpt2-xl": (48, 1600)}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--n-embd", type=int, default=768)
    ap.add_argument("--model", choices=tuple(MODEL_SHAPES), default=None,
                    help="a GPT-2 preset's shape (sets --n-layer and --n-embd)")
    ap.add_argument("--fsdp", action="store_true",
                    help="also the sharded step's line per world size above 1 (bucket balance, bytes, estimate)")
    ap.add_argument("--fsdp-shard-ranks", type=int, default=None, metavar="S",
                    help="with --fsdp: HSDP, shard groups of S ranks, world size / S replicas (each world size "
                         "above 1 a multiple of S)")
    ap.add_argument("--exchange-bucket", type=int, default=None, metavar="ELEMENTS",
                    help="what if manifolds.exchange.EXCHANGE_BUCKET (elements of W per owner and bucket) were "
                         "this: more buckets overlap more of the exchange and repeat the solver's per-bank launches")
    ap.add_argument("--assign", default="hetero", help="train_gpt2.py's --assign (not auto)")
    ap.add_argument("--bank-launches", action="store_true",
                    help="also the launches each bank adds to one rank's step at the largest world size (DDP's "
                         "buckets): that rank owning one piece of it, and one of each bank of its bucket, against "
                         "owning none (what a rank pays per bank it touches, exchange.bucket_owners)")
    ap.add_argument("--world-size", type=int, nargs="+", default=[1, 8], help="world sizes to count")
    ap.add_argument("--solver-opt", action="append", default=[], metavar="KEY=VALUE",
                    help="train_gpt2's --solver-opt, repeatable, applied after the GPU's choices "
                         + " ".join(GPU_SOLVER_OPTS) + " (e.g. clip=eigh, capturable=off, iterations=4)")
    ap.add_argument("--exchange-opt", action="append", default=[], metavar="KEY=VALUE",
                    help="train_gpt2's --exchange-opt, repeatable (e.g. resident=on, exchange_grad=fp32: the "
                         "sharded line's bytes)")
    ap.add_argument("--solver-precision", default="tf32",
                    help="train_gpt2's --solver-precision (default tf32: what its auto picks on a GPU; on this "
                         "CPU auto would be fp32)")
    ap.add_argument("--tf32", action="store_true",
                    help="label products as if torch.backends.cuda.matmul.fp32_precision = 'tf32' "
                         "(set_float32_matmul_precision('high')): TF32 for torch's fp32 matmuls and the kernels")
    ap.add_argument("--fake", action="store_true", help="count under FakeTensorMode (falls back to a real run "
                                                        "when the step reads device values on the host)")
    ap.add_argument("--fake-only", action="store_true", help="with --fake: no real fallback")
    ap.add_argument("--seq-len", type=int, default=1024, help="for the forward+backward comparison")
    ap.add_argument("--tokens", type=int, default=64 * 1024,
                    help="tokens per optimizer step over all ranks (the trainer's 64 x 1024)")
    ap.add_argument("--top", type=int, default=20, help="ops listed by count")
    ap.add_argument("--count-every-rank", action="store_true",
                    help="count each rank's step (default: one rank per set of ranks that own the same "
                         "shapes on the same manifolds, whose counts are the same)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (1 is fastest for small shapes on a busy machine)")
    ap.add_argument("--out", default=None, help="JSON results")
    args = ap.parse_args(argv)
    if args.model:
        args.n_layer, args.n_embd = MODEL_SHAPES[args.model]
    if args.fake_only:
        args.fake = True
    if args.assign.strip() == "auto":
        ap.error("--assign auto switches manifolds during training; give its base assignment instead")
    if any(n < 1 for n in args.world_size):
        ap.error("--world-size takes positive integers")
    if args.bank_launches and max(args.world_size) < 2:
        ap.error("--bank-launches needs a world size above 1")
    if args.exchange_bucket is not None and args.exchange_bucket < 1:
        ap.error("--exchange-bucket takes a positive number of elements")
    if args.fsdp_shard_ranks is not None:
        if not args.fsdp:
            ap.error("--fsdp-shard-ranks needs --fsdp")
        if args.fsdp_shard_ranks < 1 or any(n > 1 and n % args.fsdp_shard_ranks for n in args.world_size):
            ap.error(f"--fsdp-shard-ranks {args.fsdp_shard_ranks}: every world size above 1 must be a multiple of it "
                     f"(got --world-size {' '.join(map(str, args.world_size))})")
    return args


def git_commit():
    """(commit, whether manifolds/ or kernels/ differ from it): the code that was counted."""
    def git(*cmd):
        return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = bool(git("status", "--porcelain", "--", "manifolds", "kernels", "bench/op_count.py"))
    return commit, dirty


# --- the trainer's optimizer ------------------------------------------------------------------

def trainer_args(args):
    """train_gpt2's args for this shape: the same groups and solver options as a training run."""
    import train_gpt2
    n_head = max(1, args.n_embd // 64) if args.n_embd % 64 == 0 else 1  # Muon shapes do not depend on it
    targs = train_gpt2.parse_args(["--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd),
                                   "--n-head", str(n_head), "--seq-len", str(args.seq_len),
                                   "--assign", args.assign, "--kernels", "torch", "--device", "cpu",
                                   "--dtype", "float32", "--solver-precision", args.solver_precision]
                                  + [flag for opt in GPU_SOLVER_OPTS + tuple(args.solver_opt)
                                     for flag in ("--solver-opt", opt)]
                                  + [flag for opt in args.exchange_opt for flag in ("--exchange-opt", opt)])
    train_gpt2.validate_args(targs, world_size=1)
    return targs


def build(args, fake):
    """(model, ManifoldMuon, [params], grads(step) -> [grad per param]) as the trainer builds them."""
    import train_gpt2
    targs = trainer_args(args)
    torch.manual_seed(args.seed)
    model = train_gpt2.GPT(train_gpt2.GPTConfig(n_layer=targs.n_layer, n_head=targs.n_head, n_embd=targs.n_embd,
                                                seq_len=targs.seq_len, vocab_size=targs.vocab_size))
    muon, _ = train_gpt2.build_optimizers(model, targs, torch.device("cpu"))
    params = [p for group in muon.param_groups for p in group["params"]]
    gen = torch.Generator().manual_seed(args.seed)
    # momentum-like gradients (power-law spectrum), drifting slowly from step to step; under
    # fake tensors only their shapes matter
    make = (lambda shape: torch.randn(shape)) if fake else (lambda shape: momentum_like(shape, gen))  # noqa: E731
    base = [make(tuple(p.shape)) for p in params]

    def grads(step):
        return [0.9 * b + 0.1 * make(tuple(b.shape)) for b in base]
    return model, muon, params, grads


def snapshot(opt, params):
    return ([p.detach().clone() for p in params],
            {p: {k: v.clone() if torch.is_tensor(v) else copy.deepcopy(v) for k, v in s.items()}
             for p, s in opt.state.items()})


def restore(opt, params, snap):
    weights, state = snap
    with torch.no_grad():
        for p, w in zip(params, weights):
            p.copy_(w)
    opt.state = defaultdict(dict, {p: {k: v.clone() if torch.is_tensor(v) else copy.deepcopy(v)
                                       for k, v in s.items()} for p, s in state.items()})


def ownership(opt, world_size):
    """[[(param index, lo, hi), ...] per rank]: the pieces each rank computes; checks that every
    piece has exactly one owner (a stale split would count work twice or not at all)."""
    index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    saved = opt.world_size, opt.rank
    owned = []
    try:
        for rank in range(world_size):
            opt.world_size, opt.rank = world_size, rank
            owned.append([(index[id(pc.param)], pc.lo, pc.hi) for pc in opt.owned_pieces()])
    finally:
        opt.world_size, opt.rank = saved
    every = sorted((index[id(pc.param)], pc.lo, pc.hi) for pc in opt.pieces())
    if sorted(x for rank in owned for x in rank) != every:
        raise RuntimeError(f"the split over {world_size} ranks does not own every piece exactly once")
    return owned


def work_signature(opt, owned):
    """What a rank's step depends on beyond the shared state: the multiset of (group, shape, rows) of
    the pieces it owns (a group holds one manifold and one set of options). Ranks of one signature run the same ops (the banks, the
    exchange's padded width and the momenta of every matrix are the same on every rank)."""
    params = [(g_index, p) for g_index, g in enumerate(opt.param_groups) for p in g["params"]]
    return tuple(sorted((params[i][0], tuple(params[i][1].shape), hi - lo) for i, lo, hi in owned))


def count_step(opt, world_size, rank):
    """OpCounter of one opt.step() as `rank` of `world_size`."""
    counter = OpCounter(sites=True)
    saved = opt.world_size, opt.rank
    opt.world_size, opt.rank = world_size, rank
    try:
        with contextlib.ExitStack() as stack:
            if world_size > 1:
                stack.enter_context(simulated_collectives(counter, world_size))
            stack.enter_context(counter)
            stack.enter_context(triton_attribution(counter))
            opt.step()
    finally:
        opt.world_size, opt.rank = saved
    return counter


def count_all(args, fake):
    """{world size: [summary per rank]}, plus the model's matmul parameter count, the per-rank
    ownership and the optimizer's SolverPlan. Raises FAKE_ERRORS when `fake` and the step reads
    device values."""
    # the solver's kept constants (kernels.constants) start empty, as in a fresh process: kept
    # ones of earlier counts (other fake modes) would fill its bounded store, which drops them all
    # when full, so that a count's launches would depend on what this process counted before
    from kernels import constants
    constants._KEPT.clear()
    mode = FakeTensorMode() if fake else contextlib.nullcontext()
    with mode:
        model, opt, params, grads = build(args, fake)
        for p, g in zip(params, grads(0)):
            p.grad = g
        opt.step()  # warm-up: momenta and warm starts
        for p, g in zip(params, grads(1)):
            p.grad = g
        snap = snapshot(opt, params)
        counts, owners, sharded = {}, {}, {}
        for world_size in args.world_size:
            owners[world_size], counts[world_size] = count_world(args, opt, params, snap, world_size)
            if args.fsdp and world_size > 1:
                # the sharded step solves in the sharded buckets (exchange.buckets, owners over
                # every rank of the job): counted as the replicated step cut the same way
                with sharded_cut():
                    sharded[world_size] = count_world(args, opt, params, snap, world_size)[1]
        banks = bank_launches(opt, params, snap, max(args.world_size)) if args.bank_launches else None
        restore(opt, params, snap)
        # matmul parameters of forward+backward: all but the position embedding (a lookup; the
        # token embedding is tied to the head, a product)
        matmul_params = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
        shapes = [tuple(p.shape) for p in params]
    return counts, owners, (matmul_params, shapes), opt.plan, sharded, banks


def bank_launches(opt, params, snap, world_size):
    """{"none": launches of rank 0's step owning no piece, "buckets": [{"banks": {bank name: launches
    one piece of it adds}, "together": launches one piece of each bank of the bucket adds}]} at
    `world_size` over DDP's buckets (exchange.replicated_buckets), every other piece owned by ranks
    1 .. N-1 in turn: what a rank pays per bank it touches (its solver's launches are per bank and per
    call, not per piece; "together" below the banks' sum: the call's own launches, paid once)."""
    from manifolds import exchange
    banks = [(opt.bank_name(pieces), pieces) for _, pieces in opt.banks()]
    saved = exchange.bucket_owners

    def launches(mine):
        def owners(bucketed, plan, ranks, **_):
            others = [piece.key for bucket in bucketed for _, pieces in bucket for piece in pieces
                      if piece.key not in mine]
            return {**{key: 0 for key in mine}, **{key: 1 + i % (ranks - 1) for i, key in enumerate(others)}}
        exchange.bucket_owners = owners
        try:
            restore(opt, params, snap)
            return count_step(opt, world_size, 0).summary(1)["launches"]
        finally:
            exchange.bucket_owners = saved
    none = launches(set())
    out = []
    for bucket in exchange.replicated_buckets(banks, world_size):
        alone = {name: launches({pieces[0].key}) - none for name, pieces in bucket}
        together = launches({pieces[0].key for _, pieces in bucket}) - none if len(bucket) > 1 else None
        out.append({"banks": alone, "together": together})
    return {"world_size": world_size, "none": none, "buckets": out}


def count_world(args, opt, params, snap, world_size):
    """(owned pieces per rank, [summary per rank]) of one step at `world_size` from the snapshot."""
    owners = ownership(opt, world_size)
    ranks, counted = [], {}
    for rank in range(world_size):
        signature = work_signature(opt, owners[rank])
        if signature in counted and not args.count_every_rank:  # the same work as a rank counted
            ranks.append({**ranks[counted[signature]], "same_count_as": counted[signature]})
            continue
        counted[signature] = rank
        restore(opt, params, snap)
        t0 = time.perf_counter()
        counter = count_step(opt, world_size, rank)
        ranks.append({**counter.summary(args.top), "seconds_on_this_machine": time.perf_counter() - t0,
                      "world_size": world_size, "pieces": len(owners[rank])})
    return owners, ranks


@contextlib.contextmanager
def sharded_cut():
    """DDP's buckets cut as the sharded step's (exchange.buckets instead of replicated_buckets)."""
    from manifolds import exchange
    saved = exchange.replicated_buckets
    exchange.replicated_buckets = exchange.buckets
    try:
        yield
    finally:
        exchange.replicated_buckets = saved


# --- the estimate -------------------------------------------------------------------------------

def memory_seconds(nbytes):
    """What a kernel that is not a product adds beyond its launch: it takes the longer of the
    launch and its bytes read and written at HBM's rate (MEMORY_NOTE)."""
    return max(0.0, nbytes / H200["hbm_bytes_per_s"] - H200["launch_s"])


def compute_parts(progress, op_bytes=()):
    """Seconds of the compute a count (OpCounter.progress, or a summary) holds: products at their
    precision's rate, launches, memory, syncs, literals, linalg (additive). memory: memory_seconds
    of the first progress["memory_ops"] of op_bytes (the count's, in program order)."""
    return {"products": sum(flops / H200[RATE_OF.get(label, "ieee_fp32_flops")]
                            for label, flops in progress["flops_executed_by_precision"].items()),
            "launches": progress["launches"] * H200["launch_s"],
            "memory": sum(map(memory_seconds, op_bytes[:progress.get("memory_ops", 0)])),
            "syncs": progress["host_syncs"] * H200["sync_s"],
            "literals": progress["host_literals"] * H200["literal_s"],
            "linalg": sum(progress["linalg_flops"].values()) / H200["linalg_flops"]}


def overlapped(events, compute_end):
    """(step seconds, transfer seconds) of a step whose compute ends at `compute_end` and whose
    collectives are `events` in program order: ("post", key, compute seconds done when posted,
    transfer seconds[, link[, after]]) and ("wait", key, compute seconds done when waited). Each
    link (default: one) carries its transfers one after another: a transfer starts when posted,
    its link is free and the transfer `after` (a key, if given) has ended; a wait stalls the
    compute until its transfer ends (OVERLAP_NOTE). Different links run at the same time."""
    stall = transfer = 0.0
    free, ends, waited = defaultdict(float), {}, set()
    for kind, key, at, *rest in events:
        now = at + stall
        if kind == "post":
            seconds, link, after = rest[0], rest[1] if len(rest) > 1 else "link", rest[2] if len(rest) > 2 else None
            start = max(now, free[link], ends[after] if after is not None else 0.0)
            free[link] = ends[key] = start + seconds
            transfer += seconds
        else:
            waited.add(key)
            stall += max(0.0, ends[key] - now)
    return max([compute_end + stall] + [end for key, end in ends.items() if key not in waited]), transfer


def estimate(summary, world_size=1):
    """Seconds of one rank's step on one H200 from its counts: compute_parts, and the collectives'
    transfers overlapped with the compute between each one's post and its wait (`overlapped`), at
    link_rate(world_size) (NVLink inside a node, the InfiniBand NIC across nodes)."""
    op_bytes = summary.get("op_bytes", ())
    parts = compute_parts(summary, op_bytes)
    compute = sum(parts.values())
    events = []
    for kind, index in summary.get("transfer_order", ()):
        t = summary["transfers"][index]
        if kind == "post":
            events.append(("post", index, sum(compute_parts(t["posted"], op_bytes).values()),
                           t["wire_bytes"] / link_rate(world_size)))
        else:
            events.append(("wait", index, sum(compute_parts(t["waited"], op_bytes).values())))
    step, transfer = overlapped(events, compute)
    parts.update(compute=compute, transfer=transfer, exposed_transfer=step - compute, total=step)
    return parts


def field_muon_flops(shapes):
    """The field's Muon: 5 steps of 4 m^2 n + 2 m^3 FLOPs on each m x n matrix (m <= n)."""
    return sum(5 * (4 * min(r, c) ** 2 * max(r, c) + 2 * min(r, c) ** 3) for r, c in shapes)


def field_muon(shapes, world_size):
    """The field's Muon on the same matrices, for comparison: 5 Polar Express (or quintic
    Newton-Schulz) steps in bf16 on the wide orientation, 4 m^2 n + 2 m^3 FLOPs each for an
    m x n matrix (m <= n: S = X X^T, S^2, B X), the matrices split evenly over the ranks
    (modded-nanogpt, dion); launches: one batched sign per shape (a normalisation and 3
    products a step, 17 launches)."""
    flops = field_muon_flops(shapes)
    launches = 17 * len({(min(r, c), max(r, c)) for r, c in shapes})
    seconds = flops / world_size / H200["bf16_flops"] + launches * H200["launch_s"]
    return {"flops": flops, "flops_per_rank": flops / world_size, "launches": launches, "seconds": seconds}


def fwd_bwd(args, matmul_params, world_size):
    tokens = args.tokens // world_size
    flops = 6 * matmul_params * tokens + 12 * args.n_layer * args.n_embd * args.seq_len * tokens
    return {"tokens_per_rank": tokens, "flops": flops, "seconds": flops / H200["fwd_bwd_flops"]}


# --- output -------------------------------------------------------------------------------------

def gf(x):
    return f"{x / 1e9:.1f}"


def print_world(world_size, ranks, owners, fb, muon):
    labels = sorted({label for r in ranks for label in r["flops_by_precision"]})
    print(f"\nworld size {world_size}" + (" (per rank; the step waits for the slowest)" if world_size > 1 else "") + ":")
    head = (f"  {'rank':>4} {'pieces':>6} " + " ".join(f"{'GFLOP ' + label:>19}" for label in labels)
            + f" {'triton':>7} {'torch':>6} {'launch':>7} {'syncs':>5} {'lit':>4} {'linalg':>6}"
            f" {'gather MB':>9} {'EST ms':>8}")
    print(head)
    for rank, r in enumerate(ranks):
        est = estimate(r, world_size)
        print(f"  {rank:>4} {r['pieces']:>6} " + " ".join(f"{gf(r['flops_by_precision'].get(label, 0)):>19}"
                                                        for label in labels)
              + f" {sum(r['triton_launches'].values()):>7} {r['kernels']:>6} {r['launches']:>7}"
              f" {r['host_syncs']:>5} {r['host_literals']:>4} {sum(r['linalg'].values()):>6}"
              f" {r['collective_bytes_sent'] / 1e6:>9.2f} {1e3 * est['total']:>8.2f}")
    if world_size > 1:
        total = {label: sum(r["flops_by_precision"].get(label, 0) for r in ranks) for label in labels}
        print("  sum  " + " " * 6 + " ".join(f"{gf(total[label]):>19}" for label in labels))
    slowest = max(ranks, key=lambda r: estimate(r, world_size)["total"])
    est = estimate(slowest, world_size)
    print(f"  ESTIMATE, one H200{' (slowest rank)' if world_size > 1 else ''}: optimizer step "
          f"{1e3 * est['total']:.2f} ms (products {1e3 * est['products']:.2f}, launches {1e3 * est['launches']:.2f}, "
          f"memory {1e3 * est['memory']:.2f}, "
          f"syncs {1e3 * est['syncs']:.2f}, literals {1e3 * est['literals']:.2f}, linalg {1e3 * est['linalg']:.2f}, "
          f"transfer {1e3 * est['transfer']:.2f} of which exposed {1e3 * est['exposed_transfer']:.2f}); "
          f"fwd+bwd of {fb['tokens_per_rank']} tokens {1e3 * fb['seconds']:.1f} ms; "
          f"ratio {est['total'] / fb['seconds']:.3f}")
    flops = sum(r["flops_total"] for r in ranks)
    print(f"  against the field's Muon (bf16, 5 steps) on the same matrices: FLOPs {flops / 1e9:.0f} / "
          f"{muon['flops'] / 1e9:.0f} GFLOP = {flops / muon['flops']:.2f}x (all ranks); ESTIMATE "
          f"{1e3 * est['total']:.2f} / {1e3 * muon['seconds']:.2f} ms = {est['total'] / muon['seconds']:.2f}x"
          f"{' per rank' if world_size > 1 else ''}")


def matrix_elements(targs):
    """(elements of the Muon matrices, elements of their q x q warm starts) of the model (the shapes
    bench/sharded_bytes.py prices)."""
    from bench.sharded_bytes import SHAPES, dual_elements
    assignment = dict(targs.assignment)
    matrices = duals = 0
    for key, shape in SHAPES.items():
        rows, cols = shape(targs.n_embd)
        matrices += targs.n_layer * rows * cols
        duals += targs.n_layer * dual_elements(assignment[key], rows, cols)
    return matrices, duals


def bytes_of(summary, function):
    """[bytes] of a count's memory-bound kernels launched from `function` (their call sites' name)."""
    return [n for n, site in zip(summary.get("op_bytes", ()), summary.get("op_sites", ()))
            if site is not None and site.endswith(f" {function}")]


def momentum_memory(summary):
    """Seconds of a count's memory term spent in the momentum update (optimizer._momenta), which
    touches every matrix of the model on every DDP rank."""
    return sum(map(memory_seconds, bytes_of(summary, "_momenta")))


def nonfinite_check_seconds(summary):
    """Seconds of a count spent in the gradients' finite check (optimizer._finite_flags: every
    kernel of it memory-bound, each one launch), which a DDP rank runs on every matrix and an FSDP
    rank on none (its sharded parameters skip it)."""
    return sum(H200["launch_s"] + memory_seconds(n) for n in bytes_of(summary, "_finite_flags"))


def link_rate(ranks):
    """Bytes per second of a collective over `ranks` ranks: NVLink's inside one node (ranks <=
    H200["node_gpus"]), one InfiniBand NIC per GPU's across nodes (a ring's slowest hop)."""
    return H200["link_bytes_per_s"] if ranks <= H200["node_gpus"] else H200["internode_bytes_per_s"]


def exchange_timeline(per_bucket, share, out, back, replica, shard_rate, replica_rate):
    """(seconds, transfer seconds) of the sharded step as issue 59 has it: each bucket's out and
    back async, double-buffered (the next bucket's out and this one's back in flight while the
    next solves), in post order on the shard group's link; `replica` bytes (HSDP's all-gather
    across the replicas) follow each bucket's back on a link of their own at replica_rate.
    Bytes are the step's totals, each bucket's `share` of them."""
    events, clock, returns = [("post", ("out", 0), 0.0, out * share[0] / shard_rate)], 0.0, []
    for b, seconds in enumerate(per_bucket):
        events.append(("wait", ("out", b), clock))
        if b + 1 < len(per_bucket):
            events.append(("post", ("out", b + 1), clock, out * share[b + 1] / shard_rate))
        clock += seconds
        events.append(("post", ("back", b), clock, back * share[b] / shard_rate))
        returns.append(("back", b))
        if replica:
            events.append(("post", ("replica", b), clock, replica * share[b] / replica_rate, "replica", ("back", b)))
            returns.append(("replica", b))
    return overlapped(events + [("wait", key, clock) for key in returns], clock)


def sharded_line(args, world_size, ranks, fb, plan, ddp_seconds):
    """Print and return the --fsdp line of one world size (module docstring); with
    --fsdp-shard-ranks S < world size, HSDP: R = world size / S replicas of S-rank shard groups, each
    matrix solved once per job (owners over all the ranks), the new values all-gathered across
    the replicas (issue 59's design)."""
    from bench.memory import meta_model
    from bench.sharded_bytes import per_step
    from manifolds import ManifoldMuon, exchange
    targs = trainer_args(args)
    _, groups = meta_model(targs)
    banks = list(ManifoldMuon(groups, shard=False).banks())
    shard_ranks = args.fsdp_shard_ranks or world_size
    replicas = world_size // shard_ranks
    # owners over every rank of the job (HSDP: of both mesh dimensions)
    bucketed = exchange.buckets(banks, world_size)
    owners = exchange.bucket_owners(bucketed, plan, world_size)
    balance = exchange.bucket_balance(bucketed, owners, plan, world_size)
    loads = exchange.bucket_loads(bucketed, owners, plan, world_size)
    # every rank's share, summed; less the momentum update's memory traffic that a DDP rank spends
    # on every matrix and an FSDP rank on its shard only (1 / world_size of it), and less the finite
    # check of the replicated gradients, which sharded ones skip
    compute = sum(estimate(r)["compute"] - (1 - 1 / world_size) * momentum_memory(r) - nonfinite_check_seconds(r)
                  for r in ranks)
    per_bucket = [compute * max(load) / sum(sum(load) for load in loads) for load in loads]
    # what the step waits on: each bucket's most loaded owner, summed, over the mean load
    step_balance = sum(max(load) for load in loads) * world_size / sum(sum(load) for load in loads)
    fsdp_compute = sum(per_bucket)
    # a steady step: G in the plan's wire dtype out, W and Lambda back (exchange.py), inside the
    # shard group: a replica group carries the pieces its replica owns, 1/R of them
    options = exchange.ExchangeOptions.from_kwargs(**targs.exchange_options)
    wire = options.grad_dtype("cuda").itemsize  # as on the H200 the estimate is for
    assignment = dict(targs.assignment)
    received = per_step(targs.n_layer, targs.n_embd, assignment, shard_ranks, wire,
                        options.resident)["manifold_muon"] / replicas
    back = per_step(targs.n_layer, targs.n_embd, assignment, shard_ranks, 0, True)["manifold_muon"] / replicas
    out = received - back
    # HSDP's back (b): the replica all-gather of this shard's new W and warm starts (fp32), a ring
    # over the R replicas: (R - 1) / R of them
    matrices, duals = matrix_elements(targs)
    replica = (replicas - 1) / replicas * 4 * (matrices + duals) / shard_ranks
    received += replica
    back += replica
    # each bucket's bytes in proportion to its elements (its pieces' W; warm starts taken alike)
    sizes = [sum(exchange.piece_numel(piece) for _, pieces in bucket for piece in pieces) for bucket in bucketed]
    share = [size / sum(sizes) for size in sizes]
    # the links: NVLink inside a node, one InfiniBand NIC per GPU between nodes (link_rate); the
    # shard group's exchange crosses nodes only where it spans more than one, the replica
    # all-gather wherever the job does (a shard group is a node, or inside one)
    shard_rate, replica_rate = link_rate(shard_ranks), link_rate(world_size)
    fsdp_seconds, transfer = exchange_timeline(per_bucket, share, out, back - replica, replica,
                                               shard_rate, replica_rate)
    # the same with every byte at NVLink's rate on one link (the figure before the two links)
    one_link, _ = exchange_timeline(per_bucket, share, out, back, 0.0, H200["link_bytes_per_s"], None)
    serial = fsdp_compute + transfer
    line = {"bucket_balance": balance, "step_balance": step_balance, "buckets": len(bucketed),
            "bytes_per_rank": received,
            "shard_ranks": shard_ranks, "replicas": replicas, "compute_seconds": fsdp_compute,
            "transfer_seconds": transfer, "optimizer_seconds": fsdp_seconds, "ratio": fsdp_seconds / fb["seconds"],
            "serial_ratio": serial / fb["seconds"], "ddp_ratio": ddp_seconds / fb["seconds"],
            "one_link_ratio": one_link / fb["seconds"]}
    links = (f" (the replica all-gather at {replica_rate / 1e9:.0f} GB/s on a link of its own, after each bucket's "
             f"return)" if replicas > 1 else "")
    mesh = (f", HSDP {replicas} replicas x {shard_ranks} shards, each matrix solved once per job, replica "
            f"all-gather {replica / 1e9:.2f} GB of it" if replicas > 1 else "")
    print(f"\nworld size {world_size}, --fsdp ({len(bucketed)} exchange buckets{mesh}; the buckets' most loaded owners "
          f"summed {step_balance:.3f} of the mean load; ESTIMATE: the counted ranks' "
          f"compute summed and spread over the buckets as their owners carry it; the exchange's bytes at "
          f"{shard_rate / 1e9:.0f} GB/s{links}, each bucket's in proportion to its elements, out and back async and "
          f"double-buffered, {1e3 * transfer:.2f} ms in all; serial, no overlap: "
          f"{serial / fb['seconds']:.3f}; DDP at this world size: {line['ddp_ratio']:.3f} ({1e3 * ddp_seconds:.2f} ms))")
    nvlink = ("" if one_link == fsdp_seconds else
              f"; every byte on one NVLink: {line['one_link_ratio']:.3f} ({1e3 * one_link:.2f} ms)")
    print(f"sharded: bucket balance {balance:.3f}, bytes per rank {received / 1e9:.2f} GB, "
          f"optimizer {line['ratio']:.3f} of a step's forward+backward ({1e3 * fsdp_seconds:.2f} ms){nvlink}")
    return line


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    commit, dirty = git_commit()
    out = Results(args.out, config={k: v for k, v in vars(args).items()}, constants=H200,
                  linalg_assumption=LINALG_NOTE, memory_assumption=MEMORY_NOTE, overlap_assumption=OVERLAP_NOTE, commit=commit, uncommitted_changes=dirty)
    trainer_args(args)  # a bad --solver-opt is a UserError before anything is built
    print(f"ManifoldMuon step, {args.assign}, {args.n_layer} layers x n_embd {args.n_embd}, solver options "
          f"{' '.join(GPU_SOLVER_OPTS + tuple(args.solver_opt))}, solver precision {args.solver_precision}"
          f"{', exchange options ' + ' '.join(args.exchange_opt) if args.exchange_opt else ''}"
          f"{', TF32 labels' if args.tf32 else ''}"
          f"{f', exchange buckets of {args.exchange_bucket} elements (what if)' if args.exchange_bucket else ''}; code at {commit}{' + uncommitted changes' if dirty else ''}",
          flush=True)
    with tf32_labels(args.tf32), exchange_bucket(args.exchange_bucket):
        return count_and_report(args, out)


@contextlib.contextmanager
def exchange_bucket(elements):
    """manifolds.exchange.EXCHANGE_BUCKET set to `elements` for the count (None: as it is)."""
    from manifolds import exchange
    saved = exchange.EXCHANGE_BUCKET
    if elements is not None:
        exchange.EXCHANGE_BUCKET = elements
    try:
        yield
    finally:
        exchange.EXCHANGE_BUCKET = saved


@contextlib.contextmanager
def tf32_labels(enabled):
    """The CUDA fp32 matmul precision the labels read (op_count.tf32_allowed), set for the count."""
    matmul = torch.backends.cuda.matmul
    if not enabled:
        yield
        return
    if hasattr(matmul, "fp32_precision"):
        saved, matmul.fp32_precision = matmul.fp32_precision, "tf32"
    else:
        saved, matmul.allow_tf32 = matmul.allow_tf32, True
    try:
        yield
    finally:
        if hasattr(matmul, "fp32_precision"):
            matmul.fp32_precision = saved
        else:
            matmul.allow_tf32 = saved


def count_and_report(args, out):
    mode = "real"
    t0 = time.perf_counter()
    if args.fake:
        try:
            counts, owners, (matmul_params, shapes), plan, sharded, banks = count_all(args, fake=True)
            mode = "fake"
        except FAKE_ERRORS:
            note = "needs a real run: the step reads device values on the host"
            if args.fake_only:
                out.put("fake", value=f"{note} (at least 1 sync)")
                print(f"--fake-only: {note} (at least 1 sync); nothing counted", file=sys.stderr)
                return 3
            print(f"--fake: {note}; counting a real run", flush=True)
            counts, owners, (matmul_params, shapes), plan, sharded, banks = count_all(args, fake=False)
            syncs = counts[args.world_size[0]][0]["host_syncs"]
            out.put("fake", value=f"{note} ({syncs} syncs)")
            print(f"  ({syncs} syncs in the counted step)")
    else:
        counts, owners, (matmul_params, shapes), plan, sharded, banks = count_all(args, fake=False)
    out.put("mode", value=mode)
    out.put("solver", value=plan.as_dict())
    out.put("seconds", value=time.perf_counter() - t0)
    out.put("matmul_params", value=matmul_params)
    print(f"counted under {'FakeTensorMode' if mode == 'fake' else 'real CPU arithmetic'} in "
          f"{time.perf_counter() - t0:.1f} s; {plan.summary()}")
    print("constants (one H200, for the ESTIMATE): bf16 395 TFLOP/s (half of 790 measured on a large product), "
          "TF32 198, 3xTF32 66, IEEE fp32 50; 5 us per launch, 20 us per host sync or tensor literal; "
          "products, launches, memory, syncs and linalg added; "
          f"{MEMORY_NOTE}; {OVERLAP_NOTE}; "
          f"{LINALG_NOTE}; fwd+bwd 6 N T + 12 L d s T FLOPs at 395 TFLOP/s (N = {matmul_params:,})")
    for world_size, ranks in counts.items():
        fb = fwd_bwd(args, matmul_params, world_size)
        muon = field_muon(shapes, world_size)
        print_world(world_size, ranks, owners[world_size], fb, muon)
        slowest = max(range(world_size), key=lambda r: estimate(ranks[r], world_size)["total"])
        out.put("world_size", str(world_size), value={
            "ranks": ranks, "owned_pieces": owners[world_size],
            "estimate_per_rank": [estimate(r, world_size) for r in ranks],
            "estimate_slowest_rank": slowest, "fwd_bwd": fb,
            "ratio_estimate": estimate(ranks[slowest], world_size)["total"] / fb["seconds"],
            "field_muon": muon,
            "ratio_flops_to_field_muon": sum(r["flops_total"] for r in ranks) / muon["flops"],
            "ratio_estimate_to_field_muon": estimate(ranks[slowest], world_size)["total"] / muon["seconds"],
            "flops_total_all_ranks": sum(r["flops_total"] for r in ranks)})
    first = counts[args.world_size[0]][0]
    print(f"\ntop {args.top} kernels (world size {args.world_size[0]}, rank 0; views and allocations excluded): "
          + ", ".join(f"{name} {n}" for name, n in first["kernels_top"].items()))
    print(f"Triton launches: {first['triton_launches']} (+{first['triton_extra_kernels']} torch sums of "
          f"||.||^2 slots); products: {first['products']}")
    print(f"linalg: {first['linalg'] or 'none'}; host syncs by op: {first['host_syncs_by_op'] or 'none'}; "
          f"linalg ops that check info on the host (a sync on CUDA): {first['linalg_syncing_on_cuda']}")
    if first["host_syncs_by_site"]:
        print("host syncs by call site: " + ", ".join(f"{site} x{n}" for site, n in first["host_syncs_by_site"].items()))
    print("FLOPs by call site (dense, as the torch twin computes them):")
    for site, flops in first["flops_by_site"].items():
        print(f"  {gf(flops):>9} GFLOP  {site}")
    print(f"launches by call site ({first['launches']} in all; a Triton product counts at its caller):")
    for site, n in list(first["launches_by_site"].items())[:args.top]:
        print(f"  {n:>5}  {site}")
    if banks is not None:
        out.put("bank_launches", value=banks)
        print(f"launches one piece of a bank adds to rank 0's step of {banks['world_size']} (DDP's buckets, every other "
              f"piece on ranks 1 to {banks['world_size'] - 1}; owning none: {banks['none']}):")
        for index, bucket in enumerate(banks["buckets"]):
            line = ", ".join(f"{name} {n}" for name, n in bucket["banks"].items())
            if bucket["together"] is not None:
                shared = sum(bucket["banks"].values()) - bucket["together"]
                line += (f"; one of each, in one solver call: {bucket['together']} (the call's own launches, paid "
                         f"once: {shared / (len(bucket['banks']) - 1):.0f})")
            print(f"  bucket {index + 1}: {line}")
    if args.fsdp:  # last: each ends with its `sharded:` line
        for world_size, ranks in counts.items():
            if world_size > 1:
                line = sharded_line(args, world_size, sharded[world_size], fwd_bwd(args, matmul_params, world_size),
                                    plan, ddp_seconds=max(estimate(r, world_size)["total"] for r in ranks))
                out.put("sharded", str(world_size), value=line)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
