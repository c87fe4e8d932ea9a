"""Train GPT-2 with module-wise manifold Muon.

    python train_gpt2.py --assign hetero --data-dir data/owt
    torchrun --standalone --nproc_per_node=8 train_gpt2.py --assign hetero --data-dir data/owt

Each attention and MLP weight matrix is optimized by ManifoldMuon on the manifold that
--assign gives its module (Stiefel, DGram or none = plain Muon); embeddings and norm gains
use AdamW. Sections: config -> data -> optimizers -> loop -> eval and outputs; the model
(GPTConfig, GPT) is model.py.
"""
import argparse
import collections
import contextlib
import dataclasses
import gc
import glob
import itertools
import json
import math
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.nn as nn
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from data.progress import require_finished
from data.shards import ShardError, ShardReader
from errors import UserError, WriteError, run_cli
from kernels import BACKENDS as KERNEL_BACKENDS, check_backend
from training.checkpoints import (check_resumable, checkpoint_path, checkpoint_payload, find_resume_checkpoint,
                                  load_muon_state, restore, restore_run, run_payload, save_atomic, save_checkpoint)
from training.auto_assign import AutoAssign
from training.user_manifolds import import_manifold_modules, saved_manifold_modules
from training.fsdp import build_sharded, check_fsdp_flags, check_replicas, gathered_matrix_stats, whole
from training.sharded_checkpoints import find_sharded_resume, load_sharded, save_sharded, sharded_checkpoint_path
from training.diagnostics import AttentionProbe, matrix_stats, stored_radii
from training.qk_clip import QKClip
from training.nonfinite import adamw_step, clip_or_mark, forget_logits
from training.run_dir import RunLock, check_out_dir, check_shared_out_dir, clear_run, remove_leftovers
from training.run_log import RunLog, write_json
from training.stop import EXIT_DIVERGED, EXIT_INTERRUPTED, StopRequest
from manifolds import ManifoldMuon, manifold_param_groups, manifold_violation
from manifolds.assignment import parse_assignment
from manifolds.param_groups import Matrix, assigned_matrices, muon_groups, project_matrices
from manifolds.sharded import shard_full_state
from manifolds.exchange import ExchangeOptions, parse_exchange_opts
from manifolds.plan import SOLVER_VALUE_TEXT, SolverOptions, parse_solver_value, show_value, solver_value_kind
from manifolds.step_graph import StepGraph, lr_in_device_tensors
from model import GPT, GPTConfig  # the model (model.py); train_gpt2.GPT stays importable

# ----------------------------------------------------------------------------------------
# Configuration


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help keeps the module docstring's layout and shows every default that says something
    (not None, nor --solver-opt's empty list)."""

    def _get_help_string(self, action):
        if action.default is None or action.default == []:
            return action.help
        return super()._get_help_string(action)


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    apply_model_preset(args)
    return args


# --model presets: (blocks, heads, width) of the GPT-2 family (Radford et al. 2019)
MODEL_PRESETS = {"gpt2": (12, 12, 768), "gpt2-medium": (24, 16, 1024), "gpt2-large": (36, 20, 1280),
                 "gpt2-xl": (48, 25, 1600)}


def apply_model_preset(args):
    """--n-layer, --n-head and --n-embd not given take the --model preset's values."""
    for name, value in zip(("n_layer", "n_head", "n_embd"), MODEL_PRESETS[args.model]):
        if getattr(args, name) is None:
            setattr(args, name, value)


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add_run_flags(p.add_argument_group("run"))
    add_auto_assign_flags(p.add_argument_group("automatic assignment (--assign auto)"))
    add_model_flags(p.add_argument_group("model (GPT-2 small by default; --model picks another size)"))
    add_stabilizer_flags(p.add_argument_group("attention-logit stabilizers (combine with any --assign)"))
    add_training_flags(p.add_argument_group("training"))
    add_solver_flags(p.add_argument_group("manifold Muon's solver"))
    add_eval_flags(p.add_argument_group("evaluation and logging"))
    add_checkpoint_flags(p.add_argument_group("checkpoints and failures"))
    return p


def add_run_flags(a):
    a.add_argument("--assign", default="hetero",
                   help="manifold per module: a preset (unconstrained, all-stiefel, all-dgram, hetero, "
                        "hetero-inv, hetero-qk, all-oblique, hetero-hyperball, all-hyperball), `auto` (see --auto-*), or key=manifold[,...] with keys "
                        "attn, mlp, attn.qkv, attn.proj, mlp.fc, mlp.proj and the QKV row blocks attn.q, "
                        "attn.k, attn.v, attn.qk (naming one splits the fused QKV into three matrices), and "
                        "manifolds stiefel, dgram, oblique, dgram-cap, hyperball, none (and those of --manifold-module)")
    a.add_argument("--manifold-module", action="append", default=[], metavar="MODULE_OR_FILE",
                   help="import a Python module (dotted name) or file that registers manifolds of your own "
                        "(manifolds.register_manifold) before --assign is read, in every process; repeatable. "
                        "Kept in config.json: --resume imports them again without the flag")
    a.add_argument("--data-dir", default="data/openwebtext",
                   help="folder with *train*.bin and *val*.bin token shards (data/prepare.py writes them)")
    a.add_argument("--out-dir", default="runs/default",
                   help="folder for config.json, metrics.jsonl and summary.json")
    a.add_argument("--seed", type=int, default=1337, help="seed of the initialisation and the data order")
    a.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto = cuda when available, else cpu")
    a.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="autocast precision of the forward pass; auto = bfloat16 on cuda, float32 on cpu. "
                        "Master weights and the manifold optimizer stay float32")
    a.add_argument("--fsdp", action=argparse.BooleanOptionalAction, default=False,
                   help="shard parameters, gradients and optimizer state over torchrun's processes (FSDP2 "
                        "per block; ManifoldMuon steps the sharded matrices; checkpoints are "
                        "torch.distributed.checkpoint folders). Without it every process holds the whole "
                        "model (DDP)")
    a.add_argument("--fsdp-shard-ranks", type=int, default=0, metavar="N",
                   help="with --fsdp: shard within groups of N consecutive ranks and replicate across the "
                        "groups (HSDP; e.g. N = GPUs per node, so that the per-step shard traffic stays "
                        "inside a node); 0 = shard over all ranks")
    a.add_argument("--fsdp-grad-sync", choices=("every", "last"), default="every",
                   help="with --fsdp and gradient accumulation: reduce-scatter the gradients on every micro-step "
                        "(each rank holds only its shards: what sharding is for) or only on the last (DDP's "
                        "choice: fewer collectives, but every rank holds the whole model's unsharded fp32 "
                        "gradients between micro-steps; bench.memory counts them)")
    a.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                   help="torch.compile the model (GPU runs)")
    a.add_argument("--wandb", choices=("off", "offline", "online"), default="off",
                   help="Weights & Biases logging; offline writes a local run that `wandb sync` uploads")
    a.add_argument("--wandb-project", default="manifold-muon-gpt2", help="wandb project name")
    a.add_argument("--run-name", default=None, help="wandb run name (default: the out-dir name)")
    a.add_argument("--dgram-cap", type=float, default=1.0,
                   help="column-norm cap C of the dgram-cap manifold (singular values <= C; C = 1 bounds "
                        "attention logits as Stiefel does while letting columns shrink)")


def add_auto_assign_flags(u):
    u.add_argument("--auto-base", default="all-dgram",
                   help="the assignment every block starts from (a preset or key=manifold spec)")
    u.add_argument("--auto-logit-max", type=float, default=10.0,
                   help="switch a block's attention to Stiefel when its max |q.k|/sqrt(d_head) at an eval "
                        "exceeds this (0 = off)")
    u.add_argument("--auto-saturation", type=float, default=0.5,
                   help="... or its mean largest softmax probability exceeds this (0 = off)")
    u.add_argument("--auto-sigma-growth", type=float, default=4.0,
                   help="... or the largest singular value of its attention matrices has grown this many "
                        "times since the first eval (0 = off)")


def add_model_flags(m):
    m.add_argument("--model", choices=MODEL_PRESETS, default="gpt2",
                   help="model size preset: blocks / heads / width " + ", ".join(
                       f"{name} {'/'.join(map(str, shape))}" for name, shape in MODEL_PRESETS.items())
                   + "; --n-layer, --n-head and --n-embd override its values")
    m.add_argument("--n-layer", type=int, default=None, help="transformer blocks (default: --model's)")
    m.add_argument("--n-head", type=int, default=None, help="attention heads (default: --model's)")
    m.add_argument("--n-embd", type=int, default=None, help="model width (default: --model's)")
    m.add_argument("--seq-len", type=int, default=1024, help="context length in tokens")
    m.add_argument("--vocab-size", type=int, default=50304, help="embedding rows (GPT-2's 50257 padded)")


def add_stabilizer_flags(s):
    s.add_argument("--qk-norm", action="store_true",
                   help="RMS-normalise q and k per head with a learned gain (Wortsman et al. 2023; modded-nanogpt)")
    s.add_argument("--qk-clip", type=float, default=0.0, metavar="TAU",
                   help="QK-Clip (Kimi K2's MuonClip): after each step, scale the query and key weights of "
                        "every head whose largest logit in that step exceeded TAU (K2: 100), as far as the "
                        "matrix's manifold allows: per head for plain Muon, the whole matrix for DGram, not "
                        "at all for Stiefel (training/qk_clip.py); 0 = off")
    s.add_argument("--attn-softcap", type=float, default=0.0, metavar="C",
                   help="soft-cap the attention logits to C tanh(logits / C) (Gemma 2: 50); needs explicit "
                        "logits instead of the fused attention kernel; 0 = off")


def add_training_flags(t):
    t.add_argument("--total-batch-size", type=int, default=64,
                   help="sequences per optimizer step over all processes (the published 64 x 1024 tokens); "
                        "gradient accumulation = total / (--batch-size x processes), a whole number")
    t.add_argument("--batch-size", type=int, default=8,
                   help="sequences per process per micro-step (8 x 1024 tokens of GPT-2 small: an estimated "
                        "10-15 GB in bf16; lower it on smaller cards, the step stays the same); also the "
                        "eval batch")
    t.add_argument("--max-steps", type=int, default=50000, help="optimizer steps")
    t.add_argument("--warmup-steps", type=int, default=1000, help="linear warmup steps")
    t.add_argument("--lr", type=float, default=6e-4, help="AdamW peak learning rate (embeddings, norms)")
    t.add_argument("--min-lr", type=float, default=6e-5, help="AdamW learning rate at the end of the cosine")
    t.add_argument("--optimizer", choices=("muon", "adamw"), default="muon",
                   help="muon: the transformer blocks' matrices by ManifoldMuon (--assign), the rest by AdamW; "
                        "adamw: every parameter by AdamW at --lr (the baseline; needs --assign unconstrained)")
    t.add_argument("--muon-lr", type=float, default=0.02,
                   help="peak spectral-norm step of the Muon matrices; follows the AdamW schedule's shape")
    t.add_argument("--momentum", type=float, default=0.95, help="Muon Nesterov momentum")
    t.add_argument("--weight-decay", type=float, default=0.1,
                   help="decoupled weight decay of AdamW 2-D tensors and of unconstrained Muon matrices")
    t.add_argument("--grad-clip", type=float, default=1.0, help="clip the global gradient norm (0 = off)")


def add_solver_flags(v):
    v.add_argument("--kernels", choices=KERNEL_BACKENDS, default="auto",
                   help="optimizer kernels: fused triton, plain torch, or auto (triton on cuda)")
    v.add_argument("--solver-precision", choices=("auto", "fp32", "tf32", "bf16"), default="auto",
                   help="precision of the solver's products: under the online scheme (the default) the products "
                        "with W, the final projection's included (TF32 under tf32, the fp32 retraction absorbing "
                        "the rounding) and the matrix sign (bf16 under tf32 and bf16); under scheme=admm its inner "
                        "iterations: fp32 (3xTF32 kernels on GPU), tf32 (TF32 tensor cores, fp32 accumulation; "
                        "emulated on CPU), or bf16. The retraction stays fp32. auto = tf32 on GPU, fp32 on CPU "
                        "(docs/flags.md, docs/solver-tuning.md)")
    v.add_argument("--cuda-graph", choices=("off", "on"), default="off",
                   help="replay the Muon step from one CUDA graph, captured at the third step of the process "
                        "(no launch overhead; needs the sync-free step: capturable auto on GPU, or "
                        "--solver-opt capturable=on); the lr then lives in device tensors. On CPU the replay "
                        "is emulated (manifolds/step_graph.py), for checking only")
    v.add_argument("--solver-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="set one solver option, for experiments and sweeps (repeat the flag for several; "
                        "the defaults are what runs). Keys and defaults: "
                        + ", ".join(f"{key}={show_value(value)}" for key, value in solver_opt_defaults().items())
                        + ". scheme=online (one dual step per training step) reads dual_step and stiefel_dual_step; scheme=admm reads "
                          "iterations, pullbacks, rho, rho_warm, rho_growth, warm_average, relax and tol "
                          "(docs/solver-tuning.md)")
    v.add_argument("--exchange-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="set one setting of the optimizer's exchange between ranks (repeatable; the defaults are "
                        "what runs). Keys and defaults: "
                        + ", ".join(f"{f.name}={show_value(f.default)}" for f in dataclasses.fields(ExchangeOptions))
                        + " (docs/distributed.md)")


def add_eval_flags(e):
    e.add_argument("--eval-every", type=int, default=250, help="evaluate every N steps (and at the end)")
    e.add_argument("--eval-tokens", type=int, default=10_485_760,
                   help="validation tokens per evaluation: a fixed prefix of the val shards")
    e.add_argument("--log-every", type=int, default=10, help="print a progress line every N steps")


def add_checkpoint_flags(r):
    r.add_argument("--ckpt-every", type=int, default=1000, help="checkpoint every N steps (0 = only on interrupt)")
    r.add_argument("--keep-ckpts", type=int, default=2, help="how many rotating checkpoints to keep")
    r.add_argument("--resume", default=None, metavar="auto|PATH",
                   help="continue a run: `auto` = newest valid checkpoint in --out-dir, or a checkpoint file")
    r.add_argument("--overwrite", action="store_true",
                   help="start afresh in an --out-dir that holds another run (deletes its logs and checkpoints)")
    r.add_argument("--diverge-factor", type=float, default=3.0,
                   help="a train or val loss above this times the best val loss so far counts as divergence "
                        "(as does a non-finite loss)")
    r.add_argument("--on-diverge", choices=("stop", "continue"), default="stop",
                   help="stop: checkpoint for post-mortem and exit with status 3; continue: record and go on")
    r.add_argument("--max-skipped-steps", type=int, default=5, metavar="N",
                   help="a step whose gradient norm is not finite (a NaN or inf gradient) is skipped: weights, "
                        "momentum, warm starts and AdamW's state stay as they were (decided on the device), and "
                        "metrics.jsonl counts it (skipped_steps); N such steps in a row stop the run with an error "
                        "(exit status 2)")


# SolverOptions fields that users choose through flags of their own, not --solver-opt
SOLVER_FLAG_OPTIONS = {"backend": "--kernels", "precision": "--solver-precision", "dgram_cap": "--dgram-cap"}


def solver_opt_defaults():
    """{key: default} of the SolverOptions fields that --solver-opt sets."""
    return {f.name: f.default for f in dataclasses.fields(SolverOptions) if f.name not in SOLVER_FLAG_OPTIONS}


def parse_solver_opts(items):
    """--solver-opt KEY=VALUE, ... -> {key: value}; a UserError names a bad item (and, for an
    unknown key or a value of the wrong type, the valid keys)."""
    defaults, options = solver_opt_defaults(), {}
    valid = ", ".join(defaults)
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if key in SOLVER_FLAG_OPTIONS:
            raise UserError(f"--solver-opt {item}: {key} is set by {SOLVER_FLAG_OPTIONS[key]}")
        if key in ExchangeOptions.keys():
            raise UserError(f"--solver-opt {item}: {key} is an exchange setting now: --exchange-opt {item}")
        if not sep or key not in defaults:
            raise UserError(f"--solver-opt {item}: unknown key {key!r}; KEY=VALUE with KEY one of {valid}")
        kind = solver_value_kind(key, defaults[key])
        value = parse_solver_value(kind, text)
        if value is None:
            raise UserError(f"--solver-opt {item}: {key} takes {SOLVER_VALUE_TEXT[kind]}, got {text!r} "
                            f"(default {show_value(defaults[key])}; keys: {valid})")
        if kind in ("int", "float") and value < 0:  # every budget, penalty, ratio and tolerance
            raise UserError(f"--solver-opt {item}: {key} must be >= 0")
        options[key] = value
    try:  # the solver's own checks of ranges and names
        SolverOptions(**options)
    except (TypeError, ValueError) as err:
        raise UserError(f"--solver-opt: {err}") from None
    return options


def validate_args(args, world_size=None):
    """Check the flags (a UserError names the first bad one) and derive args.grad_accum,
    args.assignment and args.solver_options (--solver-opt's {key: value}). `world_size` defaults
    to torchrun's WORLD_SIZE (1 without torchrun)."""
    args.solver_options = parse_solver_opts(args.solver_opt)
    try:
        args.exchange_options = parse_exchange_opts(args.exchange_opt)
    except ValueError as err:
        raise UserError(str(err)) from None
    for name, value in vars(args).items():  # inf and NaN pass the range checks below
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"--{name.replace('_', '-')} must be a finite number, got {value}")
    positive = ("n_layer", "n_head", "n_embd", "seq_len", "vocab_size", "batch_size", "total_batch_size",
                "max_steps", "eval_every", "eval_tokens", "log_every", "keep_ckpts", "max_skipped_steps")
    for name in positive:
        if getattr(args, name) <= 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ("lr", "muon_lr"):
        if not getattr(args, name) > 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not args.diverge_factor > 1:
        raise UserError(f"--diverge-factor must be above 1, got {args.diverge_factor}")
    for name in ("min_lr", "weight_decay", "grad_clip", "warmup_steps", "ckpt_every"):
        if getattr(args, name) < 0:
            raise UserError(f"--{name.replace('_', '-')} must be non-negative, got {getattr(args, name)}")
    if not 0 <= args.auto_saturation <= 1:
        raise UserError(f"--auto-saturation is a probability in [0, 1] (0 = off), got {args.auto_saturation}")
    if not 0 <= args.momentum < 1:
        raise UserError(f"--momentum must be in [0, 1), got {args.momentum}")
    if args.n_embd % args.n_head:
        raise UserError(f"--n-embd {args.n_embd} is not divisible by --n-head {args.n_head}")
    if args.vocab_size > 2**16:
        raise UserError(f"--vocab-size {args.vocab_size} exceeds what uint16 token shards can hold")
    if not args.dgram_cap > 0:
        raise UserError(f"--dgram-cap must be positive, got {args.dgram_cap}")
    for name in ("qk_clip", "attn_softcap"):
        if getattr(args, name) < 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive (0 = off), got {getattr(args, name)}")
    if args.qk_clip and args.qk_norm:
        raise UserError("--qk-clip with --qk-norm: normalised q and k do not depend on the scale of W_q and W_k, "
                        "so the clip could not lower a logit; use one of them")
    if args.qk_clip and args.optimizer != "muon":
        raise UserError("--qk-clip rescales Muon matrices after the Muon step: it needs --optimizer muon")
    for name in ("auto_logit_max", "auto_saturation", "auto_sigma_growth"):
        if getattr(args, name) < 0:
            raise UserError(f"--{name.replace('_', '-')} must be non-negative (0 = off), got {getattr(args, name)}")
    if args.optimizer == "adamw" and args.assign.strip() != "unconstrained":
        raise UserError(f"--optimizer adamw trains no matrix on a manifold: pass --assign unconstrained "
                        f"(got --assign {args.assign})")
    if args.cuda_graph == "on":
        if args.optimizer == "adamw":
            raise UserError("--cuda-graph replays the Muon step: it needs --optimizer muon")
        if args.assign.strip() == "auto":
            raise UserError("--cuda-graph with --assign auto: a switch of manifolds changes the step the graph holds")
        capturable = args.solver_options.get("capturable", solver_opt_defaults().get("capturable"))
        if capturable is False or (capturable == "auto" and not wants_cuda(args)):
            raise UserError("--cuda-graph needs the sync-free step: --solver-opt capturable=on "
                            "(auto is on only on GPUs)")
    args.grad_accum = grad_accum_steps(args, world_size or int(os.environ.get("WORLD_SIZE", "1")))
    check_fsdp_flags(args, world_size or int(os.environ.get("WORLD_SIZE", "1")))
    # a resumed run's modules first (its config.json), then the flag's: before any manifold name is read
    args.manifold_module = import_manifold_modules(saved_manifold_modules(args) + list(args.manifold_module))
    if args.assign.strip() == "auto":
        if args.auto_base.strip() == "auto":
            raise UserError("--auto-base must be a preset or key=manifold spec, not auto")
        args.assignment = parse_assignment(args.auto_base)
    else:
        args.assignment = parse_assignment(args.assign)


def grad_accum_steps(args, world_size):
    """Micro-steps per optimizer step: --total-batch-size = --batch-size x world_size x accumulation,
    as nanoGPT derives its accumulation from the total batch, so that a run means the same
    optimizer steps on any number of processes."""
    per_micro_step = args.batch_size * world_size
    if args.total_batch_size % per_micro_step:
        total, processes = args.total_batch_size, f"{world_size} process" + ("es" if world_size > 1 else "")
        if total % world_size:
            hint = f"{total} sequences cannot be split evenly over {processes}"
        else:
            per_process = total // world_size
            divisors = [d for d in range(1, per_process + 1) if per_process % d == 0]
            hint = f"--batch-size must divide {per_process} ({', '.join(map(str, divisors[-6:]))}, ...)"
        raise UserError(f"--total-batch-size {total} is not a multiple of --batch-size {args.batch_size} x "
                        f"{processes} = {per_micro_step} sequences: {hint}")
    return args.total_batch_size // per_micro_step


# ----------------------------------------------------------------------------------------
# Distributed setup: torchrun's environment; NCCL on CUDA, gloo on CPU


# The longest a rank waits in one collective before its process group is torn down (NCCL's
# watchdog aborts the communicator; gloo raises): the bound on how long a rank that another one
# left behind holds its GPU. Known failures stop every rank sooner, at the next status exchange
# (exchange_status); this bounds the unknown ones (a hung rank, a lost node). It must exceed the
# longest legitimate skew between ranks: rank 0 writing a checkpoint while the others wait (seconds
# for GPT-2 small), the diagnostics only rank 0 computes at an eval, a slow rank's first compile.
PROCESS_GROUP_TIMEOUT = timedelta(minutes=5)


@dataclass
class DistEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_main(self):
        return self.rank == 0


def init_distributed(args):
    """Join the process group torchrun describes (WORLD_SIZE, RANK, LOCAL_RANK, MASTER_*)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if args.fsdp or (args.resume not in (None, "auto") and os.path.isdir(args.resume)):
        # DTensor and DCP, before the process group as torch.distributed.nn below (only when sharded
        # state is made or read: they cost a second of start-up)
        # (and what their first use imports: DCP's state_dict helpers, torch._dynamo through FSDP2)
        from torch import _dynamo  # noqa: F401  (`from`: see below)
        from torch.distributed import fsdp as _fsdp, tensor as _dtensor  # noqa: F401
        from torch.distributed.checkpoint import state_dict as _dcp  # noqa: F401
    if world_size == 1 and args.fsdp:  # FSDP2 needs a process group, even of one process
        use_cuda = wants_cuda(args)
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=torch.device("cuda", 0) if use_cuda else None)
        return DistEnv()
    if world_size == 1:
        return DistEnv()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = wants_cuda(args)
    if use_cuda:
        torch.cuda.set_device(local_rank)
    # Before init_process_group, on purpose: the functions of torch.distributed.nn.functional take
    # `group=group.WORLD` as a default argument, evaluated at import. DDP's constructor imports it
    # (through torch._dynamo); imported after the group exists, those defaults hold the default group
    # for good, destroy_process_group() cannot free it and its gloo threads live on until interpreter
    # shutdown destroys it. A gloo worker thread still dropping its last finished collective then
    # (a descheduled thread on a busy machine) needs the GIL for the tensors' Python objects; Python
    # ends such a thread with pthread_exit, whose unwinding through a noexcept destructor calls
    # std::terminate: "terminate called without an active exception", SIGABRT after `done:`.
    # Imported now, the defaults are None and destroy_process_group() joins those threads.
    # (`from ... import`, not `import torch.distributed.nn.functional`: that would bind `torch` as a
    # local name of this function, unbound at the torch.cuda.set_device above)
    from torch.distributed.nn import functional  # noqa: F401
    # device_id binds this rank's NCCL communicator to its GPU now (eagerly), not at the first
    # collective, and lets NCCL skip guessing the device from the current one
    dist.init_process_group(backend="nccl" if use_cuda else "gloo", timeout=PROCESS_GROUP_TIMEOUT,
                            device_id=torch.device("cuda", local_rank) if use_cuda else None,
                            **attempt_store(rank, world_size))
    return DistEnv(rank, local_rank, world_size)


def attempt_store(rank, world_size):
    """{store, rank, world_size} for init_process_group when torchrun shares its own store with the
    workers (TORCHELASTIC_USE_AGENT_STORE=True, torchrun's default), else {} (env://). That store
    outlives a restart of the worker group (--max-restarts), and the keys a dead attempt's process
    group left there (each rank's address) would be read by the next attempt's, which then
    connects to dead ranks. A prefix per attempt (TORCHELASTIC_RESTART_COUNT) keeps attempts apart.
    The count is each node's own: on several nodes, set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for
    torchrun instead (docs/checkpoints.md)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    shared = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                           timeout=PROCESS_GROUP_TIMEOUT)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"store": dist.PrefixStore(f"attempt_{attempt}", shared), "rank": rank, "world_size": world_size}


def all_reduce_sum(values, env, device):
    """Sum a list of floats over ranks (identity on one process)."""
    if env.world_size == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


@torch.no_grad()
def replica_max_abs_diff(model, env):
    """max |theta_rank - theta_rank0| over all parameters and ranks (0 on one process; None under
    --fsdp, where ranks hold different parts, not replicas)."""
    if env.world_size == 1:
        return 0.0
    if any(hasattr(p, "full_tensor") for p in model.parameters()):
        return None
    flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    diff = (flat - reference).abs().max()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return float(diff)


# ----------------------------------------------------------------------------------------
# Data: memory-mapped token shards, read in a deterministic order


class TokenStream:
    """The concatenation of a split's shards, read as windows of seq_len + 1 tokens."""

    def __init__(self, paths, vocab_size):
        self.paths = paths
        self.vocab_size = vocab_size
        try:
            self.shards = [ShardReader(p) for p in paths]
        except ShardError as err:
            raise UserError(str(err)) from None
        sizes = np.array([len(s) for s in self.shards], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(sizes)])
        self.total = int(self.offsets[-1])
        if self.total == 0:
            raise UserError(f"{', '.join(paths)}: {'the shard holds' if len(paths) == 1 else 'the shards hold'} "
                            "no tokens (an empty split: see data/prepare.py's warnings)")

    def read(self, start, length):
        """Tokens [start, start + length) of the concatenated stream, as int64."""
        pieces, position = [], start
        while position < start + length:
            shard = int(np.searchsorted(self.offsets, position, side="right")) - 1
            local = position - self.offsets[shard]
            take = min(start + length - position, len(self.shards[shard]) - local)
            try:
                pieces.append(self.shards[shard].read(local, take))
            except ShardError as err:
                raise UserError(str(err)) from None
            position += take
        tokens = np.concatenate(pieces).astype(np.int64)
        if tokens.max(initial=0) >= self.vocab_size:
            raise UserError(f"token id {int(tokens.max())} >= --vocab-size {self.vocab_size} in "
                            f"{self.describe(start)}; the shards do not match this model")
        return tokens

    def fingerprint(self):
        """[(shard file name, token count)]: what a resume compares to tell changed data."""
        return [[os.path.basename(path), len(shard)] for path, shard in zip(self.paths, self.shards)]

    def describe(self, position):
        shard = int(np.searchsorted(self.offsets, position, side="right")) - 1
        return f"{self.paths[shard]} near token {position - self.offsets[shard]}"


def find_shards(data_dir, split):
    if not os.path.isdir(data_dir):
        raise UserError(f"--data-dir {data_dir} does not exist (write shards with data/prepare.py)")
    require_finished(data_dir)
    paths = sorted(glob.glob(os.path.join(data_dir, f"*{split}*.bin")))
    if not paths:
        raise UserError(f"no {split} shards (*{split}*.bin) in --data-dir {data_dir}")
    return paths


class TrainBatches:
    """Deterministic training batches: windows of the train stream in a seeded order.

    The stream is cut into windows of seq_len + 1 tokens at stride seq_len; each epoch visits
    them all in a permutation drawn from (seed, epoch). Global sequence g of the run is window
    perm_e[g mod N] of epoch e = g div N. Step s, micro-step m and rank r read sequences
    s*(world*accum*B) + (m*world + r)*B + [0, B): so N ranks x accumulation K see exactly
    the tokens of 1 rank x accumulation N*K, and the position is a function of the step.
    """

    def __init__(self, stream, seq_len, batch_size, grad_accum, seed, rank=0, world_size=1):
        self.stream, self.T, self.B = stream, seq_len, batch_size
        self.accum, self.seed, self.rank, self.world = grad_accum, seed, rank, world_size
        self.windows = (stream.total - 1) // seq_len
        total_batch = world_size * grad_accum * batch_size
        if self.windows < total_batch:  # else one step would read some sequences twice
            raise UserError(f"the train shards hold {stream.total:,} tokens: fewer than one batch of "
                            f"{total_batch} sequences of {seq_len} (+1) tokens needs")
        self._epoch, self._perm = None, None

    def _window(self, g):
        epoch, index = divmod(g, self.windows)
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.windows, generator=gen).numpy()
            self._epoch = epoch
        return int(self._perm[index])

    def windows_of(self, step, micro):
        """This rank's (B, T + 1) token windows of micro-step `micro` of optimizer step `step`."""
        first = step * self.world * self.accum * self.B + (micro * self.world + self.rank) * self.B
        rows = [self.stream.read(self._window(g) * self.T, self.T + 1) for g in range(first, first + self.B)]
        return torch.from_numpy(np.stack(rows))

    def get(self, step, micro):
        """(inputs, targets) of windows_of(step, micro)."""
        batch = self.windows_of(step, micro)
        return batch[:, :-1], batch[:, 1:]


class Prefetcher:
    """TrainBatches of the loop's micro-steps, in loop order from `start_step`, read ahead.

    A background thread reads the next `depth` micro-batches (pread from the shards, then a stack)
    and, on CUDA, pins them, while the current one computes: a non_blocking copy from pageable
    memory is a synchronous one, from pinned memory it overlaps. One (B, T + 1) copy per
    micro-step; inputs and targets are views of it on the device. The order is fixed by the
    loop, so the batches are exactly those of TrainBatches.get (`next` checks the step it is asked for).
    """

    def __init__(self, batches, start_step, device, depth=2):
        self.batches, self.device, self.pin = batches, device, device.type == "cuda"
        self.order = ((s, m) for s in itertools.count(start_step) for m in range(batches.accum))
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
        self.pending = collections.deque(self._submit() for _ in range(depth))

    def _submit(self):
        step, micro = next(self.order)
        return step, micro, self.pool.submit(self._read, step, micro)

    def _read(self, step, micro):
        batch = self.batches.windows_of(step, micro)
        return batch.pin_memory() if self.pin else batch

    def next(self, step, micro):
        """(inputs, targets) of micro-step `micro` of step `step`, on the device."""
        ahead_step, ahead_micro, future = self.pending.popleft()
        assert (ahead_step, ahead_micro) == (step, micro), "batches asked for out of loop order"
        self.pending.append(self._submit())
        batch = future.result().to(self.device, non_blocking=True)  # re-raises a reader's UserError
        return batch[:, :-1], batch[:, 1:]

    def close(self):
        self.pool.shutdown(wait=True, cancel_futures=True)


# ----------------------------------------------------------------------------------------
# Optimizers: ManifoldMuon for the block matrices, AdamW for everything else


def layer_of(name):
    return int(name.split(".")[1])  # "blocks.<layer>.attn.c_attn.weight"


def layer_assignments(args, auto):
    return [auto.layer_assignment(args.assignment, layer) if auto else dict(args.assignment)
            for layer in range(args.n_layer)]


def build_model(args, device, dtype):
    """The GPT of `args` on `device`, initialised from --seed (the same on every rank). Under --fsdp
    (before the optimizers: they take the sharded parameters) it is built on the meta device,
    sharded, and materialised rank by rank with the same weights (training/meta_init.py)."""
    cfg = GPTConfig(args.n_layer, args.n_head, args.n_embd, args.seq_len, args.vocab_size, qk_norm=args.qk_norm,
                    attn_softcap=args.attn_softcap)
    torch.manual_seed(args.seed)
    if args.fsdp:
        return build_sharded(lambda: GPT(cfg), device, dtype, args.fsdp_shard_ranks, args.seed)
    return GPT(cfg).to(device)


def build_optimizers(model, args, device, auto=None):
    # the one path from an assignment to Muon's groups (manifolds.param_groups, as for any model);
    # it projects the GPT-2 init onto the manifolds
    groups, rest = manifold_param_groups(model, layer_assignments(args, auto), args.dgram_cap)
    if args.optimizer != "muon":  # --optimizer adamw: Muon keeps one empty group (the loop stays the same)
        groups, rest = [{"params": [], "manifold": "none"}], list(model.parameters())
    muon = ManifoldMuon(groups, lr=args.muon_lr, momentum=args.momentum, nesterov=True,
                        weight_decay=args.weight_decay, backend=args.kernels, dgram_cap=args.dgram_cap,
                        precision=args.solver_precision, **args.solver_options, **args.exchange_options)
    adamw_groups = [{"params": [p for p in rest if p.dim() >= 2], "weight_decay": args.weight_decay},
                    {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}]
    adamw = torch.optim.AdamW(adamw_groups, lr=args.lr, betas=(0.9, 0.95),
                              fused=device.type == "cuda")
    return muon, adamw


def lr_at(step, args):
    """AdamW learning rate: linear warmup, then cosine decay from --lr to --min-lr."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps)
    return args.min_lr + 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))) * (args.lr - args.min_lr)


def max_violations(matrices, args, muon=None):
    """{manifold: max violation over the Muon matrices (or row blocks) assigned to it}; a
    Hyperball matrix against the radius `muon` keeps for it (0 without one)."""
    radii = stored_radii(muon, matrices) if muon is not None else {}
    out = {}
    for name, p, _, blocks, transposed in (Matrix(*matrix) for matrix in matrices):
        p = whole(p.detach())  # under --fsdp gathered one matrix at a time, on every rank
        for _, lo, hi, manifold in blocks:
            violation = manifold_violation(p[lo:hi], manifold, args.dgram_cap, transposed, radius=radii.get((name, lo)))
            # NaN (blown-up weights) must win: max() would silently drop it
            out[manifold] = max(out.get(manifold, 0.0), violation, key=lambda v: math.inf if math.isnan(v) else v)
    return out


# ----------------------------------------------------------------------------------------
# Evaluation: a fixed prefix of the validation stream


def val_windows(stream, args):
    """Sequences an evaluation reads: the first --eval-tokens of the val stream, at least one."""
    windows = min(args.eval_tokens, stream.total - 1) // args.seq_len
    if windows <= 0 and args.eval_tokens < stream.total - 1:
        raise UserError(f"--eval-tokens {args.eval_tokens} is less than one sequence of {args.seq_len} tokens")
    if windows <= 0:
        raise UserError(f"the val shards hold {stream.total} tokens: fewer than one sequence of "
                        f"{args.seq_len} (+1) tokens; prepare more validation data or lower --seq-len")
    return windows


@torch.no_grad()
def evaluate(model, stream, args, device, autocast, env=DistEnv(), probe=None):
    """Mean loss over the first --eval-tokens tokens of the val shards (windows in order;
    rank r of N takes windows r, r + N, ...; the sums are all-reduced). A `probe` (context
    manager) watches the forward pass of this rank's first batch."""
    windows = val_windows(stream, args)
    mine = list(range(env.rank, windows, env.world_size))
    model.eval()
    total, count = 0.0, 0
    for first in range(0, len(mine), args.batch_size):
        rows = [stream.read(w * args.seq_len, args.seq_len + 1) for w in mine[first:first + args.batch_size]]
        batch = torch.from_numpy(np.stack(rows)).to(device)
        with autocast, probe if probe is not None and first == 0 else contextlib.nullcontext():
            loss = model(batch[:, :-1], batch[:, 1:])
        total += loss.item() * len(rows)
        count += len(rows)
    model.train()
    total, count = all_reduce_sum([total, count], env, device)
    return total / count, windows * args.seq_len


def evaluate_and_diagnose(model, matrices, stream, args, device, autocast, env=DistEnv(), radii=None):
    """evaluate(), plus on rank 0 the diagnostics of training/diagnostics.py (attention logits
    and softmax saturation of the first val batch; singular values, manifold violation and DGram
    column norms of every Muon matrix; a Hyperball's violation against `radii`, stored_radii) and
    what they cost: `eval_ms` is the loss pass alone,
    `diagnostics_ms` the time the diagnostics added to it."""
    t0 = time.perf_counter()
    probe = (AttentionProbe([block.attn.c_attn for block in model.blocks], args.n_head,
                            [block.attn for block in model.blocks]) if env.is_main else None)
    val_loss, eval_tokens = evaluate(model, stream, args, device, autocast, env, probe)
    t1 = time.perf_counter()
    # under --fsdp the weights' statistics need each matrix gathered whole, by every rank
    weights = gathered_matrix_stats(matrices, args.dgram_cap, env.is_main, radii) if args.fsdp else None
    if probe is None:
        return val_loss, eval_tokens, {}
    fields = {**probe.results(), **(weights if weights is not None else matrix_stats(matrices, args.dgram_cap, radii))}
    weights_ms = 1000 * (time.perf_counter() - t1)
    return val_loss, eval_tokens, {**fields, "eval_ms": 1000 * (t1 - t0) - probe.ms,
                                   "diagnostics_ms": probe.ms + weights_ms}


# ----------------------------------------------------------------------------------------
# Device


def wants_cuda(args):
    return args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())


def resolve_device(args, env=DistEnv()):
    if wants_cuda(args):
        if not torch.cuda.is_available():
            raise UserError("--device cuda was asked for but no CUDA device is available")
        device = torch.device("cuda", env.local_rank)
    else:
        device = torch.device("cpu")
    check_backend(args.kernels, device)
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    if dtype == "bfloat16":
        autocast = torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    else:
        autocast = contextlib.nullcontext()
    return device, dtype, autocast


def synchronize(device):
    """Wait for the device's queued work (what a step's wall time must include)."""
    if device.type == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------
# The run: setup -> steps (train step, log, eval, divergence check, checkpoint) -> summary


def main(argv=None):
    args = parse_args(argv)
    validate_args(args)
    check_out_dir(args)
    check_wandb_login(args)
    env = init_distributed(args)
    failure = None
    try:
        with contextlib.ExitStack() as cleanup:
            summary = train(args, env, cleanup)
    except (UserError, WriteError) as err:
        # Its traceback holds the run's frames, and through them DDP and the process group's
        # pending work: freed now, before the group is destroyed, not at interpreter shutdown,
        # where freeing them hung the exit of a rank that stopped on an exchanged failure
        failure = err.with_traceback(None)
        del err
        gc.collect()
    finally:
        if dist.is_available() and dist.is_initialized():  # --fsdp in one process has a group too
            # FSDP2's modules, DTensors and their collectives' work sit in reference cycles: freed
            # now, while the group's threads can still finish them, not at interpreter shutdown
            # (where a gloo thread ending mid-cleanup aborts the process: "terminate called ...")
            gc.collect()
            dist.destroy_process_group()
    if failure is not None:
        raise failure
    if summary["status"] == "diverged" and args.on_diverge == "stop":
        sys.exit(EXIT_DIVERGED)
    if summary["status"] == "interrupted":
        sys.exit(EXIT_INTERRUPTED)
    return summary


def train(args, env, cleanup):
    """The run; `cleanup` (contextlib.ExitStack) takes what must be undone when it ends (the lock).
    A failed write of rank 0 (WriteError) ends the loop on every rank at the same step; the summary
    is still written, then the error is raised again on every rank (exit status 5)."""
    run = setup(args, env, cleanup)
    stop = StopRequest().install()
    prefetch = Prefetcher(run.batches, run.start_step, run.device)
    start, write_failure = time.time(), None
    try:
        status = run_steps(run, prefetch, stop)
    except WriteError as err:  # every rank raises the same one (exchange_status)
        status, write_failure = "write_failed", err
    finally:
        stop.uninstall()
        prefetch.close()
    return finish(run, status, write_failure, wall_s=time.time() - start)


@dataclass
class Run:
    """What the phases of one run share. `setup` builds it; the loop updates the losses, the
    assigned matrices (--assign auto's switches), the steps done and the divergence record."""
    args: argparse.Namespace
    env: DistEnv
    say: object                    # print on rank 0, nothing elsewhere
    device: torch.device
    autocast: object               # the forward's autocast context (or a null one)
    train_stream: TokenStream
    val_stream: TokenStream
    batches: TrainBatches
    model: GPT
    muon: ManifoldMuon
    adamw: torch.optim.AdamW
    matrices: list                 # assigned_matrices of the current assignment
    auto: AutoAssign = None        # --assign auto
    qk_clip: QKClip = None         # --qk-clip
    step_model: nn.Module = None   # what the forward runs: the model, compiled and in DDP as asked
    muon_step: object = None       # muon.step, or its replay from a CUDA graph (--cuda-graph on)
    log: RunLog = None             # rank 0's metrics log
    start_step: int = 0
    steps_done: int = 0
    best_val: float = math.inf
    val_loss: float = None
    train_loss: float = None
    diverged: dict = None          # the first divergence: its step and diagnostics
    skipped_steps: int = 0         # steps not applied for a non-finite gradient norm (training/nonfinite.py)
    skipped_in_row: int = 0        # ... the last of them in a row
    failure: Exception = None      # this rank's error (WriteError, UserError) not yet told to the others

    @property
    def graphed(self):
        return self.args.cuda_graph == "on"

    @property
    def tokens_per_step(self):
        return self.args.total_batch_size * self.args.seq_len


@dataclass
class StepRecord:
    """What one training step reports besides the loss (run.train_loss)."""
    lr: float
    grad_norm: torch.Tensor        # before clipping
    skipped: bool                  # not applied: the gradient norm was not finite (training/nonfinite.py)
    stop: bool                     # a stop was requested on some rank
    seconds: float                 # the whole step
    opt_seconds: float             # the optimizers' share


# --- setup: data, run folder, model, optimizers, resume -----------------------------------


def setup(args, env, cleanup):
    """Everything the loop needs, at the step it starts from."""
    device, dtype, autocast = resolve_device(args, env)
    train_stream = TokenStream(find_shards(args.data_dir, "train"), args.vocab_size)
    val_stream = TokenStream(find_shards(args.data_dir, "val"), args.vocab_size)
    batches = TrainBatches(train_stream, args.seq_len, args.batch_size, args.grad_accum, args.seed,
                           env.rank, env.world_size)
    val_windows(val_stream, args)  # too short a val split is an error now, not at the first eval
    say = print if env.is_main else (lambda *a, **k: None)
    open_out_dir(args, env, cleanup, say)
    find = find_sharded_resume if args.fsdp else find_resume_checkpoint
    resume_path, payload = find(args, say) if args.resume else (None, None)

    model = build_model(args, device, dtype)
    auto = None
    if args.assign.strip() == "auto":
        auto = AutoAssign(args.n_layer, args.auto_logit_max, args.auto_saturation, args.auto_sigma_growth)
        if payload is not None:  # the switches taken so far shape the optimizer's groups
            auto.load_state_dict(payload["auto"])
    muon, adamw = build_optimizers(model, args, device, auto)
    matrices = assigned_matrices(model, layer_assignments(args, auto))
    qk_clip = QKClip([block.attn for block in model.blocks], matrices, args.qk_clip, env.world_size > 1,
                     optimizer=muon) if args.qk_clip else None
    run = Run(args=args, env=env, say=say, device=device, autocast=autocast, train_stream=train_stream,
              val_stream=val_stream, batches=batches, model=model, muon=muon, adamw=adamw, matrices=matrices, auto=auto,
              qk_clip=qk_clip)
    if payload is not None:
        resume(run, payload, resume_path)
    run.step_model = forward_model(model, args, env, device)
    try:  # under --resume, also when auto found no checkpoint: rows of an attempt that wrote none go
        describe(run, dtype, resumed=args.resume is not None)
    except (WriteError, UserError) as err:  # rank 0's config.json, metrics.jsonl or wandb
        keep_failure(run, err)
    exchange_status(run)
    run.muon_step = muon.step
    if run.graphed:
        lr_in_device_tensors(muon, device)
        run.muon_step = StepGraph(muon.step, device)
    run.steps_done = run.start_step
    return run


def open_out_dir(args, env, cleanup, say):
    """Create --out-dir and hold its lock for the run (rank 0); clear leftovers and, under
    --overwrite, the previous run; on several processes check that every rank sees the folder."""
    if env.is_main:
        try:
            os.makedirs(args.out_dir, exist_ok=True)
        except OSError as err:
            raise UserError(f"cannot create --out-dir {args.out_dir}: {err.strerror}") from None
        cleanup.callback(RunLock(args.out_dir).acquire().release)  # one run per folder, until we return
        leftovers = remove_leftovers(args.out_dir)
        if leftovers:
            say(f"removed {len(leftovers)} temporary file(s) of an unfinished write: {', '.join(leftovers)}")
        if args.overwrite:
            clear_run(args.out_dir)
    if env.world_size > 1:
        check_shared_out_dir(args.out_dir, env.rank, env.world_size)


def resume(run, payload, path):
    """Continue from a checkpoint: weights, optimizer states, RNGs, QK-Clip, losses and step."""
    if run.qk_clip is not None and "qk_clip" in payload:
        run.qk_clip.load_state_dict(payload["qk_clip"])
    if os.path.isdir(path):  # an --fsdp run's DCP folder, into this run's layout at any number of ranks
        check_resumable(payload, run.args)
        if not run.args.fsdp:
            run.muon.init_state()  # every key of the sharded state, so that DCP loads them
        load_sharded(path, run.model, [run.muon, run.adamw])
        solver_changes = restore_run(payload, run.args)
    elif run.args.fsdp:  # a one-file checkpoint (DDP or one process) into the sharded model
        check_resumable(payload, run.args)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        set_model_state_dict(run.model, payload["model"], options=StateDictOptions(full_state_dict=True))
        run.adamw.load_state_dict(shard_full_state(run.adamw, payload["adamw"]))
        load_muon_state(run.muon, shard_full_state(run.muon, payload["muon"]))
        solver_changes = restore_run(payload, run.args)
    else:
        solver_changes = restore(payload, run.model, run.adamw, run.muon, run.args)
    if solver_changes:
        run.say("note: solver options differ from the checkpoint's; this run's apply: "
                + ", ".join(f"{k} {old} -> {new}" for k, (old, new) in solver_changes.items()))
    if payload.get("train_shards", run.train_stream.fingerprint()) != run.train_stream.fingerprint():
        run.say(f"warning: the train shards in {run.args.data_dir} are not those of the checkpoint (files or "
                "token counts differ): the resumed run reads other data than the original would have",
                file=sys.stderr)
    run.start_step, run.best_val = payload["step"], payload["best_val_loss"]
    run.val_loss, run.train_loss = payload["val_loss"], payload["train_loss"]
    # checkpoints from before skipped steps were counted hold neither count
    run.skipped_steps, run.skipped_in_row = payload.get("skipped_steps", 0), payload.get("skipped_in_row", 0)
    run.say(f"resuming from {path} at step {run.start_step}")


def forward_model(model, args, env, device):
    """The module the training forward runs: `model`, compiled under --compile, and on several
    processes in DDP (the gradient all-reduce, bucketed and overlapped with the backward) unless
    --fsdp sharded it (its reduce-scatters are hooked into the backward already)."""
    step_model = torch.compile(model) if args.compile else model
    if env.world_size > 1 and not args.fsdp:
        # broadcast_buffers=False: the only buffers are QK-Clip's per-rank logit maxima (reduced in QKClip.step)
        step_model = DDP(step_model, device_ids=[env.local_rank] if device.type == "cuda" else None,
                         broadcast_buffers=False)
    return step_model


def describe(run, dtype, resumed):
    """The run's first lines (model, data, the solver's plan); on rank 0 config.json and the metrics
    log (opened for appending)."""
    args, env = run.args, run.env
    n_params = sum(p.numel() for p in run.model.parameters())
    comm_bytes = communication_bytes_per_step(run.model, run.muon, env, run.args, run.device, dtype)
    run.say(f"GPT-2 {args.n_layer}L {args.n_head}H {args.n_embd}D, {n_params / 1e6:.2f}M parameters, "
            f"{run.device.type} {dtype}, {env.world_size} process(es); assign {args.assign}: "
            + ", ".join(f"{k}={v}" for k, v in args.assignment.items()))
    run.say(f"data: {run.train_stream.total:,} train / {run.val_stream.total:,} val tokens; "
            f"{run.tokens_per_step:,} tokens per step ({args.total_batch_size} x {args.seq_len}: {args.batch_size} "
            f"per process x {env.world_size} x {args.grad_accum} accumulation), {args.max_steps} steps"
            + (f"; {comm_bytes / 2**20:.1f} MiB received per rank per step" if comm_bytes else ""))
    run.say(run.muon.plan.summary())
    if env.is_main:
        write_json(os.path.join(args.out_dir, "config.json"),
                   {**vars(args), "device_resolved": run.device.type, "dtype_resolved": dtype,
                    "world_size": env.world_size, "n_params": n_params,
                    "tokens_per_step": run.tokens_per_step, "comm_bytes_per_step": comm_bytes,
                    "solver": run.muon.plan.as_dict()})
        run.log = RunLog(args.out_dir, args, resume_step=run.start_step if resumed else None)


def communication_bytes_per_step(model, muon, env, args=None, device=None, dtype="float32"):
    """Bytes each rank receives per optimizer step. DDP: the ring all-reduce of the gradients
    (2 (N-1)/N of the gradient bytes) plus the all-gather of the Muon banks ((N-1)/N of the
    padded bank bytes), fp32. --fsdp: FSDP2's two all-gathers of the parameters (bf16 on CUDA
    with a bf16 forward, else fp32) and reduce-scatter of the gradients (fp32) over the shard
    group of P ranks, (P-1)/P of each; across HSDP's R replicas the all-reduce of the gradient
    shards, 2 (R-1)/R; and ManifoldMuon's steady exchange (manifolds/exchange.py)."""
    n = env.world_size
    if n == 1:
        return 0
    params = list(dict.fromkeys(model.parameters()))
    if any(hasattr(p, "full_tensor") for p in params):
        from manifolds.exchange import steady_received_bytes
        numel = sum(p.numel() for p in params)
        group = args.fsdp_shard_ranks or n
        replicas = n // group
        gather = 2 if device.type == "cuda" and dtype == "bfloat16" else 4  # training/fsdp.shard_model's policy
        fsdp = (group - 1) / group * numel * (2 * gather + 4) + 2 * (replicas - 1) / replicas * 4 * numel / group
        return int(fsdp + steady_received_bytes(muon))
    grads = 4 * sum(p.numel() for p in model.parameters())
    banks = 4 * muon.all_gather_elements()
    return int(2 * (n - 1) / n * grads + (n - 1) / n * banks)


# --- the steps ------------------------------------------------------------------------------


def run_steps(run, prefetch, stop):
    """Steps from run.start_step to --max-steps: each trains, logs, evaluates every --eval-every
    steps, checks for divergence and checkpoints every --ckpt-every steps. A divergence under
    --on-diverge stop or a stop request (a signal on any rank) ends the loop early. Returns the
    run's status: completed, diverged or interrupted. A rank's failure is raised on every rank
    at the next status exchange: after the step's loss reduction, an eval or a checkpoint."""
    args, saved_step = run.args, run.start_step
    for step in range(run.start_step, args.max_steps):
        run.steps_done = step + 1
        record = train_step(run, step, prefetch, stop)
        injected_fault(run, step)
        count_skipped(run, record)
        log_step(run, step, record)
        stop_after_skipped_steps(run, step)
        evaluated = (step + 1) % args.eval_every == 0 or step + 1 == args.max_steps
        if evaluated and math.isfinite(run.train_loss):
            evaluate_and_log(run, step)
            exchange_status(run)
        # a skipped step's loss (NaN where its forward was) is no divergence: the weights did not move
        if run.diverged is None and not record.skipped and check_divergence(run, step, record, evaluated) \
                and args.on_diverge == "stop":
            return "diverged"
        if evaluated and run.val_loss is not None and math.isfinite(run.val_loss):
            run.best_val = min(run.best_val, run.val_loss)
        if record.stop or (args.ckpt_every and (step + 1) % args.ckpt_every == 0):
            save(run, step + 1)
            saved_step = step + 1
        if record.stop:
            run.say(f"stopped by {stop.signal or 'another rank'} after step {step + 1}; "
                    f"resume with --resume auto", file=sys.stderr, flush=True)
            return "interrupted"
    if saved_step != args.max_steps:
        save(run, args.max_steps)  # the final weights, and a resumable end state
    return "completed"


def train_step(run, step, prefetch, stop):
    """Optimizer step `step` (from 0): the scheduled lr, forward and backward over the
    micro-batches, the gradient clip, AdamW, the Muon step and QK-Clip. Sets run.train_loss
    (the mean over ranks)."""
    args, t0 = run.args, time.perf_counter()
    lr = set_lr(run, step)
    loss_sum = torch.zeros((), device=run.device)
    for micro in range(args.grad_accum):
        x, y = next_batch(run, prefetch, step, micro)
        last = micro == args.grad_accum - 1
        # gradients are all-reduced once, on the last micro-step; under --fsdp reduce-scattered on
        # every micro-step (--fsdp-grad-sync every: only shards are held) or on the last
        if args.fsdp:
            run.model.set_requires_gradient_sync(last or args.fsdp_grad_sync == "every")
        with contextlib.nullcontext() if last or run.env.world_size == 1 or args.fsdp else run.step_model.no_sync():
            with run.autocast:
                loss = run.step_model(x, y) / args.grad_accum
            loss.backward()
        loss_sum += loss.detach()
    injected_nan_gradient(run, step)
    # a non-finite norm makes every gradient NaN: the optimizers leave what it reaches as it was,
    # decided on the device (training/nonfinite.py); the host reads the flag with the loss below
    grad_norm, finite = clip_or_mark(run.model.parameters(), args.grad_clip or math.inf)
    grad_norm, finite = whole(grad_norm), whole(finite)
    synchronize(run.device)
    t_opt = time.perf_counter()
    adamw_step(run.adamw, finite)
    # --fsdp: the sharded Muon step has no mask per matrix (a shard sees only its part of a
    # gradient), so the flag is read here: one host sync a step more (training/nonfinite.py)
    if not (args.fsdp and not bool(finite)):
        run.muon_step()
    if run.qk_clip is not None:
        forget_logits(run.qk_clip, finite)
        run.qk_clip.step()
    run.adamw.zero_grad(set_to_none=True)
    run.muon.zero_grad(set_to_none=not run.graphed)  # a graph reads the gradients it was captured with
    synchronize(run.device)
    t1 = time.perf_counter()
    # one reduction carries the loss, whether any rank was asked to stop and whether any failed;
    # the skip flag is read with the loss (one read, after the step), the same on every rank
    loss_value, skipped = torch.stack([loss_sum.float(), (~finite).float().to(loss_sum.device)]).tolist()
    loss_total, stops, failed = all_reduce_sum([loss_value, float(stop.requested), float(run.failure is not None)],
                                               run.env, run.device)
    if failed:
        exchange_status(run)
    run.train_loss = loss_total / run.env.world_size
    return StepRecord(lr=lr, grad_norm=grad_norm, skipped=skipped > 0, stop=stops > 0, seconds=t1 - t0,
                      opt_seconds=t1 - t_opt)


def count_skipped(run, record):
    """The run's count of skipped steps, and of those in a row (training/nonfinite.py)."""
    if record.skipped:
        run.skipped_steps += 1
        run.skipped_in_row += 1
    else:
        run.skipped_in_row = 0


def stop_after_skipped_steps(run, step):
    """--max-skipped-steps skipped steps in a row stop the run (every rank: the flag is global)."""
    n = run.skipped_in_row
    if n >= run.args.max_skipped_steps:
        raise UserError(f"{n} steps in a row (steps {step + 2 - n}-{step + 1}) had a non-finite gradient norm and "
                        f"were skipped (--max-skipped-steps {run.args.max_skipped_steps}); the weights are those "
                        f"after step {step + 1 - n}. Lower --lr / --muon-lr, check the data, or resume from a "
                        f"checkpoint")


def next_batch(run, prefetch, step, micro):
    """(inputs, targets) of the micro-step. A shard this rank cannot read (changed, truncated, a
    token out of range) is kept as its failure and a batch of zeros stands in, so that the step's
    collectives (DDP's gradient reduction) still meet the other ranks; the step's reduction then
    stops every rank with it."""
    try:
        return prefetch.next(step, micro)
    except UserError as err:
        if run.env.world_size == 1:
            raise
        keep_failure(run, err)
        zeros = torch.zeros(run.args.batch_size, run.args.seq_len, dtype=torch.long, device=run.device)
        return zeros, zeros


def set_lr(run, step):
    """The schedule's lr at `step` for AdamW, scaled by --muon-lr / --lr for Muon; returns AdamW's."""
    args, lr = run.args, lr_at(step, run.args)
    for group in run.adamw.param_groups:
        group["lr"] = lr
    for group in run.muon.param_groups:  # a replayed graph reads the lr from its tensor
        if run.graphed:
            group["lr"].fill_(args.muon_lr * lr / args.lr)
        else:
            group["lr"] = args.muon_lr * lr / args.lr
    return lr


def log_step(run, step, record):
    """The step's metrics row (rank 0) and, every --log-every steps and at the first, its line."""
    tokens_per_s, step_ms, opt_ms = run.tokens_per_step / record.seconds, 1000 * record.seconds, 1000 * record.opt_seconds
    if run.log:
        solver = run.muon.stats()  # this rank's share of every bank; reading it syncs the device
        # matrices that took the sync-free precision fallback (rare; only logged when it happens)
        fallbacks = {bank: s["fallbacks"] for bank, s in solver.items() if s["fallbacks"]}
        log_row(run, step=step + 1, train_loss=run.train_loss, lr=record.lr, grad_norm=float(record.grad_norm),
                    skipped=record.skipped, skipped_steps=run.skipped_steps,
                    tokens_per_s=tokens_per_s, step_ms=step_ms, opt_ms=opt_ms,
                solver_iterations={bank: s["iterations"] for bank, s in solver.items()},
                solver_residual={bank: s["residual"] for bank, s in solver.items()},
                **({"solver_fallbacks": fallbacks} if fallbacks else {}))
    if record.skipped:
        run.say(f"step {step + 1:6d}: gradient norm {float(record.grad_norm)}: step skipped, weights and optimizer "
                f"state as they were ({run.skipped_in_row} in a row, {run.skipped_steps} in all)", file=sys.stderr,
                flush=True)
    if (step + 1) % run.args.log_every == 0 or step == run.start_step:
        run.say(f"step {step + 1:6d}/{run.args.max_steps} | loss {run.train_loss:.4f} | lr {record.lr:.2e} | "
                f"{step_ms:7.1f} ms (optimizer {opt_ms:6.1f}) | {tokens_per_s:,.0f} tok/s", flush=True)


def evaluate_and_log(run, step):
    """The eval after step `step`: val loss and diagnostics (run.val_loss), their row and line,
    and --assign auto's switches."""
    run.val_loss, eval_tokens, fields = evaluate_and_diagnose(run.model, run.matrices, run.val_stream, run.args,
                                                              run.device, run.autocast, run.env,
                                                              stored_radii(run.muon, run.matrices))
    replica_diff = replica_max_abs_diff(run.model, run.env)
    if run.args.fsdp:  # HSDP: replicas bitwise equal, or every rank stops with ReplicaDrift
        check_replicas(run.model)
    if run.qk_clip is not None:
        fields.update(run.qk_clip.stats())
    if run.log:
        log_row(run, step=step + 1, val_loss=run.val_loss, eval_tokens=eval_tokens,
                replica_max_abs_diff=replica_diff, **fields)
    run.say(f"step {step + 1:6d} | val loss {run.val_loss:.4f} ({eval_tokens:,} tokens)"
            + (f" | replicas differ by {replica_diff:.1e}" if replica_diff is not None and run.env.world_size > 1
               else ""), flush=True)
    if run.auto is not None:
        auto_switch(run, step, fields)


def auto_switch(run, step, fields):
    """--assign auto at an eval: rank 0 decides from its diagnostics `fields`, every rank applies
    the switches: Stiefel attention for those layers (weights projected, dual state reset,
    momentum kept), new assigned matrices for Muon's groups and QK-Clip, a row and line per switch."""
    args, env = run.args, run.env
    new = run.auto.decide(step + 1, fields) if env.is_main else None
    if env.world_size > 1:
        box = [new]
        dist.broadcast_object_list(box, src=0)
        new = box[0]
    if not new:
        return
    run.auto.apply(new)
    run.matrices = assigned_matrices(run.model, layer_assignments(args, run.auto))
    switched = {name for name, *_ in run.matrices if layer_of(name) in {s["layer"] for s in new}}
    project_matrices(run.matrices, args.dgram_cap, only=switched)
    if env.world_size > 1:  # bitwise-equal replicas whatever the SVD does on each rank
        for name, p, *_ in run.matrices:
            if name in switched:
                dist.broadcast(p.data, src=0)
    run.muon.reassign(muon_groups(run.matrices, args.dgram_cap))
    if run.qk_clip is not None:
        run.qk_clip.follow(run.matrices)
    for switch in new:
        run.say(f"step {step + 1:6d} | auto: layer {switch['layer']} attention -> stiefel ({switch['reason']})",
                flush=True)
        if run.log:
            log_row(run, **switch, event="auto_switch")


def check_divergence(run, step, record, evaluated):
    """A non-finite loss, or one above --diverge-factor x the best val loss so far, is a divergence:
    run.diverged records it (with what a post-mortem needs first) and diverged_<step>.pt the
    state. Returns whether the run diverged at this step."""
    worst = max(run.train_loss, run.val_loss if evaluated and run.val_loss is not None else -math.inf)
    if math.isfinite(worst) and worst <= run.args.diverge_factor * run.best_val:
        return False
    run.diverged = {"step": step + 1, "train_loss": run.train_loss, "lr": record.lr,
                    "grad_norm": float(record.grad_norm),
                    "param_max_abs": max(float(p.detach().abs().max()) for p in run.model.parameters()),
                    "max_manifold_violation": max_violations(run.matrices, run.args, run.muon)}
    run.say(f"step {step + 1}: diverged (loss {worst:.4g}, best val {run.best_val:.4g}); "
            f"post-mortem checkpoint diverged_{step + 1:08d}.pt", file=sys.stderr, flush=True)
    save(run, step + 1, prefix="diverged")
    return True


# --- checkpoint and summary -------------------------------------------------------------------


def save(run, steps_done, prefix="ckpt"):
    """Checkpoint the run after `steps_done` steps: ckpt_<steps>.pt in the rotation of
    --keep-ckpts, or <prefix>_<steps>.pt. Every rank holds Muon's whole state (DDP), so rank 0
    writes what it has; the call is still a collective: a failed write stops every rank here
    (exchange_status)."""
    if run.args.fsdp:
        check_replicas(run.model)  # HSDP: a checkpoint of drifted replicas would keep one of them
        save_sharded_checkpoint(run, steps_done, prefix)
        return
    muon_state = run.muon.consolidated_state_dict()
    if run.env.is_main:
        losses = run_counters(run)
        state = checkpoint_payload(steps_done, run.model, run.adamw, muon_state, losses, run.args)
        state["train_shards"] = run.train_stream.fingerprint()
        if run.auto is not None:
            state["auto"] = run.auto.state_dict()
        if run.qk_clip is not None:
            state["qk_clip"] = run.qk_clip.state_dict()
        try:
            if prefix == "ckpt":
                save_checkpoint(state, run.args.out_dir, steps_done, run.args.keep_ckpts,
                                injected_write_fault(steps_done))
            else:
                save_atomic(state, checkpoint_path(run.args.out_dir, steps_done, prefix))
        except WriteError as err:
            keep_failure(run, err)
    exchange_status(run)


def run_counters(run):
    """What a checkpoint keeps of the loop's own state: the losses, and the skipped steps' counts
    (so that a resumed run's --max-skipped-steps counts on from the ones in a row before it)."""
    return {"best_val_loss": run.best_val, "val_loss": run.val_loss, "train_loss": run.train_loss,
            "skipped_steps": run.skipped_steps, "skipped_in_row": run.skipped_in_row}


def save_sharded_checkpoint(run, steps_done, prefix):
    """save() under --fsdp: a DCP folder (training/sharded_checkpoints.py); every rank writes its shards."""
    losses = run_counters(run)
    payload = {**run_payload(steps_done, losses, run.args), "train_shards": run.train_stream.fingerprint()}
    try:
        save_sharded(sharded_checkpoint_path(run.args.out_dir, steps_done, prefix), run.model, [run.muon, run.adamw],
                     payload, keep=run.args.keep_ckpts if prefix == "ckpt" else None)
    except WriteError as err:
        keep_failure(run, err)
    exchange_status(run)


def finish(run, status, write_failure, wall_s):
    """The run's summary: summary.json and its line (rank 0); returned, or after a failed write
    of rank 0 (`write_failure`) raised again once the summary is written."""
    summary = {"status": status, "steps": run.steps_done, "tokens": run.steps_done * run.tokens_per_step,
               "final_val_loss": run.val_loss, "final_train_loss": run.train_loss,
               "max_manifold_violation": max_violations(run.matrices, run.args, run.muon),
               "world_size": run.env.world_size, "diverged": run.diverged, "skipped_steps": run.skipped_steps,
               "wall_s": wall_s,
               # a collective: not after a failed write, which only rank 0 met
               "replica_max_abs_diff": replica_max_abs_diff(run.model, run.env) if write_failure is None else None}
    if write_failure is not None:
        summary["error"] = str(write_failure)
    if run.auto is not None:
        summary["auto_switches"] = run.auto.switches
    if run.device.type == "cuda":  # this rank's peak of tensors allocated (the caching allocator reserves more)
        summary["peak_memory_gb"] = torch.cuda.max_memory_allocated(run.device) / 2**30
    if run.log:
        try:
            write_json(os.path.join(run.args.out_dir, "summary.json"), summary)
            run.log.close()
            run.say(f"done: {json.dumps(summary)}")
        except WriteError as err:
            keep_failure(run, err)
    if write_failure is not None:
        raise write_failure  # every rank holds it already: no collective
    exchange_status(run)  # rank 0's summary.json
    return summary


# --- one rank's failure stops every rank ------------------------------------------------------


FAILURE_TYPES = {"WriteError": WriteError, "UserError": UserError}


def keep_failure(run, err):
    """Hold this rank's first failure until the next status exchange (the other ranks go on to it)."""
    if run.failure is None:
        run.failure = err


def exchange_status(run):
    """A collective at the same point on every rank: after the setup, each eval, each checkpoint
    and the summary, and after a step whose reduction said that some rank failed. If any rank
    holds a failure, every rank raises the lowest failing rank's error, its type and message
    (rank 0's when rank 0 failed), so that all stop at the same step with the same `error:` line
    and exit status instead of waiting in their next collective for the process group's timeout."""
    env = run.env
    if env.world_size == 1:
        if run.failure is not None:
            raise run.failure
        return
    first = torch.tensor([env.rank if run.failure is not None else env.world_size], device=run.device)
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    source = int(first.item())
    if source == env.world_size:
        return
    box = [(type(run.failure).__name__, str(run.failure)) if env.rank == source else None]
    dist.broadcast_object_list(box, src=source)
    kind, message = box[0]
    raise FAILURE_TYPES.get(kind, UserError)(message + (f" (on rank {source})" if source else ""))


def log_row(run, **fields):
    """A metrics row (rank 0). A failed write is kept for the next status exchange; no row follows it."""
    if run.log is None or run.failure is not None:
        return
    try:
        run.log.row(**fields)
    except WriteError as err:
        keep_failure(run, err)


def injected_fault(run, step):
    """Fault injection for tests only, off unless the environment asks (tests/test_elastic.py):
    rank MMUON_FAULT_RANK kills itself with SIGKILL, as the OOM killer or a lost node would, right
    after step MMUON_FAULT_STEP (counted from 1), in the first attempt of a torchrun job only
    (TORCHELASTIC_RESTART_COUNT unset or 0), so that the restarted job runs through."""
    at = os.environ.get("MMUON_FAULT_STEP")
    if (at is not None and step + 1 == int(at) and run.env.rank == int(os.environ.get("MMUON_FAULT_RANK", "0"))
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
        os.kill(os.getpid(), signal.SIGKILL)


def injected_nan_gradient(run, step):
    """Fault injection for tests only, off unless the environment asks (tests/test_reliability.py):
    MMUON_NAN_GRAD_STEPS=N[,M...] (counted from 1) puts a NaN in one entry of the first gradient of
    those steps, after the backward (on every rank: under DDP the all-reduce would spread it)."""
    at = os.environ.get("MMUON_NAN_GRAD_STEPS")
    if at is not None and step + 1 in {int(s) for s in at.split(",")}:
        grad = next(p.grad for p in run.model.parameters() if p.grad is not None)
        with torch.no_grad():
            (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("nan")


def injected_write_fault(steps_done):
    """Fault injection for tests only, off unless the environment asks (tests/test_elastic.py):
    with MMUON_FAULT_IN_CKPT=N, the process writing checkpoint N (rank 0) kills itself with
    SIGKILL once FAULT_WRITE_BYTES of it are written, its file flushed to that point: a crash in
    the middle of a checkpoint write. First torchrun attempt only, as injected_fault. Returns the
    HashingWriter's after_write callback, or None."""
    at = os.environ.get("MMUON_FAULT_IN_CKPT")
    if at is None or steps_done != int(at) or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None

    def die_partway(writer):
        if writer.size >= FAULT_WRITE_BYTES:
            writer.file.flush()  # the part written so far reaches the file, as a crash would leave it
            os.kill(os.getpid(), signal.SIGKILL)
    return die_partway


FAULT_WRITE_BYTES = 64 * 1024  # a tiny test model's checkpoint is a few hundred KiB


def check_wandb_login(args):
    """--wandb online needs credentials; without them wandb would fail (or prompt) only once the
    model is built. Checked before anything starts; reads the key from WANDB_API_KEY or the netrc
    file `wandb login` writes, without contacting the server."""
    if args.wandb != "online" or os.environ.get("RANK", "0") != "0":
        return
    import wandb
    try:
        wandb.login(verify=False)
    except Exception as err:  # wandb.errors.UsageError: no API key configured
        raise UserError(f"--wandb online: not logged in to Weights & Biases ({str(err)[:200]}); run `wandb login` "
                        "or set WANDB_API_KEY, or use --wandb offline (a local run that `wandb sync` "
                        "uploads later) or --wandb off") from None


if __name__ == "__main__":
    run_cli(main)
