"""ManifoldMuon: Muon-family steps with each matrix kept on the manifold of its group.

One step, for every parameter W with gradient g (group options lr = eta, momentum = mu):

    buf <- mu buf + g;   G = g + mu buf  (Nesterov)  or  G = buf
    none:      W <- (1 - eta wd) W - eta msign(G)                  (plain Muon)
    manifold:  A = steepest_direction(W, G)   (tangent, ||A||_op <= 1, within ~1e-3)
               W <- R(W - eta A)                                  (retraction, fp32)

`lr` is the spectral norm of the step on every group: no extra shape factor. Weight decay
applies to the unconstrained group only (a manifold fixes or frees the scale by itself).

As any torch optimizer, a parameter whose `.grad` is None in a step (frozen, or unused by that
forward) is left alone, weight and momentum: the bank is solved for the matrices that have one.
Groups may be added at any time (`add_param_group`); a matrix given off its manifold (violation
above `on_manifold_tol`) is projected onto it in place when its group is added, at construction
or later (a frozen one at its first step with a gradient), so that every step starts on the
manifold. A group with "transposed": True stores its maps' weights (in, out), as transformers'
Conv1D: its manifold constrains the (out, in) weight (geometry.stored_wide), so a square Conv1D
weight takes the side of its nn.Linear twin.

One optimizer for a whole model: a group with "algorithm": "adamw" (any parameters, not only
matrices) is stepped by torch's AdamW with that group's lr, betas, eps and weight_decay
(defaults those of torch.optim.AdamW), its state ("step", "exp_avg", "exp_avg_sq") as AdamW's.
Such groups are stepped on every rank (their gradients are the same everywhere under DDP).

The unit of work is a *piece*: a whole parameter, or a block of its rows when its group
gives `"blocks": [(row_lo, row_hi, manifold), ...]` (the fused QKV matrix as three q | k | v
matrices, each on its own manifold). Pieces with the same manifold, shape and group options
form a *bank*, across groups, and are stacked into one batched computation; the learning
rate and weight decay may differ inside a bank (they enter per matrix). All banks are solved in
one call (solver.solve_tall_banks) under the optimizer's one SolverPlan (manifolds/plan.py),
decided when the optimizer is built (`plan`): the tall Stiefel and DGram banks of one column
count are ONE batched ADMM in span coordinates, whatever their rows.

Under torch.distributed every piece is computed by one rank, its *owner*: the pieces are cut
into buckets and each bucket's balanced over the ranks by an estimate of their cost
(step_cost.piece_cost, `balanced_owners`: longest first onto the least loaded rank), the same on every
rank without communication (manifolds/exchange.py, which owns the owners, the buckets, the
collectives and the solver's statistics; the optimizer hands it `_step_banks` and what it needs
of its state). A rank solves its pieces of a bank together, as one batched solve. The new weights
of replicated parameters are exchanged with one all-gather per bank, posted as soon as the bank's
answers exist (in flight while the next bank is retracted and the next bucket solves): each rank
sends its pieces, each followed by its new dual warm start (fp32,
flattened, padded to the largest rank's volume), and every rank writes all of them. So
every rank holds the whole state of the replicated parameters: the momentum of every matrix
(every rank updates it from its gradient, the same everywhere under DDP, so the momenta stay
bitwise equal) and every piece's warm start. `state_dict()` on any one rank (rank 0 alone saves
it in PyTorch Lightning, the transformers Trainer and accelerate) is the whole optimizer state,
loadable at any world size.

A matrix whose gradient has a non-finite entry (inf, NaN) is left as it was in that step:
weight, momentum and warm start (a mask per matrix on the device, no host sync); the others step.
"""
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake
from torch.optim.adamw import adamw

import kernels
from manifolds import exchange, step_agreement, reference
from manifolds.solver import STATS, solve_tall_banks
from manifolds.exchange import Exchange, ExchangeOptions, Replicated, StepInputs, bucket_group
from manifolds.geometry import MANIFOLDS, geometry, project_to_manifold, stored_wide, tall
from manifolds.plan import SolverOptions, plan_for
from manifolds.sharded import (is_sharded, keeps_warm_start, local, project_sharded, radius_key,
                               shard_layout, stores_radius, warm_placements, warm_shape)

# group options that may differ inside one bank: they enter the step per matrix
PER_MATRIX = ("lr", "weight_decay")
# group options that name or place a piece, not its step (a bank may mix them)
NOT_OPTIONS = ("params", "name", "blocks", "manifold", "initial_lr", "transposed")
# the update rules a group may name ("algorithm"); "muon" is the default
ALGORITHMS = ("muon", "adamw")
# an "adamw" group's options that it does not give: torch.optim.AdamW's defaults
ADAMW_DEFAULTS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)


@dataclass(frozen=True)
class Piece:
    """One matrix of the optimizer: rows [lo, hi) of a parameter, on one manifold."""
    param: torch.Tensor
    group: dict
    lo: int
    hi: int
    manifold: str

    @property
    def whole(self):
        return self.lo == 0 and self.hi == self.param.size(0)

    @property
    def dual_key(self):
        """State key of the piece's warm start ("dual" for a whole parameter)."""
        return "dual" if self.whole else f"dual@{self.lo}"

    @property
    def key(self):
        """Identifies the piece among the optimizer's (the same on every rank)."""
        return id(self.param), self.lo

    def weight(self):
        return self.param[self.lo:self.hi]

    @property
    def transposed(self):
        """The parameter stores its map's weight (in, out) (transformers' Conv1D)."""
        return bool(self.group.get("transposed", False))

    @property
    def wide(self):
        """Solved transposed, on the tall orientation of its map (geometry.stored_wide): fewer
        rows than columns, or as many when stored (in, out)."""
        return stored_wide(self.hi - self.lo, self.param.size(1), self.transposed)


def stepped(W, eta, A):
    """W - eta A in one kernel (eta a number or a tensor that broadcasts): 12 bytes an entry moved,
    not 20 in a product and a difference (GPT-2 small hetero on one H200: -0.14 ms, python -m
    bench.cost_model --fake). It may round once (a fused multiply-add) where the two rounded twice."""
    return torch.addcmul(W, eta, A, value=-1.0) if torch.is_tensor(eta) else torch.add(W, A, alpha=-eta)


def per_matrix(W, values):
    """A group option of each matrix of a bank, as a factor of W (n, p, q): a Python number when
    they are all equal (the usual case; no host-to-device copy), else an (n, 1, 1) tensor copied
    from pinned memory without blocking (a pageable copy would wait for the device).

    Options given as 0-dim tensors on W's device (a CUDA-graph-replayed step: the trainer writes
    the scheduled lr into them, the replay reads them) stay on the device: no copy, no sync."""
    if any(torch.is_tensor(v) for v in values):
        if len({id(v) for v in values}) == 1:
            return values[0].to(W.dtype)
        return torch.stack([torch.as_tensor(v, dtype=W.dtype, device=W.device) for v in values])[:, None, None]
    if len(set(values)) == 1:
        return values[0]
    host = torch.tensor(values, dtype=W.dtype)
    if W.device.type == "cuda":
        host = host.pin_memory()
    return host.to(W.device, non_blocking=True)[:, None, None]


def on_manifold_tol(dtype):
    """Largest violation of a matrix taken as on its manifold when its group is added: 1e-4, or
    a few roundings of a low-precision dtype (bf16 weights are not closer than their rounding)."""
    return max(1e-4, 4 * torch.finfo(dtype).eps)


class ManifoldMuon(torch.optim.Optimizer):
    """Group options: lr, momentum, nesterov, weight_decay, manifold (or blocks), dgram_cap (the
    column-norm cap of "dgram-cap"), transposed; algorithm ("muon", or "adamw" with
    lr, betas, eps, weight_decay). Solver options (SolverOptions fields) are the optimizer's,
    resolved once into `plan` for the parameters' device; the exchange's (ExchangeOptions fields:
    overlap, exchange_grad, resident) are keyword arguments too, kept by `exchange`."""

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.0,
                 manifold="none", dgram_cap=1.0, shard=True, **options):
        exchange_opts = {key: options.pop(key) for key in ExchangeOptions.keys() if key in options}
        self.options = SolverOptions.from_kwargs(**options)
        exchange_options = ExchangeOptions.from_kwargs(**exchange_opts)
        self._unprojected = []  # frozen matrices not yet checked against their manifold (add_param_group)
        self._agreement_checked = False  # step_agreement at the next step (also after a load or new groups)
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                        manifold=manifold, blocks=None, dgram_cap=dgram_cap, algorithm="muon")
        super().__init__(params, defaults)
        first = next((p for group in self.param_groups for p in group["params"]), None)
        self.plan = plan_for(self.options, first.device if first is not None else "cpu")
        distributed = shard and dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size() if distributed else 1
        self.rank = dist.get_rank() if distributed else 0
        # who solves which piece, the collectives, the resident copies and the statistics (exchange.py)
        self.exchange = Exchange(exchange_options, self.plan)
        for group in self.param_groups:
            self._init_sharded_state(group)

    # what torch.optim.Optimizer pickles (defaults, state, param_groups), and the rest of ours, so
    # that copy.deepcopy and pickle give a working optimizer
    OWN_ATTRIBUTES = ("options", "plan", "world_size", "rank", "exchange", "_unprojected", "_agreement_checked")

    def __getstate__(self):
        return {**super().__getstate__(), **{k: self.__dict__[k] for k in self.OWN_ATTRIBUTES}}

    @property
    def last_stats(self):
        """{bank: {"iterations", "residual", "fallbacks"}} of the last step, as tensors (stats() reads them)."""
        return self.exchange.stats

    @property
    def exchange_counts(self):
        """What the last step's exchange sent and received (bytes), its collectives, the pieces
        solved here and the most bytes of sharded exchange buffers held at once ("held")."""
        return self.exchange.counts

    def add_param_group(self, param_group):
        """Add a group (at construction or later): checks it, and projects each of its matrices
        that is off its manifold onto it, in place (exact retraction)."""
        algorithm = param_group.get("algorithm", self.defaults["algorithm"])
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {algorithm!r}; valid: {', '.join(ALGORITHMS)}")
        if algorithm == "adamw":  # AdamW's own defaults, not the Muon groups' lr and weight decay
            param_group = {**ADAMW_DEFAULTS, **param_group}
        super().add_param_group(param_group)
        self._agreement_checked = False
        if hasattr(self, "exchange"):
            self.weights_changed()
        group = self.param_groups[-1]
        if algorithm == "adamw":
            if hasattr(self, "plan"):  # at construction: once the plan is known (__init__)
                self._init_sharded_state(group)
            return
        for p in group["params"]:
            if p.dim() != 2:
                raise ValueError(f"ManifoldMuon takes matrices (or an \"adamw\" group); got a parameter of shape "
                                 f"{tuple(p.shape)}")
        for _, _, manifold in self._blocks(group, group["params"][0] if group["params"] else None):
            if manifold not in MANIFOLDS:
                raise ValueError(f"unknown manifold {manifold!r}; valid: {sorted(MANIFOLDS)}")
        for p in group["params"]:
            if is_sharded(p):
                shard_layout(p)  # a layout the exchange cannot handle fails here, not in a step
            if p.is_meta or is_fake(p):  # no values (meta device, FakeTensorMode): nothing to project
                continue
            if p.requires_grad:
                self._project_onto_manifolds(group, p)
            else:  # frozen: left as it is; projected at the first step that gives it a gradient
                self._unprojected.append(p)
        if hasattr(self, "plan"):
            self._init_sharded_state(group)

    @torch.no_grad()
    def init_state(self):
        """Create every parameter's state now, zero, as a sharded optimizer has it from
        construction: so that torch.distributed.checkpoint can load a checkpoint of a sharded run
        (every key present) into this one. A replicated piece keeps its warm start as before: used
        once present, so call this only to load a checkpoint that has them."""
        for group in self.param_groups:
            if group.get("algorithm") == "adamw":
                for p in group["params"]:
                    self._adamw_state(p)
                continue
            self._init_state(group, [piece for piece in self.pieces() if piece.group is group], replicated=True)

    def _init_sharded_state(self, group):
        """The state of a group's sharded parameters, created now: every rank has the same keys
        before the first step, as torch.distributed.checkpoint's get_state_dict needs."""
        if group.get("algorithm") == "adamw":
            for p in group["params"]:
                if is_sharded(p):
                    self._adamw_state(p)
            return
        self._init_state(group, [piece for piece in self.pieces() if piece.group is group])

    def _init_state(self, group, pieces, replicated=False):
        """Create the state of a group's sharded parameters, zero, without communication: "step" (a
        CPU tensor: the warm start is used once it is positive), "momentum_buffer" (a DTensor in the
        parameter's layout), a "radius" where the manifold stores one (NaN until known) and one
        "dual" / "dual@<lo>" per piece that keeps a warm start (a DTensor split on rows); with
        `replicated`, of its other parameters too (plain tensors, the same keys)."""
        for p in group["params"]:
            if not (replicated or is_sharded(p)):
                continue
            state = self.state[p]
            state.setdefault("step", torch.tensor(0.0))
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
        for piece in pieces:
            if (replicated or is_sharded(piece.param)) and stores_radius(piece):
                # set when the matrix was put on its manifold (_keep_radius); NaN: not yet known
                self.state[piece.param].setdefault(radius_key(piece), torch.full(
                    (), float("nan"), dtype=torch.float64, device=local(piece.param).device))
            if not (replicated or is_sharded(piece.param)) or not keeps_warm_start(piece, self.options):
                continue  # (before touching self.state, a defaultdict: no empty entries)
            state = self.state[piece.param]
            if piece.dual_key in state:
                continue
            if is_sharded(piece.param):
                from torch.distributed.tensor import zeros as sharded_zeros
                layout = shard_layout(piece.param)
                state[piece.dual_key] = sharded_zeros(warm_shape(piece), dtype=torch.float32, device_mesh=layout.mesh,
                                                      placements=warm_placements(piece.param, layout))
            else:
                state[piece.dual_key] = torch.zeros(warm_shape(piece), dtype=torch.float32, device=piece.param.device)

    def _keep_radius(self, param, lo, block):
        """Store ||block||_F (float64, on the device of param's local part) as the radius of the
        piece at row lo, the sphere it is put on (when its group is added, or it is unfrozen;
        every rank, from the whole matrix)."""
        whole = lo == 0 and block.size(0) == param.size(0)
        key = "radius" if whole else f"radius@{lo}"
        self.state[param][key] = block.detach().double().square().sum().sqrt().to(local(param).device)

    def stored_radius(self, param, lo=0):
        """The radius kept for the piece of `param` at row lo (a float64 0-dim tensor; NaN until
        known: a parameter without values when its group was added), or None: what
        geometry.manifold_violation(..., radius=) measures a Hyperball matrix against."""
        if param not in self.state:
            return None
        state = self.state[param]
        return state.get("radius" if lo == 0 and "radius" in state else f"radius@{lo}")

    def _radii(self, pieces, W):
        """(n,) float64 on W's device: the stored radius of each of a bank's pieces (W: their
        stacked weights), for the retraction (geometry.Hyperball.retract_from). One not yet known
        (NaN) becomes ||W||_F now and is kept, on the device, without a sync; a replicated piece
        without the key (a state loaded from before radii were stored) gets one."""
        stored = []
        for piece in pieces:
            state = self.state[piece.param]
            r = state.get(radius_key(piece))
            if r is None:
                r = torch.full((), float("nan"), dtype=torch.float64, device=W.device)
                if not is_sharded(piece.param):  # a sharded piece's keys are every rank's (_init_state)
                    state[radius_key(piece)] = r
            stored.append(r)
        r = torch.stack([x.to(device=W.device, dtype=torch.float64) for x in stored])
        r = torch.where(torch.isnan(r), W.double().square().sum(dim=(-2, -1)).sqrt(), r)
        torch._foreach_copy_(stored, list(r.unbind(0)))
        return r

    @torch.no_grad()
    def _project_onto_manifolds(self, group, p):
        """Project p's matrices that are off their manifold (violation > on_manifold_tol, checked
        in fp32 on their device) onto it; those on it are left bitwise as they are."""
        cap, transposed = group.get("dgram_cap", 1.0), bool(group.get("transposed", False))
        blocks = self._blocks(group, p)
        manifolds = {lo: manifold for lo, _, manifold in blocks}

        def projected(lo, hi, block):
            """The block projected onto its manifold, or None where it is on it."""
            geo = geometry(manifolds[lo], cap)
            if not geo.constrained:
                return None
            if geo.stores_radius:  # the sphere it is put on: its norm now (geometry.Hyperball)
                self._keep_radius(p, lo, block)
            violation = geo.violation(tall(block.float(), transposed))
            if bool(violation <= on_manifold_tol(p.dtype)):  # NaN: projected
                return None
            return project_to_manifold(block.float(), manifolds[lo], cap, transposed)

        if is_sharded(p):  # gathered once, here: the whole matrix decides
            project_sharded(p, blocks, projected)
            return
        for lo, hi, _ in blocks:
            new = projected(lo, hi, p[lo:hi])
            if new is not None:
                p[lo:hi].copy_(new)

    def _project_unfrozen(self):
        """Matrices added frozen that have a gradient now: onto their manifolds before their first step."""
        unfrozen = [p for p in self._unprojected if p.grad is not None]
        if not unfrozen:
            return
        self._unprojected = [p for p in self._unprojected if p.grad is None]
        unfrozen = {id(p) for p in unfrozen}
        for group in self.param_groups:  # only manifold groups put matrices in _unprojected
            for p in group["params"]:
                if id(p) in unfrozen:
                    self._project_onto_manifolds(group, p)

    @staticmethod
    def _blocks(group, p):
        """[(lo, hi, manifold)] of a parameter of this group; checks that blocks tile the rows."""
        if group.get("blocks") is None:
            return [(0, p.size(0) if p is not None else 0, group["manifold"])]
        blocks = [tuple(b) for b in group["blocks"]]
        edges = [0] + [hi for _, hi, _ in blocks]
        if p is not None and ([lo for lo, _, _ in blocks] != edges[:-1] or edges[-1] != p.size(0)
                              or any(hi <= lo for lo, hi, _ in blocks)):
            raise ValueError(f"blocks {blocks} do not tile the {p.size(0)} rows of a parameter in order")
        return blocks

    def pieces(self):
        """Every matrix ManifoldMuon steps on a manifold (not the "adamw" groups'), in group order."""
        for group in self.param_groups:
            if group.get("algorithm") == "adamw":
                continue
            for p in group["params"]:
                for lo, hi, manifold in self._blocks(group, p):
                    yield Piece(p, group, lo, hi, manifold)

    def banks(self):
        """(key, [pieces]) for each set of pieces solved together, in a fixed order: same
        manifold, tall shape (a p x q and a q x p matrix are one bank: mlp.c_fc and mlp.c_proj)
        and group options (their groups may differ in lr and weight decay)."""
        by_key = OrderedDict()
        for piece in self.pieces():
            options = tuple((k, v) for k, v in sorted(piece.group.items()) if k not in NOT_OPTIONS + PER_MATRIX)
            rows, cols = piece.hi - piece.lo, piece.param.size(1)
            key = (piece.manifold, max(rows, cols), min(rows, cols), options)
            by_key.setdefault(key, []).append(piece)
        yield from by_key.items()

    def _replicated_group(self, with_grad=lambda piece: True):
        """exchange.Group of the replicated (not sharded) pieces that `with_grad`, in bank order:
        their buckets and owners over this optimizer's ranks (exchange.bucket_group); None if none."""
        banks = []
        for _, pieces in self.banks():
            pieces = [piece for piece in pieces if with_grad(piece) and not is_sharded(piece.param)]
            if pieces:
                banks.append((self.bank_name(pieces), pieces))
        return bucket_group(Replicated(self.world_size, self.rank), banks, self.plan) if banks else None

    def owners(self):
        """{piece.key: rank} for every piece of a replicated parameter: the rank that computes its
        step (balanced over the ranks bucket by bucket: exchange.bucket_group). Sharded parameters'
        owners are their mesh's (exchange.py)."""
        group = self._replicated_group()
        return dict(group.owners) if group is not None else {}

    def owned_pieces(self):
        owners = self.owners()
        return [piece for _, pieces in self.banks() for piece in pieces if owners.get(piece.key) == self.rank]

    def _warm_numel(self, piece):
        """Elements of a piece's warm start in the exchange: q x q where the solver keeps one."""
        return warm_shape(piece)[0] * warm_shape(piece)[1] if keeps_warm_start(piece, self.options) else 0

    def all_gather_elements(self):
        """Elements of one step's all-gathers of replicated pieces (one per bucket), padded to the
        largest rank's share ((N-1)/N of them come from other ranks), the last one with STATS
        statistics per bank."""
        group = self._replicated_group()
        if group is None:
            return 0
        total = 0
        for bucket in group.buckets:
            shares = [0] * group.slots
            for _, pieces in bucket:
                for piece in pieces:
                    shares[group.owners[piece.key]] += piece.weight().numel() + self._warm_numel(piece)
            total += group.slots * max(shares)
        return total + group.slots * STATS * len(group.banks)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._project_unfrozen()
        self._step_adamw_groups()
        self._finite = {}  # {id(param): 0-dim bool, its gradient finite} of this step (_momenta)
        # a matrix without a gradient is left alone; under DDP and FSDP every rank sees the same
        # ones, so every rank builds the same exchange
        with_grad = lambda piece: piece.param.grad is not None  # noqa: E731
        # the same groups in the same order on every rank: the sharded layouts, then the replicated pieces
        groups = [bucket_group(layout, banks, self.plan)
                  for layout, banks in exchange.sharded_banks(self, with_grad).items()]
        replicated = self._replicated_group(with_grad)
        if replicated is not None:
            groups.append(replicated)
        if not self._agreement_checked:  # before any exchange whose sizes the plan sets
            self._check_agreement(groups)
        # every rank updates the momentum of every replicated matrix stepped (the whole state on
        # every rank) and forms G for those it solves; sharded parameters: their local parts
        pieces = [piece for group in groups for _, bank in group.banks for piece in bank]
        solved = [piece for group in groups for _, bank in group.banks for piece in bank
                  if group.sharded or group.owners[piece.key] == group.me]
        momenta = self._momenta(pieces, solved)
        io = StepInputs(solve=self._step_banks, momenta=momenta,
                        replicated=lambda piece: (piece.weight().float(), momenta[id(piece.param)][piece.lo:piece.hi],
                                                  self.state[piece.param].get(piece.dual_key)),
                        warm=lambda piece: local(self.state[piece.param][piece.dual_key])
                        if piece.dual_key in self.state.get(piece.param, {}) else None,
                        store_warm=self._keep_warm_starts,
                        started=lambda piece: bool(self.state[piece.param]["step"] > 0))
        self.exchange.step(groups, io, self._world())
        for param in OrderedDict((id(piece.param), piece.param) for group in groups if group.sharded
                                 for _, bank in group.banks for piece in bank).values():
            self.state[param]["step"] += 1
        return loss

    def _world(self):
        """Ranks of the default group where this optimizer exchanges over it (DDP, or sharded parameters)."""
        if self.world_size > 1:
            return self.world_size
        sharded = any(is_sharded(p) for group in self.param_groups for p in group["params"])
        return dist.get_world_size() if sharded and dist.is_available() and dist.is_initialized() else 1

    def _check_agreement(self, groups):
        """step_agreement: every rank compares the step it built with the others' (one small all-gather)
        at the first step and after a load or a change of groups; a disagreement is a StepMismatch
        on every rank, before any exchange."""
        if self._world() > 1:
            first = next(iter(self.pieces()), None)
            device = local(first.param).device if first is not None else torch.device("cpu")
            pieces = list(self.pieces())
            started = {piece.key: "step" in self.state.get(piece.param, {}) and bool(self.state[piece.param]["step"] > 0)
                       for piece in pieces}
            index = {id(p): i for i, p in enumerate(p for group in self.param_groups for p in group["params"])}
            step_agreement.check(step_agreement.describe(pieces, index, started, self.options, groups), device)
        self._agreement_checked = True

    def _step_adamw_groups(self):
        """The "adamw" groups' step: torch's AdamW (functional form, its default implementation
        for these tensors), state initialised as torch.optim.AdamW initialises it."""
        for group in self.param_groups:
            if group.get("algorithm") != "adamw":
                continue
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            capturable = self.plan.capturable
            for p in params:
                self._adamw_state(p)
            beta1, beta2 = group["betas"]
            adamw(params, [p.grad for p in params], [self.state[p]["exp_avg"] for p in params],
                  [self.state[p]["exp_avg_sq"] for p in params], [], [self.state[p]["step"] for p in params],
                  capturable=capturable, has_complex=any(torch.is_complex(p) for p in params),
                  amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                  eps=group["eps"], maximize=False)

    def _adamw_state(self, p):
        """An "adamw" parameter's state, as torch.optim.AdamW creates it."""
        state, capturable = self.state[p], self.plan.capturable
        if not state:
            state["step"] = (torch.zeros((), dtype=torch.float32, device=p.device) if capturable
                             else torch.tensor(0.0, dtype=torch.float32))
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        elif capturable and state["step"].device != p.device:  # loaded: a state_dict keeps it on the host
            state["step"] = state["step"].to(p.device, torch.float32)

    def _momenta(self, pieces, solved=None):
        """{id(param): G} for the parameters of the `solved` pieces (default: all); the momentum of
        every parameter of `pieces` updated once per step, all of a group setting's matrices in one
        kernels.momentum_update (a Triton kernel on CUDA, SLOTS matrices a launch; torch foreach
        ops elsewhere): buf <- mu buf + g;  G = g + mu buf (Nesterov) or buf. Sharded parameters:
        their local parts.

        A replicated parameter whose gradient has a non-finite entry keeps its momentum: its g is
        taken as 0 and its mu as 1 (a flag per matrix from the gradient's largest |entry|, on the
        device: no sync), and self._finite[id(param)] (a 0-dim bool) tells _finish_bank to keep
        its weight and warm start as they were."""
        by_setting = OrderedDict()
        for piece in pieces:
            group = piece.group
            by_setting.setdefault((group["momentum"], group["nesterov"]), OrderedDict())[id(piece.param)] = piece.param
        wanted = None if solved is None else {id(piece.param) for piece in solved}
        momenta = {}
        for (mu, nesterov), params in by_setting.items():
            params = list(params.values())
            for p in params:
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
            bufs = [local(self.state[p]["momentum_buffer"]) for p in params]
            grads = [local(p.grad) for p in params]  # any float dtype: the update reads it as fp32
            keep = {i for i, p in enumerate(params) if wanted is None or id(p) in wanted}
            G = {}
            # replicated matrices: a non-finite gradient leaves the momentum as it was (the flags on the
            # device, no sync); sharded ones: a shard sees only its part, so they are not checked
            replicated = [i for i, p in enumerate(params) if not is_sharded(p)]
            sharded = [i for i, p in enumerate(params) if is_sharded(p)]
            for part, checked in ((replicated, True), (sharded, False)):
                if not part:
                    continue
                flags = self._finite_flags(params, grads, part) if checked else None
                out = kernels.momentum_update([bufs[i] for i in part], [grads[i] for i in part], flags, mu, nesterov,
                                              [k for k, i in enumerate(part) if i in keep], backend=self.plan.backend)
                G.update(zip([i for i in part if i in keep], out))
            momenta.update((id(params[i]), G[i]) for i in sorted(G))
        return momenta

    def _finite_flags(self, params, grads, checked):
        """(len(checked),) bool on the device: whether each of the replicated matrices `checked`
        (indices into params and grads) has a finite gradient, each also kept in self._finite for
        _finish_bank. No sync: the momentum update reads the flags on the device
        (kernels.momentum). A function of its own: sharded parameters skip it, and bench.cost_model's
        sharded line, built from DDP's counts, drops these kernels by their call site."""
        # the largest |entry| is below inf exactly when every entry is finite (a NaN's comparison is
        # False): one launch where isfinite decomposes into four
        finite = torch.stack(torch._foreach_norm([grads[i] for i in checked], float("inf"))) < float("inf")
        for i, ok in zip(checked, finite.unbind(0)):
            self._finite[id(params[i])] = ok
        return finite

    def _step_banks(self, banks, matrices):
        """The solve the exchange runs: [(pieces, [new weight of each piece, in its orientation],
        their new warm starts stacked or None, the bank's statistics)] for banks [(name, pieces)]
        (all of each bank's pieces, or this rank's share): one solve_tall_banks under the plan.
        matrices(piece) -> (W, G, warm start or None) of a piece. Writes nothing: the exchange
        puts the results where they belong."""
        inputs = [self._bank_inputs(pieces, matrices) for _, pieces in banks]
        if self.options.solver == "reference":
            return [(pieces, *self._reference_bank(pieces, W, G)) for (W, G, _), (_, pieces) in zip(inputs, banks)]
        solutions = solve_tall_banks([(W, G, self._geometry(pieces), state)
                                      for (W, G, state), (_, pieces) in zip(inputs, banks)], self.plan)
        # lazily, bank by bank: the exchange posts a bank's gather before the next bank retracts
        return ((pieces, *self._finish_bank(pieces, W, solution))
                for (W, _, _), (_, pieces), solution in zip(inputs, banks, solutions))

    @staticmethod
    def _geometry(pieces):
        return geometry(pieces[0].manifold, pieces[0].group.get("dgram_cap", 1.0))

    @staticmethod
    def _bank_inputs(pieces, matrices):
        """(W, G, warm start) of same-shape pieces, stacked, on the tall orientation."""
        # the tall orientation: constraints act on the small Gram matrix
        on_tall = lambda X, piece: X.mT if piece.wide else X  # noqa: E731
        inputs = [matrices(piece) for piece in pieces]
        W = torch.stack([on_tall(W, piece) for piece, (W, _, _) in zip(pieces, inputs)])
        G = torch.stack([on_tall(G, piece) for piece, (_, G, _) in zip(pieces, inputs)])
        warm = [w for _, _, w in inputs]
        return W, G, torch.stack(warm) if all(w is not None for w in warm) else None

    def _finish_bank(self, pieces, W, solution):
        """([new weight of each piece] (its own orientation), new warm starts or None, statistics)
        from their solution."""
        eta = per_matrix(W, [piece.group["lr"] for piece in pieces])
        if not self._geometry(pieces).constrained:  # plain Muon: weight decay, no retraction
            decay = per_matrix(W, [piece.group["weight_decay"] for piece in pieces])
            new_W = stepped(W * (1 - eta * decay), eta, solution.A)
        else:
            # the retraction's Gram stays fp32; where the iterations run at TF32 so do its small corrections
            # a manifold with a radius (the Hyperball) retracts to the stored one, not to ||W||
            radius = {"radius": self._radii(pieces, W)} if self._geometry(pieces).stores_radius else {}
            new_W = self._geometry(pieces).retract_from(W, stepped(W, eta, solution.A), near=True,
                                                        backend=self.plan.backend, tf32_correction=self.plan.tf32,
                                                        **radius)
        finite = self._finite_mask(pieces)
        if finite is not None:  # a matrix with a non-finite gradient: its weight and warm start as they were
            new_W = torch.where(finite, new_W, W)
        states = None
        if self._geometry(pieces).constrained:
            states = (solution.warm_start if finite is None or solution.warm_start is None
                      else torch.where(finite, solution.warm_start, self._warm_starts(pieces, solution.warm_start)))
        # tensors, not floats: reading them would sync the device every bank
        stats = {"iterations": solution.iterations, "residual": solution.residual.max(), "fallbacks": solution.fallbacks}
        return [w.mT if piece.wide else w for piece, w in zip(pieces, new_W.unbind(0))], states, stats

    def _finite_mask(self, pieces):
        """(n, 1, 1) bool of a bank's pieces: whether each one's gradient is finite (this step's
        _momenta); None where it was not checked (sharded parameters)."""
        finite = getattr(self, "_finite", {})
        if not pieces or any(id(piece.param) not in finite for piece in pieces):
            return None
        return torch.stack([finite[id(piece.param)] for piece in pieces])[:, None, None]

    def _warm_starts(self, pieces, like):
        """The pieces' warm starts of the last step, stacked as `like`; zero where a piece has none."""
        old = [self.state[piece.param].get(piece.dual_key) for piece in pieces]
        return torch.stack([o.to(like.dtype) if o is not None and o.shape == s.shape else torch.zeros_like(s)
                            for o, s in zip(old, like.unbind(0))])

    def _reference_bank(self, pieces, W, G):
        """[new weight of each piece] by manifolds/reference.py, matrix by matrix (W, G tall): the
        same lr, weight decay and retraction as the fast path; no warm start."""
        geo = self._geometry(pieces)
        new_W, residuals, iterations = [], [0.0], 0
        for piece, W_i, G_i in zip(pieces, W.unbind(0), G.unbind(0)):
            new, run, residual = reference.step_tall(W_i, G_i, geo, piece.group["lr"], piece.group["weight_decay"])
            iterations, residuals = max(iterations, run), residuals + [residual]
            new_W.append(new.mT if piece.wide else new)
        finite = self._finite_mask(pieces)
        if finite is not None:  # a matrix with a non-finite gradient: as it was
            new_W = [torch.where(ok, new, piece.weight().float()) for piece, ok, new in zip(pieces, finite, new_W)]
        return new_W, None, {"iterations": torch.tensor(float(iterations)), "residual": torch.tensor(max(residuals)),
                             "fallbacks": torch.tensor(0.0)}

    def _keep_warm_starts(self, pieces, states):
        """Store each piece's warm start, into its tensor of the last step where there is one
        (one foreach copy): a CUDA graph replays the step on fixed memory, so state that the
        next step reads must be written in place, not replaced by a new tensor. Solvers without
        a warm start return no state (None)."""
        if states is None:
            for piece in pieces:
                self.state[piece.param].pop(piece.dual_key, None)
            return
        states = list(states.unbind(0)) if torch.is_tensor(states) else list(states)
        old = [self.state[piece.param].get(piece.dual_key) for piece in pieces]
        if all(o is not None and o.shape == s.shape and o.dtype == s.dtype and o.device == s.device
               for o, s in zip(old, states)):
            torch._foreach_copy_(old, states)
            return
        for piece, o, state in zip(pieces, old, states):
            if o is not None and o.shape == state.shape and o.dtype == state.dtype and o.device == state.device:
                o.copy_(state)
            else:  # the first warm start of this piece here: a tensor of its own
                self.state[piece.param][piece.dual_key] = state.clone()

    def stats(self):
        """{bank: {"iterations": int, "residual": float, "fallbacks": int}} of the last step:
        iterations and residual the largest over the bank's matrices, fallbacks the number of
        them that took the sync-free precision fallback (solver.admm_in_span: Proj_T(G) instead
        of the steepest direction), under torch.distributed over every rank's share."""
        return {name: {"iterations": int(s["iterations"]), "residual": float(s["residual"]),
                       "fallbacks": int(s.get("fallbacks", 0))}
                for name, s in self.last_stats.items()}

    @staticmethod
    def bank_name(pieces):
        """"<group names>:<rows>x<cols>" when the groups are named "<key>=<manifold>" (e.g.
        "attn.proj=dgram+mlp.fc=dgram:768x768"); otherwise "[<group names>/]<manifold>:<rows>x<cols>"."""
        manifold = pieces[0].manifold
        names = list(OrderedDict.fromkeys(piece.group.get("name") for piece in pieces if piece.group.get("name")))
        rows, cols = pieces[0].hi - pieces[0].lo, pieces[0].param.size(1)
        if names and all(name.endswith(f"={manifold}") for name in names):
            return f"{'+'.join(names)}:{rows}x{cols}"
        prefix = "+".join(names) + "/" if names else ""
        return f"{prefix}{manifold}:{rows}x{cols}"

    # --- state across world sizes and assignments ------------------------------------------

    def consolidated_state_dict(self):
        """The full state_dict, loadable by ManifoldMuon over the same parameters at any world
        size. Every rank holds the whole state of its replicated parameters (module docstring):
        that is state_dict(), no collective. With sharded parameters (FSDP2) under
        torch.distributed it is a collective, each rank's state gathered (torch.distributed.checkpoint
        is their checkpoint: README, Sharded models)."""
        state = super().state_dict()
        if self.world_size > 1 and any(is_sharded(p) for group in self.param_groups for p in group["params"]):
            shards = [None] * self.world_size
            dist.all_gather_object(shards, {k: _to_cpu(v) for k, v in state["state"].items()})
            merged = {}
            for shard in shards:  # a parameter's pieces may live on several ranks
                for k, v in shard.items():
                    merged.setdefault(k, {}).update(v)
            state["state"] = merged
        return state

    def load_state_dict(self, state_dict):
        """torch's load, but a ManifoldMuon group's state keeps its dtype: torch casts floating
        state to its parameter's dtype, which would round the fp32 momentum and warm start of a
        bf16 parameter to bf16 (the "adamw" groups' state follows torch, as AdamW's does). Every
        rank keeps the whole state it is given (a dict saved by any one rank is the whole state)."""
        super().load_state_dict(state_dict)
        saved = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [(p, group.get("algorithm") != "adamw") for group in self.param_groups for p in group["params"]]
        for i, (p, muon) in zip(saved, params):
            state = self.state.get(p) if muon else None
            for key, value in (state_dict["state"].get(i, {}) if state else {}).items():
                if torch.is_tensor(value) and torch.is_tensor(state.get(key)) and value.dtype != state[key].dtype:
                    state[key] = value.to(device=state[key].device)
        self._agreement_checked = False  # a resume: the warm-start flags come from the loaded state
        self.weights_changed()  # the owners' warm starts are the loaded ones now

    def weights_changed(self):
        """Forget the owners' resident copies of sharded matrices (manifolds/exchange.py): the next
        step sends every W and warm start again. Not needed for a change of the shards or warm
        starts by any route (the step compares digests of what they hold: Exchange.resident_flags);
        called by load_state_dict and add_param_group, where the pieces or owners may change. Call
        it on every rank."""
        self.exchange.forget()

    def reassign(self, param_groups):
        """Replace the groups (the same parameters; new manifolds or blocks) in place, keeping
        every parameter's momentum. A piece whose manifold or rows changed loses its dual warm
        start. Call it on every rank (with sharded parameters a collective: consolidated_state_dict)."""
        old = self.consolidated_state_dict()["state"]
        old_params = [p for group in self.param_groups for p in group["params"]]
        old_pieces = {(id(pc.param), pc.dual_key): pc.manifold for pc in self.pieces()}
        by_param = {id(p): old[i] for i, p in enumerate(old_params) if i in old}
        self.param_groups = []
        self.weights_changed()
        for group in param_groups:
            self.add_param_group(group)
        if {id(p) for g in self.param_groups for p in g["params"]} != {id(p) for p in old_params}:
            raise ValueError("reassign takes the same parameters in new groups")
        new_pieces = {(id(pc.param), pc.dual_key): pc.manifold for pc in self.pieces()}
        self.state.clear()
        for group in self.param_groups:
            for p in group["params"]:
                for k, v in by_param.get(id(p), {}).items():
                    if k.startswith("dual") and old_pieces.get((id(p), k)) != new_pieces.get((id(p), k)):
                        continue
                    self.state[p][k] = v.to(p.device) if torch.is_tensor(v) else v


def _to_cpu(state):
    return {k: v.cpu() if torch.is_tensor(v) else v for k, v in state.items()}
