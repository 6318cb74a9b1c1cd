from rlfabric.services.core.proto.rlfabric.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class HostRanksRequest(_message.Message):
    __slots__ = ("world", "first_rank", "count", "rendezvous", "prefix", "device", "timeout_s")
    WORLD_FIELD_NUMBER: _ClassVar[int]
    FIRST_RANK_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    world: int
    first_rank: int
    count: int
    rendezvous: str
    prefix: str
    device: str
    timeout_s: float
    def __init__(self, world: _Optional[int] = ..., first_rank: _Optional[int] = ..., count: _Optional[int] = ..., rendezvous: _Optional[str] = ..., prefix: _Optional[str] = ..., device: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class HostRanksReply(_message.Message):
    __slots__ = ("pids", "host")
    PIDS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    pids: _containers.RepeatedScalarFieldContainer[int]
    host: str
    def __init__(self, pids: _Optional[_Iterable[int]] = ..., host: _Optional[str] = ...) -> None: ...

class WarmStartRequest(_message.Message):
    __slots__ = ("run_id", "config_json", "stage", "run_dir")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    RUN_DIR_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    config_json: str
    stage: str
    run_dir: str
    def __init__(self, run_id: _Optional[str] = ..., config_json: _Optional[str] = ..., stage: _Optional[str] = ..., run_dir: _Optional[str] = ...) -> None: ...

class WarmStartReply(_message.Message):
    __slots__ = ("path", "summary", "kept")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    path: str
    summary: str
    kept: bool
    def __init__(self, path: _Optional[str] = ..., summary: _Optional[str] = ..., kept: _Optional[bool] = ...) -> None: ...

class TrainRequest(_message.Message):
    __slots__ = ("batch_index", "min_version", "timeout_s")
    BATCH_INDEX_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    batch_index: int
    min_version: int
    timeout_s: float
    def __init__(self, batch_index: _Optional[int] = ..., min_version: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class TrainReply(_message.Message):
    __slots__ = ("weight_version", "batch_version", "env_steps", "optimizer_steps", "stats", "train_seconds", "wait_seconds")
    class StatsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    BATCH_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENV_STEPS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STEPS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    batch_version: int
    env_steps: int
    optimizer_steps: int
    stats: _containers.ScalarMap[str, float]
    train_seconds: float
    wait_seconds: float
    def __init__(self, weight_version: _Optional[int] = ..., batch_version: _Optional[int] = ..., env_steps: _Optional[int] = ..., optimizer_steps: _Optional[int] = ..., stats: _Optional[_Mapping[str, float]] = ..., train_seconds: _Optional[float] = ..., wait_seconds: _Optional[float] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("key", "extra_json", "periodic")
    KEY_FIELD_NUMBER: _ClassVar[int]
    EXTRA_JSON_FIELD_NUMBER: _ClassVar[int]
    PERIODIC_FIELD_NUMBER: _ClassVar[int]
    key: str
    extra_json: str
    periodic: bool
    def __init__(self, key: _Optional[str] = ..., extra_json: _Optional[str] = ..., periodic: _Optional[bool] = ...) -> None: ...

class CheckpointReply(_message.Message):
    __slots__ = ("uri", "bytes", "weight_version")
    URI_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    uri: str
    bytes: int
    weight_version: int
    def __init__(self, uri: _Optional[str] = ..., bytes: _Optional[int] = ..., weight_version: _Optional[int] = ...) -> None: ...

class LearnerState(_message.Message):
    __slots__ = ("weight_version", "optimizer_steps", "env_steps", "algorithm")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STEPS_FIELD_NUMBER: _ClassVar[int]
    ENV_STEPS_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    optimizer_steps: int
    env_steps: int
    algorithm: str
    def __init__(self, weight_version: _Optional[int] = ..., optimizer_steps: _Optional[int] = ..., env_steps: _Optional[int] = ..., algorithm: _Optional[str] = ...) -> None: ...
