"""Which manifold each kind of Muon matrix lives on: the `--assign` presets and spec parser.

Module keys name the four Muon matrices of a GPT-2 block, and groups of them:
    attn.qkv  (fused Q, K, V projection)    attn.proj  (attention output projection)
    mlp.fc    (MLP expansion)               mlp.proj   (MLP contraction)
    attn = attn.qkv + attn.proj             mlp = mlp.fc + mlp.proj
A spec is a preset name or `key=manifold[,key=manifold...]`; later entries override earlier
ones and keys not mentioned stay `none` (plain Muon).
"""
from errors import UserError
from manifolds.geometry import MANIFOLDS

MATRIX_KEYS = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
GROUP_KEYS = {"attn": ("attn.qkv", "attn.proj"), "mlp": ("mlp.fc", "mlp.proj")}

PRESETS = {
    "unconstrained": "attn=none,mlp=none",
    "all-stiefel": "attn=stiefel,mlp=stiefel",
    "all-dgram": "attn=dgram,mlp=dgram",
    "hetero": "attn=stiefel,mlp=dgram",
    "hetero-inv": "attn=dgram,mlp=stiefel",
}


def valid_choices():
    return (f"presets {', '.join(PRESETS)}; or key=manifold[,...] with keys "
            f"{', '.join(list(GROUP_KEYS) + list(MATRIX_KEYS))} and manifolds {', '.join(MANIFOLDS)}")


def parse_assignment(spec):
    """Map a preset or custom spec to {matrix key: manifold name} over MATRIX_KEYS."""
    text = PRESETS.get(spec.strip(), spec)
    assignment = {key: "none" for key in MATRIX_KEYS}
    entries = [e.strip() for e in text.split(",") if e.strip()]
    if not entries:
        raise UserError(f"empty --assign; valid: {valid_choices()}")
    for entry in entries:
        key, sep, manifold = (part.strip() for part in entry.partition("="))
        if not sep:
            raise UserError(f"unknown --assign {spec!r}; valid: {valid_choices()}")
        if manifold not in MANIFOLDS:
            raise UserError(f"unknown manifold {manifold!r} in --assign {spec!r}; valid: {valid_choices()}")
        targets = GROUP_KEYS.get(key, (key,) if key in MATRIX_KEYS else None)
        if targets is None:
            raise UserError(f"unknown module {key!r} in --assign {spec!r}; valid: {valid_choices()}")
        for target in targets:
            assignment[target] = manifold
    return assignment
