"""Which strategies the mesh allows, their plans, and the one to recommend."""

from __future__ import annotations

from lctrain.parallel import STRATEGIES
from lctrain.parallel.chips import LOAD_RESERVE_BYTES, Chip, gigabytes
from lctrain.parallel.cost_model import NotOnThisMesh
from lctrain.parallel.planner.accuracy import STEP_TIME_ERROR, estimate_note
from lctrain.parallel.planner.estimate import estimate, recipe_for_strategy
from lctrain.parallel.planner.results import Plan, StrategyPlan
from lctrain.parallel.strategy import check_kernel_layout
from lctrain.recipes.schema import KIND_ONLY_STRATEGIES, Recipe, RecipeError

# A strategy whose estimated step time is within this factor of the fastest counts as a tie
# (smaller than the estimate's own error: it only settles near-equal cases).
TIE = 1.005


def plan(recipe: Recipe, chip: Chip, axis_sizes: dict[str, int],
         platform: str = "tpu") -> Plan:
    """Estimates every strategy the mesh allows and recommends one."""
    options, skipped = candidates(recipe, axis_sizes, platform)
    plans = [estimate(recipe, axis_sizes, chip, s, u, platform) for s, u in options]
    choice, reason = recommend(plans)
    return Plan(chip, axis_sizes, plans, skipped, choice, reason,
                estimate_note(recipe, axis_sizes))


def _figure_source(plan: StrategyPlan) -> str:
    """Where the plan's deciding HBM figure comes from (StrategyPlan.deciding_hbm_bytes)."""
    return "compiled" if (plan.compiled or {}).get("hbm_bytes") is not None else "estimated"


def _fit_figures(plan: StrategyPlan) -> str:
    """'<n> GB of <hbm> GB per device, compiled', saying so where the figure, XLA's buffers'
    sum or its estimate, is above what the compiler lets a program hold: what it checks is
    the program's peak (results.fits_as_compiled, StrategyPlan.fits)."""
    figures = (f"{gigabytes(plan.deciding_hbm_bytes)} of {gigabytes(plan.hbm_capacity)} per "
               f"device, {_figure_source(plan)}")
    if plan.deciding_fits and plan.deciding_hbm_bytes > plan.hbm_capacity - LOAD_RESERVE_BYTES:
        figures += ("; a sum of XLA's buffers, which are not all alive at once: the TPU "
                    "compiler checks the program's peak (docs/memory.md)")
    return figures


def recommend(plans: list[StrategyPlan]) -> tuple[StrategyPlan | None, str]:
    """Among the plans that fit (StrategyPlan.deciding_fits: compiled figures where there
    are any), the fastest estimated step (StrategyPlan.step_s); within TIE of it, the
    simplest (the strategy class's `simplicity`). If none fits, the one that needs the
    least HBM."""
    if not plans:
        return None, "no strategy applies"
    fitting = [p for p in plans if p.deciding_fits]
    if not fitting:
        best = min(plans, key=lambda p: (p.compile_failed, p.deciding_hbm_bytes))
        return best, (f"none fits in {gigabytes(best.hbm_capacity)}; {best.name} needs the "
                      f"least ({gigabytes(best.deciding_hbm_bytes)} per device, "
                      f"{_figure_source(best)})")
    fastest = min(p.step_s for p in fitting)
    near = [p for p in fitting if p.step_s <= TIE * fastest]
    best = min(near, key=lambda p: STRATEGIES[p.strategy].simplicity)
    bound = "communication" if best.comm_s > best.compute_s else "compute"
    speed = "fastest" if best.step_s == fastest else "near-fastest"
    reason = (f"fits ({_fit_figures(best)}) with the {speed} estimated step "
              f"({bound}-bound, MFU <= {best.mfu_bound:.0%})")
    if len(near) > 1:
        reason += f"; simplest of {', '.join(p.name for p in near)} (within {TIE - 1:.1%})"
    too_big = [p.name for p in plans if not p.deciding_fits and not p.compile_failed]
    if too_big:
        reason += f"; {', '.join(too_big)} would not fit"
    failed = [p.name for p in plans if p.compile_failed]
    if failed:
        reason += f"; the compiler failed on {', '.join(failed)}"
    return best, reason


def put_first(result: Plan, strategy: str) -> StrategyPlan | None:
    """Moves the plan of `strategy` (the recipe's own, where it names one) to the top of
    the table; returns it (None when it does not run on this mesh)."""
    own = next((p for p in result.plans if p.strategy == strategy and p.kinds is None), None)
    if own is not None:
        result.plans.remove(own)
        result.plans.insert(0, own)
    return own


def against_recipe(result: Plan, strategy: str) -> str:
    """One line: whether to keep the recipe's own strategy, and what switching to the
    recommendation would gain or cost in memory and estimated step time. Where the
    recipe's own fits and nothing that fits is estimated faster by STEP_TIME_ERROR or more,
    the recipe's own becomes the recommendation: a smaller difference is the estimate's
    noise, not a reason to move a user off the strategy they named."""
    own = put_first(result, strategy)
    if own is None:
        why = result.skipped.get(strategy, "not a candidate on this mesh")
        return f"the recipe's {strategy} does not run here ({why}); set parallel.strategy"
    best = result.choice
    if best is None or best is own:
        return f"the recipe's {own.name} is the recommendation: keep it"
    change = _switching(own, best)
    if own.deciding_fits and not _clearly_faster_than(own, result.plans):
        result.choice, result.reason = own, _kept_reason(own)
        return (f"the recipe's {own.name} is kept: parallel.strategy={best.strategy}, the "
                f"pick by estimate, would take {change}, a difference under the step "
                f"estimate's error ({STEP_TIME_ERROR:.0%})")
    fits = ("" if own.deciding_fits else
            f", which does not fit ({gigabytes(own.deciding_hbm_bytes)} per device)")
    return (f"the recipe runs {own.name}{fits}; parallel.strategy={best.strategy} would take "
            f"{change}")


def _switching(own: StrategyPlan, other: StrategyPlan) -> str:
    """'<n> GB per device less, an estimated step <x>% slower': moving from own to other."""
    memory = other.deciding_hbm_bytes - own.deciding_hbm_bytes
    speed = own.step_s / other.step_s - 1
    return (f"{gigabytes(abs(memory))} per device {'more' if memory > 0 else 'less'}, an "
            f"estimated step {abs(speed):.1%} {'faster' if speed >= 0 else 'slower'}")


def _clearly_faster_than(own: StrategyPlan, plans: list[StrategyPlan]) -> bool:
    """Whether a plan that fits has an estimated step faster than own's by at least the
    step estimate's error."""
    fastest = min(p.step_s for p in plans if p.deciding_fits)
    return own.step_s >= (1 + STEP_TIME_ERROR) * fastest


def _kept_reason(own: StrategyPlan) -> str:
    return (f"the recipe's own: it fits ({_fit_figures(own)}), and no strategy that fits has "
            f"an estimated step faster by {STEP_TIME_ERROR:.0%} or more, the step estimate's "
            f"error")


def candidates(recipe: Recipe, axis_sizes: dict[str, int], platform: str = "tpu"
               ) -> tuple[list[tuple[str, int]], dict[str, str]]:
    """[(strategy, ulysses degree)] the mesh allows, simplest first, and why the others
    are left out."""
    options, skipped = [], {}
    for strategy in sorted(STRATEGIES.values(), key=lambda cls: cls.simplicity):
        if strategy.name in KIND_ONLY_STRATEGIES:
            continue  # never a whole model's strategy
        try:
            options.append((strategy.name, strategy.planned_ulysses_degree(recipe, axis_sizes)))
        except NotOnThisMesh as why:
            skipped[strategy.name] = str(why)
    if axis_sizes["context"] == 1:
        # One strategy, nothing to weigh it against: the run's own recipe check reports a
        # kernel layout it cannot run.
        return options, skipped
    for strategy, ulysses in options:
        variant = recipe_for_strategy(recipe, strategy, ulysses)
        try:
            check_kernel_layout(variant, axis_sizes,
                                STRATEGIES[strategy].kernel_lengths(variant, axis_sizes), platform)
        except RecipeError as err:  # splash's or (on TPU) Pallas's tiles do not fit
            skipped[strategy] = str(err).removeprefix("recipe key 'attention.impl' = 'splash': ")
    return [(s, u) for s, u in options if s not in skipped], skipped
