"""The Triton kernels compile for real GPU targets, on a machine without a GPU.

The interpreter (the other kernel tests on a CPU) runs the kernels' Python, not Triton's
compiler: an error that only the compiler sees (a type or shape it rejects, a configuration
whose buffers exceed a GPU's shared memory) passes there. Here each kernel is built ahead of
time for sm_80 and sm_90 (kernels/aot.py: Triton's passes and the ptxas inside the triton
wheel, in spawned worker processes without TRITON_INTERPRET), in every flag set the wrappers
launch it with, for fp32 and bf16, and every configuration the pruning keeps is built at least
once. bench/aot_compile.py builds the full sweep (every configuration x flag set x dtype).
"""
import os
import types

import pytest
import torch
import triton

import kernels
from kernels import aot, products_triton
from manifolds import steepest_direction
from manifolds.geometry import MANIFOLDS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: in the interpreter (conftest)
CAPABILITIES = {"sm_80": (8, 0), "sm_90": (9, 0)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def test_ptxas_ships_inside_the_triton_wheel():
    # nothing beyond the triton package is needed to build cubins (no CUDA toolkit)
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    assert os.access(ptxas, os.X_OK), ptxas


# --- the flag sets the wrappers launch with -----------------------------------------------

def _record_launches(monkeypatch, launch):
    """Record the flags (constexprs less CAST_FP32/PRECISION) of every kernel launch."""
    seen = {name: [] for name in products_triton.WRAPPER_FLAGS}

    def recording(name, grid, args, size, key, **constexprs):
        seen[name].append({k: v for k, v in constexprs.items() if k not in ("CAST_FP32", "PRECISION")})
        return launch(name, grid, args, size, key, **constexprs)

    monkeypatch.setattr(products_triton, "_launch", recording)
    return seen


def _as_set(flag_sets):
    return {tuple(sorted(flags.items())) for flags in flag_sets}


def test_wrapper_flags_are_exactly_the_flag_sets_the_api_launches(monkeypatch):
    # Every form of every call (kernels/__init__.py), launches skipped: only the flags matter.
    seen = _record_launches(monkeypatch, lambda name, *args, **flags: products_triton.SMALL_CONFIGS[name])
    X, W, A = (torch.randn(*shape, device=DEVICE) for shape in ((2, 8, 12), (2, 12, 8), (2, 12, 8)))
    S, d2 = torch.randn(2, 8, 8, device=DEVICE), torch.ones(2, 8, device=DEVICE)
    per_matrix = torch.tensor([0.5, 1.0], device=DEVICE)
    kernels.msign(X, steps=2, polish_steps=1, backend="triton")   # Polar Express (c != 0), Newton-Schulz
    kernels.orthonormalize_near(X, steps=1, backend="triton")
    for manifold in ("stiefel", "dgram"):
        for with_norm in (False, True):
            kernels.tangent_residual(W, A, manifold, backend="triton", with_norm=with_norm)
        for alpha in (0.5, per_matrix):
            kernels.preconditioned(W, A, manifold, d2, alpha, backend="triton")
        kernels.tangent_projection(W, A, manifold, d2, backend="triton")
    kernels.symmetric_part(A, W, backend="triton")
    kernels.matmul_add(S, X, X, backend="triton")
    for name, flag_sets in products_triton.WRAPPER_FLAGS.items():
        assert _as_set(seen[name]) == _as_set(flag_sets), name


@pytest.mark.parametrize("manifold, shape", [("stiefel", (40, 40)),  # square Stiefel's exact step
                                            ("dgram", (40, 24)),  # ADMM on the full matrices
                                            ("stiefel", (64, 24))])  # ADMM in span coordinates
def test_solvers_launch_no_flag_set_beyond_wrapper_flags(monkeypatch, manifold, shape):
    seen = _record_launches(monkeypatch, products_triton._launch)  # real launches (interpreter)
    W = MANIFOLDS[manifold].retract(torch.randn(shape).double(), near=False).float().to(DEVICE)
    steepest_direction(W, torch.randn(shape, device=DEVICE), manifold, backend="triton", iterations=2)
    for name, flag_sets in products_triton.WRAPPER_FLAGS.items():
        assert _as_set(seen[name]) <= _as_set(flag_sets), name
    assert seen["symmetric_gram"] and seen["sym_product"]  # the solver really ran the kernels


def test_builds_specialise_arguments_as_triton_does_for_the_wrappers_calls(monkeypatch):
    # What the launcher makes of a wrapper's real arguments (contiguous, sizes divisible by 16):
    # types, unit strides as constants, divisibility by 16. The builds must model the same.
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    calls = []

    def record(name, grid, args, size, key, **constexprs):
        calls.append((name, args, constexprs))
        return products_triton.SMALL_CONFIGS[name]

    monkeypatch.setattr(products_triton, "_launch", record)
    bf16 = dict(dtype=torch.bfloat16)
    X, S = torch.randn(2, 64, 48, **bf16), torch.randn(2, 64, 64, **bf16)
    products_triton.sym_product(X, 0.5, S, 2.0)
    products_triton.matmul_add(S, X, X, 1.0, 0.5)
    products_triton.symmetric_gram(X, X, True, d2=torch.ones(2, 48, **bf16), alpha=torch.ones(2))
    products_triton.symmetric_gram(X, X, want_sumsq=True)
    for name, args, constexprs in calls:
        arg_names = products_triton._jit[name].arg_names
        flags = {k: v for k, v in constexprs.items() if k not in ("CAST_FP32", "PRECISION")}
        sig, consts, attrs = aot.signature(name, arg_names, set(arg_names[len(args):]), "bf16", flags)
        for index, (arg_name, value) in enumerate(zip(arg_names, args)):
            kind, key = native_specialize_impl(BaseBackend, value, False, True, True)
            assert sig[arg_name] == kind, (name, arg_name)
            if kind == "constexpr":
                assert consts[arg_name] == value, (name, arg_name)
            else:
                assert ((index,) in attrs) == (key == "D"), (name, arg_name, value)


# --- pruning, a pure function: checked without a GPU --------------------------------------

def _kept(kernel, dtype, target, precision="tf32x3"):
    capability = aot.TARGETS[target]
    return [c for c in products_triton.GPU_CONFIGS[kernel]
            if products_triton.keeps_config(c, DTYPES[dtype], CAPABILITIES[target],
                                            aot.SMEM_LIMITS[capability], precision)]


@pytest.mark.parametrize("target", list(aot.TARGETS))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kernel", list(products_triton.GPU_CONFIGS))
def test_pruning_keeps_a_gpu_configuration_of_every_kernel_dtype_and_target(kernel, dtype, target):
    assert _kept(kernel, dtype, target)


def test_pruning_drops_what_does_not_fit_or_spills():
    wide = products_triton.GPU_CONFIGS["matmul_add"][1]  # 128 x 256 x 64, 3 stages
    assert wide.kwargs == {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64}
    for target in aot.TARGETS:  # fp32 buffers exceed both GPUs' shared memory; bf16 ones fit
        assert wide not in _kept("matmul_add", "fp32", target)
        assert wide in _kept("matmul_add", "bf16", target)
    # 3xTF32 on sm_80: the 128-wide tiles spill kilobytes of registers; plain TF32 need not
    square = products_triton.GPU_CONFIGS["sym_product"][0]  # 128 / 64
    assert square not in _kept("sym_product", "fp32", "sm_80")
    assert square in _kept("sym_product", "fp32", "sm_90") and square in _kept("sym_product", "bf16", "sm_80")


def test_autotuner_prunes_for_the_operands_device(monkeypatch):
    configs = products_triton.GPU_CONFIGS["matmul_add"]
    cpu = {"B": torch.empty(1, dtype=torch.float32)}
    assert products_triton._prune("matmul_add", configs, cpu) == configs  # the interpreter: no limits
    fake = types.SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.float32)
    limits = {}
    monkeypatch.setattr(products_triton, "_device_limits", lambda device: limits[device.index])
    limits[0] = ((9, 0), aot.SMEM_LIMITS[90])
    assert products_triton._prune("matmul_add", configs, {"B": fake}, PRECISION="tf32x3") == \
        _kept("matmul_add", "fp32", "sm_90")
    limits[0] = ((8, 6), 1024)  # nothing fits: the small configuration
    assert products_triton._prune("matmul_add", configs, {"B": fake}, PRECISION="tf32x3") == \
        [products_triton.SMALL_CONFIGS["matmul_add"]]


# --- ahead-of-time builds -----------------------------------------------------------------

def _ci_jobs():
    """Per kernel, dtype and target: every flag set once and every kept configuration (the
    SMALL one included) once, the configurations taken in turn across the flag sets."""
    jobs = []
    for kernel, flag_sets in products_triton.WRAPPER_FLAGS.items():
        for target in aot.TARGETS:
            for dtype in DTYPES:
                precision = aot.precisions(dtype)[0]
                configs = [("gpu", c) for c in _kept(kernel, dtype, target, precision)]
                configs.append(("small", products_triton.SMALL_CONFIGS[kernel]))
                for i in range(max(len(flag_sets), len(configs))):
                    source, config = configs[i % len(configs)]
                    jobs.append(aot.job(kernel, flag_sets[i % len(flag_sets)], dtype, target,
                                        aot.as_dict(config), precision, source))
            # fp32 tiles read as bf16 (kernels.precision.bf16_products): the first kept configuration
            configs = _kept(kernel, "fp32", target, "bf16")
            jobs.append(aot.job(kernel, flag_sets[0], "fp32", target, aot.as_dict(configs[0]), "bf16", "gpu"))
    return jobs


@pytest.fixture(scope="module")
def builds():
    return aot.run(_ci_jobs(), n_jobs=2)


def _report(results):
    """One line per build, then the first failed build's error (source lines included)."""
    failed = [r for r in results if not r["ok"]]
    lines = ["", *map(aot.describe, results)]
    return "\n".join(lines + ([f"first failure:\n{failed[0]['error']}"] if failed else []))


def test_every_kernel_builds_in_every_flag_set_dtype_and_target(builds):
    failed = [r for r in builds if not r["ok"]]
    if failed:
        pytest.fail(_report(failed), pytrace=False)
    covered = {(r["kernel"], tuple(sorted(r["flags"].items())), r["dtype"], r["target"]) for r in builds}
    assert covered == {(kernel, tuple(sorted(flags.items())), dtype, target)
                       for kernel, flag_sets in products_triton.WRAPPER_FLAGS.items() for flags in flag_sets
                       for dtype in DTYPES for target in aot.TARGETS}


def test_every_kept_configuration_builds_within_the_targets_shared_memory(builds):
    ok = [r for r in builds if r["ok"]]
    over = [r for r in ok if r["shared"] > r["smem_limit"]]
    if over:
        pytest.fail(_report(over), pytrace=False)
    built = {(r["kernel"], r["dtype"], r["target"], r["label"]) for r in ok}
    for kernel in products_triton.GPU_CONFIGS:
        for dtype in DTYPES:
            for target in aot.TARGETS:
                for config in _kept(kernel, dtype, target):
                    assert (kernel, dtype, target, aot.config_label(aot.as_dict(config))) in built


def test_shared_memory_estimate_bounds_the_builds(builds):
    # pruning relies on the estimate: never below what the compiler allocates
    under = [r for r in builds if r["ok"] and r["shared"] > r["estimate"]]
    if under:
        pytest.fail(_report(under), pytrace=False)


def test_kept_3xtf32_configurations_spill_little_on_sm_80(builds):
    # fp32 with 3xTF32 on sm_80: the pruned 128-row tiles spill 0.3-28 KB of registers
    heavy = [r for r in builds if r["ok"] and r["target"] == "sm_80" and r["dtype"] == "fp32"
             and r["precision"] == "tf32x3" and r["spill_stores"] > 2048]
    if heavy:
        pytest.fail(_report(heavy), pytrace=False)
