"""What sharded ManifoldMuon moves per step, beside FSDP's own collectives: an ESTIMATE from shapes.

    python -m bench.sharded_bytes                      # GPT-2 small to XL, hetero, 8 ranks
    python -m bench.sharded_bytes --ranks 16 --assign all-dgram
    python -m bench.sharded_bytes --resident            # with the owners' resident copies
    python -m bench.sharded_bytes --grad-wire fp32      # G in fp32 too

Per rank and step, in bytes received (what sets a ring collective's time; sent is the same):
  * FSDP2 (fully_shard, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), resharded
    after forward): two all-gathers of every parameter in bf16 (forward, backward) and one
    reduce-scatter of the gradients in fp32: (P-1)/P N (2 + 2 + 4) bytes;
  * ManifoldMuon's exchange (manifolds/exchange.py): out, a rank receives the parts of G of the
    pieces it owns from the P-1 others (g bytes an element: 2 in bf16, a GPU's default, 4 in
    fp32), and of W and the dual warm start Lambda only where the owner holds no resident copy
    from the last step (--resident: --exchange-opt resident=on; otherwise every step); back,
    it receives its parts of the new W and Lambda of the pieces others own, fp32. Per step without
    resident copies (the default, or a step that resends): (P-1)/P^2 ((g + 8) |W| + 8 |Lambda|)
    summed over the matrices; with valid ones (--resident): (P-1)/P^2 ((g + 4) |W| + 4 |Lambda|); |Lambda| = q^2 for a piece that keeps a warm start and 0 for plain Muon and the
    exact square Stiefel step;
  * for scale, what gathering every matrix on every rank would take (the replicated path's
    all-gather, fp32): (P-1)/P sum |W|.
Evenly balanced owners and evenly split rows are assumed (the real split is within a row per
rank). Not a measurement: no GPU has run the sharded step (bench/RESULTS.md).
"""
import argparse

from manifolds.assignment import parse_assignment
from manifolds.geometry import geometry

MODELS = {"small": (12, 768), "medium": (24, 1024), "large": (36, 1280), "xl": (48, 1600)}
VOCAB, CONTEXT = 50304, 1024
SHAPES = {"attn.qkv": lambda d: (3 * d, d), "attn.proj": lambda d: (d, d), "mlp.fc": lambda d: (4 * d, d),
          "mlp.proj": lambda d: (d, 4 * d)}


def dual_elements(manifold, rows, cols):
    geo = geometry(manifold)
    if not geo.constrained or (geo.exact_square_step and rows == cols):
        return 0
    return min(rows, cols) ** 2


def per_step(n_layer, d, assignment, ranks, grad_bytes=2, resident=False):
    """{what: bytes received per rank and step}; grad_bytes: G's bytes an element on the wire;
    resident: the owners hold W and Lambda from the last step (a steady step)."""
    matrices = duals = 0
    for key, shape in SHAPES.items():
        rows, cols = shape(d)
        manifold = assignment[key]
        matrices += n_layer * rows * cols
        duals += n_layer * dual_elements(manifold, rows, cols)
    everything = matrices + VOCAB * d + CONTEXT * d + (2 * n_layer + 1) * d  # tied head; LayerNorm gains
    spread = (ranks - 1) / ranks
    return {"parameters": everything,
            "fsdp": spread * everything * (2 + 2 + 4),
            "manifold_muon": spread / ranks * ((grad_bytes + (4 if resident else 8)) * matrices
                                               + (4 if resident else 8) * duals),
            "gather_every_matrix": spread * matrices * 4}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=8, help="ranks of the shard group")
    parser.add_argument("--assign", default="hetero", help="manifold assignment (train_gpt2.py --assign)")
    parser.add_argument("--grad-wire", choices=("bf16", "fp32"), default="bf16",
                        help="G's dtype on the exchange's wire (--exchange-opt exchange_grad; bf16 is a GPU's default)")
    parser.add_argument("--resident", action="store_true",
                        help="owners with resident copies (--exchange-opt resident=on): W and Lambda not sent out "
                             "on a steady step (default: off, as the optimizer's default; sent every step)")
    args = parser.parse_args(argv)
    assignment = dict(parse_assignment(args.assign))
    grad_bytes = 2 if args.grad_wire == "bf16" else 4
    print(f"ESTIMATE from shapes, {args.ranks} ranks, --assign {args.assign}, G in {args.grad_wire}, "
          f"{'' if args.resident else 'no '}resident copies; MB received per rank and step")
    print(f"{'model':8} {'params':>8} {'FSDP ag+rs':>11} {'ManifoldMuon':>13} {'ratio':>6} {'gather all W':>13}")
    for name, (n_layer, d) in MODELS.items():
        b = per_step(n_layer, d, assignment, args.ranks, grad_bytes, args.resident)
        print(f"{name:8} {b['parameters'] / 1e6:7.0f}M {b['fsdp'] / 1e6:11.0f} {b['manifold_muon'] / 1e6:13.0f} "
              f"{b['manifold_muon'] / b['fsdp']:6.1%} {b['gather_every_matrix'] / 1e6:13.0f}")


if __name__ == "__main__":
    main()
