"""Note [Saved caches] (reviva/cache/saved.py): a call's K/V saved to a file, loaded in another
process, continued from with the uninterrupted call's tokens; another model, another prompt, a
truncated or damaged file refused by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from test_generate import budget_for, tiny_model

import reviva
from reviva import RevivaConfig, RevivaManager
from reviva._C import DiskFile
from reviva.cache.saved import BLOCK_BYTES, PREAMBLE, SavedCacheError, aligned_empty

KW = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True)


def first_turn(family: str = "llama", **config: object):
    model = tiny_model(family, seed=3)
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    manager = RevivaManager(model, RevivaConfig(**config))
    out = manager.generate(ids, **KW)
    more = torch.cat([out.sequences, ids[:, :9]], dim=1)
    return model, manager, out, more


@pytest.mark.parametrize(
    "family, fields",
    [("llama", {}), ("llama", {"kv_dtype": "fp8"}), ("mistral_sliding", {}), ("qwen3", {})],
)
def test_a_saved_cache_continues_as_the_returned_one(
    tmp_path: Path, family: str, fields: dict[str, object]
) -> None:
    """Saved, loaded, continued: the tokens and logits of continuing from the returned cache,
    which are plain HF's over the whole sequence (fp8: Reviva's own, the K/V rows as saved).
    Twice from one loaded cache (it is never written), and the file's sections checked."""
    model, manager, out, more = first_turn(family, **fields)
    path = tmp_path / "turn1.rkv"
    size = manager.save_cache(out, path)
    assert size == path.stat().st_size and size % BLOCK_BYTES == 0
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert not list(tmp_path.glob(".*.tmp"))  # (written under a temporary name, renamed)
    loaded = reviva.load_cache(path, model)
    # (opening reads the header and the tokens alone: the layers are read by the call)
    assert loaded.parked.file.counters()["bytes_read"] == loaded.token_ids.numel() * 8
    assert loaded.get_seq_length() == out.past_key_values.get_seq_length()
    assert torch.equal(loaded.token_ids, out.sequences[:, : loaded.parked_length])
    for (k, v), (k0, v0) in zip(loaded.parked, out.past_key_values.parked, strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0)
    kw = dict(KW, output_logits=True)
    want = manager.generate(more, past_key_values=out.past_key_values, **kw)
    for _ in range(2):
        got = manager.generate(more, past_key_values=loaded, **kw)
        assert torch.equal(got.sequences, want.sequences)
        for a, b in zip(got.logits, want.logits, strict=True):
            assert torch.equal(a, b)
    if not fields:
        plain = model.generate(more, max_new_tokens=6, do_sample=False)
        assert torch.equal(want.sequences, plain)
    # (a saved cache's own returned cache saves again: a chat's third turn)
    manager.save_cache(got, tmp_path / "turn2.rkv")
    assert reviva.load_cache(tmp_path / "turn2.rkv").parked_length == got.sequences.shape[1] - 1


SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    from test_generate import tiny_model
    import reviva
    model = tiny_model("llama", seed=3)
    loaded = reviva.load_cache({path!r})
    more = torch.load({more!r})
    out = reviva.RevivaManager(model).generate(
        more, past_key_values=loaded, max_new_tokens=6, do_sample=False,
        return_dict_in_generate=True)
    torch.save(out.sequences, {result!r})
    """
)


def test_a_new_process_continues_with_the_uninterrupted_calls_tokens(tmp_path: Path) -> None:
    """Save here, load and continue in a fresh interpreter: the tokens of one call over the
    whole sequence, uninterrupted, in this process."""
    model, manager, out, more = first_turn()
    manager.save_cache(out, tmp_path / "c.rkv")
    torch.save(more, tmp_path / "more.pt")
    script = SCRIPT.format(
        tests=str(Path(__file__).parent),
        path=str(tmp_path / "c.rkv"),
        more=str(tmp_path / "more.pt"),
        result=str(tmp_path / "seq.pt"),
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    uninterrupted = RevivaManager(model).generate(more, **KW).sequences
    assert torch.equal(torch.load(tmp_path / "seq.pt"), uninterrupted)


@pytest.mark.parametrize("saved_as, continued_as", [("auto", "fp8"), ("fp8", "auto")])
def test_a_cache_saved_in_one_kv_dtype_continues_in_the_other(
    tmp_path: Path, saved_as: str, continued_as: str
) -> None:
    """The K/V dtype is the continuing manager's: bf16 values are quantized into its fp8 rows, fp8
    rows dequantized into its values, as the returned cache itself is in that manager."""
    model, manager, out, more = first_turn(kv_dtype=saved_as)
    manager.save_cache(out, tmp_path / "c.rkv")
    other = RevivaManager(model, RevivaConfig(kv_dtype=continued_as))
    kw = dict(KW, output_logits=True)
    want = other.generate(more, past_key_values=out.past_key_values, **kw)
    got = other.generate(more, past_key_values=reviva.load_cache(tmp_path / "c.rkv"), **kw)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits, strict=True):
        assert torch.equal(a, b)


def test_layers_are_read_into_aligned_memory_straight_from_the_disk(tmp_path: Path) -> None:
    """A section's whole blocks land in its memory without the DiskFile's staging (aligned_empty:
    torch's allocations are not always 4 KiB-aligned); only a partial last block is staged."""
    for shape, dtype in (
        ([3, 1000, 129], torch.bfloat16),
        ([7], torch.int64),
        ([0, 4], torch.float32),
    ):
        t = aligned_empty(shape, dtype, pin=False)
        assert list(t.shape) == shape and t.dtype == dtype and t.data_ptr() % 4096 == 0
    data = torch.randint(0, 256, (3 * BLOCK_BYTES + 100,), dtype=torch.uint8)
    f = DiskFile(str(tmp_path / "x"), "create", block_bytes=BLOCK_BYTES)
    sums = f.write(data, 0)
    r = DiskFile(str(tmp_path / "x"), "read", block_bytes=BLOCK_BYTES)
    back = aligned_empty([data.numel()], torch.uint8, pin=False)
    r.read(back, 0, sums)
    assert torch.equal(back, data)
    if r.direct_io:
        assert r.counters()["staged_blocks"] == 1  # (the partial last block alone)


def test_another_model_or_prompt_is_refused_by_name(tmp_path: Path) -> None:
    model, manager, out, more = first_turn()
    path = tmp_path / "c.rkv"
    manager.save_cache(out, path)
    loaded = reviva.load_cache(path)
    # another config: the keys that differ, named
    other = tiny_model("qwen2", seed=3)
    with pytest.raises(SavedCacheError, match=r"model class: LlamaForCausalLM saved"):
        reviva.load_cache(path, other)
    # the same config, other weights
    reseeded = tiny_model("llama", seed=4)
    with pytest.raises(SavedCacheError, match="weights: a sample of them differs"):
        RevivaManager(reseeded).generate(more, past_key_values=loaded, **KW)
    # one token changed inside the cached part
    n = loaded.parked_length
    wrong = more.clone()
    wrong[1, n - 3] = (wrong[1, n - 3] + 1) % 128
    with pytest.raises(SavedCacheError, match=rf"differ at row 1, position {n - 3}"):
        manager.generate(wrong, past_key_values=loaded, **KW)
    with pytest.raises(SavedCacheError, match="differ at its rows"):
        manager.generate(more[:1], past_key_values=loaded, **KW)
    # (nothing the refusals did changed the loaded cache: it still continues)
    assert manager.generate(more, past_key_values=loaded, **KW).sequences.shape[1] > more.shape[1]
    with pytest.raises(FileExistsError, match="exists"):
        manager.save_cache(out, path)
    manager.save_cache(out, path, overwrite=True)
    with pytest.raises(ValueError, match="needs a cache a call returned"):
        manager.save_cache(more, tmp_path / "x.rkv")


def test_a_truncated_or_damaged_file_is_refused(tmp_path: Path) -> None:
    model, manager, out, more = first_turn()
    path = tmp_path / "c.rkv"
    manager.save_cache(out, path)
    data = path.read_bytes()
    _, _, header_bytes, _ = PREAMBLE.unpack(data[: PREAMBLE.size])
    header = json.loads(data[PREAMBLE.size : PREAMBLE.size + header_bytes])
    start = -(-(PREAMBLE.size + header_bytes) // BLOCK_BYTES) * BLOCK_BYTES
    sec = next(s for s in header["sections"] if s["name"] == "layer1.v")

    def variant(name: str, body: bytes) -> Path:
        p = tmp_path / name
        p.write_bytes(body)
        return p

    # a damaged layer is found when a call reads it: the call raises naming it, and the manager
    # goes on (the intact file continues)
    flipped = bytearray(data)
    flipped[start + sec["offset"] + 7] ^= 0x40
    damaged = reviva.load_cache(variant("flip.rkv", bytes(flipped)))
    with pytest.raises(SavedCacheError, match=r"section layer1.v is damaged: .*checksum 0x"):
        manager.generate(more, past_key_values=damaged, **KW)
    good = manager.generate(more, past_key_values=reviva.load_cache(path), **KW)
    assert torch.equal(
        good.sequences, manager.generate(more, past_key_values=out.past_key_values, **KW).sequences
    )
    cut = variant("cut.rkv", data[: start + sec["offset"] + 100])
    with pytest.raises(SavedCacheError, match=r"is truncated: \d+ bytes of the \d+"):
        reviva.load_cache(cut)
    tokens = next(s for s in header["sections"] if s["name"] == "tokens")
    flipped = bytearray(data)
    flipped[start + tokens["offset"] + 3] ^= 0x01
    with pytest.raises(SavedCacheError, match=r"section tokens is damaged: .*checksum 0x"):
        reviva.load_cache(variant("flip-tokens.rkv", bytes(flipped)))
    head = bytearray(data)
    head[PREAMBLE.size + 20] ^= 0x01
    with pytest.raises(SavedCacheError, match="its header is damaged"):
        reviva.load_cache(variant("head.rkv", bytes(head)))
    with pytest.raises(SavedCacheError, match="is not a saved Reviva cache"):
        reviva.load_cache(variant("other.bin", b"PK\x03\x04" + bytes(100)))
    # the intact file still loads and continues
    assert reviva.load_cache(path).parked_length == out.sequences.shape[1] - 1


def test_a_failed_save_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save that fails halfway (here the disk refuses its header) leaves neither the file nor
    its temporary."""
    model, manager, out, more = first_turn()
    real = DiskFile.write
    calls = []

    def failing(self, tensor, offset):  # noqa: ANN001
        calls.append(offset)
        if offset == 0:
            raise reviva.RevivaDiskError("disk write of block 0: EIO (injected)")
        return real(self, tensor, offset)

    monkeypatch.setattr(DiskFile, "write", failing)
    with pytest.raises(reviva.RevivaDiskError, match="EIO"):
        manager.save_cache(out, tmp_path / "c.rkv")
    assert calls and not os.listdir(tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_gpu_a_saved_cache_continues_in_a_fresh_manager(tmp_path: Path, kv_dtype: str) -> None:
    """On CUDA (1B widths, 4 layers, bf16, a 4k prompt, 2 of 4 layers' K/V on the device): the
    layers read from the file into pinned memory (O_DIRECT, blocks in flight) and written into
    a new manager's tiers give the returned cache's continuation, token for token."""
    from test_generate import gpu_llama

    model = gpu_llama(4, 8192, torch.bfloat16)
    ids = torch.randint(1, 32000, (1, 4096), device="cuda")
    budget = budget_for(model, 1, 4200, 16, 2, kv_dtype=kv_dtype)
    config = RevivaConfig(vram_budget=budget, kv_dtype=kv_dtype)
    manager = RevivaManager(model, config)
    out = manager.generate(ids, **KW)
    path = tmp_path / "c.rkv"
    manager.save_cache(out, path)
    more = torch.cat([out.sequences, ids[:, :64]], dim=1)
    want = manager.generate(more, past_key_values=out.past_key_values, **KW)
    del manager, out
    fresh = RevivaManager(model, config)
    loaded = reviva.load_cache(path, model)
    got = fresh.generate(more, past_key_values=loaded, **KW)
    assert torch.equal(got.sequences, want.sequences)
    assert loaded.parked.file.counters()["failed_blocks"] == 0
    # (streamed in prefill; decode's room, once prefill's working set is gone, may promote all)
    assert fresh.get_memory_stats()["resident_layers_in_prefill"] < 4
