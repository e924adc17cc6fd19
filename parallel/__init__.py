"""Mesh, sharding rules and the context-parallel strategies (one file each)."""

from __future__ import annotations

from jax.sharding import Mesh

from lctrain.recipes import schema
from lctrain.recipes.schema import Recipe, RecipeError

from .all_gather import AllGather
from .halo import Halo
from .layer_strategies import LayerStrategies, layer_strategies
from .mesh import MESH_AXES, build_mesh, describe_devices
from .none import NoContextParallel
from .ring import Ring
from .state_passing import StatePassing
from .strategy import ContextStrategy, load_balanced_order
from .ulysses import Ulysses
from .usp import UnifiedSequenceParallel

# The registry: every strategy class, its cost model included (the planner reads it
# here).
STRATEGIES: dict[str, type[ContextStrategy]] = {
    strategy.name: strategy for strategy in (NoContextParallel, AllGather, Ulysses,
                                             Ring, UnifiedSequenceParallel, Halo,
                                             StatePassing)
}
# The recipe schema cannot import this registry (it is read before jax starts), so it
# keeps the names; they must be these, plus auto.
assert schema.STRATEGY_NAMES == (*STRATEGIES, "auto"), (schema.STRATEGY_NAMES, tuple(STRATEGIES))
assert len({s.simplicity for s in STRATEGIES.values()}) == len(STRATEGIES), \
    "each strategy needs its own simplicity rank (the planner's tie-break)"


def strategy_classes(recipe: Recipe) -> dict[str, type[ContextStrategy]]:
    """The strategy class of each layer kind the model has (parallel.strategy: one name for
    all, or a map kind -> name)."""
    names = recipe.parallel.by_kind(dict.fromkeys(recipe.model.layer_kinds()))
    for key, name in recipe.parallel.keyed_names():
        if name not in STRATEGIES:
            raise RecipeError(f"recipe key '{key}' = '{name}': not implemented yet; "
                              f"available: {', '.join(STRATEGIES)}")
    return {kind: STRATEGIES[name] for kind, name in names.items()}


def make_strategy(recipe: Recipe, mesh: Mesh) -> LayerStrategies:
    """The strategy of every layer kind (one instance per strategy named), as the step
    uses them."""
    classes = strategy_classes(recipe)
    instances = {cls: cls(recipe, mesh) for cls in dict.fromkeys(classes.values())}
    return layer_strategies(recipe, {kind: instances[cls] for kind, cls in classes.items()})


__all__ = ["MESH_AXES", "STRATEGIES", "ContextStrategy", "LayerStrategies", "build_mesh",
           "describe_devices", "load_balanced_order", "make_strategy", "strategy_classes"]
