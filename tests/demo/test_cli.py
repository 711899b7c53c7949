"""`radixkv demo` end to end: it creates the default model, starts a server, generates, reports and plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixkv.demo.main import main


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
    assert "of float8_e4m3fn, in a server process" in out
    assert "0 live sequences" in out and "radixkv saves" in out
