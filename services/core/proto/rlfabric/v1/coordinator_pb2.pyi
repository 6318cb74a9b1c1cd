from rlfabric.services.core.proto.rlfabric.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_STATE_UNSPECIFIED: _ClassVar[RunState]
    PENDING: _ClassVar[RunState]
    RUNNING: _ClassVar[RunState]
    SUCCEEDED: _ClassVar[RunState]
    FAILED: _ClassVar[RunState]
    STOPPED: _ClassVar[RunState]
RUN_STATE_UNSPECIFIED: RunState
PENDING: RunState
RUNNING: RunState
SUCCEEDED: RunState
FAILED: RunState
STOPPED: RunState

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("role", "endpoint", "pid", "host", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    role: _common_pb2.Role
    endpoint: _common_pb2.Endpoint
    pid: int
    host: str
    labels: _containers.ScalarMap[str, str]
    def __init__(self, role: _Optional[_Union[_common_pb2.Role, str]] = ..., endpoint: _Optional[_Union[_common_pb2.Endpoint, _Mapping]] = ..., pid: _Optional[int] = ..., host: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RegisterWorkerReply(_message.Message):
    __slots__ = ("worker_id", "heartbeat_interval_s", "worker_key")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    WORKER_KEY_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    heartbeat_interval_s: float
    worker_key: str
    def __init__(self, worker_id: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ..., worker_key: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "state", "worker_key", "cpu_s", "messages")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    WORKER_KEY_FIELD_NUMBER: _ClassVar[int]
    CPU_S_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    state: str
    worker_key: str
    cpu_s: float
    messages: int
    def __init__(self, worker_id: _Optional[str] = ..., state: _Optional[str] = ..., worker_key: _Optional[str] = ..., cpu_s: _Optional[float] = ..., messages: _Optional[int] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("known", "run_id", "run_key", "lost")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_KEY_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    known: bool
    run_id: str
    run_key: str
    lost: bool
    def __init__(self, known: _Optional[bool] = ..., run_id: _Optional[str] = ..., run_key: _Optional[str] = ..., lost: _Optional[bool] = ...) -> None: ...

class DeregisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "reason", "force", "worker_key")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    WORKER_KEY_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    reason: str
    force: bool
    worker_key: str
    def __init__(self, worker_id: _Optional[str] = ..., reason: _Optional[str] = ..., force: _Optional[bool] = ..., worker_key: _Optional[str] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "role", "endpoint", "pid", "host", "alive", "seconds_since_heartbeat", "run_id")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: _common_pb2.Role
    endpoint: _common_pb2.Endpoint
    pid: int
    host: str
    alive: bool
    seconds_since_heartbeat: float
    run_id: str
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.Role, str]] = ..., endpoint: _Optional[_Union[_common_pb2.Endpoint, _Mapping]] = ..., pid: _Optional[int] = ..., host: _Optional[str] = ..., alive: _Optional[bool] = ..., seconds_since_heartbeat: _Optional[float] = ..., run_id: _Optional[str] = ...) -> None: ...

class ListWorkersReply(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ...) -> None: ...

class SubmitRunRequest(_message.Message):
    __slots__ = ("config_yaml", "overrides", "run_dir", "resume")
    CONFIG_YAML_FIELD_NUMBER: _ClassVar[int]
    OVERRIDES_FIELD_NUMBER: _ClassVar[int]
    RUN_DIR_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    config_yaml: str
    overrides: _containers.RepeatedScalarFieldContainer[str]
    run_dir: str
    resume: bool
    def __init__(self, config_yaml: _Optional[str] = ..., overrides: _Optional[_Iterable[str]] = ..., run_dir: _Optional[str] = ..., resume: _Optional[bool] = ...) -> None: ...

class RunRef(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class RunStatus(_message.Message):
    __slots__ = ("run_id", "state", "reason", "bad_input", "run_dir", "env_steps", "weight_version", "iteration", "latest", "mode", "recoveries", "stage")
    class LatestEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BAD_INPUT_FIELD_NUMBER: _ClassVar[int]
    RUN_DIR_FIELD_NUMBER: _ClassVar[int]
    ENV_STEPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    LATEST_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    RECOVERIES_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    state: RunState
    reason: str
    bad_input: bool
    run_dir: str
    env_steps: int
    weight_version: int
    iteration: int
    latest: _containers.ScalarMap[str, float]
    mode: str
    recoveries: int
    stage: str
    def __init__(self, run_id: _Optional[str] = ..., state: _Optional[_Union[RunState, str]] = ..., reason: _Optional[str] = ..., bad_input: _Optional[bool] = ..., run_dir: _Optional[str] = ..., env_steps: _Optional[int] = ..., weight_version: _Optional[int] = ..., iteration: _Optional[int] = ..., latest: _Optional[_Mapping[str, float]] = ..., mode: _Optional[str] = ..., recoveries: _Optional[int] = ..., stage: _Optional[str] = ...) -> None: ...

class ListRunsReply(_message.Message):
    __slots__ = ("runs",)
    RUNS_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[RunStatus]
    def __init__(self, runs: _Optional[_Iterable[_Union[RunStatus, _Mapping]]] = ...) -> None: ...

class MetricRow(_message.Message):
    __slots__ = ("iteration", "env_steps", "wall_time_s", "weight_version", "values")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    ENV_STEPS_FIELD_NUMBER: _ClassVar[int]
    WALL_TIME_S_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    iteration: int
    env_steps: int
    wall_time_s: float
    weight_version: int
    values: _containers.ScalarMap[str, float]
    def __init__(self, iteration: _Optional[int] = ..., env_steps: _Optional[int] = ..., wall_time_s: _Optional[float] = ..., weight_version: _Optional[int] = ..., values: _Optional[_Mapping[str, float]] = ...) -> None: ...

class LogEvent(_message.Message):
    __slots__ = ("level", "message", "time")
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    level: str
    message: str
    time: float
    def __init__(self, level: _Optional[str] = ..., message: _Optional[str] = ..., time: _Optional[float] = ...) -> None: ...

class RecoveryEvent(_message.Message):
    __slots__ = ("attempt", "role", "worker_id", "cause", "discarded", "resumed_from", "resumed_at_iteration", "weight_version", "seconds", "time")
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    DISCARDED_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FROM_FIELD_NUMBER: _ClassVar[int]
    RESUMED_AT_ITERATION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    attempt: int
    role: str
    worker_id: str
    cause: str
    discarded: str
    resumed_from: str
    resumed_at_iteration: int
    weight_version: int
    seconds: float
    time: float
    def __init__(self, attempt: _Optional[int] = ..., role: _Optional[str] = ..., worker_id: _Optional[str] = ..., cause: _Optional[str] = ..., discarded: _Optional[str] = ..., resumed_from: _Optional[str] = ..., resumed_at_iteration: _Optional[int] = ..., weight_version: _Optional[int] = ..., seconds: _Optional[float] = ..., time: _Optional[float] = ...) -> None: ...

class RunEvent(_message.Message):
    __slots__ = ("metrics", "log", "status", "recovery")
    METRICS_FIELD_NUMBER: _ClassVar[int]
    LOG_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_FIELD_NUMBER: _ClassVar[int]
    metrics: MetricRow
    log: LogEvent
    status: RunStatus
    recovery: RecoveryEvent
    def __init__(self, metrics: _Optional[_Union[MetricRow, _Mapping]] = ..., log: _Optional[_Union[LogEvent, _Mapping]] = ..., status: _Optional[_Union[RunStatus, _Mapping]] = ..., recovery: _Optional[_Union[RecoveryEvent, _Mapping]] = ...) -> None: ...

class ScaleRequest(_message.Message):
    __slots__ = ("run_id", "role", "delta", "count", "timeout_s")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    role: str
    delta: int
    count: int
    timeout_s: float
    def __init__(self, run_id: _Optional[str] = ..., role: _Optional[str] = ..., delta: _Optional[int] = ..., count: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class ScaleReply(_message.Message):
    __slots__ = ("role", "workers", "worker_ids", "applied_at_iteration", "detail")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    APPLIED_AT_ITERATION_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    role: str
    workers: int
    worker_ids: _containers.RepeatedScalarFieldContainer[str]
    applied_at_iteration: int
    detail: str
    def __init__(self, role: _Optional[str] = ..., workers: _Optional[int] = ..., worker_ids: _Optional[_Iterable[str]] = ..., applied_at_iteration: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...

class PlanRow(_message.Message):
    __slots__ = ("plan", "predicted_iteration_s", "measured_iteration_s", "chosen", "description")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_ITERATION_S_FIELD_NUMBER: _ClassVar[int]
    MEASURED_ITERATION_S_FIELD_NUMBER: _ClassVar[int]
    CHOSEN_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    plan: str
    predicted_iteration_s: float
    measured_iteration_s: float
    chosen: bool
    description: str
    def __init__(self, plan: _Optional[str] = ..., predicted_iteration_s: _Optional[float] = ..., measured_iteration_s: _Optional[float] = ..., chosen: _Optional[bool] = ..., description: _Optional[str] = ...) -> None: ...

class PlanReply(_message.Message):
    __slots__ = ("plan", "description", "decisions")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    plan: str
    description: str
    decisions: _containers.RepeatedCompositeFieldContainer[PlanRow]
    def __init__(self, plan: _Optional[str] = ..., description: _Optional[str] = ..., decisions: _Optional[_Iterable[_Union[PlanRow, _Mapping]]] = ...) -> None: ...

class DashboardLoginReply(_message.Message):
    __slots__ = ("url",)
    URL_FIELD_NUMBER: _ClassVar[int]
    url: str
    def __init__(self, url: _Optional[str] = ...) -> None: ...
