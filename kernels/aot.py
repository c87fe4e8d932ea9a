"""Ahead-of-time builds of the Triton products for GPU targets, on a machine without a GPU.

Triton compiles down to a cubin without a device: triton.compile(ASTSource(...), target=
GPUTarget("cuda", 80 or 90, 32)) runs Triton's passes and the ptxas that ships inside the
triton wheel (triton/backends/nvidia/bin/ptxas; no CUDA toolkit needed). A build tells
whether the kernel compiles at all, its shared memory per block (metadata.shared) and, from
ptxas's -v log, its registers per thread and spill bytes: the figures that decide whether a
configuration can launch on, or is worth tuning for, a target.

Builds run in worker processes spawned without TRITON_INTERPRET: the tests set it (on CPU),
and under it triton.jit makes interpreted functions, which do not compile. A worker imports
products_triton itself, so its @triton.jit kernels and helpers are real JITFunctions.

A build models the wrappers' usual call: contiguous operands (the innermost strides are 1,
which Triton's launcher specialises to constants) and sizes and pointers divisible by 16
(GPT-2 dimensions are), the other specialisation Triton's launcher makes.
"""
import contextlib
import io
import os
import re
import tempfile
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context

import torch  # not triton: see run()

TARGETS = {"sm_80": 80, "sm_90": 90}
# shared memory one block may opt into (cudaDevAttrMaxSharedMemoryPerBlockOptin): A100, H100/H200
SMEM_LIMITS = {80: 166_912, 90: 232_448}
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPES = tuple(TORCH_DTYPES)
POINTERS = {"sym_product": ("X", "C", "Out"), "matmul_add": ("B", "X", "C", "Out"),
            "symmetric_gram": ("X", "Y", "D2", "Scale", "Out", "Sumsq")}
UNIT_STRIDES = {"sym_product": ("sxk", "scn", "son"), "matmul_add": ("sbk", "sxn", "scn", "son"),
                "symmetric_gram": ("sxq", "syq", "sdq", "son")}
FLOATS = ("alpha", "beta")
ODD_INTS = ("sumsq_slots",)  # the number of 32-wide upper tiles: rarely a multiple of 16


def config_label(config):
    """'128x256x64 w8 s3' (BLOCK_M x BLOCK_N x BLOCK_K) or '128/64 w8 s3' (BLOCK / BLOCK_K)."""
    kw = config["kwargs"]
    tile = (f"{kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']}" if "BLOCK_M" in kw
            else f"{kw['BLOCK']}/{kw['BLOCK_K']}")
    return f"{tile} w{config['num_warps']} s{config['num_stages']}"


def as_dict(config):
    """A triton.Config as plain data, to send to a worker and to write to JSON."""
    return {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages}


def precisions(dtype, all_fp32=False):
    """The PRECISION constexprs the wrappers pass for `dtype`: fp32 takes 3xTF32 (torch's default
    fp32 matmul precision) or, with all_fp32, also plain TF32 (the solver's inner iterations on
    GPUs) and bf16 (tiles cast before tl.dot: kernels.precision.bf16_products); the others always
    'tf32'."""
    if dtype != "fp32":
        return ("tf32",)
    return ("tf32x3", "tf32", "bf16") if all_fp32 else ("tf32x3",)


def job(kernel, flags, dtype, target, config, precision, source="gpu"):
    """One build: plain data, so that it pickles to a worker and prints as a table row."""
    import triton
    from kernels import products_triton as pt
    arch = TARGETS[target]
    capability = divmod(arch, 10)
    triton_config = triton.Config(config["kwargs"], num_warps=config["num_warps"], num_stages=config["num_stages"])
    torch_dtype = TORCH_DTYPES[dtype]
    return dict(kernel=kernel, flags=dict(flags), dtype=dtype, target=target, precision=precision,
                config=config, label=config_label(config), source=source, smem_limit=SMEM_LIMITS[arch],
                estimate=pt.shared_memory_estimate(triton_config, torch_dtype, capability, precision),
                kept=pt.keeps_config(triton_config, torch_dtype, capability, SMEM_LIMITS[arch], precision))


def sweep(kernels=None, dtypes=DTYPES, targets=tuple(TARGETS), all_fp32=False, small=True):
    """Every configuration (GPU_CONFIGS, and SMALL_CONFIGS with `small`) x every flag set the
    wrappers pass x dtypes x targets (x both fp32 precisions with all_fp32)."""
    from kernels import products_triton as pt
    jobs = []
    for kernel in kernels or pt.WRAPPER_FLAGS:
        configs = [("gpu", as_dict(c)) for c in pt.GPU_CONFIGS[kernel]]
        if small:
            configs.append(("small", as_dict(pt.SMALL_CONFIGS[kernel])))
        for target in targets:
            for dtype in dtypes:
                for precision in precisions(dtype, all_fp32):
                    for flags in pt.WRAPPER_FLAGS[kernel]:
                        for source, config in configs:
                            jobs.append(job(kernel, flags, dtype, target, config, precision, source))
    return jobs


# ----------------------------------------------------------------------------------------
# In the worker


def _worker_init(cache_dir):
    os.environ.pop("TRITON_INTERPRET", None)  # (run() started the worker without it already)
    os.environ["TRITON_CACHE_DIR"] = cache_dir  # a fresh cache: every build really compiles
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"


def _ptxas_figures(log):
    """Registers per thread, spill stores and loads, stack frame (bytes), from ptxas -v."""
    def number(pattern):
        found = re.findall(pattern, log)
        return int(found[-1]) if found else None
    return dict(regs=number(r"Used (\d+) registers"), spill_stores=number(r"(\d+) bytes spill stores"),
                spill_loads=number(r"(\d+) bytes spill loads"), stack=number(r"(\d+) bytes stack frame"))


def signature(kernel, arg_names, constexpr_names, dtype, flags):
    """(signature, constexprs, attrs) of an ASTSource for a wrapper's call with contiguous
    `dtype` operands of sizes divisible by 16, as Triton's launcher specialises it."""
    pointer = "*" + dtype
    fp32_pointers = set()
    if flags.get("WANT_SUMSQ"):  # otherwise the wrapper passes `out` in their place
        fp32_pointers.add("Sumsq")
    if flags.get("HAS_SCALE"):
        fp32_pointers.add("Scale")
    sig, constexprs, attrs = {}, {}, {}
    for index, name in enumerate(arg_names):
        if name in constexpr_names:
            sig[name] = "constexpr"
        elif name in UNIT_STRIDES[kernel]:
            sig[name], constexprs[name] = "constexpr", 1
        elif name in POINTERS[kernel]:
            sig[name] = "*fp32" if name in fp32_pointers else pointer
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif name in FLOATS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name not in ODD_INTS:
                attrs[(index,)] = [["tt.divisibility", 16]]
    return sig, constexprs, attrs


def build(spec):
    """Compile one job (see `job`) and return it with the build's figures, or its error."""
    from kernels import products_triton as pt
    fn = pt._jit[spec["kernel"]]
    config = spec["config"]
    sig, constexprs, attrs = signature(spec["kernel"], fn.arg_names, {fn.arg_names[i] for i in fn.constexprs},
                                       spec["dtype"], spec["flags"])
    constexprs.update(spec["flags"], CAST_FP32=False, PRECISION=spec["precision"], **config["kwargs"])
    return dict(spec, **compile_for_target(fn, sig, constexprs, attrs, spec["target"], config["num_warps"],
                                           config["num_stages"]))


def function_specs(module, function, signature, constexprs, num_warps=4, num_stages=2, dtype="fp32"):
    """One build_function spec per GPU target (TARGETS) of the @triton.jit `function` of `module`."""
    return [dict(module=module, function=function, signature=signature, constexprs=constexprs, target=target,
                 num_warps=num_warps, num_stages=num_stages, dtype=dtype) for target in TARGETS]


def build_function(spec):
    """Compile any @triton.jit function: spec = dict(module, function, signature, constexprs,
    attrs, target, num_warps, num_stages), as triton.compiler.ASTSource takes them."""
    import importlib
    fn = getattr(importlib.import_module(spec["module"]), spec["function"])
    return dict(spec, **compile_for_target(fn, spec["signature"], dict(spec["constexprs"]), spec.get("attrs", {}),
                                           spec["target"], spec["num_warps"], spec["num_stages"]))


def compile_for_target(fn, sig, constexprs, attrs, target, num_warps, num_stages):
    """{ok, shared, seconds, triton, regs, spill_stores, spill_loads, stack} of one build of `fn`
    for `target`, or {ok: False, error, reason, traceback, seconds}."""
    import triton
    from triton.backends.compiler import GPUTarget
    if not isinstance(fn, triton.runtime.jit.JITFunction):
        raise RuntimeError("kernels/aot.py: the kernels were imported under TRITON_INTERPRET")
    log = io.StringIO()
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(log):  # ptxas's log is printed
            compiled = triton.compile(
                triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                target=GPUTarget("cuda", TARGETS[target], 32),
                options={"num_warps": num_warps, "num_stages": num_stages})
    except Exception as err:  # noqa: BLE001 -- reported per build, the caller decides
        chain = []  # a CompilationError points at the call; its causes at the faulty line
        while err is not None and len(chain) < 8:
            chain.append(f"{type(err).__name__}: {err}")
            err = err.__cause__ or err.__context__
        return dict(ok=False, error="\n".join(chain), reason=chain[-1].strip().splitlines()[-1],
                    traceback=traceback.format_exc(), seconds=time.perf_counter() - start)
    return dict(ok=True, shared=compiled.metadata.shared, seconds=time.perf_counter() - start,
                triton=triton.__version__, **_ptxas_figures(log.getvalue()))


# ----------------------------------------------------------------------------------------
# In the caller


@contextlib.contextmanager
def _without_interpreter():
    """TRITON_INTERPRET unset while worker processes start: they inherit the environment, and
    Triton reads it when it first decorates a kernel (triton.language's own, at import)."""
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved


def run(jobs, n_jobs=2, progress=None, builder=build):
    """Build `jobs` in `n_jobs` spawned worker processes with `builder` (build: the products'
    jobs; build_function: any kernel's); results in the order of `jobs`. `progress(done,
    total, result)` is called as each build finishes."""
    results = [None] * len(jobs)
    with tempfile.TemporaryDirectory(prefix="triton-aot-") as cache_dir:
        with ProcessPoolExecutor(max_workers=max(1, n_jobs), mp_context=get_context("spawn"),
                                 initializer=_worker_init, initargs=(cache_dir,)) as pool:
            with _without_interpreter():  # workers start as jobs are submitted
                futures = {pool.submit(builder, spec): i for i, spec in enumerate(jobs)}
            for done, future in enumerate(as_completed(futures), 1):
                results[futures[future]] = result = future.result()
                if progress:
                    progress(done, len(jobs), result)
    return results


def describe(result):
    """One line: what was built and how it went."""
    flags = ",".join(k for k, v in result["flags"].items() if v) or "-"
    head = (f"{result['kernel']:<14} {result['target']} {result['dtype']:<4} {result['precision']:<6} "
            f"{result['label']:<18} {flags:<38}")
    if not result["ok"]:
        return f"{head} FAILED {result['reason']}"
    return (f"{head} smem {result['shared']:>7} regs {result['regs']} "
            f"spills {result['spill_stores']}/{result['spill_loads']} "
            f"{'kept' if result['kept'] else 'PRUNED'}")
