"""RevivaCacheLayer: one layer of a RevivaCache as HF's per-layer cache (CacheLayerMixin),
answering over the cache's shared store; and the mask sizes it gives HF for a prompt (Note
[Prefill masks left to Reviva]).
"""

from __future__ import annotations

import weakref
from typing import Protocol

import torch
from transformers.cache_utils import CacheLayerMixin


class _Layers(Protocol):
    """What a layer reads and calls of its RevivaCache (cache/kv_cache.py)."""

    skip_prefill_masks: bool
    rings: dict[int, tuple[int, int]]
    capacity: int

    def append(
        self, layer_idx: int, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def get_seq_length(self, layer_idx: int = 0) -> int: ...

    def reorder(self, layer_idx: int, beam_idx: torch.Tensor) -> None: ...

    def truncate(self, layer_idx: int, tokens: int) -> None: ...


# Note [Prefill masks left to Reviva]
# HF's model builds each attention type's 4D mask before its layers run. For a sliding window
# shorter than the prompt it cannot leave the mask to SDPA's is_causal, so a 64k prompt gets a
# [1, 1, 64k, 64k] boolean mask: 4 GiB at once, more than a 24 GB card has beside a 7B model's
# weights (the H200 at da88db7: Mistral-7B's shape at 64k ran out of memory there, in
# masking_utils.sdpa_mask, with and without rings). Reviva's prefill needs no such mask where no
# row is padded: its chunks apply the causal rule and the window's band themselves
# (chunk_attention), and a layer whose window is shorter than the prompt never goes to HF's
# attention call over the whole prompt (LlamaLayerPath.prefill). So for an unpadded call from an
# empty cache with such a window (the manager sets skip_prefill_masks), each layer answers HF's
# mask sizes for the prompt as one key at offset 0: HF's mask then comes out None (its is_causal
# shortcut), and Reviva's calls, which take a mask only to apply padding, get none. From the
# first decode step on the sizes are the true ones (HF's decode path reads them).


class RevivaCacheLayer(CacheLayerMixin):
    """One layer of a RevivaCache (HF's per-layer interface over the shared store)."""

    is_sliding = False
    is_compileable = False
    is_croppable = True  # (assisted and prompt-lookup decoding cut the rejected candidates)

    def __init__(self, cache: _Layers, layer_idx: int) -> None:
        super().__init__()
        self._cache_ref = weakref.ref(cache)
        self._layer_idx = layer_idx
        self.is_initialized = True

    @property
    def _cache(self) -> _Layers:
        cache = self._cache_ref()
        if cache is None:
            raise RuntimeError("RevivaCacheLayer: its RevivaCache is gone")
        return cache

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):  # noqa: ANN001, ANN201
        return self._cache.append(self._layer_idx, key_states, value_states)

    def get_seq_length(self) -> int:
        return self._cache.get_seq_length(self._layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self._cache.skip_prefill_masks and query_length > 1 and self.get_seq_length() == 0:
            return 1, 0  # Note [Prefill masks left to Reviva]: HF builds no prompt-sized mask
        ring = self._cache.rings.get(self._layer_idx)
        if ring is None:
            return self.get_seq_length() + query_length, 0
        # Note [Window rings] (cache/window_rings.py): the keys update() returns, as HF's
        # sliding layers
        window, length = ring[0], self.get_seq_length()
        return min(length, window - 1) + query_length, max(length - window + 1, 0)

    def get_max_length(self) -> int:
        return self._cache.capacity

    def reset(self) -> None:
        raise NotImplementedError("RevivaCache cannot be reset layer by layer; build a new one")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._cache.reorder(self._layer_idx, beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        # HF's convention (a number or a 0-d tensor): a negative count removes that many tokens,
        # 0 removes none, a positive one (legacy) is the length to keep
        n = int(tokens_to_remove)
        if n == 0:
            return
        length = self.get_seq_length()
        keep = length + n if n < 0 else min(n, length)
        self._cache.truncate(self._layer_idx, max(keep, 0))

    def offload(self) -> None:
        pass  # the store decides where layers live

    def prefetch(self) -> None:
        pass
