"""Per-chip memory and collective traffic of each context-parallel strategy, from XLA's TPU
compiler (libtpu ahead-of-time, no TPU needed).

For each strategy and sequence length, compiles the recipe's full train step for a TPU
topology with mesh.context = the topology's device count and prints what the compiled
program needs per chip: temporaries, peak HBM, and the bytes each collective kind moves
per step (see lctrain.parallel.aot for the counting convention).

    python benchmarks/strategies.py --topology v5p:2x2x1 --preset tiny \\
        --seq-lens 8192 16384 32768 65536

The model is the preset widened by DEFAULT_SETS below; any --set replaces them all. Needs
the tpu extra (pip install -e '.[tpu]'). Each case is one compile: 20-60 s on an idle
2-core machine, minutes on a busy one.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# The topology's devices need no TPU backend; keep jax off any accelerator here.
os.environ["JAX_PLATFORMS"] = "cpu"

from lctrain.parallel import aot  # noqa: E402
from lctrain.recipes import RecipeError, load_recipe  # noqa: E402
from lctrain.trainer.state import build  # noqa: E402

STRATEGIES = ("all_gather", "ulysses", "ring", "usp")
# A tiny-preset model widened to head_dim 128 (TPU lanes) with GQA, compiled in bf16.
DEFAULT_SETS = ("model.d_model=1024", "model.n_heads=8", "model.n_kv_heads=4",
                "model.d_ff=2048", "model.layers=2", "model.dtype=bfloat16",
                "attention.impl=xla")
KIND_COLUMNS = (("all-gather", "AG"), ("reduce-scatter", "RS"), ("all-reduce", "AR"),
                ("all-to-all", "A2A"), ("collective-permute", "CP"))


def usp_degree(n_heads: int, context: int) -> int | None:
    """Largest Ulysses degree u with 1 < u < context dividing both; None if there is none."""
    for u in range(context - 1, 1, -1):
        if context % u == 0 and n_heads % u == 0:
            return u
    return None


def case_overrides(strategy: str, seq_len: int, args, context: int, n_heads: int):
    """--set overrides of one case, or None when the strategy cannot run it."""
    sets = [f"parallel.strategy={strategy}", f"mesh.context={context}", "mesh.data=1",
            "mesh.fsdp=1", "mesh.tensor=1", f"data.seq_len={seq_len}",
            f"data.batch_size={args.batch_size}"]
    if strategy == "ulysses" and n_heads % context:
        return None
    if strategy == "usp":
        degree = args.usp_ulysses or usp_degree(n_heads, context)
        if not degree:
            return None
        sets.append(f"parallel.ulysses={degree}")
    return sets


def mib(x: int) -> str:
    return f"{x / 2**20:,.1f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topology", default="v5p:2x2x1")
    parser.add_argument("--preset", default="tiny", help="model.preset")
    parser.add_argument("--recipe", default=None, help="recipe file (default: built-in tiny)")
    parser.add_argument("--set", dest="sets", action="append", default=None,
                        help="recipe override section.key=value (repeatable; default: "
                             + " ".join(DEFAULT_SETS) + ")")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    parser.add_argument("--usp-ulysses", type=int, default=0,
                        help="usp's Ulysses degree (default: the largest proper one)")
    args = parser.parse_args(argv)

    devices = aot.topology_devices(args.topology)
    context = len(devices)
    sets = [f"model.preset={args.preset}", *(DEFAULT_SETS if args.sets is None else args.sets)]
    model = load_recipe(args.recipe, sets).model
    print(f"topology {args.topology}: {context} x {devices[0].device_kind}; mesh.context="
          f"{context}; model {args.preset} {' '.join(sets[1:])} (layers {model.layers}, heads "
          f"{model.n_heads}/{model.n_kv_heads} kv, head_dim {model.head_dim}, {model.dtype}); "
          f"batch {args.batch_size}")
    print("per chip, MiB; collectives: bytes each chip receives per step, by kind; 'own': "
          "the part sent inside the strategy's shard_map (the rest: parameter gathers, gradient "
          "reductions, what XLA's partitioner adds)")
    header = (f"{'strategy':<11}{'seq_len':>8}{'temp':>10}{'hbm':>10}"
              + "".join(f"{short:>9}" for _, short in KIND_COLUMNS) + f"{'own':>9}"
              + f"{'compile s':>11}")
    print(header)
    print("-" * len(header))
    for strategy in args.strategies:
        for seq_len in args.seq_lens:
            case = case_overrides(strategy, seq_len, args, context, model.n_heads)
            if case is None:
                print(f"{strategy:<11}{seq_len:>8}  skipped: the heads allow no such split")
                continue
            try:
                recipe = load_recipe(args.recipe, sets + case)
                start = time.perf_counter()
                stats = aot.compiled_stats(build.compile_train_step(recipe, devices))
            except RecipeError as err:
                print(f"{strategy:<11}{seq_len:>8}  skipped: {err}")
                continue
            seconds = time.perf_counter() - start
            print(f"{strategy:<11}{seq_len:>8}{mib(stats.temp_bytes):>10}{mib(stats.hbm_bytes):>10}"
                  + "".join(f"{mib(stats.collective_bytes[kind]):>9}" for kind, _ in KIND_COLUMNS)
                  + f"{mib(sum(stats.shard_map_collective_bytes.values())):>9}"
                  + f"{seconds:>11.1f}"
                  + (f"  ({stats.unknown_trip_counts} loops of unknown trip count)"
                     if stats.unknown_trip_counts else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
