"""--fsdp: the trainer's model sharded by FSDP2 over torchrun's processes.

Each transformer block, then the whole model, is wrapped by `fully_shard` on a 1-D mesh of every
rank (parameters, gradients and optimizer state split by rows over the ranks; a block's weights
are gathered for its forward and again for its backward, then freed). On CUDA with a bf16
forward, parameters are gathered in bf16 and gradients reduced in fp32 (the sharded master
weights stay fp32); on CPU everything is fp32. ManifoldMuon steps the sharded matrices itself
(manifolds/exchange.py: under HSDP each matrix is solved once per job and its new values copied
to every replica) and torch's AdamW the rest.
"""
import torch
import torch.distributed as dist

from errors import UserError
from manifolds.exchange import all_gather_rows


def shard_model(model, device, dtype, shard_ranks=0):
    """Wrap `model` (our GPT) in place: fully_shard per block, then at the root; over all ranks,
    or (HSDP) within groups of `shard_ranks` consecutive ranks, replicated across the groups."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    world = dist.get_world_size()
    if shard_ranks and shard_ranks != world:
        # each matrix is solved by one rank of the job and its new values copied to every replica
        # (manifolds/exchange.py): the replicas need not pick the same kernel tiles
        mesh = init_device_mesh(device.type, (world // shard_ranks, shard_ranks), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world,))
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if device.type == "cuda" and dtype == "bfloat16" else MixedPrecisionPolicy())
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def build_sharded(build, device, dtype, shard_ranks, seed):
    """`build()` (a GPT) on the meta device, sharded (shard_model), then materialised on `device`
    rank by rank with the weights the whole model built in one process after
    torch.manual_seed(seed) has (training/meta_init.py): no rank ever holds the whole model."""
    from training.meta_init import materialize, record
    model, steps = record(build)
    shard_model(model, device, dtype, shard_ranks)
    return materialize(model, steps, device, seed)


class ReplicaDrift(UserError):
    """HSDP replicas whose parameters are no longer bitwise equal (check_replicas)."""


def checksum(tensor):
    """Two int64 sums of a tensor's bits, the second weighted by position: equal for bitwise-equal
    tensors; a changed bit or a moved element changes them (overflow wraps, the same everywhere)."""
    bits = tensor.detach().contiguous().reshape(-1)
    bits = bits.view(torch.int32 if bits.element_size() == 4 else torch.int16).to(torch.int64)
    weights = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % 65521 + 1
    return torch.stack([bits.sum(), (bits * weights).sum()])


@torch.no_grad()
def check_replicas(model):
    """Under HSDP (--fsdp --fsdp-shard-ranks N < ranks) the replica groups must hold bitwise-equal
    shards: each rank's checksums of its shards are all-gathered over its replicas, and whether a
    parameter differs anywhere is all-reduced over every rank, so every rank raises the same
    ReplicaDrift naming the parameters (never a hang). A collective: every rank calls it (the
    trainer: at each eval and before each checkpoint). Returns the parameters compared (0 when
    there are no replicas)."""
    params = [(name, p) for name, p in model.named_parameters() if hasattr(p, "placements")]
    if not params:
        return 0
    mesh, placements = params[0][1].device_mesh, params[0][1].placements
    replicated = [dim for dim, placement in enumerate(placements) if placement.is_replicate()]
    if not replicated or mesh.size(replicated[0]) == 1:
        return 0
    group = mesh.get_group(replicated[0])
    mine = torch.stack([checksum(p.to_local()) for _, p in params])
    every = all_gather_rows(mine, mesh.size(replicated[0]), group)
    differ = (every != mine).any(dim=2).any(dim=0).to(torch.int64)
    dist.all_reduce(differ, op=dist.ReduceOp.MAX)
    if bool(differ.any()):
        names = [name for (name, _), bad in zip(params, differ.tolist()) if bad]
        raise ReplicaDrift(f"HSDP replicas drifted apart: {len(names)} parameter(s) no longer bitwise equal "
                           f"across the replica groups ({', '.join(names[:5])}{', ...' if len(names) > 5 else ''}); "
                           "the run stopped before saving a state that depends on which replica is read "
                           "(resume from the last checkpoint)")
    return len(params)


def whole(tensor):
    """The whole tensor of a DTensor (a collective: every rank calls it), else the tensor."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def check_fsdp_flags(args, world_size):
    """UserError for what --fsdp does not support (yet), and for a --fsdp-shard-ranks that does not
    divide the ranks."""
    if args.fsdp_shard_ranks and not args.fsdp:
        raise UserError("--fsdp-shard-ranks shards within groups of ranks: it needs --fsdp")
    if args.fsdp_grad_sync == "last" and not args.fsdp:
        raise UserError("--fsdp-grad-sync last chooses when --fsdp reduce-scatters: it needs --fsdp "
                        "(without it gradients are all-reduced once per step)")
    if not args.fsdp:
        return
    if args.fsdp_shard_ranks < 0 or (args.fsdp_shard_ranks and world_size % args.fsdp_shard_ranks):
        raise UserError(f"--fsdp-shard-ranks {args.fsdp_shard_ranks} must divide the {world_size} ranks (0 = all)")
    unsupported = {"--qk-clip": bool(args.qk_clip), "--assign auto": args.assign.strip() == "auto",
                   "--cuda-graph on": args.cuda_graph == "on"}
    named = [flag for flag, given in unsupported.items() if given]
    if named:
        raise UserError(f"--fsdp does not support {', '.join(named)} yet (they rescale, reassign or capture "
                        f"whole matrices on every rank); run them without --fsdp")


def gathered_matrix_stats(matrices, dgram_cap, report, radii=None):
    """training.diagnostics.matrix_stats of sharded matrices (a collective): each matrix is
    gathered whole by every rank in turn, so that no rank holds more than one whole at a time, and
    its statistics computed on the rank that `report`s (rank 0); {} elsewhere. `radii`: as
    matrix_stats takes them."""
    from manifolds.param_groups import Matrix
    from training.diagnostics import matrix_stats
    out = {}
    for matrix in (Matrix(*m) for m in matrices):
        W = whole(matrix.param.detach())
        if report:
            for field, values in matrix_stats([matrix._replace(param=W)], dgram_cap, radii).items():
                out.setdefault(field, {}).update(values)
    return out
