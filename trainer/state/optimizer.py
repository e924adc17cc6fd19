"""AdamW with linear warmup and cosine decay, optionally clipping the global gradient norm."""

from __future__ import annotations

import optax

from lctrain.recipes.schema import TrainConfig


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=cfg.run_warmup_steps,
        decay_steps=cfg.steps, end_value=cfg.lr * cfg.min_lr_ratio)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    optimizer = optax.adamw(learning_rate_schedule(cfg), b1=0.9, b2=0.95,
                            weight_decay=cfg.weight_decay)
    if cfg.grad_clip > 0:
        optimizer = optax.chain(optax.clip_by_global_norm(cfg.grad_clip), optimizer)
    if cfg.on_nonfinite == "skip":
        # Leaves parameters and moments untouched on a step with non-finite gradients.
        optimizer = optax.apply_if_finite(optimizer, max_consecutive_errors=2**31 - 1)
    return optimizer
