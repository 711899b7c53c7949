#!/usr/bin/env bash
# Regenerate the committed protobuf modules in radixkv/v1/ from proto/radixkv/v1/*.proto.
# With -Iproto the generated imports read `from radixkv.v1 import ..._pb2`: no rewriting.
# protoc writes each module at OUT_ROOT/<proto path below -I>, i.e. OUT_ROOT/radixkv/v1/.
# Usage: proto/generate.sh [OUT_ROOT]   (default: the repo root; tests pass a temp dir and diff)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.}"
mkdir -p "$out"
python -m grpc_tools.protoc -Iproto \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  proto/radixkv/v1/*.proto
