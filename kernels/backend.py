"""Which implementation runs a kernel call: Triton on CUDA (and on CPU under the interpreter), torch otherwise."""

from __future__ import annotations

import os

import torch

BACKENDS = ("triton", "torch")

# Triton decides at decoration time whether @triton.jit builds a GPU kernel or an interpreted one, so
# the answer is fixed when this package is imported; setting the variable later changes nothing.
INTERPRETED: bool = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on", "y")


def pick_backend(device: torch.device, backend: str | None) -> str:
    """The backend for tensors on `device`: `backend` when given, else Triton on CUDA or under the interpreter.

    Raises:
        ValueError: `backend` is unknown, or "triton" was asked for CPU tensors without the interpreter.
    """
    if backend is None:
        return "triton" if device.type == "cuda" or INTERPRETED else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS} or None, got {backend!r}")
    if backend == "triton" and device.type != "cuda" and not INTERPRETED:
        raise ValueError(
            f"backend: 'triton' on {device} tensors needs TRITON_INTERPRET=1 set before triton is imported"
        )
    return backend
