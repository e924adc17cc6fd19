"""Context extension on a CPU, end to end: docs/evaluation.md's passkey heatmaps before and after.

Stage 1 trains a small model (3 layers, byte tokens) on passkey documents of up to 256
tokens: a pass key sentence hidden at a random depth in filler text, then the question
and the answer, so the model learns to retrieve. `lctrain eval` then scores retrieval on
a grid up to 1,024 tokens: it fails past its training length. Stage 2 imports that
model as a Hugging Face checkpoint (`lctrain export`, then `model.init: hf:<dir>`),
scales RoPE linearly by 4 and trains on documents of up to 1,024 tokens; the same grid
then passes. That is the extension workflow of docs/extension.md, at 1/1000 of the scale.

    python benchmarks/passkey_extension.py [--out benchmarks/figures] [--work /tmp/passkey]

About 30 minutes on 2 CPU cores. Writes passkey_before_extension.png and
passkey_after_extension.png (and each stage's eval.json beside its run).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from lctrain.recipes import load_recipe
from lctrain.trainer.data.batches import BYTE_EOS
from lctrain.trainer.evaluation import retrieval

VOCAB = 320        # bytes, end-of-document, room to spare: text samples need > BYTE_EOS
SHORTEST = 110     # a passkey needle, question and answer take 105 byte tokens
MODEL = ["model.vocab=320", "model.layers=3", "data.eos_id=256", "eval.task=passkey",
         "eval.source=synthetic"]
STAGES = {
    "stage1": dict(longest=256, documents=60_000, sets=[
        "data.seq_len=256", "data.batch_size=16", "train.steps=1000", "train.warmup_steps=100",
        "runtime.cpu_devices=8"]),
    "stage2": dict(longest=1024, documents=12_000, sets=[
        "data.seq_len=1024", "data.batch_size=4", "train.steps=300", "train.warmup_steps=20",
        "train.lr=1e-3", "model.rope_scaling.type=linear", "model.rope_scaling.factor=4",
        "runtime.cpu_devices=4"]),
}
GRID = ["eval.seq_len=1024", "eval.lengths=7", "eval.depths=11", "data.batch_size=16"]


def passkey_documents(path: Path, count: int, longest: int, seed: int) -> None:
    """`count` documents of SHORTEST..longest byte tokens, each a passkey sample (needle at
    a random depth of the filler), as one .npy token stream with end-of-document ids."""
    recipe = load_recipe("tiny", [f"model.vocab={VOCAB}", f"data.seq_len={longest}",
                                "eval.task=passkey"])
    pieces, rng = retrieval.Pieces(recipe), np.random.default_rng(seed)
    documents = []
    for _ in range(count):
        sample = pieces.sample("passkey", rng)
        length = int(rng.integers(SHORTEST, longest + 1))
        filler = np.roll(pieces.filler(rng, longest + 1, None, 0), -int(rng.integers(0, 90)))
        window, _ = retrieval.sample_row(pieces, sample, length, float(rng.random()), longest,
                                         filler)
        documents.append(np.append(window[:length], BYTE_EOS))
    np.save(path, np.concatenate(documents).astype(np.uint16))


def lctrain(*args) -> None:
    command = [sys.executable, "-m", "lctrain.cli.main", *map(str, args)]
    print("$", " ".join(command[2:]), flush=True)
    subprocess.run(command, check=True)


def sets(*assignments: str) -> list[str]:
    return [part for assignment in assignments for part in ("--set", assignment)]


def extend(work: Path, stages: dict, model: list[str], make_documents, evaluate,
           recipe: tuple[str, ...] = ()) -> list:
    """The two-stage workflow: stage 1 trained on make_documents' stream, exported as a
    Hugging Face checkpoint, stage 2 trained from it; evaluate(run_dir) after each stage
    (its two results, in order)."""
    work.mkdir(parents=True, exist_ok=True)
    for seed, (name, stage) in enumerate(stages.items()):
        make_documents(work / f"{name}.npy", stage["documents"], stage["longest"], seed)
    stage1, stage2, hf = (work / name for name in ("stage1", "stage2", "stage1_hf"))
    lctrain("run", *recipe, "--run-dir", stage1,
            *sets(*model, f"data.source={work}/stage1.npy", *stages["stage1"]["sets"]))
    lctrain("export", stage1, hf, "--dtype", "float32")
    before = evaluate(stage1)
    lctrain("run", *recipe, "--run-dir", stage2,
            *sets(*model, f"model.init=hf:{hf}", f"data.source={work}/stage2.npy",
                  *stages["stage2"]["sets"]))
    return [before, evaluate(stage2)]


def passkey_grid(run_dir: Path) -> Path:
    lctrain("eval", "--run-dir", run_dir, "--out", run_dir / "eval", *sets(*GRID))
    return run_dir


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/figures"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/passkey_extension"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    stage_dirs = extend(args.work, STAGES, MODEL, passkey_documents, passkey_grid)
    for run_dir, figure in zip(stage_dirs, ("before", "after")):
        shutil.copyfile(run_dir / "eval" / "passkey_heatmap.png",
                        args.out / f"passkey_{figure}_extension.png")
        result = json.loads((run_dir / "eval" / "eval.json").read_text())["retrieval"]
        print(f"{figure} extension: passkey accuracy by length "
              + ", ".join(f"{length}: {np.mean(row):.2f}"
                          for length, row in zip(result["lengths"], result["accuracy"])))


if __name__ == "__main__":
    main()
