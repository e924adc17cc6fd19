"""Two processes x 4 CPU devices (gloo collectives) train exactly like one process x 8,
and save and restore checkpoints across processes."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
from rich.console import Console
from typer.testing import CliRunner

from helpers import lctrain_run
from lctrain.cli.main import app
from lctrain.recipes import load_recipe
from lctrain.trainer.hf.safetensors_io import SafetensorsFolder
from lctrain.trainer.train.distributed import several_tpu_hosts
from lctrain.trainer.train.loop import train
from subprocess_env import subprocess_env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ring_settings(*settings, steps=4):
    # A constant learning rate after warmup (min_lr_ratio 1), so that a run to 4 steps
    # resumed to 6 follows the same schedule as a run to 6.
    return [f"train.steps={steps}", "train.warmup_steps=1", "train.min_lr_ratio=1.0",
            "runtime.log_every=1", "checkpoint.every=2", "data.seq_len=64", "mesh.data=2",
            "mesh.context=4", "parallel.strategy=ring", *settings]


def ring_run(run_dir, *settings, steps=4):
    return lctrain_run(run_dir, *ring_settings(*settings, steps=steps))


def losses(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


ENV = subprocess_env()  # the resume and export starts load what the first ones compiled


def two_processes(run_dir, steps, command=None):
    """`command` (default: ring_run(run_dir, steps=steps)) in two processes of 4 devices."""
    coordinator = f"127.0.0.1:{free_port()}"
    command = command or ring_run(run_dir, "runtime.cpu_devices=4", steps=steps)
    processes = [subprocess.Popen(
        [*command, "--coordinator", coordinator, "--num-processes", "2", "--process-id", str(i)],
        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in processes]
    assert [p.returncode for p in processes] == [0, 0], outputs[0][-2000:]
    return outputs


def test_two_processes_match_one_and_resume_across_processes(tmp_path, monkeypatch):
    """The one-process references (a 6-step run, an export) run here, on this process's 8
    fake devices (conftest.py), as `lctrain run` would on its own."""
    monkeypatch.setenv("XLA_FLAGS", os.environ["XLA_FLAGS"])  # the CLI's start appends to it
    single = tmp_path / "single"
    train(load_recipe(None, ring_settings(steps=6)), single, Console(quiet=True))

    multi = tmp_path / "multi"
    outputs = two_processes(multi, steps=4)
    assert "step 4/4" in outputs[0] and "step 4/4" not in outputs[1]  # process 0 logs
    assert (multi / "checkpoints" / "4").is_dir()
    # Both processes restore the step-4 checkpoint they wrote together and go on.
    outputs = two_processes(multi, steps=6)
    assert "resumed from checkpoint at step 4" in outputs[0]
    np.testing.assert_allclose(losses(multi), losses(single), rtol=1e-5)
    assert len(losses(multi)) == 6

    # Export gathers one tensor at a time across the processes; process 0 writes the same
    # files one process writes.
    exported = {}
    for name, processes in (("one", 1), ("two", 2)):
        arguments = ["export", str(multi), str(tmp_path / name), "--dtype", "float32"]
        if processes == 1:
            result = CliRunner().invoke(app, [*arguments, "--set", "runtime.cpu_devices=8"])
            assert result.exit_code == 0, result.output
        else:
            two_processes(multi, 6, [sys.executable, "-m", "lctrain.cli.main", *arguments])
        exported[name] = SafetensorsFolder(tmp_path / name)
    assert set(exported["one"].entries) == set(exported["two"].entries)
    for tensor in exported["one"].entries:
        np.testing.assert_array_equal(exported["two"].read(tensor), exported["one"].read(tensor))


def test_only_several_tpu_hosts_start_jax_distributed():
    """A single-host TPU VM's runtime sets TPU_WORKER_HOSTNAMES=localhost (seen on a lent
    v5e); jax.distributed.initialize() there asks the cloud's metadata server and failed
    where it was unreachable. Only a list of hosts, or several slices, needs it."""
    assert not several_tpu_hosts({})
    assert not several_tpu_hosts({"TPU_WORKER_HOSTNAMES": "localhost"})
    assert several_tpu_hosts({"TPU_WORKER_HOSTNAMES": "10.0.0.2,10.0.0.3"})
    assert several_tpu_hosts({"TPU_WORKER_HOSTNAMES": "localhost",
                              "MEGASCALE_COORDINATOR_ADDRESS": "10.0.0.2:8080"})
