"""`lctrain` commands. Kept thin: parse arguments, load the recipe, hand over.

jax is imported only after the recipe is read, because `runtime.cpu_devices` must reach
XLA_FLAGS before jax initialises its backends.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Optional

import typer

from lctrain.recipes import RecipeError, load_recipe, named_strategy
from lctrain.trainer.train.runtime import start

from . import models, tokenize  # noqa: F401  registers their commands
from .common import (COORDINATOR, DEBUG, NUM_PROCESSES, PROCESS_ID, SETS, app, attempt, console,
                     default_run_dir, error_console, fail, versions_line, wide_console)


def _print_version(asked: bool) -> None:
    if asked:
        typer.echo(versions_line())
        raise typer.Exit()


@app.callback()
def main(
    debug: bool = typer.Option(
        False, "--debug", envvar="LCTRAIN_DEBUG",
        help="Show the Python traceback of expected failures too (out of memory, "
             "unreadable checkpoints or files), not just their one line."),
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True,
        help="Print the versions of lctrain, jax, jaxlib and libtpu, and exit."),
) -> None:
    """Long-context language-model training with context parallelism."""
    DEBUG.enabled = debug


@app.command()
def run(
    recipe: Optional[str] = typer.Argument(
        None, help="Recipe YAML file or built-in recipe name (default: the run dir's recipe, "
                   "else the built-in 'quickstart')."),
    set_: list[str] = SETS,
    steps: Optional[int] = typer.Option(None, help="Shorthand for --set train.steps=N."),
    run_dir: Optional[Path] = typer.Option(
        None, help="Checkpoints, metrics and TensorBoard events (default: runs/<recipe name>). "
                   "A run dir with checkpoints is resumed."),
    init_from: Optional[str] = typer.Option(
        None, "--init-from", metavar="RUN_DIR[:STEP]",
        help="Start a new stage from another run's checkpoint (its latest, or STEP): its "
             "parameters, restored into this run's mesh; step, data and learning-rate "
             "schedule start at 0. Ignored when --run-dir already has checkpoints (it "
             "resumes)."),
    init_optimizer: bool = typer.Option(
        False, "--init-optimizer",
        help="With --init-from: bring AdamW's moments too, instead of a fresh optimizer."),
    coordinator: Optional[str] = COORDINATOR,
    num_processes: Optional[int] = NUM_PROCESSES,
    process_id: Optional[int] = PROCESS_ID,
) -> None:
    """Train a model from a recipe, resuming from the run dir's latest checkpoint. One run
    at a time per run dir; Ctrl-C or SIGTERM saves a checkpoint, then exits (Ctrl-C 130, SIGTERM 0)."""
    overrides = list(set_) + ([f"train.steps={steps}"] if steps is not None else [])
    if init_optimizer and not init_from:
        fail("--init-optimizer brings the optimizer state of --init-from's run; give "
             "--init-from RUN_DIR[:STEP] too, or drop it")
    run_dir = run_dir or default_run_dir(recipe)
    # As eval does: a run dir is resumed with its own recipe unless given another. Read as
    # written (not load_run_recipe's, which drops model.init): a run with no checkpoint yet
    # must start from model.init's weights.
    own = run_dir / "recipe.yaml"
    loaded = attempt(lambda: load_recipe(own if recipe is None and own.is_file() else recipe,
                                         overrides))
    start(loaded.runtime.cpu_devices, coordinator, num_processes, process_id)
    from lctrain.trainer.train.init_from import InitFrom
    from lctrain.trainer.train.loop import train

    stage = InitFrom.parse(init_from, init_optimizer) if init_from else None
    attempt(lambda: train(loaded, run_dir, console, init_from=stage))


@app.command()
def plan(
    recipe: Optional[str] = typer.Argument(
        None, help="Recipe YAML file or built-in recipe name (default: the built-in 'quickstart')."),
    topology: str = typer.Option(
        ..., help="Chips and their shape, e.g. v5p:4x4x4 or tpu7x:2x2x1 (the mesh's -1 axis "
                  "fills the chip count)."),
    slices: int = typer.Option(
        1, "--slices", min=1, help="Slices of that topology joined over the data-center "
                                   "network (multi-slice; mesh.dcn_data x mesh.dcn_fsdp must "
                                   "equal it)."),
    set_: list[str] = SETS,
    compile_: bool = typer.Option(
        False, "--compile", help="Also compile every strategy for the topology (libtpu, no TPU "
                                 "needed) and show XLA's per-device figures beside the estimate."),
    max_seq: bool = typer.Option(
        False, "--max-seq", help="Longest sequence that fits per strategy (estimated; with "
                                 "--compile, by compiling)."),
    no_cache: bool = typer.Option(
        False, "--no-cache", help="Compile again even where compiled figures for the same "
                                  "recipe, topology and versions are cached."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Per-device memory, communication and step time of each context-parallel strategy,
    the recipe's own first, and a recommendation (per device: a TPU7x chip is two). A
    recipe's own strategy that fits stays the recommendation unless another's estimated
    step is faster by the estimate's error (15%) or more."""
    from lctrain.parallel import planner

    own, loaded, chip = _recipe_and_chip(recipe, set_, topology)
    sizes = _mesh_sizes(loaded, topology, slices, chip)
    result = planner.plan(loaded, chip, sizes, chip.platform)
    devices = None
    if compile_:
        if chip.platform != "tpu":
            fail(f"--compile needs a TPU topology (libtpu), got '{topology}'")
        devices = _attach_compiled(result, loaded, topology, slices, no_cache)
    longest = (planner.longest_sequences(result, loaded, chip.platform, devices,
                                         _compile_train_step() if compile_ else None,
                                         _compile_timer, use_cache=not no_cache)
               if max_seq else None)
    own_line = (planner.against_recipe(result, own)
                if isinstance(own, str) and own not in ("auto", "none") else None)
    if as_json:
        _print_plan_json(result, own, own_line, longest)
        return
    from .plan_render import plan_title, render, render_max_seq

    wide = wide_console()
    render(result, wide, own_line, title=plan_title(loaded, topology, slices, sizes))
    if max_seq:
        render_max_seq(longest, wide)


def _recipe_and_chip(recipe: Optional[str], sets: list[str], topology: str):
    """The recipe's own strategy, the recipe to plan and one device's share of the chip.

    The plan weighs every strategy, so the recipe's own choice must not rule out a context
    axis (strategy 'none' would): the recipe's strategy is shown first instead. A map of
    layer kinds given with --set stays (it may fix some kinds)."""
    from lctrain.parallel import chips

    try:
        own = named_strategy(recipe, sets)
        weigh_all = ["parallel.strategy=auto"]
        loaded = load_recipe(recipe, [*weigh_all, *sets,
                                      *(weigh_all if isinstance(own, str) else [])])
        return own, loaded, chips.chip_named(topology).per_device()
    except (RecipeError, ValueError) as err:
        fail(str(err))


def _mesh_sizes(loaded, topology: str, slices: int, chip) -> dict[str, int]:
    """The recipe's mesh on `slices` slices of `topology`; fails with one line when the
    topology, its slices or the mesh do not go together."""
    from lctrain.parallel import chips
    from lctrain.recipes import check_against_devices

    try:
        count = chips.topology_device_count(topology) * slices
    except (ValueError, IndexError):
        fail(f"--topology '{topology}' must look like chip:AxBxC, e.g. v5p:4x4x4")
    if slices > 1 and chip.dcn_bytes_per_s is None:
        fail(f"--slices {slices}: no data-center network bandwidth is known for {chip.name} "
             f"(parallel/chips.py); plan one slice, or a {chips.multi_slice_chips()} topology")
    try:
        return check_against_devices(loaded, count, slices)
    except RecipeError as err:
        fail(str(err))


def _compile_timer(label: str):
    """Times one compile on stderr, so --json's stdout stays JSON."""
    from lctrain.trainer.outputs.progress import timed

    return timed(error_console, label)


def _compile_train_step():
    """The trainer's compile, imported only when a plan compiles: it imports jax."""
    from lctrain.trainer.state.build import compile_train_step

    return compile_train_step


def _attach_compiled(result, loaded, topology: str, slices: int, no_cache: bool):
    """XLA's figures for every strategy, compiled ahead of time for the topology (libtpu on
    this machine's CPU); returns the topology's devices."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from lctrain.parallel import aot, planner

    try:
        devices = aot.topology_devices(topology, slices)
    except (RuntimeError, ValueError) as err:
        fail(str(err))
    planner.attach_compiled(
        result, loaded, devices, _compile_train_step(), timed=_compile_timer,
        use_cache=not no_cache,
        make_devices=functools.partial(aot.topology_devices, topology, slices))
    return devices


def _print_plan_json(result, own, own_line: str | None, longest: dict | None) -> None:
    import json

    out = {**result.as_json(), "recipe_strategy": own, "against_recipe": own_line}
    if longest is not None:
        out["max_seq_len"] = longest
    typer.echo(json.dumps(out, indent=2))


if __name__ == "__main__":
    app()
