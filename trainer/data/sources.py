"""Opening the recipe's data: one source (synthetic, a token file, text) or a weighted
mixture of them (trainer/data/mixture.py), split into training and held-out windows. All file
errors surface here, before training starts."""

from __future__ import annotations

from pathlib import Path

from lctrain.recipes.schema import DataConfig
from lctrain.trainer.data.batches import (EVAL_SEED_OFFSET, DataSource, SyntheticCopySource,
                                          WindowedStreamSource, open_stream)
from lctrain.trainer.data.mixture import make_mixture
from lctrain.trainer.outputs.failures import DataError


def make_source(cfg: DataConfig, *, vocab: int, seed: int, split: str = "train",
                holdout: float = 0.0) -> DataSource:
    """The source `cfg.source` names; raises DataError for data that cannot work.

    `holdout` (eval.holdout) keeps every round(1/holdout)-th window of a file out of the
    "train" split; the "eval" split reads those. Without a holdout, and for synthetic data,
    the "eval" split draws with another seed: other sequences, or another window order."""
    if split == "eval" and not (holdout and (cfg.sources or cfg.source != "synthetic")):
        seed += EVAL_SEED_OFFSET
    if cfg.sources:
        return make_mixture(cfg, vocab=vocab, seed=seed, split=split,
                            holdout_stride=holdout_stride(holdout))
    if cfg.source == "synthetic":
        if vocab < 2:
            raise DataError(f"synthetic: needs model.vocab >= 2 (ids 1..vocab-1), got {vocab}")
        return SyntheticCopySource(cfg, vocab=vocab, seed=seed)

    path = Path(cfg.source)
    tokens, eos_id = open_stream(path, cfg, vocab, key="data.source")
    return WindowedStreamSource(tokens, name=str(path), eos_id=eos_id, cfg=cfg, vocab=vocab,
                                seed=seed, holdout_stride=holdout_stride(holdout), split=split)


def holdout_stride(holdout: float) -> int:
    """eval.holdout as the stride of held-out windows (0: none held out)."""
    return round(1 / holdout) if holdout else 0
