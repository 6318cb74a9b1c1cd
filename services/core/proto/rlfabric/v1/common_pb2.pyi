from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    COORDINATOR: _ClassVar[Role]
    LEARNER: _ClassVar[Role]
    ROLLOUT: _ClassVar[Role]
    ENV: _ClassVar[Role]
    REPLAY: _ClassVar[Role]
    ROBOT_GATEWAY: _ClassVar[Role]
ROLE_UNSPECIFIED: Role
COORDINATOR: Role
LEARNER: Role
ROLLOUT: Role
ENV: Role
REPLAY: Role
ROBOT_GATEWAY: Role

class Endpoint(_message.Message):
    __slots__ = ("grpc", "data", "metrics")
    GRPC_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    grpc: str
    data: str
    metrics: str
    def __init__(self, grpc: _Optional[str] = ..., data: _Optional[str] = ..., metrics: _Optional[str] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ConfigureRequest(_message.Message):
    __slots__ = ("run_id", "config_json", "peers", "worker_index", "context_json")
    class PeersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    WORKER_INDEX_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_JSON_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    config_json: str
    peers: _containers.ScalarMap[str, str]
    worker_index: int
    context_json: str
    def __init__(self, run_id: _Optional[str] = ..., config_json: _Optional[str] = ..., peers: _Optional[_Mapping[str, str]] = ..., worker_index: _Optional[int] = ..., context_json: _Optional[str] = ...) -> None: ...

class ConfigureReply(_message.Message):
    __slots__ = ("data_endpoint", "detail_json")
    DATA_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    DETAIL_JSON_FIELD_NUMBER: _ClassVar[int]
    data_endpoint: str
    detail_json: str
    def __init__(self, data_endpoint: _Optional[str] = ..., detail_json: _Optional[str] = ...) -> None: ...

class EpisodeStats(_message.Message):
    __slots__ = ("episodes", "return_mean", "return_std", "length_mean", "return_min", "return_max")
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    RETURN_MEAN_FIELD_NUMBER: _ClassVar[int]
    RETURN_STD_FIELD_NUMBER: _ClassVar[int]
    LENGTH_MEAN_FIELD_NUMBER: _ClassVar[int]
    RETURN_MIN_FIELD_NUMBER: _ClassVar[int]
    RETURN_MAX_FIELD_NUMBER: _ClassVar[int]
    episodes: int
    return_mean: float
    return_std: float
    length_mean: float
    return_min: float
    return_max: float
    def __init__(self, episodes: _Optional[int] = ..., return_mean: _Optional[float] = ..., return_std: _Optional[float] = ..., length_mean: _Optional[float] = ..., return_min: _Optional[float] = ..., return_max: _Optional[float] = ...) -> None: ...
