"""The context-parallel strategies of a model's layer kinds (model.layer_pattern), as the
train step uses them: one strategy per kind, each kind's attend bound to its window.

All kinds see the same stored batch, so their strategies must store the sequence alike
(token order, its split over the devices); what they may differ in is how a device's
chunk meets the rest of the sequence (e.g. ring for global layers, halo for sliding ones).
"""

from __future__ import annotations

import functools

import numpy as np

from lctrain.recipes.schema import Recipe, RecipeError

from .linear_mix import linear_mix
from .strategy import ContextStrategy


class LayerStrategies:
    """What the step needs of the strategies: `attends` (kind -> the model's attend), and
    the stored layout they share (`sequence_order`, `sequence_shards`, `split_tokens`,
    `gather_weight`), read from the first kind's strategy."""

    def __init__(self, by_kind: dict[str, ContextStrategy], windows: dict[str, int | None],
                 name: str, linear_chunk: int | None = None):
        self.by_kind = by_kind
        self.name = name
        shared = next(iter(by_kind.values()))
        self.mesh, self.sequence_shards = shared.mesh, shared.sequence_shards
        self.sequence_order = shared.sequence_order
        self.split_tokens, self.gather_weight = shared.split_tokens, shared.gather_weight
        self.attends = {kind: _with_window(strategy.attend, windows[kind])
                        for kind, strategy in by_kind.items()}
        if "linear" in by_kind:  # Gated DeltaNet layers take a mix (parallel/linear_mix.py)
            self.attends["linear"] = functools.partial(linear_mix, by_kind["linear"],
                                                       linear_chunk)


def _with_window(attend, window: int | None):
    """The strategy's attend for layers of `window` (global ones call it as before)."""
    return attend if window is None else functools.partial(attend, window=window)


def layer_strategies(recipe: Recipe, by_kind: dict[str, ContextStrategy]) -> LayerStrategies:
    """The kinds' strategies, once checked to share the stored layout."""
    windows = {kind: recipe.model.layer_group(kind).window for kind in by_kind}
    _check_shared_layout(recipe, by_kind)
    return LayerStrategies(by_kind, windows, strategy_name(recipe.parallel.strategy),
                           recipe.model.linear_chunk)


def strategy_name(strategy: str | dict[str, str], ulysses: int | None = None) -> str:
    """How the run names parallel.strategy: a map per layer kind as "global: ring,
    sliding: halo"; usp with its degree when `ulysses` is given."""
    if isinstance(strategy, dict):
        return ", ".join(f"{kind}: {strategy_name(name, ulysses)}"
                         for kind, name in strategy.items())
    return f"{strategy} (ulysses {ulysses})" if strategy == "usp" and ulysses else strategy


def _check_shared_layout(recipe: Recipe, by_kind: dict[str, ContextStrategy]) -> None:
    seq_len = recipe.data.seq_len
    layouts = {kind: (s.sequence_shards, s.sequence_order(seq_len)) for kind, s in by_kind.items()}
    (first, (context, order)), *others = layouts.items()
    for kind, (other_context, other_order) in others:
        same_order = (order is None and other_order is None) or (
            order is not None and other_order is not None and np.array_equal(order, other_order))
        if other_context != context or not same_order:
            raise RecipeError(
                f"recipe key 'parallel.strategy' = {recipe.parallel.strategy!r}: the {first} "
                f"layers' {by_kind[first].name} and the {kind} layers' {by_kind[kind].name} "
                f"store the sequence differently (its order or its split over the devices), "
                f"and every layer reads the same stored batch; pick strategies that agree")
