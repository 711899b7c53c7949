"""Every command-line mistake a new user makes is one line on stderr naming the problem and the fix, exit status 2,
before anything slow loads (a model, a pool): each runs as a real `radixkv` process."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from radixkv.extras import install_hint
from radixkv.server.process.spawn import patient


def radixkv(*argv: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "radixkv.cli", *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=patient(300), stdin=subprocess.DEVNULL)


MISTAKES = [
    # (argv, what the line must say: the problem and the fix)
    (["plan", "--model", "llama-3-8b", "--gpu-memory", "80"], ["'80' has no unit", "80GiB", "80GB"]),
    (["plan", "--model", "llama-3-8b", "--weights", "16"], ["'16' has no unit", "16GiB"]),
    (["serve", "--port", "70000"], ["--port", "from 0 to 65535", "70000"]),
    (["serve", "--kv-dtype", "fp9"], ["'fp9' is not a KV dtype", "fp8"]),
    (["demo", "--block-size", "3"], ["--block-size", "not a power of two", "use 2 or 4"]),
    (["simulate", "--num-blocks", "10", "--tokens", "20000"], ["--num-blocks 10 is too small", "or leave it out"]),
    (["simulate", "--tokens", "lots"], ["--tokens", "expected an integer, got 'lots'"]),
]


@pytest.mark.parametrize(("argv", "says"), MISTAKES, ids=[" ".join(a) for a, _ in MISTAKES])
def test_a_mistake_is_one_line_with_the_fix_and_status_2(argv: list[str], says: list[str]) -> None:
    done = radixkv(*argv)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"radixkv {argv[0]}: "), done.stderr
    for part in says:
        assert part in lines[0], (part, lines[0])
    assert done.stdout == "", "checked before anything loads (the demo prints 'loading ...' first)"


def test_serve_on_a_port_in_use_says_in_use() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = radixkv("serve", "--port", str(port), "--device", "cpu", "--num-blocks", "8")
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        f"radixkv serve: --port {port}: 127.0.0.1:{port} is in use by another process; stop it, or pick another "
        "--port (0: any free port)\n"
    )


def test_serve_on_cuda_without_a_device_names_the_fix() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    done = radixkv("serve", "--device", "cuda", "--port", "0")
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.splitlines()
    assert "device cuda: no CUDA device is visible here" in line and line.endswith("use --device cpu")


def test_fp8_means_float8_e4m3fn_in_serve_as_in_plan_and_demo() -> None:
    from radixkv.server.process.flags import parse_args

    config, _ = parse_args(["--device", "cpu", "--kv-dtype", "fp8", "--num-blocks", "8"])
    assert config.pools[0].dtype == "float8_e4m3fn"
    config, _ = parse_args(["--pool", "p:num_layers=1,num_kv_heads=1,head_dim=8,num_blocks=8,dtype=fp8"])
    assert config.pools[0].dtype == "float8_e4m3fn"
    plan = radixkv("plan", "--model", "llama-3-8b", "--dtype", "fp8")
    assert plan.returncode == 0 and "dtype=float8_e4m3fn" in plan.stdout


def test_version_and_help_with_defaults() -> None:
    version = radixkv("--version")
    assert version.returncode == 0 and version.stdout.startswith("radixkv 0.")
    helped = radixkv("simulate", "--help")
    assert helped.returncode == 0
    text = " ".join(helped.stdout.split())
    assert "(default: 1000000)" in text and "(default: 16)" in text and "(default: 0.15)" in text


def test_pool_view_without_torch_is_one_import_error_naming_the_extra() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from radixkv.client import PoolView\n"
        "try:\n    PoolView(None)\n"
        "except ImportError as e:\n    print(type(e).__name__, e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=patient(120))
    assert done.stdout == (
        f"ImportError PoolView maps the pool as torch tensors and needs torch: {install_hint('server')}\n"
    ), done.stderr
