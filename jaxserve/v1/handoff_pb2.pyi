from jaxserve.v1 import jaxserve_pb2 as _jaxserve_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request", "target_kv_layout", "transport")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TARGET_KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    request: _jaxserve_pb2.GenerateRequest
    target_kv_layout: str
    transport: str
    def __init__(self, request: _Optional[_Union[_jaxserve_pb2.GenerateRequest, _Mapping]] = ..., target_kv_layout: _Optional[str] = ..., transport: _Optional[str] = ...) -> None: ...

class HandoffOffer(_message.Message):
    __slots__ = ("protocol_version", "transfer_id", "request_id", "session_id", "model_fingerprint", "kv_layout", "num_tokens", "prompt_token_ids", "first_token_ids", "prefix_hashes", "digest", "payload_bytes", "expires_unix_s", "address", "transport", "transfer_address", "cached_tokens", "sampling_seed")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASHES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_SEED_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    transfer_id: str
    request_id: str
    session_id: str
    model_fingerprint: str
    kv_layout: str
    num_tokens: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prefix_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    digest: str
    payload_bytes: int
    expires_unix_s: float
    address: str
    transport: str
    transfer_address: str
    cached_tokens: int
    sampling_seed: int
    def __init__(self, protocol_version: _Optional[int] = ..., transfer_id: _Optional[str] = ..., request_id: _Optional[str] = ..., session_id: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., kv_layout: _Optional[str] = ..., num_tokens: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., first_token_ids: _Optional[_Iterable[int]] = ..., prefix_hashes: _Optional[_Iterable[bytes]] = ..., digest: _Optional[str] = ..., payload_bytes: _Optional[int] = ..., expires_unix_s: _Optional[float] = ..., address: _Optional[str] = ..., transport: _Optional[str] = ..., transfer_address: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., sampling_seed: _Optional[int] = ...) -> None: ...

class PullPagesRequest(_message.Message):
    __slots__ = ("transfer_id",)
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    def __init__(self, transfer_id: _Optional[str] = ...) -> None: ...

class PageChunk(_message.Message):
    __slots__ = ("index", "data", "last")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    index: int
    data: bytes
    last: bool
    def __init__(self, index: _Optional[int] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("transfer_id", "pulled")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    PULLED_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    pulled: bool
    def __init__(self, transfer_id: _Optional[str] = ..., pulled: _Optional[bool] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request", "offer", "recompute_on_failure")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    OFFER_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_ON_FAILURE_FIELD_NUMBER: _ClassVar[int]
    request: _jaxserve_pb2.GenerateRequest
    offer: HandoffOffer
    recompute_on_failure: bool
    def __init__(self, request: _Optional[_Union[_jaxserve_pb2.GenerateRequest, _Mapping]] = ..., offer: _Optional[_Union[HandoffOffer, _Mapping]] = ..., recompute_on_failure: _Optional[bool] = ...) -> None: ...
