"""manifolds/exchange.py on gloo ranks, at the optimizer's level (matrices and gradients made by
hand, the same on every rank, as after DDP's all-reduce or FSDP2's reduce-scatter): one launch
each of 2, 3 and 4 ranks, every bank cut into buckets of one piece per owner
(exchange.EXCHANGE_BUCKET = 1).

  * overlap on and off (ExchangeOptions.overlap): bitwise equal weights, momenta, warm starts and
    statistics on every rank, replicated (DDP) and sharded (FSDP2, Shard(0) on a 1-D mesh), on
    2 and 3 ranks, and HSDP 2 x 2; with overlap, a bucket's return is still in flight while the
    next bucket solves (the order of posts, waits and solves is traced);
  * HSDP 2 x 2 on 4 ranks ((Replicate, Shard(0)) on a 2-D mesh): every matrix solved once per job
    (the pieces solved, summed over the 4 ranks, are the pieces: each replica group solved all of
    them before), the replicas' shards bitwise equal, and the weights those of one process.
"""
import os

import pytest
import torch
import torch.distributed as dist

from gloo_ranks import end_rank_process, run_ranks
from manifolds import ManifoldMuon, exchange

STEPS = 3
# (rows, cols, manifold or blocks) of the matrices: tall and wide Stiefel (one bank across
# orientations: 16 x 8 and 8 x 16), square dgram, plain Muon, oblique, and q | k | v blocks
MATRICES = [(16, 8, "stiefel")] * 3 + [(8, 16, "stiefel")] + [(8, 8, "dgram")] * 3 + [(12, 8, "none")] * 2 + \
    [(8, 12, "oblique")] + [(24, 8, ((0, 8, "stiefel"), (8, 16, "oblique"), (16, 24, "dgram")))] * 2


def matrices():
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(rows, cols, generator=generator) / 4 for rows, cols, _ in MATRICES]


def gradients(step):
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(rows, cols, generator=generator) for rows, cols, _ in MATRICES]


def groups(params):
    out = []
    for p, (_, _, spec) in zip(params, MATRICES):
        out.append({"params": [p], **({"blocks": list(spec)} if isinstance(spec, tuple) else {"manifold": spec})})
    return out


def whole(x):
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def train(layout, overlap, mesh=None, trace=None):
    """{"weights", "state", "stats", "solved", "local"} after STEPS steps of the matrices under
    `layout` ("one", "ddp", "fsdp" or "hsdp"; mesh for the last two); trace: a list that gets the
    exchange's posts, waits and solves in order."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    placements = {"fsdp": [Shard(0)], "hsdp": [Replicate(), Shard(0)]}.get(layout)
    params = [torch.nn.Parameter(distribute_tensor(w, mesh, placements) if placements else w) for w in matrices()]
    opt = ManifoldMuon(groups(params), lr=0.05, shard=layout != "one", overlap=overlap)
    if trace is not None:
        solve = opt._step_banks

        def traced(banks, inputs):
            trace.append(("solve", sum(len(pieces) for _, pieces in banks)))
            return solve(banks, inputs)
        opt._step_banks = traced
        finish = opt._finish_bank

        def traced_finish(pieces, W, solution):
            trace.append(("finish", len(pieces)))
            return finish(pieces, W, solution)
        opt._finish_bank = traced_finish
    solved = []
    for step in range(STEPS):
        for p, g in zip(params, gradients(step)):
            p.grad = distribute_tensor(g, mesh, placements) if placements else g
        opt.step()
        solved.append(opt.exchange_counts["solved"] if layout != "one" else None)
    state = {i: {key: whole(value).clone() for key, value in opt.state[p].items() if torch.is_tensor(value)}
             for i, p in enumerate(params)}
    return {"weights": [whole(p.detach()).clone() for p in params], "state": state, "stats": opt.stats(),
            "solved": solved, "local": [p.detach().to_local().clone() if placements else None for p in params],
            "counts": dict(opt.exchange_counts),
            "steady": exchange.steady_received_bytes(opt) if placements else None,
            "held estimate": held_estimate(opt) if layout == "fsdp" else None}


def held_estimate(opt):
    """bench/memory.py's estimate of the most bytes of exchange buffers a warm step holds."""
    from bench import memory
    return memory.exchange_held(opt, dist.get_world_size(), dist.get_rank())


class Traced:
    """exchange's collectives, recording each post and each wait in `trace`."""

    def __init__(self, trace):
        self.trace, self.count, self.saved = trace, 0, {}

    def handle(self, kind, handle):
        index, trace = self.count, self.trace
        self.count += 1
        trace.append(("post", kind, index))

        class Waited:
            def wait(self):
                trace.append(("wait", kind, index))
                return handle.wait()
        return Waited()

    def __enter__(self):
        all_to_all, gather = exchange.all_to_all, exchange.all_gather_rows

        def traced_all_to_all(*args, **kwargs):
            received, send, handle = all_to_all(*args, **kwargs)
            return received, send, self.handle("all_to_all", handle)

        def traced_gather(*args, async_op=False, **kwargs):
            if not async_op:
                return gather(*args, **kwargs)
            rows, handle = gather(*args, async_op=True, **kwargs)
            return rows, self.handle("all_gather", handle)
        self.saved = {"all_to_all": all_to_all, "all_gather_rows": gather}
        exchange.all_to_all, exchange.all_gather_rows = traced_all_to_all, traced_gather
        return self

    def __exit__(self, *exc):
        for name, value in self.saved.items():
            setattr(exchange, name, value)


def rank_main(rank, world, store, out_dir):
    torch.set_num_threads(1)
    from torch.distributed import tensor as _tensor  # noqa: F401  (before the group: see train_gpt2)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    try:
        exchange.EXCHANGE_BUCKET = 1  # every bank cut: one piece per owner and bucket
        exchange.replicated_buckets = exchange.buckets  # DDP's too (by default it cuts whole banks)
        results = {}
        meshes = {"ddp": None, "fsdp": init_device_mesh("cpu", (world,))}
        if world == 4:
            meshes = {"hsdp": init_device_mesh("cpu", (2, 2))}
        for layout, mesh in meshes.items():
            for overlap in (True, False):
                trace = []
                with Traced(trace):
                    results[layout, overlap] = train(layout, overlap, mesh, trace)
                results[layout, overlap]["trace"] = trace
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        end_rank_process()


def launch(world, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    run_ranks(rank_main, lambda rank: (rank, world, os.path.join(out_dir, "store"), out_dir), world, timeout=300)
    return [torch.load(os.path.join(out_dir, f"rank{rank}.pt")) for rank in range(world)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("exchange")
    return {world: launch(world, str(root / str(world))) for world in (2, 3, 4)}


@pytest.fixture(scope="module")
def alone():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train("one", True)
    finally:
        torch.set_num_threads(threads)


def equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"])) and a["state"].keys() == b[
        "state"].keys() and all(a["state"][i].keys() == b["state"][i].keys() and all(
            torch.equal(v, b["state"][i][k]) for k, v in a["state"][i].items()) for i in a["state"])


def largest_difference(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a["weights"], b["weights"]))


CASES = [(2, "ddp"), (2, "fsdp"), (3, "ddp"), (3, "fsdp"), (4, "hsdp")]


@pytest.mark.parametrize("world,layout", CASES)
def test_overlap_on_and_off_are_bitwise_equal_with_every_bank_cut(runs, alone, world, layout):
    for results in runs[world]:
        on, off = results[layout, True], results[layout, False]
        assert equal(on, off)  # weights, momenta, warm starts (and radii, steps)
        assert on["stats"] == off["stats"] and on["stats"].keys() == alone["stats"].keys()
        assert equal(on, runs[world][0][layout, True])  # every rank holds the same
        assert on["counts"]["collectives"] >= 3  # several buckets: something to overlap
    # the one process's solve, to within the rounding of batches of other sizes
    gap = largest_difference(runs[world][0][layout, True], alone)
    print(f"{layout} on {world} ranks: {gap:.1e} from one process")
    assert gap <= 1e-5


def returns_in_flight_while_solving(trace):
    """Whether a bucket's return (the collective posted right after its solve) is waited only
    after a later solve: in flight while the next bucket solves."""
    trace = [event for event in trace if event[0] != "finish"]
    waits = {event[1:]: i for i, event in enumerate(trace) if event[0] == "wait"}
    returns = [(i + 1, trace[i + 1][1:]) for i, event in enumerate(trace[:-1])
               if event[0] == "solve" and trace[i + 1][0] == "post"]
    return any(trace[j][0] == "solve" for posted, key in returns for j in range(posted, waits[key]))


@pytest.mark.parametrize("world,layout", CASES)
def test_with_overlap_a_buckets_return_travels_while_the_next_one_solves(runs, world, layout):
    for results in runs[world]:
        assert returns_in_flight_while_solving(results[layout, True]["trace"])
        assert not returns_in_flight_while_solving(results[layout, False]["trace"])


def gathers_between_finishes(trace):
    """All-gathers posted after one bank's answer was finished and before the next bank's of the
    same solve: a bank's gather travelling while the solve finishes (retracts) the next bank."""
    count, segment = 0, []
    for event in trace + [("solve",)]:
        if event[0] == "solve":  # a solve's events: its finishes and what was posted between them
            finishes = [i for i, e in enumerate(segment) if e[0] == "finish"]
            count += sum(1 for i, e in enumerate(segment) if e[:2] == ("post", "all_gather")
                         and finishes and finishes[0] < i < finishes[-1])
            segment = []
        else:
            segment.append(event)
    return count


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_posts_each_banks_gather_as_soon_as_its_answer_exists(runs, world):
    """DDP: a bucket of several banks is gathered bank by bank, each bank's gather posted as soon
    as the solve has finished it (the solve yields bank by bank), in flight while the next bank
    is retracted; not one gather of the bucket after its last bank (the last one left exposed)."""
    for results in runs[world]:
        assert gathers_between_finishes(results["ddp", True]["trace"]) > 0


@pytest.mark.parametrize("world,layout", [(2, "fsdp"), (3, "fsdp"), (4, "hsdp")])
def test_the_bytes_received_are_those_the_shapes_give(runs, world, layout):
    """exchange.steady_received_bytes (the trainer's comm_bytes_per_step): a warm step's bytes
    received, out, back and (HSDP) the replica all-gather, counted by the step itself."""
    for results in runs[world]:
        run = results[layout, True]
        assert run["counts"]["received"] == run["steady"] > 0


@pytest.mark.parametrize("world", [2, 3])
def test_the_buffers_held_are_those_bench_memory_estimates(runs, world):
    """counts["held"] (the most bytes of exchange buffers held at once in a warm step, the next
    bucket's out exchange and the previous bucket's return in flight with overlap) equals
    bench/memory.py's exchange_held from the shapes, overlap on and off."""
    for results in runs[world]:
        for overlap in (True, False):
            run = results["fsdp", overlap]
            assert run["counts"]["held"] == run["held estimate"] > 0, (overlap, run["counts"])


def test_hsdp_solves_each_matrix_once_per_job_with_bitwise_equal_replicas(runs, alone):
    ranks = runs[4]  # mesh (2, 2): rank = 2 r + s, replica r, shard s
    pieces = sum(len(spec) if isinstance(spec, tuple) else 1 for _, _, spec in MATRICES)
    for step in range(STEPS):
        assert sum(results["hsdp", True]["solved"][step] for results in ranks) == pieces
    for s in range(2):
        for a, b in zip(ranks[s]["hsdp", True]["local"], ranks[2 + s]["hsdp", True]["local"]):
            assert torch.equal(a, b)
    assert largest_difference(ranks[0]["hsdp", True], alone) <= 1e-5


def gpt2_banks(model):
    from bench.memory import meta_model, trainer_args
    _, groups = meta_model(trainer_args(model))
    return list(ManifoldMuon(groups, shard=False).banks())


@pytest.mark.parametrize("model,ranks,sizes", [("gpt2", 8, [[24], [12, 12]]), ("gpt2-xl", 8, [[96], [48], [48]]),
                                               ("gpt2", 3, [[12], [12], [24]][::-1])])
def test_ddp_buckets_are_whole_banks_few_and_the_largest_first(model, ranks, sizes):
    """DDP's buckets (exchange.bucket_group of a Replicated layout): whole banks, closed when their
    pieces are a multiple of the ranks, the largest first; not the sharded step's memory-bound cut
    (GPT-2 XL at 8 ranks: 16 buckets that repeat the solver's per-bank launches in each)."""
    from manifolds.plan import SolverOptions, plan_for
    banks = gpt2_banks(model)
    group = exchange.bucket_group(exchange.Replicated(ranks, 0), banks, plan_for(SolverOptions(), "cpu"))
    assert [[len(pieces) for _, pieces in bucket] for bucket in group.buckets] == sizes
    whole = {name: len(pieces) for name, pieces in banks}
    assert all(len(pieces) == whole[name] for bucket in group.buckets for name, pieces in bucket)
    numel = [sum(exchange.piece_numel(p) for _, pieces in bucket for p in pieces) for bucket in group.buckets]
    assert numel == sorted(numel, reverse=True)


def test_the_statistics_are_packed_in_few_launches_with_the_element_writes_values():
    """Exchange._pack_stats: one stack, one copy and one fill per distinct Python number (a fill
    and one write per value before), the same fp32 values as writing each (ints, fp32 and fp64
    tensors and Python numbers), -inf for a bank this rank did not solve."""
    from bench.op_count import OpCounter
    from manifolds.plan import SolverOptions, plan_for
    ex = exchange.Exchange(exchange.ExchangeOptions(), plan_for(SolverOptions(), "cpu"))
    ex.stats = {"a": {"iterations": torch.tensor(3), "residual": torch.tensor(1 / 3, dtype=torch.float64),
                      "fallbacks": 0},
                "c": {"iterations": 7, "residual": torch.tensor(0.1), "fallbacks": torch.tensor(2.0)}}
    names = ["a", "b", "c"]
    expected = torch.full((3, exchange.STATS), -float("inf"))
    for i, name in enumerate(names):
        for j, field in enumerate(exchange.STAT_FIELDS):
            if name in ex.stats:
                expected[i, j] = ex.stats[name][field]
    counter = OpCounter()
    with counter:
        packed = ex._pack_stats(names, "cpu")
    assert torch.equal(packed, expected)
    assert sum(counter.kernels.values()) <= 2 + 3, counter.kernels  # the numbers 0, 7 and -inf


def test_hsdp_buckets_balance_the_pieces_left_over_together():
    """exchange.buckets for GPT-2 XL over 64 owners (HSDP 8 x 8): the pieces left over after the
    runs (48 QKV, 48 projections, 32 MLP pieces: fewer than 64 per bank) form a bucket of their
    own, before the run of 64 MLP pieces, so that the step waits on its owners no longer than in
    one bucket (the sum over buckets of the most loaded owner's load); cut as runs then pieces in
    one sequence it waited 1.19 of that."""
    from manifolds.plan import SolverOptions, plan_for
    plan = plan_for(SolverOptions(precision="tf32", clip="polynomial", capturable=True), "cuda")
    banks = gpt2_banks("gpt2-xl")

    def waited(bucketed):
        loads = exchange.bucket_loads(bucketed, exchange.bucket_owners(bucketed, plan, 64), plan, 64)
        return sum(max(load) for load in loads)

    bucketed = exchange.buckets(banks, 64)
    assert [sorted(len(pieces) for _, pieces in bucket) for bucket in bucketed] == [[32, 48, 48], [64]]
    assert waited(bucketed) <= waited([banks]) * (1 + 1e-9)


def test_a_ddp_gather_packs_its_send_in_one_cat(monkeypatch):
    """Exchange._gather (one bank's all-gather): this rank's answers, the zeros up to the widest
    share and the statistics in one cat (with the copy of its own answers into its weights: 3
    launches with padding, 4 with the statistics' stack too); a zero buffer, the answers' cat
    copied into it and the statistics copied after took 4 and 6. The send holds the same fp32
    values, in that order."""
    from bench.op_count import OpCounter
    opt = ManifoldMuon([{"params": [torch.nn.Parameter(w) for w in matrices()[:3]], "manifold": "stiefel"}],
                       shard=False)
    (name, pieces), = opt.banks()
    group = exchange.bucket_group(exchange.Replicated(2, 0), [(name, pieces)], opt.plan)
    me = min((0, 1), key=lambda slot: sum(group.owners[p.key] == slot for p in pieces))
    group = exchange.bucket_group(exchange.Replicated(2, me), [(name, pieces)], opt.plan)  # the narrower share
    mine = [p for p in pieces if group.owners[p.key] == me]
    assert 0 < len(mine) < len(pieces) - len(mine)  # padded to the other's
    new_W = [torch.randn(p.weight().shape) for p in mine]
    states = torch.randn(len(mine), 8, 8)
    stats = {"iterations": torch.tensor(3), "residual": torch.tensor(0.5), "fallbacks": torch.tensor(0)}
    sends = []

    volume = (len(pieces) - len(mine)) * (16 * 8 + 8 * 8)  # the wider share's W and warm starts
    # made here: the count holds _gather's launches only
    received = {n: torch.zeros(2, n) for n in (volume, volume + exchange.STATS)}

    def gather(send, size, group=None, async_op=False):
        sends.append(send)
        return received[send.numel()], None
    monkeypatch.setattr(exchange, "all_gather_rows", gather)
    io = type("IO", (), {"store_warm": staticmethod(lambda pieces, states: None)})()
    ex = opt.exchange
    ex.counts = {"sent": 0, "received": 0, "collectives": 0, "solved": 0, "held": 0}
    for stats_names, bound in ((None, 3), ([name], 4)):
        ex.stats = {name: stats}
        counter = OpCounter()
        with counter, torch.no_grad():
            ex._gather(group, io, [(name, pieces)], [(mine, new_W, states, stats)], stats_names)
        assert sum(counter.kernels.values()) <= bound, counter.kernels
    answers = torch.cat([x for w, s in zip(new_W, states) for x in (w.reshape(-1), s.reshape(-1))])
    for send in sends:
        assert send.dtype == torch.float32 and torch.equal(send[:answers.numel()], answers)
    assert sends[0].numel() == volume
    assert not sends[0][answers.numel():].any()
    assert torch.equal(sends[1][:volume], sends[0])
    assert torch.equal(sends[1][volume:], ex._pack_stats([name], "cpu").reshape(-1))
