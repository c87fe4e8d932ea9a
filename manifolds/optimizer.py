"""ManifoldMuon: Muon-family steps with each matrix kept on the manifold of its group.

One step, for every parameter W with gradient g (group options lr = eta, momentum = mu):

    buf <- mu buf + g;   G = g + mu buf  (Nesterov)  or  G = buf
    none:      W <- (1 - eta wd) W - eta msign(G)                  (plain Muon)
    manifold:  A = steepest_direction(W, G)   (tangent, ||A||_op = 1)
               W <- R(W - eta A)                                  (retraction, fp32)

`lr` is the spectral norm of the step on every group: no extra shape factor. Weight decay
applies to the unconstrained group only (a manifold fixes or frees the scale by itself).

Parameters of the same shape in a group form a *bank* and are stacked into one batched
computation. Under torch.distributed each rank computes the step for its contiguous share
of every bank (ceil(n / world) matrices; the last shares may be short or empty) and the new
weights are exchanged with one all-gather per bank, started asynchronously so that the
exchange of one bank overlaps the computation of the next. The momentum and the dual warm
start of a matrix live only on the rank that owns it; `consolidated_state_dict` gathers
them, and `load_state_dict` of a consolidated dict works for any world size.
"""
from collections import OrderedDict
from dataclasses import asdict

import torch
import torch.distributed as dist

from manifolds.dual import SolverOptions, solve_tall
from manifolds.geometry import MANIFOLDS

SOLVER_DEFAULTS = asdict(SolverOptions())


class ManifoldMuon(torch.optim.Optimizer):
    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.0,
                 manifold="none", shard=True, **solver_opts):
        unknown = set(solver_opts) - set(SOLVER_DEFAULTS)
        if unknown:
            raise TypeError(f"unknown options {sorted(unknown)}; solver options: {sorted(SOLVER_DEFAULTS)}")
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                        manifold=manifold, **{**SOLVER_DEFAULTS, **solver_opts})
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["manifold"] not in MANIFOLDS:
                raise ValueError(f"unknown manifold {group['manifold']!r}; valid: {sorted(MANIFOLDS)}")
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(f"ManifoldMuon takes matrices; got a parameter of shape {tuple(p.shape)}")
        distributed = shard and dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size() if distributed else 1
        self.rank = dist.get_rank() if distributed else 0
        self.last_stats = {}

    def banks(self):
        """(group, [params]) for each set of same-shape parameters of a group, in a fixed order."""
        for group in self.param_groups:
            by_shape = OrderedDict()
            for p in group["params"]:
                by_shape.setdefault(tuple(p.shape), []).append(p)
            for params in by_shape.values():
                yield group, params

    def share(self, n):
        """[lo, hi) of the n matrices of a bank that this rank computes, and the padded share size."""
        size = -(-n // self.world_size)
        lo = min(self.rank * size, n)
        return lo, min(lo + size, n), size

    def owned(self):
        """Parameters whose state this rank keeps."""
        return [p for _, params in self.banks() for p in params[slice(*self.share(len(params))[:2])]]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.last_stats = {}
        pending = []
        for group, params in self.banks():
            if any(p.grad is None for p in params):
                if all(p.grad is None for p in params):
                    continue
                raise RuntimeError("ManifoldMuon needs gradients for all or none of a bank's matrices")
            lo, hi, size = self.share(len(params))
            mine = self._step_bank(group, params[lo:hi]) if hi > lo else None
            if self.world_size == 1:
                self._write(params, mine)
                continue
            # equal-sized pieces for the all-gather: pad a short or empty share
            piece = torch.zeros((size,) + params[0].shape, dtype=torch.float32, device=params[0].device)
            if mine is not None:
                piece[: hi - lo] = mine
            gathered = [torch.empty_like(piece) for _ in range(self.world_size)]
            pending.append((dist.all_gather(gathered, piece, async_op=True), gathered, params))
        for handle, gathered, params in pending:
            handle.wait()
            self._write(params, torch.cat(gathered)[: len(params)])
        return loss

    @staticmethod
    def _write(params, new_W):
        for p, w in zip(params, new_W):
            p.copy_(w)

    def _momentum(self, group, p):
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
        buf = state["momentum_buffer"]
        g = p.grad.float()
        buf.mul_(group["momentum"]).add_(g)
        return g.add(buf, alpha=group["momentum"]) if group["nesterov"] else buf.clone()

    def _step_bank(self, group, params):
        """New weights (stacked, original orientation) for these same-shape parameters."""
        G = torch.stack([self._momentum(group, p) for p in params])
        W = torch.stack([p.float() for p in params])
        wide = W.size(-2) < W.size(-1)
        if wide:  # work on the tall orientation: constraints act on the small Gram matrix
            W, G = W.mT, G.mT
        eta, manifold = group["lr"], group["manifold"]
        opts = SolverOptions(**{k: group[k] for k in SOLVER_DEFAULTS})
        warm = [self.state[p].get("dual") for p in params]
        state = torch.stack(warm) if all(w is not None for w in warm) else None
        solution = solve_tall(W, G, manifold, state, opts)
        if manifold == "none":
            new_W = W * (1 - eta * group["weight_decay"]) - eta * solution.A
        else:
            new_W = MANIFOLDS[manifold].retract(W - eta * solution.A, near=True, backend=opts.backend)
            for i, p in enumerate(params):  # solvers without a warm start return no state
                if solution.state is None:
                    self.state[p].pop("dual", None)
                else:
                    self.state[p]["dual"] = solution.state[i]
        # tensors, not floats: reading them would sync the device every bank
        self.last_stats[self.bank_name(group, params)] = {"iterations": solution.iterations,
                                                          "residual": solution.residual.max()}
        return new_W.mT if wide else new_W

    def stats(self):
        """{bank: {"iterations": int, "residual": float}} of the last step (this rank's shares)."""
        return {name: {"iterations": s["iterations"], "residual": float(s["residual"])}
                for name, s in self.last_stats.items()}

    @staticmethod
    def bank_name(group, params):
        rows, cols = params[0].shape
        return f"{group.get('name', group['manifold'])}:{rows}x{cols}"

    # --- state across world sizes -------------------------------------------------------

    def consolidated_state_dict(self):
        """The full state_dict, gathered from the owning ranks (a collective; every rank
        gets it). Loadable by ManifoldMuon over the same parameters at any world size."""
        state = super().state_dict()
        if self.world_size > 1:
            shards = [None] * self.world_size
            dist.all_gather_object(shards, {k: _to_cpu(v) for k, v in state["state"].items()})
            state["state"] = {k: v for shard in shards for k, v in shard.items()}
        return state

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        keep = {id(p) for p in self.owned()}
        for p in list(self.state):
            if id(p) not in keep:
                del self.state[p]  # another rank owns it now


def _to_cpu(state):
    return {k: v.cpu() if torch.is_tensor(v) else v for k, v in state.items()}
