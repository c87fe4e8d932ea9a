"""Manifold geometry and the ManifoldMuon optimizer.

Public API: ManifoldMuon, manifold_param_groups, steepest_direction, project_to_manifold,
manifold_violation, SolverOptions; Manifold, register_manifold and MANIFOLDS (the registry of
manifolds by name), MANIFOLD_NAMES (the names registered now).
"""
from manifolds.solver import SolverOptions, steepest_direction
from manifolds.geometry import MANIFOLDS, Manifold, manifold_violation, project_to_manifold, register_manifold
from manifolds.optimizer import ManifoldMuon
from manifolds.param_groups import manifold_param_groups


def __getattr__(name):
    if name == "MANIFOLD_NAMES":  # read at each access: manifolds registered later are in it
        return tuple(MANIFOLDS)
    raise AttributeError(f"module 'manifolds' has no attribute {name!r}")
