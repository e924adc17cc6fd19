"""The device half of a recipe's second check phase: what the recipe asks of the devices it
is given, checked before anything is built or compiled.

Phase 1 (recipes.load_recipe) checks what a recipe says on its own, without jax. Phase 2
(trainer/train/preflight.py for `lctrain run`) checks it against the files it names and the
machine; `check_devices` below is its device part, which every command that builds a mesh
(run, eval, export, plan --compile) goes through. Each check that belongs to one strategy
stays in that strategy's file (ContextStrategy.check) and is called from here only.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import jax
from rich.console import Console

from lctrain.parallel import strategy_classes
from lctrain.parallel.auto import resolve_auto
from lctrain.parallel.chips import chip_for_device_kind
from lctrain.parallel.mesh import slice_count
from lctrain.recipes import Recipe, RecipeError, check_against_devices
from lctrain.recipes.schema import require
from lctrain.trainer.model.remat import layer_input_pieces, tpu_compiler_settings


class DevicePlan(NamedTuple):
    """What the device checks found: the mesh's axis sizes, the strategies to try, best
    first (auto's ranking, else the recipe's own), and the recipe they checked: the one
    given, with auto replaced by its first choice."""
    sizes: dict[str, int]
    candidates: list[tuple[str, int]]
    recipe: Recipe


def check_devices(recipe: Recipe, devices=None, console: Console | None = None,
                  evaluating: bool = False) -> DevicePlan:
    """RecipeError unless the recipe runs on `devices` (default: all): their count and
    slices, auto's choice (printed; the plan's recipe names it, `recipe` is left as it
    is), each strategy's own limits on this platform, host memory for offload and libtpu's
    limit on one offloaded piece. Evaluation (`evaluating`, or
    eval.every in training) is checked at eval.seq_len."""
    devices = jax.devices() if devices is None else devices
    sizes = check_against_devices(recipe, len(devices), slice_count(devices))
    recipe, choice = resolve_auto(recipe, sizes, devices, device_memory_bytes(devices))
    if choice:  # the mesh's checks of the strategy chosen (auto itself passes them by)
        check_against_devices(recipe, len(devices), slice_count(devices))
    if choice and console:
        console.print(choice.sentence, soft_wrap=True, markup=False)
    platform = devices[0].platform
    for note in (kernel_note(recipe.attention.impl, platform),
                 *tpu_compiler_notes(recipe, platform)):
        if note and console:
            console.print(f"note: {note}", markup=False, soft_wrap=True)
    _check_strategies(recipe, sizes, platform, evaluating)
    check_host_memory(recipe, memory_kinds(devices))
    if not evaluating:  # a forward alone saves nothing for a backward, offloads nothing
        check_offload_piece(recipe, sizes, platform)
    return DevicePlan(sizes, choice.ranked if choice
                      else [(recipe.parallel.strategy, recipe.parallel.ulysses)], recipe)


def _check_strategies(recipe: Recipe, sizes: dict[str, int], platform: str,
                      evaluating: bool) -> None:
    classes = dict.fromkeys(strategy_classes(recipe).values())
    if not evaluating:
        for strategy in classes:
            strategy.check(recipe, sizes, platform)
    if evaluating or recipe.eval.every:
        try:
            for strategy in classes:
                strategy.check(recipe.for_evaluation(), sizes, platform)
        except RecipeError as err:  # the checks name data's keys; evaluation reads eval's
            if recipe.eval.seq_len is None:
                raise
            raise RecipeError(str(err).replace("data.seq_len", "eval.seq_len")) from None


def tpu_compiler_notes(recipe: Recipe, platform: str) -> list[str]:
    """What the remat keys that are options of XLA's TPU compiler
    (trainer/model/remat.tpu_compiler_settings) do off a TPU: nothing."""
    if platform == "tpu":
        return []
    return [f"{key} changes nothing on {platform} (it is about XLA's TPU compiler)"
            for key in tpu_compiler_settings(recipe.remat)]


def kernel_note(impl: str, platform: str) -> str | None:
    """What the user should know about the attention kernel `impl` on `platform`, if any:
    never a silent fallback to a slower kernel."""
    if platform == "cpu" and impl in ("pallas", "splash", "triton"):
        return (f"attention.impl={impl} runs in Pallas interpret mode on CPU: exact but slow "
                f"(attention.impl=auto takes xla here)")
    if platform == "gpu" and impl != "triton":
        return (f"attention.impl={impl} runs the blockwise XLA kernel on GPU; "
                f"attention.impl=triton is the fused GPU kernel (not yet timed on a GPU, so "
                f"auto does not pick it)")
    return None


def check_host_memory(recipe: Recipe, kinds: set[str]) -> None:
    """Host offload (remat.tensors ... offload, optimizer.offload) needs devices with a
    'pinned_host' memory (TPU, GPU and CPU have one); `kinds` are the devices' memories."""
    if "pinned_host" in kinds:
        return
    listed = ", ".join(sorted(kinds))
    require(not recipe.optimizer.offload, "optimizer.offload", True,
            f"these devices have no pinned_host memory (only {listed}); set it to false")
    offloaded = [name for name, where in recipe.remat.tensors.items() if where == "offload"]
    if offloaded:
        require(False, f"remat.tensors.{offloaded[0]}", "offload",
                f"these devices have no pinned_host memory (only {listed}); use remat or "
                f"device")


def check_offload_piece(recipe: Recipe, sizes: dict[str, int], platform: str) -> None:
    """On TPU, an offloaded layer input goes to the host in pieces
    (trainer/model/remat.layer_input_pieces), each under libtpu's limit."""
    if platform != "tpu":
        return
    d, t = recipe.data, recipe.train
    rows = d.batch_size // (sizes["data"] * sizes["fsdp"] * t.grad_accum_steps)
    tokens = d.seq_len // sizes["context"]
    require(layer_input_pieces(recipe, rows, tokens) is not None, "data.seq_len", d.seq_len,
            f"offloads layer inputs of {rows} row(s) x {tokens:,} tokens per chip, which no "
            f"slicing of d_model keeps under libtpu's 4 GiB; spread the sequence over more "
            f"chips (mesh.context), shorten it, or put fewer rows on a chip (data.batch_size, "
            f"train.grad_accum_steps)")


def memory_kinds(devices) -> set[str]:
    """Memory kinds of this process's devices (TPU, GPU, CPU: device and pinned_host)."""
    return {memory.kind for memory in (_local(devices) or list(devices))[0].addressable_memories()}


def device_memory_bytes(devices) -> int:
    """Memory of one device: the chip's HBM (from the chip table, or the allocator's limit),
    else a share of this host's RAM (CPU devices)."""
    chip = chip_for_device_kind(devices[0].device_kind)
    if chip:
        return int(chip.hbm_bytes)
    return allocator_limit(devices) or (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                                        // max(len(_local(devices)), 1))


def allocator_limit(devices) -> int | None:
    """What one device's allocator may hand out (memory_stats' bytes_limit), where the
    platform reports it: on a GPU, the share jax preallocates."""
    local = _local(devices)
    stats = local[0].memory_stats() if local else None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def _local(devices) -> list:
    return [d for d in devices if d.process_index == jax.process_index()]
