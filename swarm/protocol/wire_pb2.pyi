from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_NONE: _ClassVar[Codec]
    CODEC_FLOAT16: _ClassVar[Codec]
    CODEC_BLOCKWISE8: _ClassVar[Codec]
    CODEC_PIECEWISE: _ClassVar[Codec]
    CODEC_LOWRANK: _ClassVar[Codec]
    CODEC_TOKEN_TOPK: _ClassVar[Codec]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
CODEC_NONE: Codec
CODEC_FLOAT16: Codec
CODEC_BLOCKWISE8: Codec
CODEC_PIECEWISE: Codec
CODEC_LOWRANK: Codec
CODEC_TOKEN_TOPK: Codec
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_INT64: DType

class TensorHeader(_message.Message):
    __slots__ = ("name", "codec", "dtype", "shape", "payload_bytes", "codec_params")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    CODEC_PARAMS_FIELD_NUMBER: _ClassVar[int]
    name: str
    codec: Codec
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    payload_bytes: int
    codec_params: bytes
    def __init__(self, name: _Optional[str] = ..., codec: _Optional[_Union[Codec, str]] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., payload_bytes: _Optional[int] = ..., codec_params: _Optional[bytes] = ...) -> None: ...

class CallMeta(_message.Message):
    __slots__ = ("protocol_version", "microbatch_id", "stage", "reply_codec", "param_version", "loss", "has_loss", "queue_length", "forward_version", "inference", "global_batch", "admitted_at", "reply_codec_name", "reply_epilogue", "admitted_by", "admission_signature")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    REPLY_CODEC_FIELD_NUMBER: _ClassVar[int]
    PARAM_VERSION_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    HAS_LOSS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    FORWARD_VERSION_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_BATCH_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    REPLY_CODEC_NAME_FIELD_NUMBER: _ClassVar[int]
    REPLY_EPILOGUE_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_BY_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    microbatch_id: str
    stage: int
    reply_codec: Codec
    param_version: int
    loss: float
    has_loss: bool
    queue_length: int
    forward_version: int
    inference: bool
    global_batch: int
    admitted_at: int
    reply_codec_name: str
    reply_epilogue: float
    admitted_by: str
    admission_signature: bytes
    def __init__(self, protocol_version: _Optional[int] = ..., microbatch_id: _Optional[str] = ..., stage: _Optional[int] = ..., reply_codec: _Optional[_Union[Codec, str]] = ..., param_version: _Optional[int] = ..., loss: _Optional[float] = ..., has_loss: _Optional[bool] = ..., queue_length: _Optional[int] = ..., forward_version: _Optional[int] = ..., inference: _Optional[bool] = ..., global_batch: _Optional[int] = ..., admitted_at: _Optional[int] = ..., reply_codec_name: _Optional[str] = ..., reply_epilogue: _Optional[float] = ..., admitted_by: _Optional[str] = ..., admission_signature: _Optional[bytes] = ...) -> None: ...

class Frame(_message.Message):
    __slots__ = ("meta", "tensor", "data")
    META_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    meta: CallMeta
    tensor: TensorHeader
    data: bytes
    def __init__(self, meta: _Optional[_Union[CallMeta, _Mapping]] = ..., tensor: _Optional[_Union[TensorHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ("with_digest",)
    WITH_DIGEST_FIELD_NUMBER: _ClassVar[int]
    with_digest: bool
    def __init__(self, with_digest: _Optional[bool] = ...) -> None: ...

class InfoReply(_message.Message):
    __slots__ = ("protocol_version", "stage", "n_stages", "param_version", "queue_length", "throughput", "model_config_json", "samples_processed", "epoch", "state_digest", "requests_rejected", "allreduce_bytes", "backwards_at_stashed_version", "backwards_past_stash", "compression", "gradients_rejected", "steps_skipped", "steps_rolled_back", "requests_busy", "allreduce_fp32_bytes", "recent_loss", "traffic", "rounds_ok", "rounds_failed", "moves", "state_downloads", "transport", "p2p_id", "peer_id", "progress_sent", "progress_received", "epoch_end_s")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    N_STAGES_FIELD_NUMBER: _ClassVar[int]
    PARAM_VERSION_FIELD_NUMBER: _ClassVar[int]
    QUEUE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_FIELD_NUMBER: _ClassVar[int]
    MODEL_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PROCESSED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_REJECTED_FIELD_NUMBER: _ClassVar[int]
    ALLREDUCE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BACKWARDS_AT_STASHED_VERSION_FIELD_NUMBER: _ClassVar[int]
    BACKWARDS_PAST_STASH_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    GRADIENTS_REJECTED_FIELD_NUMBER: _ClassVar[int]
    STEPS_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    STEPS_ROLLED_BACK_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_BUSY_FIELD_NUMBER: _ClassVar[int]
    ALLREDUCE_FP32_BYTES_FIELD_NUMBER: _ClassVar[int]
    RECENT_LOSS_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_OK_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FAILED_FIELD_NUMBER: _ClassVar[int]
    MOVES_FIELD_NUMBER: _ClassVar[int]
    STATE_DOWNLOADS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    P2P_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_SENT_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_END_S_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    stage: int
    n_stages: int
    param_version: int
    queue_length: int
    throughput: float
    model_config_json: str
    samples_processed: int
    epoch: int
    state_digest: str
    requests_rejected: int
    allreduce_bytes: int
    backwards_at_stashed_version: int
    backwards_past_stash: int
    compression: str
    gradients_rejected: int
    steps_skipped: int
    steps_rolled_back: int
    requests_busy: int
    allreduce_fp32_bytes: int
    recent_loss: float
    traffic: _containers.RepeatedCompositeFieldContainer[Traffic]
    rounds_ok: int
    rounds_failed: int
    moves: int
    state_downloads: int
    transport: str
    p2p_id: str
    peer_id: str
    progress_sent: int
    progress_received: int
    epoch_end_s: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, protocol_version: _Optional[int] = ..., stage: _Optional[int] = ..., n_stages: _Optional[int] = ..., param_version: _Optional[int] = ..., queue_length: _Optional[int] = ..., throughput: _Optional[float] = ..., model_config_json: _Optional[str] = ..., samples_processed: _Optional[int] = ..., epoch: _Optional[int] = ..., state_digest: _Optional[str] = ..., requests_rejected: _Optional[int] = ..., allreduce_bytes: _Optional[int] = ..., backwards_at_stashed_version: _Optional[int] = ..., backwards_past_stash: _Optional[int] = ..., compression: _Optional[str] = ..., gradients_rejected: _Optional[int] = ..., steps_skipped: _Optional[int] = ..., steps_rolled_back: _Optional[int] = ..., requests_busy: _Optional[int] = ..., allreduce_fp32_bytes: _Optional[int] = ..., recent_loss: _Optional[float] = ..., traffic: _Optional[_Iterable[_Union[Traffic, _Mapping]]] = ..., rounds_ok: _Optional[int] = ..., rounds_failed: _Optional[int] = ..., moves: _Optional[int] = ..., state_downloads: _Optional[int] = ..., transport: _Optional[str] = ..., p2p_id: _Optional[str] = ..., peer_id: _Optional[str] = ..., progress_sent: _Optional[int] = ..., progress_received: _Optional[int] = ..., epoch_end_s: _Optional[_Iterable[float]] = ...) -> None: ...

class Traffic(_message.Message):
    __slots__ = ("role", "wire_bytes", "fp32_bytes")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FP32_BYTES_FIELD_NUMBER: _ClassVar[int]
    role: str
    wire_bytes: int
    fp32_bytes: int
    def __init__(self, role: _Optional[str] = ..., wire_bytes: _Optional[int] = ..., fp32_bytes: _Optional[int] = ...) -> None: ...

class StageProgress(_message.Message):
    __slots__ = ("protocol_version", "stage", "peer_id", "epoch", "samples", "end_epoch", "address", "admitted", "admitted_next", "stopped_admitting", "public_key", "signature", "claims", "lineage", "averaged", "recovering", "served", "taken_epoch", "taken", "moved_on", "via_hub", "passed_on")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    END_EPOCH_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_NEXT_FIELD_NUMBER: _ClassVar[int]
    STOPPED_ADMITTING_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    CLAIMS_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    AVERAGED_FIELD_NUMBER: _ClassVar[int]
    RECOVERING_FIELD_NUMBER: _ClassVar[int]
    SERVED_FIELD_NUMBER: _ClassVar[int]
    TAKEN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TAKEN_FIELD_NUMBER: _ClassVar[int]
    MOVED_ON_FIELD_NUMBER: _ClassVar[int]
    VIA_HUB_FIELD_NUMBER: _ClassVar[int]
    PASSED_ON_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    stage: int
    peer_id: str
    epoch: int
    samples: int
    end_epoch: bool
    address: str
    admitted: int
    admitted_next: int
    stopped_admitting: bool
    public_key: bytes
    signature: bytes
    claims: bool
    lineage: str
    averaged: int
    recovering: bool
    served: _containers.RepeatedCompositeFieldContainer[Admission]
    taken_epoch: int
    taken: _containers.RepeatedCompositeFieldContainer[Admission]
    moved_on: Admission
    via_hub: bool
    passed_on: _containers.RepeatedCompositeFieldContainer[StageProgress]
    def __init__(self, protocol_version: _Optional[int] = ..., stage: _Optional[int] = ..., peer_id: _Optional[str] = ..., epoch: _Optional[int] = ..., samples: _Optional[int] = ..., end_epoch: _Optional[bool] = ..., address: _Optional[str] = ..., admitted: _Optional[int] = ..., admitted_next: _Optional[int] = ..., stopped_admitting: _Optional[bool] = ..., public_key: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., claims: _Optional[bool] = ..., lineage: _Optional[str] = ..., averaged: _Optional[int] = ..., recovering: _Optional[bool] = ..., served: _Optional[_Iterable[_Union[Admission, _Mapping]]] = ..., taken_epoch: _Optional[int] = ..., taken: _Optional[_Iterable[_Union[Admission, _Mapping]]] = ..., moved_on: _Optional[_Union[Admission, _Mapping]] = ..., via_hub: _Optional[bool] = ..., passed_on: _Optional[_Iterable[_Union[StageProgress, _Mapping]]] = ...) -> None: ...

class Admission(_message.Message):
    __slots__ = ("microbatch_id", "samples", "global_batch", "admitted_at", "admitted_by", "signature")
    MICROBATCH_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_BATCH_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_BY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    microbatch_id: str
    samples: int
    global_batch: int
    admitted_at: int
    admitted_by: str
    signature: bytes
    def __init__(self, microbatch_id: _Optional[str] = ..., samples: _Optional[int] = ..., global_batch: _Optional[int] = ..., admitted_at: _Optional[int] = ..., admitted_by: _Optional[str] = ..., signature: _Optional[bytes] = ...) -> None: ...

class ProgressAck(_message.Message):
    __slots__ = ("epoch", "admitted", "admitted_next", "served_held")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_NEXT_FIELD_NUMBER: _ClassVar[int]
    SERVED_HELD_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    admitted: int
    admitted_next: int
    served_held: int
    def __init__(self, epoch: _Optional[int] = ..., admitted: _Optional[int] = ..., admitted_next: _Optional[int] = ..., served_held: _Optional[int] = ...) -> None: ...

class ReachRequest(_message.Message):
    __slots__ = ("host", "port", "tls_cert", "proof")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    TLS_CERT_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    host: str
    port: int
    tls_cert: str
    proof: bytes
    def __init__(self, host: _Optional[str] = ..., port: _Optional[int] = ..., tls_cert: _Optional[str] = ..., proof: _Optional[bytes] = ...) -> None: ...

class ReachReply(_message.Message):
    __slots__ = ("reachable", "dialled", "detail")
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    DIALLED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    reachable: bool
    dialled: str
    detail: str
    def __init__(self, reachable: _Optional[bool] = ..., dialled: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class P2PCall(_message.Message):
    __slots__ = ("frame", "timeout", "auth", "status", "details", "end")
    FRAME_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    frame: bytes
    timeout: float
    auth: str
    status: int
    details: str
    end: bool
    def __init__(self, frame: _Optional[bytes] = ..., timeout: _Optional[float] = ..., auth: _Optional[str] = ..., status: _Optional[int] = ..., details: _Optional[str] = ..., end: _Optional[bool] = ...) -> None: ...
