from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetRequest(_message.Message):
    __slots__ = ("key", "offset", "length", "has_range")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    HAS_RANGE_FIELD_NUMBER: _ClassVar[int]
    key: str
    offset: int
    length: int
    has_range: bool
    def __init__(self, key: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., has_range: _Optional[bool] = ...) -> None: ...

class GetChunk(_message.Message):
    __slots__ = ("data", "total_bytes")
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    total_bytes: int
    def __init__(self, data: _Optional[bytes] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class StatRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class StatResponse(_message.Message):
    __slots__ = ("size",)
    SIZE_FIELD_NUMBER: _ClassVar[int]
    size: int
    def __init__(self, size: _Optional[int] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("prefix",)
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    def __init__(self, prefix: _Optional[str] = ...) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("after_version", "push_bytes")
    AFTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    PUSH_BYTES_FIELD_NUMBER: _ClassVar[int]
    after_version: int
    push_bytes: int
    def __init__(self, after_version: _Optional[int] = ..., push_bytes: _Optional[int] = ...) -> None: ...

class VersionEvent(_message.Message):
    __slots__ = ("version", "latest", "copies", "pushed", "piece")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LATEST_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    PUSHED_FIELD_NUMBER: _ClassVar[int]
    PIECE_FIELD_NUMBER: _ClassVar[int]
    version: int
    latest: int
    copies: _containers.RepeatedCompositeFieldContainer[UpstreamCopy]
    pushed: _containers.RepeatedCompositeFieldContainer[PushedObject]
    piece: PushedPiece
    def __init__(self, version: _Optional[int] = ..., latest: _Optional[int] = ..., copies: _Optional[_Iterable[_Union[UpstreamCopy, _Mapping]]] = ..., pushed: _Optional[_Iterable[_Union[PushedObject, _Mapping]]] = ..., piece: _Optional[_Union[PushedPiece, _Mapping]] = ...) -> None: ...

class PushedObject(_message.Message):
    __slots__ = ("key", "size")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    key: str
    size: int
    def __init__(self, key: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class PushedPiece(_message.Message):
    __slots__ = ("key", "offset", "data", "dropped")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    key: str
    offset: int
    data: bytes
    dropped: bool
    def __init__(self, key: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., dropped: _Optional[bool] = ...) -> None: ...

class UpstreamCopy(_message.Message):
    __slots__ = ("key", "data", "absent", "keys")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    ABSENT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    key: str
    data: bytes
    absent: bool
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, key: _Optional[str] = ..., data: _Optional[bytes] = ..., absent: _Optional[bool] = ..., keys: _Optional[_Iterable[str]] = ...) -> None: ...

class PutChunk(_message.Message):
    __slots__ = ("key", "total_bytes", "if_absent", "digest", "data", "references_pending", "commit_latest", "release")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    IF_ABSENT_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    REFERENCES_PENDING_FIELD_NUMBER: _ClassVar[int]
    COMMIT_LATEST_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    key: str
    total_bytes: int
    if_absent: bool
    digest: bytes
    data: bytes
    references_pending: bool
    commit_latest: bool
    release: str
    def __init__(self, key: _Optional[str] = ..., total_bytes: _Optional[int] = ..., if_absent: _Optional[bool] = ..., digest: _Optional[bytes] = ..., data: _Optional[bytes] = ..., references_pending: _Optional[bool] = ..., commit_latest: _Optional[bool] = ..., release: _Optional[str] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UploadCredit(_message.Message):
    __slots__ = ("send_until", "stored", "gone", "unchecked")
    SEND_UNTIL_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    GONE_FIELD_NUMBER: _ClassVar[int]
    UNCHECKED_FIELD_NUMBER: _ClassVar[int]
    send_until: int
    stored: int
    gone: _containers.RepeatedScalarFieldContainer[str]
    unchecked: bool
    def __init__(self, send_until: _Optional[int] = ..., stored: _Optional[int] = ..., gone: _Optional[_Iterable[str]] = ..., unchecked: _Optional[bool] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
