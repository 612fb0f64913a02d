"""A call's K/V saved to a file and continued from in another process (Note [Saved caches]):
save() writes a returned cache (Note [A returned cache] in cache/returned.py) with the model's
fingerprint and the tokens it holds; load() reads one back as a SavedCache, which
RevivaManager.generate continues from as from the returned cache itself.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from reviva._C import DiskFile, RevivaDiskError, crc32c

# Note [Saved caches]
# A saved cache is one file: a preamble (MAGIC, the format's VERSION, the header's length and
# CRC-32C), the header (JSON: the model's fingerprint, the tokens, and per section its dtype,
# shape, offset and the CRC-32C of each of its blocks), then the sections, each at a multiple of
# BLOCK_BYTES: the token ids [batch, tokens] (int64), then each layer's K and V as the returned
# cache parked them ([batch, kv_heads, tokens, D]: bf16/fp16/fp32 values, or fp8 rows). The
# sections go through the core's DiskFile: O_DIRECT where the file system takes it, several
# blocks in flight, each block's checksum kept in the header and checked on every read. The file
# is written under a temporary name in its folder and renamed once whole and synced, so a crash
# leaves no partial file under the name.
# Loading checks, before any section is read: the preamble and the header's checksum (a damaged
# or foreign file), the file's size against the sections (a truncated one); then each block's
# checksum as it is read. A call continuing from the loaded cache checks the model (class,
# dtype, config, a sample of the weights: Fingerprint) and that its prompt starts with the
# tokens the cache holds; each difference is refused by name. The call then reads the layers one
# at a time (SavedLayers), each into new pinned host memory (where CUDA is there; straight from
# the disk where that memory is aligned, else through the DiskFile's staging blocks), and writes
# it into its own tiers as it does a returned cache's layers before dropping it: the whole cache
# is never held twice, nor copied through pageable memory. A damaged section raises then, naming
# it, and the call gives back what it took as after any failure. The file stays open while the
# SavedCache lives, so it can be continued from any number of times.

MAGIC = b"REVIVAKV"
VERSION = 1
BLOCK_BYTES = 1 << 20
ALIGNMENT = 4096  # O_DIRECT's (kDiskAlignment in the core)
PREAMBLE = struct.Struct("<8sIQI")  # magic, version, header bytes, header CRC-32C
# config keys that say how a model was saved or run, not what it computes
VOLATILE_CONFIG = ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache")
SAMPLED_ELEMENTS = 4096  # of each of three parameters (Fingerprint.of)


class SavedCacheError(ValueError):
    """A saved cache that cannot be used: not one, damaged, truncated, or saved from another
    model or for other tokens than the call's. The message names the file and what differs."""


@dataclass(frozen=True)
class Fingerprint:
    """What a saved cache's K/V depends on beside its tokens: the model's class, parameter
    dtype, config, and a hash of a sample of its weights (the first SAMPLED_ELEMENTS elements of
    the first, middle and last parameters: two checkpoints of one config differ there)."""

    model_class: str
    dtype: str
    config: dict[str, Any]
    weights: str

    @staticmethod
    def of(model: torch.nn.Module) -> Fingerprint:
        config = {
            k: v
            for k, v in model.config.to_dict().items()
            if k not in VOLATILE_CONFIG and not k.startswith("_")
        }
        params = [p for _, p in model.named_parameters()]
        digest = hashlib.sha256()
        for p in (params[0], params[len(params) // 2], params[-1]):
            sample = p.detach().reshape(-1)[:SAMPLED_ELEMENTS].to("cpu").contiguous()
            digest.update(str((p.dtype, tuple(p.shape))).encode())
            digest.update(sample.view(torch.uint8).numpy().tobytes())
        return Fingerprint(
            type(model).__name__,
            str(params[0].dtype),
            json.loads(json.dumps(config, sort_keys=True, default=str)),
            digest.hexdigest(),
        )

    def refuse_other(self, model: torch.nn.Module, path: str) -> None:
        """SavedCacheError naming what differs, when `model` is not the one saved (self)."""
        diff = self.differences(Fingerprint.of(model))
        if diff:
            raise SavedCacheError(
                f"the cache in {path} was saved from another model: " + "; ".join(diff)
            )

    def differences(self, other: Fingerprint) -> list[str]:
        """What differs, named ("config num_hidden_layers: 4 saved, 2 now"), saved = self."""
        out = []
        if self.model_class != other.model_class:
            out.append(f"model class: {self.model_class} saved, {other.model_class} now")
        if self.dtype != other.dtype:
            out.append(f"parameter dtype: {self.dtype} saved, {other.dtype} now")
        for k in sorted(set(self.config) | set(other.config)):
            a, b = self.config.get(k, "(unset)"), other.config.get(k, "(unset)")
            if a != b:
                out.append(f"config {k}: {a!r} saved, {b!r} now")
        if not out and self.weights != other.weights:
            out.append("weights: a sample of them differs (another checkpoint of this config)")
        return out


class SavedLayers(Sequence[tuple[torch.Tensor, torch.Tensor]]):
    """A saved cache's layers, read from its file when asked for: layers[i] is layer i's
    (K, V) as a returned cache parks them, in new pinned host memory (where CUDA is there) that
    the caller drops once it has written them into its tiers; each block's checksum is checked
    as it is read (SavedCacheError naming the section)."""

    def __init__(self, path: str, file: DiskFile, start: int, sections: list[dict[str, Any]]):
        self.path, self.file, self.start, self.sections = path, file, start, sections

    def __len__(self) -> int:
        return len(self.sections) // 2

    def shape(self, i: int) -> tuple[int, ...]:
        """Layer i's K shape, without reading it."""
        return tuple(self.sections[2 * i]["shape"])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        if not -len(self) <= i < len(self):
            raise IndexError(f"layer {i} of a saved cache of {len(self)} layers")
        i %= len(self)
        k, v = (
            _read(self.path, self.file, self.start, s) for s in self.sections[2 * i : 2 * i + 2]
        )
        return k, v


def aligned_empty(shape: list[int], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """An uninitialized host tensor whose memory starts on a 4 KiB boundary, so that O_DIRECT
    reads land in it straight (torch's pinned and CPU allocations are not always aligned so:
    then every block went through the DiskFile's staging, a copy each, on the H100 machine)."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8, pin_memory=pin)
    skip = -raw.data_ptr() % ALIGNMENT
    return raw[skip : skip + nbytes].view(dtype).view(shape)


def _read(path: str, file: DiskFile, start: int, s: dict[str, Any]) -> torch.Tensor:
    t = aligned_empty(s["shape"], getattr(torch, s["dtype"]), torch.cuda.is_available())
    if s["bytes"]:
        try:
            file.read(
                t.view(-1).view(torch.uint8),
                start + s["offset"],
                [int(c, 16) for c in s["checksums"]],
            )
        except RevivaDiskError as e:
            raise SavedCacheError(f"{path}: section {s['name']} is damaged: {e}") from e
    return t


@dataclass
class SavedCache:
    """A saved cache opened (load): RevivaManager.generate(..., past_key_values=it) continues
    from it, reading each layer from the file as the call writes it into its own tiers."""

    path: str
    fingerprint: Fingerprint
    token_ids: torch.Tensor  # [batch, tokens] int64: the tokens whose K/V it holds
    parked: SavedLayers
    fp8: bool

    @property
    def parked_length(self) -> int:
        return int(self.token_ids.shape[1])

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.parked_length

    def check(self, model: torch.nn.Module, input_ids: torch.Tensor | None) -> None:
        """Refuses, by name, a model other than the one the cache was saved from, and a prompt
        that does not start with the cache's tokens."""
        self.fingerprint.refuse_other(model, self.path)
        if input_ids is None:
            raise SavedCacheError(
                f"a call continuing from the cache in {self.path} needs token ids (the cache "
                "checks that the prompt starts with the tokens it holds)"
            )
        n = self.parked_length
        head = input_ids[:, :n].to("cpu")
        if head.shape != self.token_ids.shape or not torch.equal(head, self.token_ids):
            where = "its length" if head.shape[1] < n else "its rows"
            if head.shape == self.token_ids.shape:
                bad = (head != self.token_ids).nonzero()[0].tolist()
                where = f"row {bad[0]}, position {bad[1]}"
            raise SavedCacheError(
                f"the prompt does not start with the {n} tokens (x {self.token_ids.shape[0]} "
                f"rows) the cache in {self.path} holds: they differ at {where}"
            )


def _sections(token_ids: torch.Tensor, parked: list[tuple[torch.Tensor, torch.Tensor]]) -> list:
    tensors = [("tokens", token_ids)]
    for i, (k, v) in enumerate(parked):
        tensors += [(f"layer{i}.k", k), (f"layer{i}.v", v)]
    return tensors


def _as_tensor(data: bytes) -> torch.Tensor:
    """Bytes as a uint8 tensor (what the binding's crc32c and DiskFile take)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _round(n: int) -> int:
    return -(-n // BLOCK_BYTES) * BLOCK_BYTES


def save(
    model: torch.nn.Module,
    parked: list[tuple[torch.Tensor, torch.Tensor]],
    fp8: bool,
    token_ids: torch.Tensor,
    path: str | os.PathLike[str],
    overwrite: bool = False,
) -> int:
    """Note [Saved caches]: writes `parked` (a returned cache's K/V) and the tokens it holds to
    `path`; returns the file's size. Refuses an existing file unless `overwrite`."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"save_cache: {path} exists (overwrite=True replaces it)")
    token_ids = token_ids.detach().to("cpu", torch.int64).contiguous()
    sections, offset = [], 0
    for name, t in _sections(token_ids, parked):
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"save_cache: section {name} is not a contiguous host tensor")
        nbytes = t.numel() * t.element_size()
        blocks = -(-nbytes // BLOCK_BYTES)
        sections.append(
            {
                "name": name,
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
                "offset": offset,
                "bytes": nbytes,
                "checksums": ["00000000"] * blocks,
            }
        )
        offset += _round(nbytes)
    fp = Fingerprint.of(model)
    header = {
        "format": "reviva-kv",
        "version": VERSION,
        "block_bytes": BLOCK_BYTES,
        "fp8": fp8,
        "model": {
            "class": fp.model_class,
            "dtype": fp.dtype,
            "config": fp.config,
            "weights": fp.weights,
        },
        "sections": sections,
    }
    # (the checksums are fixed-width hex: the header's size is known before they are)
    data_start = _round(PREAMBLE.size + len(json.dumps(header).encode()))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        f = DiskFile(str(tmp), "create", block_bytes=BLOCK_BYTES)
        f.reserve(data_start + offset)
        for s, (_, t) in zip(sections, _sections(token_ids, parked), strict=True):
            flat = t.view(-1).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)
            s["checksums"] = [f"{c:08x}" for c in f.write(flat, data_start + s["offset"])]
        text = json.dumps(header).encode()
        head = torch.zeros(data_start, dtype=torch.uint8)
        head[: PREAMBLE.size] = _as_tensor(
            PREAMBLE.pack(MAGIC, VERSION, len(text), crc32c(_as_tensor(text)))
        )
        head[PREAMBLE.size : PREAMBLE.size + len(text)] = _as_tensor(text)
        f.write(head, 0)
        f.sync()
        del f
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return data_start + offset


def load(path: str | os.PathLike[str], model: torch.nn.Module | None = None) -> SavedCache:
    """Note [Saved caches]: the cache saved in `path`, opened: its header and tokens read and
    checked, its layers read when a call continuing from it writes them. With `model`, refuses
    at once a model other than the one it was saved from."""
    path = str(path)
    size = os.path.getsize(path)
    with open(path, "rb") as raw:
        pre = raw.read(PREAMBLE.size)
        if len(pre) < PREAMBLE.size or pre[:8] != MAGIC:
            raise SavedCacheError(f"{path} is not a saved Reviva cache (no {MAGIC!r} at its start)")
        _, version, nbytes, crc = PREAMBLE.unpack(pre)
        if version != VERSION:
            raise SavedCacheError(
                f"{path} is a saved cache of format {version}; this Reviva reads format {VERSION}"
            )
        text = raw.read(nbytes) if nbytes <= size else b""
    if len(text) != nbytes or crc32c(_as_tensor(text)) != crc:
        raise SavedCacheError(f"{path}: its header is damaged or cut short (checksum)")
    header = json.loads(text)
    data_start = _round(PREAMBLE.size + nbytes)
    sections = header["sections"]
    need = data_start + max((s["offset"] + s["bytes"] for s in sections), default=0)
    if size < need:
        raise SavedCacheError(f"{path} is truncated: {size} bytes of the {need} its header lists")
    m = header["model"]
    fp = Fingerprint(m["class"], m["dtype"], m["config"], m["weights"])
    if model is not None:
        fp.refuse_other(model, path)
    f = DiskFile(path, "read", block_bytes=header["block_bytes"])
    tokens = _read(path, f, data_start, sections[0])
    return SavedCache(
        path, fp, tokens, SavedLayers(path, f, data_start, sections[1:]), bool(header["fp8"])
    )
