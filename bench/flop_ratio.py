"""Dense FLOPs of one warm ManifoldMuon step against the field's Muon, counted by torch's own
FlopCounterMode on a model a user brings (transformers' GPT-2), not by this repository's counter.

    python -m bench.flop_ratio                          # width 768, 2 layers, hetero all-dgram none
    python -m bench.flop_ratio --assign hetero --solver-opt scheme=admm --n-layer 12

The model's matrices go through manifold_param_groups as a user's would; ManifoldMuon runs with
capturable=True and clip="polynomial" (a GPU's control flow; fixed budgets, so the count does not
depend on the data), one untimed step, then the second (warm) step is counted. The field's Muon:
5 quintic Newton-Schulz steps per matrix, 4 m^2 n + 2 m^3 FLOPs each (m <= n). The ratio does not
depend on the layer count (every layer has the same matrices), so 2 layers keep it quick.
"""
import argparse
import sys

import torch
from torch.utils.flop_counter import FlopCounterMode

from bench.cost_model import field_muon_flops
from errors import run_cli


def count(assign, n_layer, n_embd, solver_opts, seed=0):
    import transformers
    from manifolds import ManifoldMuon, manifold_param_groups
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_embd // 64,
                                                                 n_positions=64, vocab_size=256))
    spec = {"none": "unconstrained"}.get(assign, assign)
    groups, _ = manifold_param_groups(model, spec)
    params = [p for g in groups for p in g["params"]]
    opt = ManifoldMuon(groups, lr=0.02, capturable=True, clip="polynomial", **solver_opts)
    gen = torch.Generator().manual_seed(seed)
    for step in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        if step == 0:
            opt.step()
            continue
        with FlopCounterMode(display=False) as counter:
            opt.step()
    flops = counter.get_total_flops()
    muon = field_muon_flops([tuple(p.shape) for p in params])
    return flops, muon


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--assign", nargs="+", default=["hetero", "all-dgram", "none"],
                    help="--assign presets (none = unconstrained) or manifold_param_groups specs")
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=768)
    ap.add_argument("--solver-opt", action="append", default=[], metavar="KEY=VALUE",
                    help="train_gpt2's --solver-opt, repeatable (e.g. scheme=admm)")
    args = ap.parse_args(argv)
    from train_gpt2 import parse_solver_opts
    opts = parse_solver_opts(args.solver_opt)  # the trainer's parsing and its errors
    for assign in args.assign:
        flops, muon = count(assign, args.n_layer, args.n_embd, opts)
        print(f"{assign}: {flops / 1e9:.1f} GFLOP, the field's Muon {muon / 1e9:.1f} GFLOP: {flops / muon:.2f}x",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
