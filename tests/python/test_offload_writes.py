"""TransferEngine.offload(x) copies x later, on the D2H stream (Note [Offload reads its source
later] in python/csrc/binding.cpp): a write to x through torch before the copy is seen complete
makes restore() and host_tensor() refuse by name instead of giving back a copy that may mix old
and new values; a write after ready() or wait() is the caller's own and restores the original."""

from __future__ import annotations

import pytest
import torch

import reviva

TORN = r"written in place after TransferEngine\.offload\(\) and before its copy was complete"


def source(device: str) -> torch.Tensor:
    # (large enough that the copy is still running when the write is issued on the host runtime)
    return torch.arange(4 << 20, dtype=torch.int32, device=device)


@pytest.mark.parametrize("write", ["fill_", "view.zero_", "copy_"])
def test_a_write_right_after_offload_makes_restore_refuse(
    engine: reviva.TransferEngine, device: str, write: str
) -> None:
    x = source(device)
    h = engine.offload(x)
    if write == "fill_":
        x.fill_(-1)
    elif write == "view.zero_":
        x[100:200].zero_()  # (a view shares the source's version counter)
    else:
        x.copy_(torch.zeros_like(x))
    with pytest.raises(ValueError, match=TORN):
        engine.restore(h)
    with pytest.raises(ValueError, match=TORN):
        engine.restore_batch([h])
    with pytest.raises(ValueError, match=TORN):
        h.host_tensor()
    h.wait()  # (seen complete only now: the write came before, the refusal stays)
    with pytest.raises(ValueError, match=TORN):
        engine.restore(h)


def test_a_write_after_the_copy_is_seen_complete_is_the_callers_own(
    engine: reviva.TransferEngine, device: str
) -> None:
    x = source(device)
    expected = x.clone()
    h = engine.offload(x)
    h.wait()
    x.fill_(-1)
    assert torch.equal(engine.restore(h), expected)
    assert torch.equal(h.host_tensor(), expected.cpu())
    y = source(device)
    h = engine.offload(y)
    while not h.ready():
        pass
    y.fill_(-1)
    assert torch.equal(engine.restore(h), expected)
    z = source(device)
    h = engine.offload(z)
    assert torch.equal(engine.restore(h), expected)  # (restore waited: the copy is complete)
    z.fill_(-1)
    assert torch.equal(engine.restore(h), expected)


def test_offload_then_del_restores_as_before(engine: reviva.TransferEngine, device: str) -> None:
    x = source(device)
    expected = x.clone()
    h = engine.offload(x)
    del x
    assert torch.equal(engine.restore(h), expected)
