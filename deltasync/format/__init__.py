"""What a version is made of: the chunk codec, manifests, digests, dtypes, signatures, slices
and the safetensors checkpoint layout. Bytes and numpy arrays only (torch appears in
:mod:`~deltasync.format.tensors`, where tensors enter or leave)."""
