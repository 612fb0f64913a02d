"""Card mode: run a contender the way a user with an N GB card runs it (DESIGN.md, "Measuring as a
user runs it"), and the measurements every card-mode benchmark takes around a call.

- `CardBallast`: device memory of (device total - N) taken with cudaMalloc outside torch's
  allocator (ctypes on the CUDA runtime library torch loaded; cupy as a fallback), so that the
  CUDA context, torch's cache and Reviva's own device memory must all fit in N.
- `CardSampler`: a thread polling the device's free memory (torch.cuda.mem_get_info) every ~2 ms
  during a call; its minimum counts memory allocated outside torch's allocator too.
- `CallTimer`: a generate streamer giving prefill (time to the first new token) and decode rate,
  as reviva.cli.timing.GenerationTimer does.
- `child_environment()`: the environment of a fresh worker: torch's allocator at its defaults.
- `prepare_device()`: what a worker does first (the ballast, or nothing without a card, or a
  stand-in probe on the CPU), and `WorkerRun`: the driver's side of a worker (protocol lines
  `TAG {json}` as they arrive, a deadline, a clean exit or not).

Nothing here imports reviva: the benchmarks use its public API only, and this module serves
contenders without Reviva alike.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import json
import os
import queue
import subprocess
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

# Every name torch has read its allocator settings from (the CUDA one, the newer generic one).
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
_MiB = 1 << 20
_BALLAST_CHUNK = 8 << 30  # cudaMalloc pieces: one failing piece leaves the others' record


def child_environment() -> tuple[dict[str, str], dict[str, str]]:
    """The environment for a card-mode worker, and the allocator settings removed from it."""
    env = dict(os.environ)
    removed = {k: env.pop(k) for k in ALLOC_CONF_VARS if k in env}
    return env, removed


def worker_result(cmd: list[str], name: str, timeout_s: float) -> dict[str, Any]:
    """Runs a card-mode worker process (child_environment) and returns what it printed on its
    `RESULT ` line (JSON), or an error with the output's tail. A worker past `timeout_s` raises
    subprocess.TimeoutExpired."""
    env, _ = child_environment()
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    for line in run.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {
        "error": f"worker {name} exited {run.returncode}",
        "tail": (run.stdout + run.stderr)[-4000:],
    }


def rss_bytes() -> int:
    """Resident set size of this process (/proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def host_total_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def error_fields(exc: BaseException) -> dict[str, Any]:
    """What a failed call records: type, first line of the message, whether it is an
    out-of-memory (torch's, Reviva's, the host's, or a CUDA error saying so), the traceback."""
    text = str(exc)
    name = type(exc).__name__
    oom = (
        isinstance(exc, MemoryError)
        or "OutOfMemory" in name
        or "out of memory" in text.lower()
        or "cudaErrorMemoryAllocation" in text
    )
    return {
        "error_type": name,
        "error": f"{name}: {text.splitlines()[0] if text else ''}"[:500],
        "error_full": text[:3000],
        "oom": bool(oom),
        "traceback": traceback.format_exc()[-3000:],
    }


# --- the CUDA runtime through ctypes --------------------------------------------------------------


def find_cudart() -> tuple[str | None, str]:
    """The CUDA runtime library to call: the one already loaded in this process (torch's, so the
    ballast lives in the same primary context), else torch's nvidia package, else the system's."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if "/" in line else ""
                if os.path.basename(path).startswith("libcudart.so"):
                    return path, "loaded in this process (/proc/self/maps)"
    except OSError:
        pass
    try:
        import nvidia  # torch's CUDA wheels (nvidia-cuda-runtime)

        for base in nvidia.__path__:
            found = sorted(glob.glob(os.path.join(base, "**", "libcudart.so*"), recursive=True))
            if found:
                return found[-1], "torch's nvidia package"
    except ImportError:
        pass
    name = ctypes.util.find_library("cudart")
    return (name, "ctypes.util.find_library") if name else (None, "not found")


class CudaRuntime:
    """The few CUDA runtime calls the ballast needs, with their C signatures."""

    def __init__(self, path: str) -> None:
        self.path = path
        lib = ctypes.CDLL(path)
        lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        lib.cudaMalloc.restype = ctypes.c_int
        lib.cudaFree.argtypes = [ctypes.c_void_p]
        lib.cudaFree.restype = ctypes.c_int
        lib.cudaMemGetInfo.argtypes = [ctypes.POINTER(ctypes.c_size_t)] * 2
        lib.cudaMemGetInfo.restype = ctypes.c_int
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetLastError.argtypes = []
        lib.cudaGetLastError.restype = ctypes.c_int
        lib.cudaGetDeviceCount.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.cudaGetDeviceCount.restype = ctypes.c_int
        lib.cudaSetDevice.argtypes = [ctypes.c_int]
        lib.cudaSetDevice.restype = ctypes.c_int
        self.lib = lib

    def error(self, code: int) -> str:
        return f"{code} ({self.lib.cudaGetErrorString(code).decode(errors='replace')})"

    def device_count(self) -> tuple[int, int]:
        n = ctypes.c_int(0)
        return self.lib.cudaGetDeviceCount(ctypes.byref(n)), n.value

    def mem_get_info(self) -> tuple[int, int]:
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        rc = self.lib.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total))
        if rc != 0:
            raise RuntimeError(f"cudaMemGetInfo failed: {self.error(rc)}")
        return free.value, total.value

    def malloc(self, nbytes: int) -> int:
        ptr = ctypes.c_void_p(0)
        rc = self.lib.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes))
        if rc != 0:
            self.lib.cudaGetLastError()  # not sticky, but torch must not find it pending
            raise RuntimeError(f"cudaMalloc({nbytes}) failed: {self.error(rc)}")
        return int(ptr.value)

    def free(self, ptr: int) -> int:
        return self.lib.cudaFree(ctypes.c_void_p(ptr))


def probe_cudart() -> dict[str, Any]:
    """Finds and loads the runtime and asks it for the device count: on a machine without a GPU
    (dry runs) this exercises the library lookup and the ctypes signatures."""
    path, how = find_cudart()
    out: dict[str, Any] = {"library": path, "found_by": how}
    if path is None:
        return out
    try:
        rt = CudaRuntime(path)
        rc, n = rt.device_count()
        out["cudaGetDeviceCount"] = {"rc": rt.error(rc), "devices": n}
    except (OSError, AttributeError) as e:
        out["load_error"] = f"{type(e).__name__}: {e}"
    return out


class CardBallast:
    """(device total - card) bytes of device memory held outside torch's allocator until free().

    Call after `torch.cuda.init()` and before anything else uses the device, so that the CUDA
    context, cuBLAS workspaces, torch's cache and Reviva's arena all count against the card."""

    def __init__(self, device: int = 0) -> None:
        self.device = device
        self._ptrs: list[int] = []
        self._free: Callable[[int], Any] | None = None
        self.record: dict[str, Any] = {}

    def allocate(self, card_bytes: int) -> dict[str, Any]:
        rec: dict[str, Any] = {"card_bytes": card_bytes, "attempts": []}
        self.record = rec
        path, how = find_cudart()
        if path is not None:
            try:
                rt = CudaRuntime(path)
                rc = rt.lib.cudaSetDevice(self.device)
                if rc != 0:
                    raise RuntimeError(f"cudaSetDevice({self.device}) failed: {rt.error(rc)}")
                self._fill(rt.malloc, rt.free, rt.mem_get_info, card_bytes, rec)
                rec.update(method="ctypes cudaMalloc", library=path, library_found_by=how)
                return rec
            except (OSError, AttributeError, RuntimeError) as e:
                rec["attempts"].append(f"libcudart {path}: {type(e).__name__}: {e}")
                self._release()
        try:
            import cupy  # the fallback the design allows

            runtime = cupy.cuda.runtime
            runtime.setDevice(self.device)

            def info() -> tuple[int, int]:
                free, total = runtime.memGetInfo()
                return int(free), int(total)

            self._fill(runtime.malloc, runtime.free, info, card_bytes, rec)
            rec.update(method="cupy.cuda.runtime.malloc", library=f"cupy {cupy.__version__}")
            return rec
        except Exception as e:  # noqa: BLE001 (no ballast at all is reported below)
            rec["attempts"].append(f"cupy: {type(e).__name__}: {e}")
            self._release()
        raise RuntimeError("no ballast could be allocated: " + "; ".join(rec["attempts"]))

    def _fill(
        self,
        malloc: Callable[[int], int],
        free: Callable[[int], Any],
        info: Callable[[], tuple[int, int]],
        card_bytes: int,
        rec: dict[str, Any],
    ) -> None:
        self._free = free
        free_before, total = info()
        target = total - card_bytes
        rec.update(device_total_bytes=total, free_before_bytes=free_before, target_bytes=target)
        if target <= 0:
            raise ValueError(f"a card of {card_bytes} bytes is not smaller than the device {total}")
        done = 0
        while done < target:
            piece = min(_BALLAST_CHUNK, target - done)
            self._ptrs.append(malloc(piece))
            done += piece
        rec["ballast_bytes"] = done
        rec["ballast_pieces"] = len(self._ptrs)
        free_after, total_after = info()
        rec.update(free_after_bytes=free_after, total_after_bytes=total_after)

    def _release(self) -> None:
        if self._free is not None:
            for p in self._ptrs:
                self._free(p)
        self._ptrs.clear()

    def free(self) -> None:
        self._release()


# --- around a call --------------------------------------------------------------------------------


class CardSampler:
    """Polls `probe() -> (free, total)` every `interval_s` in a thread between enter and exit;
    `min_free` is the least free memory seen (one sample at enter and one at exit included).
    The thread needs the GIL between samples, so while the caller runs Python the achieved
    interval can stretch to the interpreter's switch interval (5 ms); it is recorded."""

    def __init__(self, probe: Callable[[], tuple[int, int]], interval_s: float = 0.002) -> None:
        self.probe = probe
        self.interval_s = interval_s
        self.min_free: int | None = None
        self.samples = 0
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self.duration_s = 0.0
        self.max_gap_s = 0.0
        self._last = 0.0

    def _sample(self) -> None:
        if self.error is not None:
            return
        try:
            free, _ = self.probe()
        except Exception as e:  # noqa: BLE001 (a sticky device error ends sampling, not the call)
            self.error = f"{type(e).__name__}: {e}"[:300]
            return
        now = time.perf_counter()
        if self.samples:
            self.max_gap_s = max(self.max_gap_s, now - self._last)
        self._last = now
        self.samples += 1
        self.min_free = free if self.min_free is None else min(self.min_free, free)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> CardSampler:
        self._t0 = time.perf_counter()
        self._sample()
        if self.interval_s > 0:
            self._thread = threading.Thread(target=self._run, name="card-sampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
        self.duration_s = time.perf_counter() - self._t0

    def summary(self) -> dict[str, Any]:
        return {
            "interval_ms_asked": self.interval_s * 1e3,
            "samples": self.samples,
            "mean_interval_ms": self.duration_s / max(self.samples - 1, 1) * 1e3,
            "max_gap_ms": self.max_gap_s * 1e3,
            "error": self.error,
        }


def _base_streamer() -> type:
    from transformers.generation.streamers import BaseStreamer

    return BaseStreamer


class CallTimer(_base_streamer()):  # type: ignore[misc]
    """A generate streamer recording when the prompt and each new token arrive: prefill is the
    time from begin() to the first new token, decode rate the tokens after it over the time
    after it. `sync` (the compute stream's synchronize; not the device's, which would also wait
    for copies running ahead of compute) runs at begin() and end() only: generate hands put()
    tokens already on the host (HF's loop waits for their copy, at once or, where it decides its
    stop a step late, a step later), so a wait in put() would only wait for the step queued
    after the token, making the host wait each step as no user's streamer does. In a call that
    streams a step late (reviva's on CUDA: the first and last tokens when they exist, those
    between a step late) the rate over the call is exact, a token's own time is not."""

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self.sync = sync or (lambda: None)
        self.start: float | None = None
        self.token_times: list[float] = []
        self._prompt_seen = False

    def begin(self) -> None:
        self.sync()
        self.start = time.perf_counter()
        self.token_times = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        now = time.perf_counter()
        if self._prompt_seen:  # generate puts the prompt first, then each new token
            self.token_times.append(now)
        self._prompt_seen = True

    def end(self) -> None:
        self.sync()

    @property
    def prefill_s(self) -> float | None:
        if self.start is None or not self.token_times:
            return None
        return self.token_times[0] - self.start

    @property
    def decode_tok_s(self) -> float | None:
        if len(self.token_times) < 2:
            return None
        return (len(self.token_times) - 1) / (self.token_times[-1] - self.token_times[0])

    @property
    def new_tokens(self) -> int:
        return len(self.token_times)


def safe(fn: Callable[[], Any]) -> Any:
    """fn(), or None when it raises (a device left in a sticky error state must not turn the
    record of a failed call into a crash)."""
    try:
        return fn()
    except Exception:  # noqa: BLE001
        return None


def gb(x: int | float | None) -> float | None:
    return None if x is None else x / 1e9


# --- a worker and its driver ----------------------------------------------------------------------


def emit(tag: str, obj: Any) -> None:
    """A protocol line for the driver: `TAG {json}`."""
    print(f"{tag} {json.dumps(obj, default=str)}", flush=True)


def say(msg: str) -> None:
    print(msg, flush=True)


def prepare_device(
    card_bytes: int | None, cuda: bool
) -> tuple[dict[str, Any], CardBallast | None, Callable[[], tuple[int, int]], int]:
    """A worker's first step: with a card, the ballast (after torch.cuda.init(), before anything
    else touches the device); returns what it did (with "error" when the ballast failed: the
    worker must not run without the card it was given), the ballast to free at the end, the probe
    of (free, total) that CardSampler polls, and the bytes the peak is counted against (the card,
    else the device). Without a device (dry runs) the probe is the host's memory less this
    process's RSS, so a "card peak" there is the peak RSS."""
    info: dict[str, Any] = {}
    if not cuda:
        total = host_total_bytes()
        info["ballast"] = (
            {"skipped": "dry run: no device", "cudart_probe": probe_cudart()}
            if card_bytes
            else None
        )
        info["probe"] = "dry run: host memory - RSS (no device to poll)"

        def host_probe() -> tuple[int, int]:
            return total - rss_bytes(), total

        return info, None, host_probe, total
    import torch

    torch.cuda.init()
    ballast = None
    if card_bytes:
        ballast = CardBallast(0)
        try:
            info["ballast"] = ballast.allocate(card_bytes)
        except Exception as e:  # noqa: BLE001 (reported; the caller stops)
            info["ballast"] = {**ballast.record, "error": f"{type(e).__name__}: {e}"}
            info["error"] = {"error": f"no ballast: {e}"}
            return info, None, torch.cuda.mem_get_info, card_bytes
    free, total = torch.cuda.mem_get_info()
    info.update(free_after_ballast_bytes=free, device_total_bytes=total)
    info["probe"] = "torch.cuda.mem_get_info"
    taken = info["ballast"]["ballast_bytes"] if card_bytes else 0
    say(f"# device: {total / 1e9:.2f} GB, {free / 1e9:.2f} GB free, ballast {taken / 1e9:.2f} GB")
    return info, ballast, torch.cuda.mem_get_info, card_bytes or total


class WorkerRun:
    """One worker process: its protocol lines (`TAG {json}`, tags in `tags`) handed over as they
    arrive; killed at `deadline` (time.perf_counter) or `done_grace_s` after its DONE line if it
    has not exited by then."""

    def __init__(
        self, cmd: list[str], env: dict[str, str], tags: tuple[str, ...], done_grace_s: float = 60
    ) -> None:
        self.cmd = cmd
        self.tags = tags
        self.done_grace_s = done_grace_s
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.tail: list[str] = []
        self.returncode: int | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def follow(self, deadline: float | None, on_line: Callable[[str, Any], None]) -> str:
        """Calls on_line(tag, obj) per protocol line and on_line("TEXT", line) otherwise, until
        the worker's output ends; returns what became of the worker."""
        done_at: float | None = None
        status: str | None = None
        while True:
            now = time.perf_counter()
            if self.proc.poll() is None:
                if deadline is not None and now >= deadline:
                    self.proc.kill()
                    status = "killed at --max-wall-s"
                elif done_at is not None and now - done_at > self.done_grace_s:
                    self.proc.kill()
                    status = f"did not exit within {self.done_grace_s:.0f} s of its DONE: killed"
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                break
            text = line.rstrip("\n")
            self.tail = (self.tail + [text])[-150:]
            tag, _, rest = text.partition(" ")
            if tag in self.tags:
                try:
                    obj = json.loads(rest)
                except json.JSONDecodeError:
                    on_line("TEXT", text)
                    continue
                if tag == "DONE":
                    done_at = time.perf_counter()
                on_line(tag, obj)
            else:
                on_line("TEXT", text)
        self.returncode = self.proc.wait()
        if status is None:
            if done_at is not None:
                status = (
                    "clean exit" if self.returncode == 0 else f"exit {self.returncode} after DONE"
                )
            else:
                status = f"died before its DONE (exit {self.returncode})"
        return status
