from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NodeReport(_message.Message):
    __slots__ = ("node", "cluster", "engine", "version", "version_digest", "repository_id", "check", "check_unix", "lag_seconds", "last_error", "last_error_unix", "bytes_fetched", "sent_unix", "interval", "target_version", "agent_state", "age", "via", "drifted_chunks")
    NODE_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_DIGEST_FIELD_NUMBER: _ClassVar[int]
    REPOSITORY_ID_FIELD_NUMBER: _ClassVar[int]
    CHECK_FIELD_NUMBER: _ClassVar[int]
    CHECK_UNIX_FIELD_NUMBER: _ClassVar[int]
    LAG_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_UNIX_FIELD_NUMBER: _ClassVar[int]
    BYTES_FETCHED_FIELD_NUMBER: _ClassVar[int]
    SENT_UNIX_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_FIELD_NUMBER: _ClassVar[int]
    TARGET_VERSION_FIELD_NUMBER: _ClassVar[int]
    AGENT_STATE_FIELD_NUMBER: _ClassVar[int]
    AGE_FIELD_NUMBER: _ClassVar[int]
    VIA_FIELD_NUMBER: _ClassVar[int]
    DRIFTED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    node: str
    cluster: str
    engine: str
    version: int
    version_digest: bytes
    repository_id: bytes
    check: str
    check_unix: float
    lag_seconds: float
    last_error: str
    last_error_unix: float
    bytes_fetched: int
    sent_unix: float
    interval: float
    target_version: int
    agent_state: str
    age: float
    via: str
    drifted_chunks: int
    def __init__(self, node: _Optional[str] = ..., cluster: _Optional[str] = ..., engine: _Optional[str] = ..., version: _Optional[int] = ..., version_digest: _Optional[bytes] = ..., repository_id: _Optional[bytes] = ..., check: _Optional[str] = ..., check_unix: _Optional[float] = ..., lag_seconds: _Optional[float] = ..., last_error: _Optional[str] = ..., last_error_unix: _Optional[float] = ..., bytes_fetched: _Optional[int] = ..., sent_unix: _Optional[float] = ..., interval: _Optional[float] = ..., target_version: _Optional[int] = ..., agent_state: _Optional[str] = ..., age: _Optional[float] = ..., via: _Optional[str] = ..., drifted_chunks: _Optional[int] = ...) -> None: ...

class ReportBatch(_message.Message):
    __slots__ = ("reports",)
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    reports: _containers.RepeatedCompositeFieldContainer[NodeReport]
    def __init__(self, reports: _Optional[_Iterable[_Union[NodeReport, _Mapping]]] = ...) -> None: ...

class ReportAck(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    def __init__(self, accepted: _Optional[int] = ...) -> None: ...

class ViewRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FleetView(_message.Message):
    __slots__ = ("nodes", "latest", "pinned", "now_unix")
    NODES_FIELD_NUMBER: _ClassVar[int]
    LATEST_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    NOW_UNIX_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeReport]
    latest: int
    pinned: int
    now_unix: float
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeReport, _Mapping]]] = ..., latest: _Optional[int] = ..., pinned: _Optional[int] = ..., now_unix: _Optional[float] = ...) -> None: ...
