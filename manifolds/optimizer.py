"""ManifoldMuon: Muon-family steps with each matrix kept on the manifold of its group.

One step, for every parameter W with gradient g (group options lr = eta, momentum = mu):

    buf <- mu buf + g;   G = g + mu buf  (Nesterov)  or  G = buf
    none:      W <- (1 - eta wd) W - eta msign(G)                  (plain Muon)
    manifold:  A = steepest_direction(W, G)   (tangent, ||A||_op = 1)
               W <- R(W - eta A)                                  (retraction, fp32)

`lr` is the spectral norm of the step on every group: no extra shape factor. Weight decay
applies to the unconstrained group only (a manifold fixes or frees the scale by itself).

Parameters of the same shape in a group form a *bank* and are stacked into one batched
computation. Each parameter keeps its momentum and its dual warm start (Lambda, or the ADMM
multiplier) in the optimizer state, so a state_dict resumes exactly.
"""
from collections import OrderedDict
from dataclasses import asdict

import torch

from manifolds.dual import SolverOptions, solve_tall
from manifolds.geometry import MANIFOLDS

SOLVER_DEFAULTS = asdict(SolverOptions())


class ManifoldMuon(torch.optim.Optimizer):
    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.0,
                 manifold="none", **solver_opts):
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
        self.last_stats = {}

    def banks(self):
        """(group, [params]) for each set of same-shape parameters of a group, in a fixed order."""
        for group in self.param_groups:
            by_shape = OrderedDict()
            for p in group["params"]:
                by_shape.setdefault(tuple(p.shape), []).append(p)
            for params in by_shape.values():
                yield group, params

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.last_stats = {}
        for group, params in self.banks():
            params = [p for p in params if p.grad is not None]
            if params:
                self._step_bank(group, params)
        return loss

    def _momentum(self, group, p):
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
        buf = state["momentum_buffer"]
        g = p.grad.float()
        buf.mul_(group["momentum"]).add_(g)
        return g.add(buf, alpha=group["momentum"]) if group["nesterov"] else buf.clone()

    def _step_bank(self, group, params):
        G = torch.stack([self._momentum(group, p) for p in params])
        W = torch.stack([p.float() for p in params])
        wide = W.size(-2) < W.size(-1)
        if wide:  # work on the tall orientation: constraints act on the small Gram matrix
            W, G = W.mT, G.mT
        new_W, stats = self.compute_bank_update(group, params, W, G)
        if wide:
            new_W = new_W.mT
        for p, w in zip(params, new_W):
            p.copy_(w)
        self.last_stats[self.bank_name(group, params)] = stats

    def compute_bank_update(self, group, params, W, G):
        """New weights for a stacked, tall bank; the piece a distributed wrapper shards."""
        eta, manifold = group["lr"], group["manifold"]
        opts = SolverOptions(**{k: group[k] for k in SOLVER_DEFAULTS})
        warm = [self.state[p].get("dual") for p in params]
        state = torch.stack(warm) if all(w is not None for w in warm) else None
        solution = solve_tall(W, G, manifold, state, opts)
        if manifold == "none":
            new_W = W * (1 - eta * group["weight_decay"]) - eta * solution.A
        else:
            new_W = MANIFOLDS[manifold].retract(W - eta * solution.A, near=True, backend=opts.backend)
            for p, s in zip(params, solution.state):
                self.state[p]["dual"] = s
        stats = {"iterations": solution.iterations,
                 "residual": float(solution.residual.max()) if manifold != "none" else 0.0}
        return new_W, stats

    @staticmethod
    def bank_name(group, params):
        rows, cols = params[0].shape
        return f"{group.get('name', group['manifold'])}:{rows}x{cols}"
