"""Window rings (Note [Window rings]): a sliding-window layer kept as a ring of its window's
tokens rather than the call's. The planner's side: whether calls keep rings (rings_wanted) and
how many tokens a ring holds (window_ring_tokens); the cache's side: WindowRings, RevivaCache's
mixin that writes positions into a ring's rows and reads a window back in position order. State
it reads and writes: the cache's rings, _ring_len, _ring_high, store and capacity.
"""

from __future__ import annotations

import torch

from reviva import switches
from reviva.adapters import DecoderLayout

# Note [Window rings]
# A sliding-window layer's query at position p reads the keys of (p - W, p] alone (Note [Sliding
# windows] in generate/layer_attention.py), so once a call's tokens pass its window, every older
# token is dead weight: held on the device when the layer is resident, pinned on the host and copied
# each step when it streams. Such a layer is kept as a ring of R = W - 1 + S tokens instead (S: the
# most tokens written at once after the window, a prefill chunk or RING_SLACK_TOKENS at least,
# window_ring_tokens, below): position p lives in row p mod R of the store's block for the
# layer, whose capacity is R (Note [Layers of their own size] in src/kv_store.cpp), so its
# device memory, its pinned host copy and each fetch are R tokens however long the call, and the
# planner counts it so (Plan.kv_bytes: more layers stay resident). A write of positions
# [first, first + n) goes to rows first mod R on, in two writes where it wraps (each written
# through to the host copy as any write); the rows of positions [high - R, high) are the ones
# intact (high: the furthest position written). A read of positions [lo, hi) (window_kv) is a
# view of the rows, or both pieces in position order where it wraps (a copy of at most R
# tokens). Reviva's own attention reads the window of its first query on, with the band mask
# in those coordinates (attend_cache); HF's own attention reads what update() returns: the
# window's last W - 1 tokens and the new ones, as HF's DynamicSlidingWindowLayer returns them,
# and the layer reports is_sliding and HF's mask sizes, so HF's masks start where they do. A
# crop (assisted decoding) keeps rows intact for up to S tokens back; a returned cache holds a
# ring layer's last W - 1 tokens, as HF's sliding layers do. Not with fp8 or paged K/V (refused
# with short windows) nor a shared prompt, and not for layers attended on the host (the manager
# plans without rings when the host attends: their K/V lives in host memory). REVIVA_WINDOW_RINGS=0
# keeps every token, to compare.


# Note [Window rings]: a ring holds a window and room for the most tokens written
# at once after it (a prefill chunk, or assisted decoding's candidates: RING_SLACK_TOKENS at least)
RING_SLACK_TOKENS = 256


def rings_wanted() -> bool:
    """Note [Window rings]: whether calls keep sliding layers as rings
    (REVIVA_WINDOW_RINGS=0 keeps every token, to compare)."""
    return switches.window_rings()


def window_ring_tokens(layout: DecoderLayout, capacity: int, chunk: int) -> int:
    """The tokens of each sliding layer's ring for a call of `capacity` tokens in `chunk`-token
    prefill chunks (Note [Window rings]), or 0 where no layer gains from one: no
    sliding layer, windows of more than one length (HF's masks take one per call), or a ring
    no shorter than the call."""
    windows = {w for w in layout.windows if w is not None}
    if len(windows) != 1:
        return 0
    (w,) = windows
    ring = w - 1 + max(chunk, RING_SLACK_TOKENS)
    return ring if ring < capacity else 0


class WindowRings:
    """The rows of RevivaCache's ring layers (its mixin; see the module)."""

    def ring(self, layer_idx: int) -> tuple[int, int] | None:
        """Note [Window rings]: (window, ring tokens) of a layer kept as a ring, else None."""
        return self.rings.get(layer_idx)

    def window_kv(self, layer_idx: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Note [Window rings]: an acquired ring layer's K and V of positions [lo, hi) in order,
        [batch, kv_heads, hi - lo, D]: views of its rows, or (where they wrap) a copy of both
        pieces. Raises when the ring no longer holds them."""
        ring = self.rings[layer_idx][1]
        high, length = self._ring_high[layer_idx], self._ring_len[layer_idx]
        if not (0 <= lo <= hi <= length and hi - lo <= ring and lo >= high - ring):
            raise RuntimeError(
                f"RevivaCache: layer {layer_idx} is a ring of {ring} tokens holding positions "
                f"[{max(high - ring, 0)}, {length}); positions [{lo}, {hi}) were asked"
            )
        # (the rows written: min(high, ring), the store's length, without asking the store)
        k_all, v_all = self.store.kv(layer_idx, min(high, ring))
        start = lo % ring
        end = start + (hi - lo)
        if end <= ring:
            return k_all[:, :, start:end], v_all[:, :, start:end]
        k = torch.cat([k_all[:, :, start:], k_all[:, :, : end - ring]], dim=2)
        v = torch.cat([v_all[:, :, start:], v_all[:, :, : end - ring]], dim=2)
        return k, v

    def _write_ring(self, i: int, first: int, key, value, bulk=False) -> None:  # noqa: ANN001
        """Note [Window rings]: positions [first, first + n) into rows first mod R on (at most
        R - W + 1 of them, so that their queries' windows stay in the ring; `bulk`: a parked
        layer's, up to R, read by later queries alone)."""
        window, ring = self.rings[i]
        n = key.shape[2]
        limit = ring if bulk else ring - window + 1
        if first > self._ring_len[i]:
            raise ValueError(
                f"RevivaCache: layer {i}'s tokens written from {first} would leave a gap after "
                f"its {self._ring_len[i]}"
            )
        if n > limit:
            raise ValueError(
                f"RevivaCache: {n} tokens written at once into layer {i}, a ring of {ring} "
                f"tokens for a window of {window}: at most {limit} (Note [Window rings]: the "
                "planner sizes rings by the prefill chunk)"
            )
        if self.capacity < first + n:
            raise ValueError(
                f"RevivaCache: {first + n} tokens exceed the {self.capacity} planned for the call"
            )
        row = first % ring
        head = min(n, ring - row)
        self.store.write(i, row, key[:, :, :head], value[:, :, :head])
        if head < n:
            self.store.write(i, 0, key[:, :, head:], value[:, :, head:])
        self._ring_len[i] = max(self._ring_len[i], first + n)
        self._ring_high[i] = max(self._ring_high[i], first + n)
