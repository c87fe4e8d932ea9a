"""ManifoldMuon's parameter groups for a model, from an assignment: `manifold_param_groups`.

    groups, rest = manifold_param_groups(model, "hetero")   # projects the chosen weights
    muon = ManifoldMuon(groups, lr=0.02)
    adamw = torch.optim.AdamW(rest, lr=3e-4)

An assignment (`spec`) is one of
  * a preset or role spec of manifolds.assignment ("hetero", "attn=stiefel,mlp=dgram",
    "attn.qk=stiefel,attn.v=dgram", ...). Its roles are found by parameter name (ROLE_PATHS) on
    our GPT (train_gpt2.GPT), on transformers' GPT-2 and on Llama-style models (q_proj, k_proj,
    v_proj, o_proj, gate_proj, up_proj, down_proj; grouped-query k and v have fewer rows);
    on any other architecture it is an error: pass patterns.
  * a dict {glob pattern over parameter names (fnmatch, `*` crosses dots): manifold or None}:
    every parameter a pattern matches goes on that manifold, or to `rest` for None; a later
    pattern overrides an earlier one.
  * a list of role assignments in parse_assignment's form, one per layer (the trainer's
    --assign auto, where layers switch manifolds one at a time).

Roles: attn.qkv is a fused Q, K, V matrix (c_attn); attn.q, attn.k, attn.v are its row blocks
when the spec splits it (ManifoldMuon "blocks"), or Llama's q_proj, k_proj, v_proj, which are
separate matrices anyway; attn.proj the attention output (c_proj, o_proj); mlp.fc the MLP
expansion (c_fc; gate_proj and up_proj); mlp.proj the contraction (c_proj, down_proj). Every
role matrix goes to ManifoldMuon (a role the spec leaves out is `none`: plain Muon), everything
else (embeddings, norms, biases, the LM head) to `rest`.

Orientation: a manifold constrains the tall orientation of the map's (out, in) weight (the
Gram W^T W of its smaller side), so an nn.Linear weight (out, in) and a Conv1D weight (in, out)
of the same map are on the same manifold, square ones included: the groups of Conv1D weights
carry "transposed": True, which tells ManifoldMuon (and project_to_manifold, manifold_violation)
the side. The layout also decides along which axis a fused QKV's q | k | v lie (rows for
nn.Linear, columns for Conv1D).

One optimizer for the whole model: `adamw={"lr": 3e-4, ...}` hands the rest back as one more
group, {"params": rest, "name": "adamw", "algorithm": "adamw", **options}, which ManifoldMuon
steps with AdamW (rest is then empty):

    groups, _ = manifold_param_groups(model, "hetero", adamw={"lr": 3e-4, "weight_decay": 0.0})
    opt = ManifoldMuon(groups, lr=0.02)
"""
import fnmatch
import re
import sys
from typing import NamedTuple

import torch
from torch._subclasses.fake_tensor import is_fake

from errors import UserError
from manifolds.assignment import MATRIX_KEYS, QKV_BLOCKS, parse_assignment, qkv_blocks
from manifolds.geometry import MANIFOLDS, geometry, project_to_manifold, tall
from manifolds.optimizer import on_manifold_tol
from manifolds.sharded import is_sharded, project_sharded


class Matrix(NamedTuple):
    """One matrix ManifoldMuon steps: `blocks` [(label, row_lo, row_hi, manifold)] tile its rows
    (one block, or the q | k | v blocks of a split fused QKV; a group's "blocks" without labels). `key` is its role, or the pattern
    that chose it; `transposed`: stored (in, out), as transformers' Conv1D (module docstring)."""
    name: str
    param: torch.Tensor
    key: str
    blocks: list
    transposed: bool = False


# role of a matrix by the end of its parameter name, "<...>.<layer>.<path>"
ROLE_PATHS = {
    "attn.c_attn.weight": "attn.qkv",        # our GPT, transformers' GPT-2
    "attn.c_proj.weight": "attn.proj",
    "mlp.c_fc.weight": "mlp.fc",
    "mlp.c_proj.weight": "mlp.proj",
    "self_attn.q_proj.weight": "attn.q",     # Llama-style
    "self_attn.k_proj.weight": "attn.k",
    "self_attn.v_proj.weight": "attn.v",
    "self_attn.o_proj.weight": "attn.proj",
    "mlp.gate_proj.weight": "mlp.fc",
    "mlp.up_proj.weight": "mlp.fc",
    "mlp.down_proj.weight": "mlp.proj",
}
ROLE_NAME = re.compile(r"(?:^|\.)(\d+)\.(" + "|".join(map(re.escape, ROLE_PATHS)) + r")$")
# assigned_matrices lists roles in this order (the trainer's group and bank order follows it)
ROLE_ORDER = ("attn.qkv",) + QKV_BLOCKS + MATRIX_KEYS[1:]
PATTERN_EXAMPLE = "{'*.attn.c_attn.weight': 'stiefel', '*.mlp.*.weight': 'dgram'}"


def manifold_param_groups(model, spec, dgram_cap=1.0, adamw=None):
    """(groups, rest): ManifoldMuon's groups for the matrices `spec` assigns (module docstring),
    each {"params", "name", and "manifold" or "blocks"; "transposed" for Conv1D weights}, and the
    model's other parameters, in model.parameters() order, for another optimizer (AdamW). With
    `adamw` (a dict of AdamW options: lr, betas, eps, weight_decay; True: torch.optim.AdamW's
    defaults), the rest is instead one more group that ManifoldMuon steps with AdamW, and `rest`
    is empty.

    Projects each chosen matrix that is off its manifold onto it IN PLACE (exact retraction, under
    no_grad; one already on it is left bit for bit; a frozen one only once it trains, at its
    first ManifoldMuon step), so that training starts on
    the manifolds: call it after the model is initialised (or its
    weights loaded) and before building the optimizers. `dgram_cap` is the column-norm cap of
    "dgram-cap"; its groups carry it. Under torch.distributed, call it on every rank with the
    same weights: ManifoldMuon then solves each rank's share of the matrices and exchanges them.
    """
    matrices = assigned_matrices(model, spec)
    project_matrices(matrices, dgram_cap)
    groups = muon_groups(matrices, dgram_cap)
    chosen = {id(p) for group in groups for p in group["params"]}
    rest = [p for p in model.parameters() if id(p) not in chosen]
    if adamw is None or adamw is False:
        return groups, rest
    if adamw is True:
        adamw = {}  # torch.optim.AdamW's defaults
    if not isinstance(adamw, dict) or "params" in adamw:
        raise UserError(f"adamw takes the AdamW options of the rest's group (a dict such as {{'lr': 3e-4}}, or True "
                        f"for torch's defaults); got {adamw!r}")
    return groups + [{"params": rest, "name": "adamw", **adamw, "algorithm": "adamw"}], []


def assigned_matrices(model, spec):
    """[Matrix] for `spec` (module docstring): role matrices in ROLE_ORDER then model order, or the
    pattern-matched matrices in model order."""
    conv1d = stored_transposed(model)
    return [matrix._replace(transposed=matrix.name in conv1d) for matrix in matrices_by_name(model, spec)]


def stored_transposed(model):
    """Names of the model's weights stored (in, out): those of transformers' Conv1D modules."""
    pytorch_utils = sys.modules.get("transformers.pytorch_utils")  # loaded by any transformers model
    if pytorch_utils is None:
        return set()
    return {f"{name}.weight" if name else "weight" for name, module in model.named_modules()
            if isinstance(module, pytorch_utils.Conv1D)}


def matrices_by_name(model, spec):
    if isinstance(spec, dict):
        return pattern_matrices(model, spec)
    if isinstance(spec, str):
        assignment = parse_assignment(spec)
        return role_matrices(model, lambda layer: assignment, spec)
    if not isinstance(spec, (list, tuple)):
        raise UserError(f"an assignment is a preset or role spec (str), a dict of patterns or a list of "
                        f"per-layer assignments; got {type(spec).__name__}")
    layers = list(spec)

    def of_layer(layer):
        if layer >= len(layers):
            raise UserError(f"{len(layers)} per-layer assignments for a model with a layer {layer}")
        return layers[layer]
    return role_matrices(model, of_layer, "per-layer assignments")


def find_roles(model):
    """[(name, parameter, role, layer)] of the model's role matrices, in model order."""
    found = []
    for name, p in model.named_parameters():
        match = ROLE_NAME.search(name)
        if match:
            found.append((name, p, ROLE_PATHS[match.group(2)], int(match.group(1))))
    return found


def role_matrices(model, assignment_of_layer, spec):
    roles = find_roles(model)
    if not roles:
        raise UserError(f"role spec {spec!r}: {type(model).__name__} has none of the attention and MLP "
                        f"matrices it names (our GPT, transformers' GPT-2 and Llama-style names are known); "
                        f"pass a dict of glob patterns over parameter names to manifolds instead, "
                        f"e.g. {PATTERN_EXAMPLE}")
    matrices, served, wanted = [], set(), set()
    for name, p, role, layer in sorted(roles, key=lambda r: ROLE_ORDER.index(r[2])):
        assignment = assignment_of_layer(layer)
        wanted.update(key for key, manifold in assignment.items() if geometry(manifold).constrained)
        split = qkv_blocks(assignment)
        if role == "attn.qkv" and split is not None:
            blocks = fused_qkv_blocks(name, p, split, spec)
            served.update(QKV_BLOCKS)
        elif role == "attn.qkv" or role in QKV_BLOCKS:
            # a separate q, k or v matrix takes its block's manifold, or the fused value when not split
            key = role if split is not None else "attn.qkv"
            blocks = [(name, 0, p.size(0), assignment[key])]
            served.add(key)
        else:
            blocks = [(name, 0, p.size(0), assignment[role])]
            served.add(role)
        matrices.append(Matrix(name, p, role, blocks))
    missing = sorted(wanted - served, key=ROLE_ORDER.index)
    if missing:
        raise UserError(f"role spec {spec!r} assigns {', '.join(missing)}, which {type(model).__name__} does not "
                        f"have under a known name; pass a dict of glob patterns over parameter names to manifolds "
                        f"instead, e.g. {PATTERN_EXAMPLE}")
    return matrices


def fused_qkv_blocks(name, p, blocks, spec):
    """Pieces of a fused QKV matrix split into q, k, v: its three row blocks, labelled name[q] ...
    ManifoldMuon's blocks are rows, so a Conv1D layout (q | k | v along the columns) cannot split."""
    rows, cols = p.shape
    if rows != 3 * cols:
        raise UserError(f"role spec {spec!r} splits the fused QKV matrix {name} of shape {tuple(p.shape)} into "
                        f"q, k, v, but its q | k | v are not row blocks (a Conv1D (in, out) weight, as in "
                        f"transformers' GPT-2): assign attn or attn.qkv as a whole")
    return [(f"{name}[{block[-1]}]", i * cols, (i + 1) * cols, manifold)
            for i, (block, manifold) in enumerate(blocks)]


def pattern_matrices(model, patterns):
    for pattern, manifold in patterns.items():
        if manifold is not None and manifold not in MANIFOLDS:
            raise UserError(f"unknown manifold {manifold!r} for pattern {pattern!r}; valid: {', '.join(MANIFOLDS)}")
    matrices, matched = [], set()
    for name, p in model.named_parameters():
        hits = [(pattern, manifold) for pattern, manifold in patterns.items() if fnmatch.fnmatchcase(name, pattern)]
        matched.update(pattern for pattern, _ in hits)
        if not hits:
            continue
        pattern, manifold = hits[-1]
        if manifold is None:
            continue
        if p.dim() != 2:
            raise UserError(f"pattern {pattern!r} matches {name} of shape {tuple(p.shape)}: ManifoldMuon takes "
                            f"2-D matrices (narrow the pattern, e.g. to end in .weight)")
        matrices.append(Matrix(name, p, pattern, [(name, 0, p.size(0), manifold)]))
    unmatched = [pattern for pattern in patterns if pattern not in matched]
    if unmatched:
        raise UserError(f"pattern {unmatched[0]!r} matches no parameter of {type(model).__name__} "
                        f"(names look like {next(iter(dict(model.named_parameters())), '?')!r})")
    return matrices


def muon_groups(matrices, dgram_cap=1.0):
    """ManifoldMuon groups: one per key and layout of manifolds (same-layout matrices of all layers
    together), named after its layout: "attn.qkv=stiefel", "attn.qkv=q:stiefel|k:stiefel|v:dgram",
    "<pattern>=dgram". Bank names in logs and statistics derive from these names."""
    groups = {}
    for _, p, key, blocks, transposed in matrices:
        if len(blocks) == 1:
            layout, extra = f"{key}={blocks[0][3]}", {"manifold": blocks[0][3]}
        else:
            layout = f"{key}=" + "|".join(f"{label[-2]}:{m}" for label, _, _, m in blocks)
            extra = {"blocks": [(lo, hi, m) for _, lo, hi, m in blocks]}
        if any("dgram_cap" in geometry(m).options for *_, m in blocks):
            extra["dgram_cap"] = dgram_cap
        if transposed:
            extra["transposed"] = True
        groups.setdefault((layout, transposed), {"params": [], "name": layout, **extra})["params"].append(p)
    return list(groups.values())


@torch.no_grad()
def project_matrices(matrices, dgram_cap=1.0, only=None):
    """Project these matrices (all, or those named in `only`) onto their manifolds in place
    (exact retraction, computed in fp32 and stored in the parameter's dtype). A matrix already on
    its manifold (violation <= on_manifold_tol, as ManifoldMuon's constructor decides) is left
    bit for bit: a resume that restores the weights and then builds the groups again (PyTorch
    Lightning's configure_optimizers) keeps them. Frozen matrices (requires_grad False) are
    left as they are: ManifoldMuon projects them at their first step."""
    for name, p, _, blocks, transposed in matrices:
        if (only is not None and name not in only) or not p.requires_grad:
            continue
        manifolds = {lo: manifold for _, lo, _, manifold in blocks}

        def projected(lo, hi, block, dtype=p.dtype):
            """The block projected, or None where it is on its manifold already (left bitwise)."""
            geo = geometry(manifolds[lo], dgram_cap)
            if not geo.constrained:
                return None
            # a tensor without values (meta device, FakeTensorMode: bench.cost_model's count) has no
            # violation to read: projected as before, so that its cost is counted
            has_values = not (block.is_meta or is_fake(block))
            if has_values and bool(geo.violation(tall(block.float(), transposed)) <= on_manifold_tol(dtype)):  # NaN: projected
                return None
            return project_to_manifold(block.float(), manifolds[lo], dgram_cap, transposed)

        if is_sharded(p):  # FSDP2: each matrix gathered once, projected whole, this rank's part kept
            project_sharded(p, [(lo, hi, m) for _, lo, hi, m in blocks], projected)
            continue
        for _, lo, hi, _ in blocks:
            new = projected(lo, hi, p[lo:hi])
            if new is not None:
                p[lo:hi] = new

