"""Eight fake CPU devices for every test; must run before jax is imported anywhere."""

import atexit
import builtins
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from lctrain.trainer.train.runtime import fake_cpu_device_flags  # imports no jax

os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {fake_cpu_device_flags(8)}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Compiled-figure cache (parallel/planner/compiled.py): a fresh one per test process, so no
# test reads figures an earlier run left in ~/.cache.
os.environ["LCTRAIN_CACHE"] = tempfile.mkdtemp(prefix="lctrain-test-cache-")


def share_one_compilation_cache() -> None:
    """One persistent JAX compilation cache for the whole test run: the pytest-xdist
    workers inherit the folder the first process (the controller) made, and so do the
    lctrain processes tests start (tests/subprocess_env.py). Tests that build the same
    program again (a module fixture in both workers, every `lctrain run` of the tiny
    recipe, a restart after a kill) load it instead of compiling it. Fresh per run, so no
    test reads what an earlier run left; removed by the process that made it."""
    if "LCTRAIN_TEST_COMPILE_CACHE" not in os.environ:
        folder = tempfile.mkdtemp(prefix="lctrain-test-jax-cache-")
        os.environ["LCTRAIN_TEST_COMPILE_CACHE"] = folder
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["LCTRAIN_TEST_COMPILE_CACHE"]
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"


share_one_compilation_cache()

# `python -m pytest` from the repo root puts the root on sys.path, where our kernels/ folder
# shadows Hugging Face's `kernels` package that transformers looks for; lctrain itself is
# imported as the installed lctrain.* package, never from there.
ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]


@pytest.fixture
def without_libtpu(monkeypatch):
    """Importing libtpu fails, as on a machine without the tpu extra."""
    real_import = builtins.__import__

    def no_libtpu(name, *args, **kwargs):
        if name == "libtpu":
            raise ImportError("No module named 'libtpu'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_libtpu)


@pytest.fixture(scope="session")
def copy_model(tmp_path_factory):
    """(run dir, logged records) of the default recipe trained whole: the model that copies
    the first half of each window into the second. Trained once per test run: the first
    pytest-xdist worker to ask trains it under a file lock in the run's shared temporary
    folder, and the others read what it left there."""
    import fcntl
    import json

    shared = tmp_path_factory.getbasetemp().parent / "copy_model"
    shared.mkdir(exist_ok=True)
    records = shared / "records.json"
    with open(shared.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not records.exists():
            from lctrain.recipes import load_recipe
            from lctrain.trainer.train.loop import train

            logged = train(load_recipe("tiny", ["runtime.log_every=50"]), shared / "run")
            records.write_text(json.dumps(logged))
    return shared / "run", json.loads(records.read_text())
