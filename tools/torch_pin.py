"""A dynamic-metadata provider (scikit-build-core's [[tool.dynamic-metadata]]): the wheel's
dependencies, with torch pinned to the minor version its reviva._C was built against.

reviva._C is compiled against one torch's C++ headers and links its libraries; torch's C++ ABI
changes between minor versions, so a wheel built against torch 2.11 must not be installed beside
torch 2.12 (the import would fail with undefined symbols, or worse). The build asks the same
interpreter python/CMakeLists.txt asks (with -E, so that pip's isolated build environment shows
the environment torch is installed in) for torch's version, and the wheel requires
`torch==X.Y.*`. An sdist has no build yet: it keeps the range and marks the field dynamic.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from typing import Any

# Without torch: what an sdist says (a wheel built from it pins its own torch).
TORCH_RANGE = "torch>=2.4"
OTHERS = ["numpy"]

_state = "metadata_wheel"


def build_state(state: str) -> None:
    global _state
    _state = state


def dynamic_wheel(settings: Mapping[str, Any]) -> dict[str, bool]:
    return {"dependencies": True}


def installed_torch() -> str:
    """X.Y of the torch the build compiles against; a clear error when there is none."""
    for flags in (["-E"], []):
        r = subprocess.run(
            [sys.executable, *flags, "-c", "import torch; print(torch.__version__)"],
            capture_output=True,
            text=True,
        )
        if r.returncode == 0:
            major, minor = r.stdout.strip().split("+")[0].split(".")[:2]
            return f"{major}.{minor}"
    raise RuntimeError(
        f"reviva: torch is not importable by {sys.executable}: install torch first (reviva._C "
        "builds against the installed torch, and the wheel requires that torch's minor version)"
    )


def dynamic_metadata(settings: Mapping[str, Any], project: Mapping[str, Any]) -> dict[str, Any]:
    if _state == "sdist":
        return {"dependencies": [TORCH_RANGE, *OTHERS]}
    return {"dependencies": [f"torch=={installed_torch()}.*", *OTHERS]}
