"""Stages: `lctrain run --init-from RUN_DIR[:STEP]` starts a new run (another sequence length,
mesh and strategy) from an earlier run's checkpoint; its own step, data and schedule start
at 0; bad input stops with one line before anything compiles; a run dir with checkpoints
of its own resumes from them instead."""

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from rich.console import Console
from typer.testing import CliRunner

from lctrain.cli.main import app
from lctrain.parallel import make_strategy
from lctrain.recipes import load_recipe
from lctrain.trainer.data.sources import make_source
from lctrain.trainer.model.transformer import Transformer
from lctrain.trainer.state.build import mesh_for
from lctrain.trainer.state.step import build_trainable, make_loss_sums
from lctrain.trainer.train.init_from import InitFrom, checked_init_from, stage_start
from lctrain.trainer.train.loop import train

# Two layers: with one, XLA inlines the layer loop and XLA:CPU of jax 0.10 can run two ring
# forwards side by side, whose permutes meet across devices (tests/test_cpu_collectives.py).
# Stage 2 is the quickstart's shape (ring, data 2 x context 4, full remat), whose gradients
# were NaN on jax 0.12 until trainer/train/runtime.fake_cpu_device_flags turned XLA:CPU's
# concurrency-optimized scheduler off there.
COMMON = ["model.layers=2", "runtime.log_every=1", "checkpoint.every=1"]
STAGE1 = [*COMMON, "data.seq_len=256", "data.batch_size=8", "mesh.context=1", "train.steps=2"]
STAGE2 = [*COMMON, "data.seq_len=1024", "data.batch_size=2", "parallel.strategy=ring",
          "mesh.context=4", "train.steps=1"]
QUIET = Console(quiet=True)


@pytest.fixture(scope="module")
def stage1(tmp_path_factory) -> Path:
    """Two steps at 256 tokens without context parallelism; checkpoints at steps 1 and 2."""
    run_dir = tmp_path_factory.mktemp("stage1")
    train(load_recipe("tiny", STAGE1), run_dir, QUIET)
    return run_dir


def saved_state(run_dir: Path, step: int) -> dict:
    """A checkpoint's train state as numpy arrays, read by orbax alone (no lctrain code)."""
    path = run_dir / "checkpoints" / str(step) / "state"
    handler = ocp.PyTreeCheckpointHandler()
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
                            handler.metadata(path).tree)
    return handler.restore(path, args=ocp.args.PyTreeRestore(restore_args=as_numpy))


def one_device_loss(params: dict, sets: list[str]) -> float:
    """The mean next-token loss of `params` on batch 0 of the recipe's data, on one device
    without context parallelism."""
    recipe = load_recipe("tiny", [*sets, "parallel.strategy=none", "mesh.context=1",
                                "mesh.data=1"])
    mesh = mesh_for(recipe, jax.devices()[:1])
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(recipe.model, nnx.Rngs(0))))
    loss_sums = make_loss_sums(recipe, graphdef, make_strategy(recipe, mesh))
    source = make_source(recipe.data, vocab=recipe.model.vocab, seed=recipe.train.seed,
                         holdout=recipe.eval.data_holdout)
    batch = vars(source.batch(0))
    total, aux = jax.jit(loss_sums)(params, batch)
    return float(total / aux.tokens)


def lctrain_run(run_dir: Path, sets: list[str], *args: str):
    return CliRunner().invoke(app, ["run", "tiny", "--run-dir", str(run_dir),
                                    *[x for s in sets for x in ("--set", s)], *args])


def test_stage2_starts_from_stage1_weights_on_its_own_first_batch(stage1, tmp_path):
    """Stage 2 (4x the sequence, ring over 4 chips) logs as its first loss the loss of
    stage 1's final weights on stage 2's batch 0, and records where it started."""
    result = lctrain_run(tmp_path, STAGE2, "--init-from", str(stage1))
    assert result.exit_code == 0, result.output
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1   # its own step count
    expected = one_device_loss(saved_state(stage1, 2)["params"], STAGE2)
    np.testing.assert_allclose(first["loss"], expected, rtol=1e-5)
    assert json.loads((tmp_path / "init_from.json").read_text()) == {
        "run_dir": str(stage1.absolute()), "step": 2, "optimizer_state": False}


@pytest.mark.parametrize("optimizer", [True, False])
def test_init_optimizer_carries_adam_moments_and_restarts_the_schedule(stage1, tmp_path,
                                                                      optimizer):
    recipe = load_recipe("tiny", STAGE2)
    trainable = build_trainable(recipe, mesh_for(recipe))
    init = checked_init_from(InitFrom(stage1, 1, optimizer), recipe, tmp_path, QUIET)
    state, next_batch = stage_start(init, recipe, trainable, tmp_path, QUIET)
    saved = saved_state(stage1, 1)
    # (clip, (adam, weight decay, schedule)): the chain of trainer/state/optimizer.py
    adam, schedule = state.opt_state[1][0], state.opt_state[1][2]
    saved_mu = saved["opt_state"][1][0]["mu"]["layers"]["mlp"]["up"]
    assert np.abs(saved_mu).max() > 0
    np.testing.assert_array_equal(adam.mu["layers"]["mlp"]["up"],
                                  saved_mu if optimizer else np.zeros_like(saved_mu))
    assert int(adam.count) == (1 if optimizer else 0)
    assert int(schedule.count) == 0 and int(state.step) == 0 and next_batch == 0
    np.testing.assert_array_equal(state.params["embedding"], saved["params"]["embedding"])
    # restored into stage 2's sharding, not stage 1's
    assert state.params["embedding"].sharding == trainable.state_shardings.params["embedding"]


def without_checkpoints(stage1: Path, tmp_path: Path) -> str:
    empty = tmp_path / "untrained"
    empty.mkdir()
    shutil.copy(stage1 / "recipe.yaml", empty)
    return str(empty)


@pytest.mark.parametrize("source, args, words", [
    (lambda s1, tmp: str(tmp / "nowhere"), [], "is not a run dir"),
    (without_checkpoints, [], "has no checkpoint yet"),
    (lambda s1, tmp: f"{s1}:7", [], "no checkpoint at step 7; saved steps: 1, 2"),
    (lambda s1, tmp: str(s1), ["--set", "model.layers=3"],
     "parameter layers.attention.wk is (2, 128, 2, 16) there and (3, 128, 2, 16) in this "
     "recipe (model.layers 2 -> 3)"),
    (lambda s1, tmp: str(s1), ["--init-optimizer", "--set", "train.grad_clip=0"],
     "does not fit this recipe's optimizer (train.grad_clip 1.0 -> 0.0)"),
    (None, ["--init-optimizer"], "give --init-from"),
], ids=["not_a_run_dir", "no_checkpoint", "no_such_step", "model_changed", "optimizer_changed",
        "init_optimizer_alone"])
def test_bad_init_from_is_one_line_before_any_compile(stage1, tmp_path, source, args, words):
    run_dir = tmp_path / "stage2"
    init = ["--init-from", source(stage1, tmp_path)] if source else []
    result = lctrain_run(run_dir, STAGE2, *init, *args)
    assert result.exit_code == 2, result.output
    assert words in result.output and "compiled" not in result.output
    assert not run_dir.exists()


def test_a_run_dir_with_checkpoints_resumes_and_ignores_init_from(stage1, tmp_path):
    run_dir = tmp_path / "stage1_again"
    shutil.copytree(stage1, run_dir)
    result = lctrain_run(run_dir, [*STAGE1, "train.steps=3"],
                         "--init-from", str(tmp_path / "nowhere"))
    assert result.exit_code == 0, result.output
    assert (f"--init-from {tmp_path / 'nowhere'} ignored: run dir {run_dir} has its own "
            f"checkpoints and resumes from step 2") in result.output
    steps = [json.loads(line)["step"] for line in
             (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3] and not (run_dir / "init_from.json").exists()


def test_a_stage_without_checkpoints_yet_needs_its_init_from_again(tmp_path):
    """Rerun without --init-from before its first checkpoint, a stage would otherwise train
    from random weights while its run dir says where it started."""
    (tmp_path / "init_from.json").write_text(json.dumps(
        {"run_dir": "/runs/stage1", "step": 2, "optimizer_state": False}))
    result = lctrain_run(tmp_path, STAGE2)
    assert result.exit_code == 2, result.output
    assert "give --init-from /runs/stage1:2 again" in result.output
