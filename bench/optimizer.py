"""Cost and accuracy of one manifold Muon step: the published algorithm against ours.

    python -m bench.optimizer                          # CPU: n_embd 256, 2 layers, hetero
    python -m bench.optimizer --n-embd 768 --n-layer 12 --device cuda --dtype bfloat16

For the Muon matrices of a GPT-2 (`--assign` decides their manifolds) it times one optimizer
step of
  (a) `published`: bench/published.py, a re-statement of the published per-matrix algorithm
      (20 dual steps of 0.1 with linear decay, 10 Polar-Express iterations per msign, host sync
      every dual step, Stiefel retraction by msign, DGram by polar factor x sorted singular values);
  (b) `ours`: ManifoldMuon with its defaults (banked, warm-started from the previous steps;
      on a CPU the ADMM's matrix functions come from eigh, on a GPU from Polar Express);
  (c) `ours-20`: ManifoldMuon with the paper's iteration count (20 ADMM iterations),
all on the same weights and gradients, in the same precision, in the same process, and prints
time ratios. Gradients are "momentum-like": a power-law spectrum (s_i ~ 1/i, as the momentum of
real GPT-2 gradients shows: largest / median singular value ~ 100) plus noise, drifting slowly
from step to step. With --quality it also measures, for one matrix per bank, the direction
quality <G/|G|, A>/||A||_op as a fraction of a certified float64 optimum (manifolds/optimum.py)
of the last step (ours: warm-started along the gradient sequence, as timed, and cold), the
tangent residual and the manifold violation after the step. A FLOP model of both algorithms
for GPT-2 small is printed too (`flop_model`: ours from manifolds/step_cost.py, the description of
the work that rank balancing splits by; the published algorithm's from bench/published.py).
"""
import argparse
import json
import math
import time

import torch

from bench.results import Results
from bench.published import PUBLISHED, published_direction, published_flops, published_step
from manifolds import ManifoldMuon, manifold_violation, project_to_manifold, steepest_direction
from manifolds.assignment import parse_assignment
from manifolds.solver import solve_tall
from manifolds.geometry import MANIFOLDS, geometry
from manifolds.plan import SolverOptions, plan_for
from manifolds.step_cost import matrix_work


def muon_shapes(n_embd, n_layer):
    """{module key: [shape] * n_layer}: nn.Linear weights are (out, in)."""
    d = n_embd
    return {"attn.qkv": (3 * d, d), "attn.proj": (d, d), "mlp.fc": (4 * d, d), "mlp.proj": (d, 4 * d)}


def momentum_like(shape, generator, decay=1.0):
    rows, cols = shape
    k = min(rows, cols)
    U = torch.linalg.qr(torch.randn(rows, k, generator=generator))[0]
    V = torch.linalg.qr(torch.randn(cols, k, generator=generator))[0]
    s = torch.arange(1, k + 1, dtype=torch.float32) ** -decay
    return (U * s) @ V.T + 0.02 * s[0] * torch.randn(shape, generator=generator) / math.sqrt(k)


def build(args, device):
    """Weights (projected GPT-2 init) and a list of gradient sets, one per step."""
    gen = torch.Generator().manual_seed(0)
    assignment = parse_assignment(args.assign)
    banks = []
    for key, shape in muon_shapes(args.n_embd, args.n_layer).items():
        std = 0.02 / math.sqrt(2 * args.n_layer) if key.endswith("proj") else 0.02
        weights = []
        for _ in range(args.n_layer):
            W = torch.randn(shape, generator=gen) * std
            if assignment[key] != "none":
                W = project_to_manifold(W, assignment[key])
            weights.append(W)
        base = [momentum_like(shape, gen) for _ in range(args.n_layer)]
        grads = [[0.9 * g + 0.1 * momentum_like(shape, gen) for g in base] for _ in range(args.steps + args.warmup)]
        banks.append({"key": key, "manifold": assignment[key], "W": weights, "G": grads})
    for bank in banks:
        bank["W"] = [w.to(device) for w in bank["W"]]
        bank["G"] = [[g.to(device) for g in step] for step in bank["G"]]
    return banks


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


# (name, cold, solver options): each row adds one lever to the row before; the last is the default
LEVERS = (
    ("ADMM in span[W, G] (2q x q), polynomial clip, cold (2 x the warm budget)", True, dict(clip="polynomial")),
    ("+ eigh clip", True, dict(clip="eigh")),
    (f"+ warm start from the last multiplier, the default budget ({SolverOptions().iterations})", False,
     dict(clip="eigh")),
)


def time_published(banks, args, device):
    weights = {b["key"]: [w.clone() for w in b["W"]] for b in banks}
    times = []
    for step in range(args.warmup + args.steps):
        sync(device)
        t0 = time.perf_counter()
        for bank in banks:
            if bank["manifold"] == "none":
                continue
            for i, W in enumerate(weights[bank["key"]]):
                G = bank["G"][step][i]
                weights[bank["key"]][i] = published_step(W.to(args.dtype), G.to(args.dtype), bank["manifold"],
                                                         args.lr).float()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times[args.warmup:], weights


def time_ours(banks, args, device, cold=False, **solver):
    """cold: forget the warm starts before every step (every step is a first step)."""
    params = {b["key"]: [torch.nn.Parameter(w.clone()) for w in b["W"]] for b in banks}
    groups = [{"params": params[b["key"]], "manifold": b["manifold"], "name": b["key"]} for b in banks]
    opt = ManifoldMuon(groups, lr=args.lr, momentum=0.0, nesterov=False, **solver)
    times = []
    for step in range(args.warmup + args.steps):
        for bank in banks:
            for p, g in zip(params[bank["key"]], bank["G"][step]):
                p.grad = g
        if cold:
            for state in opt.state.values():
                for key in [k for k in state if k.startswith("dual")]:
                    del state[key]
        sync(device)
        t0 = time.perf_counter()
        opt.step()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times[args.warmup:], {k: [p.detach() for p in v] for k, v in params.items()}, opt


def warm_direction(W, Gs, manifold, **solver):
    """The direction of the last of a sequence of steps at W, each warm-started from the one
    before (what the optimizer does every step but the first), on the tall orientation."""
    plan = plan_for(SolverOptions(**solver), W.device, W.dtype)
    state = None
    for G in Gs:
        solution = solve_tall(W[None], G[None], geometry(manifold), state, plan)
        state = solution.warm_start
    return solution.A[0]


def quality_report(banks, args):
    """Direction quality of each algorithm on the last step's (W, G), one matrix per bank.

    "ours" and "ours-20" are warm-started along the bench's gradient sequence, as in the timed
    steps; "ours-cold" is the first step of a run (or steepest_direction), twice the iterations.
    """
    from manifolds.optimum import optimum, quality  # float64 ADMM with exact SVD and a duality certificate
    rows = []
    for bank in banks:
        if bank["manifold"] == "none":
            continue
        W, G = bank["W"][0].double().cpu(), bank["G"][-1][0].double().cpu()
        orient = (lambda M: M.mT) if W.size(-2) < W.size(-1) else (lambda M: M)  # noqa: E731
        tall_W, tall_G = orient(W), orient(G)
        Gs = [orient(step[0].float().cpu()) for step in bank["G"]]
        opt, upper = optimum(tall_W, tall_G, bank["manifold"], iters=args.reference_iters)
        geo = MANIFOLDS[bank["manifold"]]
        row = {"bank": bank["key"], "manifold": bank["manifold"], "shape": list(W.shape),
               "reference_gap": (upper - opt) / upper}
        candidates = {
            "published": published_direction(tall_W.float(), tall_G.float(), bank["manifold"], **PUBLISHED)[0],
            "ours": warm_direction(tall_W.float(), Gs, bank["manifold"]),
            "ours-cold": steepest_direction(tall_W.float(), tall_G.float(), bank["manifold"]),
            "ours-20": warm_direction(tall_W.float(), Gs, bank["manifold"], iterations=20),
        }
        for name, A in candidates.items():
            A = A.double()
            H = geo.tangent_residual(tall_W, A)
            row[name] = {"quality": quality(tall_W, tall_G, A, opt),
                         "residual": float(H.square().mean().sqrt() / tall_W.norm(dim=0).mean())}
        rows.append(row)
    return rows


def flop_model(n_embd, n_layer, assignment, plan):
    """(published FLOPs, {term: our FLOPs}) of the constrained matrices' direction and retraction
    in one warm-started step (every step but the first) of a GPT-2 of this shape: ours the sum of
    manifolds.step_cost.matrix_work over its matrices under `plan` (x 2: FLOPs per multiply-add), the
    one description of the work that rank balancing splits by; the published algorithm's from
    bench/published.py. Unconstrained matrices are left out of both (plain Muon either way)."""
    published, ours = 0, {}
    for key, (rows, cols) in muon_shapes(n_embd, n_layer).items():
        manifold = assignment[key]
        if manifold == "none":
            continue
        p, q = max(rows, cols), min(rows, cols)
        published += n_layer * published_flops(p, q)
        for term, work in matrix_work(manifold, p, q, plan).items():
            ours[term] = ours.get(term, 0) + 2 * n_layer * work
    return published, ours


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--assign", default="hetero")
    ap.add_argument("--steps", type=int, default=3, help="timed steps")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first (warm starts, compilation)")
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="precision of the published algorithm's msign (ours keeps fp32 master weights)")
    ap.add_argument("--clip", default="auto", choices=("auto", "eigh", "polynomial"),
                    help="our ADMM's spectral clip (auto: eigh on CPU, polynomial on GPU)")
    ap.add_argument("--levers", action="store_true", help="also time the levers one by one (LEVERS)")
    ap.add_argument("--quality", action="store_true", help="also measure direction quality (slow)")
    ap.add_argument("--reference-iters", type=int, default=800)
    ap.add_argument("--out", default=None, help="JSON results, rewritten after every measurement")
    args = ap.parse_args(argv)
    args.dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    banks = build(args, device)
    assignment = parse_assignment(args.assign)

    # each figure goes to --out as soon as it is measured (a time limit may cut the bench short)
    out = Results(args.out, config={k: str(v) for k, v in vars(args).items()})
    results = out.data
    med = lambda t: sorted(t)[len(t) // 2]  # noqa: E731

    def record(name, times):
        out.put("seconds_per_step", name, value=med(times))
        if name != "published":
            out.put("speedup_vs_published", name, value=med(t_pub) / med(times))
        print(f"  {name:10s} {1000 * med(times):9.1f} ms/step   ({med(t_pub) / med(times):5.2f}x vs published)",
              flush=True)

    print(f"{args.assign}, n_embd {args.n_embd}, {args.n_layer} layers, {args.device}:", flush=True)
    t_pub, w_pub = time_published(banks, args, device)
    record("published", t_pub)
    t_ours, w_ours, opt = time_ours(banks, args, device, clip=args.clip)
    record("ours", t_ours)
    stats = opt.stats()
    out.put("ours_iterations", value=stats)
    out.put("violation_after_steps", value={
        name: {key: max(manifold_violation(w, assignment[key]) for w in ws) for key, ws in weights.items()}
        for name, weights in (("published", w_pub), ("ours", w_ours))})
    t_20, _, _ = time_ours(banks, args, device, iterations=20, clip=args.clip)
    record("ours-20", t_20)
    if args.levers:  # the optimizer's levers added one at a time, timed against the published step
        for name, cold, solver in LEVERS:
            t, _, _ = time_ours(banks, args, device, cold=cold, **solver)
            out.put("levers", name, value={"seconds_per_step": med(t), "speedup_vs_published": med(t_pub) / med(t)})
            print(f"  lever: {name:55s} {1000 * med(t):9.1f} ms/step  ({med(t_pub) / med(t):5.2f}x vs published)",
                  flush=True)
    # the clips a CPU and a GPU run by default (auto), on a GPU with TF32 iterations
    pub_flops, eigh_terms = flop_model(768, 12, assignment, plan_for(SolverOptions(clip="eigh"), "cpu"))
    _, poly_terms = flop_model(768, 12, assignment,
                               plan_for(SolverOptions(clip="polynomial", precision="tf32"), "cpu"))
    our_flops, poly_flops = sum(eigh_terms.values()), sum(poly_terms.values())
    out.put("gpt2_small_flops_per_step", value={"published": pub_flops, "ours (eigh clip)": our_flops,
                                                "ours (polynomial clip)": poly_flops,
                                                "ours by term (eigh clip)": eigh_terms,
                                                "ours by term (polynomial clip)": poly_terms,
                                                "ratio (eigh)": pub_flops / max(our_flops, 1),
                                                "ratio (polynomial)": pub_flops / max(poly_flops, 1)})
    print(f"  manifold violation after the steps: {json.dumps(results['violation_after_steps'])}")
    print(f"  our solver iterations (last step): {json.dumps(stats)}")
    print(f"  FLOP model, GPT-2 small (768 x 12, {args.assign}, warm-started step): published "
          f"{pub_flops / 1e12:.1f} TFLOP; ours {our_flops / 1e12:.2f} TFLOP with the eigh clip "
          f"({pub_flops / max(our_flops, 1):.1f}x less), {poly_flops / 1e12:.2f} TFLOP with the polynomial "
          f"clip ({pub_flops / max(poly_flops, 1):.1f}x less)")
    if args.quality:
        out.put("quality", value=quality_report(banks, args))
        for row in results["quality"]:
            print(f"  {row['bank']:9s} {row['manifold']:7s} {tuple(row['shape'])} reference gap {row['reference_gap']:.0e}: "
                  + "  ".join(f"{n} {row[n]['quality']:.4f} (res {row[n]['residual']:.0e})"
                              for n in ("published", "ours", "ours-cold", "ours-20")))


if __name__ == "__main__":
    main()
