"""The memory model's coefficients (MemoryModel; MODEL, the one a plan uses): what a generate
call's prefill and decode steps hold beside the K/V, per token of a chunk and fixed, the margins,
the chunk's and the staging room's sizes, and the copy and host-attention rates decode's
placement is decided by; and what a token holds in a mixture-of-experts layer (Note [The
experts' working set]). The arithmetic that uses them: reviva.plan.arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

from reviva.adapters import DecoderLayout

_MiB = 1 << 20


@dataclass(frozen=True)
class MemoryModel:
    """Coefficients of the working-set estimate (bytes, per prompt token of one chunk unless
    named otherwise). Measured against torch's peaks on the H200 (issue 4)."""

    hidden_fp32_copies: int = 8  # RMSNorm's fp32 input and output, per hidden unit
    head_temporaries: int = 5  # q with RoPE (2), attention output, o_proj input/output
    kv_head_temporaries: int = 4  # k with RoPE (2), v, their cache write
    mlp_wide_tensors: int = 3  # gate, up, their product
    # HF's grouped experts forward, per (token, chosen expert) pair (Note [The experts' working
    # set]): the gathered input and, of the expert's width, four (gate_up and its masked copy;
    # then that copy, the gate's activation and the gated product); at its end four hidden-sized
    # tensors (the gathered input, the down projection, weighted, unpermuted); the int64 sort
    # indices; fp32 router scores per expert.
    expert_wide_tensors: int = 4
    expert_hidden_tensors: int = 4
    expert_index_bytes: int = 4 * 8
    router_bytes_per_expert: int = 4 * 3
    residual_tensors: int = 3  # input, residual, output
    score_bytes_per_pair: int = 4 * 3  # unfused attention: fp32 scores with softmax temporaries
    logits_bytes_per_vocab: int = 12  # fp32 logits and the sampler's temporaries (+ dtype bytes)
    decode_fixed: int = 4 * _MiB  # decode's small tensors (positions, masks, sampler state)
    margin_fixed: int = 8 * _MiB  # allocator rounding ...
    margin_fraction: float = 1 / 50  # ... and fragmentation, as a part of the budget
    # Decode's working set is a token's tensors (small-pool blocks of torch's allocator): little
    # to fragment. The prefill margin kept through decode left a layer's K/V unused on a 24 GB card.
    decode_margin_fraction: float = 1 / 200
    # Staging slots kept in decode when layers still stream: the one in use and one being filled
    # keep the copy stream busy (a fill waits only for the release of the layer two streamed
    # layers back), so a third slot's memory makes one more layer resident instead.
    decode_slots: int = 2
    # ... and when the weights stream too: their copies keep the copy stream busy, so a streamed
    # layer's K/V can wait for the release of the one before it (its copy queues behind the
    # weights' blocks already in flight), and one slot less is a layer more resident.
    decode_slots_with_streamed_weights: int = 1
    chunk_target_fraction: float = 1 / 10  # a chunk's transients take this part of the room
    chunk_min_bytes: int = 32 * _MiB
    chunk_max_bytes: int = 4096 * _MiB
    chunk_multiple: int = 256
    kv_block_bytes: int = 128 * _MiB  # fp8 K/V: a block's dequantized K and V with temporaries
    # ... in a decode step, whose one query per sequence makes a block's attention cheap beside
    # its copy: smaller blocks free decode's working set for K/V kept resident (8B shape, 32k, 8 GB
    # card: 128 MiB of blocks was two layers' fp8 K/V streamed per step, at 045f1c0).
    kv_decode_block_bytes: int = 16 * _MiB
    # Streamed weights (Note [Streamed weights] in reviva/weights/streamed.py): room for at most
    # this many streamed layers' weights on the device beside the resident ones: the one compute
    # uses and the next being copied. Where a layer more can stay resident instead, the plan takes
    # one slot (the mix that holds more bytes: _residency): a decode step is copy-bound, and the
    # copy stream stays busy without prefetching weights (the K/V fetches and the next layer's
    # weights queue behind each other). Measured on the H200, 32B shape on a 24 GB card: one
    # weight slot, decode at 0.975 of the transfer roofline (bench_weights, ec413ed).
    weight_slots: int = 2
    # Note [Weights first when the host attends] (plan/decode_placement.py): a decode step's copy
    # rate, and the rate at which the host's cores attend streamed K/V (bytes of rows a second,
    # 16 threads, bf16, while the weights' copies run: 134 MB of a 32k layer in 3.9 ms on the
    # H200's host at ace9acc) with a fixed cost per layer (the wait for compute, the query and
    # output copies): what decides how much room goes to weights rather than K/V.
    copy_bps: float = 55e9
    host_attention_bps: float = 34e9
    host_attention_layer_s: float = 3e-4
    # RevivaConfig(decode_attention="auto") attends on the host where a step planned so is this
    # much shorter than with the K/V fetched (host_attention_pays): the host's time varies with
    # what else runs on its cores (2.5-4.8 ms a 32k layer between calls on the H200's host).
    host_attention_margin: float = 0.9
    # Note [The host beside the copies] (plan/host_decode.py): the rate at which the host's
    # cores attend fp8 rows (bytes of rows a second, 16 threads, e4m3 values and their scales).
    host_fp8_attention_bps: float = 34e9


MODEL = MemoryModel()


# Note [The experts' working set]
# A mixture-of-experts layer's prefill runs HF's own experts forward (Note [Routed experts] in
# weights/routed_experts.py), by default its grouped one (transformers.integrations.moe): each
# token's input is gathered once per chosen expert, sorted by expert, and each (token, expert) pair
# goes through that expert's gate_up, gate and down projections; the pairs' outputs are weighted,
# put back in token order and summed over the k experts. So a chunk of T tokens holds T*k rows at
# once: of the expert's width while it computes, of the hidden size (four of them) at its end.
# Qwen3-MoE (k = 8, width 768, hidden 2048) holds 128 KiB a token there, where a dense MLP of its
# config's intermediate_size (6144, run by none of its layers) is 36 KiB: planned as dense, a
# 4k-token chunk on a 6 GB card ran out of memory in `weighted_out[inv_perm]` (bench_experts --model
# qwen3-30b-a3b on the H200 at cb4c235). Measured on the CPU with torch's profiler
# (test_the_experts_working_set_covers_hfs_grouped_forward): the estimate is within 2% above the
# forward's peak.


def _experts_per_token(lay: DecoderLayout, model: MemoryModel) -> int:
    """Bytes a prompt token holds in HF's experts forward at its peak (Note [The experts'
    working set]); 0 for a model without experts."""
    k, width, e = lay.experts_per_token, lay.expert_intermediate_size, lay.dtype.itemsize
    if not k:
        return 0
    rows = max(
        lay.hidden_size + width * model.expert_wide_tensors,
        lay.hidden_size * model.expert_hidden_tensors,
    )
    return (
        k * (rows * e + model.expert_index_bytes) + lay.num_experts * model.router_bytes_per_expert
    )
