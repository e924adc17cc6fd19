"""The longest sequence each strategy fits at: by the estimate, or by compiling."""

from __future__ import annotations

import dataclasses
import functools
import math
from contextlib import nullcontext
from typing import Callable

from lctrain.parallel.chips import Chip
from lctrain.parallel.planner import compiled
from lctrain.parallel.planner.estimate import estimate, recipe_for_strategy
from lctrain.parallel.planner.results import Plan
from lctrain.recipes.schema import Recipe

# Bisection steps of a compiled --max-seq search after the doubling (each is a compile).
COMPILED_BISECT_STEPS = 3


def sequence_quantum(recipe: Recipe, axis_sizes: dict[str, int]) -> int:
    """Step between sequence lengths the recipe accepts on this mesh (divisible by 2 x
    context with load balancing) and the kernels block evenly (multiples of 128)."""
    c = axis_sizes["context"]
    chunks = 2 * c if recipe.parallel.load_balance and c > 1 else c
    return math.lcm(chunks, 128)


def max_fitting(fits: Callable[[int], bool], quantum: int, limit: int = 2**27,
                bisect_steps: int | None = None, start: int | None = None) -> int:
    """Longest multiple of `quantum` for which `fits` holds (0 if none does), assuming
    `fits` is monotone (true up to some length, false beyond): power-of-two steps from
    `start` (default: the smallest power-of-two multiple of `quantum`; doubling while it
    fits, halving while it does not), then bisection between the last length that fit and
    the first that did not (down to `quantum`, or `bisect_steps` halvings of the gap)."""
    first = quantum
    while first & (first - 1):      # the smallest power of two that quantum divides
        first += quantum
    point = first
    if start is not None:
        while point * 2 <= min(start, limit):
            point *= 2
    if fits(point):
        lo = point
        while lo * 2 <= limit and fits(lo * 2):
            lo *= 2
        hi = lo * 2
        if hi > limit:
            return lo
    else:
        hi = point
        while hi > first and not fits(hi // 2):
            hi //= 2
        lo = hi // 2 if hi > first else 0
    steps = 0
    while hi - lo > quantum and (bisect_steps is None or steps < bisect_steps):
        mid = (lo + hi) // 2 // quantum * quantum
        if mid <= lo:
            break
        if fits(mid):
            lo = mid
        else:
            hi = mid
        steps += 1
    return lo


def with_seq_len(recipe: Recipe, seq_len: int) -> Recipe:
    return dataclasses.replace(recipe, data=dataclasses.replace(recipe.data, seq_len=seq_len))


def max_seq_len(recipe: Recipe, axis_sizes: dict[str, int], chip: Chip, strategy: str,
                ulysses: int = 1, platform: str = "tpu", devices=None,
                compile_step: compiled.CompileStep | None = None,
                bisect_steps: int | None = None,
                timed: compiled.Timer = lambda _: nullcontext(), use_cache: bool = True) -> int:
    """Longest sequence (a multiple of sequence_quantum) this strategy fits at, from the
    estimate, or by compiling with `compile_step` when `devices` (a TPU topology) are given
    (each length's figures cached as `plan --compile` caches them)."""
    variant = recipe_for_strategy(recipe, strategy, ulysses)

    def fits(seq_len: int) -> bool:
        candidate = with_seq_len(variant, seq_len)
        if devices is not None:
            figures = compiled.cached_figures(
                candidate, devices, compile_step, f"compiled {variant.parallel.strategy}, seq {seq_len:,}",
                timed, use_cache)
            return compiled.compiled_fits(figures, chip)
        return estimate(candidate, axis_sizes, chip, strategy, ulysses, platform).fits

    quantum = sequence_quantum(recipe, axis_sizes)
    start = None
    if devices is not None:        # start the compiles where the estimate ends
        start = max_seq_len(recipe, axis_sizes, chip, strategy, ulysses, platform)
    return max_fitting(fits, quantum, bisect_steps=bisect_steps, start=start)


def longest_sequences(result: Plan, recipe: Recipe, platform: str = "tpu",
                      devices=None, compile_step: compiled.CompileStep | None = None,
                      timed: compiled.Timer = lambda _: nullcontext(),
                      use_cache: bool = True) -> dict[str, dict[str, int]]:
    """{strategy name: {"estimated": longest sequence, "compiled": ... (with `devices`)}}
    for every plan of `result`."""
    longest = {}
    for p in result.plans:
        search = functools.partial(max_seq_len, recipe, result.axis_sizes, result.chip,
                                   p.strategy, p.ulysses, platform)
        longest[p.name] = {"estimated": search()}
        if devices is not None:
            longest[p.name]["compiled"] = search(devices, compile_step,
                                                 bisect_steps=COMPILED_BISECT_STEPS,
                                                 timed=timed, use_cache=use_cache)
    return longest
