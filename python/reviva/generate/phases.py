"""The phases of a generate call as they happen: prefill's layers being issued, the switch from
prefill to decode, decode's steps. Each leaves an event (a CUDA event on the device's clock, or
the host's time on the CPU) in the call's phase record, from which generate/call_stats.py makes the
call's statistics and trace; and the switch to decode runs what decode needs first: fp8's
decode blocks, streamed weights' decode rooms, then the placement of decode
(plan/decode_placement.py).

CallPhases is a mixin of RevivaManager, called from the wrappers (generate/hf_surface.py). State it
reads: the manager's layout, arena, weights, _graphs, _cache, _plan, _own_decode, _copy_hidden.
State it writes: the call's _phase record (events, the decode step count, rotary shapes for the
decode graphs, the pinning helper's go), _ranges and _progress; the decode graphs' captures
ahead of decode (Note [Decode graphs] in generate/decode_graphs.py); torch's and the arena's peak
memory counters, reset per phase (_phase_peak).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from reviva.generate.call_stats import phase_counters
from reviva.generate.host_copies import _PIN_AFTER_LAYER
from reviva.weights.streamed import DECODE_ROOMS, HOST_DECODE_ROOMS


class CallPhases:
    """The call's phase events and its switch from prefill to decode (RevivaManager's mixin)."""

    def _event(self) -> Any:
        if self.layout.device.type == "cuda":
            e = torch.cuda.Event(enable_timing=True)
            e.record(torch.cuda.current_stream(self.layout.device))
            return e
        return time.perf_counter()

    def _mark_decode_step(self) -> None:
        self._prefill_over()
        self._phase["decode_steps"] = self._phase.get("decode_steps", 0) + 1
        self._phase.setdefault("step_events", []).append(self._event())
        self._ranges.swap("reviva.decode.step")

    def _prefill_over(self) -> None:
        """The call's first decode step starts (once per call, before its first layer): decode's
        smaller fp8 blocks, streamed weights taken one block at a time in a smaller room (Note
        [Layers in parts]), then what prefill's working set and that room leave promoted."""
        if "prefill_end" in self._phase:
            return
        self._phase["prefill_end"] = self._event()
        self._ranges.pop("reviva.prefill")
        self._ranges.push("reviva.decode")
        if self._progress is not None:
            self._progress.close()
        self._phase["prefill_peak"] = self._phase_peak()
        self._phase["prefill_counters"] = phase_counters(self, self._cache)
        if "pin_go" in self._phase:  # (a prompt too short for a layered prefill)
            self._phase["pin_go"].set()
        plan, cache = self._plan, self._cache
        if cache is not None and plan is not None and cache.fp8 and plan.kv_decode_block_tokens:
            cache.block_tokens = plan.kv_decode_block_tokens
        if self.weights is not None:
            # (Note [Decode rooms when the host attends] in weights/streamed.py)
            rooms = HOST_DECODE_ROOMS if self._phase.get("host_attention", False) else DECODE_ROOMS
            self._phase["weight_bytes_given_back"] = self.weights.enter_decode(rooms)
            self._promote_weights_for_host_decode()
        self._promote_after_prefill()
        self._attend_on_host_after_prefill()

    def _phase_peak(self) -> int | None:
        """The device bytes a phase (prefill, then decode) held at most: torch's peak plus the
        arena's peak within it, and starts the next phase's peaks. A sum of two peaks bounds
        the true one; within one phase they nearly coincide (prefill's K/V grows to the end of
        the phase, where the last layer's working set peaks; decode's barely moves)."""
        if self.layout.device.type != "cuda":
            return None
        peak = torch.cuda.max_memory_allocated(self.layout.device)
        peak += self.arena.stats()["peak_bytes"]
        torch.cuda.reset_peak_memory_stats(self.layout.device)
        self.arena.reset_peak()
        return peak

    def _prefill_layer_starts(
        self, i: int, kwargs: dict[str, Any], hidden_states: torch.Tensor
    ) -> None:
        """Layer i's prefill is about to be issued: the phase events of the call's first layers
        (stats: prefill_before_first_layer_s, prefill_first_layer_s; each layer's for the
        trace), the rotary shapes for the decode graphs, the helper thread's go
        (host_copies.pin_host_copies), and from the middle layer on the decode graphs'
        captures while the device is busy."""
        start = self._event()
        self._phase.setdefault("layer_events", []).append(start)
        self._ranges.swap("reviva.prefill.layer")
        if self._progress is not None:
            self._progress.layer(i)
        if i == 0:
            self._phase["layer0_start"] = start
            if "t_setup" in self._phase:
                t = time.perf_counter() - self._phase["t_setup"]
                self._phase["setup_host_ms"]["first_layer"] = t * 1e3
            self._note_rope(kwargs)
        elif i == 1:
            self._phase["layer1_start"] = start
        if i == _PIN_AFTER_LAYER and "pin_go" in self._phase:
            self._phase["pin_go"].set()
        if i >= max(_PIN_AFTER_LAYER + 1, len(self.layout.layers) // 2):
            thread = self._phase.get("pin_thread")
            if thread is None or not thread.is_alive():  # (registration holds up the host)
                self._capture_ahead(hidden_states, busy=True)

    def _capture_ahead(self, hidden_states: torch.Tensor, busy: bool) -> None:
        """Captures the decode graphs of layers that have none yet, before decode (Note [Decode
        graphs]), when this call's decode runs them and at least 8 steps are to come:
        hidden_states is prefill's ([batch, tokens, hidden]). busy: prefill's later layers are
        being issued, and the host captures only while the device works through what is
        queued (an event recorded now); else (the end of prefill) every such layer."""
        rope = self._phase.get("rope_like")
        cache, plan = self._cache, self._plan
        if self._graphs is None or rope is None or cache is None or plan is None:
            return
        if plan.capacity - cache.get_seq_length(0) < 8:  # decode steps still to come
            return
        h = self._phase.get("graph_h")
        if h is None:
            h = torch.zeros(
                (hidden_states.shape[0], 1, hidden_states.shape[2]),
                dtype=hidden_states.dtype,
                device=hidden_states.device,
            )
            self._phase["graph_h"] = h
        event = None
        if busy:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(h.device))
        self._graphs.capture_ahead(self.layout.layers, h, *rope, busy=event)

    def _note_rope(self, kwargs: dict[str, Any]) -> None:
        """Prefill's first layer: one position of its cos and sin (shape and dtype of a decode
        step's) for the decode graphs captured at the end of prefill, if the call's decode runs
        them (Reviva's own decode path, no padding mask, no per-layer hidden states kept)."""
        pe = kwargs.get("position_embeddings")
        if (
            self._graphs is None
            or pe is None
            or self._copy_hidden
            or self._phase.get("padded", True)
            or not (
                self._own_decode
                or (self._cache is not None and (self._cache.fp8 or self._cache.page_tokens > 0))
            )
        ):
            return
        self._phase["rope_like"] = tuple(t[:, :1].clone() for t in pe)
