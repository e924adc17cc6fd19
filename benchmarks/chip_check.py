"""What lctrain does on the TPU at hand, in one command: the Pallas kernels' accuracy, their
speed per block size, a short `lctrain run`, the longest sequence that really runs, and
the train step's MFU.

    python benchmarks/chip_check.py --json chip.json                 # every section
    python benchmarks/chip_check.py --sections blocks mfu            # some of them

Sections (each prints its rows as it goes; --json writes them after every row):
- accuracy: our Pallas kernel and splash against the xla kernel in f32, bf16 inputs, on
  one causal document and four packed ones (benchmarks/attention.py --check-seq-len),
  with blocks of 512 and of 1024.
- blocks: forward+backward TFLOP/s of one causal sequence per kernel and block pair
  (block_q x block_kv) at --block-seq-lens, heads of --block-head-dim: what
  kernels/tiles.py's table is made from.
- run: `lctrain run` of the default recipe on one chip, 20 steps: its losses must fall
  and its step times be finite.
- max_seq: for each remat of recipes/one_chip.yaml (--max-seq-recipes), `lctrain run` of
  two steps (a checkpoint included) at each of its lengths (REMATS, or --max-seq-lens) in
  its own process, until one fails; the longest that ran is the figure `lctrain plan --max-seq` must come within
  10% of, and never above.
- mfu: benchmarks/step.py's rows (full remat unless --set says otherwise) of --mfu-models:
  "1b-h128" (recipes/one_chip.yaml's model) and Llama 3.2 1B's shape by default, each with
  4 of its 16 layers (the whole 1B with f32 AdamW does not fit a v5e).

Without a TPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import attention  # noqa: E402  (benchmarks/attention.py)
import step  # noqa: E402  (benchmarks/step.py)


SECTIONS = ("accuracy", "blocks", "run", "max_seq", "mfu")
BLOCKS = {"pallas": [(512, 512), (1024, 1024), (1024, 512), (512, 1024), (2048, 512),
                     (512, 2048), (1024, 2048), (2048, 1024), (2048, 2048)],
          "splash": [(512, 512), (1024, 1024)]}
# recipes/one_chip.yaml under each remat the fit rule must hold for, with the lengths to
# try: the longest the compiler for v5e:1x1 (the chip's own compile) accepts and the
# shortest it refuses (benchmarks/RESULTS.md, "One v5e chip")
EDGES = json.loads((ROOT / "benchmarks/data/tpu_v5e_2026-12-07_fits.json").read_text())
REMATS = {edge["remat"]: (edge["sets"], [edge["accepted"], edge["refused"]])
          for edge in EDGES["compiled_edges_v5e_1x1"]["edges"]}
RUN_TIMEOUT_S = 480  # the narrow recipe's two steps at ~300K tokens take minutes
IN_CHILDREN = ("run", "max_seq")


def accuracy(args, emit) -> None:
    for impl in ("pallas", "splash"):
        for layout in ("causal", "packed"):
            for block in (512, 1024):
                try:
                    errors = attention.kernel_errors(impl, 2048, layout, block)
                except Exception as err:  # noqa: BLE001 - a kernel that does not run is a row
                    errors = {"error": str(err).splitlines()[0][:200]}
                emit(dict(impl=impl, layout=layout, block=block, **errors))


def blocks(args, emit) -> None:
    for seq_len in args.block_seq_lens:
        for impl, pairs in BLOCKS.items():
            for block in pairs:
                row = dict(impl=impl, seq_len=seq_len, block_q=block[0], block_kv=block[1],
                           head_dim=args.block_head_dim)
                try:
                    seconds = attention.time_impl(impl, seq_len, block, 3, jnp.bfloat16,
                                                  head_dim=args.block_head_dim)
                    flops = attention.causal_flops(seq_len, head_dim=args.block_head_dim)
                    row.update(seconds=seconds, tflops=flops / seconds / 1e12)
                except Exception as err:  # noqa: BLE001 - VMEM, or splash's block map
                    row["error"] = str(err).splitlines()[0][:200]
                emit(row)


def lctrain_run(sets: list[str], recipe: str | None = None, steps: int = 2) -> dict:
    """`lctrain run` in its own process (a runtime OOM leaves nothing behind); the
    compiled line, the last logged step and how it ended."""
    with tempfile.TemporaryDirectory() as run_dir:
        command = [sys.executable, "-m", "lctrain.cli.main", "run",
                   *([recipe] if recipe else []), "--run-dir", run_dir,
                   "--set", f"train.steps={steps}", "--set", "runtime.log_every=1",
                   "--set", f"checkpoint.every={steps}", "--set", "train.warmup_steps=1",
                   *[arg for s in sets for arg in ("--set", s)]]
        start = time.perf_counter()
        try:
            done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT,
                                  timeout=RUN_TIMEOUT_S)
            out, code = done.stdout + done.stderr, done.returncode
        except subprocess.TimeoutExpired as err:
            out, code = str(err.stdout or "") + str(err.stderr or ""), "timeout"
        metrics = Path(run_dir, "metrics.jsonl")
        records = ([json.loads(line) for line in metrics.read_text().splitlines()]
                   if metrics.exists() else [])
    lines = out.splitlines()
    return dict(exit=code, seconds=round(time.perf_counter() - start, 1),
                compiled=next((line for line in lines if "compiled train step" in line), None),
                error=next((line for line in lines if line.startswith("error")), None),
                step_lines=[line for line in lines if "MFU" in line],
                records=records, tail=lines[-3:])


def run(args, emit) -> None:
    result = lctrain_run(["mesh.context=1", "parallel.strategy=none"], steps=20)
    losses = [r["loss"] for r in result["records"]]
    result["ok"] = (result["exit"] == 0 and len(losses) == 20 and losses[-1] < losses[0])
    emit(result)


def max_seq(args, emit) -> None:
    for remat in args.max_seq_recipes:
        sets, lengths = REMATS[remat]
        for seq_len in args.max_seq_lens or lengths:
            result = lctrain_run([f"data.seq_len={seq_len}", *sets],
                                 recipe="recipes/one_chip.yaml")
            emit(dict(remat=remat, seq_len=seq_len, ran=result["exit"] == 0,
                      **{k: v for k, v in result.items() if k != "records"}))
            if result["exit"] != 0:
                break


def mfu(args, emit) -> None:
    for model in args.mfu_models:
        for seq_len in args.mfu_seq_lens:
            emit(step.time_steps(model, seq_len, 3, ["model.layers=4", *args.sets]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    parser.add_argument("--block-seq-lens", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--block-head-dim", type=int, default=attention.HEAD_DIM,
                        help="heads of this width (32 query / 8 KV heads); 64 is Llama 3.2 1B's")
    parser.add_argument("--max-seq-recipes", nargs="+", default=list(REMATS), choices=REMATS)
    parser.add_argument("--max-seq-lens", type=int, nargs="+", default=None,
                        help="lengths to try for every remat (default: REMATS' own)")
    parser.add_argument("--mfu-models", nargs="+", default=["1b-h128", "1b"],
                        choices=step.MODELS)
    parser.add_argument("--mfu-seq-lens", type=int, nargs="+", default=[8192, 32768, 65536])
    parser.add_argument("--set", dest="sets", action="append", default=[],
                        metavar="KEY=VALUE", help="recipe override for the mfu rows")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the rows")
    args = parser.parse_args(argv)
    backend = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"],
                             capture_output=True, text=True).stdout.strip()
    if backend != "tpu":
        print(f"no TPU here (jax's backend is {backend}): nothing to check")
        return 0
    report = dict(jax=jax.__version__, sections={})
    # A TPU serves one process: the sections that run `lctrain run` in processes of their
    # own go first, before this one takes the chip.
    for section in sorted(args.sections, key=lambda name: name not in IN_CHILDREN):
        rows = report["sections"][section] = []

        def emit(row: dict, section=section, rows=rows) -> None:
            print(section, {k: v for k, v in row.items() if k != "records"}, flush=True)
            rows.append(row)
            if args.json:  # after every row: a run cut short keeps what it measured
                Path(args.json).write_text(json.dumps(report, indent=1))

        globals()[section](args, emit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
