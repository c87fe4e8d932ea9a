"""The model: GPT-2 without biases, with tied embedding and head (nanoGPT's layout: this file
holds the model, train_gpt2.py the training).

GPTConfig gives the sizes and the attention options; GPT(cfg)(idx, targets) returns the mean
cross-entropy of predicting targets from idx. Only the block matrices (c_attn, c_proj, c_fc)
go to ManifoldMuon; the assignment of manifolds to them is the trainer's (--assign).
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels.logit_max import causal_logit_max


@dataclass
class GPTConfig:
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    seq_len: int = 1024
    vocab_size: int = 50304
    qk_norm: bool = False       # RMS-normalise q and k per head (learned gain), Wortsman et al. 2023
    attn_softcap: float = 0.0   # logits -> C tanh(logits / C) when C > 0 (Gemma 2 uses 50)


class CausalSelfAttention(nn.Module):
    """Causal multi-head attention; the literature's logit stabilizers are options of it.

    logits = q k^T / sqrt(d_head), with q and k RMS-normalised per head under qk_norm, and
    soft-capped to C tanh(logits / C) under attn_softcap (which needs the explicit logits: the
    fused kernel takes no score function). `track_logits` (QK-Clip, training.qk_clip) makes
    the training forward keep the largest logit of each head since the last reset, on the
    device, without a host sync.
    """

    def __init__(self, cfg):
        super().__init__()
        self.n_head = cfg.n_head
        self.d_head = cfg.n_embd // cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)  # fused Q, K, V
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.q_norm = nn.RMSNorm(self.d_head) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(self.d_head) if cfg.qk_norm else None
        self.softcap = cfg.attn_softcap
        self.track_logits = False
        self.register_buffer("logit_max", torch.zeros(cfg.n_head), persistent=False)

    def heads(self, qkv):
        """q, k, v (B, H, T, d_head) of the fused projection's output, q and k normalised."""
        B, T, three_C = qkv.shape
        q, k, v = (t.view(B, T, self.n_head, self.d_head).transpose(1, 2) for t in qkv.split(three_C // 3, dim=2))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def raw_logits(self, q, k):
        return q @ k.mT / self.d_head ** 0.5

    def cap(self, logits):
        return self.softcap * torch.tanh(logits / self.softcap) if self.softcap else logits

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.heads(self.c_attn(x))
        if self.track_logits and self.training:
            self._track(q, k)
        if self.softcap:
            logits = self.cap(self.raw_logits(q, k))
            future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
            y = logits.masked_fill(future, float("-inf")).softmax(dim=-1).to(v.dtype) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))

    @torch.no_grad()
    def _track(self, q, k):
        """logit_max[h] <- max(logit_max[h], max over batch and causal pairs of the logit the
        softmax sees), in fp32: what QK-Clip compares with tau. causal_logit_max
        (kernels/logit_max.py; fused on a GPU: no T x T logits in memory) finds the raw maximum
        of q . k; the scale and the cap are increasing, so they apply to the maximum."""
        raw = causal_logit_max(q, k)
        self.logit_max.copy_(torch.maximum(self.logit_max, self.cap(raw / self.d_head ** 0.5)))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=False)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=False)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=False)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by depth
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets):
        T = idx.size(1)
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x)).float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
