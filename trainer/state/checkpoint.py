"""Checkpoints through orbax: async saves, the newest `keep` kept, resume from the latest.

Orbax writes each step into a temporary folder and renames it when complete, so a crash
mid-save leaves the previous checkpoint as the latest one.
"""

from __future__ import annotations

import logging
import sys
from contextlib import contextmanager
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from lctrain.recipes.schema import CheckpointConfig
from lctrain.trainer.outputs.failures import CheckpointError, is_out_of_memory
from lctrain.trainer.state.step import TrainState


class Checkpointer:
    def __init__(self, directory: Path, cfg: CheckpointConfig):
        self.every = cfg.every
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=cfg.keep, create=True,
                                                 enable_async_checkpointing=True))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def restore(self, abstract_state: TrainState,
                step: int | None = None) -> tuple[TrainState, int]:
        """Checkpoint `step` (default: the latest complete one) as (state, index of the next
        data batch), into the shardings of `abstract_state`."""
        step = self.manager.latest_step() if step is None else step
        with self._reading(step):
            restored = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
        return TrainState(*restored.state), int(restored.data["next_batch"])

    def restore_params(self, abstract_params: dict, step: int | None = None) -> dict:
        """The parameters alone of checkpoint `step` (default: the latest), into the
        shardings of `abstract_params`: the optimizer state is never read."""
        step = self.manager.latest_step() if step is None else step
        restore_args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding),
                                    abstract_params)
        with self._reading(step):
            restored = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(item={"params": abstract_params},
                                             restore_args={"params": restore_args},
                                             partial_restore=True)))
        return restored.state["params"]

    def saved_shapes(self, step: int) -> dict:
        """The train state of checkpoint `step` as a tree of orbax's array metadata (shape,
        dtype; no array is read): {'step': ..., 'params': ..., 'opt_state': ...}."""
        with self._reading(step):
            return ocp.StandardCheckpointHandler().metadata(
                self.directory / str(step) / "state").tree

    @contextmanager
    def _reading(self, step: int):
        """Orbax's failures (a file deleted or truncated, shapes that do not match) as one
        CheckpointError naming the step's folder; out-of-memory passes through as it is."""
        _quiet_abandoned_reads()
        try:
            yield
        except Exception as err:
            if is_out_of_memory(err):
                raise
            first_line = (str(err).strip().splitlines() or [""])[0][:300]
            raise CheckpointError(
                f"{self.directory / str(step)}: cannot restore checkpoint step {step} "
                f"({type(err).__name__}: {first_line}); delete that folder to resume from the "
                f"checkpoint before it, or use a new run dir") from err

    def due(self, step: int, force: bool = False) -> bool:
        """Whether `save` would save `step`: on the interval (or forced), not saved yet."""
        on_interval = self.every > 0 and step % self.every == 0
        return (on_interval or force) and step not in self.manager.all_steps()

    def save(self, state: TrainState, step: int, next_batch: int, *, force: bool = False) -> bool:
        """Saves when `step` is on the interval (or forced); returns whether it saved."""
        if not self.due(step, force):
            return False
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave({"next_batch": next_batch})))
        return True

    def close(self) -> None:
        """Waits for the async save in flight, so the process never exits mid-write."""
        self.manager.wait_until_finished()
        self.manager.close()


def _quiet_abandoned_reads() -> None:
    """When a restore fails, orbax closes its event loop while tensorstore's other reads are
    still in flight; their threads then report "Event loop is closed" as an unraisable error
    (a bare traceback on stderr, before, among or after the one line that says what failed),
    and asyncio logs "Task (or Future) exception was never retrieved" at exit, with the
    failed read's message over many lines. Both are dropped from before the first read on,
    since they race with the failure itself. Installed once."""
    if getattr(sys.unraisablehook, "drops_closed_loop_reads", False):
        return
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        if not (isinstance(unraisable.exc_value, RuntimeError)
                and "Event loop is closed" in str(unraisable.exc_value)):
            previous(unraisable)

    hook.drops_closed_loop_reads = True
    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(
        lambda record: "exception was never retrieved" not in record.getMessage())


def saved_steps(directory: Path) -> list[int]:
    """The complete checkpoints in `directory`, oldest first; none where it does not exist.
    Creates nothing, so a mistyped path stays absent."""
    directory = Path(directory).absolute()
    if not directory.is_dir():
        return []
    manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(create=False))
    try:
        return sorted(manager.all_steps())
    finally:
        manager.close()
