"""Record the optimizer's real inputs (weights and Nesterov momenta) from a training run.

    python -m bench.dump_momenta --out runs/momenta.pt --steps 47-50 297-300 -- \
        --data-dir runs/stabilizers/data --assign hetero --n-layer 2 --n-head 4 --n-embd 256 \
        --seq-len 128 --total-batch-size 8 --batch-size 8 --max-steps 300 --device cpu

Runs train_gpt2.py in this process (the flags after `--`, plus an out-dir of its own under
/tmp unless given) and, at the optimizer steps listed, saves what ManifoldMuon hands its solver:
every bank's W and G on the tall orientation and its manifold, as
{"steps": [step, ...], "banks": [[(name, manifold, W, G), ...] per step], "dgram_cap": C}. Windows of
consecutive steps let a reader replay the warm starts as training runs them:
bench/experiments/warm_sweep.py --momenta FILE measures the direction quality of the solver settings on
them against the float64 optimum. Synthetic momenta (bench/optimizer.momentum_like) miss what
real ones have: LayerNorm null vectors, spectra that change with training.
"""
import argparse
import sys
import tempfile

import torch

import manifolds.optimizer as optimizer_module
import train_gpt2


def parse_steps(texts):
    """["47-50", "300"] -> [47, 48, 49, 50, 300]"""
    steps = []
    for text in texts:
        lo, _, hi = text.partition("-")
        steps.extend(range(int(lo), int(hi or lo) + 1))
    return sorted(set(steps))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ours, train_argv = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the .pt file to write")
    ap.add_argument("--steps", nargs="+", required=True, help="optimizer steps (1-based) or ranges A-B to record")
    args = ap.parse_args(ours)
    wanted = parse_steps(args.steps)
    record = {"steps": [], "banks": [], "dgram_cap": 1.0}
    solve = optimizer_module.solve_tall_banks
    calls = [0]

    def recording(banks, plan):
        calls[0] += 1  # the optimizer solves all its banks under one plan: one call per step
        if calls[0] in wanted:
            record["steps"].append(calls[0])
            record["banks"].append([(f"bank{i}", geo.name, W.detach().clone(), G.detach().clone())
                                    for i, (W, G, geo, _) in enumerate(banks)])
            record["dgram_cap"] = next((geo.cap for _, _, geo, _ in banks if geo.name == "dgram-cap"),
                                       record["dgram_cap"])
        return solve(banks, plan)

    optimizer_module.solve_tall_banks = recording
    if "--out-dir" not in train_argv:
        train_argv += ["--out-dir", tempfile.mkdtemp(prefix="dump_momenta_"), "--ckpt-every", "0"]
    train_gpt2.main(train_argv + ["--wandb", "off"])
    missing = sorted(set(wanted) - set(record["steps"]))
    if missing:
        sys.exit(f"error: the run made {calls[0]} optimizer steps; steps {missing} were not recorded")
    torch.save(record, args.out)
    shapes = sorted({(m, tuple(W.shape)) for banks in record["banks"] for _, m, W, _ in banks})
    print(f"wrote {args.out}: steps {record['steps']}, banks {shapes}")


if __name__ == "__main__":
    main()
