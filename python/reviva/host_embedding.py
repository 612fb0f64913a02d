"""HostEmbedding: a decoder's input embedding table in pinned host memory, its rows read by the
device in place (Note [Embedding on the host])."""

from __future__ import annotations

import torch
from torch import nn

from reviva.host_heap import _trim_host_heap

# Note [Embedding on the host]
# A decoder's input embedding is a table of vocab x hidden (1.56 GB for the 32B shape, 1.05 GB
# for the 8B one) of which a decode step reads one row per sequence. When the layers' weights
# stream, every byte of device memory is a byte a step need not copy, so the table moves to pinned
# host memory, from which the device reads the rows it needs in place (Backend::gather_rows_async:
# one kernel, the prompt's rows once, then a row per step; no host work and no synchronization in
# a step). At 067decd the rows were gathered on the host and copied, and the 32B shape's first
# 32k-token call spent 1.4 s more before its first layer than with the table on the device.
# The module's `weight` stays a parameter on the device, of the table's shape, over one element
# (an expanded view): `model.device` (HF reads the first parameter's) stays the compute device,
# and anything that would write into it fails loudly (an expanded tensor refuses in-place
# copies). Its state_dict entry is the host table. Only for an input embedding that is not tied
# to the output head (tied, the head reads the table every step: it stays on the device).


class HostEmbedding:
    """An nn.Embedding whose table lives in pinned host memory (Note [Embedding on the host])."""

    def __init__(
        self, embed: nn.Embedding, pool: object, runtime: object, device: torch.device
    ) -> None:
        if type(embed) is not nn.Embedding or embed.max_norm is not None:
            raise ValueError(
                f"HostEmbedding: a plain nn.Embedding without max_norm is needed, got "
                f"{type(embed).__name__}"
            )
        w = embed.weight
        self.embed = embed
        self.device = device
        self.runtime = runtime
        self.table = pool.tensor(list(w.shape), w.dtype)  # pinned
        with torch.no_grad():
            self.table.copy_(w.data)
        self.nbytes = w.numel() * w.element_size()
        w.data = torch.zeros((), dtype=w.dtype, device=device).expand(w.shape)
        self._state_hook = embed._register_state_dict_hook(self._state_dict_hook)
        embed.forward = self.forward  # (an instance attribute: the class's forward is shadowed)
        _trim_host_heap()
        if device.type == "cuda":
            # The table's device memory goes back to the driver, not to torch's cache: the arena
            # maps its own memory and cannot take what torch keeps cached (the H200 at 7657206:
            # 8-16 of an 8 GB card's promotions refused by the device, 1 GB of budget unused).
            torch.cuda.empty_cache()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows, width = self.table.shape
        ids = input_ids.to(self.device, torch.long).reshape(-1).contiguous()
        if input_ids.shape[-1] > 1 and ids.numel() > 0:
            # A prompt (or candidates): ids that did not come from this model's own sampling are
            # checked as nn.Embedding checks them (one synchronization per prompt; the kernel
            # would give zeros for them).
            lo, hi = torch.stack(torch.aminmax(ids)).tolist()  # (one synchronization)
            if lo < 0 or hi >= rows:
                raise IndexError(
                    f"token id {lo if lo < 0 else hi} is outside the input embedding's {rows} rows"
                )
        out = torch.empty((ids.numel(), width), dtype=self.table.dtype, device=self.device)
        # The device reads the rows from the pinned table in place, in stream order: no host
        # gather, no copy to stage, no synchronization in a decode step.
        self.runtime.gather_rows(self.table, ids, out)
        return out.view(*input_ids.shape, width)

    def _state_dict_hook(self, module: nn.Module, state: dict, prefix: str, meta: object) -> None:
        state[prefix + "weight"] = self.table
