"""RevivaConfig(offload_device="disk"): streamed layers whose K/V does not fit host_memory spill
to disk (Note [Spilled layers] in src/kv_store_disk.cpp). Greedy tokens equal the uncapped run's
and plain HF's, call after call; the plan counts the three tiers; the file leaves nothing behind;
what cannot fit is refused by name."""

from __future__ import annotations

import pytest
import torch
from test_generate import TINY, budget_for
from transformers import AutoModelForCausalLM, LlamaConfig

import reviva
from reviva import RevivaConfig, RevivaManager

PROMPT, NEW = 150, 24


def ten_layers(seed: int = 3, device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**TINY, "num_hidden_layers": 10})
    cfg.pad_token_id, cfg.eos_token_id = 0, None
    model = AutoModelForCausalLM.from_config(cfg).to(device).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # (argmax robust to last-bit differences: test_generate)
    return model


def host_copy_bytes(model: torch.nn.Module, tokens: int) -> int:
    """One layer's pinned host copy for `tokens` tokens (K and V, the model's dtype)."""
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    itemsize = next(model.parameters()).dtype.itemsize
    return 2 * c.num_key_value_heads * head_dim * itemsize * tokens


@pytest.mark.parametrize(
    ("staged_layers", "device"),
    [(3, "cpu"), (4, "cpu"), pytest.param(3, "cuda", marks=pytest.mark.gpu)],
)
def test_greedy_tokens_with_a_cap_that_spills_to_disk_equal_the_uncapped_run(
    tmp_path, staged_layers: int, device: str
) -> None:
    model = ten_layers(device=device)
    ids = torch.randint(1, 211, (1, PROMPT), generator=torch.Generator().manual_seed(4))
    ids = ids.to(device)
    ref = model.generate(ids, max_new_tokens=NEW, do_sample=False)
    budget = budget_for(model, 1, PROMPT, NEW, 2)
    uncapped = RevivaManager(model, RevivaConfig(vram_budget=budget))
    assert torch.equal(uncapped.generate(ids, max_new_tokens=NEW, do_sample=False), ref)
    streamed = uncapped.get_memory_stats()["streamed_layers"]
    # (on the CPU the budget's two layers of K/V are staging slots: all 10 stream; on CUDA, whose
    # arena maps 2 MiB granules, the budget holds a few layers more)
    assert streamed == 10 if device == "cpu" else streamed >= 5
    # Pinned memory for `staged_layers` layers' host copies: the plan spills every streamed
    # layer and stages as many as fit (prefetch_layers + 3 = 5 at most, fewer when short).
    per_layer = host_copy_bytes(model, PROMPT + NEW)
    config = RevivaConfig(
        vram_budget=budget,
        offload_device="disk",
        disk_path=str(tmp_path),
        host_memory=staged_layers * per_layer,
    )
    manager = RevivaManager(model, config)
    for call in range(3):  # the same call again and again in one process
        out = manager.generate(ids, max_new_tokens=NEW, do_sample=False)
        assert torch.equal(out, ref), f"call {call}: {(out != ref).sum().item()} tokens differ"
        st = manager.get_memory_stats()
        # (on CUDA, decode's room promotes some of the spilled layers back: spilled first)
        on_disk = streamed if device == "cpu" else st["disk_layers"]
        assert st["disk_layers"] == on_disk and on_disk >= 1
        assert st["disk_staged_layers"] == staged_layers
        assert 2 <= st["disk_peak_staged_layers"] <= staged_layers
        assert st["disk_reads"] >= NEW  # every decode step reads spilled layers back
        assert st["bytes_from_disk"] >= NEW * max(on_disk - staged_layers, 1) * PROMPT * (
            per_layer // (PROMPT + NEW)
        )
        assert st["bytes_to_disk"] > 0
        assert st["disk_bytes"] >= on_disk * per_layer
        assert st["disk_file"].startswith(str(tmp_path))
        assert st["decode_attention"] == "device"
    # The file was unlinked once open, and its folder is the user's: nothing is left there.
    assert list(tmp_path.iterdir()) == []
    # A second manager at once, with the default folder: the same tokens.
    other = RevivaManager(
        model,
        RevivaConfig(
            vram_budget=budget, offload_device="disk", host_memory=staged_layers * per_layer
        ),
    )
    assert torch.equal(other.generate(ids, max_new_tokens=NEW, do_sample=False), ref)
    assert torch.equal(manager.generate(ids, max_new_tokens=NEW, do_sample=False), ref)


def test_a_returned_cache_continues_from_spilled_layers(tmp_path) -> None:
    """A call's returned cache (its K/V parked) continues in a later call with the same spill:
    the tokens of one uninterrupted call."""
    model = ten_layers(seed=5)
    ids = torch.randint(1, 211, (1, PROMPT), generator=torch.Generator().manual_seed(6))
    ref = model.generate(ids, max_new_tokens=2 * NEW, do_sample=False)
    budget = budget_for(model, 1, PROMPT, 2 * NEW, 2)
    per_layer = host_copy_bytes(model, PROMPT + 2 * NEW)
    config = RevivaConfig(
        vram_budget=budget,
        offload_device="disk",
        disk_path=str(tmp_path),
        host_memory=3 * per_layer,
    )
    manager = RevivaManager(model, config)
    first = manager.generate(ids, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True)
    assert manager.get_memory_stats()["disk_layers"] > 0
    out = manager.generate(
        first.sequences, past_key_values=first.past_key_values, max_new_tokens=NEW, do_sample=False
    )
    assert torch.equal(out, ref)


def test_the_plan_counts_the_three_tiers_and_refuses_what_cannot_fit(tmp_path) -> None:
    model = ten_layers()
    ids = torch.randint(1, 211, (1, PROMPT), generator=torch.Generator().manual_seed(4))
    budget = budget_for(model, 1, PROMPT, NEW, 2)
    per_layer = host_copy_bytes(model, PROMPT + NEW)
    # offload_device="cpu" under the same cap: refused by name, as before the disk tier.
    with pytest.raises(reviva.RevivaOutOfMemoryError, match="over host_memory"):
        RevivaManager(model, RevivaConfig(vram_budget=budget, host_memory=3 * per_layer)).generate(
            ids, max_new_tokens=NEW, do_sample=False
        )
    # Room for one staged host copy: too little even with every streamed layer on disk.
    with pytest.raises(reviva.RevivaOutOfMemoryError, match="every one of the 10 streamed layers"):
        RevivaManager(
            model,
            RevivaConfig(
                vram_budget=budget,
                offload_device="disk",
                disk_path=str(tmp_path),
                host_memory=per_layer,
            ),
        ).generate(ids, max_new_tokens=NEW, do_sample=False)
    # Enough pinned memory: nothing spills.
    manager = RevivaManager(
        model, RevivaConfig(vram_budget=budget, offload_device="disk", disk_path=str(tmp_path))
    )
    manager.generate(ids, max_new_tokens=4, do_sample=False)
    st = manager.get_memory_stats()
    assert st["disk_layers"] == 0 and st["disk_reads"] == 0 and st["disk_file"] is None


def test_a_saved_cache_continues_into_spilled_layers(tmp_path) -> None:
    """A cache saved by one manager, loaded and continued by another whose plan spills: each
    layer goes from the file through pinned memory into the call's tiers (disk among them), and
    the tokens are those of the uninterrupted call."""
    model = ten_layers(seed=7)
    ids = torch.randint(1, 211, (1, PROMPT), generator=torch.Generator().manual_seed(8))
    ref = model.generate(ids, max_new_tokens=2 * NEW, do_sample=False)
    saver = RevivaManager(model, RevivaConfig())
    first = saver.generate(ids, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True)
    saver.save_cache(first, tmp_path / "c.rkv")
    budget = budget_for(model, 1, PROMPT, 2 * NEW, 2)
    per_layer = host_copy_bytes(model, PROMPT + 2 * NEW)
    spill = RevivaConfig(
        vram_budget=budget,
        offload_device="disk",
        disk_path=str(tmp_path),
        host_memory=3 * per_layer,
    )
    manager = RevivaManager(model, spill)
    loaded = reviva.load_cache(tmp_path / "c.rkv", model)
    out = manager.generate(
        first.sequences, past_key_values=loaded, max_new_tokens=NEW, do_sample=False
    )
    assert torch.equal(out, ref)
    assert manager.get_memory_stats()["disk_layers"] > 0


def test_fp8_rows_spill_and_give_the_tokens_of_fp8_rows_pinned(tmp_path) -> None:
    """fp8 K/V rows (Note [fp8 K/V rows]) spilled to disk: the tokens of the same rows kept in
    pinned memory (fp8 is lossy: its own reference, not HF's)."""
    from reviva.cache import fp8 as kv_fp8

    model = ten_layers(seed=9)
    ids = torch.randint(1, 211, (1, PROMPT), generator=torch.Generator().manual_seed(10))
    budget = budget_for(model, 1, PROMPT, NEW, 2, kv_dtype="fp8")
    pinned = RevivaManager(model, RevivaConfig(vram_budget=budget, kv_dtype="fp8"))
    ref = pinned.generate(ids, max_new_tokens=NEW, do_sample=False)
    c = model.config
    row = kv_fp8.row_bytes(c.hidden_size // c.num_attention_heads)
    per_layer = 2 * c.num_key_value_heads * row * (PROMPT + NEW)
    config = RevivaConfig(
        vram_budget=budget,
        kv_dtype="fp8",
        offload_device="disk",
        disk_path=str(tmp_path),
        host_memory=3 * per_layer,
    )
    manager = RevivaManager(model, config)
    for _ in range(2):
        assert torch.equal(manager.generate(ids, max_new_tokens=NEW, do_sample=False), ref)
        st = manager.get_memory_stats()
        assert st["disk_layers"] >= 5 and st["disk_reads"] >= NEW
