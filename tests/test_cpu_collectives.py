"""XLA:CPU and collectives inside shard_map: what lctrain orders itself, and the case it
cannot (kept as a repro).

jax lowers every collective of a shard_map with the same channel id (1), and XLA:CPU's
in-process communicator meets a collective's devices by that id while its thunk executor
runs independent collectives as their inputs become ready, in an order that can differ
from device to device. Two independent permutes can then meet across devices: one
device's K send with another's V send (wrong data), or a rendezvous short of a device
(on jax 0.12 an abort after 40 s). The ring orders its own sends on CPU
(parallel/ring.sends_in_order: in order within a step, the backward's after the forward's
result), which tests/test_ring.py's short rings check on jax 0.12. What it cannot order is
two ring forwards that XLA puts in one computation: a one-layer model under full remat,
where the layer loop of one iteration is inlined and the recomputed forward of the
backward is independent of the first forward.

XLA:CPU's concurrency-optimized scheduler is what lets those two forwards interleave on
jax 0.12. Turned off there (trainer/train/runtime.fake_cpu_device_flags, used by the tests
and `runtime.cpu_devices`), jax 0.12 runs the repro below bit-identical every time. On jax
0.10 turning it off breaks other rings, so the flag is not set and the repro fails: its
first step's loss differs from the same step's repeats (or is NaN), or the process dies
(6 runs in 6 on two loaded cores; it has also deadlocked, two devices in an all-gather and
one in a permute). A race is no test: on jax 0.10 the repro is skipped, on jax 0.12 it
must hold.
"""

import json
import subprocess
import sys

import pytest

from lctrain.trainer.train.runtime import fake_cpu_device_flags, jaxlib_at_least
from subprocess_env import subprocess_env

REPEATS = 4
ONE_LAYER_RING = ("from lctrain.recipes import load_recipe; import sys, jax, json; "
                  "from lctrain.trainer.state import build; "
                  "from lctrain.trainer.data.sources import make_source; "
                  "from lctrain.trainer.hf.weights import initial_state; "
                  "r = load_recipe('tiny', sys.argv[1:]); run = build.build_run(r, jax.devices()); "
                  "src = make_source(r.data, vocab=r.model.vocab, seed=0, holdout=0); "
                  "order = run.strategy.sequence_order(r.data.seq_len); "
                  "print(json.dumps([float(run.train_step(initial_state(r, run.trainable), "
                  "build.device_batch(src, 0, order, run.mesh))[1]['loss']) "
                  f"for _ in range({REPEATS})]))")
SETS = ["model.layers=1", "data.seq_len=1024", "data.batch_size=2", "mesh.context=4",
        "remat.policy=full", "runtime.cpu_devices=8"]


def losses_of_repeated_steps(strategy: str) -> list[float] | str:
    """The first step's loss, computed REPEATS times by one compiled train step in a
    fresh process; the way the process ended where it did not finish."""
    env = {**subprocess_env(), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": (
        f"{fake_cpu_device_flags(8)} "
        "--xla_cpu_collective_call_warn_stuck_timeout_seconds=5 "
        "--xla_cpu_collective_call_terminate_timeout_seconds=10")}
    done = subprocess.run([sys.executable, "-c", ONE_LAYER_RING, *SETS,
                           f"parallel.strategy={strategy}"], capture_output=True, text=True,
                          env=env, timeout=600)
    if done.returncode != 0:
        return f"exit {done.returncode}"
    return json.loads(done.stdout.splitlines()[-1])


def test_one_layer_all_gather_steps_are_bit_identical():
    """The same program with all_gather: its gathers each meet all devices at once, so the
    repro below is about the ring's permutes, not the rest of the step."""
    losses = losses_of_repeated_steps("all_gather")
    assert isinstance(losses, list) and len(set(losses)) == 1, losses


JAX_0_10 = not jaxlib_at_least(0, 12)


@pytest.mark.skipif(JAX_0_10, reason="XLA:CPU of jax 0.10 meets the permutes of the two "
                                      "ring forwards across devices, by a race (module "
                                      "docstring): neither a pass nor a failure is certain")
def test_one_layer_ring_steps_under_full_remat_are_bit_identical():
    losses = losses_of_repeated_steps("ring")
    assert isinstance(losses, list) and len(set(losses)) == 1, losses
