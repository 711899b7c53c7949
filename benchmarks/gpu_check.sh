#!/usr/bin/env bash
# The GPU check, for a lent GPU machine: the image's own Python with torch, triton and numpy, no network, no
# pip, radixkv not installed. It installs nothing: it runs benchmarks/gpu_check.py from this checkout, with
# benchmarks/from_checkout first on PYTHONPATH (a stand-in `radixkv` package whose `radixkv.kernels` is the
# checkout's kernels/ folder, as setuptools maps it), and prints one table. At most 5 minutes (--budget-s).
#
#   benchmarks/gpu_check.sh [--smoke] [--out FILE] [--peak-gbps N] [--sections a,b]    FILE: gpu_check.json
#
# PYTHON picks the interpreter (default: python3). --smoke runs every section on the CPU in well under a
# minute, so the script is tested without a GPU. Exit status: 0 when no row failed (targets missed are
# reported, not failed), 1 otherwise, 2 on a usage error or no CUDA device without --smoke.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$root/benchmarks/from_checkout${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" "$root/benchmarks/gpu_check.py" "$@"
