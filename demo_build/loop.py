"""The training loop: AdamW (optax) with warmup + cosine decay and global-norm clipping, one jitted step.

Reproducible from the seed: parameters are drawn with jax.random (threefry) and window offsets with numpy
PCG64, both from `TrainConfig.seed`; the loop is single-device with float32 parameters. On a TPU, JAX's
default precision runs the float32 matrix products as one bfloat16 pass (what the chip is fast at); on a CPU
they stay float32. The whole step (forward, backward, AdamW) is one jitted program that donates the parameters
and optimiser state, so they are updated in place on the device.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from model_service.config import ModelConfig
from model_service.model.params import Params
from demo_build import network
from demo_build.data import training_batches


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides the trained weights besides the model config and the corpus."""

    seed: int = 0
    steps: int = 400
    batch_size: int = 8
    seq_len: int = 256
    learning_rate: float = 5e-3
    warmup_steps: int = 50
    final_lr_fraction: float = 0.05
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    holdout_every: int = 16
    log_every: int = 10
    copy_share: float = 0.25  # windows that repeat a paragraph (data.training_batches)
    eval_windows: int = 0  # windows of each stream the final losses are measured on, evenly spaced (0: all)
    time_limit: float = 0.0  # seconds of steps after which training stops early, recorded as such (0: none)


class LogEntry(NamedTuple):
    step: int  # steps done
    loss: float  # mean training loss of the steps since the previous entry
    seconds: float  # wall time since the loop started


class TrainResult(NamedTuple):
    params: Params
    log: tuple[LogEntry, ...]
    seconds: float  # the whole loop, the first step's compilation included
    steps: int  # steps done (fewer than TrainConfig.steps only when time_limit stopped it)
    first_step_seconds: float  # the first step: compilation, mostly


def optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.steps, end_value=cfg.learning_rate * cfg.final_lr_fraction)
    # Decay matrices only: norm scales pull towards 1 through the data, not towards 0.
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay, mask=decay_mask))


def make_step(model_cfg: ModelConfig, opt: optax.GradientTransformation) -> Callable[..., Any]:
    def loss_fn(params: Params, tokens: jax.Array) -> jax.Array:
        return jnp.mean(network.token_losses(model_cfg, params, tokens))

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params: Params, opt_state: Any, tokens: jax.Array) -> tuple[Params, Any, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def train(model_cfg: ModelConfig, cfg: TrainConfig, stream: np.ndarray, starts: np.ndarray,
          stop_after: int | None = None, report: Callable[[LogEntry], None] | None = None) -> TrainResult:
    """Train on windows of `stream` beginning at `starts`; `stop_after` ends early (same schedule), e.g. to
    check reproducibility."""
    params = network.init_params(model_cfg, jax.random.PRNGKey(cfg.seed))
    opt = optimizer(cfg)
    opt_state = opt.init(params)
    step = make_step(model_cfg, opt)
    batches = training_batches(stream, starts, cfg.batch_size, cfg.seq_len + 1, cfg.seed, model_cfg.eos_token,
                                 cfg.copy_share)
    log: list[LogEntry] = []
    losses: list[jax.Array] = []
    start = time.monotonic()
    first_step, done = 0.0, 0
    for i in range(min(cfg.steps, stop_after or cfg.steps)):
        params, opt_state, loss = step(params, opt_state, jnp.asarray(next(batches)))
        losses.append(loss)
        done = i + 1
        if i == 0:
            jax.block_until_ready(loss)
            first_step = time.monotonic() - start  # compilation, mostly
        if done % cfg.log_every == 0:
            entry = LogEntry(done, float(np.mean(jax.device_get(losses))), time.monotonic() - start)
            losses = []
            log.append(entry)
            if report:
                report(entry)
            if cfg.time_limit and entry.seconds > cfg.time_limit:
                break
    return TrainResult(jax.device_get(params), tuple(log), time.monotonic() - start, done, first_step)
