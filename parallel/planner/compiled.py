"""XLA's own figures beside the estimate: compile each strategy's train step for a TPU
topology (parallel/aot.py, libtpu, no TPU needed) and recommend by what the compiler says."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, ContextManager

from lctrain.parallel.chips import Chip
from lctrain.parallel.planner.choice import recommend
from lctrain.parallel.planner.estimate import recipe_for_strategy
from lctrain.parallel.planner.results import Plan
from lctrain.recipes.schema import Recipe

# What the compiling functions wrap each compile in, given its label (the CLI shows a
# spinner and the elapsed time: each compile can take minutes).
Timer = Callable[[str], ContextManager]


def compile_figures(recipe: Recipe, devices) -> dict:
    """XLA's own per-device figures for the recipe's train step on `devices` (a TPU
    topology from parallel.aot.topology_devices): {"hbm_bytes", "host_bytes",
    "collective_bytes"}, or {"hbm_bytes": None, "error": ...} when XLA refuses the program
    because its temporaries exceed the chip's HBM (it does not fit)."""
    from lctrain.parallel import aot
    try:
        stats = aot.compiled_stats(aot.compile_train_step(recipe, devices))
    except Exception as err:                      # XLA's RESOURCE_EXHAUSTED, as JaxRuntimeError
        text = str(err)
        if "RESOURCE_EXHAUSTED" not in text:
            raise
        return {"hbm_bytes": None, "host_bytes": None, "collective_bytes": None,
                "error": text.splitlines()[0][:300]}
    return {"hbm_bytes": stats.hbm_bytes,
            "host_bytes": stats.host_temp_bytes + stats.host_argument_bytes,
            "collective_bytes": dict(stats.collective_bytes),
            "temp_bytes": stats.temp_bytes, "argument_bytes": stats.argument_bytes}


def compiled_fits(figures: dict, chip: Chip) -> bool:
    return (figures.get("hbm_bytes") is not None and figures["hbm_bytes"] <= chip.hbm_bytes
            and (figures.get("host_bytes") or 0) <= chip.host_bytes)


def attach_compiled(result: Plan, recipe: Recipe, devices,
                    timed: Timer = lambda _: nullcontext()) -> None:
    """Compiles every strategy of the plan for `devices`, records XLA's figures and
    recommends again by them."""
    for strategy_plan in result.plans:
        variant = recipe_for_strategy(recipe, strategy_plan.strategy, strategy_plan.ulysses)
        with timed(f"compiled {strategy_plan.name}, seq {recipe.data.seq_len:,}, for "
                   f"{len(devices)} devices"):
            strategy_plan.compiled = compile_figures(variant, devices)
    result.choice, result.reason = recommend(result.plans)
