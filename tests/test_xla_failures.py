"""XLA's and libtpu's failures, each wording they are known to use, read by the one module
that the run, the plan, auto and the benchmarks share (parallel/xla_failures.py)."""

import subprocess
import sys

import pytest

from lctrain.parallel import xla_failures
from lctrain.parallel.xla_failures import classify, classify_message
from lctrain.trainer.outputs.failures import explain, is_out_of_memory, is_scoped_vmem_oom

XLA_ERROR = type("JaxRuntimeError", (RuntimeError,), {})
G, M = 2**30, 2**20

# The TPU compiler (llama3.1-8b at 4M tokens on v5p:2x2x1)
USED = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory "
        "space hbm. Used 97.24G of 95.74G hbm. Exceeded hbm capacity by 1.50G.")
# libtpu 0.0.42, refusing before it adds the arguments
TEMPORARIES = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for "
               "HLO temporaries (97.06G) exceeds available HBM (95.74G).")
# A v5e's runtime, loading a program at 131,072 tokens
RUNTIME = ("RESOURCE_EXHAUSTED: E0101: RuntimeProgramAllocationFailure: Error loading program "
           "'jit_train_step': Attempting to allocate 30.01M.")
# XLA:CPU's allocator (a step that asks for 16 TiB)
ALLOCATOR = "RESOURCE_EXHAUSTED: Out of memory allocating 17592186044416 bytes."
SCOPED_VMEM = ("RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom: XLA:TPU compile "
               "permanent error. Ran out of memory in memory space vmem while allocating on "
               "stack for %splash_mha_dq_kernel. Scoped allocation with size 16.02M and "
               "limit 16.00M exceeded scoped vmem limit by 16.00K.")
# libtpu 0.0.50
UNIMPLEMENTED = ("UNIMPLEMENTED: No feasible span count for single input all reduce scatter "
                 "fusion\nand more lines")


def test_the_compilers_whole_need_and_the_chips_hbm():
    failure = classify_message(USED)
    assert failure.kind == xla_failures.HBM_OOM and not failure.temporaries_only
    assert (failure.needed_bytes, failure.capacity_bytes) == (round(97.24 * G), round(95.74 * G))


def test_libtpu_0_0_42s_temporaries_wording():
    failure = classify_message(TEMPORARIES)
    assert failure.kind == xla_failures.HBM_OOM and failure.temporaries_only
    assert (failure.needed_bytes, failure.capacity_bytes) == (round(97.06 * G), round(95.74 * G))


@pytest.mark.parametrize("text, nbytes", [(RUNTIME, round(30.01 * M)),
                                          (ALLOCATOR, 17592186044416),
                                          ("RESOURCE_EXHAUSTED: Attempting to allocate 4.00GiB",
                                           4 * G)])
def test_a_failed_allocation_and_its_size(text, nbytes):
    failure = classify_message(text)
    assert failure.kind == xla_failures.RUNTIME_OOM and failure.needed_bytes is None
    assert failure.allocation_bytes == nbytes


def test_a_runtime_allocation_failure_without_a_size():
    failure = classify_message("RESOURCE_EXHAUSTED: E0101: RuntimeProgramAllocationFailure: "
                               "Error loading program 'jit_train_step'")
    assert failure.kind == xla_failures.RUNTIME_OOM and failure.allocation_bytes is None


def test_scoped_vmem_is_not_hbm():
    failure = classify_message(SCOPED_VMEM)
    assert failure.kind == xla_failures.SCOPED_VMEM_OOM and failure.needed_bytes is None
    assert failure.out_of_memory and failure.recorded == SCOPED_VMEM


def test_a_compiler_failure_is_not_memory_and_is_recorded_as_such():
    failure = classify_message(UNIMPLEMENTED)
    assert failure.kind == xla_failures.COMPILER_FAILED and not failure.out_of_memory
    assert failure.recorded == ("compiler failed: UNIMPLEMENTED: No feasible span count for "
                                "single input all reduce scatter fusion")


def test_out_of_memory_in_words_it_does_not_know():
    assert classify_message("RESOURCE_EXHAUSTED: Ran out of memory on HBM").kind == \
        xla_failures.HBM_OOM
    unknown = classify_message("RESOURCE_EXHAUSTED: too many handles")
    assert unknown.kind == xla_failures.OUT_OF_MEMORY and unknown.out_of_memory
    assert unknown.first_line == "RESOURCE_EXHAUSTED: too many handles"


def test_only_xlas_errors_are_classified():
    assert classify(RuntimeError(USED)) is None
    assert classify(XLA_ERROR(USED)).needed_bytes == round(97.24 * G)
    assert not is_out_of_memory(RuntimeError(USED)) and is_out_of_memory(XLA_ERROR(USED))
    assert is_scoped_vmem_oom(XLA_ERROR(SCOPED_VMEM)) and not is_scoped_vmem_oom(XLA_ERROR(USED))
    assert not is_out_of_memory(XLA_ERROR(UNIMPLEMENTED))


@pytest.mark.parametrize("text, figure", [
    (USED, "the program needs 104.41 GB per device of 102.80 GB hbm"),
    (TEMPORARIES, "the program's temporaries need 104.22 GB per device of 102.80 GB hbm"),
    (RUNTIME, "a device could not allocate 31.5 MB"),
    (ALLOCATOR, "a device could not allocate 17,592.19 GB")])
def test_the_run_tells_each_wording_with_its_figure_in_gb(text, figure):
    message, code = explain(XLA_ERROR(text))
    assert message.startswith(f"out of device memory: {figure}. ") and code == 1


def test_the_failures_module_is_read_without_jax():
    """The CLI imports it before jax starts (XLA_FLAGS, JAX_PLATFORMS): the classifier, in
    the parallel package that imports jax, is imported only once an error needs it."""
    code = ("import sys; import lctrain.trainer.outputs.failures as f; "
            "f.explain(OSError(2, 'No such file', 'x')); print('jax' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.strip() == "False", done.stderr
