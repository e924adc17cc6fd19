"""benchmarks/step.py and the MFU figure it shares with `lctrain run`
(trainer/train/loop.Throughput); benchmarks/attention.py's accuracy check."""

import importlib.util
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from lctrain.parallel.chips import CHIPS
from lctrain.recipes import load_recipe
from lctrain.trainer.train.loop import Throughput
from lctrain.parallel.model_arithmetic import training_flops_per_token

ROOT = Path(__file__).resolve().parent.parent


def benchmark(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mfu_is_model_flops_over_the_chips_peak(monkeypatch):
    """Four v5p chips, 2 steps in 3 s: MFU = 6N + attention FLOPs per token x tokens per
    step / 1.5 s / (4 x v5p's bf16 peak)."""
    recipe = load_recipe("tiny", ["model.preset=llama3.1-8b", "data.seq_len=8192",
                                  "data.batch_size=2"])
    chip = CHIPS["v5p"]
    mesh = SimpleNamespace(devices=np.array([SimpleNamespace(device_kind="TPU v5p")] * 4))
    clock = iter([100.0, 103.0, 103.0])
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    throughput = Throughput(recipe, mesh)
    throughput.steps = 2
    figures = throughput.report()
    flops = training_flops_per_token(recipe.model, 8192) * 2 * 8192
    assert figures["step_time_s"] == 1.5
    assert figures["tokens_per_s"] == 2 * 8192 / 1.5
    assert figures["mfu"] == pytest.approx(flops / 1.5 / (4 * chip.peak_bf16_flops))


def test_without_an_accelerator_it_says_so_and_exits_0(capsys):
    assert benchmark("step").main([]) == 0
    assert "no accelerator here" in capsys.readouterr().out
    assert benchmark("chip_check").main([]) == 0
    assert "no TPU here (jax's backend is cpu)" in capsys.readouterr().out


def test_a_cpu_row_has_consistent_figures_and_no_mfu():
    """A CPU has no peak FLOP/s in parallel/chips.py, so no MFU; tokens/s is the step's
    tokens over its time."""
    step = benchmark("step")
    step.MODELS["tiny"] = []
    row = step.time_steps("tiny", 256, 1, ["model.layers=1"])
    assert row["seq_len"] == 256 and "mfu" not in row
    assert row["tokens_per_s"] == pytest.approx(256 / row["step_time_s"])


def test_attention_accuracy_check_measures_bf16_rounding_and_nothing_else():
    """The check an accelerator runs before timing (here interpreted on CPU): the Pallas
    kernel with bf16 inputs against the xla kernel in f32 differs by bf16's rounding (about
    3e-3 of the largest value here), neither zero (which would mean it compared the
    reference with itself) nor more than BF16_REL of the kernel tests."""
    errors = benchmark("attention").kernel_errors("pallas", 512, "packed")
    assert set(errors) == {"out", "lse", "dq", "dk", "dv"}
    assert all(1e-4 < error < 2e-2 for error in errors.values()), errors


@pytest.mark.parametrize("model, published", [("1b", 1_235_814_400), ("3b", 3_212_749_824),
                                              ("8b", 8_030_261_248)])
def test_model_shapes_have_the_published_parameter_counts(model, published):
    """The counts of Llama 3.2 1B and 3B and Llama 3.1 8B's safetensors."""
    from lctrain.parallel.model_arithmetic import count_parameters

    recipe = load_recipe("tiny", benchmark("step").MODELS[model])
    assert count_parameters(recipe.model) == published
