from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_CONTEXT_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP_TOKEN: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_CONTEXT_LENGTH: FinishReason
FINISH_REASON_STOP_TOKEN: FinishReason

class GenerateRequest(_message.Message):
    __slots__ = ("token_ids", "max_tokens", "temperature", "top_p", "seed", "ignore_eos", "top_logprobs", "allowed_token_ids", "blocked_token_ids", "request_id", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "stop_token_ids", "n", "prompt_logprobs", "json_schema", "regex", "choice", "grammar", "cache_salt", "min_tokens", "ids_only")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCKED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IDS_ONLY_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    ignore_eos: bool
    top_logprobs: int
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    blocked_token_ids: _containers.RepeatedScalarFieldContainer[int]
    request_id: str
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    n: int
    prompt_logprobs: int
    json_schema: str
    regex: str
    choice: Choices
    grammar: str
    cache_salt: bytes
    min_tokens: int
    ids_only: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., blocked_token_ids: _Optional[_Iterable[int]] = ..., request_id: _Optional[str] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., n: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., grammar: _Optional[str] = ..., cache_salt: _Optional[bytes] = ..., min_tokens: _Optional[int] = ..., ids_only: _Optional[bool] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class TopToken(_message.Message):
    __slots__ = ("id", "probability", "logprob")
    ID_FIELD_NUMBER: _ClassVar[int]
    PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    id: int
    probability: float
    logprob: float
    def __init__(self, id: _Optional[int] = ..., probability: _Optional[float] = ..., logprob: _Optional[float] = ...) -> None: ...

class Token(_message.Message):
    __slots__ = ("id", "probability", "logprob", "top_tokens")
    ID_FIELD_NUMBER: _ClassVar[int]
    PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    id: int
    probability: float
    logprob: float
    top_tokens: _containers.RepeatedCompositeFieldContainer[TopToken]
    def __init__(self, id: _Optional[int] = ..., probability: _Optional[float] = ..., logprob: _Optional[float] = ..., top_tokens: _Optional[_Iterable[_Union[TopToken, _Mapping]]] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_seconds", "prefill_seconds", "mean_step_seconds", "draft_tokens", "accepted_draft_tokens", "draft_acceptance_rate")
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEAN_STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    queue_seconds: float
    prefill_seconds: float
    mean_step_seconds: float
    draft_tokens: int
    accepted_draft_tokens: int
    draft_acceptance_rate: float
    def __init__(self, queue_seconds: _Optional[float] = ..., prefill_seconds: _Optional[float] = ..., mean_step_seconds: _Optional[float] = ..., draft_tokens: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ..., draft_acceptance_rate: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "tokens", "finish_reason", "prompt_tokens", "completion_tokens", "timings", "index", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedCompositeFieldContainer[Token]
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    timings: Timings
    index: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[Token]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[_Union[Token, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., index: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[Token, _Mapping]]] = ...) -> None: ...

class GenerateManyRequest(_message.Message):
    __slots__ = ("start", "cancel")
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    start: StartRequest
    cancel: int
    def __init__(self, start: _Optional[_Union[StartRequest, _Mapping]] = ..., cancel: _Optional[int] = ...) -> None: ...

class StartRequest(_message.Message):
    __slots__ = ("id", "request", "timeout_seconds", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    id: int
    request: GenerateRequest
    timeout_seconds: float
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, id: _Optional[int] = ..., request: _Optional[_Union[GenerateRequest, _Mapping]] = ..., timeout_seconds: _Optional[float] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class GenerateManyResponse(_message.Message):
    __slots__ = ("updates",)
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    updates: _containers.RepeatedCompositeFieldContainer[RequestUpdate]
    def __init__(self, updates: _Optional[_Iterable[_Union[RequestUpdate, _Mapping]]] = ...) -> None: ...

class RequestUpdate(_message.Message):
    __slots__ = ("id", "responses", "ended", "code", "message", "status_details")
    ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STATUS_DETAILS_FIELD_NUMBER: _ClassVar[int]
    id: int
    responses: _containers.RepeatedCompositeFieldContainer[GenerateResponse]
    ended: bool
    code: int
    message: str
    status_details: bytes
    def __init__(self, id: _Optional[int] = ..., responses: _Optional[_Iterable[_Union[GenerateResponse, _Mapping]]] = ..., ended: _Optional[bool] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., status_details: _Optional[bytes] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelConfig(_message.Message):
    __slots__ = ("vocab_size", "pad_token", "eos_token", "sequence_len", "embedding_init_scale", "output_multiplier_scale", "embedding_multiplier_scale", "emb_size", "widening_factor", "key_size", "num_q_heads", "num_kv_heads", "num_layers", "attn_output_multiplier", "num_experts", "num_selected_experts")
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAD_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_LEN_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_INIT_SCALE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_MULTIPLIER_SCALE_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_MULTIPLIER_SCALE_FIELD_NUMBER: _ClassVar[int]
    EMB_SIZE_FIELD_NUMBER: _ClassVar[int]
    WIDENING_FACTOR_FIELD_NUMBER: _ClassVar[int]
    KEY_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_Q_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    ATTN_OUTPUT_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    NUM_SELECTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    vocab_size: int
    pad_token: int
    eos_token: int
    sequence_len: int
    embedding_init_scale: float
    output_multiplier_scale: float
    embedding_multiplier_scale: float
    emb_size: int
    widening_factor: float
    key_size: int
    num_q_heads: int
    num_kv_heads: int
    num_layers: int
    attn_output_multiplier: float
    num_experts: int
    num_selected_experts: int
    def __init__(self, vocab_size: _Optional[int] = ..., pad_token: _Optional[int] = ..., eos_token: _Optional[int] = ..., sequence_len: _Optional[int] = ..., embedding_init_scale: _Optional[float] = ..., output_multiplier_scale: _Optional[float] = ..., embedding_multiplier_scale: _Optional[float] = ..., emb_size: _Optional[int] = ..., widening_factor: _Optional[float] = ..., key_size: _Optional[int] = ..., num_q_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., num_layers: _Optional[int] = ..., attn_output_multiplier: _Optional[float] = ..., num_experts: _Optional[int] = ..., num_selected_experts: _Optional[int] = ...) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("config", "mesh_data", "mesh_model", "slots", "prefill_buckets", "dtype", "max_queue", "checkpoint", "random_weights", "platform", "device_count", "generate_many")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    MESH_DATA_FIELD_NUMBER: _ClassVar[int]
    MESH_MODEL_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    RANDOM_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    DEVICE_COUNT_FIELD_NUMBER: _ClassVar[int]
    GENERATE_MANY_FIELD_NUMBER: _ClassVar[int]
    config: ModelConfig
    mesh_data: int
    mesh_model: int
    slots: int
    prefill_buckets: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    max_queue: int
    checkpoint: str
    random_weights: bool
    platform: str
    device_count: int
    generate_many: bool
    def __init__(self, config: _Optional[_Union[ModelConfig, _Mapping]] = ..., mesh_data: _Optional[int] = ..., mesh_model: _Optional[int] = ..., slots: _Optional[int] = ..., prefill_buckets: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., max_queue: _Optional[int] = ..., checkpoint: _Optional[str] = ..., random_weights: _Optional[bool] = ..., platform: _Optional[str] = ..., device_count: _Optional[int] = ..., generate_many: _Optional[bool] = ...) -> None: ...
