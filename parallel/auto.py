"""parallel.strategy=auto: pick a context-parallel strategy from the planner's estimate, then
keep the first one whose compiled train step fits.

On a model of several layer kinds (model.layer_pattern) the choice is a map kind ->
strategy, each kind planned on its own (parallel/planner/layer_kinds.py: sliding layers on
halo when their window fits the chunk); parallel.strategy may then be auto, or a map with
auto for some kinds, the kinds it names kept.

The planner (`parallel/planner/`) estimates every strategy the mesh allows (per-device
memory at the step's peak, traffic, step time) and ranks them as its recommendation does:
among the strategies that fit in device memory, the fastest estimated step, the simplest
when they are within a few percent; when none fits, the one that needs the least memory.
The estimate can be off by a quarter near the limit, so on a real accelerator the run
compiles its first choice and, when XLA's own figure does not fit, falls back to the next
(`first_that_fits`), saying why in one line.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from lctrain.parallel import planner
from lctrain.parallel.chips import CHIPS, Chip, chip_for_device_kind, gigabytes
from lctrain.parallel.layer_strategies import strategy_name
from lctrain.parallel.planner.results import StrategyPlan
from lctrain.parallel.xla_failures import COMPILER_FAILED, classify, classify_message
from lctrain.recipes.schema import Recipe, RecipeError

# A strategy name, or (model.layer_pattern) a map layer kind -> name
Strategy = str | dict[str, str]

# Peak flops and link bandwidth only set the balance of compute and traffic; devices the
# chip table does not know (CPU) are planned as a v5p with their own memory.
DEFAULT_CHIP = "v5p"


@dataclasses.dataclass
class AutoChoice:
    """What auto chose: (strategy, ulysses degree) best first, and the sentence to print."""
    ranked: list[tuple[Strategy, int]]
    sentence: str


def ranked(plans: list[StrategyPlan]) -> list[StrategyPlan]:
    """The plans in the order the recommendation ranks them: its pick, then its pick of
    the rest, and so on."""
    left, order = list(plans), []
    while left:
        best, _ = planner.recommend(left)
        order.append(best)
        left.remove(best)
    return order


def ranked_strategies(recipe: Recipe, axis_sizes: dict[str, int], device_memory: int,
                      chip: Chip | None = None, platform: str = "tpu"
                      ) -> tuple[list[tuple[Strategy, int]], str]:
    """[(strategy, ulysses degree)] best first, and the reason for the first in words; on
    a model of several layer kinds each strategy is a map kind -> name (the planner's per
    kind, model.layer_pattern), keeping the kinds the recipe names."""
    if axis_sizes["context"] == 1:
        return [(by_kind(recipe, "none"), 1)], "mesh.context is 1"
    chip = dataclasses.replace(chip or CHIPS[DEFAULT_CHIP], hbm_bytes=device_memory)
    result = planner.plan(recipe, chip, axis_sizes, platform)
    named = named_kinds(recipe)
    order = []
    for p in ranked(result.plans):
        if p.kinds is None:
            order.append((p.strategy, p.ulysses))
        elif named.get("global", p.kinds["global"].strategy) == p.kinds["global"].strategy:
            choice = {**{kind: part.strategy for kind, part in p.kinds.items()}, **named}
            if (choice, p.ulysses) not in order:
                order.append((choice, p.ulysses))
    if not order:
        key, name = (("parallel.strategy.global", named["global"]) if "global" in named
                     else ("parallel.strategy", recipe.parallel.strategy))
        why = "; ".join(f"{s}: {w}" for s, w in result.skipped.items()) or "no candidate"
        raise RecipeError(f"recipe key {key!r} = {name!r}: no strategy of the planner runs "
                          f"on this mesh ({why}); change mesh.context or data.seq_len, or "
                          f"name a strategy")
    return order, result.reason


def by_kind(recipe: Recipe, name: str) -> Strategy:
    """`name` for every layer kind of a model with several, else `name`."""
    kinds = dict.fromkeys(recipe.model.layer_kinds())
    return {kind: name for kind in kinds} if recipe.model.layer_pattern else name


def named_kinds(recipe: Recipe) -> dict[str, str]:
    """The kinds a strategy map fixes (those it does not leave to auto)."""
    strategy = recipe.parallel.strategy
    return ({kind: name for kind, name in strategy.items() if name != "auto"}
            if isinstance(strategy, dict) else {})


def wants_auto(recipe: Recipe) -> bool:
    """parallel.strategy is auto, or a map with auto for some kind."""
    strategy = recipe.parallel.strategy
    return "auto" in (strategy.values() if isinstance(strategy, dict) else [strategy])


def choose_strategy(recipe: Recipe, axis_sizes: dict[str, int], device_memory: int,
                    chip: Chip | None = None, platform: str = "tpu"
                    ) -> tuple[Strategy, int, str]:
    """Returns (strategy, ulysses degree, the reason in words)."""
    order, reason = ranked_strategies(recipe, axis_sizes, device_memory, chip, platform)
    strategy, ulysses = order[0]
    return strategy, ulysses, reason


def resolve_auto(recipe: Recipe, axis_sizes: dict[str, int], devices,
                 device_memory: int) -> tuple[Recipe, AutoChoice | None]:
    """The recipe with parallel.strategy=auto (or auto for some kinds of a strategy map)
    replaced by the planner's pick for `devices`, and the ranking and the sentence to print;
    `recipe` itself and None when the recipe named every strategy."""
    if not wants_auto(recipe):
        return recipe, None
    order, reason = ranked_strategies(recipe, axis_sizes, device_memory,
                                      chip_for_device_kind(devices[0].device_kind),
                                      devices[0].platform)
    return recipe.with_strategy(*order[0]), AutoChoice(
        order, f"parallel.strategy=auto chose {strategy_name(*order[0])}: {reason}")


# ------------------------------------------------------- compiled fit check ----

@dataclasses.dataclass
class CompiledNeed:
    """Per-device memory of one candidate's compiled train step."""
    name: str
    hbm_bytes: int
    host_bytes: int = 0
    refused: str | None = None      # XLA's own out-of-memory message, when it refused
    seconds: float = 0.0            # lowering and compiling took


def compiled_line(need: CompiledNeed, limit: int | None) -> str:
    """The line every run prints once its train step is compiled."""
    host = f" + {gigabytes(need.host_bytes)} host" if need.host_bytes else ""
    of = f" (of {gigabytes(limit)})" if limit else ""
    took = f" in {need.seconds:.1f} s" if need.seconds else ""
    return (f"compiled train step: {need.name}, {gigabytes(need.hbm_bytes)} per device{of}"
            f"{host}{took}")


def first_that_fits(candidates: list[tuple[Strategy, int]],
                    compile_candidate: Callable[[Strategy, int], tuple[Any, CompiledNeed]],
                    limit: int | None, say: Callable[[str], None]
                    ) -> tuple[Any, CompiledNeed] | list[CompiledNeed]:
    """Compiles the candidates in order (each once) until one needs at most `limit` bytes
    per device (no limit: the first); returns what compile_candidate gave for it, or every
    need when none fits."""
    needs = []
    for index, (strategy, ulysses) in enumerate(candidates):
        compiled, need = compile_candidate(strategy, ulysses)
        if need.refused is None and (limit is None or need.hbm_bytes <= limit):
            say(compiled_line(need, limit))
            return compiled, need
        needs.append(need)
        if index + 1 < len(candidates):
            say(f"{shortfall(need, limit)}; trying {strategy_name(*candidates[index + 1])}")
    return needs


def compiler_failed(need: CompiledNeed) -> bool:
    """Whether XLA refused the candidate for another reason than memory (a candidate that
    compiled, over the limit or not, has no refusal)."""
    return (need.refused or "").startswith(COMPILER_FAILED)


def shortfall(need: CompiledNeed, limit: int | None) -> str:
    """'ring needs 97.2 GB of 95.7 GB per device' (or XLA's words when it gave no figure)."""
    if compiler_failed(need):
        return f"{need.name}: {need.refused}"
    if not need.hbm_bytes:
        return f"{need.name} does not fit: {need.refused}"
    of = f" of {gigabytes(limit)}" if limit else ""
    return f"{need.name} needs {gigabytes(need.hbm_bytes)}{of} per device"


def none_fits(needs: list[CompiledNeed], limit: int) -> str:
    """The smallest need of candidates none of which fits, in words."""
    smallest = min(needs, key=lambda need: need.hbm_bytes or float("inf"))
    tried = (f" (the least of {', '.join(need.name for need in needs)})" if len(needs) > 1
             else "")
    return shortfall(smallest, limit) + tried


def compiler_failure(name: str, err: BaseException) -> CompiledNeed | None:
    """The need of a candidate XLA refused to compile for a reason other than memory: no
    figure, ranked after every candidate that has one. None when `err` is not XLA's."""
    failure = classify(err)
    if failure is None:
        return None
    return CompiledNeed(name, 0, refused=failure.recorded)


def refused_need(name: str, message: str) -> CompiledNeed:
    """The need of a candidate XLA refused to compile for lack of memory (0 when its
    message gives no figure: it then ranks as the smallest only if every message does)."""
    failure = classify_message(message)
    return CompiledNeed(name, failure.needed_bytes or 0, refused=failure.first_line)
