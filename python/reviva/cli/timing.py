"""GenerationTimer: per-phase wall times of any `model.generate` call, through its streamer hook.

generate hands the streamer the prompt first, then each new token once it is on the host (HF's
loop waits for the token's copy: at once, or a step later where the stop is decided a step late,
as a Reviva call on CUDA does with its first token at once and its last at the end: Note [A stop
decided a step late] in generate/stop_check.py). The timer waits for the device at begin and end
only: a wait when a token arrives would wait for the step queued after it, as no user's streamer
does. Prefill is the time to the first new token; decode rate is the tokens after it over the time
after it (exact over the call; a token's own time may be a step late).
"""

from __future__ import annotations

import time

import torch
from transformers.generation.streamers import BaseStreamer


class GenerationTimer(BaseStreamer):
    """A streamer that records when the prompt and each new token arrive."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else None
        self.start: float | None = None
        self.token_times: list[float] = []
        self.ended = False
        self._prompt_seen = False

    def begin(self) -> None:
        """Call right before generate: the clock starts here."""
        self._sync()
        self.start = time.perf_counter()
        self.token_times.clear()
        self.ended = False
        self._prompt_seen = False

    def _sync(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def put(self, value: torch.Tensor) -> None:
        if self.start is None:
            raise RuntimeError("GenerationTimer: call begin() before generate")
        now = time.perf_counter()
        if self._prompt_seen:  # generate puts the prompt first, then each new token
            self.token_times.append(now)
        self._prompt_seen = True

    def end(self) -> None:
        self._sync()
        self.ended = True

    @property
    def prefill_s(self) -> float | None:
        """Time from begin() to the first new token."""
        if self.start is None or not self.token_times:
            return None
        return self.token_times[0] - self.start

    @property
    def decode_tok_s(self) -> float | None:
        """New tokens after the first, per second after the first."""
        if len(self.token_times) < 2:
            return None
        return (len(self.token_times) - 1) / (self.token_times[-1] - self.token_times[0])

    @property
    def new_tokens(self) -> int:
        return len(self.token_times)
