"""`radixkv demo` end to end: it creates the default model, starts a server, generates, reports and plots."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import PIL.Image
import pytest

from radixkv.demo.main import main

pytestmark = pytest.mark.slow  # runs first under `make test` (tests/conftest.py)


def test_demo_runs_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_dir, plot = tmp_path / "tiny-llama", tmp_path / "blocks.png"
    argv = [
        "--model",
        "tiny",
        "--model-dir",
        str(model_dir),
        "--max-new-tokens",
        "5",
        "--samples",
        "2",
        "--beam-width",
        "2",
        "--plot",
        str(plot),
    ]
    argv += ["--backend", "torch"]  # the suite runs Triton interpreted (conftest): slow for a whole demo
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert json.loads((model_dir / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert (model_dir / "model.safetensors").is_file()
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    step_lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(step_lines) >= 5 + 5  # at least the first request's steps, then the second turn's
    table = out[out.index("request    mode") :].splitlines()
    rows = {line.split()[0]: line.split() for line in table[2:6]}
    assert set(rows) == {"greedy", "samples", "beam", "turn-2"}
    assert int(rows["samples"][4]) > 0 and int(rows["turn-2"][3]) > 0  # prefix hits: the system prompt, the first turn
    assert "radixkv saves" in out
    assert "0 live sequences" in out
    answers = out[out.index("radixkv saves") :]  # every answer as text, under the tables
    assert "[greedy] user:" in answers and "[turn-2] user:" in answers
    assert answers.count("  answer 0") == 2 and answers.count("  answer 1") == 2  # 2 samples, 2 beams
    # An answer that reached --max-new-tokens before its end-of-turn token says it was cut there; none other does.
    answer_lines = [line for line in answers.splitlines() if line.startswith("  answer")]
    cut = [line for line in answer_lines if line.endswith(" [... cut at --max-new-tokens 5]")]
    assert cut and all(line.count("[... cut") == 1 for line in cut)
    # Why unshared paging can cost more than the slabs: under the memory table, and in the plot's caption.
    assert "paged, no sharing can exceed the slabs: it rounds every sequence up to whole blocks" in out
    caption = PIL.Image.open(plot).text["Description"]
    assert "its own blocks of 16 tokens" in caption and "can cross above" in caption


def test_demo_names_a_missing_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(tmp_path / "nothing-here")]) == 2
    assert "neither a GGUF file nor a checkpoint directory" in capsys.readouterr().err


def test_demo_runs_with_an_fp8_pool(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--model",
        "tiny",
        "--model-dir",
        str(tmp_path / "tiny-llama"),
        "--max-new-tokens",
        "4",
        "--samples",
        "2",
        "--beam-width",
        "2",
    ]
    assert main([*argv, "--backend", "torch", "--kv-dtype", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "of float8_e4m3fn, in a server process (lossy: K/V rounded from the model's float32" in out
    # It runs the requests again on a pool of the model's dtype and says whether the rounding changed an answer.
    compared = [line for line in out.splitlines() if line.startswith("outputs token-identical to a float32 pool")]
    assert len(compared) == 1 and compared[0].endswith((": yes", " differ")), compared
    assert "0 live sequences" in out and "radixkv saves" in out


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--samples", "0", "expected an integer of at least 1, got 0"),
        ("--beam-width", "0", "expected an integer of at least 1, got 0"),
        ("--max-new-tokens", "0", "expected an integer of at least 1, got 0"),
        ("--num-blocks", "-3", "expected an integer of at least 1, got -3"),
        ("--block-size", "3", "3 is not a power of two: use 2 or 4"),
        ("--host-blocks", "many", "expected an integer, got 'many'"),
        ("--temperature", "-1", "expected a number >= 0 (0 is greedy), got -1.0"),
        ("--top-p", "0", "expected a number in (0, 1], got 0.0"),
        ("--temperature", "nan", "expected a number, got 'nan'"),
    ],
)
def test_a_bad_value_is_a_usage_error_before_anything_loads(
    flag: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--model", "tiny", flag, value])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err == f"radixkv demo: argument {flag}: {message} (see radixkv demo --help)\n"
    assert "Traceback" not in err


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-llama")


@pytest.mark.parametrize(
    ("pool", "reason"),
    [
        # The greedy prompt alone does not fit: the host tier cannot help, and the message does not blame forks.
        (["--num-blocks", "2", "--host-blocks", "64"], r"request 'greedy' needs (\d+) blocks for its prompt of (\d+) "
         r"tokens; the pool holds 2 \(a host tier holds no prompt being computed\); give more blocks$"),
        # Samples are preempted only by swap: without a host tier, say so and suggest one.
        (["--num-blocks", "22"], r"request 'samples' holds several sequences \(samples, beams\), which only a swap to "
         r"a host tier preempts, and this step's tokens do not fit \(.*\); give more blocks \(or try --host-blocks"),
        # With a host tier, the swapped-out samples cannot come back even alone: a host tier is no longer the advice.
        (["--num-blocks", "22", "--host-blocks", "64"], r"request 'samples' cannot come back from preemption with "
         r"nothing else running \(out of blocks: .*\); give more blocks$"),
    ],
)  # fmt: skip
def test_a_pool_too_small_says_which_request_and_why(
    tiny_dir: Path, capsys: pytest.CaptureFixture[str], pool: list[str], reason: str
) -> None:
    argv = ["--model", "tiny", "--model-dir", str(tiny_dir), "--max-new-tokens", "4", "--backend", "torch", *pool]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"radixkv demo: --num-blocks {pool[1]} is too small: "), err
    found = re.search(reason, err)
    assert found, err
    if pool[1] == "2":
        needed, num_tokens = int(found[1]), int(found[2])
        assert needed == -(-num_tokens // 16) > 2


def test_the_first_line_comes_before_torch_is_imported() -> None:
    """`radixkv demo` says what it loads before the seconds of importing torch and the model's code."""
    code = "import sys, radixkv.demo.main; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
