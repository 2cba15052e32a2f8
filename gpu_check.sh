#!/usr/bin/env bash
# The GPU's checks in one command (one CUDA GPU, under 8 minutes, nothing fetched from the
# network): exactness eager and compiled in float32 and bfloat16, the verify curve of the
# default model's shape and Llama-3.1-8B's, plain decoding on the 8B shape against the
# bandwidth limit; one JSON file (gpu_check.json, or --out FILE). --small: the CPU's version.
set -euo pipefail
cd "$(dirname "$0")"
exec python gpu_check.py "$@"
