"""The geometry of each manifold a weight matrix can be assigned to.

Everything here works on the tall orientation: W is (..., p, q) with p >= q, so constraints
act on the q x q Gram matrix W^T W. A manifold is described by its Gram projector P, a symmetric
0/1 mask on the Gram (P(S) = mask * S), and by the squared column norms d^2 that scale its
tangent geometry:

    Stiefel    P = identity (all ones)     {W : W^T W = I}                    d = 1
    DGram      P = Off (ones off the diag) {W : Off(W^T W) = 0} = {Q D}       d = column norms of W
    Oblique    P = Diag (the identity)     {W : diag(W^T W) = 1}              d = column norms of W
    DGram-cap  DGram with column norms d_i <= C (a manifold with boundary; see DGramCap)
    Hyperball  P(S) = (tr S / q) I           {W : ||W||_F = r}                  d^2 = ||W||_F^2 / q
    none       P = 0: no constraint (plain Muon)

P need not be a mask: any linear projector on symmetric q x q matrices works (the Hyperball's
keeps only the trace) provided d^2 makes the identity below hold; masks are what the fused
kernels serve, any other P runs through torch after Stiefel's kernel (gram_projector).

The tangent space at W is {A : P(W^T A + A^T W) = 0}. For symmetric M in range(P) the identity

    P(W^T (W M) + (W M)^T W)_ij = (d_i^2 + d_j^2) M_ij

holds whenever the Gram entries it reads are diagonal: on Stiefel and DGram (W^T W = D^2), and
on Oblique for any W (M is diagonal, and only (W^T W)_ii = d_i^2 enters); on the Hyperball M = m I
and P(2 m W^T W) = 2 m (||W||_F^2 / q) I, so d_i^2 = ||W||_F^2 / q for every i. That one identity gives
the exact tangent projection A - W M with M = P(W^T A + A^T W) / (d_i^2 + d_j^2), and the exact
multiplier Lambda0 = -P(W^T G + G^T W) / (2 (d_i^2 + d_j^2)) of the Euclidean projection of G.

The fused kernels (kernels/tangent.py) apply Stiefel's, DGram's and none's P themselves
(`kernel_name`); any other mask runs Stiefel's kernel and one masked select after it.

Every fact about a manifold is its class's (the attributes of `Manifold`: its mask, norms,
retraction and violation, and what the solver, QK-Clip and the diagnostics may do with it); no
other module tests a manifold's name. `MANIFOLDS` is the registry of names: adding a manifold is
a subclass and `register_manifold(MyManifold())`, after which its name works wherever a manifold
is named (specs, groups, the trainer's --assign, the reference solver).
"""
import torch

import kernels
from kernels.constants import scalar
from kernels.products_torch import pair_scale
from kernels.tangent import correction_product


def stored_wide(rows, cols, transposed=False):
    """Whether a stored (rows, cols) weight is transposed to reach its tall orientation, the side
    whose Gram a manifold constrains. The side belongs to the map, not to its storage: a map's
    weight is (out, in) as nn.Linear stores it, and `transposed` says the parameter stores (in, out)
    (transformers' Conv1D). The map's weight is tall when out >= in, so a square map is constrained
    on W^T W of its (out, in) weight W: nn.Linear's as stored, Conv1D's stored W^T transposed back."""
    return rows <= cols if transposed else rows < cols


def tall(W, transposed=False):
    """W (..., rows, cols) on its tall orientation (stored_wide), a view."""
    return W.mT if stored_wide(W.size(-2), W.size(-1), transposed) else W


def polar_svd(X):
    """Exact polar factor U V^T by SVD: used once per matrix at initialisation, where the
    input can be far from orthonormal (square random matrices have tiny singular values that
    iterative msign leaves far from 1)."""
    U, _, Vh = torch.linalg.svd(X.double() if X.device.type == "cpu" else X.float(),
                                full_matrices=False)
    return (U @ Vh).to(X.dtype)


def column_norms(X):
    return X.norm(dim=-2, keepdim=True).clamp_min(torch.finfo(X.dtype).tiny ** 0.5)


def diagonal_mask(keep):
    """The Gram mask that keeps every off-diagonal entry and the diagonal entries of `keep`
    (..., q): all True is Stiefel's, all False DGram's."""
    return torch.diag_embed(~keep).logical_not()


class Manifold:
    """Interface shared by every manifold. A new one defines `name`, `gram_mask`, `retract` and
    `violation` (and `squared_norms` when its column norms are fixed, as Stiefel's), and states its
    facts below where they differ from these defaults.

    The tangent operations run through `kernels` (fused Triton kernels on CUDA, torch elsewhere,
    as `backend` says); d2 are the squared column norms d_i^2 (..., q), which a solver computes
    once per bank and passes along.
    """

    name = "abstract"
    kernel_name = None     # P as the fused kernels apply it ("stiefel", "dgram", "none"), or None: a mask
    orthogonal_columns = False  # W^T W diagonal on the manifold: the span reduction (span.py) applies
    constrained = True     # False: no constraint, plain Muon (msign step, weight decay, no retraction)
    exact_square_step = False  # square matrices: the steepest direction in closed form (solver.exact_square_stiefel)
    has_boundary = False   # a set with a boundary: the tangent cone by an active set (solver.solve_capped)
    # QK-Clip (training/qk_clip.py): which rescaling of a q or k matrix stays on the manifold:
    # "rows" (any: per-head rows), "matrix" (only c W, one factor for the whole matrix) or None
    qk_clip_scaling = None
    column_norm_diagnostics = False  # the trainer's diagnostics report its column norms (they move)
    # the online scheme (solver.online_iterations): dual steps per training step, and whether its
    # multiplier is one number per matrix (then the steps after the first are secant steps)
    online_steps = 1
    secant_dual = False
    online_dual_option = "dual_step"  # the SolverOptions field holding its dual step (0: no dual, C stays 0)
    polar_retraction = True  # its retraction takes a polar factor (rank balancing prices it: manifolds/step_cost.py)
    # its set has a size of its own, fixed when a matrix is put on it (the Hyperball's radius): the
    # optimizer keeps it in its state and passes it to retract_from and violation as `radius`
    stores_radius = False
    options = ()           # the group options it reads (`configured`), which its groups carry

    def configured(self, dgram_cap=1.0):
        """This manifold with a group's options (dgram-cap: its cap); most take none."""
        return self

    def gram_mask(self, q, device):
        """P's mask, a (..., q, q) bool tensor that broadcasts over the batch."""
        raise NotImplementedError

    def gram_projector(self, S):
        """P(S) for symmetric S (..., q, q)."""
        return torch.where(self.gram_mask(S.size(-1), S.device), S, scalar(0.0, S))

    def squared_norms(self, W):
        """d_i^2 as a (..., q) tensor: the column norms of W, which on Stiefel are 1."""
        return W.square().sum(dim=-2)

    def pair_scale(self, W):
        """(d_i^2 + d_j^2) as a (..., q, q) tensor: the Gram-space metric at W."""
        return pair_scale(self.squared_norms(W))

    def tangent_residual(self, W, A, backend="auto", with_norm=False):
        """H = P(W^T A + A^T W): zero exactly when A is tangent at W (with_norm: and ||H||_F^2)."""
        if self.kernel_name is not None:
            return kernels.tangent_residual(W, A, self.kernel_name, backend, with_norm)
        H = self.gram_projector(kernels.tangent_residual(W, A, "stiefel", backend))
        return (H, H.square().sum(dim=(-2, -1))) if with_norm else H

    def preconditioned(self, W, A, d2, alpha=1.0, backend="auto"):
        """alpha P(W^T A + A^T W) / (d_i^2 + d_j^2)."""
        if self.kernel_name is not None:
            return kernels.preconditioned(W, A, self.kernel_name, d2, alpha, backend)
        return self.gram_projector(kernels.preconditioned(W, A, "stiefel", d2, alpha, backend))

    def tangent_projection(self, W, A, d2=None, backend="auto", tf32_correction=False):
        """Euclidean projection of A onto the tangent space at W (W on the manifold):
        A - W M with M = P(W^T A + A^T W) / (d_i^2 + d_j^2), which makes P(W^T A_T + A_T^T W) = 0.
        tf32_correction: W M at TF32, for an A that is tangent up to rounding (kernels/tangent.py)."""
        d2 = self.squared_norms(W) if d2 is None else d2
        if self.kernel_name is not None:
            return kernels.tangent_projection(W, A, self.kernel_name, d2, backend, tf32_correction)
        M = self.preconditioned(W, A, d2, 1.0, backend)
        return correction_product(W, M, A, -1.0, kernels.products_for(backend, W, A), tf32_correction)

    def retract(self, X, near=True, backend="auto", tf32_correction=False):
        """Map X back onto the manifold; near=True assumes X is already close to it
        (tf32_correction: the Newton-Schulz corrections at TF32, kernels.orthonormalize_near)."""
        raise NotImplementedError

    def retract_from(self, W, X, near=True, backend="auto", tf32_correction=False):
        """R(X) for X = W - eta A, a step from the point W: the optimizer's retraction. Most
        manifolds read only X (the default); one whose set depends on W's own scale (the
        Hyperball's radius) reads W too."""
        return self.retract(X, near, backend, tf32_correction)

    def violation(self, W):
        """Per-matrix distance from the manifold (a tensor of W's leading shape)."""
        raise NotImplementedError


class Stiefel(Manifold):
    name = kernel_name = "stiefel"
    orthogonal_columns = True
    exact_square_step = True  # square: A* = W msign(skew(W^T G)) in closed form
    # online scheme: its own dual step (stiefel_dual_step); without one (0) the sign of Proj_T(G),
    # projected, is closer to the optimum on recorded GPT-2 momenta, yet trains no better
    # (docs/solver-tuning.md, "Stiefel without a dual step")
    online_dual_option = "stiefel_dual_step"

    def gram_mask(self, q, device):
        return torch.ones(q, q, dtype=torch.bool, device=device)

    def gram_projector(self, S):
        return S  # P is the identity: no mask to build and apply

    def squared_norms(self, W):
        return torch.ones(W.shape[:-2] + W.shape[-1:], dtype=W.dtype, device=W.device)

    def retract(self, X, near=True, backend="auto", tf32_correction=False):
        # R(X) = msign(X): the closest matrix with orthonormal columns
        if not near:
            return polar_svd(X)
        return kernels.orthonormalize_near(X, backend=backend, tf32_correction=tf32_correction)

    def violation(self, W):
        # max |W^T W - I|
        eye = torch.eye(W.size(-1), dtype=W.dtype, device=W.device)
        return (W.mT @ W - eye).abs().amax(dim=(-2, -1))


class DGram(Manifold):
    name = kernel_name = "dgram"
    orthogonal_columns = True
    qk_clip_scaling = "matrix"  # c W keeps W^T W diagonal; a row scaling does not
    column_norm_diagnostics = True

    def gram_mask(self, q, device):
        return ~torch.eye(q, dtype=torch.bool, device=device)

    def retract(self, X, near=True, backend="auto", tf32_correction=False):
        # R(X) = msign(X N^-1) N, N = diag(column norms of X). On the manifold X = Q D, so
        # X N^-1 = Q and R(X) = X: a true retraction that keeps each column's norm.
        norms = column_norms(X)
        unit = X / norms
        Q = (kernels.orthonormalize_near(unit, backend=backend, tf32_correction=tf32_correction) if near
             else polar_svd(unit))
        return Q * self.column_scale(norms)

    def column_scale(self, norms):
        """The column norms the retraction gives back (DGram: those of X)."""
        return norms

    def violation(self, W):
        # max |Off(W^T W)| / max diag(W^T W)
        gram = W.mT @ W
        diag = torch.diagonal(gram, dim1=-2, dim2=-1)
        off = gram - torch.diag_embed(diag)
        return off.abs().amax(dim=(-2, -1)) / diag.amax(dim=-1).clamp_min(1e-30)


class Oblique(Manifold):
    """Unit column norms, the columns free to turn: {W : diag(W^T W) = 1}.

    Its Gram is not diagonal, so the span reduction does not apply (orthogonal_columns False):
    ADMM runs on the full matrices. The retraction R(X) = X N^-1 is exact: R(W) = W on the set.
    """
    name = "oblique"
    column_norm_diagnostics = True
    polar_retraction = False  # X N^-1

    def gram_mask(self, q, device):
        return torch.eye(q, dtype=torch.bool, device=device)

    def retract(self, X, near=True, backend="auto", tf32_correction=False):
        return X / column_norms(X)

    def violation(self, W):
        # max |diag(W^T W) - 1|
        return (W.square().sum(dim=-2) - 1).abs().amax(dim=-1)


class Hyperball(Manifold):
    """Fixed Frobenius norm: {W : ||W||_F = r}, r per matrix (Wen et al. 2025, MuonH).

    The tangent condition tr(W^T A) = 0 is P(W^T A + A^T W) = 0 for the projector
    P(S) = (tr S / q) I, which is not a mask: gram_projector says it, and d_i^2 = ||W||_F^2 / q
    (every i) makes the tangent projection A - (tr(W^T A) / ||W||_F^2) W exact. The steepest
    direction solves the one-dimensional dual min_lambda ||G - lambda W||_* (A* = msign(G -
    lambda* W)): no closed form, the solver's scheme runs it on the full matrices.

    r is the norm the matrix has when it is put on the manifold: the projection at the start is
    the identity (the sphere through the initialiser's W keeps its scale). ManifoldMuon stores r
    in its state ("radius" / "radius@<row>" per piece, float64, saved and loaded with it, DCP
    too: manifolds/sharded.py) and every step retracts to it, R(W - eta A) = (W - eta A) r /
    ||W - eta A||_F with the norm in float64: the norm's rounding per step (each entry rounded
    to the weight's dtype) does not accumulate into a drift, as it would if each step kept the
    current norm (bf16 weights: 2.6e-3 relative in 3,000 steps). `violation(W, radius)` is
    | ||W||_F - r | / r; without a radius W lies on its own sphere and it is 0. A radius of one's
    own (r = c sqrt(fan_out / fan_in), say) is a subclass whose `retract` scales to it,
    registered under another name (docs/api.md).
    """
    name = "hyperball"
    # one multiplier per matrix: 3 secant steps per training step reach 0.9999 of the certified
    # optimum on the tests' shapes where one rms step stays at 0.984 (tests/test_hyperball.py)
    online_steps = 3
    secant_dual = True
    polar_retraction = False

    @property
    def stores_radius(self):
        # a subclass with a radius of its own (docs/api.md's fixed radius) retracts to that one:
        # its retract_from takes no stored radius
        return type(self).retract_from is Hyperball.retract_from

    def gram_mask(self, q, device):
        raise TypeError("the Hyperball's Gram projector keeps the trace: it is not a mask (use gram_projector)")

    def gram_projector(self, S):
        q = S.size(-1)
        trace = torch.diagonal(S, dim1=-2, dim2=-1).sum(dim=-1)
        return torch.diag_embed((trace / q)[..., None].expand(S.shape[:-1]))

    def squared_norms(self, W):
        return (W.square().sum(dim=(-2, -1)) / W.size(-1))[..., None].expand(W.shape[:-2] + W.shape[-1:])

    def retract(self, X, near=True, backend="auto", tf32_correction=False):
        return X  # the sphere through X: a start keeps its norm

    def retract_from(self, W, X, near=True, backend="auto", tf32_correction=False, radius=None):
        # X r / ||X||, r the stored radius (W's leading shape; None: ||W||, the sphere through W),
        # the scale in float64, so the radius carries no per-step norm error
        r = frobenius64(W) if radius is None else torch.as_tensor(radius, dtype=torch.float64, device=X.device)
        scale = r / frobenius64(X).clamp_min(1e-300)
        return (X.double() * scale[..., None, None]).to(X.dtype)

    def violation(self, W, radius=None):
        # | ||W||_F - r | / r against the stored radius r (W's leading shape); none: 0 (its own sphere)
        if radius is None:
            return torch.zeros(W.shape[:-2], dtype=W.dtype, device=W.device)
        r = torch.as_tensor(radius, dtype=torch.float64, device=W.device)
        return ((frobenius64(W) - r).abs() / r).to(W.dtype)


def frobenius64(X):
    """||X||_F per matrix (..., m, n) -> (...), summed in float64."""
    return X.double().square().sum(dim=(-2, -1)).sqrt()


class Unconstrained(Manifold):
    name = kernel_name = "none"
    constrained = False
    qk_clip_scaling = "rows"

    def gram_mask(self, q, device):
        return torch.zeros(q, q, dtype=torch.bool, device=device)

    def retract(self, X, near=True, backend="auto", tf32_correction=False):
        return X

    def violation(self, W):
        return torch.zeros(W.shape[:-2], dtype=W.dtype, device=W.device)


class DGramCap(DGram):
    """DGram with every column norm capped: {Q D : Q^T Q = I, 0 < d_i <= C}.

    Singular values are the column norms, so ||W||_op <= C: in attention the logit gain of
    W_Q W_K^T is bounded by C^2, which is what DGram attention lacks (docs/experiments.md).

    Retraction: R(X) = msign(X N^-1) min(N, C): DGram's retraction with the norms clipped.
    Below the cap it equals DGram's (R(W) = W on the set), so W stays a fixed point.

    The set has a boundary, so at W its tangent *cone* is {A : Off(W^T A + A^T W) = 0, and
    (W^T A)_ii >= 0 for each column at the cap} (the step is W - eta A, and the norm of
    column i changes at first order by -2 eta (W^T A)_ii). The solver handles the cone by an
    active set: columns at the cap whose DGram direction would grow them are pinned,
    (W^T A)_ii = 0, which makes P keep those diagonal entries: the same Gram-space identity
    then projects exactly. `pinned` is that set, one bool per column (..., q); `pin` returns the
    geometry with it (its mask no longer DGram's: kernel_name None).
    """
    name = "dgram-cap"
    has_boundary = True
    options = ("dgram_cap",)

    def __init__(self, cap=1.0, pinned=None):
        if not cap > 0:
            raise ValueError(f"the DGram cap must be positive; got {cap}")
        self.cap = float(cap)
        self.pinned = pinned
        self.kernel_name = "dgram" if pinned is None else None

    def configured(self, dgram_cap=1.0):
        return DGramCap(dgram_cap)

    def pin(self, pinned):
        return DGramCap(self.cap, pinned)

    def at_cap(self, W, rtol=1e-4):
        """Columns whose norm is at the cap (retraction leaves them at C up to rounding)."""
        return self.squared_norms(W).sqrt() >= self.cap * (1 - rtol)

    def gram_mask(self, q, device):
        return super().gram_mask(q, device) if self.pinned is None else diagonal_mask(self.pinned)

    def column_scale(self, norms):
        return norms.clamp_max(self.cap)  # R(X) = msign(X N^-1) min(N, C)

    def violation(self, W):
        # DGram's violation, or the relative excess of a column norm over the cap if larger
        excess = (self.squared_norms(W).sqrt().amax(dim=-1) / self.cap - 1).clamp_min(0)
        return torch.maximum(super().violation(W), excess)


class MaskedGram(Manifold):
    """The Gram geometry of a batch whose matrices differ only in P's mask (..., q, q): Stiefel
    and DGram problems stacked into one batch (span coordinates make them all 2q x q,
    span.StackedSpans), or dgram-cap with pinned columns. The squared column norms d2 come with
    each problem (Stiefel: 1)."""
    name = "masked"
    orthogonal_columns = True

    def __init__(self, mask):
        self.mask = mask

    def gram_mask(self, q, device):
        return self.mask


MANIFOLDS = {}  # the registry: name -> Manifold


def register_manifold(manifold, replace=False):
    """Make a manifold known by its name (specs, groups, the trainer, the reference solver).
    Returns it. A name already taken is an error unless `replace`."""
    if not isinstance(manifold, Manifold):
        raise TypeError(f"register_manifold takes a Manifold instance; got {type(manifold).__name__}")
    name = manifold.name
    if not isinstance(name, str) or not name or any(c in name for c in ",=:|[] ") or name == Manifold.name:
        raise ValueError(f"a manifold needs a name of its own without , = : | [ ] or spaces; got {name!r}")
    if name in MANIFOLDS and not replace and MANIFOLDS[name] is not manifold:
        raise ValueError(f"a manifold named {name!r} is registered already")
    MANIFOLDS[name] = manifold
    return manifold


for _manifold in (Stiefel(), DGram(), Oblique(), DGramCap(), Hyperball(), Unconstrained()):
    register_manifold(_manifold)


def geometry(name, dgram_cap=1.0):
    """The registered manifold of a name, with a group's options (dgram-cap: its cap `dgram_cap`)."""
    if name not in MANIFOLDS:
        raise ValueError(f"unknown manifold {name!r}; valid: {', '.join(MANIFOLDS)}")
    return MANIFOLDS[name].configured(dgram_cap)


def project_to_manifold(W, manifold, dgram_cap=1.0, transposed=False):
    """The retraction R applied to an arbitrary W (e.g. an initialisation), same shape as W.
    `transposed`: W stores its map's weight as (in, out), as transformers' Conv1D does; the
    manifold then constrains the map's (out, in) weight (geometry.stored_wide).

    Stiefel: msign(W); DGram: msign(W N^-1) N with N the column norms (tall orientation).
    DGram-cap: the DGram projection with the column norms clipped at `dgram_cap`.
    Computed with an exact SVD polar factor, so it is accurate however far W is from the manifold.
    """
    geo = geometry(manifold, dgram_cap)
    out = geo.retract(tall(W, transposed), near=False)
    return out.mT if stored_wide(W.size(-2), W.size(-1), transposed) else out


def manifold_violation(W, manifold, dgram_cap=1.0, transposed=False, radius=None):
    """Distance from the manifold on the tall orientation, as a float (max over a batch);
    `transposed` as for project_to_manifold; `radius`: the size of a manifold that stores one
    (the Hyperball's r, kept in ManifoldMuon's state: sharded.stored_radius).

    Stiefel: max|W^T W - I|;  DGram: max|Off(W^T W)| / max diag(W^T W);  DGram-cap: the larger
    of DGram's and the relative excess of the largest column norm over the cap;  Hyperball:
    | ||W||_F - r | / r (0 without r);  none: 0.
    """
    geo = geometry(manifold, dgram_cap)
    extra = {"radius": radius} if geo.stores_radius and radius is not None else {}
    with torch.no_grad():
        return float(geo.violation(tall(W, transposed).double(), **extra).max())
