"""Per-chip memory of `lctrain eval` (forward only: loss and accuracy by position) from XLA's
TPU compiler, at long evaluation lengths (libtpu ahead-of-time, no TPU needed).

    python benchmarks/eval_memory.py                 # the 1M recipe on v5p:2x2x1, 1M and 2M
    python benchmarks/eval_memory.py --recipe recipes/llama3_8b_1m.yaml --topology v5p:2x2x1 \\
        --seq-lens 1048576 2097152 4194304

Each length is one compile of the recipe's eval step (its mesh, strategy and kernel) with
eval.seq_len set; minutes each for an 8B model. Needs the tpu extra.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ["JAX_PLATFORMS"] = "cpu"  # the topology's devices need no TPU backend

from lctrain.parallel import aot, chips  # noqa: E402
from lctrain.recipes import load_recipe  # noqa: E402
from lctrain.trainer.evaluation.evaluate import compile_eval_step  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/llama3_8b_1m.yaml")
    parser.add_argument("--topology", default="v5p:2x2x1")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1048576, 2097152])
    parser.add_argument("--set", dest="sets", action="append", default=[])
    args = parser.parse_args()
    devices = aot.topology_devices(args.topology)
    hbm = chips.chip_named(args.topology).per_device().hbm_bytes
    print(f"{args.recipe} eval step on {args.topology} ({len(devices)} devices, "
          f"{hbm / 1e9:.2f} GB HBM each)")
    for seq_len in args.seq_lens:
        recipe = load_recipe(args.recipe, [f"eval.seq_len={seq_len}", *args.sets])
        start = time.perf_counter()
        stats = aot.compiled_stats(compile_eval_step(recipe, devices))
        print(f"eval.seq_len {seq_len:>10,}: {stats.hbm_bytes / 1e9:6.2f} GB per device "
              f"(parameters {stats.argument_bytes / 1e9:.2f} GB, temporaries "
              f"{stats.temp_bytes / 1e9:.2f} GB) -> "
              f"{'fits' if stats.hbm_bytes <= hbm else 'does not fit'} "
              f"[compiled in {time.perf_counter() - start:.0f} s]", flush=True)


if __name__ == "__main__":
    main()
