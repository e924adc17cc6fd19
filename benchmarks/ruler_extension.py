"""RULER before and after a context extension, on a CPU: passkey_extension.py's workflow
with RULER's tasks in place of the passkey grid.

Stage 1 trains a small model (3 layers, byte tokens) on one RULER task, niah_single_1
(lctrain's own generator, seeds apart from the evaluation's), in documents of up to 512
tokens. `lctrain eval --set eval.task=ruler` then scores every RULER task at 512 and
1,024 tokens: the trained task should pass at 512 and fail at 1,024, past its training
length; the tasks it never saw should score near zero at both. Stage 2 imports that model
as a Hugging Face checkpoint, scales RoPE linearly by 2 and trains on niah_single_1
documents of up to 1,024 tokens; the same RULER pass is then scored again.

Which tasks: every task of the group whose samples fit. With byte tokens RULER's
templates are long: the NIAH tasks need 470 to 700 tokens (multikey_1, multivalue and
multiquery only fit at 1,024), fwe fits at 512, while vt needs 2,048 and cwe 2,048 too
(its example list alone passes 1,024 bytes), so the group skips those two and says so
in ruler.json. QA needs a SQuAD or HotpotQA file and a model that reads English: left
out. A byte-token model trained on synthetic text can only learn retrieval by copying,
which is what NIAH asks; fwe (counting coded words) is the task it never saw.

    python benchmarks/ruler_extension.py [--out benchmarks/figures] [--work /tmp/ruler_ext]

Writes ruler_before_extension.png and ruler_after_extension.png to --out, and
benchmarks/data/ruler_extension.json (both ruler.json's rows and the times).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np
from passkey_extension import VOCAB, extend, lctrain, sets

from lctrain.recipes import load_recipe
from lctrain.trainer.data.batches import BYTE_EOS
from lctrain.trainer.evaluation.retrieval import Pieces
from lctrain.trainer.evaluation.ruler import SampleText, build_sample, task_draft

TRAINED = "niah_single_1"
RECIPE = "tiny"  # one device, no context parallelism: the cheapest step on a shared CPU
SHORTEST = 512  # niah_single_1's byte-token template and answer budget need ~470
MODEL = ["model.vocab=320", "model.layers=3", "data.eos_id=256", "eval.source=synthetic",
         "runtime.cpu_devices=1"]
STAGES = {
    "stage1": dict(longest=512, documents=8_000, sets=[
        "data.seq_len=512", "data.batch_size=8", "train.steps=800", "train.warmup_steps=80"]),
    "stage2": dict(longest=1024, documents=2_000, sets=[
        "data.seq_len=1024", "data.batch_size=4", "train.steps=200", "train.warmup_steps=20",
        "train.lr=1e-3", "model.rope_scaling.type=linear", "model.rope_scaling.factor=2"]),
}
RULER = ["eval.task=ruler", "eval.seq_len=1024", "eval.lengths=2", "data.batch_size=8"]


def task_documents(path: Path, count: int, longest: int, seed: int) -> None:
    """`count` samples of TRAINED (prompt and answer) built for SHORTEST..longest tokens,
    as one .npy token stream with end-of-document ids. Seeds [seed, 10**6 + i] never meet
    the evaluation's [train.seed, task, length, i]."""
    recipe = load_recipe("tiny", [f"model.vocab={VOCAB}", f"data.seq_len={longest}",
                                  f"eval.task={TRAINED}"])
    text, make_draft = SampleText(Pieces(recipe), None, 0), task_draft(TRAINED, recipe)
    documents = []
    for index in range(count):
        rng = np.random.default_rng([seed, 10**6 + index])
        length = int(rng.integers(SHORTEST, longest + 1))
        [sample] = build_sample(TRAINED, make_draft(rng, length), text, length)
        documents.append(np.append(sample.tokens, BYTE_EOS))
    np.save(path, np.concatenate(documents).astype(np.uint16))


def ruler_pass(run_dir: Path) -> tuple[Path, dict, float]:
    """`lctrain eval` of RULER on the run's checkpoint: the run dir, ruler.json and the
    seconds taken."""
    start = time.time()
    lctrain("eval", "--run-dir", run_dir, "--out", run_dir / "eval", *sets(*RULER))
    ruler = json.loads((run_dir / "eval" / "ruler.json").read_text())
    return run_dir, ruler, time.time() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/figures"))
    parser.add_argument("--data", type=Path, default=Path("benchmarks/data/ruler_extension.json"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/ruler_extension"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    passes = extend(args.work, STAGES, MODEL, task_documents, ruler_pass, recipe=(RECIPE,))
    rows, seconds = {}, {}
    for (run_dir, ruler, pass_s), figure in zip(passes, ("before", "after")):
        shutil.copyfile(run_dir / "eval" / "ruler.png", args.out / f"ruler_{figure}_extension.png")
        rows[figure], seconds[figure] = ruler, round(pass_s, 1)
        print(f"{figure} extension: RULER average by length "
              + ", ".join(f"{length}: {average:.1f}"
                          for length, average in zip(ruler["lengths"], ruler["average"])))
    args.data.parent.mkdir(parents=True, exist_ok=True)
    args.data.write_text(json.dumps({
        "trained_task": TRAINED, "stages": STAGES, "ruler_sets": RULER, "model": MODEL,
        "ruler_pass_s": seconds, "total_s": round(time.time() - start, 1), **rows},
        indent=2) + "\n")


if __name__ == "__main__":
    main()
