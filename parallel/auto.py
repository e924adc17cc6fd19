"""parallel.strategy=auto: pick a context-parallel strategy from the planner's estimate.

The planner (`parallel/planner/`) estimates every strategy the mesh allows (per-device
memory at the step's peak, traffic, step time); auto takes its recommendation: among the
strategies that fit in device memory, the fastest estimated step, the simplest when they
are within a few percent; when none fits, the one that needs the least memory. The run
prints the choice and the planner's reason.
"""

from __future__ import annotations

import dataclasses

from lctrain.parallel import planner
from lctrain.parallel.chips import CHIPS, Chip, chip_for_device_kind
from lctrain.recipes.schema import Recipe

# Peak flops and link bandwidth only set the balance of compute and traffic; devices the
# chip table does not know (CPU) are planned as a v5p with their own memory.
DEFAULT_CHIP = "v5p"


def choose_strategy(recipe: Recipe, axis_sizes: dict[str, int], device_memory: int,
                    chip: Chip | None = None, platform: str = "tpu") -> tuple[str, int, str]:
    """Returns (strategy, ulysses degree, the reason in words)."""
    if axis_sizes["context"] == 1:
        return "none", 1, "mesh.context is 1"
    chip = dataclasses.replace(chip or CHIPS[DEFAULT_CHIP], hbm_bytes=device_memory)
    result = planner.plan(recipe, chip, axis_sizes, platform)
    best = result.choice
    return best.strategy, best.ulysses, result.reason


def resolve_auto(recipe: Recipe, axis_sizes: dict[str, int], devices,
                 device_memory: int) -> str | None:
    """Replaces parallel.strategy=auto in `recipe` by the planner's pick for `devices`;
    returns the sentence to print (None when the recipe named a strategy)."""
    if recipe.parallel.strategy != "auto":
        return None
    strategy, ulysses, reason = choose_strategy(
        recipe, axis_sizes, device_memory, chip_for_device_kind(devices[0].device_kind),
        devices[0].platform)
    recipe.parallel.strategy, recipe.parallel.ulysses = strategy, ulysses
    return f"parallel.strategy=auto chose {strategy}" + (
        f" (ulysses {ulysses})" if strategy == "usp" else "") + f": {reason}"
