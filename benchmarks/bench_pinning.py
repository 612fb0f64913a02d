"""Pinning host memory while the GPU computes: what it costs the computation, and which way of
pinning costs least (where the first generate call's extra time goes, issue 12).

A generate call whose layers stream needs their host copies pinned; the first call of a process
pins them (later calls find them in the pool). Measured here, each against a loop of bf16 GEMMs
(8192^3) enqueued by the main thread, timed on the device and on the host:
    alone              the GEMM loop by itself
    hostalloc_thread   another thread pins with cudaHostAlloc (Reviva's pool.reserve) meanwhile
    populate_thread    another thread maps anonymous memory (transparent huge pages) and touches
                       every page: no CUDA call
    register_thread    another thread cudaHostRegisters that populated memory meanwhile
And whether each CUDA pinning call waits for the device: it is timed on an idle device and
behind a 0.5 s kernel (torch.cuda._sleep).

    python benchmarks/bench_pinning.py [--gb 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_result  # noqa: E402

import reviva  # noqa: E402

MiB = 1 << 20


def gemm_loop(a: torch.Tensor, iters: int) -> dict[str, float]:
    """Enqueues `iters` GEMMs; device ms per GEMM (events) and the host's enqueue time."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    start.record()
    for _ in range(iters):
        torch.mm(a, a)
    end.record()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return {"device_ms_per_gemm": start.elapsed_time(end) / iters, "host_enqueue_s": host}


def populate(nbytes: int) -> mmap.mmap:
    """Anonymous memory backed by huge pages where the kernel gives them, every page touched."""
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mm.madvise(mmap.MADV_HUGEPAGE)
    t = torch.frombuffer(mm, dtype=torch.uint8)
    t[::4096].fill_(1)
    del t
    return mm


def address(mm: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(mm))


def register(mm: mmap.mmap) -> None:
    rc = torch.cuda.cudart().cudaHostRegister(address(mm), len(mm), 0)
    if int(rc) != 0:
        raise RuntimeError(f"cudaHostRegister failed: {rc}")


def unregister(mm: mmap.mmap) -> None:
    torch.cuda.cudart().cudaHostUnregister(address(mm))


def while_gemms(a: torch.Tensor, iters: int, work: Any) -> dict[str, Any]:
    """Runs `work` on another thread while the GEMM loop runs; its duration and the loop's."""
    done: dict[str, Any] = {}

    def run() -> None:
        t = time.perf_counter()
        try:
            done["result"] = work()
        except Exception as e:  # recorded
            done["error"] = f"{type(e).__name__}: {e}"
        done["work_s"] = time.perf_counter() - t

    th = threading.Thread(target=run)
    th.start()
    loop = gemm_loop(a, iters)
    th.join()
    return {**loop, "work_s": done.get("work_s"), "error": done.get("error")}


def waits_for_device(work: Any) -> dict[str, float]:
    """The call's time on an idle device, and behind a ~0.5 s kernel."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    work()
    idle = time.perf_counter() - t
    torch.cuda._sleep(int(0.5 * 1.98e9))
    t = time.perf_counter()
    work()
    busy = time.perf_counter() - t
    torch.cuda.synchronize()
    return {"idle_s": idle, "behind_kernel_s": busy}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gb", type=float, default=2.0, help="bytes pinned in each test")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    nbytes = int(args.gb * 2**30) // (256 * MiB) * (256 * MiB)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    gemm_loop(a, 20)  # warm-up
    per = gemm_loop(a, 50)["device_ms_per_gemm"]
    # Enough GEMMs to outlast the pinning (~0.35 ms per MB measured before): the loop's time is
    # then the computation's, with or without the other thread.
    iters = max(200, int(nbytes / MiB * 0.5 / per))
    rows: dict[str, Any] = {"gemm_iters": iters, "bytes": nbytes}
    rows["alone"] = gemm_loop(a, iters)

    rt = reviva.Runtime("cuda")
    pool = reviva.PinnedHostPool(rt)
    rows["hostalloc_thread"] = while_gemms(
        a, iters, lambda: pool.reserve(nbytes // (256 * MiB), 256 * MiB)
    )
    pool.release_cached()
    rows["populate_thread"] = while_gemms(a, iters, lambda: rows.setdefault("mm", populate(nbytes)))
    mm = rows.pop("mm")
    rows["register_thread"] = while_gemms(a, iters, lambda: register(mm))
    unregister(mm)
    mm.close()

    small = 64 * MiB
    pool2 = reviva.PinnedHostPool(rt)

    def hostalloc_small() -> None:
        pool2.reserve(1, small)
        pool2.release_cached()

    rows["hostalloc_waits_for_device"] = waits_for_device(hostalloc_small)
    mm2 = populate(small)

    def register_small() -> None:
        register(mm2)
        unregister(mm2)

    rows["register_waits_for_device"] = waits_for_device(register_small)
    mm2.close()

    base = rows["alone"]
    table = []
    for name in ("alone", "hostalloc_thread", "populate_thread", "register_thread"):
        r = rows[name]
        table.append(
            [
                name,
                f"{r['device_ms_per_gemm']:.3f}",
                f"{r['device_ms_per_gemm'] / base['device_ms_per_gemm']:.3f}",
                f"{r['host_enqueue_s']:.3f}",
                "-" if r.get("work_s") is None else f"{r['work_s']:.3f}",
                "-" if r.get("work_s") is None else f"{r['work_s'] * 1e3 / (nbytes / MiB):.3f}",
                r.get("error") or "",
            ]
        )
    print_table(
        ["case", "ms/gemm", "vs alone", "host enqueue s", "pin s", "pin ms/MB", "error"], table
    )
    for k in ("hostalloc_waits_for_device", "register_waits_for_device"):
        print(k, json.dumps(rows[k]))
    path = write_result("pinning", {"results": rows}, Path(args.out) if args.out else None)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
