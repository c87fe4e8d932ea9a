"""Compile every Triton configuration ahead of time for sm_80 and sm_90, without a GPU.

    python -m bench.aot_compile                      # the full sweep, 2 parallel builds
    python -m bench.aot_compile --jobs 8 --out aot.json
    python -m bench.aot_compile --kernels matmul_add --dtypes fp32 --targets sm_80

The sweep: every configuration of GPU_CONFIGS and SMALL_CONFIGS x every flag set the wrappers
launch a kernel with (products_triton.WRAPPER_FLAGS) x fp32/bf16/fp16 x sm_80/sm_90, and for
fp32 both tl.dot precisions (3xTF32, torch's default, and plain TF32). Each build prints its
shared memory per block, registers per thread and spill bytes (stores/loads, from ptxas -v),
and whether products_triton.keeps_config keeps the configuration for that target, dtype and
precision; a summary table follows, one row per configuration, target, dtype and precision,
with the largest figures over the flag sets. See kernels/aot.py for what a build models.
"""
import argparse
import json
import sys
import time
from collections import defaultdict

from kernels import aot


def summarise(results):
    """Rows (kernel, target, dtype, precision, label): largest smem/regs/spills over flag sets."""
    rows = defaultdict(list)
    for r in results:
        rows[(r["kernel"], r["target"], r["dtype"], r["precision"], r["label"], r["source"])].append(r)
    lines = [f"{'kernel':<14} {'target':<6} {'dtype':<5} {'prec':<6} {'config':<18} {'kind':<5} {'builds':>6} "
             f"{'smem':>7} {'limit':>7} {'estimate':>8} {'regs':>4} {'spill st/ld':>13} {'pruning':<7}"]
    for (kernel, target, dtype, precision, label, source), group in rows.items():
        ok = [r for r in group if r["ok"]]
        failed = len(group) - len(ok)
        smem = max((r["shared"] for r in ok), default=0)
        regs = max((r["regs"] or 0 for r in ok), default=0)
        stores = max((r["spill_stores"] or 0 for r in ok), default=0)
        loads = max((r["spill_loads"] or 0 for r in ok), default=0)
        verdict = {True: "kept", False: "PRUNED"}[group[0]["kept"]]
        lines.append(f"{kernel:<14} {target:<6} {dtype:<5} {precision:<6} {label:<18} {source:<5} "
                     f"{len(group):>6} {smem:>7} {group[0]['smem_limit']:>7} {group[0]['estimate']:>8} "
                     f"{regs:>4} {f'{stores}/{loads}':>13} {verdict:<7}"
                     + (f" {failed} FAILED" if failed else "")
                     + (" OVER LIMIT" if smem > group[0]["smem_limit"] else ""))
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("--jobs", type=int, default=2, help="parallel builds (worker processes; default 2)")
    parser.add_argument("--out", help="also write every build's figures to this JSON file")
    parser.add_argument("--kernels", nargs="+", choices=("sym_product", "matmul_add", "symmetric_gram"),
                        help="only these kernels (default: all three)")
    parser.add_argument("--dtypes", nargs="+", choices=aot.DTYPES, default=list(aot.DTYPES),
                        help="operand dtypes (default: all)")
    parser.add_argument("--targets", nargs="+", choices=tuple(aot.TARGETS), default=list(aot.TARGETS),
                        help="GPU targets (default: all)")
    parser.add_argument("--no-tf32", action="store_true",
                        help="fp32 with 3xTF32 only (skip the plain-TF32 builds)")
    parser.add_argument("--quiet", action="store_true", help="no line per build, the summary only")
    args = parser.parse_args(argv)

    jobs = aot.sweep(args.kernels, tuple(args.dtypes), tuple(args.targets), all_fp32=not args.no_tf32)
    print(f"{len(jobs)} builds, {args.jobs} at a time", flush=True)
    start = time.perf_counter()

    def progress(done, total, result):
        if not args.quiet or not result["ok"]:
            print(f"[{done}/{total} {time.perf_counter() - start:5.0f}s] {aot.describe(result)}", flush=True)

    results = aot.run(jobs, args.jobs, progress)
    elapsed = time.perf_counter() - start
    print()
    print("\n".join(summarise(results)))
    failed = [r for r in results if not r["ok"]]
    over = [r for r in results if r["ok"] and r["kept"] and r["shared"] > r["smem_limit"]]
    print(f"\n{len(results)} builds in {elapsed:.0f} s ({sum(r['seconds'] for r in results):.0f} s of "
          f"compiling), triton {next((r['triton'] for r in results if r['ok']), '?')}: {len(failed)} failed, "
          f"{sum(not r['kept'] for r in results)} pruned, {len(over)} kept over the shared memory limit")
    for r in failed:
        print(f"FAILED {aot.describe(r)}\n{r['traceback']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "traceback"} for r in results], f, indent=1)
        print(f"wrote {args.out}")
    return 1 if failed or over else 0


if __name__ == "__main__":
    sys.exit(main())
