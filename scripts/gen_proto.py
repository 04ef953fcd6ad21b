"""Regenerate deltasync/v1/*_pb2.py(i) from proto/ (commit the result).

    python scripts/gen_proto.py            # write into the source tree
    python scripts/gen_proto.py OUTDIR     # write elsewhere (the staleness test does this)
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc

    protos = sorted((ROOT / "proto").rglob("*.proto"))
    args = ["protoc", f"-I{ROOT / 'proto'}", f"--python_out={out}", f"--pyi_out={out}", *map(str, protos)]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return protos


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
