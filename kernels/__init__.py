"""Kernels over the paged KV pool: Triton kernels with their launchers, and the torch reference of each.

Every kernel takes one layer's cache as `kv_layer` `[2, num_blocks, block_size, num_kv_heads, head_dim]`
(K at 0, V at 1: a worker's `PoolView.layer(l)`), or the whole pool for `copy_blocks` (two whole pools,
device and host tier, for `swap_blocks`). CUDA tensors run the Triton kernels; CPU tensors run the torch
references, unless TRITON_INTERPRET=1 was set before triton was imported, in which case Triton's
interpreter runs the kernels (how the tests exercise them without a GPU). Every public function takes
`backend="triton" | "torch"` to force one.

The package needs torch, triton and numpy and nothing else, of radixkv or outside it (its tests check the
closure), so a bare GPU image runs it from a checkout (`benchmarks/gpu_check.sh`).

Started from the checkout root, Python finds this folder as a top-level `kernels` before Hugging Face's
package of that name (transformers 5 imports it). Imported under that name, this module yields: it loads
the installed `kernels` in its place; with none installed it stays empty (transformers then finds no
`__version__` and takes kernels as absent), each name saying to import radixkv.kernels.
"""

import sys

if __name__ == "kernels":  # the checkout root is on sys.path: not radixkv.kernels

    def _yield_to_installed() -> bool:
        """Put the installed top-level `kernels` (Hugging Face's) in sys.modules in place of this folder; False if
        none is installed."""
        import importlib.machinery
        import importlib.util
        import os

        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
        spec = importlib.machinery.PathFinder.find_spec("kernels", path)
        if spec is None or spec.loader is None:
            return False
        module = importlib.util.module_from_spec(spec)
        sys.modules["kernels"] = module  # the import system hands back what sys.modules holds after this file
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules["kernels"]
            raise
        return True

    if not _yield_to_installed():
        # None installed: an empty module whose every name says where radixkv's kernels are. transformers probes
        # `kernels` this way (import, then its __version__) and takes it as absent.
        def __getattr__(name: str) -> object:
            raise AttributeError(
                f"kernels.{name}: no `kernels` package is installed; this top-level `kernels` is radixkv's folder, "
                "imported as radixkv.kernels"
            )
else:
    from radixkv.kernels.copy_blocks import copy_blocks, copy_blocks_reference
    from radixkv.kernels.decode_plan import DecodeConfig, DecodePlan, choose_split_len, plan_decode
    from radixkv.kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_reference
    from radixkv.kernels.step_tensors import HostStep, StepTensors, host_to_device, step_tensors
    from radixkv.kernels.store_kv import quantize_fp8, store_kv, store_kv_reference
    from radixkv.kernels.swap_blocks import swap_blocks, swap_blocks_reference

    __all__ = [
        "DecodeConfig",
        "DecodePlan",
        "choose_split_len",
        "copy_blocks",
        "copy_blocks_reference",
        "host_to_device",
        "HostStep",
        "paged_decode_attention",
        "paged_decode_attention_reference",
        "plan_decode",
        "quantize_fp8",
        "step_tensors",
        "StepTensors",
        "store_kv",
        "store_kv_reference",
        "swap_blocks",
        "swap_blocks_reference",
    ]
