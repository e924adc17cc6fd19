"""Building a run: the recipe checked against the devices, the mesh, the strategy (auto
resolved), the train state's shardings and the train step compiled, falling back to the
next candidate while XLA's figure does not fit; the sharded batches it is fed. What `lctrain
run` trains with and what `lctrain plan --compile` measures (compile_train_step, with
libtpu's topology devices: parallel/aot.py)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from rich.console import Console

from lctrain.kernels.tiles import DEFAULT_BLOCK
from lctrain.parallel import (LayerStrategies, attention_blocks, attention_kernels, build_mesh,
                              make_strategy)
from lctrain.parallel.aot import memory_stats
from lctrain.parallel.chips import LOAD_RESERVE_BYTES, compile_options_for
from lctrain.parallel.auto import (CompiledNeed, compiler_failed, compiler_failure,
                                   first_that_fits, none_fits, refused_need,
                                   shortfall, strategy_name)
from lctrain.recipes import Recipe
from lctrain.trainer.data.batches import Batch, DataSource
from lctrain.trainer.model.remat import compiler_options
from lctrain.trainer.outputs.failures import (DoesNotFit, RunFailure, is_out_of_memory,
                                              is_scoped_vmem_oom, kernel_tiles_message,
                                              out_of_device_memory)
from lctrain.trainer.state.device_checks import DevicePlan, allocator_limit, check_devices, \
    device_memory_bytes
from lctrain.trainer.state.step import (BATCH_FIELDS, Trainable, batch_shardings, build_trainable,
                                        make_train_step)


def mesh_for(recipe: Recipe, devices=None, console: Console | None = None,
             evaluating: bool = False) -> Mesh:
    """The recipe's mesh on `devices` (default: all), once the device checks pass
    (device_checks.check_devices: RecipeError before anything compiles)."""
    return resolved_mesh(recipe, devices, console, evaluating)[1]


def resolved_mesh(recipe: Recipe, devices=None, console: Console | None = None,
                  evaluating: bool = False, plan: DevicePlan | None = None
                  ) -> tuple[Recipe, Mesh]:
    """The recipe as it runs on `devices` (default: all), auto replaced by its choice, and
    its mesh, once the device checks pass. `plan` is what they found for this recipe when
    the caller ran them (trainer/train/preflight.py): they then do not run again."""
    devices = jax.devices() if devices is None else devices
    if plan is None or plan.recipe != recipe:
        plan = check_devices(recipe, devices, console, evaluating)
    recipe = plan.recipe
    return recipe, build_mesh(plan.sizes, recipe.parallel.ulysses, devices,
                              recipe.mesh.dcn_sizes())


class CompiledRun(NamedTuple):
    """A run's mesh, strategy and state, and its train step compiled once for them; the
    recipe they were built from (auto resolved, the attention kernel that fitted)."""
    mesh: Mesh
    strategy: LayerStrategies
    trainable: Trainable
    train_step: jax.stages.Compiled
    recipe: Recipe
    report: tuple[str, ...] = ()  # what compiling said: fall-backs, the compiled figure


def compile_run(recipe: Recipe, devices=None, console: Console | None = None,
                memory_limit: int | None = None, plan: DevicePlan | None = None) -> CompiledRun:
    """Builds and compiles the train step of the recipe's strategy (auto: of the planner's
    first choice, then of the next while it does not fit) and prints the compiled figure.
    On a TPU a program fits when XLA compiles it; elsewhere when XLA's figure is within
    `memory_limit` per device, by default the GPU's memory, and none on CPU (fake devices
    share the host's RAM). The run's recipe (CompiledRun.recipe) names the strategy that
    runs; `recipe` itself is left as it is. `plan` is what the device checks found, when
    the caller ran them (trainer/train/preflight.py): they run once per candidate at most."""
    devices = jax.devices() if devices is None else devices
    plan = plan or check_devices(recipe, devices, console)
    platform = devices[0].platform
    if memory_limit is None and platform in ("tpu", "gpu"):
        memory_limit = allocator_limit(devices) or device_memory_bytes(devices)
    # On a TPU the compiler is the check: libtpu refuses a program whose peak exceeds HBM
    # less what loading it needs (chips.LOAD_RESERVE_BYTES), so that is the figure a
    # refusal names. A GPU's compiler checks nothing.
    compared_limit = None if platform == "tpu" else memory_limit
    if platform == "tpu" and memory_limit:
        memory_limit -= LOAD_RESERVE_BYTES

    def compile_candidate(strategy: str, ulysses: int) -> tuple[CompiledRun | None,
                                                                 CompiledNeed]:
        candidate = recipe.with_strategy(strategy, ulysses)
        name = strategy_name(strategy, ulysses)
        start = time.perf_counter()
        try:
            run = build_kernel_that_fits(candidate, devices, console, report.append, plan)
        except Exception as err:  # XLA's TPU compiler refuses a program over HBM
            if not is_out_of_memory(err):
                failed = compiler_failure(name, err)
                if failed is None:
                    raise
                return None, failed
            if memory_limit is None:
                raise
            return None, refused_need(name, str(err))
        need = compiled_need(name, run.train_step, platform)
        need.seconds = time.perf_counter() - start
        return run, need

    report: list[str] = []
    found = first_that_fits(plan.candidates, compile_candidate, compared_limit, report.append)
    if isinstance(found, list):
        print_lines(console, report)
        if all(map(compiler_failed, found)):
            raise RunFailure(f"{shortfall(found[0], None)} (docs/failures.md); name another "
                             f"parallel.strategy, or another data.seq_len")
        raise DoesNotFit(out_of_device_memory(none_fits(found, memory_limit), recipe))
    return found[0]._replace(report=tuple(report))


# What a recipe that left the attention kernel to lctrain falls back to when the chip's
# choice does not fit a core's scoped VMEM: our kernel at the blocks every TPU compiles.
SAFE_ATTENTION = dict(impl="pallas", block_q=DEFAULT_BLOCK, block_kv=DEFAULT_BLOCK)


def build_kernel_that_fits(recipe: Recipe, devices, console: Console | None,
                           say, plan: DevicePlan | None = None) -> CompiledRun:
    """build_run, and on a scoped-VMEM failure (a kernel's tiles, not HBM) either once
    more with SAFE_ATTENTION, where the recipe left the kernel or its blocks unset (the
    CompiledRun's recipe then names it), or a RunFailure naming the kernel and its tiles.
    `plan`: as build_run's."""
    try:
        return build_run(recipe, devices, console, plan=plan)
    except Exception as err:
        if not is_scoped_vmem_oom(err):
            raise
        a = recipe.attention
        tried = (f"{attention_kernels(recipe, devices)} with blocks of "
                 f"{attention_blocks(recipe, devices)}")
        if a.impl != "auto" and a.block_q and a.block_kv:
            raise RunFailure(kernel_tiles_message(tried)) from err
        say(f"{tried} does not fit the chip's scoped VMEM; trying attention.impl=pallas "
            f"with blocks of {DEFAULT_BLOCK}")
        safe = dataclasses.replace(recipe, attention=dataclasses.replace(a, **SAFE_ATTENTION))
        return build_run(safe, devices, console, plan=plan)


def build_run(recipe: Recipe, devices, console: Console | None = None,
              plan: DevicePlan | None = None) -> CompiledRun:
    """The recipe's mesh, strategy and state, and its train step compiled for them (lowered
    with abstract state and batch): what a run trains with, and what `lctrain plan
    --compile` measures (parallel/aot.py). The device checks run unless `plan` holds what
    they found for this very recipe (resolved_mesh)."""
    recipe, mesh = resolved_mesh(recipe, devices, plan=plan)
    strategy = make_strategy(recipe, mesh)
    trainable = build_trainable(recipe, mesh)
    step = make_train_step(recipe, trainable, strategy, mesh)
    device = mesh.devices.flat[0]
    options = compiler_options(recipe, device.platform) | compile_options_for(device)
    compiled = step.lower(trainable.abstract_state, abstract_batch(recipe, mesh)).compile(
        options)
    return CompiledRun(mesh, strategy, trainable, compiled, recipe)


def print_lines(console: Console | None, lines) -> None:
    for line in lines if console else ():
        console.print(line, soft_wrap=True, markup=False)


def compiled_need(name: str, compiled: jax.stages.Compiled, platform: str) -> CompiledNeed:
    """XLA's per-device memory of a compiled program: on a TPU its peak
    (CompiledStats.peak_bytes, what the compiler checked against HBM), elsewhere its
    buffers' sum, which a GPU run compares with the device's memory."""
    stats = memory_stats(compiled)
    held = stats.peak_bytes if platform == "tpu" else stats.hbm_bytes
    return CompiledNeed(name, held, stats.host_temp_bytes + stats.host_argument_bytes)


def device_batch(source: DataSource, index: int, order: np.ndarray | None,
                 mesh: Mesh) -> dict[str, jax.Array]:
    """Global batch `index` as sharded arrays, in the strategy's token order.

    Each process reads only the rows its own devices hold (once per row range, shared by
    every field and sequence shard), so a multi-host job never loads the whole batch.
    """
    shape = (source.cfg.batch_size, source.cfg.seq_len)
    read: dict[tuple[int, int], Batch] = {}

    def rows(row_slice: slice) -> Batch:
        start, stop, _ = row_slice.indices(shape[0])
        if (start, stop) not in read:
            batch = source.batch(index, rows=slice(start, stop))
            read[start, stop] = batch if order is None else Batch(
                *(getattr(batch, name)[:, order] for name in BATCH_FIELDS))
        return read[start, stop]

    shardings = batch_shardings(mesh)
    return {name: jax.make_array_from_callback(
                shape, shardings[name],
                lambda shard, name=name: getattr(rows(shard[0]), name)[:, shard[1]])
            for name in BATCH_FIELDS}


def compile_train_step(recipe: Recipe, devices) -> Any:
    """The compiled train step (jax.stages.Compiled) of `recipe` on `devices`, built and
    lowered with abstract state and batch as the real run does it (build_run)."""
    return build_run(recipe, devices).train_step


def abstract_batch(recipe: Recipe, mesh) -> dict[str, jax.ShapeDtypeStruct]:
    """The batch's shapes, dtypes and shardings, for lowering without data."""
    shape = (recipe.data.batch_size, recipe.data.seq_len)
    shardings = batch_shardings(mesh)
    return {name: jax.ShapeDtypeStruct(shape, jnp.float32 if name == "loss_mask" else jnp.int32,
                                       sharding=shardings[name])
            for name in BATCH_FIELDS}
