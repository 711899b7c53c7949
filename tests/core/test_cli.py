import subprocess
import sys

from radixkv.cli import main


def test_plan_prints_the_capacity_arithmetic(capsys):
    assert main(["plan", "--model", "llama-3-8b", "--gpu-memory", "80GiB", "--weights", "16GiB", "--context", "4096"]) == 0
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
