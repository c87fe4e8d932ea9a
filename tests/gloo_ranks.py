"""A test's rank processes (multiprocessing spawn, one rank of a gloo group each): started and
joined by `run_ranks`, ended by `end_rank_process`."""
import gc
import multiprocessing
import os
import sys
import traceback

import torch.distributed as dist


def end_rank_process(code=0):
    """Call as a rank's `finally:` (or last). Leaves the group and ends the process at once: exit code
    `code`, or 1 after printing the exception in flight.

    Why not return and let the interpreter end: modules, DTensors and collectives' work sit in
    reference cycles, and at interpreter shutdown a gloo thread can still be finishing with them; the
    process then aborts (SIGABRT, "terminate called without an active exception") after it has written
    its results. Seen once each in clean-clone suite runs: test_step_agreement's resume worker and, with
    gc and destroy already done, test_torch_clients' frozen-layer rank 0 (2026-12-07). train_gpt2.main
    frees the cycles before it destroys the group too; a user's process ends normally after it."""
    failed = sys.exc_info()[0] is not None
    if failed:
        traceback.print_exc()
    gc.collect()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if failed else code)


def run_ranks(target, args_of_rank, world_size, timeout):
    """Start `target(*args_of_rank(rank))` for every rank, spawned (not forked: a rank forked from
    pytest's threads can hang before its first line), wait for them and check that all exited 0."""
    context = multiprocessing.get_context("spawn")
    ranks = [context.Process(target=target, args=args_of_rank(rank)) for rank in range(world_size)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=timeout)
    assert [process.exitcode for process in ranks] == [0] * world_size
