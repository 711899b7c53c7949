import os
import re
import subprocess
import sys

import pytest

from radixkv.cli import main
from radixkv.extras import install_hint
from radixkv.server.process.spawn import patient


def test_plan_prints_the_capacity_arithmetic(capsys):
    assert (
        main(["plan", "--model", "llama-3-8b", "--gpu-memory", "80GiB", "--weights", "16GiB", "--context", "4096"]) == 0
    )
    out = capsys.readouterr().out
    assert "28,672" in out and "458,752" in out and "112" in out


def test_plan_fp8_shows_twice_the_blocks(capsys):
    assert main(["plan", "--model", "llama-3-8b", "--gpu-memory", "80GiB", "--weights", "16GiB", "--dtype", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "57,344" in out and "917,504" in out  # 2 x 28,672 blocks, 2 x 458,752 tokens


def test_plan_from_explicit_shape(capsys):
    assert main(["plan", "--layers", "80", "--kv-heads", "8", "--head-dim", "128", "--context", "4096"]) == 0
    assert "1.250 GiB" in capsys.readouterr().out


def test_plan_without_a_model_is_a_usage_error(capsys):
    assert main(["plan"]) == 2
    assert "--model" in capsys.readouterr().err


def test_plan_bad_value_is_a_clear_error(capsys):
    assert main(["plan", "--model", "llama-3-8b", "--utilization", "2"]) == 2
    assert "memory_utilization" in capsys.readouterr().err


def test_simulate_replays_with_invariants_checked(capsys):
    assert main(["simulate", "--tokens", "40000", "--block-size", "16", "--check"]) == 0
    out = capsys.readouterr().out
    assert "invariants hold" in out and "hit ratio" in out


def test_core_and_client_imports_stay_light():
    code = "import radixkv, sys; print(','.join(m for m in ('torch', 'triton', 'grpc') if m in sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip()
    assert loaded == "", f"import radixkv pulled in {loaded}"


def test_plan_tells_gb_from_gib(capsys):
    assert main(["plan", "--model", "llama-3.1-8b", "--gpu-memory", "80GiB"]) == 0
    gib = capsys.readouterr().out
    assert main(["plan", "--model", "llama-3.1-8b", "--gpu-memory", "80GB"]) == 0
    gb = capsys.readouterr().out
    assert "80.00 GiB (85.90 GB)" in gib and "74.51 GiB (80.00 GB)" in gb
    assert "blocks                   36,864" in gib and "blocks                   34,332" in gb


def test_plan_echoes_every_assumption_and_the_pool_that_serves_it(capsys):
    from radixkv.server.rules.config import parse_pool_flag

    argv = ["plan", "--model", "meta-llama/Llama-3.2-3B-Instruct", "--dtype", "bfloat16", "--block-size", "32"]
    assert main([*argv, "--utilization", "0.8", "--weights", "7GB", "--gpu-memory", "24GiB"]) == 0
    out = capsys.readouterr().out
    for echoed in (
        "28 layers x 8 KV heads x head_dim 128",
        "dtype                    bfloat16 (2 bytes per value; --dtype)",
        "block size               32 tokens (--block-size)",
        "utilization              0.8 of device memory",
        "weights                  6.52 GiB (7.00 GB)",
    ):
        assert echoed in out, echoed
    blocks = int(out.split("\n  blocks")[1].split()[0].replace(",", ""))
    flag = out.split("radixkv serve --pool ")[1].strip()
    pool = parse_pool_flag(flag)
    assert (pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.block_size, pool.dtype, pool.num_blocks) == (
        28, 8, 128, 32, "bfloat16", blocks,
    )  # fmt: skip
    assert blocks == (int(24 * 2**30 * 0.8) - 7 * 10**9) // (2 * 28 * 8 * 128 * 2 * 32)


def test_plan_reads_a_hugging_face_directory(tmp_path, capsys):
    (tmp_path / "config.json").write_text(
        '{"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30}'
    )
    assert main(["plan", "--model", str(tmp_path)]) == 0
    assert "30 layers x 3 KV heads x head_dim 64" in capsys.readouterr().out


def test_plan_unknown_model_and_bad_size_are_one_line(capsys):
    assert main(["plan", "--model", "llama-4-1t"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a known model" in err and "llama-3.1-8b" in err
    with pytest.raises(SystemExit) as exited:
        main(["plan", "--model", "llama-3-8b", "--gpu-memory", "80 gigs"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err == (
        "radixkv plan: argument --gpu-memory: '80 gigs' is not a size: write e.g. 80GiB (2^30 bytes), "
        "80GB (10^9 bytes) or 512MiB (see radixkv plan --help)\n"
    )


# A sitecustomize that makes the modules named in RADIXKV_TEST_HIDDEN (and their submodules) unimportable,
# as if their extra were not installed: the child processes of the command inherit it through the environment.
HIDING_SITECUSTOMIZE = """
import os, sys

HIDDEN = [name for name in os.environ.get("RADIXKV_TEST_HIDDEN", "").split(",") if name]


class Hide:
    def find_spec(self, name, path=None, target=None):
        if any(name == h or name.startswith(h + ".") for h in HIDDEN):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, Hide())
"""


def run_without(tmp_path, hidden, *argv):
    """`radixkv ARGV` in a child process where the modules `hidden` are not installed."""
    (tmp_path / "sitecustomize.py").write_text(HIDING_SITECUSTOMIZE)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "RADIXKV_TEST_HIDDEN": ",".join(hidden)}
    command = [sys.executable, "-m", "radixkv.cli", *argv]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=patient(120))


@pytest.mark.parametrize(
    ("argv", "hidden", "missing", "extras"),
    [
        (["serve", "--help"], ["grpc_health"], "grpc_health", "server"),
        (["serve", "--port", "0"], ["torch"], "torch", "server"),  # imported when the pool is built, not at import
        (["keeper", "--state-dir", "{tmp}"], ["torch"], "torch", "server"),
        (["demo", "--model", "tiny"], ["torch"], "torch", "demo,server"),
        (["demo", "--model", "tiny"], ["grpc_health"], "grpc_health", "demo,server"),  # its server's extra
    ],
)
def test_a_missing_extra_is_one_line_naming_it(tmp_path, argv, hidden, missing, extras):
    done = run_without(tmp_path, hidden, *(a.format(tmp=tmp_path / "state") for a in argv))
    command = argv[0]
    assert done.returncode == 2, done.stderr
    # The command that works from here: this checkout's (or wheel's) path, not a package index's name.
    assert done.stderr == f"radixkv {command}: needs the {missing} package: {install_hint(extras)}\n"
    assert "'radixkv[" not in done.stderr
    # Nothing else, but the demo's first line, printed before it imports torch and the model's code.
    assert done.stdout in ("", "loading tiny ...\n"), done.stdout


def test_the_core_commands_need_no_extra(tmp_path):
    done = run_without(tmp_path, ["torch", "triton", "grpc_health"], "simulate", "--tokens", "4000")
    assert done.returncode == 0, done.stderr
    assert "invariants hold" in done.stdout


def test_a_missing_module_of_radixkv_itself_is_a_bug_not_an_extra(tmp_path):
    done = run_without(tmp_path, ["radixkv.server.process.app"], "serve", "--help")
    assert done.returncode == 1 and "Traceback" in done.stderr and "pip install" not in done.stderr


def test_simulate_says_when_a_trace_is_too_short_to_evict(capsys):
    assert main(["simulate", "--tokens", "20000"]) == 0
    out = capsys.readouterr().out
    pool, working_set = (int(n.replace(",", "")) for n in re.findall(r"([\d,]+) blocks", out.splitlines()[1])[:2])
    assert pool >= working_set and "evicted 0 blocks" in out
    assert "too short for eviction: its live sequences need" in out
    assert main(["simulate", "--tokens", "200000"]) == 0
    out = capsys.readouterr().out
    pool, working_set = (int(n.replace(",", "")) for n in re.findall(r"([\d,]+) blocks", out.splitlines()[1])[:2])
    assert pool < working_set and "too short" not in out
    assert int(re.search(r"evicted ([\d,]+) blocks", out)[1].replace(",", "")) > 0
