"""The memory arithmetic of one plan (_make_plan): a token's and a layer's K/V, the prefill
chunk, the working sets of prefill and decode with their margins, whole or chunked attention,
fp8 blocks and the fp8 prefill shadow, pages and rings; then how the room left is shared
between resident K/V, rings, staging slots and streamed weights (_residency), and which layers
stay (spread). reviva.plan.planner.make_plan runs it with the prompt's hidden states on the device,
then, where that does not fit, on the host.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from reviva._C import RevivaOutOfMemoryError
from reviva.adapters import DecoderLayout
from reviva.cache import fp8 as kv_fp8
from reviva.cache.window_rings import window_ring_tokens
from reviva.config import RevivaConfig
from reviva.plan.call_plan import Plan
from reviva.plan.memory_model import MemoryModel, _experts_per_token
from reviva.plan.memory_state import DeviceState, HostState
from reviva.sizes import format_bytes as _fmt


def _make_plan(
    layout: DecoderLayout,
    config: RevivaConfig,
    state: DeviceState,
    batch: int,
    prompt_tokens: int,
    new_tokens: int,
    padded: bool,
    model: MemoryModel,
    host: HostState | None,
    weights: tuple[int, int, int],
    past_tokens: int,
    rings: bool,
    host_residual: bool,
) -> Plan:
    lay = layout
    e = lay.dtype.itemsize
    requested = config.budget_bytes(state.total)
    budget = min(requested, state.limit)
    baseline = state.baseline
    keys = past_tokens + prompt_tokens  # what prefill's queries attend
    capacity = keys + new_tokens
    fp8 = config.kv_dtype == "fp8"
    if fp8:  # uint8 rows: head_dim e4m3 values and a 4-byte scale per token and head
        kv_token = 2 * batch * lay.num_kv_heads * kv_fp8.row_bytes(lay.head_dim)
    else:
        kv_token = 2 * batch * lay.num_kv_heads * lay.head_dim * e
    layer_kv = _round_up(capacity * kv_token, state.granularity)
    per_token = batch * (
        lay.hidden_size * model.hidden_fp32_copies
        + lay.num_heads * lay.head_dim * e * model.head_temporaries
        + lay.num_kv_heads * lay.head_dim * e * model.kv_head_temporaries
        + max(lay.intermediate_size * e * model.mlp_wide_tensors, _experts_per_token(lay, model))
        + lay.hidden_size * e * model.residual_tensors
    )
    # Without a fused attention kernel, attention materializes its scores: fp32, with softmax
    # temporaries, for every (query, key) pair of a call. Fused: CUDA in half precision
    # (flash, cuDNN), and the CPU's flash kernel, unless a padding mask forces the math path.
    fused = (lay.device.type == "cuda" and lay.dtype in (torch.float16, torch.bfloat16)) or (
        lay.device.type == "cpu" and not padded
    )
    score = 0 if fused else batch * lay.num_heads * model.score_bytes_per_pair
    free_for_work = max(budget - baseline, 0)
    if config.chunk_tokens is not None:
        chunk = config.chunk_tokens
    else:
        target = min(
            max(int(free_for_work * model.chunk_target_fraction), model.chunk_min_bytes),
            model.chunk_max_bytes,
        )
        m = model.chunk_multiple
        chunk = max(m, target // (per_token + score * keys) // m * m)
    chunk = min(chunk, prompt_tokens)
    # The prompt's hidden states and rotary tables: on the device for the whole prompt, or (the
    # residual on the host) a chunk's at a time, already in per_token's residual tensors.
    rows = chunk if host_residual else prompt_tokens
    hidden = 0 if host_residual else batch * prompt_tokens * lay.hidden_size * e
    rotary = batch * rows * lay.head_dim * (2 * e + 8)
    mask = batch * prompt_tokens * capacity if padded else 0
    logits = batch * lay.vocab_size * (e + model.logits_bytes_per_vocab)
    # Whole-prompt attention needs the queries and the output of all tokens at once (and,
    # without a fused kernel, the scores); one call over the prompt runs the fastest kernel,
    # while a chunk's queries need a bottom-right causal mask (measured ~30% slower on the
    # H200). It is chosen when it fits beside a full set of staging slots: layers it keeps
    # off the device during prefill are promoted back after it.
    # Three tensors of the queries' size: the queries, the attention's output, and the copy of
    # it that HF's sdpa_attention_forward returns (attn_output.transpose(1, 2).contiguous()):
    # counting two, a paged plan at 64k on a 24 GB card ran out of memory in that copy (50eb01c).
    q_and_out = 3 * batch * prompt_tokens * lay.num_heads * lay.head_dim * e
    q_and_out += score * prompt_tokens * keys
    # ... and a contiguous copy of the layer's keys and values (LlamaLayerPath._attend_hf).
    kv_copy = 2 * batch * keys * lay.num_kv_heads * lay.head_dim * e
    q_and_out += kv_copy
    # fp8 K/V: one block of K and V dequantized at a time, and the merge's fp32 accumulators for
    # a chunk's queries. In 16 bits the core's kernel writes the block and nothing else
    # (kv_fp8.dequantize); otherwise torch's ops hold an fp32 copy beside it.
    block_tokens = decode_block_tokens = 0
    blocks = 0
    if fp8:
        sixteen = lay.dtype in (torch.bfloat16, torch.float16)
        per_block_token = 2 * batch * lay.num_kv_heads * lay.head_dim * (e if sixteen else 4 + e)
        block_tokens = config.kv_block_tokens or min(
            capacity, max(256, model.kv_block_bytes // per_block_token)
        )
        accumulators = 3 * batch * lay.num_heads * lay.head_dim * 4
        blocks = block_tokens * per_block_token + chunk * accumulators
        decode_block_tokens = config.kv_block_tokens or min(
            block_tokens, max(256, model.kv_decode_block_bytes // per_block_token)
        )
    paged = config.kv_page_tokens > 0
    page_bytes = _round_up(min(config.kv_page_tokens, capacity) * kv_token, state.granularity)
    if paged and not fp8:  # the merge's fp32 accumulators of a chunk's queries across pages
        blocks += chunk * 3 * batch * lay.num_heads * lay.head_dim * 4
    base = hidden + rotary + mask + chunk * per_token + logits + blocks
    margin = model.margin_fixed + int(budget * model.margin_fraction)
    n = lay.num_layers
    window = min(config.prefetch_layers, n)
    weight_layers, weight_bytes, weight_decode_slot = weights
    # the least room streamed weights need beside the K/V: their slots (or all of them resident)
    weight_least = min(weight_layers, model.weight_slots) * weight_bytes
    # after a returned cache's tokens, each chunk attends the cache's buffer in place
    # (LlamaLayerPath.prefill); fp8 K/V attends whole only through a shadow (below)
    if host_residual or past_tokens:
        whole_attention = False
    elif chunk >= prompt_tokens or config.prefill_attention == "whole":
        whole_attention = True
    elif config.prefill_attention == "chunked":
        whole_attention = False
    else:
        # (paged layers attend by chunks, page by page; whole layers may still attend whole)
        fits = base + q_and_out + margin + (window + 1) * (page_bytes if paged else layer_kv)
        fits += weight_least
        whole_attention = fits <= budget - baseline

    def prefill_bytes(whole: bool) -> int:
        if whole and chunk < prompt_tokens:
            return base + q_and_out  # whole queries and output, and the scores
        if whole:  # q and out are in per_token
            return base + score * prompt_tokens * keys + kv_copy
        return base + score * chunk * keys

    decode = logits + batch * capacity * 8 + per_token + model.decode_fixed
    if fp8:
        decode += decode_block_tokens * per_block_token + accumulators
    decode_margin = model.margin_fixed + int(budget * model.decode_margin_fraction)
    prefill = prefill_bytes(whole_attention)
    shadow = 0
    if fp8:
        # Note [fp8 prefill shadow] (cache/fp8_reads.py): with 16-bit compute, prefill may keep the
        # layer's K/V dequantized beside its rows (no blocks then) and attend it as a bf16
        # layer's. Whole attention through it is taken where the rules above allow it and
        # decode keeps the residency of the blocks by chunks (Note [fp8 whole attention]);
        # by chunks through it where it costs no residency at all; else the blocks.
        blocks_only = prefill_bytes(False)
        args = (n, layer_kv, layer_kv, window, weight_layers, weight_bytes)  # (fp8: no rings)
        rest = (model.weight_slots, 0, 0)

        def residency(p: int) -> tuple[int, int, int, int, int] | None:
            room = budget - baseline - max(p + margin, decode + decode_margin)
            return _residency(room, *args, *rest)

        reference = residency(blocks_only)
        whole_wanted, whole_attention, prefill = whole_attention, False, blocks_only
        if not paged and e == 2:
            sh = 2 * batch * keys * lay.num_kv_heads * lay.head_dim * e
            swap = sh - block_tokens * per_block_token  # (the shadow instead of the blocks)
            whole_bytes = prefill_bytes(True) + swap
            after = residency(0)  # what decode holds once prefill's working set is gone
            whole_mix = residency(whole_bytes)
            if (
                whole_wanted
                and whole_mix is not None
                and (
                    config.prefill_attention == "whole"
                    or _whole_keeps_decode(whole_mix, reference, after)
                )
            ):
                whole_attention, prefill, shadow = True, whole_bytes, sh
            elif residency(blocks_only + swap) == reference:
                prefill, shadow = blocks_only + swap, sh
    working = max(prefill + margin, decode + decode_margin)
    avail = budget - baseline - working
    unit = page_bytes if paged else layer_kv
    # Note [Window rings] (cache/window_rings.py): sliding layers as rings of ring_tokens, planned
    # apart
    ring_tokens = window_ring_tokens(lay, capacity, chunk) if rings and not (fp8 or paged) else 0
    ring_ids = tuple(i for i, w in enumerate(lay.windows) if ring_tokens and w is not None)
    ring_kv = _round_up(ring_tokens * kv_token, state.granularity) if ring_ids else 0
    mix = _residency(
        avail,
        n - len(ring_ids),
        layer_kv,
        unit,
        window,
        weight_layers,
        weight_bytes,
        model.weight_slots,
        len(ring_ids),
        ring_kv,
    )
    if mix is None:
        capped = (
            f" (vram_budget {_fmt(requested)} capped to the {_fmt(state.limit)} the device "
            f"can give: {_fmt(state.available)} free beside {_fmt(baseline)} held)"
            if budget < requested
            else ""
        )
        where = ", its hidden states on the host" if host_residual else ""
        what = (
            f"one page of K/V ({_fmt(unit)} for {config.kv_page_tokens} tokens"
            if paged
            else f"one layer's K/V ({_fmt(unit)} for {capacity} tokens"
        )
        streamed = (
            f" plus one layer's weights streamed ({_fmt(weight_bytes)})" if weight_layers else ""
        )
        raise RevivaOutOfMemoryError(
            f"RevivaManager: the budget of {_fmt(budget)}{capped} cannot hold what is "
            f"already on the device ({_fmt(baseline)}: weights and buffers) plus the working "
            f"set of a {prompt_tokens}-token prompt ({_fmt(working)} at {chunk}-token "
            f"chunks{where}) plus {what}, batch {batch}){streamed}: "
            f"{_fmt(baseline + working + unit + (weight_bytes if weight_layers else 0))} needed. "
            "Raise vram_budget, "
            + ("lower kv_page_tokens or chunk_tokens" if paged else "lower chunk_tokens")
            + ", or shorten the prompt."
        )
    resident_full, resident_rings, staged, weight_resident, weight_slots = mix
    resident = resident_full + resident_rings
    full_ids = [i for i in range(n) if i not in ring_ids]
    resident_ids = tuple(
        sorted(
            [full_ids[k] for k in spread(resident_full, len(full_ids))]
            + [ring_ids[k] for k in spread(resident_rings, len(ring_ids))]
        )
    )
    if resident >= n:
        slots, page_slots, prefetch = 0, 0, window
    else:
        slots, page_slots = (0, staged) if paged else (staged, 0)
        prefetch = min(window, staged - 1)
    plan = Plan(
        budget=budget,
        requested_budget=requested,
        device_limit=state.limit,
        baseline=baseline,
        batch=batch,
        prompt_tokens=prompt_tokens,
        capacity=capacity,
        chunk_tokens=int(chunk),
        whole_attention=whole_attention,
        kv_token_bytes=kv_token,
        layer_kv_bytes=layer_kv,
        working_set=working,
        decode_working_set=decode + decode_margin,
        margin=margin,
        decode_slots=min(
            slots,
            model.decode_slots_with_streamed_weights
            if weight_layers > weight_resident
            else model.decode_slots,
        ),
        resident_layers=resident_ids,
        slots=slots,
        prefetch_layers=prefetch,
        num_layers=n,
        residual_on_host=host_residual,
        kv_fp8=fp8,
        kv_block_tokens=block_tokens,
        kv_decode_block_tokens=decode_block_tokens,
        kv_fp8_shadow_bytes=shadow,
        hidden_bytes_per_token=lay.hidden_size * e,
        page_tokens=config.kv_page_tokens if page_slots else 0,
        page_bytes=page_bytes if page_slots else 0,
        page_slots=page_slots,
        weight_layers=weight_layers,
        weight_layer_bytes=weight_bytes if weight_layers else 0,
        weight_resident_layers=spread(weight_resident, weight_layers) if weight_layers else (),
        weight_slots=weight_slots,
        weight_decode_slot_bytes=weight_decode_slot if weight_layers else 0,
        # as wide as the slots: the last of the window comes in as a layer is released (Note
        # [Streamed weights] in src/weight_store.cpp)
        weight_prefetch_layers=min(window, weight_slots),
        past_tokens=past_tokens,
        ring_tokens=ring_tokens,
        ring_layers=ring_ids,
        ring_kv_bytes=ring_kv,
    )
    plan = _spill(plan, config, host)
    host_cap = config.host_memory_bytes()
    pinned = plan.pinned_host_bytes
    if host_cap and pinned > host_cap:
        residual = (
            f" and the prompt's hidden states {_fmt(plan.residual_host_bytes)}"
            if host_residual
            else ""
        )
        raise RevivaOutOfMemoryError(
            f"RevivaManager: {plan.streamed_layers} streamed layers need {_fmt(plan.host_bytes)}"
            f"{residual} of pinned host memory for {capacity} tokens, over host_memory="
            f"{_fmt(host_cap)}. Raise host_memory or vram_budget, or shorten the prompt."
        )
    if host is not None and pinned > host.available:
        raise RevivaOutOfMemoryError(
            f"RevivaManager: {plan.streamed_layers} streamed layers' K/V "
            + ("and the prompt's hidden states " if host_residual else "")
            + f"need {_fmt(pinned)} of pinned host memory for {capacity} tokens, batch {batch}; "
            f"the host can give {_fmt(host.available)} ({_fmt(host.system_available)} available "
            f"to the system less {_fmt(host.reserve)} kept for the process, plus "
            f"{_fmt(host.pool_cached)} pinned and unused in Reviva's pool). Raise vram_budget, "
            "or shorten the prompt or the batch."
        )
    return plan


def _spill(plan: Plan, config: RevivaConfig, host: HostState | None) -> Plan:
    """Note [Spilled layers] (src/kv_store_disk.cpp): with offload_device="disk", the fewest
    streamed layers (spread among them) whose K/V goes to disk so that the call's pinned memory
    fits host_memory and what the host can give; prefetch_layers + 3 of them staged at a time
    (down to 2 where pinned memory is that short). A spilled layer saves its host copy only when
    more layers spill than are staged. Raises naming the numbers where even that cannot fit."""
    room = min(
        (r for r in (config.host_memory_bytes(), host.available if host else 0) if r > 0),
        default=0,
    )
    if config.offload_device != "disk" or room == 0 or plan.pinned_host_bytes <= room:
        return plan
    candidates = [i for i in plan.streamed_layer_ids if i not in plan.ring_layers]
    per_layer = plan.capacity * plan.kv_token_bytes
    if plan.page_tokens:
        raise RevivaOutOfMemoryError(
            f"RevivaManager: offload_device='disk' spills whole layers, not pages "
            f"(kv_page_tokens={plan.page_tokens}); use kv_page_tokens=0"
        )
    # each layer spilled beyond the staged ones saves its host copy: the fewest that fit
    beyond = max(-(-(plan.pinned_host_bytes - room) // per_layer), 1)
    for staged in range(plan.prefetch_layers + 3, 1, -1):
        count = staged + beyond
        if count <= len(candidates):
            picked = spread(count, len(candidates))
            return dataclasses.replace(
                plan,
                disk_layers=tuple(candidates[k] for k in picked),
                disk_staged_layers=staged,
            )
    least = plan.pinned_host_bytes - max(len(candidates) - 2, 0) * per_layer
    raise RevivaOutOfMemoryError(
        f"RevivaManager: with every one of the {len(candidates)} streamed layers but 2 staged "
        f"on disk, the call still needs {_fmt(least)} of pinned host memory for {plan.capacity} "
        f"tokens, over the {_fmt(room)} it may pin (host_memory, and what the host can give). "
        "Raise host_memory or vram_budget, or shorten the prompt."
    )


def _residency(
    avail: int,
    n: int,
    layer_kv: int,
    unit: int,
    window: int,
    weight_layers: int,
    weight_bytes: int,
    weight_slots: int,
    rings: int = 0,
    ring_kv: int = 0,
) -> tuple[int, int, int, int, int] | None:
    """How `avail` bytes are shared: (resident full K/V layers, resident rings, K/V staging
    units, resident weight layers, weight slots), or None when not even the least of each fits.
    K/V streams through up to window + 1 units (pages, or whole layers: the largest that
    streams) of staging room, narrowed before failing; streamed weights through weight_slots
    layers' room, narrowed to one where the rest does not fit. `n` full layers of layer_kv,
    `rings` ring layers of ring_kv (Note [Window rings] in cache/window_rings.py): rings are kept
    first (a byte kept saves a byte a step either way, and a ring is a whole layer fewer streamed
    for fewer bytes), and where every full layer stays the slots are a ring's. Of the mixes,
    the one with the most bytes resident, then the most weights (make_plan's docstring says
    why): so a second weight slot is given up where a layer more stays resident with one
    (MemoryModel.weight_slots)."""

    def staged_for(room: int, size: int) -> int | None:
        staged = window + 1
        while staged > 1 and room < staged * size:
            staged -= 1  # a narrower window before failing: still correct, less overlap
        return staged if room >= staged * size else None

    best: tuple[tuple[int, int, int], tuple[int, int, int, int, int]] | None = None
    for w in range(weight_layers, -1, -1):
        room = avail - w * weight_bytes
        wslots = 0
        if w < weight_layers:
            wslots = weight_slots
            while wslots > 1 and room - wslots * weight_bytes < min(unit, ring_kv or unit):
                wslots -= 1
            room -= wslots * weight_bytes
        if room < 0:
            continue
        options: list[tuple[int, int, int]] = []  # (full, rings, staged)
        if room >= n * layer_kv + rings * ring_kv:
            options.append((n, rings, 0))
        else:
            if rings and room >= n * layer_kv:  # every full layer kept: ring-sized slots
                staged = staged_for(room - n * layer_kv, ring_kv)
                if staged is not None:
                    left = room - n * layer_kv - staged * ring_kv
                    options.append((n, min(rings, left // ring_kv), staged))
            if n:  # full layers stream: slots of a full layer's, rings kept first
                staged = staged_for(room, unit)
                if staged is not None:
                    left = room - staged * unit
                    kept_rings = min(rings, left // ring_kv) if rings else 0
                    left -= kept_rings * ring_kv
                    options.append((min(n, left // layer_kv), kept_rings, staged))
        for full, kept_rings, staged in options:
            held = w * weight_bytes + full * layer_kv + kept_rings * ring_kv
            key = (held, w, full + kept_rings)  # (as much held: more weights, then more layers)
            if best is None or key > best[0]:
                best = (key, (full, kept_rings, staged, w, wslots))
    return None if best is None else best[1]


def _whole_keeps_decode(
    whole: tuple[int, int, int, int, int],
    reference: tuple[int, int, int, int, int] | None,
    after: tuple[int, int, int, int, int] | None,
) -> bool:
    """Note [fp8 whole attention]: whether fp8's whole attention through the shadow (prefill's
    residency `whole`) leaves decode what the blocks by chunks would (`reference`): the same
    weights, and room once prefill is done (`after`) for every layer the reference keeps, so
    that the layers prefill streams are promoted back."""
    if reference is None or after is None:
        return False
    return whole[3:] == reference[3:] and after[0] >= reference[0] and after[3] >= reference[3]


def spread(count: int, total: int) -> tuple[int, ...]:
    """`count` layer indices out of `total`, evenly spread, so that streamed layers' copies
    overlap the compute of resident layers between them."""
    if count >= total:
        return tuple(range(total))
    if count <= 0:
        return ()
    return tuple(sorted({math.floor((k + 0.5) * total / count) for k in range(count)}))


def _round_up(n: int, unit: int) -> int:
    return (n + unit - 1) // unit * unit if unit > 0 else n
