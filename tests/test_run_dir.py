"""A run dir belongs to one run: a second `lctrain run` in it is refused, a run that trained
nothing blocks no rerun, and `lctrain run --run-dir D` resumes D's own recipe. Nothing here
compiles: a run that gets past its checks and the lock stops at compile_run."""

import os
import socket

import pytest
import yaml
from typer.testing import CliRunner

from lctrain.cli.main import app
from lctrain.recipes import load_recipe
from lctrain.trainer.train import loop
from lctrain.trainer.train.run_dir_lock import run_dir_lock

SMALL = ["data.seq_len=64", "train.steps=5"]


class Compiling(Exception):
    """compile_run was reached."""


@pytest.fixture
def compiled(monkeypatch, tmp_path):
    """What reached compile_run: the recipe, and the lock file's line meanwhile."""
    reached = []

    def stop(recipe, *args, **kwargs):
        reached.append((recipe, (tmp_path / "lock").read_text()))
        raise Compiling

    monkeypatch.setattr(loop, "compile_run", stop)
    return reached


def run(run_dir, *args):
    result = CliRunner().invoke(app, ["run", *args, "--run-dir", str(run_dir)])
    return result, [line for line in result.output.splitlines() if line.strip()]


def test_a_run_dir_in_use_is_refused_and_a_dead_holders_lock_taken_over(tmp_path, compiled):
    with run_dir_lock(tmp_path):  # a first run, training
        result, lines = run(tmp_path, "tiny", *[f"--set={s}" for s in SMALL])
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert (f"run dir {tmp_path} is in use by lctrain pid {os.getpid()} on host "
            f"{socket.gethostname()} ({tmp_path / 'lock'}); wait for that run to end or stop "
            f"it, or give another --run-dir") in lines[0]
    assert compiled == []

    # A holder killed with -9 leaves its line behind, but the kernel dropped its lock.
    (tmp_path / "lock").write_text("pid 999999999 on host gone\n")
    result, _ = run(tmp_path, "tiny", *[f"--set={s}" for s in SMALL])
    assert isinstance(result.exception, Compiling), result.output
    assert compiled[0][1] == f"pid {os.getpid()} on host {socket.gethostname()}\n"
    assert (tmp_path / "lock").read_text() == ""  # released: it names no one


def write_run_dir(run_dir, overrides):
    """What a run that failed before its first step leaves: its recipe, no checkpoint."""
    (run_dir / "checkpoints").mkdir(parents=True)
    recipe = load_recipe("tiny", overrides)
    (run_dir / "recipe.yaml").write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))


def test_a_run_that_trained_nothing_does_not_block_a_rerun_with_another_recipe(tmp_path,
                                                                              compiled):
    write_run_dir(tmp_path, SMALL)
    result, _ = run(tmp_path, "tiny", "--set=train.lr=0.01", *[f"--set={s}" for s in SMALL])
    assert isinstance(result.exception, Compiling), result.output
    assert compiled[0][0].train.lr == 0.01


def test_run_without_a_recipe_takes_the_run_dirs_own(tmp_path, compiled):
    write_run_dir(tmp_path, [*SMALL, "train.lr=0.01", "model.layers=3"])
    result, _ = run(tmp_path, "--steps", "7")
    assert isinstance(result.exception, Compiling), result.output
    recipe = compiled[0][0]
    assert (recipe.model.layers, recipe.train.lr, recipe.train.steps) == (3, 0.01, 7)
