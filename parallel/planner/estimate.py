"""One strategy's plan: the common terms (shapes, memory, traffic, time) plus the
strategy's own cost model, for one recipe on one mesh."""

from __future__ import annotations

import dataclasses

from lctrain.parallel import STRATEGIES, attention_on
from lctrain.parallel.chips import Chip
from lctrain.parallel.planner import layer_kinds
from lctrain.parallel.planner.memory import kernel_impl, memory
from lctrain.parallel.planner.results import StrategyPlan
from lctrain.parallel.planner.shapes import dims, weights
from lctrain.parallel.planner.timing import timing
from lctrain.parallel.planner.traffic import by_kind, traffic
from lctrain.recipes.schema import Recipe


def recipe_for_strategy(recipe: Recipe, strategy: str, ulysses: int = 1) -> Recipe:
    """A copy of the recipe running `strategy` (with Ulysses degree `ulysses` where the
    strategy takes one)."""
    takes_degree = STRATEGIES[strategy].takes_ulysses_degree
    return recipe.with_strategy(strategy, ulysses if takes_degree else 1)


def recipe_for_plan(recipe: Recipe, p: StrategyPlan) -> Recipe:
    """A copy of the recipe running plan `p`: its strategy, or on a model of several
    layer kinds its strategy per kind."""
    variant = recipe_for_strategy(recipe, p.strategy, p.ulysses)
    if p.kinds is not None:
        variant = variant.with_strategy({kind: part.strategy for kind, part in p.kinds.items()},
                                        variant.parallel.ulysses)
    return variant


def estimate(recipe: Recipe, axis_sizes: dict[str, int], chip: Chip, strategy: str,
             ulysses: int = 1, platform: str = "tpu") -> StrategyPlan:
    """The analytic plan of one strategy (the modules' docstrings give every term)."""
    recipe = dataclasses.replace(recipe, attention=attention_on(recipe, chip.name,
                                                                axis_sizes["context"]))
    cost_model = STRATEGIES[strategy]
    dm = dims(recipe, axis_sizes, strategy, ulysses)
    kinds = None
    if layer_kinds.is_mixed(recipe):   # `strategy` serves the global layers
        choice = layer_kinds.choice_for(recipe, axis_sizes, strategy, ulysses)
        cost_model = layer_kinds.cost_model(recipe, axis_sizes, choice, dims)
        kinds = layer_kinds.kind_plans(cost_model, dm.accum)
    w = weights(recipe, axis_sizes, dm.c)
    impl = kernel_impl(recipe_for_strategy(recipe, strategy, ulysses), platform, axis_sizes)
    held = memory(recipe, dm, w, cost_model, impl)
    own = cost_model.traffic(dm)
    detail = traffic(recipe, dm, w, own)
    time = timing(recipe, axis_sizes, chip, detail, own, cost_model.ring_timing(dm, chip))
    return StrategyPlan(
        strategy=strategy, ulysses=ulysses if cost_model.takes_ulysses_degree else 1,
        memory=held.terms, peak_terms=held.peak_terms, peak_phase=held.peak_phase,
        host=held.host, comm=by_kind(detail),
        comm_detail={source: nbytes for source, (_, nbytes) in detail.items()},
        **dataclasses.asdict(time), peak_flops=chip.peak_bf16_flops,
        hbm_capacity=chip.hbm_bytes, host_capacity=chip.host_bytes, kinds=kinds)
