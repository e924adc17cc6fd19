"""End to end: the default recipe learns, sharding and accumulation change nothing, and a
killed run resumes exactly where it was."""

import json
import re
import signal
import subprocess
import time

import jax
import numpy as np
import pytest
from rich.console import Console

from helpers import FAST_COMPILE, lctrain_run, one_worker
from lctrain.parallel import make_strategy
from lctrain.recipes import load_recipe
from lctrain.trainer.data.sources import make_source
from lctrain.trainer.state.build import device_batch, mesh_for
from lctrain.trainer.state.step import build_trainable, make_train_step
from lctrain.trainer.train.loop import train
from subprocess_env import subprocess_env


def run_steps(recipe, devices, steps=3):
    """Losses of `steps` train steps and the parameters after them; the step compiled at
    XLA:CPU's cheap optimization level (helpers.FAST_COMPILE), which changes no dtype."""
    mesh = mesh_for(recipe, devices)
    strategy = make_strategy(recipe, mesh)
    trainable = build_trainable(recipe, mesh)
    state = trainable.init()
    source = make_source(recipe.data, vocab=recipe.model.vocab, seed=recipe.train.seed)
    batches = [device_batch(source, index, strategy.sequence_order(recipe.data.seq_len), mesh)
               for index in range(steps)]
    options = FAST_COMPILE if jax.default_backend() == "cpu" else None
    step_fn = make_train_step(recipe, trainable, strategy, mesh).lower(
        state, batches[0]).compile(compiler_options=options)
    losses = []
    for batch in batches:
        state, metrics = step_fn(state, batch)
        losses.append(float(metrics["loss"]))
    return np.array(losses), jax.device_get(state.params)


SMALL = ["data.seq_len=64", "data.batch_size=8", "train.steps=10", "train.warmup_steps=2"]


@pytest.fixture(scope="module")
def single_device_run():
    return run_steps(load_recipe("tiny", SMALL), jax.devices()[:1])


@one_worker("test_train_single_device_run")
@pytest.mark.parametrize("overrides", [
    ["mesh.data=8"],
    ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
    ["mesh.data=1", "mesh.fsdp=8"],
    ["mesh.data=4", "mesh.tensor=2", "train.grad_accum_steps=2"],
])
def test_meshes_and_accumulation_match_one_device(single_device_run, overrides):
    """f32: losses of 3 steps and the parameters after them agree to 1e-5 relative."""
    losses, params = run_steps(load_recipe("tiny", SMALL + overrides), jax.devices())
    reference_losses, reference_params = single_device_run
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-5)
    assert losses[-1] < losses[0]
    for ours, reference in zip(jax.tree.leaves(params), jax.tree.leaves(reference_params)):
        np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=1e-6)


def test_default_recipe_learns_the_copy_task(copy_model):
    """Half of each sequence is a copy: only attention across the sequence can push the loss
    from about log(vocab) (4.8) towards half of it."""
    tmp_path, records = copy_model
    first, last = records[0]["loss"], records[-1]["loss"]
    assert last < 0.65 * first, (first, last)
    assert (tmp_path / "checkpoints" / "300").is_dir()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [50, 100, 150, 200, 250, 300]
    assert {"step", "loss", "grad_norm", "lr", "tokens_per_s", "step_time_s"} <= set(lines[0])

    # lctrain eval on the trained run, once: eval.task=needle reports the loss and accuracy
    # by position (what eval.task=loss reports) besides its retrieval. The copied half
    # (positions 129-255 of each window of 257 tokens) is predicted, the random first half
    # stays at chance (1/127).
    from lctrain.trainer.evaluation.evaluate import evaluate

    result = evaluate(load_recipe("tiny", ["eval.task=needle", "eval.lengths=1",
                                         "eval.depths=245"]), tmp_path)
    buckets = result["by_position"]
    assert len(buckets["edges"]) > 2 and sum(buckets["tokens"]) > 0, buckets
    for start, accuracy in zip(buckets["edges"], buckets["accuracy"]):
        if start >= 177:
            assert accuracy > 0.95, buckets
        elif 4 <= start < 122:
            assert accuracy < 0.05, buckets

    # A model known to copy: it predicts each token of the second half from 129 tokens
    # earlier. Token-level needles (key 2, value 4 tokens) at every depth of one 256-token
    # haystack: the answer (positions 252-255) is the copy of positions 123-126, where the
    # value sits only when the needle starts at 121, so retrieval succeeds at that depth
    # alone: needle placement and answer scoring are exact to the token.
    accuracy = np.array(result["retrieval"]["accuracy"][0])
    assert result["retrieval"]["lengths"] == [256]
    assert accuracy[121] > 0.85 and np.delete(accuracy, 121).max() < 0.3, accuracy


# A run to kill and resume: the default recipe, 30 steps of 64 tokens, a checkpoint every
# 2, each logged (tests/test_faults.py stops the same program, compiled once per test run).
RESUMABLE = ["train.steps=30", "checkpoint.every=2", "runtime.log_every=1", "data.seq_len=64"]


def resumable_run(run_dir):
    return lctrain_run(run_dir, *RESUMABLE)


def logged_records(run_dir):
    if not (run_dir / "metrics.jsonl").exists():
        return []
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses_by_step(run_dir):
    return {r["step"]: r["loss"] for r in logged_records(run_dir)}


def tensorboard_restarts(run_dir):
    """The step each TensorBoard events file starts at (its SessionLog START, from which
    TensorBoard hides the older files' events), in the order they were written."""
    from tensorboardX.proto.event_pb2 import Event, SessionLog

    starts = []
    for path in (run_dir / "tb").glob("events.out.tfevents.*"):
        data, offset = path.read_bytes(), 0
        while offset + 12 <= len(data):  # TFRecords: length, its CRC, the event, its CRC
            length = int.from_bytes(data[offset:offset + 8], "little")
            if offset + 16 + length > len(data):
                break  # a record a kill cut short
            event = Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 16 + length
            if event.session_log.status == SessionLog.START:
                starts.append((event.wall_time, event.step))
                break
    return [step for _, step in sorted(starts)]


def wait_until(condition, seconds=120):
    deadline = time.time() + seconds
    while time.time() < deadline and not condition():
        time.sleep(0.05)


def saving_now(run_dir):
    return any("tmp" in p.name for p in (run_dir / "checkpoints").glob("*")) if (
        run_dir / "checkpoints").exists() else False


def test_killed_twice_resumes_with_identical_losses(tmp_path):
    """SIGKILL at two points (the first while a checkpoint is being written, the second
    mid-training), then run to the end: every step's loss equals the uninterrupted run's,
    bit for bit, and metrics.jsonl holds each step once. Each kill costs a process start
    (the compile comes from the test run's cache, tests/subprocess_env.py); one of each
    kind covers both. The uninterrupted run trains here, on the same 8 fake devices and
    XLA flags as `lctrain run` (conftest.py, runtime.fake_cpu_device_flags), the same
    program without the checkpoints in between (a save must not change what follows)."""
    env = subprocess_env()
    uninterrupted = tmp_path / "uninterrupted"
    train(load_recipe(None, [*RESUMABLE, "checkpoint.every=0"]), uninterrupted,
          Console(quiet=True))

    killed = tmp_path / "killed"
    rng = np.random.default_rng(0)
    for round_ in range(2):
        reached = max(losses_by_step(killed), default=0)
        process = subprocess.Popen(resumable_run(killed), env=env, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        if round_ == 0:
            wait_until(lambda: saving_now(killed))
        else:
            target = reached + int(rng.integers(1, 5))
            wait_until(lambda: max(losses_by_step(killed), default=0) >= target)
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert max(losses_by_step(killed)) < 30
    resumed = subprocess.run(resumable_run(killed), check=True, env=env, capture_output=True,
                             text=True)
    resumed_at = int(re.search(r"resumed from checkpoint at step (\d+)", resumed.stdout)[1])
    # Each resume cut metrics.jsonl and TensorBoard back to its checkpoint's step: every
    # step appears once, in order.
    assert [r["step"] for r in logged_records(killed)] == list(range(1, 31))
    assert tensorboard_restarts(killed)[-1] == resumed_at + 1
    expected, got = losses_by_step(uninterrupted), losses_by_step(killed)
    np.testing.assert_array_equal([got[s] for s in range(1, 31)],
                                  [expected[s] for s in range(1, 31)])


# 64 tokens: 8 per device on mesh.context=8 (ring's load balancing: two chunks of 4).
FIRST_3 = ["train.steps=3", "train.warmup_steps=1", "runtime.log_every=1", "data.seq_len=64"]


@pytest.fixture(scope="module")
def one_device_records(tmp_path_factory):
    """The records of FIRST_3 trained on one device (strategy none), with a peak at which
    a 0.1 ms step would be 100% MFU (only the logged mfu sees it)."""
    from lctrain.trainer.train import loop

    recipe = load_recipe("tiny", FIRST_3 + ["checkpoint.every=0"])
    per_step = loop.training_flops_per_token(recipe.model, 64) * 64 * recipe.data.batch_size
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop, "peak_flops", lambda kind: per_step / 1e-4)
        return train(recipe, tmp_path_factory.mktemp("one"), devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def one_device_losses(one_device_records):
    return [r["loss"] for r in one_device_records]


@one_worker("test_train_one_device_losses")
@pytest.mark.parametrize("strategy, extra", [
    ("all_gather", []), ("ulysses", []), ("ring", []), ("usp", ["parallel.ulysses=2"]),
    ("auto", []),
])
def test_every_strategy_trains_like_one_device(tmp_path, monkeypatch, one_device_losses,
                                              strategy, extra):
    """The tiny recipe on mesh.context=8: the first 3 losses equal those of strategy none
    on a single device (to 1e-4, as the issue asks; f32 gives ~1e-6). The strategies' steps
    compile at XLA:CPU's cheap optimization level (helpers.FAST_COMPILE: the same dtypes),
    the reference at the default one."""
    from lctrain.trainer.state import build

    if jax.default_backend() == "cpu":
        monkeypatch.setattr(build, "compiler_options", lambda recipe, platform: FAST_COMPILE)
    recipe = load_recipe("tiny", FIRST_3 + [f"parallel.strategy={strategy}", "mesh.context=8",
                                          *extra])
    records = train(recipe, tmp_path)
    assert len(records) == 3
    np.testing.assert_allclose([r["loss"] for r in records], one_device_losses, rtol=1e-4)


def test_device_batch_reads_only_what_each_shard_needs():
    """Rows come from the source once per row range, reordered for load balancing."""
    recipe = load_recipe("tiny", ["parallel.strategy=ring", "mesh.data=2", "mesh.context=4",
                                "data.seq_len=64"])
    mesh = mesh_for(recipe)
    source = make_source(recipe.data, vocab=recipe.model.vocab, seed=0)
    calls = []
    original = source.batch
    source.batch = lambda index, rows=None: calls.append(rows) or original(index, rows)
    order = make_strategy(recipe, mesh).sequence_order(64)
    batch = device_batch(source, 3, order, mesh)
    assert sorted((s.start, s.stop) for s in calls) == [(0, 4), (4, 8)]
    np.testing.assert_array_equal(np.asarray(batch["inputs"]), original(3).inputs[:, order])
    np.testing.assert_array_equal(np.asarray(batch["positions"]),
                                  original(3).positions[:, order])


def test_logged_loss_is_the_cross_entropy_and_the_z_loss_is_apart():
    """With train.z_loss the objective is cross-entropy + z * logsumexp^2; the log shows
    the cross-entropy as `loss` (what perplexity comes from) and the z-loss beside it."""
    from lctrain.trainer.state.step import make_loss_sums

    sets = ["data.seq_len=64", "mesh.data=1"]
    recipe = load_recipe("tiny", [*sets, "train.z_loss=0.1"])
    mesh = mesh_for(recipe, jax.devices()[:1])
    strategy = make_strategy(recipe, mesh)
    trainable = build_trainable(recipe, mesh)
    state = trainable.init()
    source = make_source(recipe.data, vocab=recipe.model.vocab, seed=0)
    batch = device_batch(source, 0, None, mesh)

    def mean_loss(z_loss):
        sums = make_loss_sums(load_recipe("tiny", [*sets, f"train.z_loss={z_loss}"]),
                              trainable.graphdef, strategy)
        total, aux = jax.jit(sums)(state.params, batch)
        return float(total / aux.tokens)

    cross_entropy, objective = mean_loss(0.0), mean_loss(0.1)
    _, metrics = make_train_step(recipe, trainable, strategy, mesh)(state, batch)
    assert objective - cross_entropy > 0.1  # the z-loss term is not negligible here
    assert float(metrics["loss"]) == pytest.approx(cross_entropy, rel=1e-6)
    assert float(metrics["z_loss"]) == pytest.approx(objective - cross_entropy, rel=1e-5)


@one_worker("test_train_one_device_losses")  # the records of the strategies' reference run
def test_a_first_step_logged_alone_reports_its_whole_duration(one_device_records):
    """log_every 1: step 1's time covers its call (the program's load included), so it is
    no shorter than a later step and its MFU stays under 100%, with a peak at which a 0.1
    ms step would be 100%. The first report used to time the few microseconds after the
    step (MFU 261,743% on a v5e)."""
    records = one_device_records
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[0]["step_time_s"] >= records[1]["step_time_s"]
    assert all(r["mfu"] < 1 for r in records), records
