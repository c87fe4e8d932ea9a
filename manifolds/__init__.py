"""Manifold geometry and the ManifoldMuon optimizer.

Public API: ManifoldMuon, manifold_param_groups, steepest_direction, project_to_manifold,
manifold_violation, MANIFOLD_NAMES, SolverOptions.
"""
import torch

from manifolds.dual import SolverOptions, steepest_direction
from manifolds.geometry import MANIFOLDS, geometry
from manifolds.optimizer import ManifoldMuon
from manifolds.param_groups import manifold_param_groups

MANIFOLD_NAMES = tuple(MANIFOLDS)


def _tall(W):
    return W.mT if W.size(-2) < W.size(-1) else W


def project_to_manifold(W, manifold, dgram_cap=1.0):
    """The retraction R applied to an arbitrary W (e.g. an initialisation), same shape as W.

    Stiefel: msign(W); DGram: msign(W N^-1) N with N the column norms (tall orientation).
    DGram-cap: the DGram projection with the column norms clipped at `dgram_cap`.
    Computed with an exact SVD polar factor, so it is accurate however far W is from the manifold.
    """
    geo = geometry(manifold, dgram_cap)
    wide = W.size(-2) < W.size(-1)
    out = geo.retract(_tall(W), near=False)
    return out.mT if wide else out


def manifold_violation(W, manifold, dgram_cap=1.0):
    """Distance from the manifold on the tall orientation, as a float (max over a batch).

    Stiefel: max|W^T W - I|;  DGram: max|Off(W^T W)| / max diag(W^T W);  DGram-cap: the larger
    of DGram's and the relative excess of the largest column norm over the cap;  none: 0.
    """
    with torch.no_grad():
        return float(geometry(manifold, dgram_cap).violation(_tall(W).double()).max())
