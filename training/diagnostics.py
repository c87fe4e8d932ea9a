"""What an eval row shows besides the loss: the mechanism by which an assignment works or fails.

The DGram-attention instability (README.md, docs/experiments.md): DGram leaves the singular values of
W_Q and W_K free; the attention logits x W_Q W_K^T x^T / sqrt(d_head) grow with them, the softmax
saturates to one-hot and its Jacobian vanishes. Each eval row therefore carries

    attn_logit_max[l]    max |q_i . k_j| / sqrt(d_head) of layer l over one eval batch: every
                         sequence, head and causal pair j <= i (the raw scaled dot products the
                         softmax sees, before the mask sets the future pairs to -inf)
    softmax_max_prob[l]  mean over sequences, heads and queries i of max_j softmax(...)_ij
                         (1.0 = one-hot; query 0 sees only itself, so a floor of about 1/T)
    sigma_max[name], sigma_min[name]
                         extreme singular values of each Muon matrix (by parameter name) and of
                         the q and k row blocks of the fused QKV matrix (`name[q]`, `name[k]`)
    manifold_violation[name]
                         distance of each Muon matrix from its manifold (0 for plain Muon)
    col_norm_min[name], col_norm_max[name]
                         DGram matrices only: extreme column norms of the tall orientation, the
                         scales D of W = Q D that DGram leaves free (equal to its singular values)

The logits come from an AttentionProbe: forward hooks on the fused QKV projections that
recompute q k^T explicitly from the q and k the model made, while the model itself keeps
using scaled_dot_product_attention (which never materialises the logits). Under the
stabilizers they are the logits the softmax sees (q and k normalised, soft-capped), and eval
rows also carry

    attn_logit_max_raw[l], softcap_fraction[l]
                         under --attn-softcap C: max |logit| before the cap, and the fraction of
                         causal logits the cap shrinks by more than 10% (|logit| > 0.587 C)
    qk_clip_heads[l], qk_clip_events   under --qk-clip (training.qk_clip): heads of layer l
                         rescaled so far, and the steps with any rescaling
"""
import math
import time

import torch

from manifolds import manifold_violation
from manifolds.geometry import geometry, tall
from manifolds.param_groups import Matrix
from manifolds.sharded import local, stored_radius


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class AttentionProbe:
    """Attention-logit statistics of one forward pass, per layer.

    `qkv_projections` are the fused QKV linear layers in layer order (output (B, T, 3C), q
    then k then v, each split into `n_head` heads). Use as a context manager around one
    forward pass; `ms` is the time the probe itself took (device-synchronised).
    """

    # logits per chunk of sequences: at most this many floats at once (256 MB in fp32)
    CHUNK_ELEMENTS = 1 << 26

    def __init__(self, qkv_projections, n_head, attentions=None):
        """`attentions`: the CausalSelfAttention modules of those projections, when their logits
        are not plain q k^T / sqrt(d_head) (qk_norm, attn_softcap): the probe then computes them
        the modules' way (heads, raw_logits, cap) and also reports, under soft-capping, the raw
        maximum and the fraction of logits the cap acts on."""
        self.projections = list(qkv_projections)
        self.n_head = n_head
        self.attentions = list(attentions) if attentions is not None else [None] * len(self.projections)
        self.logit_max = [None] * len(self.projections)
        self.max_prob = [None] * len(self.projections)
        self.capped = [None] * len(self.projections)  # (raw logit max, capped fraction) under soft-capping
        self.handles = []
        self.ms = 0.0

    def __enter__(self):
        self.handles = [module.register_forward_hook(self._hook(layer))
                        for layer, module in enumerate(self.projections)]
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _hook(self, layer):
        def hook(module, inputs, qkv):
            _sync(qkv.device)
            t0 = time.perf_counter()
            self.logit_max[layer], self.max_prob[layer], self.capped[layer] = self.attention_stats(
                qkv.detach(), self.attentions[layer])
            _sync(qkv.device)
            self.ms += 1000 * (time.perf_counter() - t0)
        return hook

    @torch.no_grad()
    def attention_stats(self, qkv, attention=None):
        """(max |logit| over causal pairs, mean over queries of the largest probability, and under
        soft-capping (raw max |logit|, fraction of causal logits the cap shrinks by over 10%)), in fp32.

        The probe runs inside the eval's autocast, which would compute q k^T in bf16 whatever the
        inputs' dtype (on CUDA and on CPU): it is switched off here, so that the statistics that
        --assign auto compares with its thresholds carry fp32 rounding, not bf16's 2^-8."""
        with torch.autocast(qkv.device.type, enabled=False):
            return self._attention_stats(qkv, attention)

    # C tanh(u / C) < 0.9 u  <=>  u / C > 0.5873: where the soft cap shrinks a logit by over 10%
    CAP_KNEE = 0.5873

    def _attention_stats(self, qkv, attention):
        B, T, three_C = qkv.shape
        C, H = three_C // 3, self.n_head
        if attention is None:
            heads = qkv.float().view(B, T, 3, H, C // H).permute(2, 0, 3, 1, 4)  # (3, B, H, T, d_head)
            q, k = heads[0], heads[1]
            raw_logits, cap, softcap = (lambda q, k: q @ k.mT / (C // H) ** 0.5), (lambda x: x), 0.0
        else:
            q, k, _ = attention.heads(qkv.float())
            raw_logits, cap, softcap = attention.raw_logits, attention.cap, attention.softcap
        future = torch.ones(T, T, dtype=torch.bool, device=qkv.device).triu(1)
        logit_max = torch.zeros((), device=qkv.device)
        raw_max = torch.zeros((), device=qkv.device)
        knee = torch.zeros((), dtype=torch.float64, device=qkv.device)
        prob_sum = torch.zeros((), dtype=torch.float64, device=qkv.device)
        rows = max(1, self.CHUNK_ELEMENTS // (H * T * T))
        for lo in range(0, B, rows):
            raw = raw_logits(q[lo:lo + rows], k[lo:lo + rows])  # (b, H, T, T)
            logits = cap(raw)
            logit_max = torch.maximum(logit_max, logits.abs().masked_fill(future, 0).amax())
            if softcap:
                raw_max = torch.maximum(raw_max, raw.abs().masked_fill(future, 0).amax())
                knee += (raw.abs() > self.CAP_KNEE * softcap).masked_fill(future, False).sum(dtype=torch.float64)
            probs = logits.masked_fill(future, float("-inf")).softmax(dim=-1)
            prob_sum += probs.amax(dim=-1).sum(dtype=torch.float64)
        capped = (raw_max, knee / (B * H * T * (T + 1) / 2)) if softcap else None
        return logit_max, prob_sum / (B * H * T), capped

    def results(self):
        """{"attn_logit_max": [per layer], "softmax_max_prob": [per layer]} as floats."""
        if any(v is None for v in self.logit_max):
            raise RuntimeError("AttentionProbe saw no forward pass through every layer")
        out = {"attn_logit_max": [float(v) for v in self.logit_max],
               "softmax_max_prob": [float(v) for v in self.max_prob]}
        if all(c is not None for c in self.capped):
            out["attn_logit_max_raw"] = [float(raw) for raw, _ in self.capped]
            out["softcap_fraction"] = [float(fraction) for _, fraction in self.capped]
        return out


def singular_values(matrices):
    """Singular values (ascending) of a list of same-shape matrices, as a (n, min(m, k)) tensor.

    sigma(W) = sqrt(eig(W^T W)) on the tall orientation: a symmetric eigenproblem of the small
    side, in float64 so that small singular values keep their accuracy. Non-finite matrices give NaN.
    """
    W = torch.stack([m.detach() for m in matrices]).double()
    if W.size(-2) < W.size(-1):
        W = W.mT
    finite = torch.isfinite(W).all(dim=-1).all(dim=-1)
    W = torch.where(finite[:, None, None], W, torch.zeros_like(W))
    sigma = torch.linalg.eigvalsh(W.mT @ W).clamp_min(0).sqrt()
    return torch.where(finite[:, None], sigma, torch.full_like(sigma, float("nan")))


def stored_radii(optimizer, matrices):
    """{(parameter name, row_lo): r} of the pieces whose manifold stores a radius (the Hyperball's
    ||W||_F when it was put on the sphere, kept in ManifoldMuon's state): what their violation is
    measured against. Pieces without one yet (NaN, or no state) are left out (their violation: 0)."""
    out = {}
    for name, W, _, blocks, _ in (Matrix(*matrix) for matrix in matrices):
        for _, lo, _, manifold in blocks:
            if not geometry(manifold).stores_radius:
                continue
            radius = stored_radius(optimizer, W, lo)
            if radius is not None and math.isfinite(float(local(radius))):
                out[(name, lo)] = float(local(radius))
    return out


@torch.no_grad()
def matrix_stats(matrices, dgram_cap=1.0, radii=None):
    """Singular values, manifold violation and DGram column norms of every Muon matrix.

    `matrices` is the trainer's [Matrix(parameter name, W, module key, [(label, row_lo, row_hi,
    manifold)], transposed=False)]: one piece per matrix, or the q | k | v row blocks of a split fused QKV. Every
    matrix gets its singular values; a fused QKV matrix (key "attn.qkv") also those of its q and
    k blocks (labelled name[q], name[k]), a split one those of all three. Violation and column
    norms are per piece. `radii` ({(parameter name, row_lo): r}, stored_radii) gives a manifold
    that stores its size (the Hyperball) the radius its violation is measured against. Returns
    the eval-row fields named in the module docstring, each a {name: float} dict.
    """
    radii = radii or {}
    pieces = []  # (name, matrix) whose singular values are reported
    out = {"sigma_max": {}, "sigma_min": {}, "manifold_violation": {}, "col_norm_min": {}, "col_norm_max": {}}
    for name, W, key, blocks, transposed in (Matrix(*matrix) for matrix in matrices):
        W = W.detach()
        pieces.append((name, W))
        if key == "attn.qkv":
            rows = W.size(0) // 3
            labels = [label for label, _, _, _ in blocks] if len(blocks) == 3 else [f"{name}[q]", f"{name}[k]"]
            pieces += [(label, W[i * rows:(i + 1) * rows]) for i, label in enumerate(labels)]
        for label, lo, hi, manifold in blocks:
            block = W[lo:hi]
            out["manifold_violation"][label] = manifold_violation(block, manifold, dgram_cap, transposed,
                                                                  radius=radii.get((name, lo)))
            if geometry(manifold).column_norm_diagnostics:
                norms = tall(block, transposed).double().norm(dim=-2)
                out["col_norm_min"][label], out["col_norm_max"][label] = float(norms.min()), float(norms.max())
    by_shape, extremes = {}, {}
    for name, W in pieces:  # one batched eigenproblem per shape
        by_shape.setdefault(tuple(W.shape), []).append((name, W))
    for same_shape in by_shape.values():
        sigma = singular_values([W for _, W in same_shape]).cpu()
        extremes.update((name, (float(s[-1]), float(s[0]))) for (name, _), s in zip(same_shape, sigma))
    for name, _ in pieces:
        out["sigma_max"][name], out["sigma_min"][name] = extremes[name]
    return out
