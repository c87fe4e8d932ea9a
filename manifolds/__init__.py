"""Manifold geometry and the ManifoldMuon optimizer.

Public API: ManifoldMuon, manifold_param_groups, steepest_direction, project_to_manifold,
manifold_violation, MANIFOLD_NAMES, SolverOptions.
"""
from manifolds.dual import SolverOptions, steepest_direction
from manifolds.geometry import MANIFOLDS, manifold_violation, project_to_manifold
from manifolds.optimizer import ManifoldMuon
from manifolds.param_groups import manifold_param_groups

MANIFOLD_NAMES = tuple(MANIFOLDS)
