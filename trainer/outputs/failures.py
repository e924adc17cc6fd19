"""Failures a user can act on, told in one line: the CLI prints these without a traceback
(`lctrain --debug` shows it). Anything else is a bug and keeps its traceback. Imports
neither jax nor orbax, so the CLI can use it before jax starts."""

from __future__ import annotations

import re

from lctrain.recipes.schema import RecipeError
from lctrain.trainer.outputs.files import OutputError


class DataError(ValueError):
    """Bad data; the message names the file, what is wrong with it and how to fix it."""


class RunFailure(RuntimeError):
    """A run or command stopped for a reason outside the code: exit 1, one line."""


class CheckpointError(RunFailure):
    """A checkpoint that orbax could not read."""


class DoesNotFit(RunFailure):
    """No candidate strategy's compiled train step fits in device memory (the message comes
    from out_of_device_memory)."""


# XLA's out-of-memory messages: the TPU compiler's ("Ran out of memory in memory space hbm.
# Used 97.24G of 95.74G hbm. Exceeded hbm capacity by 1.50G.") and the allocators' at run
# time ("Out of memory allocating 17592186044416 bytes.", "Attempting to allocate 4.00G").
_COMPILER_OOM = re.compile(r"Used (\S+) of (\S+) (\w+)")
_ALLOCATOR_OOM = re.compile(r"(?:allocating|allocate) (\d+ bytes|[\d.]+\s?[KMGT]i?B?)")


def is_out_of_memory(err: BaseException) -> bool:
    """Out of host memory, or of a device's HBM or scoped VMEM (is_scoped_vmem_oom)."""
    return isinstance(err, MemoryError) or (
        type(err).__name__ in ("JaxRuntimeError", "XlaRuntimeError")
        and "RESOURCE_EXHAUSTED" in str(err))


def is_scoped_vmem_oom(err: BaseException) -> bool:
    """A Pallas kernel's tiles need more of a TPU core's scoped VMEM (16 MiB on v5e) than it
    has (libtpu's E1001 CompileTimeScopedVmemOom): a tile problem, not HBM."""
    return is_out_of_memory(err) and "ScopedVmemOom" in str(err)


def kernel_tiles_message(kernel: str) -> str:
    """The line for a scoped-VMEM failure; `kernel` names the kernel and its tiles."""
    return (f"the attention kernel's tiles do not fit the chip's scoped VMEM (a kernel tile "
            f"problem, not HBM): {kernel}; pin smaller blocks (attention.block_q / "
            f"attention.block_kv, e.g. 512), or attention.impl=pallas")


def out_of_memory_message(err: BaseException, recipe=None) -> str:
    """The per-device figure XLA gave, and where to find a configuration that fits (advice
    for the recipe as it stands, when given)."""
    if isinstance(err, MemoryError):
        return ("out of host memory (RAM); lower data.batch_size or data.seq_len, or run "
                "on more hosts")
    if is_scoped_vmem_oom(err):
        return kernel_tiles_message("the recipe's attention.impl and blocks")
    text = str(err)
    if used := _COMPILER_OOM.search(text):
        figure = (f"the program needs {_in_gb(used.group(1))} per device of "
                  f"{_in_gb(used.group(2))} {used.group(3)}")
    elif wanted := _ALLOCATOR_OOM.search(text):
        figure = f"a device could not allocate {_in_gb(wanted.group(1))}"
    else:
        figure = text.strip().splitlines()[0][:200]
    return out_of_device_memory(figure, recipe)


def out_of_device_memory(figure: str, recipe=None) -> str:
    """The out-of-memory line around `figure` (what needs how much of what), with the
    changes that lower the need which `recipe` has not made yet."""
    return (f"out of device memory: {figure}. `lctrain plan RECIPE --topology CHIP:SHAPE "
            f"--compile` gives each strategy's memory per device and `--max-seq` the longest "
            f"sequence that fits; {' or '.join(memory_savers(recipe))}")


def memory_savers(recipe=None) -> list[str]:
    """What lowers a step's device memory, leaving out what `recipe` already does."""
    savers = ["lower data.seq_len", "raise mesh.context"]
    if recipe is None or recipe.remat.tensors.get("decoder_layer_input") != "offload":
        savers.append("offload the layer inputs (remat.policy=custom, "
                      "remat.tensors={decoder_layer_input: offload})")
    if recipe is not None and not recipe.remat.mlp_chunk_tokens:
        savers.append("compute the MLP in chunks (remat.mlp_chunk_tokens, e.g. 8192)")
    return savers


def _in_gb(amount: str) -> str:
    """XLA's amount ("97.24G", binary units like all its messages, or "4096 bytes") in
    decimal GB, the one unit lctrain shows memory in."""
    if amount.endswith(" bytes"):
        nbytes = float(amount.split()[0])
    else:
        number, unit = re.fullmatch(r"([\d.]+)\s?([KMGT]?)i?B?", amount).groups()
        nbytes = float(number) * 1024 ** (" KMGT".index(unit or " "))
    return f"{nbytes / 1e9:,.2f} GB"


def explain(err: BaseException) -> tuple[str, int] | None:
    """(one-line message, exit code) for an expected failure; None for a bug. Exit 2 is bad
    input found before anything compiled, exit 1 a run or command that failed."""
    if isinstance(err, (RecipeError, DataError, OutputError)):
        return str(err), 2
    if isinstance(err, RunFailure):
        return str(err), 1
    if is_out_of_memory(err):
        return out_of_memory_message(err), 1
    if isinstance(err, OSError) and err.strerror:
        where = f"{err.filename}: " if err.filename else ""
        return f"{where}{err.strerror}", 1
    return None
