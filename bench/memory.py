"""Bytes per rank of parameters, gradients and optimizer state: DDP against --fsdp.

    python -m bench.memory                      # the four presets at 1, 2, 4 and 8 ranks (counted)
    python -m bench.memory --live               # + 2 gloo ranks on CPU: one real step of each, measured
    python -m bench.memory --live --model gpt2 --n-layer 2 --live-only   # a quicker live check
    python -m bench.memory --live-only --live-layout fsdp --model gpt2-large --live-timeout 1800
                                                # the meta-device build at scale (a slow CPU step)

COUNTED from the tensors of the trainer's own model and optimizer groups built on the meta device
(no memory allocated): each parameter's fp32 master weight and gradient, AdamW's two moments, and
ManifoldMuon's momentum and dual warm starts, on the rank that holds them (under --fsdp also the
resident copies of the whole W and warm start of each piece a rank owns, manifolds/exchange.py):
  * DDP: every rank holds every parameter and gradient (and DDP's gradient buckets, as many bytes
    again), AdamW's state of every parameter, and ManifoldMuon's state of every matrix (momentum
    and warm start: the whole state on every rank); in flight, the step's flat all-gather of the
    new weights and warm starts.
  * --fsdp: rank r holds rows chunk r of every parameter (torch.chunk's split, as FSDP2), of its
    gradient and of every optimizer state (manifolds/sharded.py); in flight (an ESTIMATE of the
    transients): two blocks' gathered parameters (the one computing and the one prefetched, bf16 as
    on a GPU) and one block's unsharded fp32 gradients, and the optimizer exchange of the largest
    bucket (exchange.EXCHANGE_BUCKET) at its most loaded owner: what it receives, the assembled whole
    matrices, what it sends and receives back, and the next bucket's out exchange and the previous
    bucket's return in flight
    (exchange_held; a one-step --live run measures the same buffers: equal). With gradient accumulation (the
    trainer's total batch of 64 sequences, 8 per rank: 8 micro-steps on 1 rank, 1 on 8) and
    --fsdp-grad-sync last, the whole model's unsharded fp32 gradients wait on every rank for the
    last micro-step: the "accumulation" column (every, the default: 0, the shards accumulate).
Activations are not counted (they depend on the micro-batch, not on sharding). The largest rank is
reported. --live trains one step of a preset on 2 gloo ranks, DDP and --fsdp, and sums the bytes of
the live tensors each rank holds (local shards under --fsdp) per category, beside the count for
that rank: they must agree; and how far the rank's peak resident memory grew while the trainer
built the model, which under --fsdp (built on the meta device, training/meta_init.py) must stay
within the rank's own parameters plus one block's whole parameters. The last line: FSDP's bytes per rank over DDP's, GPT-2 XL at 8 ranks.
"""
import argparse
import datetime
import gc
import multiprocessing
import os
import resource
import sys
import tempfile
import time

import torch

import train_gpt2
from manifolds import ManifoldMuon
from manifolds.param_groups import assigned_matrices, muon_groups
from manifolds import exchange
from manifolds.sharded import chunk_range, keeps_warm_start, warm_shape, wire_bytes

CATEGORIES = ("parameters", "gradients", "adamw", "manifold_muon")
LIVE_TIMEOUT_S = 300  # --live: a rank's collectives, and the whole launch twice that
RANKS = (1, 2, 4, 8)
FP32, BF16 = 4, 2


def trainer_args(model, *flags):
    args = train_gpt2.parse_args(["--model", model, "--device", "cpu", *flags])
    train_gpt2.validate_args(args, world_size=1)
    return args


def meta_model(args):
    """The trainer's GPT and ManifoldMuon groups on the meta device (nothing allocated, nothing projected)."""
    with torch.device("meta"):
        model = train_gpt2.GPT(train_gpt2.GPTConfig(args.n_layer, args.n_head, args.n_embd, args.seq_len,
                                                    args.vocab_size))
    groups = muon_groups(assigned_matrices(model, train_gpt2.layer_assignments(args, None)), args.dgram_cap)
    return model, groups


def local_numel(p, world, rank, sharded):
    if not sharded:
        return p.numel()
    lo, hi = chunk_range(p.size(0), world, rank)
    return (hi - lo) * (p.numel() // max(p.size(0), 1))


def count(args, world, fsdp):
    """{category: bytes} of the most loaded rank, with DDP's gradient buckets and "in_flight"."""
    worst = max((counted_rank(args, world, rank, fsdp) for rank in range(world)), key=lambda h: sum(h.values()))
    model, groups = meta_model(args)
    muon = ManifoldMuon(groups, shard=False, exchange_grad="bf16")  # G on the wire as a GPU sends it
    muon.world_size = world
    # DDP's reducer keeps its own copy of every gradient in its buckets
    worst["grad_buckets"] = 0 if fsdp or world == 1 else worst["gradients"]
    # --fsdp --fsdp-grad-sync last with accumulation: the unsharded fp32 gradients of the whole
    # model wait on every rank for the last micro-step (every: the shards accumulate in place)
    accumulating = fsdp and train_gpt2.grad_accum_steps(args, world) > 1 and args.fsdp_grad_sync == "last"
    worst["accumulation"] = FP32 * sum(p.numel() for p in dict.fromkeys(model.parameters())) if accumulating else 0
    worst["in_flight"] = in_flight(model, muon, world, fsdp)
    return worst


def in_flight(model, muon, world, fsdp):
    """ESTIMATE of the transients (module docstring)."""
    if not fsdp:  # the all-gather of the new weights: every rank's padded share, fp32
        return muon.all_gather_elements() * FP32 if world > 1 else 0
    block = sum(p.numel() for p in model.blocks[0].parameters())
    exchange = max(exchange_held(muon, world, rank) for rank in range(world))
    return 2 * block * BF16 + block * FP32 + exchange


def exchange_held(muon, world, rank, warm=True, resident=False):
    """The most bytes of the sharded exchange's buffers that `rank` holds at once (what
    manifolds/exchange.py measures as exchange_counts["held"]), from the shapes: for a bucket,
    what its owner received and the pieces assembled from it, or those pieces and what it sends
    and receives back, whichever is more, and,
    with overlap, the next bucket's out exchange and the previous bucket's return in flight (sent
    and received). The worst step by default: warm starts travel, nothing resident (the step after
    a resume)."""
    grad = muon.exchange.grad_dtype.itemsize
    bucketed = exchange.buckets(list(muon.banks()), world)
    owners = exchange.bucket_owners(bucketed, muon.plan, world)

    def parts(piece, s, out):
        """(bytes of rank s's part of piece out to its owner, or back from it)."""
        lo, hi = chunk_range(piece.param.size(0), world, s)
        box = max(0, min(hi, piece.hi) - max(lo, piece.lo)) * piece.param.size(1)
        keeps = keeps_warm_start(piece, muon.options)
        q = warm_shape(piece)[0]
        dual = (lambda r: r[1] - r[0])(chunk_range(q, world, s)) * q if keeps else 0
        if not out:
            return FP32 * (box + dual)
        sent_again = not resident
        return (wire_bytes(box, torch.float32) if sent_again else 0) + wire_bytes(
            box, muon.exchange.grad_dtype) + (FP32 * dual if warm and keeps and sent_again else 0)

    def out_received(bucket):
        return sum(parts(piece, s, True) for _, pieces in bucket for piece in pieces
                   if owners[piece.key] == rank for s in range(world))

    def out_sent(bucket):
        return sum(parts(piece, rank, True) for _, pieces in bucket for piece in pieces)

    held, returning = 0, 0
    for index, bucket in enumerate(bucketed):
        mine = [piece for _, pieces in bucket for piece in pieces if owners[piece.key] == rank]
        numel = lambda piece: (piece.hi - piece.lo) * piece.param.size(1)  # noqa: E731
        dual = lambda piece: warm_shape(piece)[0] ** 2 if keeps_warm_start(piece, muon.options) else 0  # noqa: E731
        assembled = sum(FP32 * numel(piece) * (1 if resident else 2) + (FP32 * dual(piece) if warm and not resident
                                                                         else 0) for piece in mine)
        back_sent = sum(FP32 * (numel(piece) + dual(piece)) for piece in mine)
        back_received = sum(parts(piece, rank, False) for _, pieces in bucket for piece in pieces)
        # the received bytes are freed once assembled (exchange.ShardedBucket.solve_and_return)
        total = max(out_received(bucket) + assembled, assembled + back_sent + back_received)
        if muon.exchange.options.overlap:  # the previous bucket's return, the next one's out exchange
            total += returning
            if index + 1 < len(bucketed):
                total += out_sent(bucketed[index + 1]) + out_received(bucketed[index + 1])
            returning = back_sent + back_received
        held = max(held, total)
    return held


def report(presets, ranks, *flags):
    print("COUNTED on the meta device (in flight: an ESTIMATE); MiB per rank, the most loaded rank")
    print(f"{'model':12} {'ranks':>5} {'layout':6} "
          + " ".join(f"{c:>14}" for c in CATEGORIES + ("grad_buckets", "accumulation"))
          + f" {'persistent':>11} {'in flight':>10} {'total':>9}")
    totals = {}
    for preset in presets:
        args = trainer_args(preset, *flags)
        for world in ranks:
            for fsdp in (False, True):
                held = count(args, world, fsdp)
                persistent = sum(held[c] for c in CATEGORIES) + held["grad_buckets"] + held["accumulation"]
                totals[preset, world, fsdp] = persistent + held["in_flight"]
                print(f"{preset:12} {world:5d} {'fsdp' if fsdp else 'ddp':6} "
                      + " ".join(f"{held[c] / 2**20:14.1f}" for c in CATEGORIES + ("grad_buckets", "accumulation"))
                      + f" {persistent / 2**20:11.1f} {held['in_flight'] / 2**20:10.1f}"
                      + f" {totals[preset, world, fsdp] / 2**20:9.1f}")
    return totals


# --- live: one real step on 2 gloo ranks --------------------------------------------------------

def local_tensor(t):
    return t.to_local() if hasattr(t, "to_local") else t


def live_bytes(model, muon, adamw):
    """{category: bytes} of the tensors this rank holds (the local parts of DTensors)."""
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    size = lambda t: local(t).numel() * local(t).element_size()  # noqa: E731
    params = list(dict.fromkeys(model.parameters()))
    held = {"parameters": sum(size(p) for p in params),
            "gradients": sum(size(p.grad) for p in params if p.grad is not None),
            "adamw": sum(size(v) for state in adamw.state.values() for k, v in state.items()
                         if k in ("exp_avg", "exp_avg_sq")),
            "manifold_muon": sum(size(v) for state in muon.state.values() for k, v in state.items()
                                 if k == "momentum_buffer" or k.startswith("dual"))
            + sum(size(t) for copies in muon.exchange.resident_cache.values() for t in copies if t is not None),
            # not a category: the sharded exchange's buffers at their most (exchange_held counts them)
            "exchange_held": muon.exchange_counts.get("held", 0)}
    return held


def live_rank(rank, world, store, out, flags, fsdp, timeout_s=LIVE_TIMEOUT_S):
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed import fsdp as _  # noqa: F401  (before the process group: train_gpt2.init_distributed says why)
    # a collective that waits longer than this fails (gloo's default is 30 minutes)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        args = train_gpt2.parse_args(["--device", "cpu", *flags, *(["--fsdp"] if fsdp else [])])
        train_gpt2.validate_args(args, world_size=world)
        # a tiny model first: the first build loads and initialises torch's DTensor and FSDP2
        # machinery (~100-130 MiB of this process's memory, whatever the model), which is not the
        # model's memory
        tiny = argparse.Namespace(**{**vars(args), "n_layer": 1, "n_head": 2, "n_embd": 32, "vocab_size": 64})
        train_gpt2.build_model(tiny, torch.device("cpu"), "float32")
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        model = train_gpt2.build_model(args, torch.device("cpu"), "float32")
        build = {"grown": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before,
                 "shards": sum(FP32 * local_tensor(p).numel() for p in dict.fromkeys(model.parameters())),
                 "block": sum(FP32 * p.numel() for p in model.blocks[0].parameters())}
        muon, adamw = train_gpt2.build_optimizers(model, args, torch.device("cpu"))
        step_model = model if fsdp else torch.nn.parallel.DistributedDataParallel(model)
        tokens = torch.randint(0, args.vocab_size, (1, args.seq_len + 1), generator=torch.Generator().manual_seed(rank))
        step_model(tokens[:, :-1], tokens[:, 1:]).backward()
        adamw.step()
        muon.step()  # gradients kept: counted as held during the step
        torch.save({**live_bytes(model, muon, adamw), "build": build}, out)
    finally:
        # FSDP2's modules and collectives sit in reference cycles: freed while the group can still
        # finish them, not at interpreter shutdown (train_gpt2.main does the same)
        gc.collect()
        dist.destroy_process_group()


def live(flags, world=2, layouts=(False, True), timeout_s=LIVE_TIMEOUT_S):
    """{(fsdp, rank): live bytes} of one real step of each layout (fsdp False, True) on `world`
    gloo ranks; a collective waits at most timeout_s, the launch twice that."""
    measured = {}
    with tempfile.TemporaryDirectory() as tmp:
        for fsdp in layouts:
            # spawn, not fork: a process forked from one that runs threads (pytest-xdist's, torch's
            # pools) can start with a lock another thread held, and hang before its first line (5 of
            # about 12 full runs of tests/test_bench.py did); a spawned rank starts a fresh interpreter
            context = multiprocessing.get_context("spawn")
            procs = [context.Process(target=live_rank, args=(r, world, os.path.join(tmp, f"store{fsdp}"),
                                                             os.path.join(tmp, f"{fsdp}{r}.pt"), flags, fsdp,
                                                             timeout_s))
                     for r in range(world)]
            for p in procs:
                p.start()
            # a rank that dies leaves the others waiting in a collective: stop them all at once
            deadline = time.monotonic() + 2 * timeout_s
            while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
                time.sleep(0.2)
            for p in procs:
                if p.is_alive():
                    p.terminate()
                p.join()
            if any(p.exitcode != 0 for p in procs):
                codes = [p.exitcode for p in procs]
                raise SystemExit(f"error: a live rank failed ({'--fsdp' if fsdp else 'DDP'}; exit codes {codes})")
            for r in range(world):
                measured[fsdp, r] = torch.load(os.path.join(tmp, f"{fsdp}{r}.pt"))
    return measured


def first_step_exchange(args, world, rank):
    """exchange_held of the first step of a run (no warm start travels, nothing resident), as the
    live step measures it."""
    _, groups = meta_model(args)
    return exchange_held(ManifoldMuon(groups, shard=False), world, rank, warm=False)


def counted_rank(args, world, rank, fsdp):
    """{category: bytes} that rank `rank` of `world` holds, counted on the meta device."""
    model, groups = meta_model(args)
    muon = ManifoldMuon(groups, shard=False)
    muon.world_size, muon.rank = world, rank
    muon_params = {id(p) for g in groups for p in g["params"]}
    held = {c: 0 for c in CATEGORIES}
    for p in dict.fromkeys(model.parameters()):
        n = local_numel(p, world, rank, fsdp)
        held["parameters"] += FP32 * n
        held["gradients"] += FP32 * n  # the tensors .grad (DDP's buckets: count())
        if id(p) not in muon_params:
            held["adamw"] += 2 * FP32 * n
    owned = list(muon.pieces())  # DDP: every rank holds every matrix's state (manifolds/optimizer.py)
    for p in dict.fromkeys(piece.param for piece in owned):
        held["manifold_muon"] += FP32 * local_numel(p, world, rank, fsdp)
    for piece in owned:
        if keeps_warm_start(piece, muon.options):
            q = warm_shape(piece)[0]
            lo, hi = chunk_range(q, world, rank) if fsdp else (0, q)
            held["manifold_muon"] += FP32 * (hi - lo) * q
    if fsdp and muon.exchange.options.resident:  # the owner's resident W and Lambda (exchange.py)
        held["manifold_muon"] += FP32 * sum(resident_numel(piece, muon.options) for piece in owned_shards(muon, world, rank))
    return held


def owned_shards(muon, world, rank):
    """The pieces `rank` owns in the sharded step (exchange.bucket_group's owners)."""
    bucketed = exchange.buckets(list(muon.banks()), world)
    owners = exchange.bucket_owners(bucketed, muon.plan, world)
    return [piece for _, pieces in muon.banks() for piece in pieces if owners[piece.key] == rank]


def resident_numel(piece, options):
    """Elements of a piece's resident copies at its owner: its whole W, and its warm start."""
    return (piece.hi - piece.lo) * piece.param.size(1) + (warm_shape(piece)[0] ** 2
                                                            if keeps_warm_start(piece, options) else 0)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--live", action="store_true", help="also measure one real step on 2 gloo ranks (CPU)")
    parser.add_argument("--live-only", action="store_true", help="only the live check (no table of presets)")
    parser.add_argument("--live-layout", choices=("both", "ddp", "fsdp"), default="both",
                        help="the live check's layouts (fsdp alone: a model whose whole training state per rank "
                             "would not fit this machine twice)")
    parser.add_argument("--live-timeout", type=int, default=LIVE_TIMEOUT_S,
                        help="seconds a live rank's collective may wait (the launch: twice that); a larger preset's "
                             "step on CPU takes longer than the default")
    parser.add_argument("--model", default="gpt2", choices=train_gpt2.MODEL_PRESETS, help="the live check's preset")
    parser.add_argument("--n-layer", type=int, default=None, help="the live check's blocks (default: the preset's)")
    parser.add_argument("--seq-len", type=int, default=64, help="the live check's sequence length")
    parser.add_argument("--fsdp-grad-sync", choices=("every", "last"), default="every",
                        help="the table's --fsdp runs: the trainer's flag (last: with accumulation, the whole "
                             "model's unsharded gradients wait for the last micro-step: the accumulation column)")
    args = parser.parse_args(argv)
    totals = {} if args.live_only else report(list(train_gpt2.MODEL_PRESETS), RANKS,
                                               "--fsdp-grad-sync", args.fsdp_grad_sync)
    agree = True
    if args.live or args.live_only:
        flags = ["--model", args.model, "--seq-len", str(args.seq_len), "--total-batch-size", "2", "--batch-size", "1"]
        if args.n_layer:
            flags += ["--n-layer", str(args.n_layer)]
        trainer = train_gpt2.parse_args(["--device", "cpu", *flags])
        train_gpt2.validate_args(trainer, world_size=2)
        shown = ["--model", args.model] + (["--n-layer", str(args.n_layer)] if args.n_layer else [])
        print(f"LIVE, 2 gloo ranks, one step of {' '.join(shown)}: bytes held, measured / counted")
        layouts = {"both": (False, True), "ddp": (False,), "fsdp": (True,)}[args.live_layout]
        for (fsdp, rank), held in sorted(live(flags, layouts=layouts, timeout_s=args.live_timeout).items()):
            expected = counted_rank(trainer, 2, rank, fsdp)
            expected["exchange_held"] = first_step_exchange(trainer, 2, rank) if fsdp else 0
            shown = CATEGORIES + (("exchange_held",) if fsdp else ())
            same = all(held[c] == expected[c] for c in shown)
            agree &= same
            print(f"  {'fsdp' if fsdp else 'ddp ':4} rank {rank}: " + ", ".join(
                f"{c} {held[c]:,} / {expected[c]:,}" for c in shown) + ("" if same else "  MISMATCH"))
            build = held["build"]  # the peak resident bytes' growth while the model was built
            within = build["grown"] <= build["shards"] + build["block"]
            agree &= within or not fsdp
            print(f"    building the model: peak memory grew {build['grown'] / 2**20:,.1f} MiB; its parameters on "
                  f"this rank {build['shards'] / 2**20:,.1f} MiB + one block whole {build['block'] / 2**20:,.1f} MiB"
                  + ("" if within or not fsdp else "  EXCEEDED (the whole model was built?)"))
        print(f"live measurement {'agrees with' if agree else 'DIFFERS from'} the count")
    if totals:
        ratio = totals["gpt2-xl", 8, True] / totals["gpt2-xl", 8, False]
        print(f"gpt2-xl at 8 ranks: --fsdp holds {ratio:.3f} of DDP's bytes per rank (1/{1 / ratio:.1f})")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
