"""Mesh, sharding rules and the context-parallel strategies (one file each)."""

from __future__ import annotations

from jax.sharding import Mesh

from lctrain import kernels
from lctrain.recipes import check_against_devices
from lctrain.recipes.schema import Recipe

from .all_gather import AllGather
from .halo import Halo
from .layer_strategies import LayerStrategies, layer_strategies
from .mesh import MESH_AXES, build_mesh, describe_devices, slice_count
from .none import NoContextParallel
from .ring import Ring
from .state_passing import StatePassing
from .strategy import (ContextStrategy, attention_on, chip_generation, load_balanced_order,
                       stored_chunk_tokens)
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
# keeps the names (schema.STRATEGY_NAMES): these, plus auto (tests/test_strategy_registry.py).


def strategy_classes(recipe: Recipe) -> dict[str, type[ContextStrategy]]:
    """The strategy class of each layer kind the model has (parallel.strategy: one name for
    all, or a map kind -> name)."""
    names = recipe.parallel.by_kind(dict.fromkeys(recipe.model.layer_kinds()))
    return {kind: STRATEGIES[name] for kind, name in names.items()}


def kernels_by_kind(recipe: Recipe, devices) -> dict[str, str]:
    """The attention kernel (a registered impl) that each attention layer kind's calls run
    on `devices`: what attention.impl=auto, or a TPU kernel on a GPU, comes to."""
    platform = devices[0].platform
    sizes = check_against_devices(recipe, len(devices), slice_count(devices))
    a = attention_on(recipe, chip_generation(devices[0]), sizes["context"])
    run_tokens = stored_chunk_tokens(recipe, sizes["context"])
    return {kind: kernels.impl_for_call(a.impl, platform, *cls.kernel_lengths(recipe, sizes),
                                        a.block_q, a.block_kv, run_tokens,
                                        recipe.model.layer_group(kind).window)
            for kind, cls in strategy_classes(recipe).items() if kind != "linear"}


def attention_blocks(recipe: Recipe, devices) -> str:
    """'512 x 2048': the blocks (queries x keys) the kernel calls take on `devices`."""
    sizes = check_against_devices(recipe, len(devices), slice_count(devices))
    a = attention_on(recipe, chip_generation(devices[0]), sizes["context"])
    return f"{a.block_q} x {a.block_kv}"


def attention_kernels(recipe: Recipe, devices) -> str:
    """attention.impl and what it comes to per layer kind, as a run's first line says it:
    "xla" where that is the kernel asked for, else e.g. "auto: global splash, sliding
    pallas" (one name where every kind got the same)."""
    chosen, impl = kernels_by_kind(recipe, devices), recipe.attention.impl
    names = set(chosen.values())
    if names <= {impl}:
        return impl
    if len(names) == 1:
        return f"{impl}: {names.pop()}"
    return f"{impl}: " + ", ".join(f"{kind} {name}" for kind, name in chosen.items())


def make_strategy(recipe: Recipe, mesh: Mesh) -> LayerStrategies:
    """The strategy of every layer kind (one instance per strategy named), as the step
    uses them."""
    classes = strategy_classes(recipe)
    instances = {cls: cls(recipe, mesh) for cls in dict.fromkeys(classes.values())}
    return layer_strategies(recipe, {kind: instances[cls] for kind, cls in classes.items()})


__all__ = ["MESH_AXES", "STRATEGIES", "ContextStrategy", "LayerStrategies", "attention_kernels",
           "build_mesh", "describe_devices", "kernels_by_kind", "load_balanced_order",
           "make_strategy", "strategy_classes"]
