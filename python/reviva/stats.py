"""What a generate call did, as a typed object (RevivaManager.get_memory_stats()).

Note [One naming scheme]
~~~~~~~~~~~~~~~~~~~~~~~~
Sizes are bytes (`*_bytes`, ints), times are seconds (`*_s`, floats), rates say their unit
(`*_tok_s`, `*_gbps`: 1e9 bytes a second), directions are `to_device` and `to_host`, and compute
waiting for a copy is a `stall`. The same names are used by ActivationStats (training) and by every
dict the core's binding returns (`bytes_to_device`, `compute_stall_s`, `to_host` and `to_device`
for the transfer engine's directions, timeline events' `start_s` and `end_s`;
tests/python/test_stats.py reads them all). Before this (issue 16) the stats said `budget_mb` for
MiB, `h2d`/`d2h` beside `to_host`, and `stall_ms` beside `compute_stall_ms`; the binding kept
milliseconds and `d2h`/`h2d` until session 13.

A GenerateStats holds the call's totals and end state (which layers stream once decode ends,
after promotions), and one PhaseStats each for prefill and decode: what happened in that phase,
so that layers streamed through prefill and promoted later do not show as "0 streamed". It reads
as a mapping too (`stats["streamed_layers"]`, `dict(stats)`, `stats.to_dict()`), for JSON and for
code that treated the stats as a dict.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

from reviva.sizes import format_bytes


@dataclass(frozen=True)
class PhaseStats:
    """One phase of a call: prefill (the prompt, layer by layer) or decode (the new tokens).

    Bytes and stalls are counted from copies issued in the phase (the transfer engine's submitted
    bytes at the phase's end as the host saw it: a copy prefill issued counts in prefill even if
    it lands while decode runs)."""

    seconds: float  # on the device's clock (CUDA events), the host's on the host backend
    tokens: int  # prefill: prompt tokens of every row; decode: steps x rows
    peak_device_bytes: int | None  # torch's tensors and the arena's, at most (CUDA only)
    bytes_to_device: int  # K/V, streamed weights and hidden states brought to the device
    bytes_to_host: int  # K/V and hidden states written to pinned host memory
    stall_s: float  # compute waiting for copies to the device (K/V and weights)
    kv_streamed_layers: int  # layers whose K/V streamed through the phase (prefill: all at once)
    kv_resident_layers: int  # layers whose K/V stayed on the device (decode: at its end)
    weight_streamed_layers: int  # layers whose weights streamed in (0: every weight resident)

    @property
    def tok_s(self) -> float | None:
        """Tokens a second over the phase (decode: the decode rate of all rows)."""
        return self.tokens / self.seconds if self.tokens and self.seconds > 0 else None

    @property
    def seconds_per_token(self) -> float | None:
        return self.seconds / self.tokens if self.tokens else None


@dataclass(frozen=True)
class GenerateStats(Mapping[str, Any]):
    """What the last generate call did (Note [One naming scheme]); see RevivaManager's docs."""

    device: str
    backend: str
    budget_bytes: int  # what the plan held itself to (RevivaConfig.vram_budget, or the card's)
    requested_budget_bytes: int
    device_limit_bytes: int
    prefill: PhaseStats
    decode: PhaseStats
    # Totals over the call
    peak_device_bytes: int | None  # max of the phases' peaks
    bytes_to_device: int
    bytes_to_host: int
    to_device_gbps: float  # the copy stream's rate while busy
    copy_to_device_s: float  # the copy stream busy bringing bytes in
    stall_s: float  # compute waiting for K/V fetches (weights: weight_stall_s)
    overlap_ratio: float  # Note [Overlap ratio]
    # K/V: where it lived
    kv_dtype: str
    kv_cache_bytes: int  # the whole cache's bytes, as if it were all on the device
    kv_device_bytes: int  # on the device at the call's end
    kv_device_peak_bytes: int
    device_bytes_saved: int  # kv_cache_bytes - kv_device_bytes
    host_bytes: int  # pinned host bytes the K/V store held
    pinned_reserved_bytes: int  # the pinned pool's reservation (all of this process's)
    layer_kv_bytes: int
    kv_fp8_rel_error: float | None  # Note [fp8 K/V rows]
    kv_block_tokens: int
    kv_fp8_prefill_shadow_bytes: int  # Note [fp8 prefill shadow]: 0 when prefill read blocks
    kv_page_tokens: int
    paged_layers: int
    page_slots: int
    shared_prompt_rows: int  # Note [Shared prompt K/V]
    fetch_window_layers: int  # Note [Fetch tails]
    generated_rows_bytes: int
    # Layers: the end state (after decode's promotions)
    resident_layers: int
    streamed_layers: int
    streamed_layer_ids: list[int]
    resident_layers_in_prefill: int
    promoted_layers: int
    promotion_failures: int
    promotions_refused_by_device: int
    first_promotion_refusal: dict[str, Any] | None
    prefetches_without_memory: int
    prefetches_deferred: int
    slots: int
    decode_slots: int
    prefetch_window: int
    fills: int
    prefetched_fills: int
    slot_hits: int
    # Prefill's plan and where its time went
    prompt_tokens: int
    chunk_tokens: int
    prefill_residual: str  # "device" or "host" (Note [Residual stream on the host])
    residual_host_bytes: int
    attention_kernel: str
    prefill_s: float
    prefill_before_first_layer_s: float | None
    prefill_first_layer_s: float | None
    prefill_after_layers_s: float | None
    prefill_setup_host_s: dict[str, float]  # host clock from the set-up's start to each step
    arena_map_s: float
    host_copy_wait_s: float
    pin_s: float
    pin_mode: str
    pin_background_s: float
    pin_error: str | None
    # Decode
    decode_steps: int
    decode_s: float
    decode_tok_s: float | None  # steps a second (a step gives one token to every row)
    own_decode_attention: bool
    # the stop decided a step late (Note [A stop decided a step late]): "deferred" or why not, and
    # the steps run past a stop and taken back (not in decode_steps; their time is in decode_s)
    decode_stop: str
    decode_steps_undone: int
    decode_graphs: str  # "on", or why not (Note [Decode graphs])
    decode_graph_replays: int
    decode_graph_capture_s: float
    decode_graph_captures: int
    decode_graph_captures_ahead: int
    decode_graph_captures_in_prefill_layers: int
    decode_graph_eager_steps: int
    decode_graph_uncaptured: dict[str, int]
    # Streamed weights (Note [Streamed weights]); zeros when every weight is resident
    weights_streamed: bool
    weight_resident_layers: int
    embedding_on_host: bool = False
    weight_streamed_layers: int = 0
    weight_slots: int = 0
    weight_prefetch_layers: int = 0
    weight_prefetch_blocks: int = 0
    weight_slot_bytes: int = 0
    weight_bytes_given_back: int = 0
    weight_host_bytes: int = 0
    weight_resident_bytes: int = 0
    weight_bytes_to_device: int = 0
    weight_bytes_to_host: int = 0
    weight_fills: int = 0
    weight_prefetched_fills: int = 0
    weight_stall_s: float = 0.0
    # Note [Attention on the host]: decode's streamed K/V attended where it lives (layers; the
    # host's seconds in its attention calls, and waiting for compute before each; rows written)
    decode_attention: str = "device"  # "device" or "host" (RevivaConfig.decode_attention)
    host_attended_layers: int = 0
    # Note [Weights first when the host attends]: weight layers kept on the device from decode on
    weight_layers_promoted_in_decode: int = 0
    host_attention_s: float = 0.0
    host_attention_wait_s: float = 0.0
    host_attention_calls: int = 0
    bytes_written_on_host: int = 0
    # A call continuing from a returned cache, and the cache it returned (Note [A returned cache])
    continued_tokens: int = 0
    returned_cache_host_bytes: int = 0
    # Note [Window rings]: sliding layers kept as rings of their window (and the rows of each)
    window_ring_layers: int = 0
    window_ring_tokens: int = 0
    # Note [Spilled layers] (src/kv_store_disk.cpp): offload_device="disk"'s layers whose K/V
    # lives on disk, how many of them held pinned copies at once (limit, most), the disk's space
    # (the most the call held), its reads and bytes each way, the calling thread's waits for it,
    # and the file (unlinked), its engine and whether O_DIRECT ran
    disk_layers: int = 0
    disk_staged_layers: int = 0
    disk_peak_staged_layers: int = 0
    disk_bytes: int = 0
    disk_reads: int = 0
    disk_staging_hits: int = 0
    bytes_from_disk: int = 0
    bytes_to_disk: int = 0
    disk_wait_s: float = 0.0
    disk_file: str | None = None
    disk_io_uring: bool | None = None
    disk_direct_io: bool | None = None

    # Mapping: the dict view (the phases as dicts)
    def __getitem__(self, key: str) -> Any:
        if key not in _names():
            raise KeyError(key)
        value = getattr(self, key)
        return dataclasses.asdict(value) if isinstance(value, PhaseStats) else value

    def __iter__(self) -> Iterator[str]:
        return iter(_names())

    def __len__(self) -> int:
        return len(_names())

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (JSON-ready): every field, the phases as dicts with their rates."""
        out = {k: self[k] for k in _names()}
        for name in ("prefill", "decode"):
            phase: PhaseStats = getattr(self, name)
            out[name]["tok_s"] = phase.tok_s
            out[name]["seconds_per_token"] = phase.seconds_per_token
        return out

    def summary(self) -> str:
        """One line a person reads: the call's phases and what moved."""

        def peak(x: int | None) -> str:
            return "n/a (CPU)" if x is None else format_bytes(x)

        p, d = self.prefill, self.decode
        return (
            f"prefill {p.seconds:.2f} s ({p.tokens} tokens, {p.kv_streamed_layers} layers' K/V "
            f"streamed, peak {peak(p.peak_device_bytes)}); decode {self.decode_steps} steps in "
            f"{d.seconds:.2f} s ({self.decode_tok_s or 0:.2f} steps/s, {d.kv_streamed_layers} "
            f"layers streamed at its end, stall {d.stall_s * 1e3:.1f} ms); moved "
            f"{format_bytes(self.bytes_to_device)} to the device, "
            f"{format_bytes(self.bytes_to_host)} to the host"
        )


@cache
def _names() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(GenerateStats))
