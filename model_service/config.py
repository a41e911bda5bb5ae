"""Model and mesh configuration: frozen dataclasses with the reference's field names, presets, validation.

Parsed once (from a preset name or a JSON file in golden/config.json's format) and never mutated.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from dataclasses import dataclass
from typing import Any

# The model service's hardware choices (backend.py makes them; --backend / --products name them).
BACKENDS = ("auto", "cpu", "generic")
PRODUCT_CHOICES = ("auto", "native", "native-int8", "xla", "int8")
MOE_CHOICES = ("auto", "pallas", "ragged", "cond")  # how the generic backend runs the experts (backend.choose_moe)
ATTENTION_CHOICES = ("auto", "batched", "pallas")  # the generic backend's attention (backend.choose_attention)
LAYERS_CHOICES = ("auto", "scan", "unroll")  # whether the generic backend scans its layers (Backend.scan_layers)
CPU_STEP_TOKENS = 64  # token rows per step on CPU (vLLM's max_num_batched_tokens): one tile
GENERIC_STEP_TOKENS = 1024  # token rows per step elsewhere (the generic backend's; --max-num-batched-tokens)


class ConfigError(ValueError):
    """A model or mesh configuration that cannot work; the message says what to change."""


@dataclass(frozen=True)
class TransformerConfig:
    """The transformer stack (reference `TransformerConfig` field names)."""

    emb_size: int
    widening_factor: float
    key_size: int
    num_q_heads: int
    num_kv_heads: int
    num_layers: int
    attn_output_multiplier: float
    num_experts: int
    num_selected_experts: int
    shard_activations: bool = True

    @property
    def ffn_size(self) -> int:
        """Hidden size of each expert: 2/3 of widening * emb, rounded up to a multiple of 8."""
        size = int(self.widening_factor * self.emb_size) * 2 // 3
        return size + (8 - size) % 8


@dataclass(frozen=True)
class ModelConfig:
    """The language model (reference `LanguageModelConfig` field names)."""

    vocab_size: int
    pad_token: int
    eos_token: int
    sequence_len: int
    embedding_init_scale: float
    output_multiplier_scale: float
    embedding_multiplier_scale: float
    model: TransformerConfig


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh shape: `data` replicas (batch) x `model` shards (weights, heads), and `expert` groups that
    each hold a share of every layer's experts (expert parallelism; 1: every device holds every expert)."""

    data: int = 1
    model: int = 1
    expert: int = 1

    @property
    def size(self) -> int:
        return self.data * self.expert * self.model

    def __str__(self) -> str:
        """The --mesh text: DATA,MODEL without an expert axis, else DATA,EXPERT,MODEL."""
        if self.expert == 1:
            return f"{self.data},{self.model}"
        return f"{self.data},{self.expert},{self.model}"

    @classmethod
    def parse(cls, text: str) -> "MeshConfig":
        """Parse "DATA,MODEL" (e.g. "2,4") or "DATA,EXPERT,MODEL" (e.g. "1,4,2")."""
        parts = [p.strip() for p in text.split(",")]
        if len(parts) not in (2, 3) or not all(p.isdigit() for p in parts):
            raise ConfigError(f"mesh must be DATA,MODEL or DATA,EXPERT,MODEL with positive integers (e.g. 1,8 or "
                              f"1,4,2), got {text!r}")
        numbers = [int(p) for p in parts]
        if min(numbers) < 1:
            raise ConfigError(f"mesh axes must be >= 1, got {text!r}")
        if len(numbers) == 2:
            return cls(data=numbers[0], model=numbers[1])
        return cls(data=numbers[0], expert=numbers[1], model=numbers[2])


GROK_1 = ModelConfig(
    vocab_size=128 * 1024,
    pad_token=0,
    eos_token=2,
    sequence_len=8192,
    embedding_init_scale=1.0,
    output_multiplier_scale=0.5773502691896257,
    embedding_multiplier_scale=78.38367176906169,
    model=TransformerConfig(
        emb_size=48 * 128,
        widening_factor=8,
        key_size=128,
        num_q_heads=48,
        num_kv_heads=8,
        num_layers=64,
        attn_output_multiplier=0.08838834764831845,
        num_experts=8,
        num_selected_experts=2,
    ),
)

PRESETS: dict[str, ModelConfig] = {"grok-1": GROK_1}


def _build(cls: type, values: dict[str, Any], where: str) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    unknown = sorted(set(values) - names)
    missing = sorted(required - set(values))
    if unknown or missing:
        raise ConfigError(f"{where}: unknown fields {unknown}, missing fields {missing}")
    return cls(**values)


# The reference's TransformerConfig names its mesh axes; this service's mesh axes are always named "data" and
# "model" (sharding.DATA / MODEL). The reference's JSON layout (golden/config.json) carries the two keys, so they
# are read and written with exactly these values and are not config fields: any other value is refused.
MESH_AXIS_KEYS = {"data_axis": "data", "model_axis": "model"}


def model_config_from_dict(values: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from golden/config.json's layout (`model` holds the transformer fields)."""
    if not isinstance(values.get("model"), dict):
        raise ConfigError("model config needs a 'model' object with the transformer fields")
    transformer = dict(values["model"])
    for key, fixed in MESH_AXIS_KEYS.items():
        if transformer.pop(key, fixed) != fixed:
            raise ConfigError(f"model.{key}: this service names its mesh axes 'data' and 'model'; "
                              f"set {key} to {fixed!r} or leave it out")
    return _build(ModelConfig, {**values, "model": _build(TransformerConfig, transformer, "model")}, "config")


def model_config_to_dict(cfg: ModelConfig) -> dict[str, Any]:
    """The JSON layout `model_config_from_dict` reads (the reference's, mesh axis names included)."""
    values = dataclasses.asdict(cfg)
    values["model"].update(MESH_AXIS_KEYS)
    return values


def load_model_config(preset_or_json_path: str) -> ModelConfig:
    """A preset name ("grok-1") or the path of a JSON config file."""
    if preset_or_json_path in PRESETS:
        return PRESETS[preset_or_json_path]
    path = pathlib.Path(preset_or_json_path)
    if not path.is_file():
        raise ConfigError(f"config {preset_or_json_path!r} is neither a preset {sorted(PRESETS)} nor a JSON file")
    try:
        values = json.loads(path.read_text())
    except ValueError as e:
        raise ConfigError(f"config file {path} is not valid JSON: {e}") from e
    return model_config_from_dict(values)


def _model_problems(cfg: ModelConfig) -> list[str]:
    t = cfg.model
    problems = []
    for name in ("emb_size", "key_size", "num_q_heads", "num_kv_heads", "num_layers", "num_experts",
                 "num_selected_experts"):
        if getattr(t, name) < 1:
            problems.append(f"model.{name} must be >= 1 (got {getattr(t, name)})")
    if cfg.vocab_size < 1 or cfg.sequence_len < 1:
        problems.append("vocab_size and sequence_len must be >= 1")
    if problems:
        return problems
    if t.num_selected_experts > t.num_experts:
        problems.append(f"num_selected_experts ({t.num_selected_experts}) exceeds num_experts ({t.num_experts})")
    if t.num_q_heads % t.num_kv_heads:
        problems.append(f"num_q_heads ({t.num_q_heads}) must be a multiple of num_kv_heads ({t.num_kv_heads})")
    if t.key_size % 2:
        problems.append(f"key_size ({t.key_size}) must be even for rotary embeddings")
    if t.emb_size % 8 or t.num_q_heads * t.key_size % 8:
        problems.append("emb_size and num_q_heads*key_size must be multiples of 8 (8 row-block scales)")
    if not 0 <= cfg.pad_token < cfg.vocab_size or not 0 <= cfg.eos_token < cfg.vocab_size:
        problems.append(f"pad_token/eos_token must be token ids below vocab_size {cfg.vocab_size}")
    return problems


def validate(cfg: ModelConfig, mesh: MeshConfig) -> None:
    """Raise ConfigError listing every reason `cfg` cannot run on `mesh`."""
    problems = _model_problems(cfg)
    if mesh.data < 1 or mesh.model < 1 or mesh.expert < 1:
        problems.append(f"mesh axes must be >= 1 (got data={mesh.data}, expert={mesh.expert}, model={mesh.model})")
    elif not problems:
        t = cfg.model
        if t.num_q_heads % mesh.model:
            problems.append(f"num_q_heads ({t.num_q_heads}) is not divisible by the model axis ({mesh.model})")
        if t.num_kv_heads % mesh.model:
            problems.append(f"num_kv_heads ({t.num_kv_heads}) is not divisible by the model axis ({mesh.model}); "
                            f"use a model axis that divides it")
        problems += _expert_problems(t, mesh)
    if problems:
        raise ConfigError("invalid configuration: " + "; ".join(problems))


def _expert_problems(t: TransformerConfig, mesh: MeshConfig) -> list[str]:
    """An expert axis holds whole experts, and its model shards split linear_1's 8 row blocks evenly."""
    if mesh.expert == 1:
        return []
    problems = []
    if t.num_experts % mesh.expert:
        problems.append(f"num_experts ({t.num_experts}) is not divisible by the expert axis ({mesh.expert}); use an "
                        "expert axis that divides it")
    if ROW_BLOCKS % mesh.model:
        problems.append(f"with an expert axis the model axis ({mesh.model}) must divide the experts' "
                        f"{ROW_BLOCKS} row blocks (1, 2, 4 or 8)")
    return problems


ROW_BLOCKS = 8  # row blocks of a row-parallel int8 matrix (the released checkpoint's linear_1 scales)
