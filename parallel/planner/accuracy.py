"""Where the memory estimate is known not to follow XLA, in the plan's own words.

The figures come from the calibration's recorded accuracy (parallel/planner/calibration.json,
written by `python benchmarks/refit_planner.py`): how far the estimate is from each
compiled grid of benchmarks/data/planner_grid.jsonl per libtpu release, the region of
chips and tokens per chip it follows closely, and notes on what the grid does not cover
(layer kinds, the compiler's own rematerialization), compiled with `plan --compile`.
benchmarks/RESULTS.md has the measurements behind them.
"""

from __future__ import annotations

import functools
import math
from importlib import metadata

from lctrain.parallel.planner.calibration import accuracy, calibration
from lctrain.recipes.schema import Recipe

# The TPU compiler the calibration was fitted with.
CALIBRATED_LIBTPU = calibration()["fitted"]["toolchain"]["libtpu"]

# How far apart two strategies' estimated step times must be before the plan moves a
# recipe off the strategy it names. A step time is a roofline: the traffic the planner
# counts at the links' bandwidth against the flops at the chip's peak. That traffic has run
# under the compiled collective bytes by nearly this much (recipes/qwen3_next_like.yaml's
# ring row in benchmarks/RESULTS.md), and no step on more than one chip has been timed against the
# estimate, so a smaller difference does not say which strategy runs faster.
STEP_TIME_ERROR = 0.15


def estimate_note(recipe: Recipe, axis_sizes: dict[str, int]) -> str | None:
    """A warning for a plan outside what the estimate follows; None inside it."""
    notes, followed = accuracy()["notes"], accuracy()["followed"]
    tokens_per_chip = recipe.data.seq_len // axis_sizes["context"]
    reasons = []
    if math.prod(axis_sizes.values()) > followed["chips"]:
        reasons.append(notes["more_chips"])
    if tokens_per_chip > followed["tokens_per_chip"]:
        reasons.append(f"at {tokens_per_chip // 1024}K tokens per chip "
                       f"{notes['more_tokens_per_chip']}")
    libtpu = installed_libtpu()
    if libtpu not in (None, CALIBRATED_LIBTPU):
        reasons.append(f"its calibration comes from libtpu {CALIBRATED_LIBTPU}; with the "
                       f"installed {libtpu} it is {accuracy_with(libtpu)}")
    kinds = set(recipe.model.layer_kinds())
    if "linear" in kinds:
        reasons.append(notes["linear_layers"])
    elif recipe.model.switches_layer_kinds():
        reasons.append(notes["switched_layer_kinds"])
    if recipe.remat.compiler_remat_percent is not None:
        reasons.append(notes["compiler_remat"])
    if recipe.remat.tensors.get("context") == "offload":
        reasons.append(notes["offloaded_context"])
    if not reasons:
        return None
    return ("the memory estimate is rough here: on the compiled grid "
            "(benchmarks/data/planner_grid.jsonl) " + "; ".join(reasons)
            + "; use --compile for XLA's own figure")


def accuracy_with(libtpu: str) -> str:
    """How far the estimate is from the grids `libtpu` compiled, as recorded."""
    grids = accuracy()["by_libtpu"].get(libtpu, {}).get("grids", {})
    if not grids:
        return "not measured against the compiler"
    names = accuracy()["grid_names"]
    measured = [f"within {g['worst']:.1%} (rms {g['rms']:.1%}) of {names[grid]}"
                for grid, g in grids.items()]
    unmeasured = [name for grid, name in names.items() if grid not in grids]
    return ", ".join(measured) + (f"; {' and '.join(unmeasured)} unmeasured"
                                  if unmeasured else "")


@functools.cache
def installed_libtpu() -> str | None:
    """The libtpu release installed (the tpu extra), None without it."""
    try:
        return metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        return None
