"""Placement: where each parameter and buffer of a user's model was before Reviva moved any, so
that close() (RevivaManager's, Finetune's) gives every tensor back there (Note [The user's
streamed parameters] in weights/writes.py says what happens to the streamed ones)."""

from __future__ import annotations

import torch
from torch import nn


class Placement:
    """The model's parameters (the Parameter objects and their devices) and buffers (the tensors
    themselves) as they were when made."""

    def __init__(self, model: nn.Module) -> None:
        self.params: list[tuple[nn.Module, str, nn.Parameter, torch.device]] = []
        self.buffers: list[tuple[nn.Module, str, torch.Tensor]] = []
        self._device: dict[int, torch.device] = {}
        for module in model.modules():
            for key, p in module._parameters.items():
                if p is not None:
                    self.params.append((module, key, p, p.device))
                    self._device[id(p)] = p.device
            for key, buf in module._buffers.items():
                if buf is not None:
                    self.buffers.append((module, key, buf))

    def origin(self, p: torch.Tensor) -> torch.device:
        """Where parameter p was (where it is, for one made since)."""
        return self._device.get(id(p), p.device)

    def restore(self) -> None:
        """Every parameter still under its name back on its device (moved there with its values
        now; one on the meta device, filled since, stays where its values are), every buffer
        moved since back to its own tensor (with the values the moved one has)."""
        with torch.no_grad():
            for module, key, p, device in self.params:
                if module._parameters.get(key) is not p or device.type == "meta":
                    continue
                if p.device != device:
                    p.data = p.data.to(device)
            for module, key, buf in self.buffers:
                now = module._buffers.get(key)
                if now is None or now is buf or buf.is_meta:
                    continue
                if now.shape == buf.shape and now.dtype == buf.dtype:
                    buf.copy_(now)
                    module._buffers[key] = buf
