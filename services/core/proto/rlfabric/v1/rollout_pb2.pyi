from rlfabric.services.core.proto.rlfabric.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CollectRequest(_message.Message):
    __slots__ = ("batch_index", "min_version", "timeout_s")
    BATCH_INDEX_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    batch_index: int
    min_version: int
    timeout_s: float
    def __init__(self, batch_index: _Optional[int] = ..., min_version: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class CollectReply(_message.Message):
    __slots__ = ("batch_index", "env_steps", "weight_version", "episodes", "collect_seconds", "env_seconds", "policy_seconds", "weight_wait_seconds", "episode_returns", "shard", "shard_envs", "stats")
    class StatsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    BATCH_INDEX_FIELD_NUMBER: _ClassVar[int]
    ENV_STEPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    COLLECT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ENV_SECONDS_FIELD_NUMBER: _ClassVar[int]
    POLICY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EPISODE_RETURNS_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    SHARD_ENVS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    batch_index: int
    env_steps: int
    weight_version: int
    episodes: _common_pb2.EpisodeStats
    collect_seconds: float
    env_seconds: float
    policy_seconds: float
    weight_wait_seconds: float
    episode_returns: _containers.RepeatedScalarFieldContainer[float]
    shard: int
    shard_envs: int
    stats: _containers.ScalarMap[str, float]
    def __init__(self, batch_index: _Optional[int] = ..., env_steps: _Optional[int] = ..., weight_version: _Optional[int] = ..., episodes: _Optional[_Union[_common_pb2.EpisodeStats, _Mapping]] = ..., collect_seconds: _Optional[float] = ..., env_seconds: _Optional[float] = ..., policy_seconds: _Optional[float] = ..., weight_wait_seconds: _Optional[float] = ..., episode_returns: _Optional[_Iterable[float]] = ..., shard: _Optional[int] = ..., shard_envs: _Optional[int] = ..., stats: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ProduceRequest(_message.Message):
    __slots__ = ("first_batch_index", "max_batches", "staleness")
    FIRST_BATCH_INDEX_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCHES_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    first_batch_index: int
    max_batches: int
    staleness: int
    def __init__(self, first_batch_index: _Optional[int] = ..., max_batches: _Optional[int] = ..., staleness: _Optional[int] = ...) -> None: ...

class EvaluateRequest(_message.Message):
    __slots__ = ("episodes", "stochastic", "seed")
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    STOCHASTIC_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    episodes: int
    stochastic: bool
    seed: int
    def __init__(self, episodes: _Optional[int] = ..., stochastic: _Optional[bool] = ..., seed: _Optional[int] = ...) -> None: ...

class EvaluateReply(_message.Message):
    __slots__ = ("episodes", "weight_version", "returns", "seconds", "successes")
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    RETURNS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    SUCCESSES_FIELD_NUMBER: _ClassVar[int]
    episodes: _common_pb2.EpisodeStats
    weight_version: int
    returns: _containers.RepeatedScalarFieldContainer[float]
    seconds: float
    successes: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, episodes: _Optional[_Union[_common_pb2.EpisodeStats, _Mapping]] = ..., weight_version: _Optional[int] = ..., returns: _Optional[_Iterable[float]] = ..., seconds: _Optional[float] = ..., successes: _Optional[_Iterable[float]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("last_batch_index",)
    LAST_BATCH_INDEX_FIELD_NUMBER: _ClassVar[int]
    last_batch_index: int
    def __init__(self, last_batch_index: _Optional[int] = ...) -> None: ...

class ProbeRequest(_message.Message):
    __slots__ = ("round_trips",)
    ROUND_TRIPS_FIELD_NUMBER: _ClassVar[int]
    round_trips: int
    def __init__(self, round_trips: _Optional[int] = ...) -> None: ...

class ProbeReply(_message.Message):
    __slots__ = ("round_trip_seconds", "payload_bytes", "in_process")
    ROUND_TRIP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    IN_PROCESS_FIELD_NUMBER: _ClassVar[int]
    round_trip_seconds: float
    payload_bytes: int
    in_process: bool
    def __init__(self, round_trip_seconds: _Optional[float] = ..., payload_bytes: _Optional[int] = ..., in_process: _Optional[bool] = ...) -> None: ...

class RolloutState(_message.Message):
    __slots__ = ("weight_version", "batches", "env_steps", "discarded_batches")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    ENV_STEPS_FIELD_NUMBER: _ClassVar[int]
    DISCARDED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    batches: int
    env_steps: int
    discarded_batches: int
    def __init__(self, weight_version: _Optional[int] = ..., batches: _Optional[int] = ..., env_steps: _Optional[int] = ..., discarded_batches: _Optional[int] = ...) -> None: ...
