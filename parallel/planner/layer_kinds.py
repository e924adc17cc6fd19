"""The planner for a model of several layer kinds (model.layer_pattern: global,
sliding-window and linear layers), each kind on its own strategy (parallel.strategy as a
map). Linear (Gated DeltaNet) layers plan on state_passing with their own heads
(`linear_dims`): its all-gathers of the runs' state maps, whatever the sequence length.

Each kind's attention terms come from its own strategy's cost model, over that kind's
layers and window (Dims.layers, Dims.window): its traffic (halo's: window-1 tokens per
exchange, whatever the sequence), its kernel residuals, its attention working set (one
layer runs at a time, so the largest kind's counts at the peak), and its attention FLOPs
(a sliding query sees about `window` keys where a causal global one sees s/2 on average).
Everything else (states, weights, loss, MLP) is shared and counted once, as without a
pattern: a model without model.layer_pattern plans exactly as before.

`KindsCostModel` answers what the planner asks a strategy class (parallel/cost_model.py),
summed or maximised over the kinds, so memory, traffic and timing take it in place of one
strategy.
"""

from __future__ import annotations

import collections
import dataclasses

from lctrain.parallel import STRATEGIES
from lctrain.parallel.chips import Chip
from lctrain.parallel.cost_model import AttentionFootprint, Dims, RingTiming, Traffic
from lctrain.parallel.halo import check_halo_window
from lctrain.parallel.strategy import stored_chunk_tokens
from lctrain.recipes.schema import Recipe

# (strategy name, ulysses degree) of each layer kind
KindChoice = dict[str, tuple[str, int]]


def is_mixed(recipe: Recipe) -> bool:
    """Whether the model names layer kinds (model.layer_pattern)."""
    return bool(recipe.model.layer_pattern)


def layer_counts(recipe: Recipe) -> dict[str, int]:
    """Layers of each kind, global first."""
    counts = collections.Counter(recipe.model.layer_kinds())
    return dict(sorted(counts.items(), key=lambda item: item[0] != "global"))


def halo_fits(recipe: Recipe, context: int) -> bool:
    """Whether the sliding layers' window - 1 fits in one stored chunk (halo can run)."""
    window = recipe.model.layer_group("sliding").window
    try:
        check_halo_window(window, stored_chunk_tokens(recipe, context))
    except ValueError:
        return False
    return True


def choice_for(recipe: Recipe, axis_sizes: dict[str, int], strategy: str,
               ulysses: int) -> KindChoice:
    """Each kind's strategy when the global layers run `strategy`: the sliding layers on
    halo where their window fits the chunk, else on `strategy` with their window; linear
    layers on state_passing wherever the sequence is split."""
    split = axis_sizes["context"] > 1
    halo = split and "sliding" in layer_counts(recipe) and halo_fits(recipe,
                                                                     axis_sizes["context"])
    special = {"sliding": ("halo", 1) if halo else None,
               "linear": ("state_passing", 1) if split else None}
    return {kind: special.get(kind) or (strategy, ulysses) for kind in layer_counts(recipe)}


def kind_dims(recipe: Recipe, axis_sizes: dict[str, int], choice: KindChoice,
              dims_for) -> dict[str, Dims]:
    """Each kind's Dims: its strategy's degrees, its layer count and window
    (`dims_for(recipe, axis_sizes, strategy, ulysses)` is planner.shapes.dims)."""
    counts = layer_counts(recipe)
    dims = {kind: dataclasses.replace(dims_for(recipe, axis_sizes, name, ulysses),
                                      layers=counts[kind],
                                      window=recipe.model.layer_group(kind).window,
                                      kinds_switched=recipe.model.switches_layer_kinds())
            for kind, (name, ulysses) in choice.items()}
    if "linear" in dims:
        dims["linear"] = linear_dims(recipe, dims["linear"])
    return dims


def linear_dims(recipe: Recipe, dm: Dims) -> Dims:
    """A linear layer's heads in place of attention's: h value heads, kv key heads per
    tensor shard, d their width (state_passing's cost model takes d_k = d_v), and its
    causal conv's width."""
    m = recipe.model
    return dataclasses.replace(dm, h=max(m.linear_value_heads // dm.t, 1),
                               kv=max(m.linear_key_heads // dm.t, 1),
                               d=m.linear_value_head_dim, conv_kernel=m.linear_conv_kernel)


@dataclasses.dataclass(frozen=True)
class KindsCostModel:
    """The kinds' cost models together, answering as one strategy class does."""
    kinds: dict[str, tuple[type, Dims]]   # kind -> (strategy class, its Dims)

    @property
    def takes_ulysses_degree(self) -> bool:
        return any(cls.takes_ulysses_degree for cls, _ in self.kinds.values())

    def attention_footprint(self, dm: Dims) -> AttentionFootprint:
        """The largest kind's working set: one layer's backward runs at a time."""
        return max((cls.attention_footprint(kdm) for cls, kdm in self.kinds.values()),
                   key=lambda footprint: footprint.working_set)

    def kernel_residuals(self, dm: Dims) -> float:
        """Per layer on average (memory multiplies by every layer)."""
        return sum(cls.kernel_residuals(kdm) * kdm.layers
                   for cls, kdm in self.kinds.values()) / dm.layers

    def traffic(self, dm: Dims) -> Traffic:
        """Each kind's traffic over its own layers, summed by source."""
        total: Traffic = {}
        for cls, kdm in self.kinds.values():
            for source, (kind, nbytes) in cls.traffic(kdm).items():
                total[source] = (kind, total.get(source, (kind, 0.0))[1] + nbytes)
        return total

    def ring_timing(self, dm: Dims, chip: Chip) -> RingTiming | None:
        """The ring's balance of the first kind that runs one (its sends are per step,
        the same in every ring layer)."""
        return next((timing for cls, kdm in self.kinds.values()
                     if (timing := cls.ring_timing(kdm, chip)) is not None), None)


def cost_model(recipe: Recipe, axis_sizes: dict[str, int], choice: KindChoice,
               dims_for) -> KindsCostModel:
    dims = kind_dims(recipe, axis_sizes, choice, dims_for)
    return KindsCostModel({kind: (STRATEGIES[name], dims[kind])
                           for kind, (name, _) in choice.items()})


@dataclasses.dataclass(frozen=True)
class KindPlan:
    """One layer kind's part of a plan (StrategyPlan.kinds)."""
    strategy: str
    layers: int
    window: int | None
    comm_bytes: float      # its strategy's own traffic per step per device


def kind_plans(model: KindsCostModel, accum: int) -> dict[str, KindPlan]:
    return {kind: KindPlan(cls.name, kdm.layers, kdm.window,
                           accum * sum(nbytes for _, nbytes in cls.traffic(kdm).values()))
            for kind, (cls, kdm) in model.kinds.items()}
