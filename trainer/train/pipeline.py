"""Keeping the host off the step loop's critical path.

Batches. A background thread builds the next global batches (reading the source,
reordering for the strategy, placing the shards on the devices) while the devices run the
current step, `depth` batches ahead. A thread, not grain: every source is a pure
function of the batch index (no iterator state to checkpoint), its work is numpy reads
and copies that release the GIL, and one thread per host keeps up with a step that takes
seconds at long context; grain's worker processes would add a dependency and pickling for
nothing here. Indices are built in order, so the batches are exactly those the loop would
have built itself, and an error in the thread reaches the loop at the batch it hit.

Finiteness. Reading a step's `finite` flag makes the host wait for that step. The loop
reads each flag one step late, after it has dispatched the next step, so the devices
always have the next step queued; before a checkpoint it reads the flag at once, so a
non-finite state is never saved.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable


class Prefetcher:
    """Global batches first, first + 1, ... built by `build(index)` on a thread."""

    def __init__(self, build: Callable[[int], Any], first: int, depth: int = 2):
        self._build = build
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(first,), daemon=True,
                                        name="lctrain-batches")
        self._thread.start()

    def get(self, index: int) -> Any:
        """Batch `index`: the next one in order (what the loop asks for)."""
        built, batch, error = self._queue.get()
        if error is not None:
            raise error
        if built != index:
            raise RuntimeError(f"batch {index} asked for, {built} built: batches are read "
                               f"in order")
        return batch

    def _fill(self, index: int) -> None:
        while not self._stopping.is_set():
            try:
                item = (index, self._build(index), None)
            except BaseException as error:  # handed to the loop, raised there
                item = (index, None, error)
            if not self._put(item) or item[2] is not None:
                return
            index += 1

    def _put(self, item) -> bool:
        while not self._stopping.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def close(self) -> None:
        self._stopping.set()
        self._thread.join()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LaggedFiniteCheck:
    """Calls `on_nonfinite(step, metrics)` for a step whose metrics["finite"] is false,
    read one step late (`push`) or at once (`flush`)."""

    def __init__(self, on_nonfinite: Callable[[int, dict], None]):
        self._on_nonfinite = on_nonfinite
        self._pending: tuple[int, dict] | None = None

    def push(self, step: int, metrics: dict) -> None:
        """Records this step's metrics, and checks the previous step's."""
        self.flush()
        self._pending = (step, metrics)

    def flush(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None and not bool(pending[1]["finite"]):
            self._on_nonfinite(*pending)
