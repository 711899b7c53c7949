"""Kernels over the paged KV pool: Triton kernels with their launchers, and the torch reference of each.

CUDA tensors run the Triton kernels; CPU tensors run the torch references, unless TRITON_INTERPRET=1
was set before triton was imported, in which case Triton's interpreter runs the kernels (how the
tests exercise them without a GPU). Every public function takes `backend="triton" | "torch"` to force one.
"""

from radixkv.kernels.copy_blocks import copy_blocks, copy_blocks_reference
from radixkv.kernels.decode_reference import paged_decode_attention_reference
from radixkv.kernels.paged_decode_attention import choose_num_splits, paged_decode_attention
from radixkv.kernels.step_tensors import StepTensors, step_tensors
from radixkv.kernels.store_kv import store_kv, store_kv_reference

__all__ = [
    "choose_num_splits",
    "copy_blocks",
    "copy_blocks_reference",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "step_tensors",
    "StepTensors",
    "store_kv",
    "store_kv_reference",
]
