"""Which manifold each kind of Muon matrix lives on: the `--assign` presets and spec parser.

Module keys name the Muon matrices of a GPT-2 block, and groups of them:
    attn.qkv  (fused Q, K, V projection, one matrix)   attn.proj  (attention output projection)
    attn.q, attn.k, attn.v  (row blocks of the fused QKV, each its own matrix)
    mlp.fc    (MLP expansion)                          mlp.proj   (MLP contraction)
    attn = attn.qkv + attn.proj     attn.qk = attn.q + attn.k     mlp = mlp.fc + mlp.proj
A spec is a preset name or `key=manifold[,key=manifold...]`; later entries override earlier
ones and keys not mentioned stay `none` (plain Muon).

The fused QKV matrix is one matrix on its manifold (Stiefel there means W_qkv^T W_qkv = I, the
published setting) unless the spec names attn.q, attn.k, attn.v or attn.qk: then it is three
n_embd-row blocks, each on its own manifold, and blocks not named keep the fused value.
"""
from errors import UserError
from manifolds.geometry import MANIFOLDS

MATRIX_KEYS = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")  # one parameter each per block
QKV_BLOCKS = ("attn.q", "attn.k", "attn.v")                      # rows 0:C, C:2C, 2C:3C of attn.qkv
GROUP_KEYS = {"attn": ("attn.qkv", "attn.proj"), "mlp": ("mlp.fc", "mlp.proj"),
              "attn.qk": ("attn.q", "attn.k")}

PRESETS = {
    "unconstrained": "attn=none,mlp=none",
    "all-stiefel": "attn=stiefel,mlp=stiefel",
    "all-dgram": "attn=dgram,mlp=dgram",
    "hetero": "attn=stiefel,mlp=dgram",
    "hetero-inv": "attn=dgram,mlp=stiefel",
    "hetero-qk": "attn.qk=stiefel,attn.v=dgram,attn.proj=dgram,mlp=dgram",
    "all-oblique": "attn=oblique,mlp=oblique",
    "hetero-hyperball": "attn=stiefel,mlp=hyperball",
    "all-hyperball": "attn=hyperball,mlp=hyperball",
}


def valid_choices():
    keys = list(GROUP_KEYS) + list(MATRIX_KEYS) + list(QKV_BLOCKS)
    return (f"presets {', '.join(PRESETS)}; or key=manifold[,...] with keys "
            f"{', '.join(keys)} and manifolds {', '.join(MANIFOLDS)}")


def parse_assignment(spec):
    """Map a preset or custom spec to {key: manifold name}.

    The keys are MATRIX_KEYS, with attn.qkv replaced by attn.q, attn.k, attn.v when the spec
    splits the fused QKV matrix (see the module docstring); order: as MATRIX_KEYS.
    """
    text = PRESETS.get(spec.strip(), spec)
    assignment = {key: "none" for key in MATRIX_KEYS + QKV_BLOCKS}
    split = False
    entries = [e.strip() for e in text.split(",") if e.strip()]
    if not entries:
        raise UserError(f"empty --assign; valid: {valid_choices()}")
    for entry in entries:
        key, sep, manifold = (part.strip() for part in entry.partition("="))
        if not sep:
            raise UserError(f"unknown --assign {spec!r}; valid: {valid_choices()}")
        if manifold not in MANIFOLDS:
            raise UserError(f"unknown manifold {manifold!r} in --assign {spec!r}; valid: {valid_choices()}")
        known = MATRIX_KEYS + QKV_BLOCKS
        targets = GROUP_KEYS.get(key, (key,) if key in known else None)
        if targets is None:
            raise UserError(f"unknown module {key!r} in --assign {spec!r}; valid: {valid_choices()}")
        for target in targets:
            if target == "attn.qkv":  # the fused value also sets the blocks it has not split off
                for block in QKV_BLOCKS:
                    assignment[block] = manifold
            split = split or target in QKV_BLOCKS
            assignment[target] = manifold
    order = [k for key in MATRIX_KEYS for k in ((QKV_BLOCKS if split else (key,)) if key == "attn.qkv" else (key,))]
    return {key: assignment[key] for key in order}


def qkv_blocks(assignment):
    """[(block key, manifold)] for q, k, v when the assignment splits the fused QKV, else None."""
    if "attn.qkv" in assignment:
        return None
    return [(key, assignment[key]) for key in QKV_BLOCKS]
