"""A newcomer's first commands: the default recipe picks its devices and says which, square
brackets in paths and names survive rich's markup, and libtpu stays quiet."""

import importlib.metadata
import importlib.util
import io
import os
import subprocess
import sys

import pytest
from rich.console import Console
from typer.testing import CliRunner

from lctrain.trainer.train import runtime
from lctrain.cli.main import app
from lctrain.recipes import RecipeError, check_against_devices, load_recipe

# ----------------------------------------------------------- runtime.cpu_devices=auto ----


def test_accelerator_needs_its_device_node_and_its_jax_module(tmp_path):
    tpu_and_gpu = {"libtpu", "jax_cuda12_plugin"}
    assert runtime.accelerator_module(tmp_path, tpu_and_gpu) is None
    (tmp_path / "vfio").mkdir()
    (tmp_path / "vfio" / "vfio").touch()    # VFIO's control node: any host may have it
    assert runtime.accelerator_module(tmp_path, tpu_and_gpu) is None
    (tmp_path / "vfio" / "0").touch()       # a TPU v5e/v5p/v6e chip
    assert runtime.accelerator_module(tmp_path, tpu_and_gpu) == "libtpu"
    assert runtime.accelerator_module(tmp_path, {"jax_cuda12_plugin"}) is None  # no libtpu
    (tmp_path / "nvidia0").touch()
    assert runtime.accelerator_module(tmp_path, {"jax_cuda12_plugin"}) == "jax_cuda"
    assert runtime.accelerator_module(tmp_path, set()) is None  # CPU-only jax
    accel = tmp_path / "v4"
    accel.mkdir()
    (accel / "accel0").touch()              # a TPU v4 chip
    assert runtime.accelerator_module(accel, {"libtpu"}) == "libtpu"


@pytest.mark.parametrize("platforms, accelerator, count", [
    (None, None, 8), (None, "libtpu", 0), ("cpu", "libtpu", 8), ("tpu", None, 0),
    ("cuda,cpu", None, 0)])
def test_auto_fakes_eight_cpu_devices_only_where_jax_finds_no_accelerator(
        monkeypatch, platforms, accelerator, count):
    if platforms is None:
        monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    else:
        monkeypatch.setenv("JAX_PLATFORMS", platforms)
    monkeypatch.setattr(runtime, "accelerator_module", lambda: accelerator)
    assert runtime.fake_cpu_device_count("auto") == count
    assert runtime.fake_cpu_device_count(4) == 4 and runtime.fake_cpu_device_count(0) == 0


def test_default_recipe_on_one_device_names_a_fix_that_works():
    """The default recipe splits sequences over 4 devices; on one (a single TPU chip or
    GPU) the error names the settings that run it, and they do."""
    with pytest.raises(RecipeError) as refused:
        check_against_devices(load_recipe(), 1)
    fix = str(refused.value).split(": --set ")[-1].split(" --set ")
    assert fix == ["mesh.context=1", "parallel.strategy=none"]
    assert check_against_devices(load_recipe(None, fix), 1)["context"] == 1


def test_first_line_of_a_run_names_its_devices_and_keeps_brackets(tmp_path):
    """`lctrain run` with the default recipe (runtime.cpu_devices=auto; the tests' JAX_PLATFORMS
    is cpu): the first line says what it computes on, and a run dir with square brackets
    is shown as it is (rich took '[try]' for a style tag and printed nothing)."""
    run_dir = tmp_path / "runs" / "[try]"
    result = CliRunner().invoke(app, ["run", "--steps", "1", "--run-dir", str(run_dir),
                                      "--set", "runtime.log_every=1"])
    assert result.exit_code == 0, result.output
    first = result.output.splitlines()[0]
    assert first.startswith("devices: 8 x cpu (fake, runtime.cpu_devices=auto) | model tiny:")
    assert first.endswith(f"run dir {run_dir}")


# --------------------------------------------------------------- square brackets ----

def test_plan_table_keeps_brackets_of_the_model_folder():
    from lctrain.cli.plan_render import render
    from lctrain.parallel import chips, planner
    from lctrain.recipes import load_recipe

    recipe = load_recipe("tiny", ["mesh.context=4", "mesh.data=1", "parallel.strategy=auto",
                                "data.batch_size=1"])
    sizes = {"data": 1, "fsdp": 1, "context": 4, "tensor": 1}
    result = planner.plan(recipe, chips.CHIPS["v5p"], sizes)
    out = io.StringIO()
    render(result, Console(file=out, width=200), title="hf:/models/[v2], seq 256")
    assert "hf:/models/[v2], seq 256" in out.getvalue()
    assert f"recommended: {result.choice.name} - {result.reason}" in out.getvalue()


def test_eval_table_keeps_brackets_of_the_run_dir():
    from lctrain.cli.eval_report import render_table

    result = {"weights": "checkpoint step 3 of runs/[try]", "tokens": 10, "seq_len": 8,
              "loss": 1.0, "perplexity": 2.72, "accuracy": 0.5,
              "by_position": {"edges": [0, 8], "tokens": [10], "loss": [1.0],
                              "accuracy": [0.5]}}
    out = io.StringIO()
    render_table(result, Console(file=out, width=200))
    assert "checkpoint step 3 of runs/[try]: 10 tokens" in out.getvalue()


def test_plan_compile_without_libtpu_names_the_extra(without_libtpu):
    result = CliRunner().invoke(app, ["plan", "--topology", "v5p:2x2x1", "--compile",
                                      "--set", "mesh.context=4", "--set", "mesh.data=1",
                                      "--set", "data.batch_size=1"])
    assert result.exit_code == 2
    assert result.output.strip() == (
        "error: compiling for TPU topology 'v5p:2x2x1' needs libtpu; install the tpu extra: "
        "pip install -e '.[tpu]'")


# ------------------------------------------------------------------- libtpu noise ----

LIBTPU_NOISE = ("Failed to find host bounds", "Logging before InitGoogle()",
                "TPU_WORKER_HOSTNAMES", "Source Location Trace")


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="TPU AOT compiles need libtpu (the tpu extra)")
def test_topology_setup_keeps_libtpu_warnings_off_the_terminal():
    """What `lctrain plan --compile` does first: load libtpu and describe v5p:2x2x1. libtpu
    warns from C++ that it finds no TPU (expected here); none of it reaches stderr."""
    code = ("from lctrain.parallel.aot import topology_devices; "
            "print(len(topology_devices('v5p:2x2x1')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "4"
    assert [noise for noise in LIBTPU_NOISE if noise in done.stderr] == []


def test_a_context_recipe_on_one_cpu_device_says_what_jax_sees_in_one_quiet_line(tmp_path):
    """The extension recipe copied onto a CPU machine: no runtime section, so jax's one CPU
    device, and ring over it. One line, naming the device count and the fix, and none of
    libtpu's start-up warnings (a plain `import jax` with libtpu installed prints them)."""
    recipe = tmp_path / "extend.yaml"
    recipe.write_text("mesh: {data: 1, context: -1}\nparallel: {strategy: ring}\n")
    env = {name: value for name, value in os.environ.items() if name != "JAX_PLATFORMS"}
    done = subprocess.run([sys.executable, "-m", "lctrain.cli.main", "run", str(recipe),
                           "--run-dir", str(tmp_path / "run")], capture_output=True,
                          text=True, env={**env, "XLA_FLAGS": ""}, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: recipe key 'parallel.strategy' = 'ring': splits the sequence over "
        "mesh.context, which is 1 (jax sees 1 device; on a machine without accelerators "
        "runtime.cpu_devices: 8 fakes eight); set mesh.context >= 2, or "
        "parallel.strategy=none"]


def test_native_stderr_is_shown_only_when_the_block_fails(capfd):
    from lctrain.parallel.native_stderr import shown_only_on_failure

    with shown_only_on_failure():
        os.write(2, b"expected start-up noise\n")
    with pytest.raises(RuntimeError), shown_only_on_failure():
        os.write(2, b"what the library said before failing\n")
        raise RuntimeError("failed")
    os.write(2, b"after\n")
    err = capfd.readouterr().err
    assert err == "what the library said before failing\nafter\n"


# Reruns in a used run dir: the run dir's recipe.yaml against the new recipe, first thing.
RERUN = ["--set", "data.seq_len=32", "--set", "data.batch_size=8", "--set",
         "train.warmup_steps=1", "--set", "runtime.log_every=1", "--set", "checkpoint.every=2"]


def rerun(run_dir, *extra):
    """The tiny recipe (data-parallel, strategy none), so that the rerun on ring over
    mesh.context 4 is another mesh and strategy."""
    return CliRunner().invoke(app, ["run", "tiny", "--run-dir", str(run_dir), *RERUN, *extra])


def test_reruns_finish_continue_or_name_what_changed(tmp_path):
    first = rerun(tmp_path, "--steps", "2")
    assert first.exit_code == 0, first.output
    # attention.impl left to lctrain on CPU (xla): nothing runs interpreted, nothing said
    # (the pallas run of test_an_interpreted_kernel_on_cpu_is_said_once says it once).
    assert "interpret mode" not in first.output

    finished = rerun(tmp_path, "--steps", "2")
    assert finished.exit_code == 0
    assert f"run dir {tmp_path} is finished: step 2 of train.steps 2" in finished.output
    assert "step 3" not in finished.output

    longer = rerun(tmp_path, "--steps", "3")
    assert longer.exit_code == 0, longer.output
    assert "train.steps 2 -> 3: the cosine decay now runs over 3 steps" in longer.output
    assert "resumed from checkpoint at step 2" in longer.output and "step 3/3" in longer.output

    # Another mesh and kernel only change how the same run computes: allowed.
    moved = rerun(tmp_path, "--steps", "4", "--set", "parallel.strategy=ring",
                  "--set", "mesh.context=4")
    assert moved.exit_code == 0, moved.output

    for key, value, before in [("data.seq_len", "64", "32"), ("model.layers", "3", "2"),
                               ("train.lr", "0.1", "0.003")]:
        changed = rerun(tmp_path, "--steps", "5", "--set", f"{key}={value}")
        lines = [line for line in changed.output.splitlines() if line.strip()]
        assert changed.exit_code == 2 and len(lines) == 1, changed.output
        assert f"{key} {before} -> {value}" in lines[0].replace("'", "")
    assert not (tmp_path / "checkpoints" / "5").exists()


# ------------------------------------------------------- attention.impl=auto ----

def test_default_attention_is_a_tpu_kernel_on_tpu_and_xla_on_cpu():
    """Left out, attention.impl is auto: on TPU splash where its tiles fit (2048-token
    chunks) and our Pallas kernel where they do not (2000), never the XLA kernel that
    computes every block pair; on CPU the XLA kernel (the others would be interpreted)."""
    from lctrain import kernels

    impl = load_recipe("tiny").attention.impl
    assert impl == "auto"
    assert kernels.impl_for_call(impl, "tpu", 2048, 8192, 512, 512, 2048) == "splash"
    assert kernels.impl_for_call(impl, "tpu", 2000, 8000, 512, 512, 2000) == "pallas"
    assert kernels.impl_for_call(impl, "cpu", 2048, 8192, 512, 512, 2048) == "xla"


def test_an_interpreted_kernel_on_cpu_is_said_once(tmp_path):
    """The tiny recipe (no ring: one interpreted kernel call per layer, not one per ring
    step). A run without pallas says nothing of it: test_reruns_finish_continue_or_name_what_
    changed's first run checks that (one compile and run less here)."""
    result = CliRunner().invoke(app, ["run", "tiny", "--steps", "1", "--run-dir",
                                      str(tmp_path), "--set", "attention.impl=pallas",
                                      "--set", "data.seq_len=64"])
    assert result.exit_code == 0, result.output
    assert result.output.count("attention.impl=pallas runs in Pallas interpret mode") == 1


def test_version_names_lctrain_and_its_toolchain():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"lctrain {importlib.metadata.version('lctrain')}, "
                                    f"jax {importlib.metadata.version('jax')}, "
                                    f"jaxlib {importlib.metadata.version('jaxlib')}, libtpu ")


@pytest.mark.parametrize("command", ["run", "plan", "eval", "export", "tokenize"])
def test_help_writes_no_type_after_a_flag(command):
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    flags = [line for line in result.output.splitlines() if "--help" in line or "--json" in line
             or "--overwrite" in line or "--compile" in line or "--debug" in line]
    assert flags and all("<bool>" not in line for line in flags), flags
    assert "<bool>" not in result.output


@pytest.mark.parametrize("command, phrases", [
    ("eval", ["With eval.task needle or passkey, also retrieval", "<task>_heatmap.png, one "
              "depth per row and one length per column", "loss_by_position.png",
              "never the run dir, its data's or model.init's folder",
              "effective length: a table, ruler.json and ruler.png"]),
    ("run", ["One run at a time per run dir; Ctrl-C or SIGTERM saves a checkpoint"]),
    ("plan", ["the recipe's own first, and a recommendation", "estimate's error"]),
    ("tokenize", ["names the tokenizer (with a fingerprint)"]),
])
def test_help_says_what_docs_say(command, phrases):
    """What README's command list and docs/ promise, in each command's --help (eval's said
    nothing of the retrieval tasks and their pictures)."""
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.replace("│", " ").split())
    missing = [phrase for phrase in phrases if phrase not in text]
    assert not missing, text
