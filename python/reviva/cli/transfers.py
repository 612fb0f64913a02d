"""`python -m reviva transfers`: random tensors offloaded to pinned host memory and brought back
through the TransferEngine, every byte checked, and what moved and how fast printed (on a GPU,
the host-to-device rate as `plan --pcie-gbps` takes it)."""

from __future__ import annotations

import argparse
import time

import torch


def _transfers(args: argparse.Namespace) -> int:
    import reviva

    device = args.device or (
        "cuda" if torch.cuda.is_available() and reviva.cuda_available() else "cpu"
    )
    rt = reviva.Runtime(device)
    where = (
        torch.cuda.get_device_name(0)
        if device.startswith("cuda")
        else "CPU (host backend: threads play the CUDA streams)"
    )
    print(f"reviva {reviva.__version__} (core {reviva.core_version()}) on {where}")

    pool = reviva.PinnedHostPool(rt, capacity_bytes=reviva.parse_bytes(f"{4 * args.mib}MiB"))
    engine = reviva.TransferEngine(rt, pool)
    gen = torch.Generator(device=device).manual_seed(0)
    # One layer's worth of tensors: a few large (activations, K/V) and many small (norm stats).
    per_tensor = max(1, args.mib // 8) << 20
    tensors = [
        torch.randn(per_tensor // 2, generator=gen, device=device, dtype=torch.bfloat16)
        for _ in range(8)
    ] + [torch.randn(1024, generator=gen, device=device) for _ in range(64)]
    total = sum(t.nbytes for t in tensors)

    t0 = time.perf_counter()
    offloaded = engine.offload_batch(tensors)
    for h in offloaded:
        h.wait()
    t1 = time.perf_counter()
    restored = engine.restore_batch(offloaded)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t2 = time.perf_counter()

    exact = all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(tensors, restored, strict=True)
    )
    d2h, h2d = engine.stats()["to_host"], engine.stats()["to_device"]
    ps = pool.stats()
    print(f"moved {total / 2**20:.1f} MiB in {len(tensors)} tensors each way")
    print(
        f"  offload  {total / (t1 - t0) / 1e9:7.2f} GB/s wall, "
        f"{d2h['bandwidth_gbps']:.2f} GB/s on the copy stream; "
        f"{d2h['coalesced_requests']} small tensors in {d2h['segment_launches']} coalesced copy"
    )
    print(
        f"  restore  {total / (t2 - t1) / 1e9:7.2f} GB/s wall, "
        f"{h2d['bandwidth_gbps']:.2f} GB/s on the copy stream"
    )
    print(
        f"  pinned pool: {ps['bytes_reserved'] / 2**20:.0f} MiB reserved in {ps['slabs']} "
        f"slab(s), {ps['bytes_in_use'] / 2**20:.1f} MiB in use, "
        f"cap {pool.capacity_bytes / 2**20:.0f} MiB"
    )
    print(f"  round trip bit-exact: {exact}")
    if device.startswith("cuda"):
        # (the copy stream's host-to-device rate over the batch: what `plan` assumes for streamed
        # weights and K/V, the H200's 55 GB/s unless given)
        print(
            f"  this card's host-to-device rate for plan: "
            f"python -m reviva plan --pcie-gbps {h2d['bandwidth_gbps']:.1f}"
        )
    return 0 if exact else 1
