#!/bin/sh
# Device check of the Triton backend (see bench/gpu_check.py); e.g. `bench/gpu_check.sh --full`.
cd "$(dirname "$0")/.." && exec "${PYTHON:-python3}" bench/gpu_check.py "$@"
