"""Failures a user can act on, told in one line: the CLI prints these without a traceback
(`lctrain --debug` shows it). Anything else is a bug and keeps its traceback. Imports
neither jax nor orbax, so the CLI can use it before jax starts."""

from __future__ import annotations

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


def is_out_of_memory(err: BaseException) -> bool:
    """Out of host memory, or of a device's HBM or scoped VMEM (is_scoped_vmem_oom)."""
    if isinstance(err, MemoryError):
        return True
    failure = _xla_failure(err)
    return failure is not None and failure.out_of_memory


def is_scoped_vmem_oom(err: BaseException) -> bool:
    """A Pallas kernel's tiles need more of a TPU core's scoped VMEM (16 MiB on v5e) than it
    has (libtpu's E1001 CompileTimeScopedVmemOom): a tile problem, not HBM."""
    from lctrain.parallel.xla_failures import SCOPED_VMEM_OOM
    failure = _xla_failure(err)
    return failure is not None and failure.kind == SCOPED_VMEM_OOM


def _xla_failure(err: BaseException):
    """parallel/xla_failures.classify(err), imported here rather than at the top: the
    parallel package imports jax, which this module must not (the CLI reads it before jax
    starts), and an error that may be XLA's comes from a process that runs jax."""
    from lctrain.parallel.xla_failures import classify
    return classify(err)


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
    figure = device_memory_figure(err)
    return out_of_device_memory(figure, recipe)


def out_of_device_memory(figure: str, recipe=None) -> str:
    """The out-of-memory line around `figure` (what needs how much of what), with the
    changes that lower the need which `recipe` has not made yet."""
    return (f"out of device memory: {figure}. `lctrain plan RECIPE --topology CHIP:SHAPE "
            f"--compile` gives each strategy's memory per device and `--max-seq` the longest "
            f"sequence that fits; {' or '.join(memory_savers(recipe))}")


def memory_savers(recipe=None) -> list[str]:
    """What lowers a step's device memory, leaving out what `recipe` already does."""
    savers = ["lower data.seq_len", "spread the sequence over more chips (mesh.context)"]
    if recipe is None or recipe.remat.tensors.get("decoder_layer_input") != "offload":
        savers.append("offload the layer inputs (remat.policy=custom, "
                      "remat.tensors={decoder_layer_input: offload})")
    if recipe is not None and not recipe.remat.mlp_chunk_tokens:
        savers.append("compute the MLP in chunks (remat.mlp_chunk_tokens, e.g. 8192)")
    return savers


def device_memory_figure(err: BaseException) -> str:
    """What XLA's out-of-memory message says was needed, in GB (its own first line where it
    gives no figure)."""
    from lctrain.parallel.chips import gigabytes
    from lctrain.parallel.xla_failures import classify_message
    failure = classify_message(str(err))
    if failure.needed_bytes is not None:
        need = ("the program's temporaries need" if failure.temporaries_only
                else "the program needs")
        return (f"{need} {gigabytes(failure.needed_bytes)} per device of "
                f"{gigabytes(failure.capacity_bytes)} hbm")
    if failure.allocation_bytes is not None:
        return f"a device could not allocate {gigabytes(failure.allocation_bytes)}"
    return failure.first_line


def explain(err: BaseException) -> tuple[str, int] | None:
    """(one-line message, exit code) for an expected failure; None for a bug. Exit 2 is bad
    input found before anything compiled, exit 1 a run or command that failed."""
    if isinstance(err, (RecipeError, DataError, OutputError)):
        return str(err), 2
    if isinstance(err, RunFailure):
        return str(err), 1
    if isinstance(err, OSError) and err.strerror:
        where = f"{err.filename}: " if err.filename else ""
        return f"{where}{err.strerror}", 1
    if is_out_of_memory(err):
        return out_of_memory_message(err), 1
    return None
