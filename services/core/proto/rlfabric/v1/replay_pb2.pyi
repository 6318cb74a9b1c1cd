from rlfabric.services.core.proto.rlfabric.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class ClearRequest(_message.Message):
    __slots__ = ("source", "pending_only", "run_id")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    PENDING_ONLY_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    source: str
    pending_only: bool
    run_id: str
    def __init__(self, source: _Optional[str] = ..., pending_only: _Optional[bool] = ..., run_id: _Optional[str] = ...) -> None: ...

class ReplayStats(_message.Message):
    __slots__ = ("batches", "transitions", "capacity", "bytes", "puts", "onpolicy_gets", "samples", "evicted_batches", "stale_dropped", "rejected_messages", "pending_onpolicy", "newest_version", "source_transitions")
    class SourceTransitionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    TRANSITIONS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PUTS_FIELD_NUMBER: _ClassVar[int]
    ONPOLICY_GETS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    STALE_DROPPED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PENDING_ONPOLICY_FIELD_NUMBER: _ClassVar[int]
    NEWEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_TRANSITIONS_FIELD_NUMBER: _ClassVar[int]
    batches: int
    transitions: int
    capacity: int
    bytes: int
    puts: int
    onpolicy_gets: int
    samples: int
    evicted_batches: int
    stale_dropped: int
    rejected_messages: int
    pending_onpolicy: int
    newest_version: int
    source_transitions: _containers.ScalarMap[str, int]
    def __init__(self, batches: _Optional[int] = ..., transitions: _Optional[int] = ..., capacity: _Optional[int] = ..., bytes: _Optional[int] = ..., puts: _Optional[int] = ..., onpolicy_gets: _Optional[int] = ..., samples: _Optional[int] = ..., evicted_batches: _Optional[int] = ..., stale_dropped: _Optional[int] = ..., rejected_messages: _Optional[int] = ..., pending_onpolicy: _Optional[int] = ..., newest_version: _Optional[int] = ..., source_transitions: _Optional[_Mapping[str, int]] = ...) -> None: ...
