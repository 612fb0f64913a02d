"""The Llama-layout decoder layer, computed by Reviva where HF's forward cannot run as is.

Prefill: one decoder layer over the whole prompt, by token chunks (projections, attention of a
chunk's queries against the keys so far, MLP), writing the layer's K/V into a RevivaCache and
updating the hidden states in place, so that the working set does not grow with the prompt.
Decode with Reviva's own attention call: the new token's queries against the cache's
token-major K/V, grouped heads read in place. A cache stores and this module computes
(STYLE.md): the cache never calls into here, the manager wires the two together.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from reviva.adapters import DecoderLayout
from reviva.cache.kv_cache import RevivaCache
from reviva.generate.layer_attention import write_and_attend
from reviva.plan.call_plan import Plan


class _Graphs(Protocol):
    """What a decode step asks of the call's decode graphs (DecodeGraphs,
    generate/decode_graphs.py)."""

    def ready(self, i: int, h: torch.Tensor) -> bool: ...

    def step(
        self,
        cache: RevivaCache,
        i: int,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        past: int,
    ) -> torch.Tensor: ...

    def defer(self, i: int, layer: nn.Module, cos: torch.Tensor, sin: torch.Tensor) -> None: ...


log = logging.getLogger("reviva.llama_layer")  # (the name users filter on)


def attention_interface(attn: nn.Module) -> Callable | None:
    """The attention function HF's layer calls for its config's attn_implementation: the
    registered one, or for "eager" (HF's fallback, registered nowhere) the modeling module's own
    eager_attention_forward, as the layer takes it; None where there is neither."""
    impl = attn.config._attn_implementation
    if impl == "eager" or impl is None:
        return getattr(sys.modules.get(type(attn).__module__), "eager_attention_forward", None)
    return ALL_ATTENTION_FUNCTIONS.get_interface(impl, None)


class LlamaLayerPath:
    """Prefill and own-decode of one layout's decoder layers (see the module docstring)."""

    def __init__(self, layout: DecoderLayout) -> None:
        self.layout = layout
        # Copy streams of the residual stream's chunks (in, out), made at first use on CUDA.
        self._residual_streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None

    def prefill(
        self,
        cache: RevivaCache,
        plan: Plan,
        i: int,
        layer: nn.Module,
        h: torch.Tensor,
        kwargs: dict[str, Any],
        past: int = 0,
        padded: bool = False,
    ) -> torch.Tensor:
        """One decoder layer over the whole prompt, by token chunks, in place on `h`. `past` >
        0: the prompt's tokens after the `past` the cache holds already (Note [A returned
        cache] in cache/returned.py): bottom-right causal attention, and HF's mask of these tokens'
        rows when the batch is `padded` (else HF's mask is left out: causal alone)."""
        if torch.is_grad_enabled():
            raise RuntimeError("RevivaManager prefill runs under torch.no_grad() (generate does)")
        attn = layer.self_attn
        mask = kwargs.get("attention_mask") if past == 0 or padded else None
        if "position_embeddings" not in kwargs:
            raise ValueError(
                "RevivaManager: the decoder layer was called without position_embeddings "
                "(the Llama layout passes them from model.model.rotary_emb)"
            )
        cos, sin = kwargs["position_embeddings"]
        whole = plan.chunk_tokens >= h.shape[1]
        interface = attention_interface(attn)
        # Note [Prefill masks left to Reviva] (cache/layer.py): a window shorter than the prompt is
        # applied by Reviva's own calls (a band per chunk), never by HF's over the whole prompt
        window = self.layout.windows[i]
        windowed = window is not None and window < past + h.shape[1]
        if (whole or plan.whole_attention) and interface is None and not windowed:
            raise ValueError(
                f"RevivaManager: attention implementation {attn.config._attn_implementation!r} "
                "is not registered with transformers"
            )
        cache.acquire(i)
        try:
            # All of the prompt's K/V is written in this call: map it at once, not by chunks.
            cache.reserve(i, past + h.shape[1])
            with cache.prefill_shadow(i, past + h.shape[1]):  # Note [fp8 prefill shadow]
                self._prefill_layer(cache, plan, i, layer, h, cos, sin, mask, interface, past)
        finally:
            cache.release(i)
        return h

    def _prefill_layer(self, cache, plan, i, layer, h, cos, sin, mask, interface, past) -> None:  # noqa: ANN001
        """prefill()'s way through one acquired layer: by chunks, or whole attention."""
        whole = plan.chunk_tokens >= h.shape[1]
        window = self.layout.windows[i]
        windowed = window is not None and window < past + h.shape[1]
        if past:
            self._prefill_fused(cache, plan, i, layer, h, cos, sin, mask, None, past)
        elif whole or not plan.whole_attention or cache.paged(i) or windowed:
            # (pages and windows: by chunks)
            hf = None if windowed else interface
            with cache.prefill_order(i, h.shape[1], plan.chunk_tokens):
                self._prefill_fused(cache, plan, i, layer, h, cos, sin, mask, hf)
        else:
            self._prefill_whole_attention(cache, plan, i, layer, h, cos, sin, mask, interface)

    def prefill_from_host(
        self,
        cache: RevivaCache,
        plan: Plan,
        i: int,
        layer: nn.Module,
        residual: torch.Tensor,
        positions: torch.Tensor,
        rotary: Any,
    ) -> None:
        """One decoder layer over the whole prompt whose hidden states live on the host
        (Note [Residual stream on the host]): residual [tokens, batch, hidden] pinned, updated
        by chunks; positions [1 or batch, tokens]; rotary(x, positions) gives a chunk's cos and
        sin."""
        if torch.is_grad_enabled():
            raise RuntimeError("RevivaManager prefill runs under torch.no_grad() (generate does)")
        tokens, chunk = residual.shape[0], plan.chunk_tokens
        cache.acquire(i)
        try:
            cache.reserve(i, tokens)
            with cache.prefill_order(i, tokens, chunk), cache.prefill_shadow(i, tokens):
                self._prefill_from_host_chunks(cache, i, layer, residual, positions, rotary, chunk)
        finally:
            cache.release(i)

    def _prefill_from_host_chunks(
        self, cache, i, layer, residual, positions, rotary, chunk
    ) -> None:  # noqa: ANN001
        if self.layout.device.type == "cuda":
            self._prefill_chunks_streamed(cache, i, layer, residual, positions, rotary, chunk)
            return
        tokens = residual.shape[0]
        for s in range(0, tokens, chunk):
            e = min(tokens, s + chunk)
            # (the host backend: the device is the host, so a copy of the chunk)
            h = residual[s:e].transpose(0, 1).clone(memory_format=torch.contiguous_format)
            cos, sin = rotary(h, positions[:, s:e])
            self._rows(cache, i, layer, h, 0, e - s, s, cos, sin, None, None)
            residual[s:e].copy_(h.transpose(0, 1))

    def _prefill_chunks_streamed(
        self,
        cache: RevivaCache,
        i: int,
        layer: nn.Module,
        residual: torch.Tensor,
        positions: torch.Tensor,
        rotary: Any,
        chunk: int,
    ) -> None:
        """prefill_from_host's chunks on CUDA (Note [Residual stream on the host]): chunk k+1
        is read in on one copy stream while chunk k computes, and chunk k written back on
        another, into two device buffers used in turn."""
        device = self.layout.device
        if self._residual_streams is None:
            self._residual_streams = (
                torch.cuda.Stream(device=device),
                torch.cuda.Stream(device=device),
            )
        up, down = self._residual_streams
        compute = torch.cuda.current_stream(device)
        tokens, batch, hidden = residual.shape
        starts = list(range(0, tokens, chunk))
        n = min(chunk, tokens)
        bufs = [torch.empty(n, batch, hidden, dtype=residual.dtype, device=device) for _ in "ab"]
        filled = [torch.cuda.Event(), torch.cuda.Event()]  # a buffer's chunk is in
        free = [torch.cuda.Event(), torch.cuda.Event()]  # a buffer's chunk is written back
        # The host rows this layer reads were written by the previous layer's write-backs (or
        # the embedding's, on the compute stream) and the buffers are new on compute's stream.
        up.wait_stream(down)
        up.wait_stream(compute)

        def read(k: int) -> None:
            s, e, b = starts[k], min(tokens, starts[k] + chunk), k % 2
            with torch.cuda.stream(up):
                if k >= 2:
                    up.wait_event(free[b])  # chunk k-2 left this buffer
                bufs[b][: e - s].copy_(residual[s:e], non_blocking=True)
                filled[b].record(up)

        read(0)
        try:
            for k, s in enumerate(starts):
                e, b = min(tokens, s + chunk), k % 2
                if k + 1 < len(starts):
                    read(k + 1)  # ahead, while chunk k computes
                compute.wait_event(filled[b])
                h = bufs[b][: e - s].transpose(0, 1)
                if not h.is_contiguous():  # (batch > 1: a copy, written back from there)
                    h = h.contiguous()
                cos, sin = rotary(h, positions[:, s:e])
                self._rows(cache, i, layer, h, 0, e - s, s, cos, sin, None, None)
                down.wait_stream(compute)
                with torch.cuda.stream(down):
                    residual[s:e].copy_(h.transpose(0, 1), non_blocking=True)
                    free[b].record(down)
                if h.data_ptr() != bufs[b].data_ptr():
                    h.record_stream(down)  # (compute's memory, read on the copy stream)
        finally:
            # The buffers go back to compute's stream: after every copy that used them.
            compute.wait_stream(up)
            compute.wait_stream(down)

    def decode(
        self,
        cache: RevivaCache,
        i: int,
        layer: nn.Module,
        h: torch.Tensor,
        kwargs: dict[str, Any],
        graphs: _Graphs | None = None,
    ) -> torch.Tensor:
        """A decode step of one layer with Reviva's own attention call: the new tokens' queries
        against the cache's token-major K/V, grouped heads read in place (no concatenation, no
        expansion). For CUDA in half precision without a padding mask. With `graphs`, the layer's
        compute before and after attention replays CUDA graphs once captured (until then the
        step runs eagerly and the layer waits for capture); the result is then in the graphs'
        static hidden state, which is returned."""
        past = cache.get_seq_length(i)
        cos, sin = kwargs["position_embeddings"]
        cache.acquire(i)
        try:
            if graphs is not None and graphs.ready(i, h):
                return graphs.step(cache, i, h, cos, sin, past)
            self._rows(cache, i, layer, h, 0, h.shape[1], past, cos, sin, None, None)
            if graphs is not None:
                graphs.defer(i, layer, cos, sin)
        finally:
            cache.release(i)
        return h

    def _qkv(
        self,
        layer: nn.Module,
        h: torch.Tensor,
        s: int,
        e: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys (both with RoPE, except in a NoPE layer: SmolLM3's `use_rope` false, as
        HF's attention reads it) and values of tokens [s, e), [B, heads, n, D]."""
        attn = layer.self_attn
        x = layer.input_layernorm(h[:, s:e])
        lay = self.layout
        shape = (h.shape[0], e - s, -1, lay.head_dim)
        if lay.fused_qkv:  # Phi-3: one projection, queries then keys then values
            qkv = attn.qkv_proj(x)
            nq, nkv = lay.num_heads * lay.head_dim, lay.num_kv_heads * lay.head_dim
            q = qkv[..., :nq].view(shape)
            k = qkv[..., nq : nq + nkv].view(shape)
            v = qkv[..., nq + nkv :].view(shape).transpose(1, 2)
        else:
            q = attn.q_proj(x).view(shape)
            k = attn.k_proj(x).view(shape)
            v = attn.v_proj(x).view(shape).transpose(1, 2)
        if hasattr(attn, "q_norm"):
            q = attn.q_norm(q)
        if hasattr(attn, "k_norm"):
            k = attn.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if getattr(attn, "use_rope", True):
            q, k = lay.apply_rotary_pos_emb(q, k, cos[:, s:e], sin[:, s:e])
        return q, k, v

    @staticmethod
    def _finish(layer: nn.Module, h: torch.Tensor, s: int, e: int, out: torch.Tensor) -> None:
        """o_proj of the attention output [B, n, heads, D], residual, MLP: h[:, s:e] in place.
        Gemma 2/3 (a pre_feedforward_layernorm): each sublayer's output normalized before its
        residual add (post_attention_layernorm, post_feedforward_layernorm), the MLP's input by
        pre_feedforward_layernorm; Llama: post_attention_layernorm is the MLP's input norm."""
        o = layer.self_attn.o_proj(out.reshape(h.shape[0], e - s, -1))
        if hasattr(layer, "pre_feedforward_layernorm"):
            r = h[:, s:e] + layer.post_attention_layernorm(o)
            m = layer.mlp(layer.pre_feedforward_layernorm(r))
            h[:, s:e] = r + layer.post_feedforward_layernorm(m)
            return
        r = h[:, s:e] + o
        h[:, s:e] = r + layer.mlp(layer.post_attention_layernorm(r))

    @staticmethod
    def _attend_hf(attn: nn.Module, q, k, v, mask, interface) -> torch.Tensor:  # noqa: ANN001
        # Exactly HF's call (same function, same arguments): the same numbers. The keys and
        # values as HF's cache holds them, contiguous, not the token-major views of Reviva's
        # cache: on those strides cuDNN's attention builds a kernel of its own in the process's
        # first call (H200: 0.89 s against 0.12 s for contiguous K/V at 64k, later calls 0.06 s
        # both), which made the first generate's prefill 1.3x a later one's. The copy is one
        # layer's K/V, counted in the planner's whole-attention working set.
        k, v = k.contiguous(), v.contiguous()
        out, _ = interface(
            attn,
            q,
            k,
            v,
            mask,
            dropout=0.0,
            scaling=attn.scaling,
            sliding_window=getattr(attn, "sliding_window", None),
        )
        return out

    def _prefill_fused(self, cache, plan, i, layer, h, cos, sin, mask, interface, past=0) -> None:  # noqa: ANN001
        """Chunk by chunk: a chunk's queries attend to the keys of all tokens up to its end, which
        this and earlier chunks have written (and the `past` tokens before h's), so one pass
        suffices and a chunk's input rows are dead once its output is written."""
        tokens, chunk = h.shape[1], plan.chunk_tokens
        for s in range(0, tokens, chunk):
            e = min(tokens, s + chunk)
            whole = s == 0 and e == tokens and past == 0
            hf = interface if whole else None
            self._rows(cache, i, layer, h, s, e, past + s, cos, sin, mask, hf)

    def _rows(self, cache, i, layer, h, s, e, first, cos, sin, mask, interface) -> None:  # noqa: ANN001
        """Rows [s, e) of h are tokens [first, first + e - s): their projections, their K/V into
        the cache, their attention to every token up to the last of them, o_proj and the MLP, in
        place. With `interface`, attention is HF's own call (the whole prompt at once: the same
        numbers as HF); else Reviva's bottom-right causal call on the cache's layout."""
        q, k, v = self._qkv(layer, h, s, e, cos, sin)
        last = first + e - s
        if interface is not None and not (cache.paged(i) or cache.read_by_blocks(i)):
            cache.write(i, first, k, v)
            k_all, v_all = cache.view(i, last)
            out = self._attend_hf(layer.self_attn, q, k_all, v_all, mask, interface)
        else:  # (fp8 and paged layers: by blocks or pages, never HF's call over whole K/V)
            scale = layer.self_attn.scaling
            window = self.layout.windows[i]
            rows = None if mask is None else mask[:, :, s:e]  # (its rows are h's)
            out = write_and_attend(cache, i, q, k, v, first, last, scale, rows, window)
            out = out.transpose(1, 2)
        self._finish(layer, h, s, e, out)

    def _prefill_whole_attention(self, cache, plan, i, layer, h, cos, sin, mask, interface) -> None:  # noqa: ANN001
        """Projections by chunks into whole-prompt queries and the cache, one attention call
        over the prompt, then o_proj and the MLP by chunks."""
        tokens, chunk = h.shape[1], plan.chunk_tokens
        lay = self.layout
        q_all = torch.empty(
            h.shape[0], lay.num_heads, tokens, lay.head_dim, dtype=h.dtype, device=h.device
        )
        for s in range(0, tokens, chunk):
            e = min(tokens, s + chunk)
            q, k, v = self._qkv(layer, h, s, e, cos, sin)
            cache.write(i, s, k, v)
            q_all[:, :, s:e] = q
        k_all, v_all = cache.view(i, tokens)
        out = self._attend_hf(layer.self_attn, q_all, k_all, v_all, mask, interface)
        del q_all
        for s in range(0, tokens, chunk):
            e = min(tokens, s + chunk)
            self._finish(layer, h, s, e, out[:, s:e])


# Note [Residual stream on the host]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A long prompt's hidden states are the largest tensor of a prefill that keeps them on the device
# (512k tokens x 4096 x bf16: 4.3 GB, issue 13), with the whole prompt's rotary tables beside
# them. When the plan does not fit with them on the device (RevivaConfig(prefill_residual="auto"),
# or always with "host"), they live in pinned host memory from the process's pool, token-major
# ([tokens, batch, hidden]: a chunk is one contiguous copy), and prefill goes layer by layer:
# each chunk of tokens is copied in, runs the layer (projections, its K/V into the cache,
# attention of its queries to the keys so far, MLP), and is copied back. On CUDA the copies run
# on two copy streams of their own, into two device buffers used in turn: chunk k+1 is read in
# while chunk k computes, chunk k written back while chunk k+1 computes; a layer's first read
# waits for the previous layer's last write-back (at 512k a layer computes for seconds against
# 2 x 78 ms of copies, which ran on the compute stream until fd28304). The model's own forward
# still drives the layers: the embedding wrapper writes the embeddings chunk by chunk to the host
# and returns a placeholder of the prompt's shape that holds no memory (a broadcast zero), the
# rotary wrapper returns broadcast placeholders for cos and sin (each chunk's are computed when
# it runs), every layer returns the placeholder, and the final norm computes only the last
# token's row, broadcast to the prompt's shape: generate asks the head for the last position's
# logits alone (logits_to_keep=1). So nothing of the prompt's size is on the device but its K/V;
# options that need every position (output_hidden_states, logits_to_keep != 1) or a padding mask
# are refused by name in this mode.
