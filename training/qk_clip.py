"""QK-Clip (Kimi K2's MuonClip), on manifold-constrained attention.

After each optimizer step, every head h whose largest attention logit in that step's training
forward passes exceeded tau gets gamma_h = tau / max_logit_h < 1, and its query and key
projections are scaled so that the logit, bilinear in them, scales by gamma_h: W_q,h and
W_k,h (the head's d_head rows of each) by sqrt(gamma_h) each. That is a row scaling, and which
rescalings keep a matrix on its manifold decides what we do (tall orientation W, W^T W):

* none (plain Muon): any scaling is allowed: the head's rows, exactly as MuonClip.
* dgram, dgram-cap (W^T W diagonal): a row scaling S W gives W^T S^2 W, not diagonal, so the
  matrix would leave the manifold; a scalar c W stays on it (c^2 W^T W; c < 1 keeps the cap).
  So the whole matrix is scaled, by the factor of the layer's worst head: every head of the
  layer is clipped at least as much as it needs. On the fused QKV matrix that also scales V
  (the attention output shrinks with it); split blocks (--assign attn.q=dgram,...) scale only
  the q and k blocks.
* stiefel (W^T W = I): no scaling is on the manifold; nothing is done, and the skip is counted.
  Its logits are bounded anyway: |q_i . k_j| <= |x_i| |x_j| / sqrt(d_head).
* oblique (diag(W^T W) = 1): any scaling changes the unit column norms; nothing is done either.

When only one of the q and k matrices can be scaled (split blocks, one of them Stiefel), it
takes the whole factor gamma instead of sqrt(gamma).

The optimizer's warm start scales with the matrix. The solver keeps the correction C = Lambda -
Lambda0 of the dual multiplier, in units of the unit tangent gradient (manifolds/solver.py), and
starts the next step from X = Proj_T G + 2 W C. The tangent space at c W is the one at W, so
Proj_T G and the optimum do not move; X is unchanged when c W carries C / c. So a matrix scaled
by c has its stored warm start ("dual" / "dual@<lo>", manifolds/optimizer.py Piece.dual_key)
divided by c, in place (a CUDA graph reads it there; under FSDP its local part); left alone, the
next step starts as if the multiplier were c times off (direction quality 0.96 at c = 0.5, 0.86 at
c = 3, several steps to recover).

The maxima come from CausalSelfAttention's `track_logits` (a per-head device buffer over the
step's micro-steps), reduced with MAX over ranks, so every rank scales the same way. Nothing
here reads a device value on the host: the counters are tensors, read when a row is logged.
"""
import torch
import torch.distributed as dist

from manifolds.geometry import geometry


def scaling(manifold):
    """How a q or k matrix on this manifold may be rescaled: "rows", "matrix" or None (its class says)."""
    return geometry(manifold).qk_clip_scaling


class QKClip:
    def __init__(self, attentions, matrices, tau, distributed=False, optimizer=None):
        """attentions: the layers' CausalSelfAttention modules; matrices: manifolds.param_groups'
        assigned_matrices [Matrix] (its attn.qkv entries give each layer's blocks and their
        manifolds, in layer order); optimizer: the ManifoldMuon whose warm starts scale with the
        matrices (None: there are none to keep consistent)."""
        if tau <= 0:
            raise ValueError(f"QK-Clip needs tau > 0, got {tau}")
        self.attentions = list(attentions)
        self.tau = tau
        self.distributed = distributed
        self.optimizer = optimizer
        self.follow(matrices)
        device = self.layers[0][0].device
        n_head = self.attentions[0].n_head
        self.heads_clipped = torch.zeros(len(self.layers), n_head, dtype=torch.int64, device=device)
        self.skipped = torch.zeros(len(self.layers), dtype=torch.int64, device=device)  # Stiefel: steps not scaled
        self.events = torch.zeros((), dtype=torch.int64, device=device)  # steps with any clip
        for attention in self.attentions:
            attention.track_logits = True
            attention.logit_max.fill_(-float("inf"))

    def follow(self, matrices):
        """Follow new assigned matrices (--assign auto's switches change the attention's manifolds)."""
        self.layers = [(param, blocks) for _, param, key, blocks, _ in matrices if key == "attn.qkv"]
        if len(self.layers) != len(self.attentions):
            raise ValueError("QK-Clip: one fused QKV matrix per attention layer expected")

    @torch.no_grad()
    def step(self):
        """Scale the q and k weights of the heads over tau (see the module docstring); reset the maxima."""
        maxima = torch.stack([attention.logit_max for attention in self.attentions])  # (L, H)
        if self.distributed:
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        over = maxima > self.tau
        gamma = torch.where(over, self.tau / maxima.clamp_min(self.tau), torch.ones_like(maxima))
        for layer, ((param, blocks), attention) in enumerate(zip(self.layers, self.attentions)):
            self._scale(param, blocks, gamma[layer], over[layer], attention.d_head, layer)
            attention.logit_max.fill_(-float("inf"))
        self.heads_clipped += over
        self.events += over.any()

    def _scale(self, param, blocks, gamma, over, d_head, layer):
        W = param.data
        C = W.size(0) // 3
        sides = [(lo, hi, manifold) for _, lo, hi, manifold in blocks if lo < 2 * C]  # blocks holding q or k rows
        scalable = sum(1 for lo, hi, manifold in sides for side in ("q", "k")
                       if scaling(manifold) and _holds(lo, hi, side, C))
        if scalable == 0:
            self.skipped[layer] += over.any()
            return
        power = 1.0 / scalable  # the logit is bilinear in q and k: split gamma over what can scale
        if any(scaling(m) is None for _, _, m in sides):
            self.skipped[layer] += over.any()  # one side could not take its share
        per_head = gamma.pow(power).repeat_interleave(d_head)  # (C,): a factor per row of a q or k block
        for lo, hi, manifold in sides:
            how = scaling(manifold)
            if how == "rows":
                for side, start in (("q", 0), ("k", C)):
                    if _holds(lo, hi, side, C):
                        W[start:start + C] *= per_head[:, None]
            elif how == "matrix":  # c W scales each of its q and k sides by c: the logit by c^scalable
                factor = gamma.min().pow(power)
                W[lo:hi] *= factor
                self._scale_warm_start(param, lo, hi, factor)

    def _scale_warm_start(self, param, lo, hi, factor):
        """The warm start of rows [lo, hi) of param divided by the factor its matrix took (see the
        module docstring); its key as manifolds/optimizer.py's Piece.dual_key names it."""
        if self.optimizer is None:
            return
        key = "dual" if lo == 0 and hi == param.size(0) else f"dual@{lo}"
        warm = self.optimizer.state.get(param, {}).get(key)
        if warm is not None:
            local = warm.to_local() if hasattr(warm, "to_local") else warm  # FSDP: a DTensor; scale its part
            local.div_(factor.to(local.dtype))

    def stats(self):
        """Counters for a log row (reading them syncs the device)."""
        return {"qk_clip_heads": self.heads_clipped.sum(dim=1).tolist(),
                "qk_clip_skipped": self.skipped.tolist(),
                "qk_clip_events": int(self.events)}

    def state_dict(self):
        return {"tau": self.tau, "heads_clipped": self.heads_clipped.cpu(), "skipped": self.skipped.cpu(),
                "events": self.events.cpu()}

    def load_state_dict(self, state):
        self.heads_clipped.copy_(state["heads_clipped"])
        self.skipped.copy_(state["skipped"])
        self.events.copy_(state["events"])


def _holds(lo, hi, side, C):
    """Does the row range [lo, hi) of the fused QKV matrix contain the q (or k) block?"""
    start = 0 if side == "q" else C
    return lo <= start and start + C <= hi
