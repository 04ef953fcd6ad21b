#!/usr/bin/env bash
# GPU checks of issue 31 for a machine with a CUDA device (<= 10 min): the CUDA engine tests
# (host mirror, fused scatters), then host->device bytes per version and the pause with the
# host mirror and without, next to a full device copy, at 1, 4 and 8 GiB.
#   bash benchmarks/gpu_check.sh        (from the repository root)
set -euo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
timeout 240 python -m pytest -x -q tests/engines/test_engines.py -k "cuda or mirror" -rs
timeout 300 python -m benchmarks.bench_gpu_mirror --gib 1,4,8 --fraction 0.01 --device cuda
