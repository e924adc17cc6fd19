"""Failures a long run meets: preemption (SIGTERM), non-finite numbers, bad data files."""

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rich.console import Console
from typer.testing import CliRunner

from lctrain.cli.main import app
from lctrain.recipes import load_recipe
from lctrain.trainer.state.optimizer import make_optimizer
from lctrain.trainer.train import loop
from subprocess_env import subprocess_env


def logged_steps(run_dir):
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


@contextlib.contextmanager
def sigint_not_ignored():
    """A background job of a non-interactive shell (CI's runner) starts with SIGINT ignored,
    and a child inherits that, unlike one started from a terminal. A handler is reset to the
    default in an exec'd child; preexec_fn would run Python in a fork of JAX's threads."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def stopped(command, signum, after_step):
    """`command` in a process of its own, sent `signum` once its metrics.jsonl logs step
    `after_step`; its return code and stdout."""
    run_dir = command[command.index("--run-dir") + 1]
    with sigint_not_ignored():
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                   text=True, env=subprocess_env())
    deadline = time.time() + 300   # a start on a busy machine (minutes at load 14)
    while time.time() < deadline and max(logged_steps(Path(run_dir)), default=0) < after_step:
        time.sleep(0.05)
    process.send_signal(signum)
    output, _ = process.communicate(timeout=120)
    return process.returncode, output


SETTINGS = ["train.steps=30", "checkpoint.every=1000", "runtime.log_every=1", "data.seq_len=64"]


def test_sigterm_and_sigint_each_save_at_the_step_reached_and_resume_continues(tmp_path):
    """SIGTERM (preemption) exits 0, SIGINT (Ctrl-C) 130 as a shell expects; both save
    first. One run dir: stopped by SIGTERM, resumed and stopped by SIGINT, resumed to the
    end, which logs every step once (two process starts, not two per signal, and the last
    resume in this process)."""
    # tests/test_train.py's resumable run (the same program, compiled once per test run)
    # without its checkpoints every 2 steps.
    command = [sys.executable, "-m", "lctrain.cli.main", "run", "--run-dir", str(tmp_path),
               *(arg for setting in SETTINGS for arg in ("--set", setting))]
    reached = 0
    for signum, exit_code in ((signal.SIGTERM, 0), (signal.SIGINT, 130)):
        returncode, output = stopped(command, signum, reached + 5)
        assert returncode == exit_code, output
        if reached:
            assert f"resumed from checkpoint at step {reached}" in output
        before, reached = reached, max(logged_steps(tmp_path))
        assert before + 5 <= reached < 30
        saved = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()
                       if p.name.isdigit())
        assert saved == [step for step in (before, reached) if step]  # checkpoint.keep 2
        assert f"{signal.Signals(signum).name}: checkpoint saved at step {reached}" in output
        assert logged_steps(tmp_path) == list(range(1, reached + 1))

    # The resume to the end runs here (the same recipe on this process's 8 fake devices, as
    # `lctrain run` would: tests/test_multihost.py does the same), not in a third process.
    console = Console(file=io.StringIO(), width=200)
    loop.train(load_recipe(None, SETTINGS), tmp_path, console)
    assert f"resumed from checkpoint at step {reached}" in console.file.getvalue()
    assert logged_steps(tmp_path) == list(range(1, 31))


def test_nonfinite_step_stops_before_saving(tmp_path, monkeypatch):
    """Step 3 is not finite: its flag is read a step late, but before step 4's checkpoint."""
    real_compile_run = loop.compile_run

    def poisoned(*args, **kwargs):
        run = real_compile_run(*args, **kwargs)

        def step(state, batch):
            state, metrics = run.train_step(state, batch)
            return state, {**metrics, "finite": metrics["finite"] & (state.step != 3)}
        return run._replace(train_step=step)

    monkeypatch.setattr(loop, "compile_run", poisoned)
    recipe = load_recipe("tiny", ["train.steps=10", "train.warmup_steps=1", "checkpoint.every=2",
                                "data.seq_len=64"])
    with pytest.raises(loop.NonFiniteLoss, match=r"^step 3: .*latest checkpoint: step 2"):
        loop.train(recipe, tmp_path)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2"]


def test_skip_leaves_parameters_and_moments_untouched():
    recipe = load_recipe("tiny", ["train.on_nonfinite=skip"])
    optimizer = make_optimizer(recipe.train)
    params = {"w": jnp.ones(3)}
    state = optimizer.init(params)
    bad = {"w": jnp.array([1.0, jnp.nan, 0.0])}
    updates, after_bad = optimizer.update(bad, state, params)
    np.testing.assert_array_equal(updates["w"], 0.0)
    for before, after in zip(jax.tree.leaves(state), jax.tree.leaves(after_bad)):
        if jnp.issubdtype(jnp.asarray(before).dtype, jnp.floating):
            np.testing.assert_array_equal(before, after)
    _, after_good = optimizer.update({"w": jnp.ones(3)}, after_bad, params)
    changed = [not np.array_equal(before, after) for before, after in
               zip(jax.tree.leaves(after_bad), jax.tree.leaves(after_good))]
    assert any(changed)  # a finite step does update the moments


def bad_token_file(kind, directory):
    path = directory / {"missing": "missing.bin", "empty": "empty.bin", "truncated": "odd.bin",
                        "floats": "float.npy"}[kind]
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "truncated":
        path.write_bytes(b"\x01\x00\x02")  # 3 bytes of uint16 tokens
    elif kind == "floats":
        np.save(path, np.ones(1000))
    return path


@pytest.mark.parametrize("kind, words", [
    ("missing", "no such file"), ("empty", "empty"), ("truncated", "truncated"),
    ("floats", "integer"),
])
def test_bad_token_file_fails_before_training(tmp_path, kind, words):
    path = bad_token_file(kind, tmp_path)
    result = CliRunner().invoke(app, ["run", "--set", f"data.source={path}",
                                      "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 2
    assert words in result.output.lower() and path.name in result.output
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("signum, exit_code", [(signal.SIGTERM, None), (signal.SIGINT, 130)],
                         ids=["SIGTERM", "SIGINT"])
def test_a_second_stop_signal_exits_at_once(monkeypatch, signum, exit_code):
    """The first SIGTERM or Ctrl-C only asks for a checkpoint at the next step boundary; a
    second one (an impatient scheduler or user) exits the process immediately with 128 +
    the signal, without waiting for the step or the save. A hard exit mid-save leaves
    orbax's unfinished directory behind and the last complete checkpoint usable (the SIGKILL
    test in test_train.py resumes from exactly that). Ctrl-C's stop ends in exit 130 once
    the loop is left."""
    exits = []
    monkeypatch.setattr(loop.os, "_exit", exits.append)
    # Not SIG_IGN, which StopSignal leaves alone (a background job may inherit it), nor a
    # KeyboardInterrupt into pytest should StopSignal not take SIGINT.
    previous = signal.signal(signal.SIGINT, lambda signum, frame: None)
    try:
        with pytest.raises(SystemExit) if exit_code else contextlib.nullcontext() as ended:
            with loop.StopSignal() as stop:
                os.kill(os.getpid(), signum)
                time.sleep(0.05)            # Python runs the handler between bytecodes
                assert stop.agreed() and exits == []
                os.kill(os.getpid(), signum)
                time.sleep(0.05)
                assert exits == [128 + signum]
        assert signal.getsignal(signum) != stop._handle
    finally:
        signal.signal(signal.SIGINT, previous)
    assert (ended.value.code if exit_code else None) == exit_code
