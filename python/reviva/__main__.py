"""The `reviva` command line.

    python -m reviva demo [--device cuda|cpu] [--prompt N]
    python -m reviva transfers [--device cuda|cpu] [--mib N]

`demo` runs a long prompt through a random-init Llama-shaped model, with and without Reviva
(which streams half the layers' K/V from pinned host memory), and prints peak VRAM, prefill
time, decode rate, VRAM saved and overlap (see reviva/demo.py). `transfers` offloads a set of
random tensors to pinned host memory and brings them back through the TransferEngine, checks
every byte, and prints what moved and how fast. Both run on the GPU when there is one, else on
the host backend, and say which.
"""

from __future__ import annotations

import argparse
import sys
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
    d2h, h2d = engine.stats()["d2h"], engine.stats()["h2d"]
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
    return 0 if exact else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="reviva", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="a long prompt with and without Reviva, and a table")
    demo.add_argument("--device", default=None, help="cuda[:N] or cpu (default: cuda if present)")
    demo.add_argument("--prompt", type=int, default=None, help="prompt tokens (default by device)")
    tr = sub.add_parser("transfers", help="offload and restore tensors, check them, print figures")
    tr.add_argument("--device", default=None, help="cuda[:N] or cpu (default: cuda if present)")
    tr.add_argument("--mib", type=int, default=256, help="MiB of tensors to move (default 256)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from reviva.demo import run_demo

        return run_demo(args)
    if args.command == "transfers":
        return _transfers(args)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
