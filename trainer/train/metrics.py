"""Per-step metrics: console lines, TensorBoard events and metrics.jsonl (process 0 only)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from rich.console import Console

from lctrain.parallel.chips import chip_for_device_kind


def peak_flops(device_kind: str) -> float | None:
    """Dense bf16 peak of the chip, or None for devices we have no figure for (CPU)."""
    chip = chip_for_device_kind(device_kind)
    return chip.peak_bf16_flops if chip else None


class MetricsWriter:
    """Appends to the run dir's metrics.jsonl and TensorBoard events. A run resumed from the
    checkpoint at `resumed_step` redoes the steps after it, so what an earlier process
    logged past that step is dropped first: every logged step appears once."""

    def __init__(self, run_dir: Path, enabled: bool, console: Console, resumed_step: int = 0):
        self.enabled = enabled
        self.console = console
        self.jsonl = None
        self.tensorboard = None
        if enabled:
            from tensorboardX import SummaryWriter

            run_dir.mkdir(parents=True, exist_ok=True)
            _cut_back(run_dir / "metrics.jsonl", resumed_step)
            self.jsonl = open(run_dir / "metrics.jsonl", "a")
            # Events can only be hidden, not removed: TensorBoard drops those of the older
            # files from purge_step on when it reads this file's first event.
            self.tensorboard = SummaryWriter(str(run_dir / "tb"), purge_step=resumed_step + 1)

    def write(self, step: int, total_steps: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        for name, value in record.items():
            if name != "step":
                self.tensorboard.add_scalar(f"train/{name}", value, step)
        mfu = f" | MFU {record['mfu']:.1%}" if "mfu" in record else ""
        self.console.print(
            f"step {step:>{len(str(total_steps))}}/{total_steps} | loss {record['loss']:.4f} | "
            f"grad_norm {record['grad_norm']:.3f} | lr {record['lr']:.2e} | "
            f"{record['tokens_per_s']:,.0f} tok/s | {record['step_time_s'] * 1e3:.1f} ms/step{mfu}",
            soft_wrap=True)

    def write_eval(self, step: int, result: dict) -> None:
        """One evaluation (trainer/evaluation/evaluate.py's summary) as eval/* metrics."""
        if not self.enabled:
            return
        record = {f"eval/{name}": float(result[name])
                  for name in ("loss", "perplexity", "accuracy", "tokens")}
        if "retrieval" in result:
            record[f"eval/{result['retrieval']['task']}_accuracy"] = result["retrieval"]["mean"]
        if "ruler" in result:
            record.update(ruler_metrics(result["ruler"]))
        self.jsonl.write(json.dumps({"step": step, **record}) + "\n")
        self.jsonl.flush()
        for name, value in record.items():
            self.tensorboard.add_scalar(name, value, step)
        retrieval = "".join(f" | {name[5:]} {value:.3f}" for name, value in record.items()
                            if name.endswith("_accuracy"))
        # The whole table would not fit a line: the console gets the average per length.
        ruler = "".join(f" | RULER at {name.rpartition('/')[2]}: {value:.1f}"
                        for name, value in record.items()
                        if name.startswith("eval/ruler/average/"))
        self.console.print(f"eval at step {step} | loss {record['eval/loss']:.4f} | "
                           f"perplexity {record['eval/perplexity']:.2f} | accuracy "
                           f"{record['eval/accuracy']:.3f} | {int(record['eval/tokens']):,} "
                           f"held-out tokens{retrieval}{ruler}", soft_wrap=True)

    def close(self) -> None:
        if self.enabled:
            self.jsonl.close()
            self.tensorboard.close()


def ruler_metrics(ruler: dict) -> dict[str, float]:
    """RULER's scores (evaluation/ruler.py's ruler_summary) as metrics: eval/ruler/<task>/
    <length> and eval/ruler/average/<length>, in percent; a cell not scored is left out."""
    rows = {**ruler["scores"], "average": ruler["average"]}
    return {f"eval/ruler/{task}/{length}": float(score)
            for task, scores in rows.items()
            for length, score in zip(ruler["lengths"], scores) if score is not None}


def _cut_back(path: Path, last_step: int) -> None:
    """Keeps path's records of steps up to last_step, replacing the file in one rename so a
    kill meanwhile leaves the old file or the new one, never half of it."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines()
            if _step(line) is not None and _step(line) <= last_step]
    cut = path.with_name(path.name + ".cut")
    cut.write_text("".join(line + "\n" for line in kept))
    os.replace(cut, path)


def _step(line: str) -> int | None:
    """The record's step; None for a line a kill cut short mid-write."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None
