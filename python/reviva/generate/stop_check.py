"""The decode loop's stop decision a step late on CUDA (Note [A stop decided a step late]):
while a Reviva call runs, HF's DeferredStopCheck is taken for that call's cache, so the host
queues the next step while the device computes. `deferring(cache)` is the scope; RevivaCache's
crop (cache/kv_cache.py) undoes the one step run past a stop.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from transformers.generation import utils as hf_generation

# Note [A stop decided a step late]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# HF's decode loop asks `unfinished_sequences.max() == 0` once a step (StopCheck): the host waits
# there for the device to finish the step, then spends its own time (the next step's inputs, the
# wrappers, the graphs' replays being issued) while the device waits for it: 1.5 ms of a 10 ms
# fp8 step at 64k on an H100. transformers' DeferredStopCheck copies the flag to pinned memory
# behind an event and reads it a step later, so the host never waits; what it costs is one
# forward past a stop (an EOS, a stop string), whose token generate drops and whose K/V the
# cache's `crop(-1)` takes back. HF enables it on MPS only (`is_supported`). For a Reviva call we
# take it where it cannot change what the caller sees:
# - CUDA, greedy (no sampling: the step past a stop would draw from the generator, so a second
#   sampled call would differ from plain HF's), not an assistant model;
# - the call's own RevivaCache, which takes one token back in every layer (rings keep slack
#   for it: Note [Window rings]). A stop at max_length is seen on the host at once: a call that
#   runs to its length runs no extra step, and no step ever passes the cache's capacity.
# The steps taken back are counted (RevivaCache.undone_steps) and leave the call's decode steps.
#
# HF's deferred check also streams each token a step late: the first new token reached a
# streamer only once the second step had been queued, so a user's time to the first token grew
# by a decode step (1.53 -> 1.77 s for the 8B streaming its weights on an 8 GB card at 32k, the
# calls' wall times alike: H200, before and after the deferral), and a streamer that timed the
# call counted N-1 tokens over N-2 steps with the first step left out. For a Reviva call the
# first token goes to the streamer at once (the call's one wait for the device, after
# prefill); the tokens after it come a step late as HF streams them, the last at the end, so
# the first and last arrive when they exist.
#
# While at least one Reviva call defers (a count under a lock), HF's module name
# DeferredStopCheck is our subclass: its `is_supported` asks the original for every other
# cache and it behaves as the original for them, so other generate calls decide as before.

_LOCK = threading.Lock()
_DEFERRING: dict[int, Any] = {}  # id(cache) -> cache, for the calls running now
# (transformers releases before DeferredStopCheck: every call waits each step, as HF's own do)
_DEFERRED = getattr(hf_generation, "DeferredStopCheck", None)


def _is_supported(device: Any, cache: Any, cache_is_returned: bool, is_assistant: bool) -> bool:
    if cache is not None and _DEFERRING.get(id(cache)) is cache:
        return device.type == "cuda" and not is_assistant
    return _DEFERRED.is_supported(device, cache, cache_is_returned, is_assistant)  # (HF's rule)


class _SkipFirstPut:
    """A streamer's stand-in that drops the first token handed to it (already streamed)."""

    def __init__(self, streamer: Any) -> None:
        self.streamer = streamer
        self.skip = True

    def put(self, value: Any) -> None:
        if self.skip:
            self.skip = False
            return
        self.streamer.put(value)


def _stop_check_class() -> type | None:
    if _DEFERRED is None:
        return None

    class RevivaStopCheck(_DEFERRED):  # type: ignore[misc, valid-type]
        """HF's DeferredStopCheck; for a deferring Reviva call's cache the first new token
        reaches the streamer at once (Note [A stop decided a step late])."""

        is_supported = staticmethod(_is_supported)

        def __init__(
            self,
            input_ids: Any,
            max_length: Any,
            cache: Any,
            cache_is_returned: bool,
            streamer: Any = None,
        ) -> None:
            super().__init__(input_ids, max_length, cache, cache_is_returned, streamer)
            ours = cache is not None and _DEFERRING.get(id(cache)) is cache
            self.first_at_once = ours and streamer is not None

        def __call__(self, unfinished_sequences: Any, tokens: Any, length: int) -> bool:
            if self.first_at_once and self.is_first_step:
                self.streamer.put(tokens.cpu())  # (waits for prefill's token: the one wait)
                self.streamer = _SkipFirstPut(self.streamer)  # (HF hands it over next step)
            return super().__call__(unfinished_sequences, tokens, length)

    return RevivaStopCheck


def defers(device: Any, gen: Any) -> bool:
    """Whether a call on `device` with GenerationConfig `gen` decides its stop a step late."""
    return (
        _DEFERRED is not None
        and device.type == "cuda"
        and not gen.do_sample
        and (gen.num_beams or 1) == 1
    )


def stop_state(device: Any, cache: Any) -> str:
    """The stats' `decode_stop`: "deferred", or why the call waited for each step's stop."""
    if cache.defers_stop:
        return "deferred"
    if _DEFERRED is None:
        return "each step (this transformers has no DeferredStopCheck)"
    if device.type != "cuda":
        return f"each step (the device is {device.type}: deferred on CUDA only)"
    return "each step (sampling or beams: the step past a stop would change what is drawn)"


@contextlib.contextmanager
def deferring(cache: Any, on: bool) -> Iterator[None]:
    """While inside, HF's generate defers the stop decision for `cache` (when `on`)."""
    if not on:
        yield
        return
    with _LOCK:
        if not _DEFERRING:
            hf_generation.DeferredStopCheck = _STOP_CHECK
        _DEFERRING[id(cache)] = cache
    try:
        yield
    finally:
        with _LOCK:
            del _DEFERRING[id(cache)]
            if not _DEFERRING:
                hf_generation.DeferredStopCheck = _DEFERRED


_STOP_CHECK = _stop_check_class()
