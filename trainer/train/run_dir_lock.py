"""One `lctrain run` per run dir at a time: two would interleave their metrics, write the same
checkpoint steps and kill each other's saves in orbax.

The lock is a flock(2) on the run dir's `lock` file, held for the run's lifetime. The kernel
drops it when its process ends, however it ends (kill -9 included), so a lock left by a dead
run is stale by construction and the next run simply takes it. The file names the holder
(pid and host) for the message a refused run prints. Only process 0 of a multi-process run
takes it; the others learn its outcome, so no process trains when process 0 cannot.
"""

from __future__ import annotations

import fcntl
import os
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import jax
import numpy as np
from jax.experimental import multihost_utils

from lctrain.recipes.schema import RecipeError

LOCK_FILE = "lock"


class RunDirInUse(RecipeError):
    """Another process holds the run dir's lock."""


@contextmanager
def run_dir_lock(run_dir: Path) -> Iterator[None]:
    """Holds run_dir's lock for the block (process 0 alone); RunDirInUse, on every process,
    when another run holds it."""
    is_main, handle = jax.process_index() == 0, None
    try:
        if is_main:
            handle = _acquire(run_dir)
    finally:  # the others wait for process 0's outcome, whatever it is
        locked = _agree(not is_main or handle is not None)
    if not locked:
        raise RunDirInUse(f"run dir {run_dir}: process 0 could not take its lock (another "
                          f"run holds it); see process 0's message")
    try:
        yield
    finally:
        if handle is not None:
            _release(handle)


def _acquire(run_dir: Path):
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    # Opened without truncating: the holder's line must survive for the refusal message.
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise RunDirInUse(
            f"run dir {run_dir} is in use by lctrain {holder} ({path}); wait for that run to "
            f"end or stop it, or give another --run-dir") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on host {socket.gethostname()}\n")
    handle.flush()
    return handle


def _release(handle) -> None:
    # Emptied before unlocking, so the file never names a process that no longer holds it.
    handle.truncate(0)
    handle.close()


def _agree(locked: bool) -> bool:
    """Whether process 0 holds the lock, on every process: one that went on alone would
    wait for process 0 in its first collective."""
    if jax.process_count() == 1:
        return locked
    return bool(multihost_utils.broadcast_one_to_all(np.array(locked)))
