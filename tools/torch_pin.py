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

# The tested range (scripts/test runs the lowest, scripts/test-newest the highest): what an sdist
# says; a wheel built from it pins its own torch, which must be inside it.
TORCH_LOWEST = (2, 11)
TORCH_FIRST_UNTESTED = (2, 16)
TORCH_RANGE = "torch>=2.11,<2.16"
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
            version = r.stdout.strip()
            major, minor = version.split("+")[0].split(".")[:2]
            if not TORCH_LOWEST <= (int(major), int(minor)) < TORCH_FIRST_UNTESTED:
                raise RuntimeError(
                    f"reviva: torch {version} is installed, and Reviva is tested with "
                    f"{TORCH_RANGE}: install a tested torch first (pip install '{TORCH_RANGE}')"
                )
            return f"{major}.{minor}"
    raise RuntimeError(
        f"reviva: torch is not importable by {sys.executable}: install torch first (reviva._C "
        "builds against the installed torch, and the wheel requires that torch's minor version)"
    )


def dynamic_metadata(settings: Mapping[str, Any], project: Mapping[str, Any]) -> dict[str, Any]:
    if _state == "sdist":
        return {"dependencies": [TORCH_RANGE, *OTHERS]}
    return {"dependencies": [f"torch=={installed_torch()}.*", *OTHERS]}
