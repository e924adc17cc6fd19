"""Phase 2 of the checks (trainer/train/preflight.py): a run's files and devices are checked
before anything is built or compiled, in a fixed order, and each failure names its key."""

import dataclasses

import jax
import pytest

from lctrain.recipes import RecipeError, load_recipe
from lctrain.trainer.model.remat import layer_input_pieces
from lctrain.trainer.state import device_checks
from lctrain.trainer.train import loop
from lctrain.trainer.train.preflight import check_run


@pytest.fixture
def nothing_compiles(monkeypatch):
    """A train() that reaches the compile has let a bad recipe through its checks."""
    def refuse(*args, **kwargs):
        raise AssertionError("compile_run reached: the checks let the recipe through")

    monkeypatch.setattr(loop, "compile_run", refuse)


def test_a_retrieval_eval_too_short_for_its_sample_stops_the_run_before_compiling(
        tmp_path, nothing_compiles):
    # Caught before: at the first evaluation, after eval.every steps of training.
    recipe = load_recipe("tiny", ["model.vocab=300", "eval.task=passkey", "eval.every=10",
                                  "eval.seq_len=32", "eval.lengths=1", "data.seq_len=256"])
    with pytest.raises(RecipeError, match="eval.seq_len: 32 tokens cannot hold a passkey"):
        loop.train(recipe, tmp_path / "run", devices=jax.devices()[:1])
    assert not (tmp_path / "run").exists()


def test_the_files_are_checked_before_the_devices(tmp_path, nothing_compiles):
    recipe = load_recipe("tiny", ["data.source=missing.bin", "mesh.context=16",
                                  "parallel.strategy=ring", "data.seq_len=256"])
    with pytest.raises(RecipeError, match="data.source"):
        loop.train(recipe, tmp_path / "run")
    recipe = dataclasses.replace(recipe, data=dataclasses.replace(recipe.data,
                                                                   source="synthetic"))
    with pytest.raises(RecipeError, match="mesh"):
        loop.train(recipe, tmp_path / "run")


def test_evaluation_is_checked_at_its_own_length_and_named_so(tmp_path):
    # Splash needs stored chunks of a multiple of 128 tokens: 1024 tokens in 8 chunks (ring
    # on 4 devices, load-balanced) pass; evaluation's 512 tokens make chunks of 64.
    overrides = ["attention.impl=splash", "mesh.context=4", "mesh.data=1",
                 "parallel.strategy=ring", "data.seq_len=1024", "data.batch_size=1",
                 "eval.every=10"]
    devices = jax.devices()[:4]
    plan = check_run(load_recipe("tiny", overrides), tmp_path / "run", devices)
    assert plan.devices.sizes["context"] == 4 and plan.devices.candidates == [("ring", 1)]
    assert plan.init_from is None and plan.rerun_note is None
    with pytest.raises(RecipeError, match=r"chunks of 64 tokens \(eval.seq_len 512 / 8"):
        check_run(load_recipe("tiny", [*overrides, "eval.seq_len=512"]), tmp_path / "run",
                  devices)


def test_offload_on_devices_without_host_memory_is_refused_before_building(monkeypatch):
    monkeypatch.setattr(device_checks, "memory_kinds", lambda devices: {"device"})
    recipe = load_recipe("tiny", ["optimizer.offload=true"])
    with pytest.raises(RecipeError, match="optimizer.offload.*no pinned_host memory"):
        device_checks.check_devices(recipe, jax.devices()[:1])


def test_an_offloaded_layer_input_goes_to_the_host_in_pieces_under_4_gib():
    """libtpu aborts offloading a piece of 4 GiB or more (measured: 4 and 8 GiB abort, 4
    GiB less 128 rows compiles). The 1M recipe at 2,097,152 tokens on 4 chips offloads
    524,288 x 4096 bf16 = 4 GiB per layer and chip: two slices of d_model (2 GiB each); at
    1M tokens one; f32 needs one more halving. Refused only where no slicing does."""
    long = load_recipe("llama3_8b_1m", ["data.seq_len=2097152"])
    assert layer_input_pieces(long, 1, 524288) == 2
    assert layer_input_pieces(load_recipe("llama3_8b_1m"), 1, 262144) == 1
    f32 = load_recipe("llama3_8b_1m", ["model.dtype=float32", "data.seq_len=2097152"])
    assert layer_input_pieces(f32, 1, 524288) == 4
    assert layer_input_pieces(load_recipe("tiny"), 1, 2**40) == 1  # on device
    assert layer_input_pieces(f32, 1, 2**22 * 4096) is None
    sizes = {"data": 1, "fsdp": 1, "context": 4, "tensor": 1}
    device_checks.check_offload_piece(long, sizes, "tpu")
    too_long = load_recipe("llama3_8b_1m", [f"data.seq_len={2**42}"])
    with pytest.raises(RecipeError, match=r"data.seq_len.*no slicing of d_model"):
        device_checks.check_offload_piece(too_long, sizes, "tpu")
    device_checks.check_offload_piece(too_long, sizes, "gpu")  # libtpu's limit alone
