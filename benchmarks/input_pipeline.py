"""The input pipeline off the critical path (trainer/train/pipeline.py), measured on this host.

    python benchmarks/input_pipeline.py [--steps 60] [--sleep-ms 0 40]

Trains the built-in tiny recipe on one CPU device four ways: batches built in the step
loop (as before: a stand-in for the Prefetcher that builds on demand) or on the
prefetch thread, with the source as it is or slowed by an injected sleep per batch.
Prints the median ms per step of the logged steps after the first. With the thread, a
slow source's time hides behind the step's compute (ms/step stays near the larger of
the two); in the loop it adds to it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before jax: no libtpu start-up on a CPU host


class InTheLoop:
    """Prefetcher's interface, building each batch when asked (the old loop)."""

    def __init__(self, build, first, depth=2):
        self._build = build

    def get(self, index):
        return self._build(index)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def slowed(make_source, seconds: float):
    """make_source whose sources sleep `seconds` per batch read."""
    def make(*args, **kwargs):
        source = make_source(*args, **kwargs)
        read = source.batch

        def batch(index, rows=None):
            time.sleep(seconds)
            return read(index, rows)

        source.batch = batch
        return source
    return make


def ms_per_step(steps: int, sleep_ms: float, prefetch: bool) -> float:
    from lctrain.recipes import load_recipe
    from lctrain.trainer.train import loop

    recipe = load_recipe("tiny", [f"train.steps={steps}", "runtime.log_every=1", "mesh.data=1",
                                "runtime.cpu_devices=1", "checkpoint.every=0"])
    real_make, real_prefetcher = loop.make_source, loop.Prefetcher
    loop.make_source = slowed(real_make, sleep_ms / 1e3)
    loop.Prefetcher = real_prefetcher if prefetch else InTheLoop
    try:
        with tempfile.TemporaryDirectory() as run_dir:
            records = loop.train(recipe, Path(run_dir), Console(quiet=True))
    finally:
        loop.make_source, loop.Prefetcher = real_make, real_prefetcher
    return statistics.median(r["step_time_s"] for r in records[1:]) * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--sleep-ms", type=float, nargs="+", default=[0.0, 40.0])
    args = parser.parse_args(argv)
    print(f"tiny recipe, 1 CPU device, {args.steps} steps: median ms per step")
    print(f"{'source sleep ms':>16}{'in the loop':>14}{'prefetched':>13}")
    for sleep_ms in args.sleep_ms:
        loop_ms = ms_per_step(args.steps, sleep_ms, prefetch=False)
        thread_ms = ms_per_step(args.steps, sleep_ms, prefetch=True)
        print(f"{sleep_ms:>16.0f}{loop_ms:>14.1f}{thread_ms:>13.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
