"""What the solver runs, decided once, before the first step.

`SolverOptions` are the settings a user or an experiment may change (the trainer's
`--solver-opt KEY=VALUE`); "auto" leaves a choice to the device. `SolverPlan` is those settings
resolved for one device and dtype when the optimizer is built: the kernels, the spectral clip,
the precision of the iterations and of their matrix signs, the sync-free mode and every
schedule length. The step reads the plan and passes what it uses to each call; nothing deeper
looks at a tensor's device or at a global to decide what runs. The trainer prints the plan in
its first lines and records it in config.json under "solver".

How each default was chosen, with its evidence: docs/solver-tuning.md.
"""
import math
from dataclasses import asdict, dataclass, fields

import torch

import kernels
from kernels.matrix_sign import CLIP_SCHEDULE, EXACT_SCHEDULE, POLAR_SCHEDULE
from manifolds import newton

CLIPS = ("auto", "eigh", "polynomial")
PRECISIONS = ("auto", "fp32", "tf32", "bf16")
CAPTURABLE = ("auto", True, False)
SOLVERS = ("fast", "reference")
SCHEMES = ("online", "admm", "newton")  # newton: manifolds/newton.py

# Fixed budgets (not settings: no experiment moves them)
MUON_STEPS = (5, 0)  # plain Muon's msign, as the field runs it: 5 Polar Express steps, no polish,
                     # in the plan's sign dtype (bf16 on a GPU)
EXACT_PE_STEPS = (5, 2)  # square Stiefel's exact sign below TF32: Polar Express, then 2 Newton-Schulz polish
ONLINE_COLD = 4      # online scheme: dual steps of a cold solve (the first step has no multiplier yet)
NORM_ITERS = 8       # power steps (on S^32) of the penalty's ||Proj_T G||_op estimate
NORM_SQUARINGS = 10  # squarings (S^1024) of the final renormalisation's bound on ||A||_op
CHECK_EVERY = 2      # ADMM iterations between convergence checks (host syncs) when not capturable
RHO_MAX = 10.0       # the warm penalty's growth stops here (relative to ||Proj_T G||_op)


@dataclass(frozen=True)
class SolverOptions:
    scheme: str = "online"     # online: one dual step per training step; admm: ADMM to the budget below
    dual_step: float = 0.25    # online: the dual step, as a fraction of its Newton estimate
    stiefel_dual_step: float = 0.25  # online: the same for (non-square) Stiefel matrices; 0: no dual step
    sharpen: bool = True       # online: a Newton-Schulz step on the answer's singular values (solver.FullProblem.sharpened)
    iterations: int = 3        # ADMM iterations from a warm start; x2 cold, x2 again for rows < 2 cols
    pullbacks: int = 2         # rounds of B <- Proj_T(pull_back(B)) on ADMM's answer
    rho: float = 0.5           # ADMM penalty from a cold start, relative to ||Proj_T G||_op
    rho_warm: float = 0.07     # ... from the previous step's multiplier
    rho_growth: float = 1.5    # the warm penalty's factor per iteration (1 = constant)
    warm_average: float = 0.5  # share of the incoming warm start kept in the next one, in [0, 1)
    relax: float = 1.7         # over-relaxation of B (1 = plain ADMM)
    tol: float = 1e-4          # stop when the relative primal and dual residuals are below it
    precision: str = "auto"    # ADMM's iterations: fp32, tf32 or bf16; auto: tf32 on fp32 CUDA, else fp32
    clip: str = "auto"         # spectral clip: eigh (of the q x q Gram) or polynomial; auto: eigh on CPU
    capturable: object = "auto"  # no host syncs (fixed budgets); auto: on CUDA
    backend: str = "auto"      # kernels: triton, torch, or auto (triton on CUDA)
    solver: str = "fast"       # fast (this plan), or reference: manifolds/reference.py, exact SVDs, slow
    # (the exchange's settings, resident copies, G's wire dtype and overlap, are
    # manifolds/exchange.py's ExchangeOptions: the trainer's --exchange-opt)

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise ValueError(f"unknown solver scheme {self.scheme!r}; valid: {', '.join(SCHEMES)}")
        if not 0 < self.dual_step <= 2:
            raise ValueError(f"dual_step must lie in (0, 2]; got {self.dual_step}")
        if not 0 <= self.stiefel_dual_step <= 2:
            raise ValueError(f"stiefel_dual_step must lie in [0, 2]; got {self.stiefel_dual_step}")
        if self.solver not in SOLVERS:
            raise ValueError(f"unknown solver {self.solver!r}; valid: {', '.join(SOLVERS)}")
        if self.clip not in CLIPS:
            raise ValueError(f"unknown clip {self.clip!r}; valid: {', '.join(CLIPS)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown solver precision {self.precision!r}; valid: {', '.join(PRECISIONS)}")
        if self.capturable not in CAPTURABLE or not isinstance(self.capturable, (bool, str)):
            raise ValueError(f"capturable must be True, False or 'auto'; got {self.capturable!r}")
        if self.backend not in kernels.BACKENDS:
            raise ValueError(f"unknown kernel backend {self.backend!r}; valid: {', '.join(kernels.BACKENDS)}")
        if self.iterations < 1 or self.pullbacks < 0:
            raise ValueError(f"iterations must be >= 1 and pullbacks >= 0; got {self.iterations}, {self.pullbacks}")
        if not 0 <= self.warm_average < 1:
            raise ValueError(f"warm_average must lie in [0, 1); got {self.warm_average}")
        if min(self.rho, self.rho_warm, self.rho_growth, self.relax) <= 0 or self.tol < 0:
            raise ValueError("rho, rho_warm, rho_growth and relax must be positive, tol >= 0")

    @classmethod
    def from_kwargs(cls, **kwargs):
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise TypeError(f"unknown solver options {unknown}; valid: {names}")
        return cls(**{key: parse_option(key, value) for key, value in kwargs.items()})


def parse_option(key, value, options=SolverOptions):
    """A SolverOptions (or other `options` dataclass's) value given to the Python API: text is
    parsed as --solver-opt KEY=VALUE parses it (a bool field takes on / off / true / false, a
    number its digits), never taken for its truth ("off" is a non-empty string); a switch given
    as anything but a bool or such text, a number as a bool, and text that does not parse are a
    ValueError naming KEY."""
    default = {f.name: f.default for f in fields(options)}[key]
    kind = solver_value_kind(key, default, options)
    if isinstance(value, str) and kind != "str":
        parsed = parse_solver_value(kind, value)
        if parsed is None or (kind in ("int", "float") and parsed < 0):
            raise ValueError(f"solver option {key} takes {SOLVER_VALUE_TEXT[kind]}"
                             f"{' (>= 0)' if kind in ('int', 'float') else ''}, got {value!r}")
        return parsed
    if kind == "switch" and not isinstance(value, bool):
        raise ValueError(f"solver option {key} takes True / False (or 'on' / 'off'), got {value!r}")
    if kind in ("int", "float") and isinstance(value, bool):
        raise ValueError(f"solver option {key} takes {SOLVER_VALUE_TEXT[kind]}, got {value!r}")
    return value


# --- SolverOptions values as text (the trainer's --solver-opt KEY=VALUE) ---------------------------

def show_value(value):
    return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


def solver_value_kind(key, default, options=SolverOptions):
    """What --solver-opt (or --exchange-opt, options=ExchangeOptions) KEY takes, from the type of
    KEY's default: "switch" (on/off) for a bool, "auto-or-switch" for a field that defaults to
    "auto" without being typed str (capturable), else the default's type name (int, float, str)."""
    field_type = {f.name: f.type for f in fields(options)}[key]
    if isinstance(default, bool):
        return "switch"
    if default == "auto" and field_type not in (str, "str"):
        return "auto-or-switch"
    return type(default).__name__


SOLVER_VALUE_TEXT = {"switch": "on or off", "auto-or-switch": "auto, on or off", "int": "a whole number",
                     "float": "a finite number", "str": "a name"}
SWITCH = {"on": True, "true": True, "off": False, "false": False}


def parse_solver_value(kind, text):
    """VALUE of --solver-opt KEY=VALUE for KEY's `kind` (solver_value_kind); None when it does not parse."""
    word = text.strip().lower()
    if kind == "switch":
        return SWITCH.get(word)
    if kind == "auto-or-switch":
        return "auto" if word == "auto" else SWITCH.get(word)
    if kind in ("int", "float"):
        try:
            value = int(text) if kind == "int" else float(text)
        except ValueError:
            return None
        return value if math.isfinite(value) else None
    return text


@dataclass(frozen=True)
class SolverPlan:
    """SolverOptions resolved for one device and dtype (`plan_for`): what every step runs."""
    options: SolverOptions
    device: str          # "cpu", "cuda", ...
    backend: str         # "triton" or "torch": every product of the step
    clip: str            # "eigh" or "polynomial": ADMM's polar start, spectral clip and pullbacks
    precision: str       # "fp32", "tf32" or "bf16": the products of ADMM's iterations in span coordinates
    sign_dtype: str      # dtype of ADMM's polynomial matrix signs ("bfloat16" below fp32 iterations)
    capturable: bool     # no host syncs: fixed budgets, decisions on the device
    clip_steps: int      # CLIP_SCHEDULE steps of the clip's and pullbacks' signs (one fewer below fp32:
                         # the last reaches an accuracy such products cannot hold)
    polar_steps: int     # POLAR_SCHEDULE steps of ADMM's starting polar factor (all, at every precision)
                         # and of the online scheme's sign (one fewer where it sharpens: solver.online_sign_steps)
    exact_sign: tuple    # square Stiefel's msign: ("minimax", 7) at TF32, else ("polar-express", 5 + 2)

    @property
    def tf32(self):
        return self.precision == "tf32"

    @property
    def sign_torch_dtype(self):
        return getattr(torch, self.sign_dtype)

    def as_dict(self):
        """A JSON-able record (config.json's "solver")."""
        record = asdict(self)
        record["options"] = asdict(self.options)
        record["exact_sign"] = list(self.exact_sign)
        record["fixed"] = {"muon_steps": list(MUON_STEPS), "online_cold": ONLINE_COLD, "norm_iters": NORM_ITERS,
                           "norm_squarings": NORM_SQUARINGS, "check_every": CHECK_EVERY,
                           "rho_max": RHO_MAX}
        return record

    def summary(self):
        """One line for a run's log."""
        o = self.options
        if o.solver == "reference":
            return (f"solver on {self.device}: reference (manifolds/reference.py: plain torch, exact SVDs, ADMM to "
                    f"convergence; slow), capturable off")
        sign = "" if self.clip == "eigh" else f", signs {self.sign_dtype} (clip {self.clip_steps} steps, polar {self.polar_steps})"
        return (f"solver on {self.device}: kernels {self.backend}, clip {self.clip}, iterations {self.precision}{sign}, "
                f"square stiefel exact ({self.exact_sign[0]} {self.exact_sign[1]}), "
                f"capturable {'on' if self.capturable else 'off'}; " + self.scheme_summary())

    def scheme_summary(self):
        """The scheme's own settings, for summary()."""
        o = self.options
        if o.scheme == "online":
            return (f"online dual: 1 sign per warm step / {ONLINE_COLD} cold, dual step {o.dual_step} "
                    f"(stiefel {o.stiefel_dual_step}), sharpen {'on' if o.sharpen else 'off'}")
        if o.scheme == "newton":
            return (f"newton: {newton.NEWTON_WARM} damped Newton steps on the multiplier per warm step / "
                    f"{newton.NEWTON_COLD} cold, {newton.CG_STEPS} CG steps each, damping {newton.DAMPING}")
        return (f"ADMM {o.iterations} warm / {2 * o.iterations} cold "
                f"(x2 near-square), pullbacks {o.pullbacks}, rho {o.rho} / {o.rho_warm} x{o.rho_growth}, "
                f"relax {o.relax}, warm average {o.warm_average}, tol {o.tol:g}")


def plan_for(options, device, dtype=torch.float32):
    """Resolve `options` for tensors of `device` and `dtype` (the weights the step updates)."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    kernels.check_backend(options.backend, device)
    if options.backend == "auto":
        backend = "triton" if cuda and dtype in kernels.TRITON_DTYPES and kernels.triton_available() else "torch"
    else:
        backend = options.backend
    if options.clip == "auto":
        # eigh of the q x q Gram costs a few q^3 and is exact; on a GPU its sequential algorithm is
        # the slower one, and the Triton kernels run the polynomial
        clip = "eigh" if device.type == "cpu" and backend != "triton" else "polynomial"
    else:
        clip = options.clip
    if options.precision == "auto":
        precision = ("tf32" if cuda and dtype == torch.float32
                     else "bf16" if dtype in (torch.bfloat16, torch.float16) else "fp32")
    else:
        precision = options.precision
    full = precision == "fp32" and dtype == torch.float32
    capturable = cuda if options.capturable == "auto" else options.capturable
    if options.solver == "reference":
        if options.capturable is True:
            raise ValueError("the reference solver reads values on the host: it cannot be capturable")
        capturable = False
    exact_sign = ("minimax", len(EXACT_SCHEDULE)) if precision == "tf32" else ("polar-express", sum(EXACT_PE_STEPS))
    return SolverPlan(options=options, device=device.type, backend=backend, clip=clip, precision=precision,
                      sign_dtype="float32" if full else "bfloat16", capturable=bool(capturable),
                      clip_steps=len(CLIP_SCHEDULE) - (0 if full else 1), polar_steps=len(POLAR_SCHEDULE),
                      exact_sign=exact_sign)
