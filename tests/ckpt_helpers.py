"""Helpers that write checkpoint directories the way training stacks do.

Single-file and sharded safetensors (``model-0000k-of-0000n.safetensors`` plus
``model.safetensors.index.json`` as Hugging Face ``save_pretrained`` writes it), written with
the ``safetensors`` package itself, plus the usual side files (config.json, tokenizer.json).
States are dicts of bf16/fp32 torch tensors generated from bit patterns, so a "training
step" can change an exact fraction of elements by one ulp, as Adam updates do.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
from safetensors.torch import save_file

State = dict[str, torch.Tensor]

INDEX_NAME = "model.safetensors.index.json"
STATE_DIR = ".deltasync"

#: Default layout of a small transformer-like model: (name, shape, dtype).
DEFAULT_LAYOUT: tuple[tuple[str, tuple[int, ...], torch.dtype], ...] = (
    ("model.embed_tokens.weight", (512, 64), torch.bfloat16),
    ("model.layers.0.self_attn.q_proj.weight", (64, 64), torch.bfloat16),
    ("model.layers.0.self_attn.k_proj.weight", (64, 64), torch.bfloat16),
    ("model.layers.0.mlp.up_proj.weight", (256, 64), torch.bfloat16),
    ("model.layers.0.mlp.down_proj.weight", (64, 256), torch.bfloat16),
    ("model.layers.0.input_layernorm.weight", (64,), torch.float32),
    ("model.layers.1.self_attn.q_proj.weight", (64, 64), torch.bfloat16),
    ("model.layers.1.mlp.up_proj.weight", (256, 64), torch.bfloat16),
    ("model.norm.weight", (64,), torch.float32),
    ("lm_head.weight", (512, 64), torch.bfloat16),
)


# -- states -------------------------------------------------------------------------------------


def _bf16_bits(rng: np.random.Generator, n: int) -> npt.NDArray[np.uint16]:
    """Plausible bf16 weights (|w| around 0.004..0.06, either sign) as bit patterns."""
    sign = rng.integers(0, 2, n, dtype=np.uint16) << np.uint16(15)
    exponent = rng.integers(119, 123, n, dtype=np.uint16) << np.uint16(7)
    mantissa = rng.integers(0, 128, n, dtype=np.uint16)
    return sign | exponent | mantissa


def make_state(
    seed: int = 0,
    layout: Iterable[tuple[str, tuple[int, ...], torch.dtype]] = DEFAULT_LAYOUT,
) -> State:
    """A deterministic state dict following ``layout``."""
    rng = np.random.default_rng(seed)
    out: State = {}
    for name, shape, dtype in layout:
        n = int(np.prod(shape)) if shape else 1
        if dtype == torch.bfloat16:
            bits = _bf16_bits(rng, n)
            out[name] = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).reshape(shape)
        elif dtype == torch.float32:
            out[name] = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).reshape(shape)
        else:
            raise ValueError(f"unsupported dtype {dtype}")
    return out


def step_state(state: Mapping[str, torch.Tensor], seed: int, fraction: float = 0.01) -> State:
    """A copy of ``state`` where ``fraction`` of each tensor's elements moved by one ulp."""
    rng = np.random.default_rng(seed)
    out: State = {}
    for name, t in state.items():
        flat = t.detach().contiguous().reshape(-1).clone()
        width = flat.element_size()
        ints = flat.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[width]).numpy()
        k = max(1, int(len(ints) * fraction))
        idx = rng.choice(len(ints), size=k, replace=False)
        ints[idx] += 1
        out[name] = flat.reshape(t.shape)
    return out


# -- writing checkpoints --------------------------------------------------------------------------


def write_safetensors(path: Path, state: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path), metadata=dict(metadata or {}))
    return path


def write_side_files(root: Path, *, step: int = 0, nested: bool = True) -> None:
    """config.json, tokenizer.json, generation_config.json (changes with ``step``), and a nested dir."""
    root.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
              "vocab_size": 512, "torch_dtype": "bfloat16"}
    (root / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    vocab = {f"tok{i}": i for i in range(512)}
    (root / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": vocab}}))
    (root / "generation_config.json").write_text(json.dumps({"step": step, "temperature": 1.0}) + "\n")
    if nested:
        (root / "extra" / "deep").mkdir(parents=True, exist_ok=True)
        (root / "extra" / "deep" / "notes.txt").write_text(f"trained for {step} steps\n")


def write_checkpoint(
    root: Path,
    state: Mapping[str, torch.Tensor],
    *,
    shards: int = 1,
    metadata: Mapping[str, str] | None = None,
    step: int = 0,
    side_files: bool = True,
) -> Path:
    """A checkpoint directory: model.safetensors, or ``shards`` shards plus the index json."""
    root.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt", **(metadata or {})}
    if shards <= 1:
        write_safetensors(root / "model.safetensors", state, meta)
    else:
        names = list(state)
        groups = [names[i::shards] for i in range(shards)]
        weight_map: dict[str, str] = {}
        total = 0
        for i, group in enumerate(groups):
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            write_safetensors(root / fname, {n: state[n] for n in group}, meta)
            for n in group:
                weight_map[n] = fname
                total += state[n].numel() * state[n].element_size()
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (root / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    if side_files:
        write_side_files(root, step=step)
    return root


def write_big_safetensors(
    path: Path,
    tensors: Iterable[tuple[str, tuple[int, ...]]],
    seed: int,
    *,
    change_fraction: float = 0.0,
    block_elems: int = 8 << 20,
) -> int:
    """A bf16 safetensors file written block by block (never the whole file in memory).

    The same ``seed`` gives the same bits; ``change_fraction`` > 0 then moves that fraction
    of elements by one ulp (a "next step" of the same checkpoint). Returns the file size.
    """
    entries: dict[str, object] = {"__metadata__": {"format": "pt"}}
    pos = 0
    tensors = list(tensors)
    for name, shape in tensors:
        nbytes = int(np.prod(shape)) * 2
        entries[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    body = json.dumps(entries, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(body)) + body)
        for ti, (_name, shape) in enumerate(tensors):
            n = int(np.prod(shape))
            for bi, start in enumerate(range(0, n, block_elems)):
                m = min(block_elems, n - start)
                rng = np.random.default_rng([seed, ti, bi])
                # One draw of raw bytes per block (fast); masking keeps a random sign and
                # mantissa with the exponent in 120..121 (|w| ~ 0.004..0.016).
                raw = np.frombuffer(rng.bytes(2 * m), dtype=np.uint16)
                bits = (raw & np.uint16(0x81FF)) | np.uint16(0x3C00)
                if change_fraction > 0:
                    crng = np.random.default_rng([seed, ti, bi, 1])
                    idx = crng.integers(0, m, max(1, int(m * change_fraction)))
                    bits[idx] += np.uint16(1)
                f.write(bits.tobytes())
                del bits
    return 8 + len(body) + pos


# -- comparing directories ------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def tree_digests(root: Path, *, include_state: bool = False) -> dict[str, str]:
    """sha256 of every regular file under ``root`` by '/'-separated relative path.

    The ``.deltasync`` state directory is left out unless ``include_state``.
    """
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        if not include_state:
            dirnames[:] = [d for d in dirnames if d != STATE_DIR]
        for fname in filenames:
            full = Path(dirpath) / fname
            out[full.relative_to(root).as_posix()] = sha256_file(full)
    return out


def safetensors_metadata(path: Path) -> dict[str, str] | None:
    """The ``__metadata__`` of a safetensors file, read from its header."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    meta = header.get("__metadata__")
    return dict(meta) if isinstance(meta, dict) else None
