"""XLA's own figures beside the estimate: compile each strategy's train step for a TPU
topology (parallel/aot.py, libtpu, no TPU needed) and recommend by what the compiler says.

A compile of a large recipe takes minutes and several GB of host memory, so figures are
cached on disk, one JSON file per (recipe, devices, jax, libtpu, lctrain sources, XLA
flags) under compile_cache_dir(); and the strategies of one plan compile in parallel
processes where cores and memory allow (compile_workers).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import multiprocessing
import os
import re
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, ContextManager

from lctrain.parallel.chips import Chip
from lctrain.parallel.planner.choice import recommend
from lctrain.parallel.planner.estimate import recipe_for_plan
from lctrain.parallel.planner.results import ABORTED, REFUSED, Plan, fits_as_compiled
from lctrain.parallel.xla_failures import classify
from lctrain.recipes import RecipeError
from lctrain.recipes.schema import Recipe

# What compiles a recipe's train step for devices: trainer.state.build.compile_train_step, which
# the caller hands in (the planner sits below the trainer and imports none of it).
CompileStep = Callable[[Recipe, list], Any]

# What the compiling functions wrap each compile in, given its label (the CLI shows a
# spinner and the elapsed time: each compile can take minutes). What it yields may take a
# new `label` and an `outcome` printed instead of the time (trainer.outputs.progress.Timing).
Timer = Callable[[str], ContextManager]

# Host memory one compile may take: llama3.1-8b at 1M tokens on v5p:2x2x1 peaks at several
# GB in XLA's TPU compiler; a process per compile beyond what memory holds would swap.
COMPILE_HOST_BYTES = 8 * 2**30

# The code that builds the train step: an edit to it invalidates the cached figures.
_COMPILED_PACKAGES = ("lctrain.trainer", "lctrain.parallel", "lctrain.kernels",
                      "lctrain.recipes")

# A fatal log line of libtpu (absl): severity F, date, time, thread, file:line], message.
_FATAL_LINE = re.compile(r"^F\d{4} [\d:.]+\s+\d+ ([\w./-]+:\d+)\] ")

# What the cache key reads of each device (a multi-slice device also has a slice_index).
_DEVICE_FIELDS = ("platform", "device_kind", "coords", "core_on_chip", "slice_index")


def compile_figures(recipe: Recipe, devices, compile_step: CompileStep) -> dict:
    """XLA's own per-device figures for the recipe's train step on `devices` (a TPU
    topology from parallel.aot.topology_devices): {"hbm_bytes", "host_bytes",
    "collective_bytes"}, or {"hbm_bytes": None, "error": ...} when XLA refuses the program:
    because its temporaries exceed the chip's HBM (it does not fit), or with an error of
    its own (e.g. UNIMPLEMENTED for a collective it cannot emit: "compiler failed: ..."), or
    when the device checks refuse the recipe first ("refused before compiling: ...")."""
    from lctrain.parallel import aot
    no_figures = {"hbm_bytes": None, "host_bytes": None, "collective_bytes": None}
    try:
        stats = aot.compiled_stats(compile_step(recipe, devices))
    except RecipeError as err:                    # the device checks, before compiling
        return {**no_figures, "error": f"{REFUSED}: {err}"}
    except Exception as err:                      # XLA's errors come as JaxRuntimeError
        if (failure := classify(err)) is None:
            raise
        return {**no_figures, "error": failure.recorded}
    return {"hbm_bytes": stats.hbm_bytes,
            "host_bytes": stats.host_temp_bytes + stats.host_argument_bytes,
            "collective_bytes": dict(stats.collective_bytes),
            "temp_bytes": stats.temp_bytes, "argument_bytes": stats.argument_bytes,
            "peak_bytes": stats.peak_bytes}


def compiled_fits(figures: dict, chip: Chip) -> bool:
    """fits_as_compiled, of compile_figures' figures."""
    return fits_as_compiled(figures.get("hbm_bytes"), figures.get("host_bytes"),
                            chip.host_bytes)


# --------------------------------------------------------------------- cache ----

def compile_cache_dir() -> Path:
    """$LCTRAIN_CACHE/compiled, else $XDG_CACHE_HOME/lctrain/compiled, else
    ~/.cache/lctrain/compiled."""
    root = os.environ.get("LCTRAIN_CACHE")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        root = Path(xdg) / "lctrain"
    return Path(root) / "compiled"


@functools.cache
def _toolchain() -> dict:
    """What else decides the compiled program: jax, jaxlib, libtpu, lctrain's own sources."""
    def version(package: str) -> str | None:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    sources = hashlib.sha256()
    for package in _COMPILED_PACKAGES:
        folder = Path(importlib.util.find_spec(package).submodule_search_locations[0])
        for path in sorted(folder.rglob("*.py")):
            sources.update(f"{package}/{path.relative_to(folder)}".encode() + b"\0"
                           + path.read_bytes())
    return {"jax": version("jax"), "jaxlib": version("jaxlib"), "libtpu": version("libtpu"),
            "lctrain_sources": sources.hexdigest()}


def cache_key(recipe: Recipe, devices) -> str | None:
    """The cache file's name for this recipe on these devices; None when the devices are
    not real device descriptions (nothing to key on, so nothing is cached)."""
    if not all(hasattr(d, "device_kind") for d in devices):
        return None
    key = {"recipe": recipe.to_dict(),
           "devices": [[getattr(d, field, None) for field in _DEVICE_FIELDS] for d in devices],
           "env": {name: os.environ.get(name) for name in ("XLA_FLAGS", "LIBTPU_INIT_ARGS")},
           **_toolchain()}
    text = json.dumps(key, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def read_cached(key: str | None) -> dict | None:
    if key is None:
        return None
    try:
        return json.loads((compile_cache_dir() / f"{key}.json").read_text())
    except (OSError, ValueError):           # absent, or cut short by a crash
        return None


def write_cached(key: str | None, figures: dict) -> None:
    if key is None:
        return
    folder = compile_cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f"{key}.{os.getpid()}.tmp"
    partial.write_text(json.dumps(figures))
    partial.replace(folder / f"{key}.json")     # whole or absent, for concurrent readers


def _finish(timing, label: str, outcome: str) -> None:
    """Tells the timer's line its label and outcome (a plain context manager yields None)."""
    if timing is not None:
        timing.label, timing.outcome = label, outcome


def cached_figures(recipe: Recipe, devices, compile_step: CompileStep, label: str,
                   timed: Timer, use_cache: bool = True) -> dict:
    """compile_figures under the timer, or (use_cache) what an earlier compile of the same
    key recorded, the timer's line then saying "cached"."""
    key = cache_key(recipe, devices) if use_cache else None
    with timed(label) as timing:
        figures = read_cached(key)
        if figures is not None:
            _finish(timing, label, "cached")
            return figures
        figures = compile_figures(recipe, devices, compile_step)
    write_cached(key, figures)
    return figures


# ------------------------------------------------------------------ parallel ----

def compile_workers(jobs: int) -> int:
    """Processes for `jobs` compiles: no more than the cores, nor than the available
    memory holds at COMPILE_HOST_BYTES each (at least one)."""
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(1, min(jobs, os.cpu_count() or 1, available // COMPILE_HOST_BYTES))


def _compile_in_worker(make_devices: Callable[[], list], compile_step: CompileStep,
                       recipe: Recipe, stderr_path: str) -> tuple[dict, float]:
    """Runs in a fresh process: the devices are rebuilt there (they do not pickle). Its
    native stderr goes to `stderr_path`, where the parent finds the compiler's last words
    if libtpu aborts the process."""
    with open(stderr_path, "wb") as log:
        os.dup2(log.fileno(), 2)
    devices = make_devices()
    start = time.perf_counter()
    return compile_figures(recipe, devices, compile_step), time.perf_counter() - start


def aborted_figures(stderr: str) -> dict:
    """The figures of a compile whose process died: no memory figures, and the compiler's
    own reason (libtpu's first fatal line, e.g. "Check failed: ...") as the error."""
    fatal = next(filter(None, map(_FATAL_LINE.match, stderr.splitlines())), None)
    if fatal:
        reason = f"{fatal.string[fatal.end():].strip()} ({fatal.group(1)})"
    else:
        lines = [line.strip() for line in stderr.splitlines() if line.strip()]
        reason = lines[-1][:200] if lines else "the compiling process died without a word"
    return {"hbm_bytes": None, "host_bytes": None, "collective_bytes": None,
            "error": f"{ABORTED}: {reason}"}


def _one_compile(make_devices: Callable[[], list], compile_step: CompileStep, recipe: Recipe,
                 folder: str, label: str) -> tuple[ProcessPoolExecutor, Future, str]:
    """A process of its own for one compile, so that libtpu aborting it (a failed CHECK
    kills the whole process) costs that compile alone."""
    context = multiprocessing.get_context("spawn")  # a forked jax runtime is not safe
    pool = ProcessPoolExecutor(max_workers=1, mp_context=context)
    stderr_path = os.path.join(folder, hashlib.sha256(label.encode()).hexdigest()[:16])
    return pool, pool.submit(_compile_in_worker, make_devices, compile_step, recipe,
                             stderr_path), stderr_path


def _outcome(future: Future, stderr_path: str) -> tuple[dict, float | None]:
    try:
        return future.result()
    except BrokenProcessPool:
        return aborted_figures(Path(stderr_path).read_text(errors="replace")), None


def compile_in_processes(jobs: dict[str, Recipe], make_devices: Callable[[], list],
                         compile_step: CompileStep, workers: int,
                         timed: Timer) -> dict[str, dict]:
    """{label: figures} for {label: recipe}, each compiled in a spawned process of its
    own, `workers` at a time; each compile is reported as it finishes, with its own
    compile time. A compile whose process the compiler aborts gets aborted_figures."""
    results = {}
    waiting = list(jobs.items())
    running: dict[Future, tuple[str, ProcessPoolExecutor, str]] = {}
    with tempfile.TemporaryDirectory(prefix="lctrain-compile-") as folder:
        while waiting or running:
            while waiting and len(running) < workers:
                label, recipe = waiting.pop(0)
                pool, future, stderr_path = _one_compile(make_devices, compile_step, recipe,
                                                         folder, label)
                running[future] = (label, pool, stderr_path)
            names = ", ".join(label.removeprefix("compiled ").split(",")[0]
                              for label, _, _ in running.values())
            with timed(f"compiling {names} ({len(running)} processes)") as timing:
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                finished = next(iter(done))
                label, pool, stderr_path = running.pop(finished)
                results[label], seconds = _outcome(finished, stderr_path)
                pool.shutdown()
                _finish(timing, label, "aborted" if seconds is None else f"{seconds:.1f} s")
    return results


# ---------------------------------------------------------------------- plan ----

def attach_compiled(result: Plan, recipe: Recipe, devices, compile_step: CompileStep,
                    timed: Timer = lambda _: nullcontext(), *,
                    make_devices: Callable[[], list] | None = None,
                    workers: int | None = None, use_cache: bool = True) -> None:
    """Compiles every strategy of the plan for `devices`, records XLA's figures and
    recommends again by them. Figures come from the cache where it has them; the rest
    compile in parallel processes when `make_devices` (picklable, e.g.
    functools.partial(aot.topology_devices, topology)) rebuilds the devices there and
    `workers` (default compile_workers) is above one."""
    labels = {f"compiled {p.name}, seq {recipe.data.seq_len:,}, for {len(devices)} devices": p
              for p in result.plans}
    variants = {label: recipe_for_plan(recipe, p) for label, p in labels.items()}
    keys = {label: cache_key(variant, devices) if use_cache else None
            for label, variant in variants.items()}
    missing = [label for label in labels if read_cached(keys[label]) is None]
    workers = compile_workers(len(missing)) if workers is None else min(workers, len(missing))
    fresh = {}
    if make_devices is not None:  # in processes of their own even one at a time: see
        # _one_compile
        fresh = compile_in_processes({label: variants[label] for label in missing},
                                     make_devices, compile_step, workers, timed)
        for label, figures in fresh.items():
            write_cached(keys[label], figures)
    for label, strategy_plan in labels.items():
        strategy_plan.compiled = fresh.get(label) or cached_figures(
            variants[label], devices, compile_step, label, timed, use_cache)
    result.choice, result.reason = recommend(result.plans)
