"""Trained float parameters -> the released checkpoint format, and losses measured through the served network.

Quantisation is the released checkpoint's (model_service.model.params.quantize): per output column (and per
row block of 8 for the row-parallel attention output and MoE linear_1) scale = bfloat16(max|w| / 127),
weight = int8(round(w / scale)). Embeddings, norms and the router stay float32, as in the released model.
"""

from __future__ import annotations

import math
import pathlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from model_service.checkpoint import load_params, write_checkpoint
from model_service.config import MeshConfig, ModelConfig
from model_service.model import GrokModel
from model_service.model.params import Params, TensorSpec, quantize, tensor_specs
from model_service.sharding import make_mesh


def checkpoint_leaves(cfg: ModelConfig, params: Params) -> Iterator[Any]:
    """Checkpoint-layout leaves in file order: (int8 weight, bfloat16 scales) or a float32 array."""
    for spec in tensor_specs(cfg):
        value = np.asarray(params[spec.module][spec.name], np.float32)
        yield quantize(value, spec.blocks) if spec.quantized else value


MAX_TENSOR_FILE_BYTES = 5_000_000  # the committed demo keeps every file under 5 MB


def tensor_payload_bytes(spec: TensorSpec) -> int:
    """The array bytes of one tensor file (the pickle adds a few hundred): int8 weight + bfloat16 scales, or
    float32."""
    if spec.quantized:
        return math.prod(spec.shape) + 2 * math.prod(spec.scales_shape)
    return 4 * math.prod(spec.shape)


def check_tensor_files(cfg: ModelConfig) -> None:
    """Refuse a config whose checkpoint would hold a file of 5 MB or more (before any training is spent)."""
    too_big = [f"{spec.ckpt_path} ({tensor_payload_bytes(spec):,} bytes)" for spec in tensor_specs(cfg)
               if tensor_payload_bytes(spec) + 1024 >= MAX_TENSOR_FILE_BYTES]
    if too_big:
        raise ValueError(f"tensor files would reach {MAX_TENSOR_FILE_BYTES:,} bytes: {', '.join(too_big)}; "
                         "narrow emb_size, widening_factor or vocab_size")


def write_trained_checkpoint(out_dir: pathlib.Path, cfg: ModelConfig, params: Params) -> None:
    check_tensor_files(cfg)
    write_checkpoint(out_dir, cfg, checkpoint_leaves(cfg, params))


def load_served(cfg: ModelConfig, checkpoint_dir: pathlib.Path) -> tuple[GrokModel, Params]:
    """The checkpoint read by the model service's own loader, on one CPU device, float32 compute: the CPU is
    where `make run` serves it and where CI measures it again, also when training ran on an accelerator."""
    mesh = make_mesh(MeshConfig(), jax.devices("cpu"))
    return GrokModel(cfg, mesh, jnp.float32), load_params(str(checkpoint_dir), cfg, mesh, jnp.float32)


def served_loss(model: GrokModel, params: Any, tokens: np.ndarray, weights: np.ndarray) -> float:
    """Mean next-token cross-entropy (nats) of the served network's full forward pass over windows
    tokens [W, L] with target weights [W, L-1]. `params` may be the int8 checkpoint or float arrays."""
    forward = jax.jit(model.forward)
    total, count = 0.0, 0.0
    with jax.default_device(jax.devices("cpu")[0]):  # beside load_served's parameters
        for row, weight in zip(tokens, weights):
            logits = forward(params, jnp.asarray(row[None, :-1]))[0]  # [L-1, V]
            logp = jax.nn.log_softmax(logits, axis=-1)
            nll = -jnp.take_along_axis(logp, jnp.asarray(row[1:, None]), axis=-1)[:, 0]
            total += float(jnp.sum(nll * weight))
            count += float(weight.sum())
    return total / count


def greedy(model: GrokModel, params: Any, prompt: list[int], max_tokens: int, eos: int, window: int) -> list[int]:
    """Greedy continuation by full forward passes over one fixed-size padded window (one compilation):
    pad keys are masked and attention is causal, so the padding never changes a real position's logits."""
    forward = jax.jit(model.forward)
    tokens = list(prompt)
    with jax.default_device(jax.devices("cpu")[0]):  # beside load_served's parameters
        while len(tokens) - len(prompt) < max_tokens and len(tokens) < window:
            padded = np.zeros((1, window), np.int32)
            padded[0, :len(tokens)] = tokens
            nxt = int(jnp.argmax(forward(params, jnp.asarray(padded))[0, len(tokens) - 1]))
            tokens.append(nxt)
            if nxt == eos:
                break
    return tokens[len(prompt):]
