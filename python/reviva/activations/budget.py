"""Budget mode of an activation offload (activations/offload.py): which layers a step offloads so
that its device peak stays under the budget (the first step offloads all and measures; later steps
keep the last layers, needed first in backward), and the window of device bytes that may wait for
their copies, grown into what the kept layers leave of the budget.

BudgetMode is a mixin of ActivationOffload. State it reads: the offload's budget, stats
(layer_saved_bytes), _regions, _extra_all, _held and window_bytes. State it writes: _room and
_kept_upto.
"""

from __future__ import annotations

import logging

from reviva.sizes import format_bytes

# (the offload's logger: what a user filters on stays reviva.activations.offload's)
log = logging.getLogger("reviva.training")


class BudgetMode:
    """ActivationOffload's budget mode (its mixin; see the module docstring)."""

    def _choose_layers(self) -> set[int] | None:
        """Budget mode: the layers to offload this step (None: all).

        The first step offloads all and measures what each layer saves and (CUDA) the step's
        peak above what the device held before it. A layer kept on the device adds what it saved
        to that floor, so layers are kept from the last one down (their activations are needed
        first in backward, where a copy could not hide) while the sum, plus a prefetch window,
        fits the budget; the first layers, needed last, are offloaded. On the CPU there is no
        peak to measure: the floor is what was saved outside the layers."""
        self._room = None
        self._kept_upto = []
        if self.budget is None or not self.stats.layer_saved_bytes:
            return None
        saved = self.stats.layer_saved_bytes
        n = self._regions
        kept = sum(b for i, b in saved.items() if i < n)
        floor = self._extra_all
        if floor is None:
            floor = sum(b for i, b in saved.items() if i >= n)
        room = self.budget - self._held - floor
        if room < 0:
            log.warning(
                "reviva: activation budget %s cannot be met: with every activation offloaded "
                "the step peaked at %s (%s held before it); offloading all",
                format_bytes(self.budget),
                format_bytes(self._held + floor),
                format_bytes(self._held),
            )
            return None
        # While kept layers run backward, the first offloaded layers' storages already come back
        # (up to window_bytes) beside the kept activations: room for that window too, or keep
        # nothing (measured on the H200: without it a halfway budget was exceeded by 65 MB).
        room_beside_window = room - min(self.window_bytes, sum(saved.values()))
        chosen: set[int] = set()
        for i in range(n):
            if kept <= room_beside_window:
                break
            chosen.add(i)
            kept -= saved.get(i, 0)
        self._room = room
        upto = 0
        for i in range(n):
            upto += 0 if i in chosen else saved.get(i, 0)
            self._kept_upto.append(upto)
        return chosen

    def _window(self, layer: int) -> int:
        """The device bytes that may wait for their D2H (forward) or be brought back ahead
        (backward) while `layer` runs: `window_bytes`, or in budget mode, if more, what the
        budget leaves beside the kept layers' activations on the device then (those of layers
        up to `layer`). The offloaded layers come first, so their copies may lag far behind
        forward compute before the kept layers fill the room, and in backward the first
        offloaded layers come back while the kept layers' activations are freed."""
        if self._room is None or not self._kept_upto:
            return self.window_bytes
        kept = self._kept_upto[min(max(layer, 0), len(self._kept_upto) - 1)]
        return max(self.window_bytes, self._room - kept)
