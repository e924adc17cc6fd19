"""What a TPU holds for a compiled train step, against memory_analysis()'s figures.

    python benchmarks/compiled_vs_chip.py                      # 80K-229K tokens, as in RESULTS.md
    python benchmarks/compiled_vs_chip.py --seq-lens 98304 --remat full

Each row compiles the train step of a small Llama-shaped model (4 layers, d_model 2048,
vocab 32K, bf16, Pallas attention) for the one local TPU chip (on a TPU lctrain leaves
the memory check to the compiler), and prints memory_analysis()'s sum (arguments + outputs - aliased + temporaries: what
`lctrain plan --compile` shows, and MaxText prints), its temporaries and its
peak_memory_in_bytes. It then runs two steps and prints what the runtime holds: the
arguments in use and what it reserved for the program's temporaries (memory_stats). A
program XLA's TPU compiler refuses (RESOURCE_EXHAUSTED) is a row that says so.

Without a TPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import sys

import jax

from lctrain.parallel.aot import memory_stats
from lctrain.parallel.native_stderr import shown_only_on_failure
from lctrain.recipes import load_recipe
from lctrain.trainer.data.sources import make_source
from lctrain.trainer.hf.weights import initial_state
from lctrain.trainer.state.build import compile_run, device_batch

MODEL = ["model.head_dim=128", "model.vocab=32000", "model.dtype=bfloat16", "model.layers=4",
         "model.d_model=2048", "model.n_heads=16", "model.n_kv_heads=4", "model.d_ff=8192",
         "attention.impl=pallas", "mesh.data=1", "mesh.context=-1", "data.batch_size=1",
         "checkpoint.every=0", "train.warmup_steps=1", "train.steps=3"]
REMAT = {"full": ["remat.policy=full"],
         "offload2": ["remat.policy=custom", "remat.tensors={decoder_layer_input: offload}",
                      "remat.layers_per_checkpoint=2", "remat.mlp_chunk_tokens=16384"]}
GIB = 2**30


def measure(remat: str, seq_len: int) -> str:
    """One row, in GiB (the unit of the runtime's own limit)."""
    recipe = load_recipe("tiny", [*MODEL, f"data.seq_len={seq_len}", *REMAT[remat]])
    head = f"{remat:<9}{seq_len:>8}"
    try:
        run = compile_run(recipe)  # on a TPU the compiler's own check only
    except Exception as err:  # noqa: BLE001 - XLA's refusal is the row
        return f"{head}  not compiled: {str(err).splitlines()[0][:160]}"
    recipe = run.recipe
    analysis, stats = run.train_step.memory_analysis(), memory_stats(run.train_step)
    source = make_source(recipe.data, vocab=recipe.model.vocab, seed=0, holdout=0)
    order = run.strategy.sequence_order(seq_len)
    state = initial_state(recipe, run.trainable)
    for index in range(2):
        state, metrics = run.train_step(state, device_batch(source, index, order, run.mesh))
    loss = float(metrics["loss"])
    held = jax.local_devices()[0].memory_stats()
    return (f"{head}{stats.hbm_bytes / GIB:>8.2f}{stats.temp_bytes / GIB:>8.2f}"
            f"{analysis.peak_memory_in_bytes / GIB:>8.2f}{held['bytes_in_use'] / GIB:>9.2f}"
            f"{held['bytes_reserved'] / GIB:>10.2f}{held['bytes_limit'] / GIB:>8.2f}"
            f"   ran, loss {loss:.3f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--remat", nargs="+", default=["full", "offload2"], choices=REMAT)
    parser.add_argument("--seq-lens", type=int, nargs="+",
                        default=[81920, 98304, 131072, 196608, 229376])
    args = parser.parse_args(argv)
    with shown_only_on_failure():  # libtpu's start-up warnings where no TPU is attached
        backend = jax.default_backend()
    if backend != "tpu":
        print(f"no TPU here (jax's backend is {backend}): nothing to measure")
        return 0
    print(f"one {jax.devices()[0].device_kind} chip; GiB per chip")
    print(f"{'remat':<9}{'seq_len':>8}{'sum':>8}{'temp':>8}{'peak':>8}{'in use':>9}"
          f"{'reserved':>10}{'limit':>8}")
    for remat in args.remat:
        for seq_len in args.seq_lens:
            print(measure(remat, seq_len), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
