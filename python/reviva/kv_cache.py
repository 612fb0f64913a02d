"""RevivaCache: a HuggingFace `Cache` whose layers live in a Reviva KVStore.

Each layer's K and V are token-major buffers [capacity, batch, kv_heads, head_dim] (a new token is
one contiguous row, so it is appended and copied out alone). Resident layers keep their buffers on
the device; the others live in pinned host memory and are streamed through staging slots, filled
`prefetch_layers` ahead of use by the core (reviva._C.KVStore). `update` returns views of the
buffers in HF's [batch, kv_heads, tokens, head_dim] layout; for batch 1 they are exactly the
layout flash attention reads, so nothing is copied or expanded to attend.

The decoder-layer wrappers of RevivaManager acquire a layer before its forward and release it
after; `update` appends into the acquired buffers.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from reviva._C import KVStore


class RevivaCacheLayer(CacheLayerMixin):
    """One layer of a RevivaCache (HF's per-layer interface over the shared store)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, cache: RevivaCache, layer_idx: int) -> None:
        super().__init__()
        self._cache = cache
        self._layer_idx = layer_idx
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):  # noqa: ANN001, ANN201
        return self._cache.append(self._layer_idx, key_states, value_states)

    def get_seq_length(self) -> int:
        return self._cache.store.length(self._layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return self._cache.capacity

    def reset(self) -> None:
        raise NotImplementedError("RevivaCache cannot be reset layer by layer; build a new one")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("RevivaCache does not support beam search (num_beams > 1)")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "RevivaCache is append-only: cropping (assisted or speculative decoding) is not "
            "supported"
        )

    def offload(self) -> None:
        pass  # the store decides where layers live

    def prefetch(self) -> None:
        pass


class RevivaCache(Cache):
    """A Cache over a KVStore; built by RevivaManager for one generate call."""

    def __init__(
        self,
        engine: object,
        num_layers: int,
        batch: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        capacity: int,
        resident_layers: list[int],
        slots: int,
        prefetch_layers: int,
    ) -> None:
        super().__init__(layers=[RevivaCacheLayer(self, i) for i in range(num_layers)])
        self.capacity = capacity
        self.batch = batch
        self.store = KVStore(
            engine, num_layers, batch, kv_heads, head_dim, dtype, capacity, prefetch_layers
        )
        self._shape = (capacity, batch, kv_heads, head_dim)
        self._dtype, self._device = dtype, device
        for layer in resident_layers:
            self.store.make_resident(layer, *self._new_buffers())
        for _ in range(slots):
            self.store.add_slot(*self._new_buffers())
        self._acquired: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def promote(self, layer_idx: int) -> None:
        """Makes a streamed layer resident (device memory freed up, e.g. after prefill)."""
        self.store.promote(layer_idx, *self._new_buffers())

    def _new_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V buffers of one layer, token-major, on the device."""
        k = torch.empty(self._shape, dtype=self._dtype, device=self._device)
        return k, torch.empty_like(k)

    # --- used by the layer wrappers --------------------------------------------------------------

    def acquire(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's buffers, holding its tokens so far, for compute from now until release."""
        kv = self.store.acquire(layer_idx)
        self._acquired[layer_idx] = kv
        return kv

    def release(self, layer_idx: int) -> None:
        self._acquired.pop(layer_idx)
        self.store.release(layer_idx)

    def write(self, layer_idx: int, first: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Writes tokens [first, first + n) of key/value ([batch, kv_heads, n, head_dim])."""
        k_buf, v_buf = self._acquired[layer_idx]
        n = key.shape[2]
        if first + n > self.capacity:
            raise ValueError(
                f"RevivaCache: {first + n} tokens exceed the capacity of {self.capacity} tokens "
                "(prompt + max_new_tokens) planned for this generate call"
            )
        k_buf[first : first + n].copy_(key.permute(2, 0, 1, 3))
        v_buf[first : first + n].copy_(value.permute(2, 0, 1, 3))
        self.store.wrote(layer_idx, first, n)

    def view(self, layer_idx: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The acquired layer's first `length` tokens, [batch, kv_heads, length, head_dim]."""
        k_buf, v_buf = self._acquired[layer_idx]
        return k_buf[:length].permute(1, 2, 0, 3), v_buf[:length].permute(1, 2, 0, 3)

    def append(
        self, layer_idx: int, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """HF's update: appends the new tokens and returns the whole layer."""
        if layer_idx not in self._acquired:
            raise RuntimeError(
                f"RevivaCache: layer {layer_idx} was updated outside RevivaManager's layer "
                "wrappers (use the cache through manager.generate)"
            )
        if key.shape[0] != self.batch:
            raise ValueError(
                f"RevivaCache: batch {key.shape[0]} differs from the planned batch {self.batch}"
            )
        first = self.store.length(layer_idx)
        self.write(layer_idx, first, key, value)
        return self.view(layer_idx, first + key.shape[2])

    # --- HF Cache interface ----------------------------------------------------------------------

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.store.length(layer_idx)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.capacity

    @property
    def batch_size(self) -> int:
        return self.batch

    def reset(self) -> None:
        self.store.clear()

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("RevivaCache does not support num_return_sequences > 1 or beams")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("RevivaCache does not support batch selection")
