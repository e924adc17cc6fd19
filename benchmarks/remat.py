"""Per-chip memory of each remat policy (and of host offload), from XLA's TPU compiler
(libtpu ahead-of-time, no TPU needed).

For each case, compiles the recipe's full train step for a TPU topology and prints what
the compiled program says per chip: peak HBM (`peak_memory_in_bytes`: arguments plus the
temporaries live at the worst moment), the size of the temporaries' allocation
(`temp_size_in_bytes`, larger than what is live at the peak), the arguments (train state
and batch) and what lives in pinned host memory (offloaded activations: host temp;
offloaded optimizer state: host arguments). Beside them, the bytes the saved layer inputs
take from the shapes alone (layers x tokens per chip x d_model x dtype bytes): what `full`
keeps on the device and `offload` moves to the host.

    python benchmarks/remat.py                       # llama3.1-8b, v5p:4x4x4, 128K tokens/chip
    python benchmarks/remat.py --topology v5p:2x2x1 --preset tiny --seq-len 1024 \\
        --batch-size 32 --mesh data=4 --set model.layers=64 --set model.n_heads=2 \\
        --set model.n_kv_heads=1 --set attention.impl=xla --unit bytes   # tests/test_remat.py

Cases (--cases): full, minimal, save_all, offload (custom: decoder_layer_input offloaded,
the rest recomputed), minimal+offload (the matmul outputs on device, the layer input
offloaded), and opt_offload (full with optimizer.offload=true). Needs the tpu extra
(pip install -e '.[tpu]'); each case is one compile, minutes for an 8B model.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# The topology's devices need no TPU backend; keep jax off any accelerator here.
os.environ["JAX_PLATFORMS"] = "cpu"

import jax.numpy as jnp  # noqa: E402

from lctrain.parallel import aot  # noqa: E402
from lctrain.recipes import RecipeError, load_recipe  # noqa: E402
from lctrain.trainer.model.remat import MATMUL_OUTPUTS  # noqa: E402
from lctrain.trainer.state import build  # noqa: E402

CASES = {
    "full": ["remat.policy=full"],
    "minimal": ["remat.policy=minimal"],
    "save_all": ["remat.policy=save_all"],
    "offload": ["remat.policy=custom", "remat.tensors={decoder_layer_input: offload}"],
    "minimal+offload": ["remat.policy=custom", "remat.tensors={decoder_layer_input: offload, "
                        + ", ".join(f"{name}: device" for name in MATMUL_OUTPUTS) + "}"],
    "opt_offload": ["remat.policy=full", "optimizer.offload=true"],
}
DEFAULT_CASES = ("full", "minimal", "offload", "opt_offload")


UNITS = {"GiB": 2**30, "MiB": 2**20, "bytes": 1}


def in_unit(x: int, unit: str) -> str:
    return f"{x:,}" if unit == "bytes" else f"{x / UNITS[unit]:,.2f}"


def layer_input_bytes(recipe, devices: int) -> int:
    """What the layer scan saves for backward per chip: each layer's input [b, s, d_model]."""
    tokens_per_chip = recipe.data.batch_size * recipe.data.seq_len // devices
    return (recipe.model.layers * tokens_per_chip * recipe.model.d_model
            * jnp.dtype(recipe.model.dtype).itemsize)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topology", default="v5p:4x4x4")
    parser.add_argument("--preset", default="llama3.1-8b", help="model.preset")
    parser.add_argument("--seq-len", type=int, default=131072)
    parser.add_argument("--batch-size", type=int, default=64,
                        help="global sequences (default: one 128K sequence per chip)")
    parser.add_argument("--mesh", nargs="+", default=["data=1", "fsdp=-1"],
                        help="mesh axis sizes (default: fully sharded data parallel)")
    parser.add_argument("--set", dest="sets", action="append", default=[],
                        help="extra recipe override section.key=value (repeatable)")
    parser.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), choices=CASES)
    parser.add_argument("--unit", default="GiB", choices=UNITS)
    args = parser.parse_args(argv)

    devices = aot.topology_devices(args.topology)
    sets = [f"model.preset={args.preset}", "model.dtype=bfloat16", "attention.impl=pallas",
            f"data.seq_len={args.seq_len}", f"data.batch_size={args.batch_size}",
            *(f"mesh.{axis}" for axis in args.mesh), *args.sets]
    recipe = load_recipe("tiny", sets)
    saved = layer_input_bytes(recipe, len(devices))
    print(f"topology {args.topology}: {len(devices)} x {devices[0].device_kind}; "
          f"{' '.join(sets)}; {args.batch_size * args.seq_len // len(devices):,} tokens per chip")
    unit = args.unit
    print(f"per chip, {unit}; the layer inputs the scan saves (from the shapes): "
          f"{in_unit(saved, unit)}")
    width = 14 if unit == "bytes" else 10
    header = (f"{'case':<17}" + "".join(f"{name:>{width}}" for name in (
        "peak HBM", "temp", "args", "host temp", "host args")) + f"{'compile s':>11}")
    print(header)
    print("-" * len(header))
    for case in args.cases:
        start = time.perf_counter()
        try:
            compiled = build.compile_train_step(load_recipe("tiny", sets + CASES[case]), devices)
        except RecipeError as err:
            print(f"{case:<17}  skipped: {err}")
            continue
        except Exception as err:  # e.g. the compiler's out-of-memory report
            print(f"{case:<17}  failed: {str(err).splitlines()[0][:200]}", flush=True)
            continue
        seconds = time.perf_counter() - start
        memory = compiled.memory_analysis()
        figures = (memory.peak_memory_in_bytes, memory.temp_size_in_bytes,
                   memory.argument_size_in_bytes, memory.host_temp_size_in_bytes,
                   memory.host_argument_size_in_bytes)
        print(f"{case:<17}" + "".join(f"{in_unit(x, unit):>{width}}" for x in figures)
              + f"{seconds:>11.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
