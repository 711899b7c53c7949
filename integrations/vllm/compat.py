"""Every place the connector differs by vLLM release, in one module: 0.30 to 0.34 are supported and tested.

`make test-vllm-matrix` runs the connector's tests against each release (README: "vLLM versions tested"). Each
entry below names the release that changed and the API that changed; the connector calls the entry, never a
version check of its own. A release newer than the newest listed is taken to keep the newest one's API.
"""

from __future__ import annotations

from typing import Any

from vllm import __version_tuple__

OLDEST, NEWEST = (0, 30), (0, 34)
# A source build of vLLM says (0, 0, "dev"): it is taken for the newest.
_MAJOR_MINOR = (int(__version_tuple__[0]), int(__version_tuple__[1])) if __version_tuple__[:2] != (0, 0) else NEWEST
VERSION: tuple[int, int] = _MAJOR_MINOR


def check_supported() -> None:
    """ValueError for a vLLM older than the oldest supported (its connector API differs in ways not handled)."""
    if VERSION < OLDEST:
        raise ValueError(
            f"RadixKVConnector: vLLM {'.'.join(map(str, VERSION))} is older than {'.'.join(map(str, OLDEST))}, "
            "the oldest release it supports"
        )


# 0.32: vLLM labels cached prompt tokens by the tier they came from (`vllm.v1.metrics.cache_hit_source`, the
# connector hook `get_external_cache_hit_sources`, the metric `vllm:prompt_tokens_cached_by_source`). 0.30 and
# 0.31 have neither the module nor the hook (nothing calls it): nothing is labelled.
def external_hit_sources(pool_device: str, num_external_tokens: int) -> dict[Any, int]:
    """vLLM's label for the tokens loaded from radixkv: a CPU pool is host memory; a CUDA pool is neither tier
    vLLM names (not its device cache, not host memory)."""
    if num_external_tokens == 0 or VERSION < (0, 32):
        return {}
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    on_host = pool_device.startswith("cpu")
    return {CacheHitSource.HOST if on_host else CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
