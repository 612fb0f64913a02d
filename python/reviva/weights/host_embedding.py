"""HostEmbedding: a decoder's input embedding table in pinned host memory, its rows read by the
device in place (Note [Embedding on the host])."""

from __future__ import annotations

import torch
from torch import nn

from reviva.weights.host_heap import _trim_host_heap

# Note [Embedding on the host]
# A decoder's input embedding is a table of vocab x hidden (1.56 GB for the 32B shape, 1.05 GB
# for the 8B one) of which a decode step reads one row per sequence. When the layers' weights
# stream, every byte of device memory is a byte a step need not copy, so the table moves to pinned
# host memory, from which the device reads the rows it needs in place (Backend::gather_rows_async:
# one kernel, the prompt's rows once, then a row per step; no host work and no synchronization in
# a step). At 067decd the rows were gathered on the host and copied, and the 32B shape's first
# 32k-token call spent 1.4 s more before its first layer than with the table on the device.
#
# The module's `weight` stays the same Parameter and is the table itself (the model a user holds
# is the model: its state_dict, get_input_embeddings().weight and F.embedding over it give the
# table's values, and `weight.copy_(...)` writes the table the next forward reads):
# - on the CPU, the pinned table;
# - on CUDA, the same pinned bytes as a CUDA tensor (pinned memory is mapped for the device, at
#   the same address under unified addressing, which the CUDA backend requires: the gather
#   kernel reads it by that pointer): kernels over it read the host's memory over the bus, so
#   torch's ops on it are correct, only slower than on device memory. It keeps `model.device`
#   (HF reads the first parameter's, the embedding's) the compute device: HF's generate moves
#   each step's inputs to `model.device`, and a CPU tensor there would send every decode step's
#   ids to the host and back (a synchronization a step).
# `weight.data = t` (or a new Parameter under the name) is taken at the next forward: its values
# (same shape and dtype, else a ValueError naming them) are copied into the table. close() gives
# the weight back where it was before (a device tensor again, copied from the table; on the CPU
# the pinned table, whose values it had). Only for an input embedding that is not tied to the
# output head (tied, the head reads the table every step: it stays on the device).


def _on_device(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`table` (pinned host memory) as a tensor of `device` over the same bytes: itself on the
    CPU; on CUDA the mapped pinned bytes (Note [Embedding on the host]), which keep the table
    alive."""
    if device.type == "cpu":
        return table
    if device.type != "cuda" or not table.is_pinned():
        raise ValueError(f"HostEmbedding: no view of a host table on {device}")

    class _Mapped:  # (torch takes a foreign CUDA pointer by this interface; uint8: no bf16 there)
        def __init__(self, t: torch.Tensor) -> None:
            self.keep = t
            nbytes = t.numel() * t.element_size()
            self.__cuda_array_interface__ = {
                "shape": (nbytes,),
                "typestr": "|u1",
                "data": (t.data_ptr(), False),
                "strides": None,
                "version": 2,
            }

    with torch.cuda.device(device):
        flat = torch.as_tensor(_Mapped(table), device=device)
    if flat.data_ptr() != table.data_ptr() or flat.device != device:
        raise ValueError(
            f"HostEmbedding: the pinned table is not mapped at its host address on {device}"
        )
    return flat.view(table.dtype).view(table.shape)


class HostEmbedding:
    """An nn.Embedding whose table lives in pinned host memory (Note [Embedding on the host])."""

    def __init__(
        self,
        embed: nn.Embedding,
        pool: object,
        runtime: object,
        device: torch.device,
        origin: torch.device | None = None,
    ) -> None:
        """origin: where the weight was before Reviva moved anything (close() puts it back
        there); default: where it is now."""
        if type(embed) is not nn.Embedding or embed.max_norm is not None:
            raise ValueError(
                f"HostEmbedding: a plain nn.Embedding without max_norm is needed, got "
                f"{type(embed).__name__}"
            )
        w = embed.weight
        self.embed = embed
        self.param = w
        self.device = device
        self.runtime = runtime
        self.origin = origin if origin is not None else w.device
        self.table = pool.tensor(list(w.shape), w.dtype)  # pinned
        with torch.no_grad():
            self.table.copy_(w.data)
        self.nbytes = w.numel() * w.element_size()
        self.view = _on_device(self.table, device)
        w.data = self.view  # (the device memory w had goes back once nothing refers to it)
        self._forward_before = embed.__dict__.get("forward")
        embed.forward = self.forward  # (an instance attribute: the class's forward is shadowed)
        _trim_host_heap()
        if device.type == "cuda":
            # The table's device memory goes back to the driver, not to torch's cache: the arena
            # maps its own memory and cannot take what torch keeps cached (the H200 at 7657206:
            # 8-16 of an 8 GB card's promotions refused by the device, 1 GB of budget unused).
            torch.cuda.empty_cache()

    def sync(self) -> None:
        """A weight the user replaced (`weight.data = t`, a new Parameter) has its values copied
        into the table, and is the table again (Note [Embedding on the host])."""
        p = self.embed._parameters.get("weight")
        if p is self.param and p.data_ptr() == self.view.data_ptr() and p.shape == self.view.shape:
            return
        if p is None or p.shape != self.table.shape or p.dtype != self.table.dtype:
            got = "None" if p is None else f"{tuple(p.shape)} {p.dtype}"
            raise ValueError(
                f"HostEmbedding: the input embedding's weight was replaced by a {got} tensor; its "
                f"table in pinned host memory is {tuple(self.table.shape)} {self.table.dtype} "
                "(Note [Embedding on the host]): write values of that shape and dtype"
            )
        with torch.no_grad():
            self.view.copy_(p.data)
        p.data = self.view
        self.param = p

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.sync()
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

    def close(self) -> None:
        """The module's own forward again, its weight where it was before (a tensor of its own
        on the device, the table's values; on the CPU the pinned table)."""
        self.sync()
        if self.embed.__dict__.get("forward") == self.forward:
            if self._forward_before is None:
                del self.embed.forward
            else:
                self.embed.forward = self._forward_before
        p = self.param
        if self.origin.type in ("cpu", "meta"):
            p.data = self.table  # (its values, on the CPU: no second copy of the table)
        else:
            p.data = torch.empty_like(self.table, device=self.origin).copy_(self.table)
        self.view = self.table
