"""The training loop: mesh, strategy, state (fresh or resumed), then step, log, checkpoint."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import jax
import numpy as np
import yaml
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from rich.console import Console

from lctrain.parallel import attention_kernels, describe_devices
from lctrain.parallel.layer_strategies import strategy_name
from lctrain.parallel.model_arithmetic import count_parameters, training_flops_per_token
from lctrain.recipes import Recipe
from lctrain.trainer.data.mixture import MixtureSource, long_token_share, tokens_per_source
from lctrain.trainer.data.provenance import write_record
from lctrain.trainer.data.sources import make_source
from lctrain.trainer.evaluation.evaluate import Evaluator
from lctrain.trainer.hf.weights import initial_state
from lctrain.trainer.outputs.failures import (DoesNotFit, RunFailure, is_out_of_memory,
                                              out_of_memory_message)
from lctrain.trainer.outputs.progress import Bar, timed
from lctrain.trainer.state.build import compile_run, device_batch, print_lines
from lctrain.trainer.state.checkpoint import Checkpointer
from lctrain.trainer.state.step import TrainState
from lctrain.trainer.train.init_from import InitFrom, stage_start
from lctrain.trainer.train.metrics import MetricsWriter, peak_flops
from lctrain.trainer.train.pipeline import LaggedFiniteCheck, Prefetcher
from lctrain.trainer.train.preflight import RunPlan, check_run
from lctrain.trainer.train.run_dir_lock import run_dir_lock


def train(recipe: Recipe, run_dir: Path, console: Console | None = None,
          devices=None, memory_limit: int | None = None,
          init_from: InitFrom | None = None) -> list[dict]:
    """Trains to recipe.train.steps on `devices` (default: all), resuming from run_dir's
    latest checkpoint; returns the metrics records it logged. `memory_limit` (bytes per
    device) overrides the device's memory in compile_run's fit check. `init_from` starts a
    new stage from another run's checkpoint (trainer/train/init_from.py). Nothing is built
    before the run's checks pass (preflight.check_run) and it holds run_dir's lock
    (run_dir_lock.py)."""
    is_main = jax.process_index() == 0
    console = Console(quiet=True) if not is_main else console or Console()
    checked = check_run(recipe, run_dir, devices, init_from, console)
    with run_dir_lock(run_dir):
        while True:
            try:
                return _train_checked(recipe, run_dir, console, devices, memory_limit, checked)
            except FirstStepOutOfMemory as failure:
                checked = _next_candidate(recipe, checked, failure, console)


class FirstStepOutOfMemory(DoesNotFit):
    """The first step found the devices full: its program did not load beside the state and
    the batches although the compiler accepted it. Nothing was trained or saved. `ran`:
    the (strategy, ulysses degree) whose program it was."""

    def __init__(self, message: str, ran: tuple = ()):
        super().__init__(message)
        self.ran = ran


def _next_candidate(recipe: Recipe, checked: RunPlan, failure: FirstStepOutOfMemory,
                    console: Console) -> RunPlan:
    """The checks with the strategies after the one that ran out of memory (auto's next,
    as when its compiled figure did not fit); the failure itself when none is left."""
    ran = failure.ran
    candidates = checked.devices.candidates
    rest = candidates[candidates.index(ran) + 1:] if ran in candidates else []
    if not rest:
        raise failure
    console.print(f"{strategy_name(*ran)}: {failure}; trying {strategy_name(*rest[0])}",
                  markup=False, soft_wrap=True)
    return checked._replace(devices=checked.devices._replace(candidates=rest))


def _train_checked(recipe: Recipe, run_dir: Path, console: Console, devices,
                   memory_limit: int | None, checked: RunPlan) -> list[dict]:
    """train() once its checks passed and it holds the run dir. From compiling on, the
    recipe is the run's: auto resolved, the attention kernel that fitted."""
    is_main = jax.process_index() == 0
    init_from = checked.init_from
    run = compile_run(recipe, devices, console, memory_limit, checked.devices)
    recipe, mesh, strategy, trainable = run.recipe, run.mesh, run.strategy, run.trainable
    train_step, compile_report = run.train_step, run.report
    source = make_source(recipe.data, vocab=recipe.model.vocab, seed=recipe.train.seed,
                         holdout=recipe.eval.data_holdout)
    evaluator = None
    if recipe.eval.every:
        evaluator = Evaluator(recipe, mesh, trainable.graphdef)
    run_dir.mkdir(parents=True, exist_ok=True)
    if is_main:
        (run_dir / "recipe.yaml").write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
        if checked.tokenizer_record is not None:
            write_record(run_dir, checked.tokenizer_record)
    checkpointer = Checkpointer(run_dir / "checkpoints", recipe.checkpoint)
    state, next_batch = (stage_start(init_from, recipe, trainable, run_dir, console) if init_from
                         else _initial_state(recipe, trainable, checkpointer, console))
    if int(state.step) >= recipe.train.steps:
        checkpointer.close()
        console.print(f"run dir {run_dir} is finished: step {int(state.step)} of train.steps "
                      f"{recipe.train.steps}; raise train.steps (--steps N) to train on",
                      markup=False, soft_wrap=True)
        return []
    if checked.rerun_note:
        console.print(checked.rerun_note, markup=False, soft_wrap=True)
    if isinstance(source, MixtureSource):
        seq_len = recipe.data.seq_len
        console.print(f"data: {len(source.components)} sources; "
                      f"{long_token_share(source, seq_len):.1%} of the tokens lie in "
                      f"documents longer than data.seq_len ({seq_len:,})", markup=False)
    order = strategy.sequence_order(recipe.data.seq_len)
    writer = MetricsWriter(run_dir, is_main, console, resumed_step=int(state.step))
    console.print(f"{describe_devices(mesh, recipe.runtime.cpu_devices)} | "
                  f"model {recipe.model.name}: {count_parameters(recipe.model):,} parameters | "
                  f"mesh {dict(mesh.shape)} | strategy {strategy.name} | "
                  f"attention {attention_kernels(recipe, mesh.devices.flatten())} | remat {recipe.remat.policy} | "
                  f"run dir {run_dir}", soft_wrap=True, markup=False)
    print_lines(console, compile_report)
    if recipe.train.run_warmup_steps < recipe.train.warmup_steps:
        console.print(f"note: train.warmup_steps {recipe.train.warmup_steps} is not shorter "
                      f"than train.steps {recipe.train.steps}: warming up over "
                      f"{recipe.train.run_warmup_steps} steps", soft_wrap=True)
    try:
        records = _run_steps(recipe, state, next_batch, source, order, mesh, train_step,
                             checkpointer, writer, evaluator)
    finally:
        checkpointer.close()
        writer.close()
    return records


def _initial_state(recipe: Recipe, trainable, checkpointer: Checkpointer, console: Console):
    latest = checkpointer.latest_step()
    if latest is None:
        return initial_state(recipe, trainable, console), 0
    with timed(console, f"resumed from checkpoint at step {latest}"):
        return checkpointer.restore(trainable.abstract_state)


class NonFiniteLoss(RunFailure):
    """The loss or gradients of a step were not finite and train.on_nonfinite is 'stop'."""


class StopSignal:
    """SIGTERM (what a TPU VM receives before maintenance) and SIGINT (Ctrl-C) ask the loop to
    checkpoint at the next step boundary and exit cleanly: 0 after SIGTERM, 130 after SIGINT,
    as a shell expects of an interrupted job. A second signal exits at once. Orbax renames a
    checkpoint only when it is complete, so the last complete one survives either way."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: int | None = None  # the first signal's number

    def __enter__(self):
        self.previous = {signum: signal.getsignal(signum) for signum in self.SIGNALS}
        for signum, handler in self.previous.items():
            # A background job of a non-interactive shell starts with SIGINT ignored, so
            # that the terminal's Ctrl-C is not meant for it: it stays ignored.
            if handler != signal.SIG_IGN:
                signal.signal(signum, self._handle)
        return self

    def __exit__(self, exc_type, *exc):
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        if exc_type is None and self.received == signal.SIGINT:
            # Raised after the loop's last save began; train()'s checkpointer.close() waits
            # for the save to finish before the process exits.
            raise SystemExit(128 + signal.SIGINT)

    def _handle(self, signum, frame):
        if self.received is not None:
            os._exit(128 + signum)
        self.received = signum

    @property
    def name(self) -> str:
        """The signal that stopped the run (SIGTERM when another process got it)."""
        return signal.Signals(self.received or signal.SIGTERM).name

    def agreed(self) -> bool:
        """Whether any process got the signal: all processes must stop at the same step."""
        if jax.process_count() == 1:
            return self.received is not None
        return bool(multihost_utils.process_allgather(
            np.array(self.received is not None)).any())


class Throughput:
    """Step time, tokens/s and MFU over the steps since the last report, compile excluded.
    A report of the first step alone covers its whole call, the program's load included:
    never less than the step took."""

    def __init__(self, recipe: Recipe, mesh: Mesh):
        self.tokens_per_step = recipe.data.batch_size * recipe.data.seq_len
        self.flops_per_step = (training_flops_per_token(recipe.model, recipe.data.seq_len)
                               * self.tokens_per_step)
        devices = mesh.devices.flatten()
        self.peak = peak_flops(devices[0].device_kind)
        self.chips = len(devices)
        self.restart()

    def restart(self) -> None:
        self.start, self.steps = time.perf_counter(), 0

    def report(self) -> dict[str, float]:
        step_time = (time.perf_counter() - self.start) / self.steps
        figures = {"step_time_s": step_time, "tokens_per_s": self.tokens_per_step / step_time}
        if self.peak:
            figures["mfu"] = self.flops_per_step / step_time / (self.peak * self.chips)
        self.restart()
        return figures


def _run_steps(recipe: Recipe, state: TrainState, next_batch: int, source, order, mesh,
               train_step, checkpointer: Checkpointer, writer: MetricsWriter,
               evaluator=None) -> list[dict]:
    total, console = recipe.train.steps, writer.console
    throughput = Throughput(recipe, mesh)
    records = []
    step = first_step = int(state.step)
    logged_batch = next_batch
    finite = LaggedFiniteCheck(lambda step, metrics: _on_nonfinite(
        recipe, step, metrics, checkpointer, console))
    with StopSignal() as stop, Bar(console, "train", total, step, summary=False) as bar, \
            Prefetcher(lambda index: device_batch(source, index, order, mesh),
                       next_batch) as batches:
        while step < total:
            state, metrics = _step(train_step, state, batches.get(next_batch), recipe,
                                   wait=step == first_step)
            step, next_batch = step + 1, next_batch + 1
            throughput.steps += 1
            finite.push(step, metrics)
            logging = step % recipe.runtime.log_every == 0 or step == total
            if step == first_step + 1:
                console.print(f"first step took "
                              f"{time.perf_counter() - throughput.start:.1f} s")
                if not logging:  # the program's load stays out of later reports
                    throughput.restart()
            figures = None
            if logging:
                record = {k: float(v) for k, v in jax.device_get(metrics).items()
                          if k != "finite"}
                record.update(throughput.report())
                record.update(_mixture_tokens(source, logged_batch, next_batch))
                logged_batch = next_batch
                writer.write(step, total, record)
                records.append({"step": step, **record})
                figures = f"loss {record['loss']:.4f} | {record['tokens_per_s']:,.0f} tok/s"
            bar.advance(figures)
            if evaluator and step % recipe.eval.every == 0:
                # Before the checkpoint of this step: a run resumed from it never repeats
                # this evaluation, and one killed before it redoes the steps and it alike.
                writer.write_eval(step, evaluator(state.params, f"step {step}", console))
                throughput.restart()
            stopping = stop.agreed()
            last = step == total or stopping
            if checkpointer.due(step, last):
                finite.flush()  # a non-finite state is never saved
            _save(checkpointer, state, step, next_batch, last, console)
            if stopping:
                console.print(f"{stop.name}: checkpoint saved at step {step}; exiting (run "
                              f"the same command again to resume)", soft_wrap=True)
                break
        finite.flush()
    return records


def _step(train_step, state: TrainState, batch, recipe: Recipe, wait: bool):
    """One step; `wait` for its result (the first). An out-of-memory failure is one line:
    the figure, and what the recipe has not yet tried. The first step's program loads
    beside the state and the prefetched batches, so a program the compiler accepted can
    still find the device full; it fails before changing anything, every checkpoint as
    it was."""
    try:
        state, metrics = train_step(state, batch)
        if wait:
            jax.block_until_ready(metrics)
    except Exception as err:
        if is_out_of_memory(err):
            message = out_of_memory_message(err, recipe)
            if wait:
                raise FirstStepOutOfMemory(
                    message, (recipe.parallel.strategy, recipe.parallel.ulysses)) from err
            raise DoesNotFit(message) from err
        raise
    return state, metrics


def _mixture_tokens(source, start: int, stop: int) -> dict[str, int]:
    """tokens/<source>: input tokens each source of a data mixture gave batches
    start..stop-1 (metrics.jsonl and TensorBoard); nothing for one source."""
    if not isinstance(source, MixtureSource):
        return {}
    return {f"tokens/{path}": count
            for path, count in tokens_per_source(source, start, stop).items()}


def _save(checkpointer: Checkpointer, state: TrainState, step: int, next_batch: int,
          force: bool, console: Console) -> None:
    """Saves when due; the devices wait only for the copy to the host, orbax writes the
    files in the background."""
    start = time.perf_counter()
    if checkpointer.save(state, step, next_batch, force=force):
        console.print(f"checkpoint at step {step}: copied off the devices in "
                      f"{time.perf_counter() - start:.1f} s, writing in the background",
                      soft_wrap=True)


def _on_nonfinite(recipe: Recipe, step: int, metrics, checkpointer: Checkpointer,
                  console: Console) -> None:
    loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
    if recipe.train.on_nonfinite == "skip":
        console.print(f"step {step}: loss {loss} / grad_norm {grad_norm} not finite; "
                      f"update skipped (train.on_nonfinite=skip)")
        return
    raise NonFiniteLoss(
        f"step {step}: loss {loss} / grad_norm {grad_norm} is not finite; stopped before "
        f"saving it (latest checkpoint: step {checkpointer.latest_step()}). Lower train.lr, "
        f"check the data, or set train.on_nonfinite=skip")
