from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Encoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENCODING_UNSPECIFIED: _ClassVar[Encoding]
    SAME: _ClassVar[Encoding]
    SPARSE: _ClassVar[Encoding]
    DENSE: _ClassVar[Encoding]
    FULL: _ClassVar[Encoding]

class VersionKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERSION_KIND_UNSPECIFIED: _ClassVar[VersionKind]
    SNAPSHOT: _ClassVar[VersionKind]
    DELTA: _ClassVar[VersionKind]
ENCODING_UNSPECIFIED: Encoding
SAME: Encoding
SPARSE: Encoding
DENSE: Encoding
FULL: Encoding
VERSION_KIND_UNSPECIFIED: VersionKind
SNAPSHOT: VersionKind
DELTA: VersionKind

class CodecSpec(_message.Message):
    __slots__ = ("name", "codec_version", "zstd_level", "chunk_bytes", "full_zstd_level")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CODEC_VERSION_FIELD_NUMBER: _ClassVar[int]
    ZSTD_LEVEL_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    FULL_ZSTD_LEVEL_FIELD_NUMBER: _ClassVar[int]
    name: str
    codec_version: int
    zstd_level: int
    chunk_bytes: int
    full_zstd_level: int
    def __init__(self, name: _Optional[str] = ..., codec_version: _Optional[int] = ..., zstd_level: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., full_zstd_level: _Optional[int] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("pack", "offset", "length", "encoding", "base_digest", "target_digest")
    PACK_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    BASE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    TARGET_DIGEST_FIELD_NUMBER: _ClassVar[int]
    pack: int
    offset: int
    length: int
    encoding: Encoding
    base_digest: bytes
    target_digest: bytes
    def __init__(self, pack: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., encoding: _Optional[_Union[Encoding, str]] = ..., base_digest: _Optional[bytes] = ..., target_digest: _Optional[bytes] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("name", "dtype", "shape", "nbytes", "file", "data_offset", "chunks", "full_shape", "slice_offsets")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    DATA_OFFSET_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    FULL_SHAPE_FIELD_NUMBER: _ClassVar[int]
    SLICE_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    file: str
    data_offset: int
    chunks: _containers.RepeatedCompositeFieldContainer[Chunk]
    full_shape: _containers.RepeatedScalarFieldContainer[int]
    slice_offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ..., file: _Optional[str] = ..., data_offset: _Optional[int] = ..., chunks: _Optional[_Iterable[_Union[Chunk, _Mapping]]] = ..., full_shape: _Optional[_Iterable[int]] = ..., slice_offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class File(_message.Message):
    __slots__ = ("path", "kind", "size", "digest", "header", "blob_parts")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[File.Kind]
        SAFETENSORS: _ClassVar[File.Kind]
        BLOB: _ClassVar[File.Kind]
    KIND_UNSPECIFIED: File.Kind
    SAFETENSORS: File.Kind
    BLOB: File.Kind
    PATH_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    BLOB_PARTS_FIELD_NUMBER: _ClassVar[int]
    path: str
    kind: File.Kind
    size: int
    digest: bytes
    header: bytes
    blob_parts: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, path: _Optional[str] = ..., kind: _Optional[_Union[File.Kind, str]] = ..., size: _Optional[int] = ..., digest: _Optional[bytes] = ..., header: _Optional[bytes] = ..., blob_parts: _Optional[_Iterable[bytes]] = ...) -> None: ...

class Pack(_message.Message):
    __slots__ = ("key", "size")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    key: str
    size: int
    def __init__(self, key: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class Manifest(_message.Message):
    __slots__ = ("format", "version", "kind", "parent", "has_parent", "snapshot", "codec", "files", "tensors", "packs", "version_digest", "raw_bytes", "stored_bytes", "created_unix", "metadata", "signature", "signing_key_id", "manifest_digest", "repository_id", "history_parent", "history_parent_digest", "history_digest")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    HAS_PARENT_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    PACKS_FIELD_NUMBER: _ClassVar[int]
    VERSION_DIGEST_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    SIGNING_KEY_ID_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_DIGEST_FIELD_NUMBER: _ClassVar[int]
    REPOSITORY_ID_FIELD_NUMBER: _ClassVar[int]
    HISTORY_PARENT_FIELD_NUMBER: _ClassVar[int]
    HISTORY_PARENT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    HISTORY_DIGEST_FIELD_NUMBER: _ClassVar[int]
    format: int
    version: int
    kind: VersionKind
    parent: int
    has_parent: bool
    snapshot: int
    codec: CodecSpec
    files: _containers.RepeatedCompositeFieldContainer[File]
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    packs: _containers.RepeatedCompositeFieldContainer[Pack]
    version_digest: bytes
    raw_bytes: int
    stored_bytes: int
    created_unix: float
    metadata: _containers.ScalarMap[str, str]
    signature: bytes
    signing_key_id: bytes
    manifest_digest: bytes
    repository_id: bytes
    history_parent: int
    history_parent_digest: bytes
    history_digest: bytes
    def __init__(self, format: _Optional[int] = ..., version: _Optional[int] = ..., kind: _Optional[_Union[VersionKind, str]] = ..., parent: _Optional[int] = ..., has_parent: _Optional[bool] = ..., snapshot: _Optional[int] = ..., codec: _Optional[_Union[CodecSpec, _Mapping]] = ..., files: _Optional[_Iterable[_Union[File, _Mapping]]] = ..., tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., packs: _Optional[_Iterable[_Union[Pack, _Mapping]]] = ..., version_digest: _Optional[bytes] = ..., raw_bytes: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., created_unix: _Optional[float] = ..., metadata: _Optional[_Mapping[str, str]] = ..., signature: _Optional[bytes] = ..., signing_key_id: _Optional[bytes] = ..., manifest_digest: _Optional[bytes] = ..., repository_id: _Optional[bytes] = ..., history_parent: _Optional[int] = ..., history_parent_digest: _Optional[bytes] = ..., history_digest: _Optional[bytes] = ...) -> None: ...
