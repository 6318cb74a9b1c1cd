from rlfabric.services.core.proto.rlfabric.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Space(_message.Message):
    __slots__ = ("kind", "shape", "dtype", "low", "high", "n", "spaces")
    class SpacesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Space
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Space, _Mapping]] = ...) -> None: ...
    KIND_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LOW_FIELD_NUMBER: _ClassVar[int]
    HIGH_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    SPACES_FIELD_NUMBER: _ClassVar[int]
    kind: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    low: _containers.RepeatedScalarFieldContainer[float]
    high: _containers.RepeatedScalarFieldContainer[float]
    n: int
    spaces: _containers.MessageMap[str, Space]
    def __init__(self, kind: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., low: _Optional[_Iterable[float]] = ..., high: _Optional[_Iterable[float]] = ..., n: _Optional[int] = ..., spaces: _Optional[_Mapping[str, Space]] = ...) -> None: ...

class EnvSpec(_message.Message):
    __slots__ = ("env_id", "num_envs", "num_chunks", "eval_envs", "observation_space", "action_space")
    ENV_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_ENVS_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    EVAL_ENVS_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_SPACE_FIELD_NUMBER: _ClassVar[int]
    ACTION_SPACE_FIELD_NUMBER: _ClassVar[int]
    env_id: str
    num_envs: int
    num_chunks: int
    eval_envs: int
    observation_space: Space
    action_space: Space
    def __init__(self, env_id: _Optional[str] = ..., num_envs: _Optional[int] = ..., num_chunks: _Optional[int] = ..., eval_envs: _Optional[int] = ..., observation_space: _Optional[_Union[Space, _Mapping]] = ..., action_space: _Optional[_Union[Space, _Mapping]] = ...) -> None: ...

class EnvStats(_message.Message):
    __slots__ = ("env_steps", "episodes", "rejected_messages", "step_seconds")
    ENV_STEPS_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    REJECTED_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    env_steps: int
    episodes: _common_pb2.EpisodeStats
    rejected_messages: int
    step_seconds: float
    def __init__(self, env_steps: _Optional[int] = ..., episodes: _Optional[_Union[_common_pb2.EpisodeStats, _Mapping]] = ..., rejected_messages: _Optional[int] = ..., step_seconds: _Optional[float] = ...) -> None: ...
