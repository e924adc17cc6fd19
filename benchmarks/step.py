"""Train-step speed on this machine's accelerator: step time, tokens/s and MFU.

    python benchmarks/step.py                                # 1B and 3B at 32K, 64K
    python benchmarks/step.py --models 8b --seq-lens 131072  # where it fits
    python benchmarks/step.py --json step.json --set attention.impl=xla

Each row compiles the full train step (forward, backward, AdamW; full remat, bf16
activations, f32 weights) of a Llama-shaped model on all local devices with the recipe's
own choices (parallel.strategy=auto), then times --steps steps after one warm-up. MFU is
the run's own figure (trainer/train/loop.Throughput): 6 x parameters plus the causal
attention FLOPs per token, over the chips' dense bf16 peak (parallel/chips.py).

Without an accelerator (jax's backend is the CPU) it says so and exits 0: a CPU step says
nothing about speed. A model that does not fit is a row that says so.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax

from lctrain.parallel.native_stderr import shown_only_on_failure
from lctrain.recipes import load_recipe
from lctrain.trainer.data.sources import make_source
from lctrain.trainer.hf.weights import initial_state
from lctrain.trainer.outputs.failures import RunFailure
from lctrain.trainer.state.build import compile_run, device_batch
from lctrain.trainer.train.loop import Throughput

LLAMA = ["model.vocab=128256", "model.dtype=bfloat16",
         "model.rope_theta=500000"]
# Llama 3.2 1B and 3B, and Llama 3.1 8B: the shapes of the published configs; "1b-h128" is
# 1B's widths with 32 heads of 128, the shape of the first rows timed on a v5e.
LLAMA_1B = [*LLAMA, "model.layers=16", "model.d_model=2048", "model.n_heads=32",
            "model.n_kv_heads=8", "model.d_ff=8192", "model.tie_embeddings=true"]
MODELS = {
    "1b": [*LLAMA_1B, "model.head_dim=64"],
    "1b-h128": [*LLAMA_1B, "model.head_dim=128"],
    "3b": [*LLAMA, "model.layers=28", "model.d_model=3072", "model.n_heads=24",
           "model.head_dim=128", "model.n_kv_heads=8", "model.d_ff=8192",
           "model.tie_embeddings=true"],
    "8b": ["model.preset=llama3.1-8b", "model.dtype=bfloat16"],
}
RUN = ["remat.policy=full", "parallel.strategy=auto", "mesh.data=1", "mesh.context=-1",
       "data.batch_size=1", "checkpoint.every=0", "train.warmup_steps=1"]


def time_steps(model: str, seq_len: int, steps: int, sets: list[str]) -> dict:
    """One row: the step's figures, or why it did not run."""
    recipe = load_recipe("tiny", [*MODELS[model], *RUN, f"data.seq_len={seq_len}",
                                  f"train.steps={steps + 1}", *sets])
    row = dict(model=model, seq_len=seq_len, device=jax.devices()[0].device_kind,
               chips=jax.device_count())
    try:
        run = compile_run(recipe)
    except RunFailure as failure:
        return {**row, "error": str(failure).splitlines()[0]}
    recipe = run.recipe  # auto resolved
    source = make_source(recipe.data, vocab=recipe.model.vocab, seed=0, holdout=0)
    order = run.strategy.sequence_order(seq_len)
    state = initial_state(recipe, run.trainable)
    state, metrics = run.train_step(state, device_batch(source, 0, order, run.mesh))
    jax.block_until_ready(metrics)  # the warm-up step
    throughput = Throughput(recipe, run.mesh)
    for index in range(1, steps + 1):
        state, metrics = run.train_step(state, device_batch(source, index, order, run.mesh))
        throughput.steps += 1
    jax.block_until_ready(metrics)
    return {**row, "strategy": recipe.parallel.strategy, **throughput.report()}


def print_row(row: dict) -> None:
    head = f"{row['model']:<6}{row['seq_len']:>9}"
    if "error" in row:
        print(f"{head}  did not run: {row['error']}", flush=True)
        return
    mfu = f"{row['mfu']:>7.1%}" if "mfu" in row else f"{'-':>7}"
    print(f"{head}{row['step_time_s']:>10.3f}{row['tokens_per_s']:>12,.0f}{mfu}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["1b", "3b"], choices=MODELS)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[32768, 65536])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--set", dest="sets", action="append", default=[],
                        metavar="KEY=VALUE", help="recipe override, as lctrain run --set")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the rows")
    args = parser.parse_args(argv)
    with shown_only_on_failure():  # libtpu's start-up warnings where no TPU is attached
        backend = jax.default_backend()
    if backend == "cpu":
        print("no accelerator here (jax's backend is cpu): nothing to time")
        return 0
    print(f"train step on {jax.device_count()} x {jax.devices()[0].device_kind}")
    print(f"{'model':<6}{'seq_len':>9}{'step s':>10}{'tokens/s':>12}{'MFU':>7}")
    rows = []
    for model in args.models:
        for seq_len in args.seq_lens:
            rows.append(time_steps(model, seq_len, args.steps, args.sets))
            print_row(rows[-1])
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
