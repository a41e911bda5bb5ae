from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EncodeRequest(_message.Message):
    __slots__ = ("text", "add_bos", "add_eos")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ADD_BOS_FIELD_NUMBER: _ClassVar[int]
    ADD_EOS_FIELD_NUMBER: _ClassVar[int]
    text: str
    add_bos: bool
    add_eos: bool
    def __init__(self, text: _Optional[str] = ..., add_bos: _Optional[bool] = ..., add_eos: _Optional[bool] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class EncodeBatchRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[EncodeRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[EncodeRequest, _Mapping]]] = ...) -> None: ...

class EncodeBatchResponse(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[EncodeResponse]
    def __init__(self, responses: _Optional[_Iterable[_Union[EncodeResponse, _Mapping]]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class DecodeStreamRequest(_message.Message):
    __slots__ = ("token_ids", "prompt_ids", "alternatives")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    ALTERNATIVES_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    alternatives: _containers.RepeatedCompositeFieldContainer[AlternativeIds]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., alternatives: _Optional[_Iterable[_Union[AlternativeIds, _Mapping]]] = ...) -> None: ...

class AlternativeIds(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeStreamResponse(_message.Message):
    __slots__ = ("text", "token_texts", "alternative_texts")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_TEXTS_FIELD_NUMBER: _ClassVar[int]
    ALTERNATIVE_TEXTS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_texts: _containers.RepeatedScalarFieldContainer[str]
    alternative_texts: _containers.RepeatedCompositeFieldContainer[AlternativeTexts]
    def __init__(self, text: _Optional[str] = ..., token_texts: _Optional[_Iterable[str]] = ..., alternative_texts: _Optional[_Iterable[_Union[AlternativeTexts, _Mapping]]] = ...) -> None: ...

class AlternativeTexts(_message.Message):
    __slots__ = ("texts",)
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, texts: _Optional[_Iterable[str]] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("vocab_size", "bos_id", "eos_id", "pad_id", "unk_id", "model_sha256", "model_path")
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    BOS_ID_FIELD_NUMBER: _ClassVar[int]
    EOS_ID_FIELD_NUMBER: _ClassVar[int]
    PAD_ID_FIELD_NUMBER: _ClassVar[int]
    UNK_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int
    unk_id: int
    model_sha256: str
    model_path: str
    def __init__(self, vocab_size: _Optional[int] = ..., bos_id: _Optional[int] = ..., eos_id: _Optional[int] = ..., pad_id: _Optional[int] = ..., unk_id: _Optional[int] = ..., model_sha256: _Optional[str] = ..., model_path: _Optional[str] = ...) -> None: ...

class GetPiecesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Piece(_message.Message):
    __slots__ = ("is_byte", "byte_value", "text", "first_text")
    IS_BYTE_FIELD_NUMBER: _ClassVar[int]
    BYTE_VALUE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FIRST_TEXT_FIELD_NUMBER: _ClassVar[int]
    is_byte: bool
    byte_value: int
    text: str
    first_text: str
    def __init__(self, is_byte: _Optional[bool] = ..., byte_value: _Optional[int] = ..., text: _Optional[str] = ..., first_text: _Optional[str] = ...) -> None: ...

class GetPiecesResponse(_message.Message):
    __slots__ = ("vocab_size", "model_sha256", "strip_all_leading_spaces", "start_id", "pieces")
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    STRIP_ALL_LEADING_SPACES_FIELD_NUMBER: _ClassVar[int]
    START_ID_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    vocab_size: int
    model_sha256: str
    strip_all_leading_spaces: bool
    start_id: int
    pieces: _containers.RepeatedCompositeFieldContainer[Piece]
    def __init__(self, vocab_size: _Optional[int] = ..., model_sha256: _Optional[str] = ..., strip_all_leading_spaces: _Optional[bool] = ..., start_id: _Optional[int] = ..., pieces: _Optional[_Iterable[_Union[Piece, _Mapping]]] = ...) -> None: ...
