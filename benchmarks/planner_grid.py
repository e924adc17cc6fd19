"""Compiled per-chip memory of llama3.1-8b at 128K-8M tokens, the data the planner's memory
terms are checked and refitted against (issue 19; benchmarks/refit_planner.py reads it).

Every point is one train step compiled by XLA's TPU compiler on this CPU machine (libtpu
ahead of time, parallel/planner/compiled.py), for one strategy, remat policy, sequence
length and topology (remat: full, the layer inputs offloaded, or offloaded with the MLP
in chunks as recipes/llama3_8b_1m.yaml runs it, or as recipes/llama3_8b_128k.yaml does: "lean"). A point that fits records
memory_analysis()'s bytes; one XLA refuses records the bytes its RESOURCE_EXHAUSTED
message says it needs ("Used 97.24G of 95.74G hbm": binary units, the same sum of
arguments and program temporaries).

    python benchmarks/planner_grid.py                      # fit and heldout, resumable
    python benchmarks/planner_grid.py --grid small         # tests/test_planner.py's grid
    python benchmarks/planner_grid.py --list               # the points left, no compile
    python benchmarks/planner_grid.py --topology v5p:4x4x4 --limit 1
    python benchmarks/planner_grid.py --strategy ring --recompile-before 29ab51d

Each point is appended to benchmarks/data/planner_grid.jsonl as soon as it is compiled, and
points already there (same topology, settings and jax / libtpu versions) are skipped, so
the run can be stopped at any time and continued in another session. A change to the code
that moves the figures: --recompile-before REV compiles again the points stored from
commits before REV, each new record replacing its old one. Points run cheapest first
(fewer chips, shorter sequences). Each compile of the 8B model takes 2-3 GB of RAM and
1.5-5 minutes on two shared cores (v5p:2x2x1 and v5p:4x4x4 alike; some usp programs on
64 chips 20): run one process at a time. A compile that fails for another reason than
memory is stored with its error and fits = null (delete its line to retry it).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import json
import os
import subprocess
import time
from importlib import metadata
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "planner_grid.jsonl"

# benchmarks/RESULTS.md's compiled rows: llama3.1-8b in bf16, one sequence over every chip.
LLAMA = ("model.preset=llama3.1-8b", "model.dtype=bfloat16", "mesh.data=1",
         "mesh.context=-1", "data.batch_size=1", "attention.impl=pallas")
# The two small models of tests/test_planner.py's accuracy grid (its FULL_GRID, which
# CALIBRATION was first fitted on): kept here too so a refit can be checked against them
# from stored figures.
SMALL_BASE = ("model.dtype=bfloat16", "attention.impl=xla", "data.batch_size=1",
              "mesh.data=1", "mesh.context=4")
# Off the grids above: heads of 64 with the Pallas kernels (what lctrain picks on a TPU),
# whose [heads, tokens, head_dim] tensors a TPU pads to 128 lanes: issue 47's small model,
# and recipes/one_chip.yaml's narrow variant on one v5e chip, with heads of 64 and of 128.
NARROW_ONE_CHIP = ("model.dtype=bfloat16", "model.vocab=128256", "model.tie_embeddings=true",
                   "model.rope_theta=500000", "model.layers=8", "model.d_model=1024",
                   "model.d_ff=4096", "data.batch_size=1", "mesh.data=1", "mesh.context=1")
MODELS = {
    "llama3.1-8b": LLAMA,
    "small384": ("model.dtype=bfloat16", "data.batch_size=1", "mesh.data=1", "mesh.context=4",
                 "model.d_model=384", "model.n_heads=6", "model.n_kv_heads=2",
                 "model.layers=3"),
    "narrow_h64": (*NARROW_ONE_CHIP, "model.n_heads=16", "model.n_kv_heads=8",
                   "model.head_dim=64"),
    "narrow_h128": (*NARROW_ONE_CHIP, "model.n_heads=8", "model.n_kv_heads=4",
                    "model.head_dim=128"),
    "tiny512": (*SMALL_BASE, "model.d_model=512", "model.n_heads=8", "model.n_kv_heads=2",
                "model.d_ff=1536", "model.layers=2"),
    "mid": (*SMALL_BASE, "model.d_model=1024", "model.n_heads=8", "model.n_kv_heads=4",
            "model.d_ff=3584", "model.layers=4", "model.vocab=32768"),
}
REMAT = {"full": ("remat.policy=full",),
         "full_groups": ("remat.policy=full", "remat.layers_per_checkpoint=2"),
         "minimal": ("remat.policy=minimal",),
         "offload": ("remat.policy=custom", "remat.tensors={decoder_layer_input: offload}"),
         # recipes/one_chip.yaml's, in groups of two layers
         "one_chip_groups": ("remat.policy=custom", "remat.mlp_chunk_tokens=16384",
                             "remat.tensors={decoder_layer_input: offload, context: offload}",
                             "remat.layers_per_checkpoint=2")}
K, M = 2**10, 2**20
# recipes/llama3_8b_1m.yaml's MLP chunks (remat.mlp_chunk_tokens, whole sequence): 8192
# tokens per chip, so Point.overrides scales them with the chips; recipes/llama3_8b_128k.yaml's
# ("lean": with remat.recast_weights besides) 2048; "frontier": the 1M recipe's, with the
# weights recast per layer and one layer input in two saved (remat.layers_per_checkpoint=2,
# how 2M tokens come within 4 GB of 4 chips' HBM).
MLP_CHUNK_TOKENS_PER_CHIP = {"offload_mlp_chunks": 8 * K, "lean": 2 * K, "frontier": 8 * K}


@dataclasses.dataclass(frozen=True)
class Grid:
    cases: tuple[tuple[str, str, int], ...]     # (model, topology, tokens)
    remats: tuple[str, ...] = ("full", "offload")
    strategies: tuple[str, ...] = ("all_gather", "ulysses", "ring", "usp")
    # (remat, (model, topology, tokens)): cases compiled with one remat setting alone
    # (offload_mlp_chunks: recipes/llama3_8b_1m.yaml's; lean: recipes/llama3_8b_128k.yaml's)
    remat_cases: tuple[tuple[str, tuple[str, str, int]], ...] = ()


GRIDS = {
    # fitted on, and held out to check the fit
    "fit": Grid((("llama3.1-8b", "v5p:2x2x1", 128 * K), ("llama3.1-8b", "v5p:2x2x1", 512 * K),
                 ("llama3.1-8b", "v5p:4x4x4", 1 * M), ("llama3.1-8b", "v5p:4x4x4", 4 * M)),
                remat_cases=(("offload_mlp_chunks", ("llama3.1-8b", "v5p:2x2x1", 1 * M)),)),
    "heldout": Grid((("llama3.1-8b", "v5p:2x2x1", 256 * K), ("llama3.1-8b", "v5p:2x2x1", 1 * M),
                     ("llama3.1-8b", "v5p:4x4x4", 2 * M), ("llama3.1-8b", "v5p:4x4x4", 8 * M)),
                    remat_cases=(("offload_mlp_chunks", ("llama3.1-8b", "v5p:2x2x1", 512 * K)),
                                 ("offload_mlp_chunks", ("llama3.1-8b", "v5p:2x2x1", 2 * M)),
                                 ("lean", ("llama3.1-8b", "v5p:2x2x1", 128 * K)),
                                 ("full_groups", ("llama3.1-8b", "v5p:2x2x1", 128 * K)),
                                 ("frontier", ("llama3.1-8b", "v5p:2x2x1", 2 * M)))),
    # tests/test_planner.py's FULL_GRID (24 programs of a few seconds to minutes each)
    "small": Grid(tuple((model, "v5p:2x2x1", seq) for model in ("tiny512", "mid")
                        for seq in (8 * K, 32 * K)),
                  remats=("full", "minimal"), strategies=("all_gather", "ulysses", "ring")),
    "off_grid": Grid((("small384", "v5p:2x2x1", 12 * K),), remats=("full",),
                     strategies=("ring", "usp", "none"),
                     remat_cases=(("one_chip_groups", ("narrow_h64", "v5e:1x1", 256 * K)),
                                  ("one_chip_groups", ("narrow_h128", "v5e:1x1", 256 * K)))),
}


@dataclasses.dataclass(frozen=True)
class Point:
    grid: str
    topology: str
    strategy: str
    remat: str
    seq_len: int
    ulysses: int = 1          # usp: the degree the planner picks for the mesh
    model: str = "llama3.1-8b"

    @property
    def overrides(self) -> list[str]:
        """The `lctrain plan --set` strings of this point's recipe."""
        extra = [f"parallel.ulysses={self.ulysses}"] if self.strategy == "usp" else []
        return [*MODELS[self.model], f"data.seq_len={self.seq_len}",
                *remat_overrides(self.remat, self.topology),
                f"parallel.strategy={self.strategy}", *extra]


def remat_overrides(remat: str, topology: str) -> list[str]:
    """REMAT's settings, or (offload_mlp_chunks, lean, frontier) the offload ones with the
    MLP in chunks of MLP_CHUNK_TOKENS_PER_CHIP per chip (lean: and the weights recast per
    layer; frontier: recast, and in groups of two layers)."""
    if remat not in MLP_CHUNK_TOKENS_PER_CHIP:
        return list(REMAT[remat])
    from lctrain.parallel import chips
    chunk = MLP_CHUNK_TOKENS_PER_CHIP[remat] * chips.topology_device_count(topology)
    recast = ["remat.recast_weights=true"] if remat in ("lean", "frontier") else []
    groups = ["remat.layers_per_checkpoint=2"] if remat == "frontier" else []
    return [*REMAT["offload"], f"remat.mlp_chunk_tokens={chunk}", *recast, *groups]


def versions() -> dict[str, str | None]:
    """The installed jax and libtpu (None without the tpu extra: no point matches)."""
    def version(package: str) -> str | None:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return None
    return {"jax": version("jax"), "libtpu": version("libtpu")}


def point_key(topology: str, overrides: list[str], version: dict[str, str]) -> tuple:
    """What makes two records the same point (the grid name and git commit do not)."""
    return topology, tuple(sorted(overrides)), version["jax"], version["libtpu"]


def point_of(record: dict) -> Point:
    """The point a stored record was compiled for."""
    fields = {f.name: record[f.name] for f in dataclasses.fields(Point) if f.name in record}
    return Point(**fields)


def record_key(record: dict) -> tuple:
    return point_key(record["topology"], record["overrides"], record["versions"])


def load_records(path: Path = DATA) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def recipe_and_mesh(topology: str, overrides: list[str]):
    """The recipe of `overrides` and its resolved mesh axis sizes on `topology`."""
    from lctrain.parallel import chips
    from lctrain.recipes import check_against_devices, load_recipe
    recipe = load_recipe("tiny", overrides)
    return recipe, check_against_devices(recipe, chips.topology_device_count(topology))


def grid_points(names: list[str]) -> tuple[list[Point], list[str]]:
    """The points of the named grids the mesh allows (with the planner's own Ulysses degree
    for usp), cheapest first, and why the others are left out."""
    from lctrain.parallel import chips, planner
    points, skipped = [], []
    for name in names:
        grid = GRIDS[name]
        cases = [*itertools.product(grid.cases, grid.remats),
                 *((case, remat) for remat, case in grid.remat_cases)]
        for (model, topology, seq_len), remat in cases:
            # as `lctrain plan` asks: every strategy the mesh allows
            recipe, sizes = recipe_and_mesh(topology, [
                *MODELS[model], f"data.seq_len={seq_len}", *remat_overrides(remat, topology),
                "parallel.strategy=auto"])
            allowed, why_not = planner.candidates(recipe, sizes)
            degrees = dict(allowed)
            for strategy in grid.strategies:
                if strategy in degrees:
                    points.append(Point(name, topology, strategy, remat, seq_len,
                                        degrees[strategy], model))
                else:
                    skipped.append(f"{name} {model} {topology} {seq_len} {remat} {strategy}: "
                                   f"{why_not.get(strategy, 'not a candidate')}")
    points.sort(key=lambda p: (p.model == "llama3.1-8b", chips.topology_device_count(p.topology),
                               p.seq_len, p.remat != "full"))
    return points, skipped


def needed_bytes(error: str) -> dict[str, int]:
    """{"hbm_bytes" or, where XLA refused before adding the arguments, "temp_bytes": what
    the program needs, "capacity_bytes": what the chip has} from XLA's out-of-memory
    message ({} if it gives no figure)."""
    from lctrain.parallel.xla_failures import classify_message
    failure = classify_message(error)
    if failure.needed_bytes is None:
        return {}
    field = "temp_bytes" if failure.temporaries_only else "hbm_bytes"
    return {field: failure.needed_bytes, "capacity_bytes": failure.capacity_bytes}


def compile_point(point: Point, devices) -> dict:
    """One record: the point, the versions and commit, XLA's figures and the seconds."""
    from lctrain.parallel import planner
    from lctrain.trainer.state.build import compile_train_step
    recipe, _ = recipe_and_mesh(point.topology, point.overrides)
    start = time.monotonic()
    try:
        figures = planner.compile_figures(recipe, devices, compile_train_step)
    except Exception as err:  # kept as a record, so a resumed run does not retry it forever
        figures = {"hbm_bytes": None, "crashed": True,
                   "error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}
    seconds = time.monotonic() - start
    record = {**dataclasses.asdict(point), "overrides": point.overrides,
              "versions": versions(), "commit": _git_commit(),
              "compile_s": round(seconds, 1)}
    if figures.get("crashed"):
        record.update(fits=None, hbm_bytes=None, error=figures["error"])
    elif figures["hbm_bytes"] is None:
        record.update(fits=False, hbm_bytes=None, error=figures["error"],
                      **needed_bytes(figures["error"]))
    else:
        record.update(fits=True, hbm_bytes=figures["hbm_bytes"],
                      host_bytes=figures["host_bytes"], temp_bytes=figures["temp_bytes"],
                      argument_bytes=figures["argument_bytes"])
    return record


def store(record: dict, path: Path = DATA) -> None:
    """Appends the record (one line per point, kept if a later one crashes), replacing an
    earlier record of the same point."""
    path.parent.mkdir(exist_ok=True)
    kept = [r for r in load_records(path) if record_key(r) != record_key(record)]
    path.write_text("".join(json.dumps(r) + "\n" for r in [*kept, record]))


def _older_than(commit: str, rev: str) -> bool:
    """Whether a record's commit (HEAD, maybe with "+" and a hash of uncommitted changes)
    precedes `rev` in git's history."""
    head = commit.split("+")[0]
    found = subprocess.run(["git", "merge-base", "--is-ancestor", head, rev],
                           cwd=Path(__file__).resolve().parent, capture_output=True)
    same = subprocess.run(["git", "rev-parse", rev], cwd=Path(__file__).resolve().parent,
                          capture_output=True, text=True).stdout.strip() == head
    return found.returncode == 0 and not same


def _git_commit() -> str:
    """HEAD, plus a hash of the uncommitted changes to the code the program is built from
    (others edit the kernels while the grid runs): points with the same string compiled
    the same code."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True,
                              text=True).stdout
    head = git("rev-parse", "HEAD").strip()
    diff = git("diff", "HEAD", "--", "kernels", "parallel", "trainer", "recipes")
    return head + (f"+{hashlib.sha1(diff.encode()).hexdigest()[:10]}" if diff else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", action="append", choices=sorted(GRIDS),
                        help="grids to compile (repeat; default: fit and heldout)")
    parser.add_argument("--list", action="store_true", help="print the points, compile none")
    parser.add_argument("--topology", help="only the points on this topology, e.g. v5p:4x4x4")
    parser.add_argument("--limit", type=int, default=0, help="compile at most N points")
    parser.add_argument("--strategy", help="only the points of this strategy")
    parser.add_argument("--recompile-before", metavar="REV",
                        help="compile again the points stored from a commit older than REV "
                             "(a change to the code moved their figures); the new record "
                             "replaces the old")
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    points, skipped = grid_points(args.grid or ["fit", "heldout"])
    points = [p for p in points if args.topology in (None, p.topology)
              and args.strategy in (None, p.strategy)]
    for line in skipped:
        print(f"skip {line}")
    done = {record_key(r) for r in load_records()
            if not (args.recompile_before and _older_than(r["commit"], args.recompile_before))}
    todo = [p for p in points if point_key(p.topology, p.overrides, versions()) not in done]
    print(f"{len(points)} points, {len(points) - len(todo)} already in {DATA.name}")
    if args.list:
        for p in todo:
            print(f"todo {p.grid} {p.model} {p.topology} {p.seq_len} {p.remat} {p.strategy} "
                  f"u={p.ulysses}")
        return
    from lctrain.parallel import aot
    devices: dict[str, list] = {}
    for p in todo[:args.limit or None]:
        devices.setdefault(p.topology, aot.topology_devices(p.topology))
        record = compile_point(p, devices[p.topology])
        store(record)
        hbm = record["hbm_bytes"]
        print(f"{p.grid} {p.topology} {p.seq_len:,} {p.remat} {p.strategy} u={p.ulysses}: "
              f"{'fits' if record['fits'] else 'does not fit'}, "
              f"{hbm / 1e9 if hbm else float('nan'):.2f} GB, {record['compile_s']:.0f} s",
              flush=True)


if __name__ == "__main__":
    main()
