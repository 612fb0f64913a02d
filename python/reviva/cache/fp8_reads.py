"""How a RevivaCache's fp8 rows (Note [fp8 K/V rows] in cache/fp8.py) are read: by dequantized
blocks, through prefill's 16-bit shadow of the layer (Note [fp8 prefill shadow]), or in place by
the fused fp8 decode attention (Note [fp8 decode attention] in src/fp8_attention.cpp). Fp8Reads
is RevivaCache's mixin; the rows are written (the shadow's too) by RevivaCache.write.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from reviva.cache import fp8 as fp8rows

# The largest head_dim the fused fp8 decode attention takes (reviva::kFp8DecodeMaxHeadDim).
FP8_DECODE_MAX_HEAD_DIM = 256


# Note [fp8 prefill shadow]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# fp8 rows are attended in prefill by blocks (layer_attention.attend_cache): each chunk's queries
# read every earlier key, a block at a time dequantized into a temporary, merged by log-sum-exp.
# Summed over a prompt's chunks that dequantizes the prefix once per chunk (a 16-bit copy of the
# whole prefix per chunk): 5.75 s against bf16's 3.84 at 64k on the H200 (Llama-3-8B shape).
# With a shadow, a layer's prefill also holds its K/V dequantized, 16-bit and token-major like a
# bf16 layer's store, written chunk by chunk as the rows are (each chunk's rows dequantized once,
# by the core's kernel, in place), and attends it exactly as a bf16 layer attends its store:
# the same values the blocks read, the bf16 path's calls. The shadow is one layer's 16-bit K/V
# of the prompt (64k, 8 kv heads of 128: 256 MiB), made when the layer's prefill starts and
# dropped when it ends; the planner takes it only where the plan keeps the same residency with
# it as without (else the blocks, in less memory: at 512k it would be 2 GiB, two layers' rows).

# Note [fp8 whole attention]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Through the shadow, an fp8 layer can also be attended whole, as a bf16 layer is where its
# plan allows (one flash call over the prompt: the queries and output of every token at once).
# By chunks, fp8 at 64k on a 24 GB card went through cuDNN (flash by chunks is ~1.75x slower
# there), whose plans, one per new shape and per thread, made a process's first call 1.31x
# bf16's (H200, 20f78a6: 5.77 s against 4.39; 1.61 s in the first layer against 0.12). Whole
# attention has one shape and no plan. Its queries and output take room the rows would have:
# at 64k it keeps 18 of 32 layers in prefill, and the 14 it streams are promoted back after it
# (as bf16's 9-in-prefill plan does), costing their copy back in the first decode step. So the
# planner takes it where bf16's rule allows whole attention and decode holds every layer the
# blocks by chunks would keep (plan_arithmetic._whole_keeps_decode); prefill_attention="chunked"
# keeps chunks, "whole" takes it wherever it fits.


class Fp8Reads:
    """The reads of a RevivaCache's fp8 rows (its mixin; see the module)."""

    def attends_fp8_in_place(
        self, layer_idx: int, q: torch.Tensor, mask: torch.Tensor | None
    ) -> bool:
        """Whether the queries q ([batch, heads, n, D]) of a decode step of the layer go through
        the fused fp8 decode attention (attend_fp8_decode): fp8 rows of a whole layer on the
        device, one query per sequence, 16-bit, no padding mask."""
        return (
            self.fp8
            and q.shape[2] == 1
            and mask is None
            and q.dtype in (torch.bfloat16, torch.float16)
            and self.head_dim <= FP8_DECODE_MAX_HEAD_DIM
            and not self.paged(layer_idx)
            and layer_idx not in self._host_layers
        )

    def fp8_graphable(self, layer_idx: int) -> bool:
        """Whether the layer's decode steps can hold its fp8 attention in their graph (Note
        [fp8 attention in the decode graphs] in generate/decode_graphs.py): what
        attends_fp8_in_place asks of a layer, in 16 bits on CUDA."""
        return (
            self.fp8
            and self.device.type == "cuda"
            and self.dtype in (torch.bfloat16, torch.float16)
            and self.head_dim <= FP8_DECODE_MAX_HEAD_DIM
            and not self.paged(layer_idx)
            and layer_idx not in self._host_layers
        )

    def attend_fp8_decode(
        self,
        layer_idx: int,
        first: int,
        q: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        window: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Note [fp8 decode attention] (src/fp8_attention.cpp): the new token's key and value
        ([batch, kv_heads, 1, D]) quantized into row `first` of the acquired layer and its
        queries' attention ([batch, heads, 1, D]) to keys [0, first] (a sliding layer's last
        `window` of them), the rows read in place, in one core call: into `out` ([batch, heads,
        1, D], any strides with a dense last dimension) when given; returned."""
        first_key = 0 if window is None else max(first + 1 - window, 0)
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        return self.store.attend_fp8_decode(layer_idx, first, q, key, value, scale, first_key, out)

    @contextlib.contextmanager
    def prefill_shadow(self, layer_idx: int, tokens: int) -> Iterator[None]:
        """Note [fp8 prefill shadow]: around an fp8 layer's prefill over its first `tokens`
        tokens, when the plan chose it (fp8_shadow) and the layer is whole: its K/V also
        dequantized as written, attended as a bf16 layer's (view(), HF's call); dropped after."""
        if not (self.fp8 and self.fp8_shadow) or self.paged(layer_idx) or tokens == 0:
            yield
            return
        shape = (tokens, self.batch, self.num_kv_heads, self.head_dim)
        k = torch.empty(shape, dtype=self.dtype, device=self.device)
        self._shadow = (layer_idx, k, torch.empty_like(k))
        try:
            if self.store.length(layer_idx):  # (rows written before: a returned cache's)
                held = self.store.length(layer_idx)
                k_all, v_all = self.store.kv(layer_idx, held)
                for rows, out in ((k_all, k), (v_all, self._shadow[2])):
                    out[:held] = fp8rows.dequantize(rows.permute(2, 0, 1, 3), self.dtype)
            yield
        finally:
            self._shadow = None

    def shadowed(self, layer_idx: int) -> bool:
        """Whether the layer's prefill holds its K/V dequantized (prefill_shadow)."""
        return self._shadow is not None and self._shadow[0] == layer_idx

    def read_by_blocks(self, layer_idx: int) -> bool:
        """Whether the layer's fp8 rows are attended by dequantized blocks: fp8 without a
        prefill shadow (Note [fp8 prefill shadow])."""
        return self.fp8 and not self.shadowed(layer_idx)

    def rows(self, layer_idx: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp8 K/V: the acquired layer's first `length` tokens as K and V rows, uint8 [batch,
        kv_heads, length, head_dim + 4] views (Note [fp8 K/V rows])."""
        return self.store.kv(layer_idx, length)
