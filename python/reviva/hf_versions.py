"""The transformers releases Reviva is tested with, refused outside them, and the one interface
that differs between them: the name under which HF hands a model and its decoder layers the cache.

Note [Tested transformers]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Reviva puts its own forwards in place of a model's decoder layers, final norm, embedding and
rotary module, and reads the arguments HF's generate and forwards pass them: an interface HF
changes between minor releases (transformers 5.25 renamed `past_key_values` to `cache` in every
model forward, decoder layer and generate's outputs, with the old name deprecated). A release that
nobody ran would fail mid-call, or worse, run silently differently. So the package declares the
releases it is tested with (pyproject's extras: TRANSFORMERS_REQUIREMENT, checked by
tests/python/test_versions.py), CI runs the suite on the lowest and a fast subset on the highest
(the newest on PyPI when the range was last raised), and anything outside the range is refused
by name where Reviva takes a model (`RevivaManager(...)`, `reviva.finetune`, `from_pretrained`,
`offload_activations`), not at its first forward. Raising the upper bound is a change with its
test run: scripts/test-newest.
"""

from __future__ import annotations

from typing import Any

# The lowest release CI runs the whole suite on (requirements-dev.txt pins it) and the first
# release not yet run; the highest release run is the newest below it.
TRANSFORMERS_LOWEST = "5.17.0"
TRANSFORMERS_FIRST_UNTESTED = "5.26"
TRANSFORMERS_REQUIREMENT = f"transformers>={TRANSFORMERS_LOWEST},<{TRANSFORMERS_FIRST_UNTESTED}"


def _release(version: str) -> tuple[int, ...]:
    """A release's numbers (5.25.0 -> (5, 25, 0); a pre-release 5.26.0rc1 -> (5, 26, 0))."""
    from packaging.version import Version  # (transformers' own dependency)

    return Version(version).release


def transformers_supported(version: str) -> bool:
    """Whether `version` is inside the tested range (Note [Tested transformers])."""
    return (
        _release(TRANSFORMERS_LOWEST) <= _release(version) < _release(TRANSFORMERS_FIRST_UNTESTED)
    )


def installed_transformers() -> str:
    """The transformers version this process imports."""
    import transformers

    return transformers.__version__


def check_transformers(who: str) -> None:
    """RuntimeError naming the installed transformers when it is outside the tested range."""
    version = installed_transformers()
    if not transformers_supported(version):
        raise RuntimeError(
            f"{who}: transformers {version} is installed, and Reviva is tested with "
            f"{TRANSFORMERS_REQUIREMENT.removeprefix('transformers')} (Reviva wraps the model's "
            "decoder layers and reads what HF passes them, which changes between releases); "
            f"install a tested one: pip install '{TRANSFORMERS_REQUIREMENT}'"
        )


def cache_argument() -> str:
    """The keyword under which this transformers passes the cache to a model's forward, its
    decoder layers and generate: `cache` from 5.25 on, `past_key_values` before."""
    from transformers.generation import utils as hf_generation

    names = getattr(hf_generation, "ALL_CACHE_NAMES", ["past_key_values"])
    return "cache" if "cache" in names else "past_key_values"


def layer_cache(kwargs: dict[str, Any]) -> Any:
    """The cache HF passed a forward (as `cache` or, before 5.25, `past_key_values`), or None."""
    cache = kwargs.get("cache")
    return cache if cache is not None else kwargs.get("past_key_values")


def pop_cache(kwargs: dict[str, Any], who: str) -> Any:
    """The cache a user passed to generate under either name, taken out of `kwargs`; both at
    once is refused as transformers refuses it."""
    new, old = kwargs.pop("cache", None), kwargs.pop("past_key_values", None)
    if new is not None and old is not None:
        raise ValueError(
            f"{who}: both cache and past_key_values were passed; pass the cache once "
            f"(as {cache_argument()})"
        )
    return new if new is not None else old
