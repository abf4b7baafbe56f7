"""AdamW with linear warmup + cosine decay and global-norm clipping (optax)."""

from __future__ import annotations

import jax
import optax

from train.config import OptimizerConfig


def schedule(cfg: OptimizerConfig, steps: int) -> optax.Schedule:
  """Learning rate by step: 0 -> `lr` over `warmup_steps`, then cosine to
  `lr * min_lr_ratio` at `steps`."""
  warmup = min(cfg.warmup_steps, steps - 1)
  return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, max(steps, warmup + 1),
                                            end_value=cfg.lr * cfg.min_lr_ratio)


def make(cfg: OptimizerConfig, lr: optax.Schedule) -> optax.GradientTransformation:
  """Clip by global norm (`clip_norm` 0: no clipping), then AdamW at learning rate `lr`
  (`schedule(cfg, steps)`); weight decay on matrices only (not norm scales)."""
  def decay_mask(params):
    return jax.tree.map(lambda p: p.ndim > 1, params)

  # Both hold an empty state: a run resumes across a change of clip_norm to or from 0.
  clip = optax.clip_by_global_norm(cfg.clip_norm) if cfg.clip_norm else optax.identity()
  return optax.chain(
      clip,
      optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                  weight_decay=cfg.weight_decay, mask=decay_mask))
