"""bench/op_count.py and bench/cost_model.py: counts that would be wrong if the counting were."""
import json

import pytest
import torch

import kernels
from bench import cost_model
from errors import UserError
from bench.op_count import OpCounter, product_precision, simulated_collectives, triton_attribution
from kernels import products_torch


@pytest.fixture(autouse=True)
def one_thread():
    # tiny products: a second thread only adds contention on a busy machine
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_product_flops_are_exact_and_views_are_free():
    a, b = torch.randn(3, 64, 32), torch.randn(3, 32, 16)
    with OpCounter() as counter:
        torch.bmm(a, b)
        a[0] @ b[0]                                  # mm
        torch.addmm(torch.randn(64, 16), a[0], b[0])  # randn is one kernel
        a.transpose(-2, -1).view(3, 32, 64).unsqueeze(0).expand(2, 3, 32, 64)
        torch.empty(5)
    expected = 2 * 3 * 64 * 32 * 16 + 2 * 2 * 64 * 32 * 16
    assert counter.flops == {product_precision(torch.float32, triton=False): expected}
    assert counter.products[("bmm", "ieee-fp32")] == 1
    assert dict(counter.kernels) == {"bmm": 1, "mm": 1, "addmm": 1, "randn": 1}
    assert counter.sync_count == 0


def test_kernel_products_are_one_triton_launch_each():
    B, X, C = torch.randn(2, 8, 4), torch.randn(2, 4, 6), torch.randn(2, 8, 6)
    original = products_torch.matmul_add
    with OpCounter() as counter, triton_attribution(counter):
        kernels.matmul_add(B, X, C, alpha=2.0, beta=0.5, backend="torch")  # product, 2 scalings, add
        kernels.symmetric_part(B, B, backend="torch")                     # symmetric_gram
        B.double() @ X.double()                                           # not a kernel product
    assert products_torch.matmul_add is original  # patched only inside
    assert dict(counter.triton) == {"matmul_add": 1, "symmetric_gram": 1}
    triton_label = product_precision(torch.float32, triton=True)
    assert triton_label.startswith("triton:")
    assert counter.flops[triton_label] == 2 * 2 * 8 * 4 * 6 + 2 * 2 * 4 * 8 * 4
    assert counter.flops["float64"] == 2 * 2 * 8 * 4 * 6
    # the ops inside the products are fused into their launches: only the casts and the
    # float64 bmm are kernels of their own
    assert dict(counter.kernels) == {"_to_copy": 2, "bmm": 1}
    assert counter.launches == 2 + 3
    # symmetric outputs: the Triton kernel computes the upper-triangle tiles (one 32-wide tile here)
    assert counter.triton_executed["symmetric_gram"] == 2 * 2 * 4 * 8 * 4


def test_host_syncs():
    x = torch.randn(4)
    with OpCounter() as counter:
        x.sum().item()
        bool((x > 0).any())
        y = x.new_tensor([1.0, 2.0])  # a literal: a blocking H2D copy on CUDA
        y * 2
    assert counter.sync_count == 2
    assert counter.literals["lift_fresh"] == 1


def test_simulated_all_gather_records_bytes_and_touches_nothing_else():
    import torch.distributed as dist
    send, out = torch.ones(10), torch.full((4, 10), 7.0)
    with OpCounter() as counter, simulated_collectives(counter):
        dist.all_gather_into_tensor(out, send, async_op=True).wait()
    assert counter.collectives == [("all_gather_into_tensor", 40)]
    assert counter.kernel_count == 0 and bool((out == 0).all())


def _run(tmp_path, name, *flags):
    path = tmp_path / f"{name}.json"
    status = cost_model.main(["--n-layer", "2", "--n-embd", "64", "--out", str(path), *flags])
    return status, json.loads(path.read_text())


def test_main_world_size_8_splits_the_work_exactly(tmp_path, capsys):
    # the default count is the GPU's plan: sync-free (fixed budgets, so a bank's work does not
    # depend on the split), hence countable under fake tensors
    status, data = _run(tmp_path, "split", "--world-size", "1", "8", "--fake-only")
    assert status == 0 and data["mode"] == "fake"
    assert data["solver"]["capturable"] and data["solver"]["clip"] == "polynomial"
    assert data["solver"]["precision"] == "tf32" and data["solver"]["backend"] == "torch"
    one, eight = data["world_size"]["1"]["ranks"], data["world_size"]["8"]["ranks"]
    assert len(one) == 1 and len(eight) == 8
    # the split loses and duplicates no work: every precision's FLOPs add up over the ranks
    for label, flops in one[0]["flops_by_precision"].items():
        assert sum(r["flops_by_precision"].get(label, 0) for r in eight) == flops
    assert sum(r["pieces"] for r in eight) == one[0]["pieces"] == 8  # 2 layers x 4 matrices
    # one flat all-gather per bank (each posted as the solve finishes its bank), the same padded
    # widths on every rank (fp32 elements * 4): 8 pieces on 8 ranks are one bucket of the 3 banks
    # (c_fc and mlp.c_proj on DGram, c_attn and attn.c_proj on Stiefel)
    assert one[0]["collectives"] == 0
    sent = {r["collective_bytes_sent"] for r in eight}
    assert len(sent) == 1 and sent.pop() % 4 == 0
    assert all(r["collectives"] == 3 for r in eight)
    estimate = data["world_size"]["8"]["estimate_per_rank"][0]
    assert estimate["total"] > 0 and data["world_size"]["1"]["ratio_estimate"] > 0
    assert "ESTIMATE" in capsys.readouterr().out


def test_fsdp_prints_the_sharded_line_with_its_balance_bytes_and_estimate(tmp_path, capsys):
    status, data = _run(tmp_path, "fsdp", "--world-size", "4", "--fake-only", "--fsdp")
    line = data["sharded"]["4"]
    assert status == 0 and line["buckets"] == 1
    # 8 pieces of 3 shapes on 4 ranks, one bucket: LPT leaves the worst owner 10.6% above the mean
    assert line["bucket_balance"] == pytest.approx(1.106, abs=1e-3)
    assert line["bytes_per_rank"] > 0 and 0 < line["optimizer_seconds"]
    printed = capsys.readouterr().out
    assert "sharded: bucket balance 1.106, bytes per rank" in printed and "DDP at this world size" in printed
    assert printed.rstrip().splitlines()[-1].startswith("sharded: ")  # the last line, for scripts to read


def test_memory_bound_kernels_cost_their_bytes_at_hbms_rate():
    """A kernel that is not a product costs the longer of its launch and its bytes (inputs read,
    output written, a broadcast input once, an out= tensor once) at 4.8 TB/s; products and views
    move none here (FLOPs price the products)."""
    x, y = torch.randn(1000, 1000), torch.randn(1000, 1)
    with OpCounter() as counter:
        x * y                                   # 4e6 + 4e3 read, 4e6 written
        torch.mul(x, 2.0, out=torch.empty_like(x))  # out= counted once (as the output)
        x.sum()                                 # 4e6 read, 4 written
        x @ x                                   # a product: FLOPs, no bytes
        x.view(-1)                              # a view: nothing
    assert counter.op_bytes == [8_004_000, 8_000_000, 4_000_004]
    parts = cost_model.compute_parts(counter.progress(), counter.op_bytes)
    rate, launch = cost_model.H200["hbm_bytes_per_s"], cost_model.H200["launch_s"]
    assert parts["memory"] == pytest.approx(sum(max(0.0, n / rate - launch) for n in counter.op_bytes))
    assert parts["memory"] == 0.0  # 8 MB is 1.7 us at 4.8 TB/s: under a launch
    z = torch.zeros(1 << 26)
    with OpCounter() as big:
        z + 1.0                                 # 2^26 floats read and written: 0.11 ms, beyond a launch
    assert cost_model.compute_parts(big.progress(), big.op_bytes)["memory"] == pytest.approx(2 * 4 * 2 ** 26 / rate - launch)


def test_the_sharded_line_charges_each_rank_its_shard_of_the_momentum_traffic(tmp_path):
    """A DDP rank updates the momentum of every matrix (its count's _momenta kernels move the whole
    model's bytes); the sharded line, built from those counts, keeps 1 / world_size of that traffic
    per rank (cost_model.momentum_memory names it by call site) and none of the finite check
    (nonfinite_check_seconds)."""
    summary = {"op_bytes": [480_000_000, 480_000_000],
               "op_sites": ["manifolds/optimizer.py:553 _momenta", "manifolds/solver.py:83 unit"]}
    assert cost_model.momentum_memory(summary) == pytest.approx(1e-4 - cost_model.H200["launch_s"])
    _, data = _run(tmp_path, "sites", "--world-size", "2", "--fake-only")
    rank = data["world_size"]["2"]["ranks"][0]
    assert len(rank["op_sites"]) == len(rank["op_bytes"]) > 0
    assert any((site or "").endswith(" _momenta") for site in rank["op_sites"])  # the name momentum_memory reads
    # the finite check of replicated gradients, which sharded ones skip: the line drops it whole
    check = {"op_bytes": [480_000_000, 8], "op_sites": ["manifolds/optimizer.py:569 _finite_flags",
                                                         "manifolds/optimizer.py:553 _momenta"]}
    assert cost_model.nonfinite_check_seconds(check) == pytest.approx(1e-4)
    checks = [site for site in rank["op_sites"] if (site or "").endswith(" _finite_flags")]
    assert len(checks) >= 3  # the gradients' largest |entry| (a foreach norm), stacked, isfinite


def test_fake_counts_equal_real_counts(tmp_path):
    # the default, sync-free step. One ADMM bank (mlp.fc, span-reduced), square Stiefel's dual (attn.proj), two plain Muon
    # banks: every solver path at a third of hetero's ops (fake tensors cost ~1 ms an op here)
    flags = ["--assign", "attn.proj=stiefel,mlp.fc=dgram"]
    # world size 2: the rank simulation and the exchange too (world size 1 differs only in the write)
    _, fake = _run(tmp_path, "fake", "--world-size", "2", "--fake-only", *flags)
    _, real = _run(tmp_path, "real", "--world-size", "2", *flags)
    assert fake["mode"] == "fake" and real["mode"] == "real"
    keys = ("kernels", "kernels_top", "triton_launches", "launches", "flops_by_precision", "host_syncs",
            "host_literals", "linalg", "collective_bytes_sent", "op_bytes")
    for f, r in zip(fake["world_size"]["2"]["ranks"], real["world_size"]["2"]["ranks"], strict=True):
        assert {k: f[k] for k in keys} == {k: r[k] for k in keys}
        assert r["host_syncs"] == 0 and r["kernels"] > 0


def test_a_syncing_step_is_counted_by_a_real_run(tmp_path):
    # ADMM's capturable=off checks convergence on the host: fake tensors cannot decide it, so --fake
    # falls back to a real run and --fake-only refuses (the online scheme has no such check)
    flags = ("--world-size", "1", "--solver-opt", "capturable=off", "--solver-opt", "scheme=admm")
    status, data = _run(tmp_path, "syncs", *flags, "--fake-only")
    assert status == 3 and data["fake"].startswith("needs a real run")
    status, data = _run(tmp_path, "fallback", *flags, "--fake")
    assert status == 0 and data["mode"] == "real" and data["fake"].startswith("needs a real run")
    assert not data["solver"]["capturable"] and data["world_size"]["1"]["ranks"][0]["host_syncs"] > 0


def test_solver_opts_reach_the_trainer_and_bad_ones_are_user_errors():
    args = cost_model.parse_args(["--solver-opt", "capturable=off", "--solver-opt", "iterations=5"])
    targs = cost_model.trainer_args(args)
    assert targs.solver_options == {"clip": "polynomial", "capturable": False, "iterations": 5}
    targs = cost_model.trainer_args(cost_model.parse_args(["--exchange-opt", "resident=on"]))
    assert targs.exchange_options == {"resident": True} and "resident" not in targs.solver_options
    assert targs.solver_precision == "tf32" and targs.kernels == "torch"
    with pytest.raises(UserError, match="clip"):
        cost_model.trainer_args(cost_model.parse_args(["--solver-opt", "clip=svd"]))


def test_the_step_costs_what_issue_49_allows_by_torchs_own_flop_counter():
    # torch's FlopCounterMode on transformers' GPT-2 (bench.flop_ratio), width 128 (the ratio of a
    # layer's matrices depends on their aspect, not their width): the default (online) scheme's hetero
    # step within 2.5x the field's Muon, all-dgram within 3x, plain Muon within 1.05x; ADMM above 5x
    from bench.flop_ratio import count
    ratio = {}
    for assign, opts in (("hetero", {}), ("all-dgram", {}), ("none", {}), ("hetero-admm", {"scheme": "admm"})):
        flops, muon = count(assign.replace("-admm", ""), 1, 128, opts)
        ratio[assign] = flops / muon
    assert ratio["hetero"] <= 2.5 and ratio["all-dgram"] <= 3.0 and ratio["none"] <= 1.05, ratio
    assert ratio["hetero-admm"] > 5.0, ratio


def _gather_step(async_op, launches_before_wait, launches=20, rows=1 << 20):
    """A step that all-gathers `rows` fp32 over 8 ranks around `launches` small products, waiting
    after `launches_before_wait` of them (a synchronous call waits where it is posted)."""
    import torch.distributed as dist
    a, out = torch.randn(8, 8), torch.zeros(8 * rows)
    with OpCounter() as counter, simulated_collectives(counter, 8):
        handle = dist.all_gather_into_tensor(out, torch.ones(rows), async_op=async_op)
        for k in range(launches):
            if k == launches_before_wait and handle is not None:
                handle.wait()
            a @ a
    return counter.summary()


def test_an_async_collective_overlaps_the_work_between_its_post_and_its_wait():
    launch, link = cost_model.H200["launch_s"], cost_model.H200["link_bytes_per_s"]
    transfer = 7 * 4 * (1 << 20) / link  # a ring all-gather puts (n - 1) x its input on the link: 84 us
    sync = cost_model.estimate(_gather_step(False, 0))
    assert sync["transfer"] == pytest.approx(transfer)
    assert sync["exposed_transfer"] == pytest.approx(transfer)  # overlaps nothing
    assert sync["total"] == pytest.approx(sync["compute"] + transfer)
    # posted after the ones() launch, waited 10 products (50 us) later: 34 us of it exposed
    half = cost_model.estimate(_gather_step(True, 10))
    assert half["compute"] == pytest.approx(sync["compute"])
    assert half["exposed_transfer"] == pytest.approx(transfer - 10 * launch, rel=1e-4)  # + the products' FLOPs
    # waited after all 20 (100 us): hidden; never waited: the step still ends after it
    assert cost_model.estimate(_gather_step(True, 20))["exposed_transfer"] == pytest.approx(0)
    late = cost_model.estimate(_gather_step(True, 20, launches=10))
    assert late["total"] == pytest.approx(launch + transfer)


def test_collectives_share_one_link_in_the_order_posted():
    # two all-gathers posted back to back, waited late: the second starts when the first ends
    events = [("post", 0, 0.0, 3.0), ("post", 1, 0.0, 3.0), ("wait", 0, 4.0), ("wait", 1, 4.0)]
    step, transfer = cost_model.overlapped(events, 5.0)
    assert transfer == 6.0 and step == 7.0  # the second ends at 6: the compute stalls 2 s at its wait
    assert cost_model.overlapped(events[:1] + events[2:3], 5.0) == (5.0, 3.0)
    # on two links they run side by side; `after` chains one to another's end whatever its link
    two = [("post", 0, 0.0, 3.0), ("post", 1, 0.0, 3.0, "nic"), ("wait", 0, 4.0), ("wait", 1, 4.0)]
    assert cost_model.overlapped(two, 5.0) == (5.0, 6.0)
    chained = [("post", 0, 0.0, 3.0), ("post", 1, 0.0, 3.0, "nic", 0), ("wait", 0, 4.0), ("wait", 1, 4.0)]
    assert cost_model.overlapped(chained, 5.0) == (7.0, 6.0)


def test_hsdp_solves_once_per_job_and_prices_the_replica_gather(tmp_path, capsys):
    from bench.sharded_bytes import per_step
    _, fsdp = _run(tmp_path, "fsdp4", "--world-size", "4", "--fake-only", "--fsdp")
    _, one = _run(tmp_path, "hsdp1", "--world-size", "4", "--fake-only", "--fsdp", "--fsdp-shard-ranks", "4")
    assert one["sharded"]["4"] == fsdp["sharded"]["4"]  # one replica: the FSDP line
    assert fsdp["sharded"]["4"]["one_link_ratio"] == fsdp["sharded"]["4"]["ratio"]  # no replica collective
    capsys.readouterr()
    status, data = _run(tmp_path, "hsdp", "--world-size", "4", "--fake-only", "--fsdp", "--fsdp-shard-ranks", "2")
    line = data["sharded"]["4"]
    assert status == 0 and (line["replicas"], line["shard_ranks"]) == (2, 2)
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith("sharded: bucket balance")
    # owners over all 4 ranks: the same balance and compute as FSDP over 4
    assert line["bucket_balance"] == fsdp["sharded"]["4"]["bucket_balance"]
    assert line["compute_seconds"] == pytest.approx(fsdp["sharded"]["4"]["compute_seconds"])
    # bytes: half of FSDP-over-2's exchange, plus the replica all-gather of the shard's new values
    # (2 layers x 64: matrices 2 x 12 x 64^2 elements; hetero's warm starts: c_attn's, c_fc's and
    # mlp.c_proj's 64 x 64 per layer)
    targs = cost_model.trainer_args(cost_model.parse_args(["--n-layer", "2", "--n-embd", "64"]))
    assign = dict(targs.assignment)
    shard = per_step(2, 64, assign, 2, 2)["manifold_muon"] / 2
    matrices, duals = cost_model.matrix_elements(targs)
    assert matrices == 2 * 12 * 64 * 64
    assert line["bytes_per_rank"] == pytest.approx(shard + 0.5 * 4 * (matrices + duals) / 2)
    # one node: the replica all-gather on a link of its own beside the shard group's can only help
    assert line["ratio"] <= line["one_link_ratio"]


def test_collectives_across_nodes_run_at_the_nics_rate(tmp_path):
    """Ranks beyond one node (8 GPUs) reach each other through one 400 Gb/s InfiniBand NIC per GPU,
    7x slower than NVLink: DDP's gathers at 16 ranks and HSDP 2 x 8's replica all-gather are priced
    at it (the HSDP line gave 0.408 for GPT-2 XL at 64 ranks with every byte at NVLink's rate,
    0.839 across nodes)."""
    assert cost_model.link_rate(8) == 7 * cost_model.link_rate(9) == 350e9
    status, data = _run(tmp_path, "hsdp16", "--world-size", "16", "--fake-only", "--fsdp", "--fsdp-shard-ranks", "8")
    line = data["sharded"]["16"]
    assert status == 0 and line["ratio"] > line["one_link_ratio"]
    ranks = data["world_size"]["16"]["ranks"]
    slowest = max(ranks, key=lambda r: cost_model.estimate(r, 16)["total"])
    nvlink, nic = cost_model.estimate(slowest, 8), cost_model.estimate(slowest, 16)
    assert nic["transfer"] == pytest.approx(7 * nvlink["transfer"]) and nic["transfer"] > 0
    with pytest.raises(SystemExit):
        cost_model.parse_args(["--fsdp", "--fsdp-shard-ranks", "3", "--world-size", "8"])
    with pytest.raises(SystemExit):
        cost_model.parse_args(["--fsdp-shard-ranks", "2"])


def test_ranks_owning_the_same_shapes_share_one_count(tmp_path):
    _, every = _run(tmp_path, "every", "--world-size", "4", "--fake-only", "--count-every-rank")
    _, shared = _run(tmp_path, "shared", "--world-size", "4", "--fake-only")
    keys = ("launches", "flops_by_precision", "collective_bytes_sent", "transfers", "pieces")
    for e, s in zip(every["world_size"]["4"]["ranks"], shared["world_size"]["4"]["ranks"], strict=True):
        assert {k: e[k] for k in keys} == {k: s[k] for k in keys}
    assert any("same_count_as" in s for s in shared["world_size"]["4"]["ranks"])
    assert len({r["flops_by_precision"]["triton:tf32"] for r in every["world_size"]["4"]["ranks"]}) > 1


def test_exchange_bucket_what_if_cuts_more_buckets_and_restores_the_setting(tmp_path):
    from manifolds import exchange
    before = exchange.EXCHANGE_BUCKET
    _, default = _run(tmp_path, "default", "--world-size", "4", "--fake-only", "--fsdp")
    _, small = _run(tmp_path, "small", "--world-size", "4", "--fake-only", "--fsdp", "--exchange-bucket", "4096")
    assert exchange.EXCHANGE_BUCKET == before
    assert default["sharded"]["4"]["buckets"] == 1 < small["sharded"]["4"]["buckets"]
    # DDP's buckets are whole banks (exchange.replicated_buckets): the what-if leaves them as they are
    assert max(r["collectives"] for r in small["world_size"]["4"]["ranks"]) == \
        max(r["collectives"] for r in default["world_size"]["4"]["ranks"])
    # the sharded line is counted in the sharded buckets: more solver calls, more compute
    assert small["sharded"]["4"]["compute_seconds"] > default["sharded"]["4"]["compute_seconds"]


# --- bench/cost_model.py --bank-launches: the launches a bank adds to one rank's step, the fixed
# cost per bank an owner pays whatever its number of pieces (exchange.bucket_owners' question)

def _run_bank_launches(tmp_path, name, *flags):
    path = tmp_path / f"{name}.json"
    status = cost_model.main(["--n-layer", "2", "--n-embd", "64", "--world-size", "4", "--fake-only",
                              "--out", str(path), *flags])
    return status, json.loads(path.read_text())


def test_bank_launches_per_bank_and_per_call_and_the_counts_unchanged(tmp_path, capsys):
    from manifolds import exchange
    owners = exchange.bucket_owners
    status, data = _run_bank_launches(tmp_path, "banks", "--bank-launches")
    assert status == 0 and exchange.bucket_owners is owners  # patched only while counting
    banks = data["bank_launches"]
    assert banks["world_size"] == 4 and banks["none"] > 0
    # 2 layers at 4 ranks, DDP's buckets: the 4 MLP pieces (one DGram bank), then QKV + attention
    # projection (2 + 2 Stiefel pieces, two banks in one solver call)
    assert [len(bucket["banks"]) for bucket in banks["buckets"]] == [1, 2]
    assert banks["buckets"][0]["together"] is None
    for bucket in banks["buckets"]:
        assert all(n > 0 for n in bucket["banks"].values())
    two = banks["buckets"][1]
    # one call of both banks: more than either alone, less than both alone (the call's own launches once)
    assert max(two["banks"].values()) < two["together"] < sum(two["banks"].values())
    printed = capsys.readouterr().out
    assert "one of each, in one solver call" in printed
    # the step's own counts are those of a run without the flag
    _, plain = _run_bank_launches(tmp_path, "plain")
    assert "bank_launches" not in plain
    keys = ("launches", "flops_by_precision", "collective_bytes_sent", "pieces")
    for a, b in zip(data["world_size"]["4"]["ranks"], plain["world_size"]["4"]["ranks"], strict=True):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}


def test_bank_launches_needs_a_world_size_above_one(capsys):
    with pytest.raises(SystemExit):
        cost_model.parse_args(["--bank-launches", "--world-size", "1"])
    assert "--bank-launches needs a world size above 1" in capsys.readouterr().err
