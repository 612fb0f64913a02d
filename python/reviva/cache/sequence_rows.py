"""The rows of a call's sequences beyond one per prompt: a prompt's K/V held once for the rows
that share it, each row's generated tokens apart (Note [Shared prompt K/V]), and beam search's
reorders of the generated rows (Note [Beams]). SequenceRows is RevivaCache's mixin; state it
reads and writes: the cache's share, batch, capacity, store, rings, _generated, _generated_len,
generated_bytes, _pending_rows and _beam_prefix.
"""

from __future__ import annotations

import torch

from reviva.cache.block_attention import attention_with_lse, merge

# Note [Shared prompt K/V]
# Beam search and several sequences per prompt run batch x n rows that share each prompt's
# tokens: HF repeats each prompt's row n times before prefill. Kept as n rows, a prompt's K/V
# is n identical copies: at 64k with 4 beams of the 8B shape, 32 GB where 8 GB hold it, and on
# a 24 GB card 28 of 32 layers streamed a step 11.8x greedy's (the H200 at f6651f0). So, when
# the rows need nothing per row in the prompt (no padding, full K/V, not fp8 or paged: the
# manager decides, call_inputs.share_rows), the cache holds each prompt's K/V once (the
# store's batch is the prompts) and each row's generated tokens in device buffers of their own
# (`generated rows`, a few tokens per row); the manager runs prefill over one row per prompt
# (its layer wrappers keep every n-th row) and hands HF's head the last token's row repeated.
# A decode step's queries attend to their prompt's K/V with the n rows' queries as one batch of
# queries (grouped heads read in place: one read of the prompt per step, not n), and to their
# own generated rows, the two merged by log-sum-exp (attend_shared). A beam's reorder gathers its
# generated rows only, at once (they are on the device), never the prompt's.
#
# Note [Beams]
# Beam search (HF's) runs batch x num_beams rows: generate repeats each prompt's row num_beams
# times before prefill, and after each step reorders the cache's rows by beam_idx, each new row
# a copy of a row of the same prompt. So every row of one prompt holds the same K/V for the
# prompt's tokens (the same computation on the same inputs), and only the generated tokens' rows
# differ between beams: a reorder gathers those alone, never the prompt's. HF's own caches copy
# every token's rows per step (index_select); here a step's reorder of a layer moves its
# generated tokens only (a few rows per beam against a prompt of thousands), on the device,
# when the layer is next acquired (acquire() applies what reorder() recorded, composed over
# reorders in between), and a streamed layer's rewritten rows go on to its host copy like any
# write. Paged layers are refused with beams (their rows are spread over pages).


class SequenceRows:
    """Shared prompts' and beams' rows of a RevivaCache (its mixin; see the module)."""

    def reorder(self, layer_idx: int, beam_idx: torch.Tensor) -> None:
        """Beam search's reorder of the layer's rows (Note [Beams]): recorded, and applied to
        the generated tokens' rows when the layer is next acquired."""
        if self.paged(layer_idx):
            raise RuntimeError(
                f"RevivaCache: layer {layer_idx} is paged; beams need whole layers (the manager "
                "refuses kv_page_tokens with num_beams > 1)"
            )
        if beam_idx.shape != (self.batch,):
            raise ValueError(
                f"RevivaCache.reorder: beam_idx of shape {tuple(beam_idx.shape)}, expected "
                f"({self.batch},)"
            )
        if self.share > 1:  # Note [Shared prompt K/V]: the generated rows alone, now
            n = self._generated_len.get(layer_idx, 0)
            if n:
                k, v = self._generated[layer_idx]
                rows = beam_idx.to(device=k.device, dtype=torch.long)
                k[:, :, :n] = k[rows, :, :n]
                v[:, :, :n] = v[rows, :, :n]
            return
        self._beam_prefix.setdefault(layer_idx, self.get_seq_length(layer_idx))
        earlier = self._pending_rows.get(layer_idx)
        beam_idx = beam_idx.to(torch.long)
        # (row j after both reorders is row earlier[beam_idx[j]] before either)
        self._pending_rows[layer_idx] = beam_idx if earlier is None else earlier[beam_idx]

    def _gather_generated(self, layer_idx: int, rows: torch.Tensor) -> None:
        """Rewrites the acquired layer's generated tokens [prompt, length) with each row taken
        from `rows` (written through to its host copy like any write)."""
        first, length = self._beam_prefix[layer_idx], self.store.length(layer_idx)
        if layer_idx in self.rings:  # (positions: the generated ones the ring still holds)
            length = self._ring_len[layer_idx]  # (<= high: its rows intact from high - R)
            first = max(first, self._ring_high[layer_idx] - self.rings[layer_idx][1])
            if length <= first:
                return
            k, v = self.window_kv(layer_idx, first, length)
            rows = rows.to(k.device)
            self._write_ring(layer_idx, first, k[rows], v[rows], bulk=True)
            return
        if length <= first:
            return
        k, v = self.store.kv(layer_idx, length)  # (fp8: uint8 rows, moved as they are)
        rows = rows.to(k.device)
        k_new, v_new = k[rows, :, first:length], v[rows, :, first:length]  # (copies)
        self.store.write(layer_idx, first, k_new, v_new)

    def _write_generated(
        self, layer_idx: int, first: int, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Note [Shared prompt K/V]: tokens [first, first + n) of every row, after the prompt."""
        prompt = self.store.length(layer_idx)
        n = key.shape[2]
        have = self._generated_len.get(layer_idx, 0)
        if first != prompt + have:
            raise ValueError(
                f"RevivaCache: layer {layer_idx}'s rows are written at token {first}, where "
                f"{prompt + have} tokens are held (a prompt of {prompt} shared by {self.share} "
                "rows): tokens after a shared prompt are written in order"
            )
        room = self.capacity - prompt
        if have + n > room:
            raise ValueError(
                f"RevivaCache: {have + n} tokens after the prompt exceed the {room} planned for "
                "the call"
            )
        if layer_idx not in self._generated:
            shape = (self.batch, key.shape[1], room, key.shape[3])
            k = torch.empty(shape, dtype=key.dtype, device=key.device)
            self._generated[layer_idx] = (k, torch.empty_like(k))
            self.generated_bytes += 2 * k.numel() * k.element_size()
        k, v = self._generated[layer_idx]
        k[:, :, have : have + n] = key
        v[:, :, have : have + n] = value
        self._generated_len[layer_idx] = have + n

    def attend_shared(
        self, layer_idx: int, q: torch.Tensor, first: int, last: int, scale: float
    ) -> torch.Tensor:
        """Note [Shared prompt K/V]: attention of the queries of tokens [first, last) of every
        row ([batch, heads, n, D]) to their prompt's K/V (the `share` rows' queries of a prompt
        as one batch of queries: non-causal, the prompt precedes them) and to their own tokens
        after it up to `last` (bottom-right causal), merged by log-sum-exp; [batch, heads, n, D]
        in q's dtype."""
        prompt = self.store.length(layer_idx)
        if first < prompt:
            raise ValueError(
                f"RevivaCache: queries from token {first} of layer {layer_idx}, inside its shared "
                f"prompt of {prompt} tokens"
            )
        rows, heads, n, dim = q.shape
        s, b = self.share, rows // self.share
        k_p, v_p = self.store.kv(layer_idx, prompt)  # [b, kv_heads, prompt, D]
        q_p = q.reshape(b, s, heads, n, dim).transpose(1, 2).reshape(b, heads, s * n, dim)
        o_p, l_p = attention_with_lse(q_p, k_p, v_p, False, scale)
        o_p = o_p.reshape(b, heads, s, n, dim).transpose(1, 2).reshape(rows, heads, n, dim)
        l_p = l_p.reshape(b, heads, s, n).transpose(1, 2).reshape(rows, heads, n)
        k_g, v_g = self._generated[layer_idx]
        after = last - prompt
        o_g, l_g = attention_with_lse(q, k_g[:, :, :after], v_g[:, :, :after], True, scale)
        out, lse = merge(None, None, o_p, l_p)
        out, _ = merge(out, lse, o_g, l_g)
        return out.to(q.dtype)
