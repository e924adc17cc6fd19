"""Expected failures are one line (out of memory with its figure, an unreadable checkpoint,
a file), bugs keep their traceback, `--debug` shows it for all; long work shows progress."""

import contextlib
import io
import shutil

import jax
import jax.numpy as jnp
import pytest
from rich.console import Console
from typer.testing import CliRunner

from lctrain.cli.main import app
from lctrain.parallel import chips, planner
from lctrain.recipes import check_against_devices, load_recipe
from lctrain.trainer.outputs.failures import explain, out_of_memory_message
from lctrain.trainer.outputs.progress import Bar, tracked
from lctrain.trainer.state import build
from lctrain.trainer.train import loop

from test_xla_failures import RUNTIME, SCOPED_VMEM, USED, XLA_ERROR

SHORT = ["--set", "data.seq_len=64", "--set", "runtime.log_every=1"]


def allocating_too_much(*args):
    """A train step that asks XLA for 16 TiB: the CPU allocator's real RESOURCE_EXHAUSTED
    (jitted: the run compiles its step before the first one)."""
    def step(state, batch):
        return jax.jit(lambda: jnp.ones((2**42,), jnp.float32))()
    return jax.jit(step)


def test_out_of_memory_is_one_line_with_the_figure_and_the_planner(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "make_train_step", allocating_too_much)
    result = CliRunner().invoke(app, ["run", "--steps", "2", "--run-dir", str(tmp_path), *SHORT])
    assert result.exit_code == 1, result.output
    error = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert error == [line for line in result.output.splitlines()[-1:]]  # the last line only
    assert "out of device memory: a device could not allocate 17,592.19 GB" in error[0]
    assert "lctrain plan" in error[0] and "Traceback" not in result.output


def test_debug_shows_the_traceback_of_an_expected_failure(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "make_train_step", allocating_too_much)
    result = CliRunner().invoke(app, ["--debug", "run", "--steps", "2", "--run-dir",
                                      str(tmp_path), *SHORT])
    # the first step's one line, raised from XLA's error, whose traceback --debug shows
    cause = result.exception.__cause__
    assert type(result.exception).__name__ == "FirstStepOutOfMemory"
    assert type(cause).__name__ == "JaxRuntimeError"
    assert "RESOURCE_EXHAUSTED" in str(cause) and "error:" not in result.output


def test_a_bug_keeps_its_traceback(tmp_path, monkeypatch):
    def broken(*args):
        raise ZeroDivisionError("a bug")
    monkeypatch.setattr(build, "make_train_step", broken)
    result = CliRunner().invoke(app, ["run", "--steps", "2", "--run-dir", str(tmp_path), *SHORT])
    assert isinstance(result.exception, ZeroDivisionError) and result.exit_code == 1


def test_compiler_out_of_memory_gives_needed_and_available_hbm():
    err = XLA_ERROR(USED)
    assert "needs 104.41 GB per device of 102.80 GB hbm" in out_of_memory_message(err)
    assert explain(err)[1] == 1
    assert explain(MemoryError())[0].startswith("out of host memory")
    assert explain(PermissionError(13, "Permission denied", "/runs/x")) == (
        "/runs/x: Permission denied", 1)
    assert explain(KeyError("a bug")) is None


# `lctrain run` of the tiny recipe, 2 steps then 4 (the first run's recipe again but
# train.steps): in this process (CliRunner) and in processes of their own.
UNREADABLE = ["tiny", "--set", "data.seq_len=64", "--set", "runtime.log_every=1"]


@pytest.fixture(scope="module")
def unreadable_checkpoint(tmp_path_factory):
    """A run dir of 2 steps whose step-2 checkpoint lost its arrays' data (the metadata
    stays); restoring it fails. Reruns that fail to restore leave it as it is."""
    run_dir = tmp_path_factory.mktemp("unreadable")
    result = CliRunner().invoke(app, ["run", *UNREADABLE, "--steps", "2", "--run-dir",
                                      str(run_dir)])
    assert result.exit_code == 0, result.output
    for array_files in (run_dir / "checkpoints" / "2").glob("state/*"):
        if array_files.is_dir():   # the arrays' data, not the metadata
            shutil.rmtree(array_files)
    return run_dir


def test_unreadable_checkpoint_names_its_folder(unreadable_checkpoint):
    run_dir = unreadable_checkpoint
    again = CliRunner().invoke(app, ["run", *UNREADABLE, "--steps", "4", "--run-dir",
                                     str(run_dir)])
    assert again.exit_code == 1, again.output
    assert f"{run_dir / 'checkpoints' / '2'}: cannot restore checkpoint step 2" in again.output
    assert "Traceback" not in again.output


# ------------------------------------------------------------------- progress ----

def test_bar_draws_on_a_terminal_and_prints_one_line_elsewhere():
    terminal = Console(file=io.StringIO(), force_terminal=True, width=120)
    pipe = Console(file=io.StringIO(), force_terminal=False, width=120)
    assert list(tracked(terminal, [1, 2, 3], "loading x")) == [1, 2, 3]
    assert list(tracked(pipe, [1, 2, 3], "loading x")) == [1, 2, 3]
    assert "3/3" in terminal.file.getvalue()
    lines = pipe.file.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("loading x: ") and lines[0].endswith(" s")
    with Bar(pipe, "quiet", 2, summary=False) as bar:
        bar.advance("loss 1.0")
    assert pipe.file.getvalue().splitlines() == lines   # nothing added without a terminal


def test_run_shows_a_bar_with_loss_and_throughput_on_a_terminal_only(tmp_path):
    recipe = load_recipe("tiny", ["train.steps=3", "train.warmup_steps=1", "data.seq_len=64",
                                "runtime.log_every=1"])
    terminal = Console(file=io.StringIO(), force_terminal=True, color_system=None, width=200)
    loop.train(recipe, tmp_path / "tty", terminal)
    drawn = terminal.file.getvalue()
    assert "3/3" in drawn and "ETA" in drawn and "tok/s" in drawn
    assert "step 3/3 | loss" in drawn                    # the log lines stay
    pipe = Console(file=io.StringIO(), force_terminal=False, width=200)
    loop.train(recipe, tmp_path / "pipe", pipe)
    logged = pipe.file.getvalue()
    assert "ETA" not in logged and "\x1b" not in logged and "step 3/3 | loss" in logged


def test_plan_compiles_are_each_timed(monkeypatch):
    """--compile and --max-seq wrap every compile in the CLI's timer, named by strategy and
    sequence (each can take minutes)."""
    recipe = load_recipe("tiny", ["parallel.strategy=auto", "mesh.context=4", "mesh.data=1",
                                "data.seq_len=4096", "data.batch_size=1"])
    result = planner.plan(recipe, chips.chip_named("v5p:2x2x1").per_device(),
                          check_against_devices(recipe, 4), "tpu")
    fitting = {"hbm_bytes": 2**30, "host_bytes": 0, "collective_bytes": {}, "temp_bytes": 0,
               "argument_bytes": 0}
    refused = {"hbm_bytes": None, "host_bytes": None, "collective_bytes": None,
               "error": "RESOURCE_EXHAUSTED: Ran out of memory on HBM"}  # as the TPU compiler
    monkeypatch.setattr(planner.compiled, "compile_figures",
                        lambda candidate, devices, compile_step: (
                            fitting if candidate.data.seq_len <= 8192 else refused))
    labels = []

    def timer(label):
        labels.append(label)
        return contextlib.nullcontext()

    planner.attach_compiled(result, recipe, [None] * 4, None, timed=timer)
    assert labels == [f"compiled {p.name}, seq 4,096, for 4 devices" for p in result.plans]
    labels.clear()
    longest = planner.longest_sequences(result, recipe, "tpu", [None] * 4, None, timer)
    compiles = sum(1 for label in labels if ", seq " in label)
    assert compiles == len(labels) and compiles >= len(result.plans)
    assert all(figures["compiled"] == 8192 for figures in longest.values())


def test_an_unreadable_checkpoint_is_one_line_to_the_end_of_the_process(
        unreadable_checkpoint, tmp_path):
    """orbax's reads still in flight when a restore fails end on a closed event loop; their
    "Event loop is closed" tracebacks came before, among or after the error line, and
    "Task exception was never retrieved" at exit (7 runs in 50 before the fix, two at a
    time; three runs here, side by side)."""
    import subprocess
    import sys

    from subprocess_env import subprocess_env

    env = {**subprocess_env(), "JAX_PLATFORMS": "cpu"}
    run_dirs = [tmp_path / str(i) for i in range(3)]   # a run dir holds one run at a time
    processes = []
    for run_dir in run_dirs:
        shutil.copytree(unreadable_checkpoint, run_dir)
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "lctrain.cli.main", "run", *UNREADABLE, "--steps", "4",
             "--run-dir", str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=env))
    for run_dir, process in zip(run_dirs, processes):
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == 1, stderr[-3000:]
        assert stderr.startswith(f"error: {run_dir / 'checkpoints' / '2'}: cannot restore")
        assert len(stderr.strip().splitlines()) == 1, stderr[-3000:]


def test_a_scoped_vmem_failure_is_a_kernel_tile_problem_not_hbm():
    message, code = explain(XLA_ERROR(SCOPED_VMEM))
    assert "scoped VMEM" in message and "attention.block_q" in message and code == 1
    assert "offload" not in message and "out of device memory" not in message


def test_out_of_memory_advice_leaves_out_what_the_recipe_already_does():
    """recipes/one_chip.yaml offloads its layer inputs and chunks its MLP: the advice is
    what it has not tried (a v5e's runtime OOM at 131,072 tokens said to offload)."""
    err = XLA_ERROR(RUNTIME)
    offloading = out_of_memory_message(err, load_recipe("recipes/one_chip.yaml"))
    assert "could not allocate 31.5 MB" in offloading
    assert "offload" not in offloading and "mlp_chunk_tokens" not in offloading
    assert "data.seq_len" in offloading
    full = out_of_memory_message(err, load_recipe("recipes/one_chip.yaml",
                                                  ["remat.policy=full", "remat.tensors={}",
                                                   "remat.mlp_chunk_tokens=0"]))
    assert "decoder_layer_input: offload" in full and "mlp_chunk_tokens" in full


def failing_once_with(message: str):
    """build_run that raises `message` as XLA's error on its first call, then compiles."""
    calls = []
    real = build.build_run

    def build_run(recipe, devices, console=None, **kwargs):
        calls.append((recipe.attention.impl, recipe.attention.block_q))
        if len(calls) == 1:
            raise XLA_ERROR(message)
        return real(recipe, devices, console, **kwargs)
    return build_run, calls


def test_a_kernel_left_to_lctrain_falls_back_when_its_tiles_overflow_vmem(monkeypatch):
    monkeypatch.setattr(build, "build_run", failing_once_with(SCOPED_VMEM)[0])
    recipe = load_recipe("tiny", ["data.seq_len=64", "mesh.data=1"])
    run = build.compile_run(recipe, jax.devices()[:1])
    assert "does not fit the chip's scoped VMEM; trying attention.impl=pallas" in run.report[0]
    assert (run.recipe.attention.impl, run.recipe.attention.block_q) == ("pallas", 512)


def test_a_pinned_kernel_whose_tiles_overflow_vmem_is_named_in_one_line(monkeypatch):
    build_run, calls = failing_once_with(SCOPED_VMEM)
    monkeypatch.setattr(build, "build_run", build_run)
    recipe = load_recipe("tiny", ["data.seq_len=64", "mesh.data=1", "attention.impl=xla",
                                  "attention.block_q=64", "attention.block_kv=64"])
    with pytest.raises(build.RunFailure, match="scoped VMEM.*xla with blocks of 64 x 64"):
        build.compile_run(recipe, jax.devices()[:1])
    assert len(calls) == 1


def test_auto_goes_on_to_its_next_candidate_when_the_first_step_finds_the_device_full(
        tmp_path, monkeypatch):
    """The compiler accepted auto's first pick, but its program does not load (a v5e's
    E0101 at 131,072 tokens): the run says so and trains with the next candidate."""
    real, tried = build.compile_run, []

    def compile_run(recipe, *args, **kwargs):
        run = real(recipe, *args, **kwargs)
        tried.append(run.recipe.parallel.strategy)
        if len(tried) > 1:
            return run

        def does_not_load(state, batch):
            raise XLA_ERROR("RESOURCE_EXHAUSTED: E0101: RuntimeProgramAllocationFailure: "
                            "Attempting to allocate 30.01M. That was not possible.")
        return run._replace(train_step=does_not_load)

    monkeypatch.setattr(loop, "compile_run", compile_run)
    console = Console(file=io.StringIO(), width=200)
    # Two devices (context 2): auto's candidates, each compiled for 2 devices, not 8.
    recipe = load_recipe("tiny", ["data.seq_len=64", "mesh.context=2", "mesh.data=1",
                                  "parallel.strategy=auto", "train.steps=2",
                                  "checkpoint.every=0"])
    records = loop.train(recipe, tmp_path, console, jax.devices()[:2])
    assert len(tried) == 2 and tried[0] != tried[1]
    assert [r["step"] for r in records] == [2] and recipe.parallel.strategy == "auto"
    assert (f"{tried[0]}: out of device memory: a device could not allocate 31.5 MB"
            in console.file.getvalue())


def test_a_pinned_strategy_whose_first_step_finds_the_device_full_stops_in_one_line(
        tmp_path, monkeypatch):
    real = build.compile_run

    def compile_run(recipe, *args, **kwargs):
        def does_not_load(state, batch):
            raise XLA_ERROR("RESOURCE_EXHAUSTED: Attempting to allocate 30.01M.")
        return real(recipe, *args, **kwargs)._replace(train_step=does_not_load)

    monkeypatch.setattr(loop, "compile_run", compile_run)
    with pytest.raises(loop.FirstStepOutOfMemory, match="could not allocate 31.5 MB"):
        loop.train(load_recipe("tiny", ["data.seq_len=64", "train.steps=2"]), tmp_path,
                   Console(file=io.StringIO()))
    assert not list((tmp_path / "checkpoints").glob("[0-9]*"))
