from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ConnectRequest(_message.Message):
    __slots__ = ("robot_id", "driver", "options", "control_hz", "watchdog_s", "spin_s", "camera_size", "camera_hz")
    class OptionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ROBOT_ID_FIELD_NUMBER: _ClassVar[int]
    DRIVER_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    CONTROL_HZ_FIELD_NUMBER: _ClassVar[int]
    WATCHDOG_S_FIELD_NUMBER: _ClassVar[int]
    SPIN_S_FIELD_NUMBER: _ClassVar[int]
    CAMERA_SIZE_FIELD_NUMBER: _ClassVar[int]
    CAMERA_HZ_FIELD_NUMBER: _ClassVar[int]
    robot_id: str
    driver: str
    options: _containers.ScalarMap[str, str]
    control_hz: float
    watchdog_s: float
    spin_s: float
    camera_size: int
    camera_hz: float
    def __init__(self, robot_id: _Optional[str] = ..., driver: _Optional[str] = ..., options: _Optional[_Mapping[str, str]] = ..., control_hz: _Optional[float] = ..., watchdog_s: _Optional[float] = ..., spin_s: _Optional[float] = ..., camera_size: _Optional[int] = ..., camera_hz: _Optional[float] = ...) -> None: ...

class RobotRef(_message.Message):
    __slots__ = ("robot_id",)
    ROBOT_ID_FIELD_NUMBER: _ClassVar[int]
    robot_id: str
    def __init__(self, robot_id: _Optional[str] = ...) -> None: ...

class ListRobotsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RobotList(_message.Message):
    __slots__ = ("robots",)
    ROBOTS_FIELD_NUMBER: _ClassVar[int]
    robots: _containers.RepeatedCompositeFieldContainer[RobotInfo]
    def __init__(self, robots: _Optional[_Iterable[_Union[RobotInfo, _Mapping]]] = ...) -> None: ...

class RobotInfo(_message.Message):
    __slots__ = ("robot_id", "driver", "joint_names", "control_hz", "watchdog_s", "limits", "realtime", "camera_endpoint", "camera_size")
    ROBOT_ID_FIELD_NUMBER: _ClassVar[int]
    DRIVER_FIELD_NUMBER: _ClassVar[int]
    JOINT_NAMES_FIELD_NUMBER: _ClassVar[int]
    CONTROL_HZ_FIELD_NUMBER: _ClassVar[int]
    WATCHDOG_S_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    REALTIME_FIELD_NUMBER: _ClassVar[int]
    CAMERA_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    CAMERA_SIZE_FIELD_NUMBER: _ClassVar[int]
    robot_id: str
    driver: str
    joint_names: _containers.RepeatedScalarFieldContainer[str]
    control_hz: float
    watchdog_s: float
    limits: SafetyLimits
    realtime: str
    camera_endpoint: str
    camera_size: int
    def __init__(self, robot_id: _Optional[str] = ..., driver: _Optional[str] = ..., joint_names: _Optional[_Iterable[str]] = ..., control_hz: _Optional[float] = ..., watchdog_s: _Optional[float] = ..., limits: _Optional[_Union[SafetyLimits, _Mapping]] = ..., realtime: _Optional[str] = ..., camera_endpoint: _Optional[str] = ..., camera_size: _Optional[int] = ...) -> None: ...

class JointCommand(_message.Message):
    __slots__ = ("robot_id", "seq", "position", "velocity", "gripper", "resetting")
    ROBOT_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    VELOCITY_FIELD_NUMBER: _ClassVar[int]
    GRIPPER_FIELD_NUMBER: _ClassVar[int]
    RESETTING_FIELD_NUMBER: _ClassVar[int]
    robot_id: str
    seq: int
    position: _containers.RepeatedScalarFieldContainer[float]
    velocity: _containers.RepeatedScalarFieldContainer[float]
    gripper: float
    resetting: bool
    def __init__(self, robot_id: _Optional[str] = ..., seq: _Optional[int] = ..., position: _Optional[_Iterable[float]] = ..., velocity: _Optional[_Iterable[float]] = ..., gripper: _Optional[float] = ..., resetting: _Optional[bool] = ...) -> None: ...

class RobotState(_message.Message):
    __slots__ = ("robot_id", "seq", "time", "position", "velocity", "gripper", "estopped", "fault", "loop_jitter_s", "intervening", "loop_lateness_s", "overruns", "holding", "hold_reason", "target", "command_seq", "clipped", "slowed", "episode", "episode_intervened_ticks", "end_effector", "policy_seq", "estop_requested", "policy_resetting")
    ROBOT_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    VELOCITY_FIELD_NUMBER: _ClassVar[int]
    GRIPPER_FIELD_NUMBER: _ClassVar[int]
    ESTOPPED_FIELD_NUMBER: _ClassVar[int]
    FAULT_FIELD_NUMBER: _ClassVar[int]
    LOOP_JITTER_S_FIELD_NUMBER: _ClassVar[int]
    INTERVENING_FIELD_NUMBER: _ClassVar[int]
    LOOP_LATENESS_S_FIELD_NUMBER: _ClassVar[int]
    OVERRUNS_FIELD_NUMBER: _ClassVar[int]
    HOLDING_FIELD_NUMBER: _ClassVar[int]
    HOLD_REASON_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    COMMAND_SEQ_FIELD_NUMBER: _ClassVar[int]
    CLIPPED_FIELD_NUMBER: _ClassVar[int]
    SLOWED_FIELD_NUMBER: _ClassVar[int]
    EPISODE_FIELD_NUMBER: _ClassVar[int]
    EPISODE_INTERVENED_TICKS_FIELD_NUMBER: _ClassVar[int]
    END_EFFECTOR_FIELD_NUMBER: _ClassVar[int]
    POLICY_SEQ_FIELD_NUMBER: _ClassVar[int]
    ESTOP_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    POLICY_RESETTING_FIELD_NUMBER: _ClassVar[int]
    robot_id: str
    seq: int
    time: float
    position: _containers.RepeatedScalarFieldContainer[float]
    velocity: _containers.RepeatedScalarFieldContainer[float]
    gripper: float
    estopped: bool
    fault: str
    loop_jitter_s: float
    intervening: bool
    loop_lateness_s: float
    overruns: int
    holding: bool
    hold_reason: str
    target: _containers.RepeatedScalarFieldContainer[float]
    command_seq: int
    clipped: bool
    slowed: bool
    episode: int
    episode_intervened_ticks: int
    end_effector: _containers.RepeatedScalarFieldContainer[float]
    policy_seq: int
    estop_requested: bool
    policy_resetting: bool
    def __init__(self, robot_id: _Optional[str] = ..., seq: _Optional[int] = ..., time: _Optional[float] = ..., position: _Optional[_Iterable[float]] = ..., velocity: _Optional[_Iterable[float]] = ..., gripper: _Optional[float] = ..., estopped: _Optional[bool] = ..., fault: _Optional[str] = ..., loop_jitter_s: _Optional[float] = ..., intervening: _Optional[bool] = ..., loop_lateness_s: _Optional[float] = ..., overruns: _Optional[int] = ..., holding: _Optional[bool] = ..., hold_reason: _Optional[str] = ..., target: _Optional[_Iterable[float]] = ..., command_seq: _Optional[int] = ..., clipped: _Optional[bool] = ..., slowed: _Optional[bool] = ..., episode: _Optional[int] = ..., episode_intervened_ticks: _Optional[int] = ..., end_effector: _Optional[_Iterable[float]] = ..., policy_seq: _Optional[int] = ..., estop_requested: _Optional[bool] = ..., policy_resetting: _Optional[bool] = ...) -> None: ...

class TeleopEvent(_message.Message):
    __slots__ = ("robot_id", "kind", "command")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        COMMAND: _ClassVar[TeleopEvent.Kind]
        INTERVENE_START: _ClassVar[TeleopEvent.Kind]
        INTERVENE_STOP: _ClassVar[TeleopEvent.Kind]
        SUCCESS: _ClassVar[TeleopEvent.Kind]
        FAILURE: _ClassVar[TeleopEvent.Kind]
        RERECORD: _ClassVar[TeleopEvent.Kind]
        TERMINATE: _ClassVar[TeleopEvent.Kind]
    COMMAND: TeleopEvent.Kind
    INTERVENE_START: TeleopEvent.Kind
    INTERVENE_STOP: TeleopEvent.Kind
    SUCCESS: TeleopEvent.Kind
    FAILURE: TeleopEvent.Kind
    RERECORD: TeleopEvent.Kind
    TERMINATE: TeleopEvent.Kind
    ROBOT_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    robot_id: str
    kind: TeleopEvent.Kind
    command: JointCommand
    def __init__(self, robot_id: _Optional[str] = ..., kind: _Optional[_Union[TeleopEvent.Kind, str]] = ..., command: _Optional[_Union[JointCommand, _Mapping]] = ...) -> None: ...

class SafetyLimits(_message.Message):
    __slots__ = ("robot_id", "position_min", "position_max", "velocity_max", "workspace_min", "workspace_max", "slew_max", "jump_max")
    ROBOT_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_MIN_FIELD_NUMBER: _ClassVar[int]
    POSITION_MAX_FIELD_NUMBER: _ClassVar[int]
    VELOCITY_MAX_FIELD_NUMBER: _ClassVar[int]
    WORKSPACE_MIN_FIELD_NUMBER: _ClassVar[int]
    WORKSPACE_MAX_FIELD_NUMBER: _ClassVar[int]
    SLEW_MAX_FIELD_NUMBER: _ClassVar[int]
    JUMP_MAX_FIELD_NUMBER: _ClassVar[int]
    robot_id: str
    position_min: _containers.RepeatedScalarFieldContainer[float]
    position_max: _containers.RepeatedScalarFieldContainer[float]
    velocity_max: _containers.RepeatedScalarFieldContainer[float]
    workspace_min: _containers.RepeatedScalarFieldContainer[float]
    workspace_max: _containers.RepeatedScalarFieldContainer[float]
    slew_max: _containers.RepeatedScalarFieldContainer[float]
    jump_max: float
    def __init__(self, robot_id: _Optional[str] = ..., position_min: _Optional[_Iterable[float]] = ..., position_max: _Optional[_Iterable[float]] = ..., velocity_max: _Optional[_Iterable[float]] = ..., workspace_min: _Optional[_Iterable[float]] = ..., workspace_max: _Optional[_Iterable[float]] = ..., slew_max: _Optional[_Iterable[float]] = ..., jump_max: _Optional[float] = ...) -> None: ...

class EStopRequest(_message.Message):
    __slots__ = ("robot_id", "reason")
    ROBOT_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    robot_id: str
    reason: str
    def __init__(self, robot_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class Intervention(_message.Message):
    __slots__ = ("robot_id", "seq", "active", "command")
    ROBOT_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    robot_id: str
    seq: int
    active: bool
    command: JointCommand
    def __init__(self, robot_id: _Optional[str] = ..., seq: _Optional[int] = ..., active: _Optional[bool] = ..., command: _Optional[_Union[JointCommand, _Mapping]] = ...) -> None: ...

class RecordingRequest(_message.Message):
    __slots__ = ("robot_id", "dataset", "task", "replay_endpoint", "replay_source", "intervention_source", "queue_ticks", "max_episode_ticks")
    ROBOT_ID_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    REPLAY_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    REPLAY_SOURCE_FIELD_NUMBER: _ClassVar[int]
    INTERVENTION_SOURCE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TICKS_FIELD_NUMBER: _ClassVar[int]
    MAX_EPISODE_TICKS_FIELD_NUMBER: _ClassVar[int]
    robot_id: str
    dataset: str
    task: str
    replay_endpoint: str
    replay_source: str
    intervention_source: str
    queue_ticks: int
    max_episode_ticks: int
    def __init__(self, robot_id: _Optional[str] = ..., dataset: _Optional[str] = ..., task: _Optional[str] = ..., replay_endpoint: _Optional[str] = ..., replay_source: _Optional[str] = ..., intervention_source: _Optional[str] = ..., queue_ticks: _Optional[int] = ..., max_episode_ticks: _Optional[int] = ...) -> None: ...

class RecordingStatus(_message.Message):
    __slots__ = ("robot_id", "recording", "dataset", "session", "episodes_kept", "episodes_discarded", "ticks_recorded", "ticks_dropped", "replay_pushes", "write_errors", "last_episode_uri", "last_error", "episodes_failed")
    ROBOT_ID_FIELD_NUMBER: _ClassVar[int]
    RECORDING_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    EPISODES_KEPT_FIELD_NUMBER: _ClassVar[int]
    EPISODES_DISCARDED_FIELD_NUMBER: _ClassVar[int]
    TICKS_RECORDED_FIELD_NUMBER: _ClassVar[int]
    TICKS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    REPLAY_PUSHES_FIELD_NUMBER: _ClassVar[int]
    WRITE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    LAST_EPISODE_URI_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FAILED_FIELD_NUMBER: _ClassVar[int]
    robot_id: str
    recording: bool
    dataset: str
    session: str
    episodes_kept: int
    episodes_discarded: int
    ticks_recorded: int
    ticks_dropped: int
    replay_pushes: int
    write_errors: int
    last_episode_uri: str
    last_error: str
    episodes_failed: int
    def __init__(self, robot_id: _Optional[str] = ..., recording: _Optional[bool] = ..., dataset: _Optional[str] = ..., session: _Optional[str] = ..., episodes_kept: _Optional[int] = ..., episodes_discarded: _Optional[int] = ..., ticks_recorded: _Optional[int] = ..., ticks_dropped: _Optional[int] = ..., replay_pushes: _Optional[int] = ..., write_errors: _Optional[int] = ..., last_episode_uri: _Optional[str] = ..., last_error: _Optional[str] = ..., episodes_failed: _Optional[int] = ...) -> None: ...
