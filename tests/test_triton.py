"""The GPU kernel (kernels/triton.py) where no GPU is needed: its numbers are checked in
interpret mode beside the TPU kernel (tests/test_pallas.py, tests/test_window.py); here,
that every strategy's attention lowers for CUDA to our three Triton kernels and nothing
slower, and that a recipe that cannot run it stops before compiling.
"""

import re
from types import SimpleNamespace
from unittest import mock

import jax
import numpy as np
import pytest

from kernel_harness import KernelCase, kernel_call_names
from lctrain.trainer.train.runtime import jaxlib_at_least
from lctrain.kernels import triton
from lctrain.parallel import STRATEGIES, attention_kernels
from lctrain.recipes import load_recipe
from lctrain.recipes.schema import RecipeError
from lctrain.trainer.state.device_checks import kernel_note
from test_halo import B, SEQ, grads_of, inputs, strategy_for

TRITON_KERNELS = {"lctrain_triton_fwd", "lctrain_triton_dq", "lctrain_triton_dkv"}


def test_impl_triton_calls_our_forward_dq_and_dkv_kernels():
    case = KernelCase(impl="triton", b=2, s=96, hq=8, d=16, block=32)
    assert kernel_call_names("triton", case) == TRITON_KERNELS


def test_tiles_are_powers_of_two_dividing_the_length():
    assert [triton.tile(n, 128) for n in (4096, 96, 48, 8192 + 64)] == [128, 32, 16, 64]
    assert triton.tile(96, 64) == 32


def lowered_for_cuda(fn, *args) -> str:
    """StableHLO of jit(fn) lowered for CUDA on this CPU host. jax 0.12 asks the device
    which GPU the Triton kernels are for; it is told an H200 (private jax names, tests
    only: jax's public way, an abstract mesh, is replaced by the strategy's CPU mesh
    inside shard_map)."""
    trace = jax.jit(fn).trace(*args)
    if not jaxlib_at_least(0, 12):
        return trace.lower(lowering_platforms=("cuda",)).as_text()
    from jax._src.pallas.triton import gpu_info
    h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    with mock.patch.object(gpu_info, "get_gpu_info", lambda: h200):
        return trace.lower(lowering_platforms=("cuda",)).as_text()


def dot_result_shapes(hlo: str) -> list[tuple[int, ...]]:
    return [tuple(map(int, dims.split("x")[:-1]))
            for dims in re.findall(r"stablehlo\.dot_general .*-> tensor<([0-9x]+[a-z0-9]+)>", hlo)]


# Every strategy with attention on 4 devices; halo with its window (sliding layers only).
LOWERED = [("all_gather", [], None), ("ulysses", [], None), ("ring", [], None),
           ("usp", ["parallel.ulysses=2"], None), ("halo", [], 8)]


@pytest.mark.parametrize("name, extra, window", LOWERED, ids=[c[0] for c in LOWERED])
def test_every_strategy_lowers_to_the_triton_kernels_for_cuda(name, extra, window):
    """Forward and backward of the strategy's attention on a GPU (the kernel options say
    gpu, as a mesh of GPUs would): Triton custom calls of our three kernels, and no
    matmul of scores outside them. Outside, only row dots remain (out . dout per row:
    [b, h, s] results); the blockwise xla kernel's score blocks would be rank 5."""
    strategy = strategy_for(name, 4, True, "triton", extra)
    strategy.kernel_options["platform"] = "gpu"
    q, k, v, dout, segment_ids = inputs()
    positions = np.broadcast_to(np.arange(SEQ, dtype=np.int32), (B, SEQ))

    def attend(q, k, v, segment_ids):
        return strategy.attend(q, k, v, positions, segment_ids, window=window)

    hlo = lowered_for_cuda(lambda q, k, v: grads_of(attend, q, k, v, dout, segment_ids),
                           q, k, v)
    assert set(re.findall(r'name = "(lctrain_triton_\w+)"', hlo)) == TRITON_KERNELS
    assert hlo.count("xla.gpu.triton") >= 3
    assert max(map(len, dot_result_shapes(hlo))) == 3


def test_triton_is_refused_on_tpu_and_where_its_tiles_do_not_fit():
    recipe = load_recipe("tiny", ["attention.impl=triton", "data.seq_len=1000",
                                  "parallel.strategy=ring", "mesh.context=4", "mesh.data=1"])
    sizes = {"data": 1, "fsdp": 1, "context": 4, "ulysses": 1, "tensor": 1}
    with pytest.raises(RecipeError, match="attention.impl' = 'triton'.*NVIDIA GPU kernel"):
        STRATEGIES["ring"].check(recipe, sizes, "tpu")
    with pytest.raises(RecipeError, match="250 tokens.*multiple of 64"):
        STRATEGIES["ring"].check(recipe, sizes, "gpu")
    STRATEGIES["ring"].check(recipe, sizes, "cpu")  # interpret mode takes any length


def test_a_gpu_run_says_when_it_is_not_on_the_fused_kernel():
    assert "attention.impl=triton is the fused GPU kernel" in kernel_note("auto", "gpu")
    assert kernel_note("triton", "gpu") is None
    assert "interpret mode" in kernel_note("triton", "cpu")
    assert kernel_note("auto", "tpu") is None


@pytest.mark.parametrize("impl, platform, want", [
    ("auto", "tpu", "auto: sliding pallas, global splash"), ("auto", "gpu", "auto: xla"),
    ("triton", "gpu", "triton"), ("xla", "cpu", "xla"), ("auto", "cpu", "auto: xla")])
def test_a_run_names_the_kernel_each_layer_kind_got(impl, platform, want):
    """The run's first line: splash has no window, so auto gives sliding layers the Pallas
    kernel on TPU; GPUs run xla unless triton is asked for."""
    recipe = load_recipe("tiny", [
        f"attention.impl={impl}", "data.seq_len=4096", "mesh.context=4", "mesh.data=1",
        "parallel.strategy={global: ring, sliding: halo}", "model.layers=2",
        "model.layer_pattern=[{kind: sliding, count: 1, window: 512}, {kind: global}]"])
    devices = [SimpleNamespace(platform=platform, slice_index=0,
                               device_kind=f"{platform} of no measured generation")] * 4
    assert attention_kernels(recipe, devices) == want
