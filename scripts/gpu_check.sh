#!/usr/bin/env bash
# The GPU check in one go (see scripts/gpu_check.py): run on a machine with CUDA, from the repository root.
#   scripts/gpu_check.sh [--ranks N] [--sizes 4K 1M 64M 256M] [--out DIR]
# Installs nothing: the environment must have pslab (pip install -e .) and a CUDA build of torch.
set -euo pipefail
cd "$(dirname "$0")/.."
exec timeout 900 python scripts/gpu_check.py "$@"
