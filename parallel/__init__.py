"""Mesh, sharding rules and the context-parallel strategies (one file each)."""

from __future__ import annotations

from jax.sharding import Mesh

from lctrain.recipes import schema
from lctrain.recipes.schema import Recipe, RecipeError

from .all_gather import AllGather
from .mesh import MESH_AXES, build_mesh, describe_devices
from .none import NoContextParallel
from .ring import Ring
from .strategy import ContextStrategy, load_balanced_order
from .ulysses import Ulysses
from .usp import UnifiedSequenceParallel

# The registry: every strategy class, its cost model included (the planner reads it
# here).
STRATEGIES: dict[str, type[ContextStrategy]] = {
    strategy.name: strategy for strategy in (NoContextParallel, AllGather, Ulysses,
                                             Ring, UnifiedSequenceParallel)
}
# The recipe schema cannot import this registry (it is read before jax starts), so it
# keeps the names; they must be these, plus auto.
assert schema.STRATEGIES == (*STRATEGIES, "auto"), (schema.STRATEGIES, tuple(STRATEGIES))
assert len({s.simplicity for s in STRATEGIES.values()}) == len(STRATEGIES), \
    "each strategy needs its own simplicity rank (the planner's tie-break)"


def strategy_class(recipe: Recipe) -> type[ContextStrategy]:
    name = recipe.parallel.strategy
    if name not in STRATEGIES:
        raise RecipeError(f"recipe key 'parallel.strategy' = '{name}': not implemented yet; "
                          f"available: {', '.join(STRATEGIES)}")
    return STRATEGIES[name]


def make_strategy(recipe: Recipe, mesh: Mesh) -> ContextStrategy:
    return strategy_class(recipe)(recipe, mesh)


__all__ = ["MESH_AXES", "STRATEGIES", "ContextStrategy", "build_mesh", "describe_devices",
           "load_balanced_order", "make_strategy", "strategy_class"]
