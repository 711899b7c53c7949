"""What the demo prints and draws: a line per step, a table per request, the run's KV memory, a plot."""

from __future__ import annotations

import dataclasses

from radixkv.demo.records import RequestResult, RequestSpec, StepRecord
from radixkv.memory.layout import PoolLayout

MIB = 2**20
ROUNDING_NOTE = (
    "  paged, no sharing can exceed the slabs: it rounds every sequence up to whole blocks, while a slab is\n"
    "  charged exactly prompt + max_new_tokens slots, so a sequence near its token limit costs paging more"
)
PLOT_CAPTION = (
    "Slabs: each live sequence charged prompt + max_new_tokens slots, reserved when it starts. Paged, no sharing: "
    "each sequence its own blocks of {block_size} tokens,\nits last one partly empty, so near its token limit a "
    "sequence costs paging more than its slab and the dashed line can cross above the dotted one.\n"
    "radixkv: the same pages, with the shared system prompt, the first turn and the forks' prefixes held once."
)


def format_step(r: StepRecord) -> str:
    prefill = (
        f"prefill {r.num_prefills} ({r.num_prefill_tokens:>3} new, {r.num_cached_tokens:>3} cached)"
        if r.num_prefills
        else "prefill 0"
    )
    preempted = f" | preempted {r.num_preempted}" if r.num_preempted else ""
    if r.num_offloaded_blocks or r.num_loaded_blocks:
        preempted += f" | to host {r.num_offloaded_blocks}, from host {r.num_loaded_blocks} blocks"
    return (
        f"step {r.step:>3} | {prefill:<32} | decode {r.num_decodes:>2} | live {r.num_live_seqs:>2} seqs, "
        f"{r.num_waiting} waiting{preempted} | "
        f"blocks: radixkv {r.blocks_radixkv:>3}, unshared {r.blocks_unshared:>3}, contiguous "
        f"{r.blocks_contiguous:>5.1f} | "
        f"cow {r.num_copies}"
    )


def mode_of(spec: RequestSpec) -> str:
    if spec.beam_width:
        return f"beam k={spec.beam_width}"
    if spec.sampling.temperature == 0:
        return "greedy" if spec.sampling.n == 1 else f"greedy n={spec.sampling.n}"
    return f"sample n={spec.sampling.n}"


def format_requests(specs: list[RequestSpec], results: list[RequestResult]) -> str:
    """The per-request table: prompt tokens, prefix hits, peak blocks, copy-on-write copies, preemptions, throughput."""
    header = (
        f"{'request':<10} {'mode':<12} {'prompt':>6} {'cached':>6} {'blocks held':>11} {'cow copies':>10} "
        f"{'preempted: recompute':>20} {'swap':>4} {'generated':>9} {'tokens/s':>9}"
    )
    lines = [header, "-" * len(header)]
    for spec, r in zip(specs, results, strict=True):
        rate = r.num_generated_tokens / r.seconds if r.seconds > 0 else 0.0
        lines.append(
            f"{r.name:<10} {mode_of(spec):<12} {len(r.prompt):>6} {r.num_cached_tokens:>6} {r.peak_blocks:>11} "
            f"{r.num_cow_copies:>10} {r.num_preemptions - r.num_swaps:>20} {r.num_swaps:>4} "
            f"{r.num_generated_tokens:>9} {rate:>9.1f}"
        )
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MemorySummary:
    """Blocks over the run's steps, three ways; `*_mean` average over steps, `*_peak` the largest step."""

    bytes_per_block: int
    radixkv_peak: int
    unshared_peak: int
    contiguous_peak: float
    radixkv_mean: float
    unshared_mean: float
    contiguous_mean: float

    @classmethod
    def of(cls, steps: list[StepRecord], layout: PoolLayout) -> MemorySummary:
        n = max(1, len(steps))
        return cls(
            bytes_per_block=layout.bytes_per_block,
            radixkv_peak=max((s.blocks_radixkv for s in steps), default=0),
            unshared_peak=max((s.blocks_unshared for s in steps), default=0),
            contiguous_peak=max((s.blocks_contiguous for s in steps), default=0.0),
            radixkv_mean=sum(s.blocks_radixkv for s in steps) / n,
            unshared_mean=sum(s.blocks_unshared for s in steps) / n,
            contiguous_mean=sum(s.blocks_contiguous for s in steps) / n,
        )


def format_memory(m: MemorySummary) -> str:
    """The run's KV memory three ways, and what radixkv saves against each baseline (peak and mean)."""
    header = f"{'KV memory':<26} {'peak blocks':>11} {'peak MiB':>9} {'mean blocks':>11} {'mean MiB':>9}"
    lines = [header, "-" * len(header)]
    for name, peak, mean in (
        ("radixkv", m.radixkv_peak, m.radixkv_mean),
        ("paged, no sharing", m.unshared_peak, m.unshared_mean),
        ("contiguous max-len slabs*", m.contiguous_peak, m.contiguous_mean),
    ):
        lines.append(
            f"{name:<26} {peak:>11.1f} {peak * m.bytes_per_block / MIB:>9.2f} {mean:>11.1f} "
            f"{mean * m.bytes_per_block / MIB:>9.2f}"
        )
    for name, peak, mean in (
        ("paged, no sharing", m.unshared_peak, m.unshared_mean),
        ("contiguous slabs", m.contiguous_peak, m.contiguous_mean),
    ):
        if peak:
            lines.append(
                f"radixkv saves {1 - m.radixkv_peak / peak:.1%} at peak, {1 - m.radixkv_mean / mean:.1%} on average, "
                f"against {name}"
            )
    lines.append("* each sequence reserves prompt + max_new_tokens slots up front, as a contiguous KV cache must")
    lines.append(ROUNDING_NOTE)
    return "\n".join(lines)


def format_moves(steps: list[StepRecord], layout: PoolLayout) -> str:
    """Preemptions, and the KV moved between the device pool and the host tier (swaps, evicted prefixes
    written back, host hits loaded back), in blocks and bytes."""
    offloaded = sum(s.num_offloaded_blocks for s in steps)
    loaded = sum(s.num_loaded_blocks for s in steps)
    return (
        f"preemptions: {sum(s.num_preempted for s in steps)}; device -> host {offloaded} blocks "
        f"({offloaded * layout.bytes_per_block / MIB:.2f} MiB), host -> device {loaded} blocks "
        f"({loaded * layout.bytes_per_block / MIB:.2f} MiB)"
    )


def plot_blocks(steps: list[StepRecord], path: str, block_size: int) -> None:
    """Blocks in use per step for radixkv, unshared paging and contiguous slabs, as a PNG whose caption says
    why unshared paging can cross above the slabs."""
    import matplotlib  # imported here: only --plot needs it

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    x = [s.step for s in steps]
    fig, ax = plt.subplots(figsize=(8, 5.2))
    ax.plot(x, [s.blocks_contiguous for s in steps], label="contiguous max-length slabs", linestyle=":")
    ax.plot(x, [s.blocks_unshared for s in steps], label="paged, no sharing", linestyle="--")
    ax.plot(x, [s.blocks_radixkv for s in steps], label="radixkv (prefix + fork sharing)", linewidth=2)
    ax.set_xlabel("scheduler step")
    ax.set_ylabel("KV blocks in use")
    ax.set_title("radixkv demo: KV blocks over the run")
    ax.grid(alpha=0.3)
    ax.legend()
    caption = PLOT_CAPTION.format(block_size=block_size)
    fig.text(0.01, 0.01, caption, fontsize=7, va="bottom")
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=120, metadata={"Description": caption.replace("\n", " ")})
    plt.close(fig)
