"""Decode's attention on the host's cores over a RevivaCache's streamed layers (Note [Attention
on the host] in src/host_attention.cpp): a layer handed to the host (attend_on_host) keeps its
K/V in its pinned host copy, and each decode step's queries and new rows cross to the host, are
attended there, and the output comes back (host_attend). HostAttention is RevivaCache's mixin;
state it reads and writes: the cache's _host_layers, host_threads, _staging and the host
attention's times and calls.
"""

from __future__ import annotations

import time

import torch

from reviva.cache import fp8 as fp8rows


class HostAttention:
    """The host-attended layers of a RevivaCache (its mixin; see the module)."""

    def host_attended(self, layer_idx: int) -> bool:
        """Whether decode attends the layer's K/V on the host (attend_on_host)."""
        return layer_idx in self._host_layers

    def attend_on_host(self, layer_idx: int) -> None:
        """Note [Attention on the host] (src/host_attention.cpp): the streamed layer's K/V stays
        in its pinned host copy from now on; decode steps write their rows there and attend them
        on the host's cores (host_attend). It leaves the device and is never fetched again."""
        if layer_idx in self.rings:
            raise RuntimeError(
                f"RevivaCache: layer {layer_idx} is a window ring (Note [Window rings]); the host "
                "attends whole layers (the manager plans without rings when the host attends)"
            )
        self.store.attend_on_host(layer_idx)
        self._host_layers.add(layer_idx)

    def host_attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """A decode step of a host-attended layer: the new tokens' keys and values ([B,
        kv_heads, n, D]) written into its host copy, and their queries' ([B, heads, n, D])
        attention to every token up to each (causal; within `window` tokens for a sliding
        layer), computed on the host; [B, heads, n, D] in
        q's dtype on q's device. On CUDA, q, k and v cross in one wait for compute (the queries
        depend on this step's work) and the output goes back by a pinned copy that torch's
        stream orders before its readers."""
        t0 = time.perf_counter()
        if self.fp8:  # (the host copy holds rows as the store does: Note [fp8 K/V rows])
            k, v = fp8rows.quantize(k), fp8rows.quantize(v)
        if q.device.type == "cuda":
            qs, ks, vs, out_pinned = self._host_staging(q, k)
            qs.copy_(q, non_blocking=True)
            ks.copy_(k, non_blocking=True)
            vs.copy_(v, non_blocking=True)
            torch.cuda.current_stream(q.device).synchronize()
            t1 = time.perf_counter()
            out = self.store.host_attend(
                layer_idx, qs, ks, vs, scale, self.host_threads, window or 0
            )
            out_pinned.copy_(out)
            result = out_pinned.to(q.device, non_blocking=True).to(q.dtype)
        else:
            t1 = time.perf_counter()
            rows = torch.uint8 if self.fp8 else self.dtype
            out = self.store.host_attend(
                layer_idx,
                q,
                k.to(rows),
                v.to(rows),
                scale,
                self.host_threads,
                window or 0,
            )
            result = out.to(q.dtype)
        t2 = time.perf_counter()
        self.host_wait_s += t1 - t0
        self.host_attention_s += t2 - t1
        self.host_attention_calls += 1
        return result

    def _host_staging(
        self, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pinned buffers for a step's q, k, v and output, made once per shape. Reused layer
        after layer: each host_attend waits for compute, by which point the previous layer's
        output copy has been read."""
        key = (tuple(q.shape), tuple(k.shape), q.dtype, k.dtype)
        if self._staging is None or self._staging[0] != key:
            qs = torch.empty(q.shape, dtype=q.dtype, pin_memory=True)
            ks = torch.empty(k.shape, dtype=k.dtype, pin_memory=True)
            vs = torch.empty(k.shape, dtype=k.dtype, pin_memory=True)
            out = torch.empty(q.shape, dtype=torch.float32, pin_memory=True)
            self._staging = (key, (qs, ks, vs, out))
        return self._staging[1]
