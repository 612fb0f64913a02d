"""RevivaManager on tiny random-init models of each supported family (CPU, fp32, host backend),
and on the GPU where one is present: the same tokens as plain HF under every residency (all
layers resident, some streamed, all streamed through one slot), chunked prefill, batches with
left padding, seeded sampling, and restore after `with manager:`."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
    SmolLM3Config,
    TextIteratorStreamer,  # noqa: F401 (generate's streamer API is exercised below)
)
from transformers.generation.streamers import BaseStreamer

import reviva
from reviva import RevivaConfig, RevivaManager, offload_activations
from reviva.adapters import sliding_window
from reviva.cache.kv_cache import RevivaCache
from reviva.plan.call_plan import Plan
from reviva.plan.memory_state import device_state
from reviva.plan.planner import smallest_budget

TINY = dict(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=211,
    max_position_embeddings=2048,
)


# Families with a sliding window of 16 tokens (Note [Sliding windows]): every layer (Mistral,
# Phi-3, Mixtral), or the layers from max_window_layers on (Qwen2: full and sliding mixed).
SLIDING = {
    "mistral_sliding": lambda: MistralConfig(**TINY, sliding_window=16),
    "qwen2_sliding": lambda: Qwen2Config(
        **TINY, use_sliding_window=True, sliding_window=16, max_window_layers=2
    ),
    "phi3_sliding": lambda: Phi3Config(**TINY, sliding_window=16),
    "mixtral_sliding": lambda: MixtralConfig(**TINY, sliding_window=16, num_local_experts=4),
    # sliding and global layers alternating (Gemma 2), five sliding to one global (Gemma 3: its
    # global layers with their own rotary base)
    "gemma2_sliding": lambda: Gemma2Config(**TINY, head_dim=16, sliding_window=16),
    "gemma3_sliding": lambda: Gemma3TextConfig(
        **TINY, head_dim=16, sliding_window=16, sliding_window_pattern=3
    ),
}


def gemma2_runs_sdpa() -> bool:
    """Whether this transformers runs Gemma 2 through sdpa (5.17: yes, its scores uncapped;
    5.25: no, eager with the cap)."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2PreTrainedModel

    return bool(Gemma2PreTrainedModel._supports_sdpa)


def test_gemma2_off_hfs_sdpa_path_is_refused_by_name() -> None:
    """Gemma 2's attention scores soft-capped (HF's eager path) are refused, naming the cap and
    the implementation, before anything is wrapped; HF's sdpa (where this transformers runs it)
    leaves them uncapped, which Reviva matches. A transformers that runs Gemma 2 eager only
    (5.25) is refused by name whatever the config (Note [Tested transformers])."""
    torch.manual_seed(0)
    cfg = Gemma2Config(**TINY, head_dim=16)
    cfg.pad_token_id = 0
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    why = "soft-capped at 50.0 .*'eager'" if gemma2_runs_sdpa() else "with .*'eager' only"
    with pytest.raises(ValueError, match=why):
        RevivaManager(model)
    assert "forward" not in model.model.layers[0].__dict__
    if not gemma2_runs_sdpa():
        with pytest.raises(ValueError, match="Gemma2ForCausalLM with attn_implementation"):
            RevivaManager(build_tiny("gemma2_sliding"))


def tiny_model(family: str, seed: int = 0, device: str = "cpu") -> torch.nn.Module:
    if family.startswith("gemma2") and not gemma2_runs_sdpa():
        pytest.skip(
            "this transformers runs Gemma 2 eager only, which RevivaManager refuses by name "
            "(test_gemma2_off_hfs_sdpa_path_is_refused_by_name)"
        )
    return build_tiny(family, seed, device)


def build_tiny(family: str, seed: int = 0, device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(seed)
    if family in SLIDING:
        cfg = SLIDING[family]()
    elif family == "llama":
        cfg = LlamaConfig(**TINY)
    elif family == "mistral":
        cfg = MistralConfig(**TINY, sliding_window=None)
    elif family == "qwen2":
        cfg = Qwen2Config(**TINY, use_sliding_window=False)
    elif family == "qwen3":
        cfg = Qwen3Config(**TINY, head_dim=16, use_sliding_window=False)
    elif family == "phi3":  # fused qkv_proj and gate_up_proj
        cfg = Phi3Config(**TINY, sliding_window=None)
    elif family == "mixtral":  # experts instead of the MLP (4, 2 routed per token)
        cfg = MixtralConfig(**TINY, sliding_window=None, num_local_experts=4)
    elif family == "qwen3_moe":
        cfg = Qwen3MoeConfig(
            **TINY, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48
        )
    elif family == "gemma2":  # norms around each sublayer's output, soft-capped logits
        cfg = Gemma2Config(**TINY, head_dim=16)
    elif family == "gemma3":  # the same norms, q/k norms, local and global rotary bases
        cfg = Gemma3TextConfig(**TINY, head_dim=16, sliding_window_pattern=3)
    elif family == "smollm3":  # layers 1 and 3 without rotary embeddings (NoPE)
        cfg = SmolLM3Config(**TINY, no_rope_layer_interval=2)
    else:
        raise AssertionError(family)
    cfg.pad_token_id = 0
    cfg.eos_token_id = None
    model = AutoModelForCausalLM.from_config(cfg).to(device).eval()
    # Random init gives near-uniform logits; scaling the head makes argmax robust to the
    # last-bit differences of an unrelated kernel, so "identical" tests what it should.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


class RaisingStreamer(BaseStreamer):
    """A streamer whose `at`-th put raises (the prompt is the first: 2 is the first new token;
    a call that raises returns no cache, so none is parked)."""

    def __init__(self, at: int) -> None:
        self.at, self.n = at, 0

    def put(self, value: torch.Tensor) -> None:
        self.n += 1
        if self.n == self.at:
            raise RuntimeError("streamer failed")

    def end(self) -> None:
        pass


def budget_for(
    model: torch.nn.Module,
    batch: int,
    prompt: int,
    new: int,
    layers: int,
    chunk: int | None = None,
    attention: str = "auto",
    **config_fields: object,
) -> int:
    """The smallest budget whose plan holds `layers` layers of K/V on the device (resident
    layers and staging slots together), from the planner's own bisection; `config_fields`: more
    RevivaConfig fields (e.g. kv_dtype)."""
    config = RevivaConfig(chunk_tokens=chunk, prefill_attention=attention, **config_fields)
    return budget_keeping(
        model,
        config,
        batch,
        prompt,
        new,
        lambda p: len(p.resident_layers) + p.slots >= min(layers, p.num_layers),
    )


def budget_keeping(
    model: torch.nn.Module,
    config: RevivaConfig,
    batch: int,
    prompt: int,
    new: int,
    keeps: Callable[[Plan], bool],
    past: int = 0,
) -> int:
    """The smallest budget whose plan of this call under `config` satisfies `keeps` (past: a
    call continued from a cache of that many tokens)."""
    manager = RevivaManager(model, config)
    state = device_state(manager.layout, manager.arena)
    return smallest_budget(
        manager.layout, config, state, batch, prompt, new, keeps, past_tokens=past
    )


FAMILIES = [
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "mixtral",
    "qwen3_moe",
    "smollm3",
    "gemma2",
    "gemma3",
]
# Experts instead of the MLP: a token's top-k choice of experts is discontinuous in its hidden
# state, so a lossy change upstream (fp8 K/V) can flip a choice and move the logits more than
# the same error does in a dense model (Mixtral, tiny: 8.3% at one step against dense's < 5%).
MOE_FAMILIES = ("mixtral", "qwen3_moe")
# (layers of K/V the budget holds, chunk, prefill attention): all resident; 2 resident + 3 slots;
# no resident layer, 3 slots; one slot (no prefetch); chunked prefill with streaming, with whole
# and with chunked attention.
RESIDENCY = [
    (99, None, "auto"),
    (5, None, "auto"),
    (3, None, "auto"),
    (1, None, "auto"),
    (4, 48, "whole"),
    (4, 48, "chunked"),
]


def greedy_as_hf(
    model: torch.nn.Module, seed: int, new: int, layers: int, chunk: int | None, attention: str
) -> tuple[RevivaManager, torch.Tensor, torch.Tensor]:
    """A 150-token prompt's greedy tokens under a budget keeping `layers` layers of K/V: asserts
    they are plain HF's; returns the manager, the prompt and those tokens."""
    ids = torch.randint(1, 211, (1, 150), generator=torch.Generator().manual_seed(seed))
    ref = model.generate(ids, max_new_tokens=new, do_sample=False)
    budget = budget_for(model, 1, 150, new, layers, chunk, attention)
    config = RevivaConfig(vram_budget=budget, chunk_tokens=chunk, prefill_attention=attention)
    manager = RevivaManager(model, config)
    out = manager.generate(ids, max_new_tokens=new, do_sample=False)
    assert torch.equal(out, ref), f"{(out != ref).sum().item()} tokens differ"
    return manager, ids, ref


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layers,chunk,attention", RESIDENCY)
def test_greedy_tokens_identical(
    family: str, layers: int, chunk: int | None, attention: str
) -> None:
    model = tiny_model(family)
    manager, _, _ = greedy_as_hf(model, 1, 64, layers, chunk, attention)
    st = manager.get_memory_stats()
    assert st["decode_steps"] == 63
    expected_resident = 5 if layers >= 5 else max(layers - min(layers, 3), 0)
    assert st["resident_layers_in_prefill"] == expected_resident
    streamed_in_prefill = 5 - expected_resident
    # After prefill its working set is free again: streamed layers that fit become resident.
    assert st["resident_layers"] == expected_resident + st["promoted_layers"]
    if streamed_in_prefill:
        assert st["bytes_to_host"] > 0 and st["device_bytes_saved"] >= 0
        # Appends move only new tokens: the prompt once per layer streamed in prefill, then a
        # token per decode step per layer still streamed.
        kv_token = 2 * 2 * 16 * 4  # K and V, 2 kv heads, head_dim 16, fp32
        expected = kv_token * (streamed_in_prefill * 150 + st["streamed_layers"] * 63)
        assert st["bytes_to_host"] == expected
    else:
        assert st["bytes_to_host"] == 0 and st["bytes_to_device"] == 0
    if chunk is not None:
        assert st["chunk_tokens"] == chunk


@pytest.mark.parametrize("family", list(SLIDING))
@pytest.mark.parametrize("layers,chunk,attention", RESIDENCY)
def test_sliding_window_greedy_tokens_identical(
    family: str, layers: int, chunk: int | None, attention: str
) -> None:
    """Note [Sliding windows]: a window of 16 tokens, a 150-token prompt and 40 new tokens, at
    every residency (chunks of 48 tokens), HF's tokens, with HF's decode path and with Reviva's
    own (the CUDA path: the window's keys only); an assistant's candidates verified several at
    a time by the own path (a band mask); a left-padded batch (HF's sliding mask with padding);
    fp8 K/V refused by name."""
    model = tiny_model(family, seed=7)
    sliding = [sliding_window(layer.self_attn) for layer in model.model.layers]
    assert 16 in sliding and (family != "qwen2_sliding" or None in sliding), sliding
    manager, ids, ref = greedy_as_hf(model, 8, 40, layers, chunk, attention)
    manager._own_decode = True  # (the CUDA half-precision path's decode, here on the CPU)
    out = manager.generate(ids, max_new_tokens=40, do_sample=False)
    assert torch.equal(out, ref), f"own decode: {(out != ref).sum().item()} tokens differ"
    assert manager.get_memory_stats()["own_decode_attention"]
    if layers != 99 or chunk is not None:
        return
    assistant = tiny_model(family, seed=17)
    out = manager.generate(
        ids, max_new_tokens=40, do_sample=False, assistant_model=assistant, num_assistant_tokens=3
    )
    assert torch.equal(out, ref), f"assisted: {(out != ref).sum().item()} tokens differ"
    g = torch.Generator().manual_seed(9)
    batch = torch.zeros(2, 90, dtype=torch.long)
    mask = torch.zeros(2, 90, dtype=torch.long)
    for row, n in enumerate((90, 61)):
        batch[row, 90 - n :] = torch.randint(1, 211, (n,), generator=g)
        mask[row, 90 - n :] = 1
    ref = model.generate(batch, attention_mask=mask, max_new_tokens=24, do_sample=False)
    budget = budget_for(model, 2, 90, 24, 3)
    manager = RevivaManager(model, RevivaConfig(vram_budget=budget))
    out = manager.generate(batch, attention_mask=mask, max_new_tokens=24, do_sample=False)
    assert torch.equal(out, ref), f"padded: {(out != ref).sum().item()} tokens differ"
    from test_paged_kv import paged_budget

    paged = RevivaConfig(chunk_tokens=48, kv_page_tokens=32)
    budget = paged_budget(model, paged, 1, 150, 4, 0)  # (every layer in pages)
    for config in (RevivaConfig(kv_dtype="fp8"), dataclasses.replace(paged, vram_budget=budget)):
        with pytest.raises(ValueError, match=r"sliding window \(16 tokens\)"):
            RevivaManager(model, config).generate(ids, max_new_tokens=4, do_sample=False)


@pytest.mark.parametrize("family", FAMILIES + list(SLIDING))
def test_logits_match_hf_with_peaked_attention(family: str) -> None:
    """Each decode step's logits (fp32) within 1e-4 of plain HF's, with HF's decode path and
    with Reviva's own (the CUDA path's, here on the CPU), some layers streamed and a chunked
    prefill. Queries and keys are scaled up so that attention is peaked: where a layer's
    positions are mishandled (a NoPE layer given rotary embeddings, a window misplaced) the
    logits move by ~0.1, while the tokens, under the scaled head of tiny_model, often do not."""
    model = tiny_model(family, seed=5)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            for proj in ("q_proj", "k_proj", "qkv_proj"):
                if hasattr(attn, proj):
                    getattr(attn, proj).weight.mul_(6.0)
    ids = torch.randint(1, 211, (1, 150), generator=torch.Generator().manual_seed(6))
    kw = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
    ref = model.generate(ids, **kw)
    budget = budget_for(model, 1, 150, 8, 3, 48)
    for own in (False, True):
        manager = RevivaManager(model, RevivaConfig(vram_budget=budget, chunk_tokens=48))
        manager._own_decode = own  # (the CUDA half-precision path's decode, here on the CPU)
        out = manager.generate(ids, **kw)
        assert manager.get_memory_stats()["streamed_layers"] > 0
        worst = max((a - b).abs().max().item() for a, b in zip(out.logits, ref.logits, strict=True))
        assert worst < 1e-4, f"{'own' if own else 'HF'} decode path: logits {worst:.3g} from HF's"


@pytest.mark.parametrize("family", list(SLIDING))
def test_a_first_chunk_longer_than_the_window_matches_hf(family: str) -> None:
    """A 60-token prompt in chunks of 48 with a 16-token window and attention made peaked: the
    first chunk's queries 16-47 see only their window (chunk_attention applied no band to a
    chunk starting at 0, so they saw every key before them), and with the tiny models' layers
    the last token's receptive field reaches them: every step's logits within 1e-4 of HF's."""
    model = tiny_model(family, seed=5)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            for proj in ("q_proj", "k_proj", "qkv_proj"):
                if hasattr(attn, proj):
                    getattr(attn, proj).weight.mul_(6.0)
    ids = torch.randint(1, 211, (1, 60), generator=torch.Generator().manual_seed(6))
    kw = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    ref = model.generate(ids, **kw)
    config = RevivaConfig(vram_budget=budget_for(model, 1, 60, 4, 99, 48), chunk_tokens=48)
    for own in (False, True):
        manager = RevivaManager(model, config)
        manager._own_decode = own
        out = manager.generate(ids, **kw)
        assert manager.get_memory_stats()["chunk_tokens"] == 48
        worst = max((a - b).abs().max().item() for a, b in zip(out.logits, ref.logits, strict=True))
        assert worst < 1e-4, f"{'own' if own else 'HF'} decode path: logits {worst:.3g} from HF's"


@pytest.mark.parametrize(
    "family,layers",
    [(f, 1) for f in FAMILIES + ["mistral_sliding"]] + [("llama", 99), ("llama", 3)],
)
def test_beam_search_identical(family: str, layers: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [Beams] and Note [Shared prompt K/V] (cache/sequence_rows.py): 4 beams and 2 returned
    sequences for each of 2 prompts, every family with every layer streamed through one slot (Llama
    also all resident, and some), HF's decode path and Reviva's own: plain HF's sequences, the
    prompt's K/V held once per prompt (shared) and one copy per row (REVIVA_SHARE_PROMPT=0). With
    every layer streamed through one slot, the bytes sent to the host are the prompt's rows once
    and, per row copies, per step the new token's row and the generated rows a reorder rewrote (a
    reorder never moves the prompt's rows; HF's caches copy every row per step); shared, the
    generated rows stay on the device: the prompts' rows alone go to the host."""
    model = tiny_model(family, seed=3)
    ids = torch.randint(1, 211, (2, 60), generator=torch.Generator().manual_seed(4))
    kw = dict(max_new_tokens=20, do_sample=False, num_beams=4, num_return_sequences=2)
    ref = model.generate(ids, **kw)
    sliding = family == "mistral_sliding"  # (a window shorter than the call: a copy per row)
    for shared in (True, False):
        monkeypatch.setenv("REVIVA_SHARE_PROMPT", "1" if shared else "0")
        rows = 2 if shared and not sliding else 8  # what the plan holds K/V for
        budget = budget_for(model, rows, 60, 20, layers)
        for own in (False, True):
            manager = RevivaManager(model, RevivaConfig(vram_budget=budget))
            manager._own_decode = own  # (the CUDA half-precision path's decode, here on the CPU)
            out = manager.generate(ids, **kw)
            st = manager.get_memory_stats()
            assert out.shape == ref.shape and torch.equal(out, ref), f"own {own} shared {shared}"
            assert st["shared_prompt_rows"] == (4 if rows == 2 else 1), st["shared_prompt_rows"]
        if layers == 1:
            assert st.prefill.kv_streamed_layers == 5 and st["resident_layers_in_prefill"] == 0
            # (decode may promote a layer at its start where prefill's working set was the
            # larger: Mixtral's experts, Note [The experts' working set] in plan/memory_model.py)
            decode = st["streamed_layers"]
            assert decode >= 5 - (family == "mixtral"), st
            row = rows * 2 * 2 * 16 * 4  # the rows held, K and V, 2 heads x 16, fp32
            steps = range(1, 20)  # step s writes its token and rewrites the s - 1 generated before
            per_step = 0 if rows == 2 else sum(steps)
            want = row * (5 * 60 + decode * per_step)
            assert st["bytes_to_host"] == want, (st["bytes_to_host"], want)
    if layers == 99 and family == "llama":
        # fp8 rows reordered the same way: every residency gives the same (lossy) sequences
        runs = []
        for keep in (99, 1):
            b = budget_for(model, 8, 60, 20, keep, kv_dtype="fp8")
            manager = RevivaManager(model, RevivaConfig(vram_budget=b, kv_dtype="fp8"))
            runs.append(manager.generate(ids, **kw))
        assert torch.equal(runs[0], runs[1])
        # pages spread a layer's rows: refused by name
        from test_paged_kv import paged_budget

        paged = RevivaConfig(chunk_tokens=32, kv_page_tokens=16)
        b = paged_budget(model, paged, 8, 60, 4, 0)
        manager = RevivaManager(model, dataclasses.replace(paged, vram_budget=b))
        with pytest.raises(ValueError, match=r"num_beams=4 with RevivaConfig\(kv_page_tokens"):
            manager.generate(ids, **kw)


def test_sequences_per_prompt_share_the_prompts_kv_across_calls_and_a_failure() -> None:
    """Note [Shared prompt K/V]: three sampled sequences per prompt (a seed) give plain HF's
    sequences with the prompt's K/V held once (the plan's K/V is the prompts' rows); calls in
    a row (greedy, shared, a padded batch, which keeps a copy per row) each give HF's tokens;
    a streamer that raises in the middle of a shared call leaves the next call exact."""
    model = tiny_model("llama", seed=6)
    ids = torch.randint(1, 211, (2, 40), generator=torch.Generator().manual_seed(7))
    sample = dict(max_new_tokens=16, do_sample=True, top_k=20, num_return_sequences=3)
    budget = budget_for(model, 6, 40, 16, 1)  # (the padded call's 6 rows, one layer's K/V)
    manager = RevivaManager(model, RevivaConfig(vram_budget=budget))

    for _ in range(2):
        torch.manual_seed(11)
        ref = model.generate(ids, **sample)
        torch.manual_seed(11)
        out = manager.generate(ids, **sample)
        st = manager.get_memory_stats()
        assert torch.equal(out, ref)
        assert st["shared_prompt_rows"] == 3 and st["streamed_layers"] >= 1, st
        assert st.kv_cache_bytes == 5 * 2 * 56 * 2 * 2 * 16 * 4, st.kv_cache_bytes
        greedy = manager.generate(ids, max_new_tokens=8)
        assert torch.equal(greedy, model.generate(ids, max_new_tokens=8))
        assert manager.get_memory_stats()["shared_prompt_rows"] == 1

    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding: the rows of a prompt are alike, but HF's mask is per row
    beams = dict(max_new_tokens=10, num_beams=3, attention_mask=mask)
    ref = model.generate(ids, **beams)
    out = manager.generate(ids, **beams)
    assert torch.equal(out, ref) and manager.get_memory_stats()["shared_prompt_rows"] == 1

    with pytest.raises(RuntimeError, match="streamer failed"):
        manager.generate(
            ids[:1],
            max_new_tokens=10,
            do_sample=True,
            num_return_sequences=2,
            streamer=RaisingStreamer(4),
        )
    torch.manual_seed(11)
    ref = model.generate(ids, **sample)
    torch.manual_seed(11)
    assert torch.equal(manager.generate(ids, **sample), ref)
    assert manager._share == 1 and manager._cache is None


@pytest.mark.parametrize("family", ["mistral_sliding", "gemma2_sliding"])
def test_sliding_layers_move_only_their_window(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Note [Fetch tails] (src/append_blocks.cpp): with Reviva's own attention calls (they
    read a sliding layer within its window alone), a streamed sliding layer's decode fetches
    copy its last 16 tokens, not all 150-189: counted against the same calls with whole fetches
    (REVIVA_FETCH_WINDOWS=0), plain HF's tokens both ways. Gemma 2 alternates sliding and global
    layers: the global ones are promoted first (a promoted sliding layer would save 16 tokens a
    step, a global one all of its). Without rings (Note [Window rings] in cache/window_rings.py,
    where a ring is its window already; test_window_rings_hold_their_window)."""
    monkeypatch.setenv("REVIVA_WINDOW_RINGS", "0")
    model = tiny_model(family, seed=7)
    windows = [sliding_window(layer.self_attn) for layer in model.model.layers]
    sliding = {i for i, w in enumerate(windows) if w == 16}
    ids = torch.randint(1, 211, (1, 150), generator=torch.Generator().manual_seed(8))
    ref = model.generate(ids, max_new_tokens=40, do_sample=False)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    row = 2 * cfg.num_key_value_heads * head_dim * 4  # one token's K and V, fp32
    runs = {}
    for windowed in (True, False):
        monkeypatch.setenv("REVIVA_FETCH_WINDOWS", "1" if windowed else "0")
        keep = 3 if family == "gemma2_sliding" else 2  # (Gemma 2: room to promote one layer)
        budget = budget_for(model, 1, 150, 40, keep)
        manager = RevivaManager(model, RevivaConfig(vram_budget=budget))
        manager._own_decode = True  # (the CUDA half-precision path's decode, here on the CPU)
        out = manager.generate(ids, max_new_tokens=40, do_sample=False)
        assert torch.equal(out, ref), f"windowed {windowed}: {(out != ref).sum().item()} differ"
        st = manager.get_memory_stats()
        runs[windowed] = (st, st["streamed_layer_ids"])
    (st, streamed), (st0, streamed0) = runs[True], runs[False]
    assert st["fetch_window_layers"] == len(sliding) and st0["fetch_window_layers"] == 0
    if family == "gemma2_sliding":  # (promoted first: a global layer; else a spread pick)
        promoted = set(range(len(windows))) - set(streamed)
        assert promoted and not promoted & sliding, (streamed, sliding)
        assert set(range(len(windows))) - set(streamed0) == {2}, streamed0
        return
    assert streamed == streamed0 and all(i in sliding for i in streamed)
    # 39 decode steps; step s fetches a streamed layer holding 150 + s tokens: 16 of them now
    saved = len(streamed) * sum((150 + s - 16) * row for s in range(39))
    diff = st0["bytes_to_device"] - st["bytes_to_device"]
    assert saved <= diff <= saved + len(streamed) * (150 + 39) * row, (diff, saved)
    # A returned cache holds every token (fetched whole to park: Note [A returned cache]), and
    # the next turn continues from it with windows again: HF continuing from its own cache.
    monkeypatch.setenv("REVIVA_FETCH_WINDOWS", "1")
    kw = dict(max_new_tokens=10, do_sample=False, return_dict_in_generate=True)
    hf = model.generate(ids, **kw)
    manager = RevivaManager(model, RevivaConfig(vram_budget=budget_for(model, 1, 190, 10, 2)))
    manager._own_decode = True
    out = manager.generate(ids, **kw)
    assert torch.equal(out.sequences, hf.sequences)
    prompt = torch.cat([out.sequences, ids[:, :20]], dim=1)
    ref2 = model.generate(prompt, past_key_values=hf.past_key_values, **kw)
    got = manager.generate(prompt, past_key_values=out.past_key_values, **kw)
    assert torch.equal(got.sequences, ref2.sequences)
    assert manager.get_memory_stats()["fetch_window_layers"] == len(sliding)


@pytest.mark.parametrize("family", list(SLIDING))
def test_window_rings_hold_their_window(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [Window rings] (cache/window_rings.py): a sliding layer whose window (16) leaves tokens
    out of the call (150 + 40) is kept as a ring of 15 + 48 rows (48-token chunks), which wraps:
    plain HF's tokens with HF's decode path and Reviva's own, and, against the same call with
    every token kept (REVIVA_WINDOW_RINGS=0): each streamed ring's host copy and each fetch of it
    are its 63 rows, counted exactly; the cache's bytes are the rings' rows and the full layers'
    tokens; a returned cache holds a ring's last 15 tokens and the next turn continues from it
    with HF's tokens; an assistant's candidates are cut back inside the ring."""
    model = tiny_model(family, seed=7)
    windows = [sliding_window(layer.self_attn) for layer in model.model.layers]
    sliding = [i for i, w in enumerate(windows) if w == 16]
    ids = torch.randint(1, 211, (1, 150), generator=torch.Generator().manual_seed(8))
    ref = model.generate(ids, max_new_tokens=40, do_sample=False)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    row = 2 * cfg.num_key_value_heads * head_dim * 4  # one token's K and V, fp32
    ring, n = 15 + 48, len(windows)
    runs = {}
    for rings in (True, False):
        monkeypatch.setenv("REVIVA_WINDOW_RINGS", "1" if rings else "0")
        for own in (False, True):
            config = RevivaConfig(vram_budget=budget_for(model, 1, 150, 40, 1, 48), chunk_tokens=48)
            manager = RevivaManager(model, config)
            manager._own_decode = own  # (the CUDA half-precision path's decode, here on the CPU)
            out = manager.generate(ids, max_new_tokens=40, do_sample=False)
            assert torch.equal(out, ref), f"rings {rings} own {own}: {(out != ref).sum()} differ"
            st = manager.get_memory_stats()
            runs[rings, own] = st
    st, st0 = runs[True, True], runs[False, True]
    assert st["window_ring_layers"] == len(sliding) and st["window_ring_tokens"] == ring, st
    assert st0["window_ring_layers"] == 0
    tokens = [ring if i in sliding else 190 for i in range(n)]
    assert st["kv_cache_bytes"] == sum(tokens) * row and st0["kv_cache_bytes"] == n * 190 * row
    streamed = st["streamed_layer_ids"]
    assert streamed and st["host_bytes"] == sum(tokens[i] for i in streamed) * row, st
    assert st0["host_bytes"] == len(st0["streamed_layer_ids"]) * 190 * row
    # Each decode step fetches a streamed ring's rows: every one of them once it has wrapped.
    rings_streamed = [i for i in streamed if i in sliding]
    assert rings_streamed, streamed
    for own in (False, True):
        moved = runs[True, own]["decode"]["bytes_to_device"]
        full = [i for i in runs[True, own]["streamed_layer_ids"] if i not in sliding]
        least = len(rings_streamed) * 39 * ring * row  # 39 steps fetch, each ring whole
        assert least <= moved <= least + len(full) * 40 * 190 * row + 2 * ring * row, (own, moved)
    # A returned cache: a ring's last 15 tokens, and the next turn as HF continues its own.
    kw = dict(max_new_tokens=10, do_sample=False, return_dict_in_generate=True)
    monkeypatch.setenv("REVIVA_WINDOW_RINGS", "1")
    hf = model.generate(ids, **kw)
    config = RevivaConfig(vram_budget=budget_for(model, 1, 190, 10, 1, 48), chunk_tokens=48)
    manager = RevivaManager(model, config)
    manager._own_decode = True
    out = manager.generate(ids, **kw)
    assert torch.equal(out.sequences, hf.sequences)
    assert manager.get_memory_stats()["window_ring_layers"] == len(sliding)
    parked = out.past_key_values.parked
    held = out.past_key_values.get_seq_length()
    assert held == 159 and all(
        parked[i][0].shape[2] == (15 if i in sliding else held) for i in range(n)
    ), [k.shape for k, _ in parked]
    # (9 more tokens: the next call's ring is 15 + 10 rows, and the parked tokens from position
    # 144 start at row 19, past the 10 a write may take at once: loaded as rows, not positions)
    for more in (9, 30):
        prompt = torch.cat([out.sequences, ids[:, :more]], dim=1)
        ref2 = model.generate(prompt, past_key_values=copy.deepcopy(hf.past_key_values), **kw)
        got = manager.generate(prompt, past_key_values=out.past_key_values, **kw)
        assert torch.equal(got.sequences, ref2.sequences), more
        assert manager.get_memory_stats()["window_ring_layers"] == len(sliding)
    # Assisted decoding: candidates verified several at a time, the rejected ones cut back.
    assistant = tiny_model(family, seed=17)
    out = manager.generate(
        ids, max_new_tokens=40, do_sample=False, assistant_model=assistant, num_assistant_tokens=3
    )
    assert torch.equal(out, ref)
    assert manager.get_memory_stats()["window_ring_layers"] == len(sliding)

    # A streamer that raises mid-decode (the rings wrapped), then the same call twice more on the
    # same manager, and a second manager's call between them: HF's tokens each time.
    with pytest.raises(RuntimeError, match="streamer failed"):
        manager.generate(ids, max_new_tokens=40, do_sample=False, streamer=RaisingStreamer(30))
    other = RevivaManager(model, config)
    for m in (manager, other, manager):
        assert torch.equal(m.generate(ids, max_new_tokens=40, do_sample=False), ref)
        assert m.get_memory_stats()["window_ring_layers"] == len(sliding)


@pytest.mark.parametrize("family", ["mistral_sliding", "gemma2_sliding"])
def test_no_prompt_sized_mask_with_a_short_window(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Note [Prefill masks left to Reviva] (cache/layer.py): an unpadded call whose window (16) is
    shorter than its prompt (150) makes HF build no mask of the prompt's size (HF alone builds
    [1, 1, 150, 150]; at 64k that is 4 GiB), and still gives HF's tokens at every residency,
    with and without rings, on both decode paths; a padded batch still gets HF's masks."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    shapes: list[tuple[int, ...]] = []
    sdpa = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping["sdpa"]

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        out = sdpa(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            shapes.append(tuple(out.shape))
        return out

    monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, "sdpa", spy)
    model = tiny_model(family, seed=7)
    ids = torch.randint(1, 211, (1, 150), generator=torch.Generator().manual_seed(8))
    ref = model.generate(ids, max_new_tokens=20, do_sample=False)
    assert any(sh[-2:] == (150, 150) for sh in shapes), shapes  # (HF's own: the prompt's size)
    for rings in ("1", "0"):
        monkeypatch.setenv("REVIVA_WINDOW_RINGS", rings)
        for layers in (1, 99):
            for own in (False, True):
                shapes.clear()
                config = RevivaConfig(
                    vram_budget=budget_for(model, 1, 150, 20, layers, 48), chunk_tokens=48
                )
                manager = RevivaManager(model, config)
                manager._own_decode = own
                out = manager.generate(ids, max_new_tokens=20, do_sample=False)
                assert torch.equal(out, ref), (rings, layers, own)
                assert all(sh[-2] < 150 for sh in shapes), (rings, layers, own, shapes)
    g = torch.Generator().manual_seed(9)
    batch = torch.zeros(2, 90, dtype=torch.long)
    mask = torch.zeros(2, 90, dtype=torch.long)
    for row, n in enumerate((90, 61)):
        batch[row, 90 - n :] = torch.randint(1, 211, (n,), generator=g)
        mask[row, 90 - n :] = 1
    ref = model.generate(batch, attention_mask=mask, max_new_tokens=12, do_sample=False)
    shapes.clear()
    manager = RevivaManager(model, RevivaConfig(vram_budget=budget_for(model, 2, 90, 12, 2)))
    out = manager.generate(batch, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert torch.equal(out, ref)
    assert any(sh[-2:] == (90, 90) for sh in shapes), shapes  # (padding: HF's masks)


@pytest.mark.parametrize("n,end", [(1, 150), (5, 150), (48, 150), (150, 150), (40, 45)])
def test_chunk_attention_within_a_sliding_window_is_the_band_masked_attention(
    n: int, end: int
) -> None:
    """chunk_attention with a window (Note [Sliding windows]): queries of tokens [start, end)
    against keys [0, end) give what SDPA gives with the explicit band mask (kv > q - W, kv <= q)
    over every key, for one query, a few (assisted decoding's candidates) and a chunk, also a
    first chunk longer than the window (its first queries see every key before them, its last
    ones not: a plain causal call there let them see every key)."""
    from reviva.generate.layer_attention import chunk_attention

    g = torch.Generator().manual_seed(3)
    window = 16
    start = end - n
    q = torch.randn(2, 4, n, 16, generator=g)
    k = torch.randn(2, 2, end, 16, generator=g)
    v = torch.randn(2, 2, end, 16, generator=g)
    pos_q = torch.arange(start, end)[:, None]
    pos_k = torch.arange(end)[None, :]
    band = (pos_k <= pos_q) & (pos_k > pos_q - window)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=band, scale=0.25, enable_gqa=True
    )
    got = chunk_attention(q, k, v, None, start, end, 0.25, "flash", window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    full = chunk_attention(q, k, v, None, start, end, 0.25, "flash")
    assert not torch.allclose(full, want, atol=1e-3), "the window changes nothing here"


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_with_left_padding_identical(family: str) -> None:
    model = tiny_model(family, seed=2)
    g = torch.Generator().manual_seed(3)
    lengths = [90, 57, 73]
    ids = torch.zeros(3, 90, dtype=torch.long)
    mask = torch.zeros(3, 90, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, 90 - n :] = torch.randint(1, 211, (n,), generator=g)
        mask[row, 90 - n :] = 1
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=64, do_sample=False)
    for layers, chunk, attention in [
        (99, None, "auto"),
        (3, None, "auto"),
        (4, 32, "whole"),
        (4, 32, "chunked"),
    ]:
        budget = budget_for(model, 3, 90, 64, layers, chunk, attention)
        config = RevivaConfig(vram_budget=budget, chunk_tokens=chunk, prefill_attention=attention)
        manager = RevivaManager(model, config)
        out = manager.generate(ids, attention_mask=mask, max_new_tokens=64, do_sample=False)
        if chunk is None:
            assert torch.equal(out, ref), f"layers={layers}: {(out != ref).sum().item()} differ"
        else:
            # Chunked prefill attends with a different kernel call (same math, other rounding):
            # nearly all tokens agree; the unchunked runs above are the exact check.
            agree = (out == ref).float().mean().item()
            assert agree > 0.9, f"chunked prefill: only {agree:.0%} of tokens agree"


def test_batch_encoding_input() -> None:
    model = tiny_model("llama")
    enc = {
        "input_ids": torch.randint(1, 211, (2, 40)),
        "attention_mask": torch.ones(2, 40, dtype=torch.long),
    }

    class Enc(dict):  # what a tokenizer returns: a Mapping with .keys()
        pass

    ref = model.generate(**enc, max_new_tokens=10, do_sample=False)
    out = RevivaManager(model).generate(Enc(enc), max_new_tokens=10, do_sample=False)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("family", FAMILIES)
def test_sampling_with_seed_identical(family: str) -> None:
    model = tiny_model(family, seed=4)
    ids = torch.randint(1, 211, (2, 60), generator=torch.Generator().manual_seed(5))
    kwargs = dict(max_new_tokens=48, do_sample=True, top_k=20, top_p=0.9, temperature=0.8)
    torch.manual_seed(123)
    ref = model.generate(ids, **kwargs)
    budget = budget_for(model, 2, 60, 48, 3)
    manager = RevivaManager(model, RevivaConfig(vram_budget=budget))
    torch.manual_seed(123)
    out = manager.generate(ids, **kwargs)
    assert torch.equal(out, ref)
    assert manager.get_memory_stats()["resident_layers_in_prefill"] == 0


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_several_sequences_per_prompt_identical(family: str) -> None:
    """num_return_sequences with sampling: generate repeats each prompt's row; the cache holds
    each prompt's K/V once (Note [Shared prompt K/V]: planned for the prompts' rows), streamed,
    and the tokens are plain HF's under the same seed."""
    model = tiny_model(family, seed=5)
    ids = torch.randint(1, 211, (2, 40), generator=torch.Generator().manual_seed(6))
    kwargs = dict(max_new_tokens=12, do_sample=True, top_k=20, num_return_sequences=3)
    torch.manual_seed(321)
    ref = model.generate(ids, **kwargs)
    assert ref.shape[0] == 6
    budget = budget_for(model, 2, 40, 12, 3)
    manager = RevivaManager(model, RevivaConfig(vram_budget=budget))
    torch.manual_seed(321)
    out = manager.generate(ids, **kwargs)
    assert torch.equal(out, ref)
    st = manager.get_memory_stats()
    assert st["resident_layers_in_prefill"] < 5 and st["decode_steps"] == 11, st
    assert st["shared_prompt_rows"] == 3


@pytest.mark.parametrize("with_ids", [False, True])
def test_inputs_embeds_identical(with_ids: bool) -> None:
    """The prompt given as embeddings (and, optionally, its ids too, which the output then
    starts with): plain HF's tokens, with streamed layers."""
    model = tiny_model("llama", seed=6)
    ids = torch.randint(1, 211, (2, 40), generator=torch.Generator().manual_seed(7))
    embeds = model.get_input_embeddings()(ids).detach()
    kwargs = dict(inputs_embeds=embeds, max_new_tokens=10, do_sample=False)
    if with_ids:
        kwargs["input_ids"] = ids
    ref = model.generate(**kwargs)
    budget = budget_for(model, 2, 40, 10, 3)
    manager = RevivaManager(model, RevivaConfig(vram_budget=budget))
    out = manager.generate(**kwargs)
    assert torch.equal(out, ref)
    assert manager.get_memory_stats()["resident_layers_in_prefill"] < 5
    with pytest.raises(ValueError, match="inputs_embeds while the prompt's hidden states"):
        RevivaManager(model, RevivaConfig(prefill_residual="host")).generate(**kwargs)


@pytest.mark.parametrize("pages", [0, 16])
def test_prompt_lookup_and_assisted_decoding_identical(pages: int) -> None:
    """Candidates verified several at a time, the rejected ones cut from the cache (crop ->
    KVStore.truncate, across pages too): greedy tokens are plain greedy's, with streamed layers,
    for prompt-lookup decoding and for an assistant model."""
    model = tiny_model("llama", seed=8)
    gen = torch.Generator().manual_seed(9)
    motif = torch.randint(1, 211, (1, 12), generator=gen)
    ids = torch.cat([motif, torch.randint(1, 211, (1, 20), generator=gen), motif, motif], dim=1)
    ref = model.generate(ids, max_new_tokens=24, do_sample=False)
    config = RevivaConfig(kv_page_tokens=pages)
    # (the first forward is the prompt and the first candidates: room for them too)
    budget = budget_keeping(
        model, config, 1, ids.shape[1] + 4, 24, lambda p: len(p.resident_layers) >= 1
    )
    manager = RevivaManager(model, dataclasses.replace(config, vram_budget=budget))
    out = manager.generate(ids, max_new_tokens=24, do_sample=False, prompt_lookup_num_tokens=4)
    assert torch.equal(out, ref)
    st = manager.get_memory_stats()
    assert st["decode_steps"] < 23, "no candidate was ever accepted: lookup not exercised"
    assert st["resident_layers_in_prefill"] < 5 and st["streamed_layers"] > 0, st
    assert st["paged_layers"] > 0 if pages else st["paged_layers"] == 0
    assistant = tiny_model("llama", seed=10)
    out = manager.generate(
        ids, max_new_tokens=24, do_sample=False, assistant_model=assistant, num_assistant_tokens=3
    )
    assert torch.equal(out, ref)


def test_store_timeline_records_the_calls_copies() -> None:
    """The store's timeline (Note [Traces]; benchmarks/diagnostics/diag_phases.py): on by default,
    each call's own; every fill of a streamed layer is a copy_to_device event whose bytes are that
    layer's valid tokens. With a capacity of 0 it keeps nothing (and the call has no trace)."""
    model = tiny_model("llama", seed=2)
    ids = torch.randint(1, 211, (1, 40), generator=torch.Generator().manual_seed(3))
    manager = RevivaManager(model, RevivaConfig(vram_budget=budget_for(model, 1, 40, 6, 2)))
    manager._timeline_capacity = 0
    manager.generate(ids, max_new_tokens=6, do_sample=False)
    assert manager._last_timeline == [] and manager._last_trace is None
    manager._timeline_capacity = 1000
    manager.generate(ids, max_new_tokens=6, do_sample=False)
    st = manager.get_memory_stats()
    fills = [e for e in manager._last_timeline if e["kind"] == "copy_to_device"]
    assert st["streamed_layers"] > 0 and len(fills) == st["fills"]
    assert sum(e["bytes"] for e in fills) == st["bytes_to_device"]
    assert all(0 <= e["start_s"] <= e["end_s"] and e["bytes"] > 0 for e in fills)


def test_eos_stopping_criteria_and_streamer() -> None:
    model = tiny_model("llama", seed=6)
    ids = torch.randint(1, 211, (1, 30), generator=torch.Generator().manual_seed(7))
    free = model.generate(ids, max_new_tokens=20, do_sample=False)
    eos = int(free[0, 30 + 5])  # the 6th new token becomes the end of sequence
    ref = model.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=eos)

    class Collect(BaseStreamer):
        def __init__(self) -> None:
            self.chunks: list[torch.Tensor] = []

        def put(self, value: torch.Tensor) -> None:
            self.chunks.append(value.clone())

        def end(self) -> None:
            self.chunks.append(torch.tensor([-1]))

    streamer = Collect()
    manager = RevivaManager(model, RevivaConfig(vram_budget=budget_for(model, 1, 30, 20, 2)))
    out = manager.generate(
        ids, max_new_tokens=20, do_sample=False, eos_token_id=eos, streamer=streamer
    )
    assert torch.equal(out, ref)
    assert out.shape[1] <= 30 + 6
    streamed = torch.cat([c.flatten() for c in streamer.chunks[1:-1]])
    assert torch.equal(streamed, out[0, 30:])
    assert int(streamer.chunks[-1]) == -1


def test_restore_leaves_model_exactly_as_before() -> None:
    model = tiny_model("mistral", seed=8)
    pristine = copy.deepcopy(model)
    ids = torch.randint(1, 211, (1, 64), generator=torch.Generator().manual_seed(9))
    manager = RevivaManager(model, RevivaConfig(vram_budget=budget_for(model, 1, 64, 16, 2)))
    with manager:
        assert "forward" in model.model.layers[0].__dict__
        inside = manager.generate(ids, max_new_tokens=16, do_sample=False)
        # (model.generate is the manager's here: Note [generate inside the with-block])
        routed = model.generate(ids, max_new_tokens=16, do_sample=False)
        # Outside generate, a wrapped model's forward behaves as plain HF (no Reviva cache).
        with torch.no_grad():
            assert torch.equal(model(ids).logits, pristine(ids).logits)
    assert torch.equal(inside, routed)
    for layer in (*model.model.layers, model.model.norm):
        assert "forward" not in layer.__dict__
    assert "generate" not in model.__dict__
    after = model.generate(ids, max_new_tokens=16, do_sample=False)
    never = pristine.generate(ids, max_new_tokens=16, do_sample=False)
    assert torch.equal(after, never)
    for (n1, p1), (n2, p2) in zip(
        model.state_dict().items(), pristine.state_dict().items(), strict=True
    ):
        assert n1 == n2 and torch.equal(p1, p2)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, pristine(ids).logits)


def test_budget_too_small_fails_before_any_work_naming_the_numbers() -> None:
    model = tiny_model("llama")
    ids = torch.randint(1, 211, (1, 100))
    manager = RevivaManager(model, RevivaConfig(vram_budget="100KB"))
    with pytest.raises(reviva.RevivaOutOfMemoryError, match=r"budget of 0\.1 MB.*needed"):
        manager.generate(ids, max_new_tokens=4)
    assert manager.get_memory_stats() is None
    assert "forward" not in model.model.layers[0].__dict__


def test_unsupported_models_and_options_are_named() -> None:
    with pytest.raises(ValueError, match=r"no `model\.config`"):
        RevivaManager(torch.nn.Linear(2, 2))
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="pin_memory=False"):
        RevivaManager(model, RevivaConfig(pin_memory=False))
    with pytest.raises(TypeError, match="RevivaConfig"):
        RevivaManager(model, {"vram_budget": "1GB"})  # type: ignore[arg-type]
    manager = RevivaManager(model)
    ids = torch.randint(1, 211, (1, 10))
    # Every Llama piece present, and a forward that does more (Glm4's extra norms, Granite's
    # residual multipliers): refused by class rather than run wrong
    from transformers import Glm4Config, GraniteConfig

    for cfg in (
        Glm4Config(**TINY, pad_token_id=0),
        GraniteConfig(**TINY, residual_multiplier=0.5, pad_token_id=0),
    ):
        other = AutoModelForCausalLM.from_config(cfg)
        name = type(other.model.layers[0]).__name__
        with pytest.raises(ValueError, match=rf"layers\[0\] is a .*\.{name}, not one of"):
            RevivaManager(other)
    eager = tiny_model("gemma2")
    eager.config._attn_implementation = "eager"  # (HF's eager attention caps Gemma 2's scores)
    with pytest.raises(ValueError, match=r"soft-capped at 50\.0.*attn_implementation='eager'"):
        RevivaManager(eager)
    for impl in ("reviva", "offloaded"):
        with pytest.raises(ValueError, match=f"cache_implementation='{impl}'"):
            manager.generate(ids, max_new_tokens=4, cache_implementation=impl)
    with pytest.raises(ValueError, match=r"inputs_embeds must be a \[batch, tokens, hidden\]"):
        manager.generate(inputs_embeds=torch.zeros(10, 64))
    with pytest.raises(ValueError, match=r"\[batch, tokens\] tensor.*shape \(10,\)"):
        manager.generate(ids[0])


def gpu_llama(layers: int, max_positions: int, dtype: torch.dtype) -> torch.nn.Module:
    """A 1B-shaped model (Llama-3.2-1B: hidden 2048, 32/8 heads, MLP 8192) on the GPU."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=max_positions,
        pad_token_id=0,
        eos_token_id=None,
    )
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()


@pytest.mark.gpu
def test_gpu_fp32_greedy_identical_1b_shape_4k() -> None:
    """A 1B-shaped model (Llama-3.2-1B: hidden 2048, 16 layers, 32/8 heads, MLP 8192), fp32,
    4k prompt: the same greedy tokens as plain HF with half the layers streamed, and the budget
    (peak allocated during generate) respected."""
    model = gpu_llama(16, 8192, torch.float32)
    device = "cuda"
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    ids = torch.randint(1, 32000, (1, 4096), device=device)
    ref = model.generate(ids, max_new_tokens=32, do_sample=False)
    # One chunk: the prefill makes exactly HF's calls, so fp32 tokens can be compared exactly.
    budget = budget_for(model, 1, 4096, 32, 8, chunk=4096)
    manager = RevivaManager(model, RevivaConfig(vram_budget=budget, chunk_tokens=4096))
    out = manager.generate(ids, max_new_tokens=32, do_sample=False)
    st = manager.get_memory_stats()
    assert torch.equal(out, ref), f"{(out != ref).sum().item()} tokens differ"
    assert st["resident_layers_in_prefill"] < 16  # some layers streamed (before promotion)
    assert st.peak_device_bytes <= budget, (st.peak_device_bytes, budget)


@pytest.mark.gpu
def test_gpu_bf16_logits_close_at_16k() -> None:
    """bf16, 16k prompt, streamed layers, decode with Reviva's own attention call.

    - Prefill with whole-prompt attention (HF's own call, projections and MLP by chunks): the
      first token's logits as close to an fp32 run as plain HF's (<= 1.5x). (Held to 1e-2 of
      HF's own logits until the H200 at 7657206 measured 1.94e-2 between them, while HF's and
      Reviva's errors from fp32 were 1.87e-2 and 1.82e-2: the chunked projections run other
      GEMM shapes than HF's whole-prompt ones, as accurate and rounded differently.)
    - Prefill with attention by query chunks, streaming in prefill and decode: lossless (the same
      logits, bit for bit, as the same configuration with every layer resident), and held to an
      fp32 run of the same weights on the same tokens: every step about as close to it as plain
      HF's (<= 1.5x). Chunked attention and the decode call run other kernels than HF's, which
      round differently (measured on the H200: 1.9e-2 from HF's first-token logits at 1k chunks,
      while HF's and Reviva's errors from fp32 were 2.7e-2 and 2.6e-2 in the demo)."""
    from reviva.cli.demo import fp32_reference_logits
    from reviva.cli.demo import relative_error as rel

    model = gpu_llama(8, 32768, torch.bfloat16)
    device = "cuda"
    with torch.no_grad():  # wide argmax margins: bf16 rounding should not flip greedy tokens
        model.lm_head.weight.mul_(8.0)
    prompt, new = 16384, 4
    ids = torch.randint(1, 32000, (1, prompt), device=device)
    kwargs = dict(
        max_new_tokens=new, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    ref = model.generate(ids, **kwargs)

    whole = dict(chunk_tokens=4096, prefill_attention="whole")
    budget = budget_for(model, 1, prompt, new, 5, chunk=4096, attention="whole")
    manager = RevivaManager(model, RevivaConfig(vram_budget=budget, **whole))
    out = manager.generate(ids, **kwargs)
    st = manager.get_memory_stats()
    assert st["resident_layers_in_prefill"] < 8
    assert st.peak_device_bytes <= budget
    first = fp32_reference_logits(model, ref.sequences[:, :prompt], keep=1)[:, 0]
    err_hf, err_rv = rel(ref.logits[0], first), rel(out.logits[0], first)
    assert err_rv <= 1.5 * err_hf, (err_rv, err_hf, rel(out.logits[0], ref.logits[0]))

    # Short chunks: a small prefill working set, so that few layers are promoted after prefill
    # and decode streams too.
    chunked = dict(chunk_tokens=1024, prefill_attention="chunked")
    budget = budget_for(model, 1, prompt, new, 3, chunk=1024, attention="chunked")
    manager = RevivaManager(model, RevivaConfig(vram_budget=budget, **chunked))
    out = manager.generate(ids, **kwargs)
    st = manager.get_memory_stats()
    assert st["resident_layers_in_prefill"] < 8 and st["streamed_layers"] > 0
    assert st["decode_steps"] == new - 1 and st["own_decode_attention"]
    assert st.peak_device_bytes <= budget
    resident = RevivaManager(model, RevivaConfig(**chunked)).generate(ids, **kwargs)
    assert torch.equal(resident.sequences, out.sequences)
    for t in range(new):
        assert torch.equal(resident.logits[t], out.logits[t]), f"step {t}: streaming changed it"

    # Every step while both runs chose the same tokens (teacher-forced fp32 on those tokens).
    same = int((ref.sequences[0, prompt:] == out.sequences[0, prompt:]).cumprod(0).sum())
    steps = min(same, new - 1)
    exact = fp32_reference_logits(model, ref.sequences[:, : prompt + steps], keep=steps + 1)
    for t in range(steps + 1):
        err_hf, err_rv = rel(ref.logits[t], exact[:, t]), rel(out.logits[t], exact[:, t])
        assert err_rv <= 1.5 * err_hf, (t, err_rv, err_hf)
    assert steps >= 1, "the first greedy token already differs: no decode step was compared"


@pytest.mark.gpu
def test_gpu_decode_graphs_same_tokens_reused_and_recaptured() -> None:
    """Note [Decode graphs]: bf16, graphs on against off: the same tokens and logits within bf16
    rounding, for a batch of two with streamed layers, then one sequence (recaptured for the new
    batch) twice: a call that captures does so at the end of prefill (what it left, at the
    end of its first decode step), so that later steps replay; the second call of a batch
    captures nothing;
    output_hidden_states runs eagerly with HF's hidden states per layer."""
    model = gpu_llama(8, 8192, torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    prompt, new, layers = 2048, 24, 8
    ids = torch.randint(1, 32000, (2, prompt), device="cuda")
    kwargs = dict(
        max_new_tokens=new, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    # 3 layers' K/V for two sequences, and no promotion after prefill (at this size prefill's
    # working set would make every layer resident in decode): the batch of two streams.
    budget = budget_for(model, 2, prompt, new, 3, chunk=512, attention="chunked")
    base = dict(vram_budget=budget, chunk_tokens=512, prefill_attention="chunked")
    eager = RevivaManager(model, RevivaConfig(cuda_graphs=False, **base))
    graphs = RevivaManager(model, RevivaConfig(**base))
    for m in (eager, graphs):
        m._promote_after_prefill = lambda: None
    steps = new - 1
    for call, batch in enumerate((2, 1, 1)):
        x = ids[:batch]
        ref = eager.generate(x, **kwargs)
        assert eager.get_memory_stats()["decode_graphs"].startswith("off: RevivaConfig")
        out = graphs.generate(x, **kwargs)
        st = graphs.get_memory_stats()
        assert st["decode_graphs"] == "on", st
        assert batch == 1 or st["streamed_layers"] > 0, st
        assert torch.equal(out.sequences, ref.sequences)
        for t in range(new):
            err = (out.logits[t].float() - ref.logits[t].float()).norm() / ref.logits[t].norm()
            assert err <= 1e-3, (batch, t, float(err))  # the same kernels: equal, in practice
        assert st["decode_graph_captures"] == (0 if call == 2 else layers), (call, st)
        # captured at the end of prefill; a layer left out there would be at the end of the
        # first decode step (23 steps to come: all of them)
        ahead, eager_steps = st["decode_graph_captures_ahead"], st["decode_graph_eager_steps"]
        assert eager_steps == (0 if call == 2 else layers - ahead), st
        assert st["decode_graph_replays"] + eager_steps == layers * steps, st
    # A hook on a layer's part must run at every step: that layer stays eager.
    seen = []
    handle = model.model.layers[2].mlp.down_proj.register_forward_hook(
        lambda m, a, o: seen.append(a[0].shape[1])
    )
    try:
        out = graphs.generate(ids[:1], **kwargs)
    finally:
        handle.remove()
    st = graphs.get_memory_stats()
    assert st["decode_graph_uncaptured"] == {2: "forward hooks on mlp.down_proj"}, st
    assert seen.count(1) == steps and st["decode_graph_replays"] == (layers - 1) * steps
    assert torch.equal(out.sequences, eager.generate(ids[:1], **kwargs).sequences)
    with_hidden = dict(kwargs, output_hidden_states=True)
    # (each output's hidden states go to the host at once: on the device they would count
    # against the next call's budget as memory already held)
    ref = [t.cpu() for t in eager.generate(ids[:1], **with_hidden).hidden_states[-1]]
    out = [t.cpu() for t in graphs.generate(ids[:1], **with_hidden).hidden_states[-1]]
    assert graphs.get_memory_stats()["decode_graph_replays"] == 0
    for a, b in zip(ref, out, strict=True):
        assert torch.equal(a, b)
    # and graphs are back for the next plain call (HF's recording hooks left on the model do
    # not count): layer 2, dropped while hooked, is captured again.
    graphs.generate(ids[:1], **kwargs)
    st = graphs.get_memory_stats()
    assert st["decode_graph_captures"] == 1, st
    assert st["decode_graph_replays"] == layers * steps - st["decode_graph_eager_steps"], st
    assert st["decode_graph_eager_steps"] <= 1, st


def test_decode_graphs_capture_only_plain_parts() -> None:
    """Note [Decode graphs]: a graph replays kernels only, so a layer is captured only when every
    part the decode path calls is a plain module with no hooks; hooks elsewhere (on self_attn,
    which the path never calls, as transformers' output capturing installs them) do not count."""
    from reviva.generate.graph_capture import uncapturable

    model = tiny_model("llama")
    layer = model.model.layers[0]
    assert uncapturable(layer) is None
    ids = torch.randint(1, 211, (1, 12), generator=torch.Generator().manual_seed(2))
    model.generate(ids, max_new_tokens=2, do_sample=False, output_hidden_states=True)
    assert uncapturable(layer) is None  # HF's recording hooks sit on self_attn and the layer
    handle = layer.self_attn.q_proj.register_forward_pre_hook(lambda m, a: None)
    assert uncapturable(layer) == "forward hooks on self_attn.q_proj"
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: None)
    try:
        assert uncapturable(layer) == "global module forward hooks are registered"
    finally:
        handle.remove()
    layer.mlp.down_proj._hf_hook = object()
    assert uncapturable(layer) == "accelerate hook on mlp.down_proj"
    del layer.mlp.down_proj._hf_hook

    class Adapter(torch.nn.Linear):  # e.g. a LoRA layer: state that a replay would not see
        pass

    plain = layer.self_attn.v_proj
    layer.self_attn.v_proj = Adapter(plain.in_features, plain.out_features, bias=False).eval()
    why = uncapturable(layer)
    assert why is not None and why.startswith("self_attn.v_proj is a ") and "Adapter" in why
    layer.self_attn.v_proj = plain
    layer.train()
    assert uncapturable(layer) == "input_layernorm is in training mode"
    layer.eval()
    assert uncapturable(layer) is None


def test_capture_ahead_while_busy_stops_when_the_device_catches_up() -> None:
    """Note [Decode graphs]: while prefill's later layers are issued, layers are captured, lowest
    first and skipping those with graphs, only while the device has not reached the event
    recorded before (its query turns true); at the end of prefill (no event) all the rest."""
    from reviva.generate.decode_graphs import DecodeGraphs

    model = tiny_model("llama")
    layers = list(model.model.layers)
    assert len(layers) >= 4
    graphs = DecodeGraphs(path=None)  # type: ignore[arg-type]
    order: list[int] = []

    def capture(i: int, layer: torch.nn.Module, h: torch.Tensor, cos, sin) -> None:
        order.append(i)
        graphs.layers[i] = (None, None, (), ())

    graphs.capture = capture  # type: ignore[method-assign]
    graphs.ready = lambda i, h: i in graphs.layers  # type: ignore[method-assign]

    class Event:  # the device reaches it after `busy` queries
        def __init__(self, busy: int) -> None:
            self.busy = busy

        def query(self) -> bool:
            self.busy -= 1
            return self.busy < 0

    h, rope = torch.zeros(1, 1, 64), (torch.zeros(1, 1, 16), torch.zeros(1, 1, 16))
    graphs.capture_ahead(layers, h, *rope, busy=Event(2))
    assert order == [0, 1] and graphs.captured_in_layers == 2
    graphs.capture_ahead(layers, h, *rope, busy=Event(0))  # the device had caught up
    assert order == [0, 1]
    graphs.capture_ahead(layers, h, *rope, busy=Event(1))
    assert order == [0, 1, 2]
    graphs.capture_ahead(layers, h, *rope)  # the end of prefill: all the rest
    assert order == list(range(len(layers)))
    assert graphs.captured_ahead == len(layers) and graphs.captured_in_layers == 3


def test_promotion_after_prefill_and_own_decode_attention() -> None:
    """A budget that holds 3 layers' K/V beside a large prefill working set: everything streams
    in prefill, then layers are promoted; Reviva's own decode attention call (used on CUDA in
    half precision, forced here) agrees with HF's layers."""
    model = tiny_model("llama", seed=11)
    ids = torch.randint(1, 211, (1, 1000), generator=torch.Generator().manual_seed(12))
    kwargs = dict(
        max_new_tokens=24, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    ref = model.generate(ids, **kwargs)
    # 512-token chunks: a prefill working set no larger than decode's, so that what frees up
    # after prefill is the third slot (decode keeps two) and one layer is promoted.
    budget = budget_for(model, 1, 1000, 24, 3, chunk=512)
    manager = RevivaManager(model, RevivaConfig(vram_budget=budget, chunk_tokens=512))
    plan = manager.plan(1, 1000, 24)
    assert plan.resident_layers == () and plan.slots == 3 and plan.decode_slots == 2
    manager._own_decode = True
    out = manager.generate(ids, **kwargs)
    st = manager.get_memory_stats()
    assert st["own_decode_attention"] and st["decode_steps"] == 23
    assert st["decode_graphs"].startswith("not used") and st["decode_graph_replays"] == 0
    assert st["promoted_layers"] == plan.promotable_layers()
    assert 0 < st["promoted_layers"] < 5  # some promoted, some still streamed in decode
    assert st["decode_slots"] == 2
    assert st["streamed_layers"] == 5 - st["promoted_layers"]
    for a, b in zip(ref.logits, out.logits, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    assert torch.equal(out.sequences, ref.sequences)


def test_prepare_pins_the_host_copies_ahead() -> None:
    model = tiny_model("llama", seed=13)
    ids = torch.randint(1, 211, (1, 120), generator=torch.Generator().manual_seed(14))
    manager = RevivaManager(model, RevivaConfig(vram_budget=budget_for(model, 1, 120, 8, 3)))
    plan = manager.prepare(1, 120, 8)
    assert plan.streamed_layers == 5
    before = manager.pool.stats()
    assert before["bytes_reserved"] >= plan.host_bytes
    out = manager.generate(ids, max_new_tokens=8, do_sample=False)
    after = manager.pool.stats()
    assert after["slabs_allocated"] == before["slabs_allocated"], "generate pinned new memory"
    assert torch.equal(out, model.generate(ids, max_new_tokens=8, do_sample=False))


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES + list(SLIDING))
def test_gpu_bf16_every_family_close_to_an_fp32_run(family: str) -> None:
    """Issue 15's families on CUDA in bf16 (a small model of each, 512-token prompt, 64-token
    chunks so that prefill runs Reviva's chunked attention, most layers' K/V streamed, its own
    decode path): the first token's logits as close to an fp32 run of the same weights as plain
    HF's bf16 ones are (<= 1.5x; 3x for expert models, whose routing a rounding can flip:
    MOE_FAMILIES), and the greedy tokens plain HF's while both runs agree on them."""
    from reviva.cli.demo import fp32_reference_logits
    from reviva.cli.demo import relative_error as rel

    model = tiny_model(family, seed=21).to(device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(1, 211, (1, 512), device="cuda")
    kwargs = dict(
        max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    ref = model.generate(ids, **kwargs)
    exact = fp32_reference_logits(model, ids, keep=1)
    budget = budget_for(model, 1, 512, 8, 3, chunk=64, attention="chunked")
    config = RevivaConfig(vram_budget=budget, chunk_tokens=64, prefill_attention="chunked")
    out = RevivaManager(model, config).generate(ids, **kwargs)
    err_hf, err_rv = rel(ref.logits[0], exact[:, 0]), rel(out.logits[0], exact[:, 0])
    factor = 3.0 if family.removesuffix("_sliding") in MOE_FAMILIES else 1.5
    assert err_rv <= factor * err_hf, (family, err_rv, err_hf)
    same = int((ref.sequences[0, 512:] == out.sequences[0, 512:]).cumprod(0).sum())
    assert same >= 1, "the first greedy token already differs"


def test_a_chat_continues_from_the_returned_cache_turn_after_turn() -> None:
    """Note [A returned cache] (cache/returned.py): a call with return_dict_in_generate=True returns
    its cache, parked in pinned host memory; the next turn (its tokens, then the user's new
    ones) continues from it with layers streamed and gives plain HF's tokens (HF continuing from
    its own DynamicCache, and HF recomputing every token); a parked cache is read, never
    written, so it serves twice; Reviva continues from HF's DynamicCache too; what cannot be
    continued is refused by name."""
    import copy

    model = tiny_model("llama", seed=8)
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(1, 211, (2, 30), generator=g)
    turns = [torch.randint(1, 211, (2, n), generator=g) for n in (7, 12)]
    kw = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    budget = budget_for(model, 2, 30 + 6 + 7 + 6 + 12, 6, 1)
    manager = RevivaManager(model, RevivaConfig(vram_budget=budget))

    ref = model.generate(ids, **kw)
    out = manager.generate(ids, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    st = manager.get_memory_stats()
    assert st.continued_tokens == 0 and st.returned_cache_host_bytes > 0, st
    assert out.past_key_values.get_seq_length() == ref.past_key_values.get_seq_length() == 35
    for user in turns:
        prompt = torch.cat([out.sequences, user], dim=1)
        hf_cache = copy.deepcopy(ref.past_key_values)
        ref = model.generate(prompt, past_key_values=ref.past_key_values, **kw)
        assert torch.equal(ref.sequences, model.generate(prompt, max_new_tokens=6))
        first = manager.generate(prompt, past_key_values=out.past_key_values, **kw)
        st = manager.get_memory_stats()
        assert torch.equal(first.sequences, ref.sequences)
        assert st["continued_tokens"] == out.past_key_values.get_seq_length(), st
        assert st["streamed_layers"] >= 3, st
        again = manager.generate(prompt, past_key_values=out.past_key_values, **kw)
        assert torch.equal(again.sequences, ref.sequences), "a parked cache is never written"
        from_hf = manager.generate(prompt, past_key_values=hf_cache, **kw)
        assert torch.equal(from_hf.sequences, ref.sequences)
        out = first

    prompt = torch.cat([out.sequences, turns[0]], dim=1)
    hf_cache = copy.deepcopy(ref.past_key_values)
    ref = model.generate(prompt, past_key_values=ref.past_key_values, **kw)
    own = RevivaManager(model, RevivaConfig(vram_budget=budget))
    own._own_decode = True  # (the CUDA half-precision path's decode, here on the CPU)
    assert torch.equal(
        own.generate(prompt, past_key_values=hf_cache, **kw).sequences, ref.sequences
    )
    with pytest.raises(ValueError, match="must extend the"):
        manager.generate(out.sequences[:, :20], past_key_values=out.past_key_values, **kw)
    with pytest.raises(ValueError, match="num_beams / num_return_sequences"):
        manager.generate(prompt, past_key_values=out.past_key_values, num_beams=2, **kw)
    with pytest.raises(ValueError, match="holds 2 rows, the call's prompt 1"):
        manager.generate(prompt[:1], past_key_values=out.past_key_values, **kw)
    with pytest.raises(ValueError, match="must be a cache a RevivaManager call returned"):
        manager.generate(prompt, past_key_values=[(prompt, prompt)], **kw)
    plain = manager.generate(ids, max_new_tokens=4)  # (no cache returned: nothing parked)
    assert torch.equal(plain, model.generate(ids, max_new_tokens=4))
    assert manager.get_memory_stats().returned_cache_host_bytes == 0

    del out, first, again, from_hf
    gc.collect()
    held = reviva.pinned_memory_stats()["bytes_in_use"]
    with pytest.raises(RuntimeError, match="streamer failed"):
        manager.generate(ids[:1], streamer=RaisingStreamer(2), **kw)  # (the first new token)
    assert reviva.pinned_memory_stats()["bytes_in_use"] == held
    assert torch.equal(manager.generate(ids, **kw).sequences, model.generate(ids, **kw).sequences)


@pytest.mark.parametrize("family", ["llama", "mistral_sliding", "gemma2_sliding"])
def test_a_padded_batch_continues_from_its_returned_cache(family: str) -> None:
    """Note [A returned cache]: a left-padded batch's returned cache is continued with the mask
    of every token so far: the new tokens' prefill attends the cache under HF's mask of their
    rows (LlamaLayerPath.prefill, past > 0 and padded), by chunks and with layers streamed, and
    gives the tokens HF gives continuing from its own cache and recomputing every token; twice,
    and from HF's DynamicCache too; sliding layers (a 16-token window) cut the mask to it."""
    import copy

    model = tiny_model(family, seed=12)
    g = torch.Generator().manual_seed(13)
    ids = torch.randint(1, 211, (2, 30), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    ids[0, :7] = 0
    kw = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_logits=True)
    budget = budget_for(model, 2, 30 + 6 + 9 + 6 + 9, 6, 1, chunk=4)
    manager = RevivaManager(model, RevivaConfig(vram_budget=budget, chunk_tokens=4))
    ref = model.generate(ids, attention_mask=mask, **kw)
    out = manager.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    for turn in range(2):
        user = torch.randint(1, 211, (2, 9), generator=g)
        prompt = torch.cat([out.sequences, user], dim=1)
        mask = torch.cat(
            [mask, torch.ones(2, prompt.shape[1] - mask.shape[1], dtype=mask.dtype)], 1
        )
        hf_cache = copy.deepcopy(ref.past_key_values)
        ref = model.generate(prompt, attention_mask=mask, past_key_values=ref.past_key_values, **kw)
        fresh = model.generate(prompt, attention_mask=mask, max_new_tokens=6, do_sample=False)
        assert torch.equal(ref.sequences, fresh), "HF's own continuation"
        got = manager.generate(
            prompt, attention_mask=mask, past_key_values=out.past_key_values, **kw
        )
        st = manager.get_memory_stats()
        assert st["continued_tokens"] == out.past_key_values.get_seq_length(), st
        assert st["streamed_layers"] >= 3 and st["prompt_tokens"] == 10, st
        assert torch.equal(got.sequences, ref.sequences), (turn, got.sequences, ref.sequences)
        # (greedy tokens of a tiny model hide much: the first new token's logits, of both rows)
        torch.testing.assert_close(got.logits[0], ref.logits[0], atol=1e-4, rtol=1e-4)
        again = manager.generate(
            prompt, attention_mask=mask, past_key_values=out.past_key_values, **kw
        )
        assert torch.equal(again.sequences, ref.sequences)
        from_hf = manager.generate(prompt, attention_mask=mask, past_key_values=hf_cache, **kw)
        assert torch.equal(from_hf.sequences, ref.sequences)
        out = got


def test_generate_inside_the_with_block_runs_through_reviva() -> None:
    """Note [generate inside the with-block] (generate/hf_surface.py): `with manager:
    model.generate(...)` is manager.generate: the same tokens and stats (layers streamed), with
    positional or keyword inputs and a positional GenerationConfig, nested blocks; what the manager
    refuses is refused there too; after the block the model's own generate is back (plain HF's
    tokens)."""
    from transformers import GenerationConfig

    model = tiny_model("llama", seed=18)
    ids = torch.randint(1, 211, (2, 40), generator=torch.Generator().manual_seed(19))
    kw = dict(max_new_tokens=8, do_sample=False)
    ref = model.generate(ids, **kw)
    manager = RevivaManager(model, RevivaConfig(vram_budget=budget_for(model, 2, 40, 8, 2)))
    want = manager.generate(ids, **kw)
    st_want = manager.get_memory_stats()
    assert st_want["streamed_layers"] >= 3 and torch.equal(want, ref)
    with manager:
        got = model.generate(ids, **kw)
        st = manager.get_memory_stats()
        assert torch.equal(got, ref)
        assert st["streamed_layers"] == st_want["streamed_layers"], st
        assert st["prompt_tokens"] == 40 and st["decode_steps"] == st_want["decode_steps"] > 0, st
        mask = torch.ones_like(ids)
        assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, **kw), ref)
        with manager:
            short = model.generate(ids, GenerationConfig(max_new_tokens=3, do_sample=False))
        assert torch.equal(short, ref[:, : 40 + 3])
        st = manager.get_memory_stats()  # (this call's: fewer steps than the calls before)
        assert 0 < st["decode_steps"] < st_want["decode_steps"], st
    assert "generate" not in model.__dict__
    with pytest.raises(ValueError, match="output_attentions=True"), manager:
        model.generate(ids, output_attentions=True, return_dict_in_generate=True, **kw)
    assert "generate" not in model.__dict__
    assert torch.equal(model.generate(ids, **kw), ref)


def test_hfs_defaults_for_the_length_of_a_call() -> None:
    """The new tokens of a call without max_new_tokens are HF's (GenerationMixin.
    _prepare_generated_length): 20 after the prompt by default, also for a prompt longer than 20
    tokens and within max_position_embeddings; a max_length in the call, in a GenerationConfig
    or in the model's; a max_length that does not exceed the prompt refused as HF refuses it."""
    from transformers import GenerationConfig

    model = tiny_model("llama", seed=20)
    ids = torch.randint(1, 211, (1, 37), generator=torch.Generator().manual_seed(21))
    manager = RevivaManager(model, RevivaConfig(vram_budget=budget_for(model, 1, 37, 20, 2)))
    for kw in ({}, {"max_length": 45}, {"generation_config": GenerationConfig(max_length=50)}):
        ref = model.generate(ids, do_sample=False, **kw)
        got = manager.generate(ids, do_sample=False, **kw)
        assert got.shape == ref.shape and torch.equal(got, ref), kw
    assert manager.generate(ids, do_sample=False).shape[1] == 37 + 20
    with pytest.raises(ValueError, match="input length of input_ids is 37, but max_length is 30"):
        manager.generate(ids, max_length=30, do_sample=False)
    with pytest.raises(ValueError, match="Input length of input_ids is 37"):
        model.generate(ids, max_length=30, do_sample=False)  # (HF refuses it too)
    # within max_position_embeddings, as HF caps it
    model.config.max_position_embeddings = 47
    try:
        assert torch.equal(
            manager.generate(ids, do_sample=False), model.generate(ids, do_sample=False)
        )
        assert manager.generate(ids, do_sample=False).shape[1] == 47
    finally:
        model.config.max_position_embeddings = TINY["max_position_embeddings"]


@pytest.mark.parametrize("family", ["mistral_sliding", "llama"])
def test_the_pad_id_in_a_prompt_without_a_mask_is_masked_as_hf_masks_it(family: str) -> None:
    """A prompt that holds the pad id, given without an attention_mask: HF's generate infers a
    mask (0 at the pad ids, where the pad id is no eos id) and so does the manager, for a
    sliding-window model too (it decided "not padded" from the kwargs alone: other tokens than
    HF's); a chat turn continuing a returned cache whose ids hold the pad id likewise."""
    model = tiny_model(family, seed=22)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 7, 2
    manager = RevivaManager(model, RevivaConfig(vram_budget=budget_for(model, 2, 48, 8, 2)))
    for seed in range(4):
        ids = torch.randint(8, 211, (2, 48), generator=torch.Generator().manual_seed(seed))
        ids[0, 5:9] = 7
        ids[1, 30] = 7
        ref = model.generate(ids, max_new_tokens=8, do_sample=False)
        got = manager.generate(ids, max_new_tokens=8, do_sample=False)
        assert torch.equal(got, ref), f"seed {seed}: {(got != ref).sum().item()} tokens differ"
    ids = torch.randint(8, 211, (1, 40), generator=torch.Generator().manual_seed(9))
    first = manager.generate(ids, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    turn = torch.cat([first.sequences, torch.tensor([[7, 7, 40, 41]])], dim=1)
    ref = model.generate(turn, max_new_tokens=6, do_sample=False)
    got = manager.generate(
        turn, past_key_values=first.past_key_values, max_new_tokens=6, do_sample=False
    )
    assert torch.equal(got, ref)


def test_eager_compiled_use_cache_and_what_is_refused_by_name() -> None:
    """HF's own options, honoured or refused by name: attn_implementation="eager" (HF's
    fallback, registered nowhere) gives HF's tokens; a torch.compile'd model (no generate of its
    own) runs the module it wraps; use_cache=False gives the same tokens (the manager's cache is
    what bounds memory; test_use_cache_false_returns_no_cache_as_hf); a model whose dtype
    changed after wrapping is refused naming what to do."""

    ids = torch.randint(1, 211, (1, 30), generator=torch.Generator().manual_seed(23))
    kw = dict(max_new_tokens=6, do_sample=False)
    torch.manual_seed(24)
    eager = AutoModelForCausalLM.from_config(LlamaConfig(**TINY, attn_implementation="eager"))
    ref = eager.generate(ids, **kw)
    assert torch.equal(RevivaManager(copy.deepcopy(eager)).generate(ids, **kw), ref)
    model = tiny_model("llama", seed=25)
    ref = model.generate(ids, **kw)
    compiled = torch.compile(copy.deepcopy(model))
    assert torch.equal(RevivaManager(compiled).generate(ids, **kw), ref)
    manager = RevivaManager(copy.deepcopy(model))
    assert torch.equal(manager.generate(ids, use_cache=False, **kw), ref)
    manager.model.half()
    with pytest.raises(ValueError, match="parameters are torch.float16 now, torch.float32 when"):
        manager.generate(ids, **kw)


def test_use_cache_false_returns_no_cache_as_hf() -> None:
    """use_cache=False (in the call, or in the model's generation_config) runs with the manager's
    cache (what bounds its memory: the same tokens) and returns what HF's generate returns: with
    return_dict_in_generate=True an output without past_key_values (None; nothing parked in
    pinned host memory), its other fields HF's; inputs_embeds, where HF caches anyway, returns
    the cache as HF does."""
    model = tiny_model("llama", seed=26)
    ids = torch.randint(1, 211, (2, 30), generator=torch.Generator().manual_seed(27))
    manager = RevivaManager(model, RevivaConfig(vram_budget=budget_for(model, 2, 30, 6, 2)))
    kw = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_scores=True)
    ref = model.generate(ids, use_cache=False, **kw)
    got = manager.generate(ids, use_cache=False, **kw)
    assert ref.past_key_values is None and "past_key_values" not in ref
    assert type(got) is type(ref) and list(got.keys()) == list(ref.keys()), got.keys()
    assert got.past_key_values is None
    assert torch.equal(got.sequences, ref.sequences)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got.scores, ref.scores, strict=True))
    assert manager.get_memory_stats().returned_cache_host_bytes == 0
    assert torch.equal(manager.generate(ids, use_cache=False, max_new_tokens=6), ref.sequences)
    # the model's own generation_config saying it
    model.generation_config.use_cache = False
    try:
        ref = model.generate(ids, **kw)
        got = manager.generate(ids, **kw)
        assert got.past_key_values is None and list(got.keys()) == list(ref.keys())
        assert torch.equal(got.sequences, ref.sequences)
        got = manager.generate(ids, use_cache=True, **kw)  # (the call's word over the model's)
        assert got.past_key_values.get_seq_length() == 35
    finally:
        model.generation_config.use_cache = True
    embeds = model.get_input_embeddings()(ids)
    ref = model.generate(inputs_embeds=embeds, use_cache=False, **kw)
    got = manager.generate(inputs_embeds=embeds, use_cache=False, **kw)
    assert list(got.keys()) == list(ref.keys()) and torch.equal(got.sequences, ref.sequences)
    assert got.past_key_values.get_seq_length() == ref.past_key_values.get_seq_length()


def test_an_empty_hf_cache_is_no_cache_as_in_hf() -> None:
    """An empty DynamicCache passed as past_key_values (the pattern of HF's docs: a cache made
    before the first turn) is the same as none for the prompt: HF's tokens, and the returned
    cache continues the chat."""
    from transformers import DynamicCache

    model = tiny_model("llama", seed=28)
    ids = torch.randint(1, 211, (2, 30), generator=torch.Generator().manual_seed(29))
    manager = RevivaManager(model, RevivaConfig(vram_budget=budget_for(model, 2, 48, 6, 2)))
    kw = dict(max_new_tokens=6, do_sample=False)
    ref = model.generate(ids, past_key_values=DynamicCache(), return_dict_in_generate=True, **kw)
    got = manager.generate(ids, past_key_values=DynamicCache(), return_dict_in_generate=True, **kw)
    assert torch.equal(got.sequences, ref.sequences)
    assert list(got.keys()) == list(ref.keys())
    assert got.past_key_values.get_seq_length() == ref.past_key_values.get_seq_length() == 35
    assert torch.equal(manager.generate(ids, past_key_values=DynamicCache(), **kw), ref.sequences)
    empty = DynamicCache(config=model.config)  # (its layers made, none holding a token)
    assert torch.equal(manager.generate(ids, past_key_values=empty, **kw), ref.sequences)
    turn = torch.cat([got.sequences, ids[:, :7]], dim=1)
    hf = model.generate(turn, past_key_values=ref.past_key_values, **kw)
    assert torch.equal(manager.generate(turn, past_key_values=got.past_key_values, **kw), hf)


def test_a_peft_model_on_inference_and_training() -> None:
    """A PEFT model (LoRA around the attention's projections, its B not zero) through all three
    entries: RevivaManager(peft_model).generate and the with-block give the PEFT model's own
    tokens (its adapters run inside the base model's layers), and offload_activations(peft_model)
    gives autograd's gradients of the adapters, bit for bit."""
    peft = pytest.importorskip("peft")
    model = tiny_model("llama", seed=26)
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    pm = peft.get_peft_model(model, lora)
    for name, p in pm.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    ids = torch.randint(1, 211, (1, 30), generator=torch.Generator().manual_seed(27))
    kw = dict(max_new_tokens=6, do_sample=False)
    ref = pm.generate(input_ids=ids, **kw)
    with pm.disable_adapter():  # (the adapters change the tokens: skipping them would show)
        assert not torch.equal(pm.generate(input_ids=ids, **kw), ref)
    manager = RevivaManager(pm)
    assert torch.equal(manager.generate(ids, **kw), ref)
    with manager:
        assert torch.equal(pm.generate(input_ids=ids, **kw), ref)
    assert manager.get_memory_stats()["decode_steps"] > 0

    def grads(offload: bool) -> dict:
        pm.zero_grad(set_to_none=True)
        ctx = offload_activations(pm) if offload else contextlib.nullcontext()
        with ctx:
            pm(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in pm.named_parameters() if p.grad is not None}

    want, got = grads(False), grads(True)
    assert want.keys() == got.keys() and len(want) > 0
    assert all(torch.equal(want[n], got[n]) for n in want)


def test_continuing_a_fp8_cache() -> None:
    """Note [A returned cache]: an fp8 cache parks its rows as they are and a call continuing
    from it writes them unchanged (no second rounding): continuing gives the tokens a single
    fp8 call over the whole conversation gives, in this tiny model; a bf16/fp32 call may
    continue from fp8 rows too (dequantized)."""
    model = tiny_model("llama", seed=10)
    ids = torch.randint(1, 211, (1, 40), generator=torch.Generator().manual_seed(11))
    kw = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    manager = RevivaManager(model, RevivaConfig(kv_dtype="fp8"))
    out = manager.generate(ids, **kw)
    assert manager.get_memory_stats()["kv_dtype"] == "fp8"
    prompt = torch.cat([out.sequences, ids[:, :9]], dim=1)
    cont = manager.generate(prompt, past_key_values=out.past_key_values, **kw)
    assert cont.sequences.shape == (1, 40 + 5 + 9 + 5)
    assert manager.get_memory_stats()["continued_tokens"] == 44
    other = RevivaManager(model, RevivaConfig())
    plain = other.generate(prompt, past_key_values=out.past_key_values, **kw)
    assert plain.sequences.shape == cont.sequences.shape


@pytest.mark.gpu
def test_gpu_chat_turns_and_beams_on_cuda() -> None:
    """On CUDA in bf16 (decode through Reviva's own attention call, layers streamed): a second
    turn continuing from the first's returned cache (Note [A returned cache]) and from HF's own
    DynamicCache: the first new token's logits within bf16 rounding of HF continuing from its
    DynamicCache (other attention kernels over the cache: rounded differently; the CPU tests
    hold the tokens exact in fp32); 3 beams sharing the prompt's K/V (Note [Shared prompt K/V])
    run with their shapes (beams_identical holds them exact in fp32 on the GPU)."""
    import copy

    model = gpu_llama(8, 8192, torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # (a peaked head: the first turn's tokens agree)
    g = torch.Generator(device="cuda").manual_seed(12)
    ids = torch.randint(1, 32000, (1, 300), device="cuda", generator=g)
    user = torch.randint(1, 32000, (1, 1024), device="cuda", generator=g)
    kw = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    ref = model.generate(ids, **kw)
    prompt = torch.cat([ref.sequences, user], dim=1)
    hf_cache = copy.deepcopy(ref.past_key_values)
    ref2 = model.generate(prompt, past_key_values=ref.past_key_values, output_logits=True, **kw)
    beams = dict(max_new_tokens=6, do_sample=False, num_beams=3)
    ref_b = model.generate(ids, **beams)
    del ref
    torch.cuda.empty_cache()  # (the budget is sized on what stays on the device)
    # (the second turn planned for its 1024 new tokens after the 303 held: 4 layers on the
    # device, the rest streamed; the first turn's 300 tokens fit beside more)
    budget = budget_keeping(
        model,
        RevivaConfig(prefill_residual="device"),  # (a continued turn's hidden states: device)
        1,
        1024,
        4,
        lambda p: len(p.resident_layers) + p.slots >= 4,
        past=303,
    )
    manager = RevivaManager(model, RevivaConfig(vram_budget=budget + (8 << 20)))
    out = manager.generate(ids, **kw)
    assert torch.equal(out.sequences, prompt[:, : out.sequences.shape[1]])
    turn = dict(past_key_values=out.past_key_values, output_logits=True, **kw)
    out2 = manager.generate(prompt, **turn)
    st = manager.get_memory_stats()
    assert st["continued_tokens"] == 303 and st["resident_layers_in_prefill"] < 8, st
    turn["past_key_values"] = hf_cache
    from_hf = manager.generate(prompt, **turn)
    want = ref2.logits[0].float()
    for got in (out2.logits[0].float(), from_hf.logits[0].float()):
        err = (got - want).abs().max().item() / want.abs().max().item()
        assert err < 3e-2, err
    out_b = manager.generate(ids, **beams)
    assert manager.get_memory_stats()["shared_prompt_rows"] == 3
    assert out_b.shape == ref_b.shape


@pytest.mark.gpu
def test_gpu_new_managers_hold_nothing_more_after_their_calls() -> None:
    """Note [One capture stream] (generate/graph_capture.py): managers made one after another in a
    process (each capturing decode graphs) leave nothing more allocated on the device after their
    calls: one side stream serves them all, so cuBLAS's per-stream workspace is taken once, and
    when the first manager is made (take_matmul_workspaces), not in its first call."""
    model = gpu_llama(2, 4096, torch.bfloat16)
    ids = torch.randint(1, 32000, (1, 256), device="cuda")
    first = RevivaManager(model)  # (the process's workspaces, once: taken as it is made)
    torch.cuda.synchronize()
    made = torch.cuda.memory_allocated()
    first.generate(ids, max_new_tokens=8)
    del first
    gc.collect()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    assert held - made < 1 << 20, "the first call left more held than the manager took"
    held = torch.cuda.memory_allocated()
    for _ in range(4):
        manager = RevivaManager(model)
        manager.generate(ids, max_new_tokens=8)
        assert manager.get_memory_stats()["decode_graph_captures"] > 0
        del manager
        gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - held < 1 << 20, torch.cuda.memory_allocated() - held


def gpu_mistral_512() -> torch.nn.Module:
    """A Mistral-shaped model (1B widths, 8 layers, a 512-token window), bf16 on the GPU."""
    torch.manual_seed(0)
    cfg = MistralConfig(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=8,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=8192,
        sliding_window=512,
        pad_token_id=0,
        eos_token_id=None,
    )
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()


def poison_stale_windows(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Note [Fetch tails]: from here on, every acquire of a layer fetched as its window fills the
    bytes before the window on the device with NaN (a read of them, masked or not, makes NaN).
    Returns the (layer, length) of each acquire poisoned."""
    acquire = RevivaCache.acquire
    poisoned: list[tuple[int, int]] = []

    def poisoning(self: RevivaCache, i: int) -> None:
        acquire(self, i)
        w = self.fetch_windows.get(i)
        on_device = w is not None and not self.paged(i) and i not in self._host_layers
        n = self.store.length(i) if on_device else 0
        if on_device and n > w:
            for part in self.store.kv(i, n):
                part[:, :, : n - w].fill_(float("nan"))
            poisoned.append((i, n))

    monkeypatch.setattr(RevivaCache, "acquire", poisoning)
    return poisoned


def greedy_runs_agree(run: Any, ref: Any, rel: float) -> int:
    """Two greedy runs of one call (sequences [1, n], one logits tensor per new token) agree
    within `rel` (relative norm of each step's logits): every step's logits until the first
    token that differs, that step's included. A token may differ only where the two runs'
    logits are that close (a near tie, flipped by rounding); the sequences part there, so later
    steps are not compared. Returns the number of steps whose tokens agree."""
    new = len(ref.logits)
    assert len(run.logits) == new and run.sequences.shape == ref.sequences.shape
    assert torch.equal(run.sequences[:, :-new], ref.sequences[:, :-new])  # (the prompts)
    for j, (a, b) in enumerate(zip(run.logits, ref.logits, strict=True)):
        err = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert err < rel, (j, err)
        if not torch.equal(run.sequences[:, j - new], ref.sequences[:, j - new]):
            return j
    return new


def test_greedy_runs_agree_up_to_a_near_tie_and_not_past_a_real_difference() -> None:
    """The comparison above, on made-up runs: equal runs agree at every step; a flip where the
    logits are close stops the comparison; logits that differ beyond `rel` fail, flipped or not;
    so does a NaN."""
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(1, 50, generator=g) for _ in range(6)]
    seq = torch.cat([torch.tensor([[7, 8]]), torch.stack([x.argmax(-1) for x in logits], 1)], 1)
    ref = SimpleNamespace(sequences=seq, logits=logits)
    assert (
        greedy_runs_agree(SimpleNamespace(sequences=seq.clone(), logits=list(logits)), ref, 1e-3)
        == 6
    )
    near = [x + 1e-4 * torch.randn(1, 50, generator=g) for x in logits]
    flipped = seq.clone()
    flipped[0, 2 + 3] = (flipped[0, 2 + 3] + 1) % 50  # (a flip at step 3, then other tokens)
    after = [*near[:4], *(torch.randn(1, 50, generator=g) for _ in range(2))]
    assert greedy_runs_agree(SimpleNamespace(sequences=flipped, logits=after), ref, 1e-3) == 3
    far = list(logits)
    far[1] = logits[1] * 1.5
    with pytest.raises(AssertionError):
        greedy_runs_agree(SimpleNamespace(sequences=seq.clone(), logits=far), ref, 1e-3)
    with pytest.raises(AssertionError):  # (a real difference that flips a token is no near tie)
        greedy_runs_agree(
            SimpleNamespace(sequences=flipped, logits=[*logits[:3], far[1], *logits[4:]]), ref, 1e-3
        )
    nan = list(logits)
    nan[0] = torch.full_like(logits[0], float("nan"))
    with pytest.raises(AssertionError):
        greedy_runs_agree(SimpleNamespace(sequences=seq.clone(), logits=nan), ref, 1e-3)


@pytest.mark.gpu
def test_gpu_sliding_layers_fetch_their_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [Fetch tails] on CUDA: a Mistral-shaped model (1B widths, 8 layers, a 512-token
    window) in bf16 with a 4k prompt and most layers' K/V streamed: fetching each streamed
    sliding layer's window alone never reads the stale bytes before the window (they are NaN
    here: poison_stale_windows), gives the logits of whole fetches (REVIVA_FETCH_WINDOWS=0) and
    moves fewer bytes; a turn continued from the returned cache too. Without rings
    (REVIVA_WINDOW_RINGS=0: a ring is its window already;
    test_gpu_window_rings_same_logits_as_whole_layers)."""
    monkeypatch.setenv("REVIVA_WINDOW_RINGS", "0")
    model = gpu_mistral_512()
    ids = torch.randint(1, 32000, (1, 4096), device="cuda")
    kw = dict(max_new_tokens=16, do_sample=False, output_logits=True, return_dict_in_generate=True)
    # (the process's first call takes cuBLAS's workspaces for the compute and capture streams,
    # held from then on: the budget is sized after them, Note [One capture stream]. It must
    # capture decode graphs: with 4 new tokens it captured none (fewer than 8 decode steps), and
    # on the H200 the second run's plan found 20-40 MB less room than the budget's probe)
    warm = RevivaManager(model)
    warm.generate(ids[:, :256], max_new_tokens=16)
    assert warm.get_memory_stats()["decode_graph_captures"] > 0
    del warm
    torch.cuda.empty_cache()
    # 4 of 8 layers on the device in decode, resident or promoted after prefill (at 3 layers in
    # prefill, the rest were promoted after it and decode streamed none on the H200, a6c1ff1);
    # the first call's own shape (the continued one's 65 tokens need less)
    budget = budget_keeping(
        model,
        RevivaConfig(),
        1,
        4096,
        16,
        # (the hidden states on the device: a host-residual plan's room is a few MB from not
        # fitting, and the H200 run held ~15 MB more at the call than at the probe, 10e3cd6)
        lambda p: not p.residual_on_host and len(p.resident_layers) + p.promotable_layers() >= 4,
    ) + (16 << 20)  # (the first call's outputs stay on the device through the second)
    runs = {}
    poisoned: list[tuple[int, int]] = []
    for windowed in (False, True):
        monkeypatch.setenv("REVIVA_FETCH_WINDOWS", "1" if windowed else "0")
        if windowed:
            poisoned = poison_stale_windows(monkeypatch)
        torch.cuda.empty_cache()
        manager = RevivaManager(model, RevivaConfig(vram_budget=budget))
        out = manager.generate(ids, **kw)
        st = manager.get_memory_stats()
        more = torch.cat([out.sequences, ids[:, :64]], dim=1)
        cont = manager.generate(more, past_key_values=out.past_key_values, **kw)
        # (what the comparison reads, on the host; the manager and the parked caches go before
        # the next run plans on the device's state)
        out = SimpleNamespace(sequences=out.sequences.cpu(), logits=[x.cpu() for x in out.logits])
        cont = SimpleNamespace(
            sequences=cont.sequences.cpu(), logits=[x.cpu() for x in cont.logits]
        )
        runs[windowed] = (out, st, cont)
        del manager
        gc.collect()
    (out, st, cont), (out0, st0, cont0) = runs[True], runs[False]
    assert st["fetch_window_layers"] == 8 and st0["fetch_window_layers"] == 0
    # (which layers each run streams at the end may differ: a windowed fetch maps less, and the
    # room left after prefill decides the promotions; on the H200 at f7329b6 the whole-fetch run
    # promoted every layer. The windowed run is the one under test: it must stream some.)
    assert st.streamed_layer_ids and st.decode.kv_streamed_layers > 0, st
    streamed = {i for i, _ in poisoned}
    assert set(st.streamed_layer_ids) <= streamed and max(n for _, n in poisoned) > 4096, poisoned
    for logits in (out.logits, cont.logits):
        assert all(torch.isfinite(x).all() for x in logits)  # (no stale byte was read)
    # Within bf16 rounding, not bit for bit: two runs of one call in one process can differ,
    # windowed or not. On the H100 at 108a154, five runs in one process (graphs off): the
    # windowed, the whole-fetch and the poisoned windowed runs gave bit-identical logits, and the
    # second run (windowed) differed from them from decode step 6 on (relative 0.0082, then
    # ~0.007); with graphs, the second run from step 5 (0.0128). Which step, and whether, varies
    # between processes: tracked as a finding (the run's cause is not known yet). Such a
    # difference can flip a greedy token of random weights (the continued turn's, in 1 of 3 runs
    # at 1161262 and at 100e442 alike, H100): the runs are compared as greedy_runs_agree says.
    print(
        "streamed layers, windowed and whole:", st["streamed_layer_ids"], st0["streamed_layer_ids"]
    )
    if greedy_runs_agree(out, out0, 2e-2) == len(out0.logits):  # (else the turns differ)
        greedy_runs_agree(cont, cont0, 2e-2)
    # Fewer bytes: a streamed layer's decode fetch is its window, not the whole layer's K/V
    # (what the whole-fetch run moved, when it streamed layers too; else what whole fetches of
    # the windowed run's streamed layers would have moved in its decode steps).
    whole = (
        st0.decode.bytes_to_device
        if st0.decode.kv_streamed_layers >= st.decode.kv_streamed_layers
        else len(st.streamed_layer_ids) * st.layer_kv_bytes * st.decode_steps
    )
    assert st.decode.bytes_to_device < whole / 2, (st.decode, st0.decode, whole)


@pytest.mark.gpu
def test_gpu_window_rings_same_logits_as_whole_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [Window rings] on CUDA: a Mistral-shaped model (1B widths, 8 layers, a 512-token
    window) in bf16, a 4k prompt in 512-token chunks and 48 new tokens, Reviva's own decode path
    with its graphs: keeping each layer as a ring of 511 + 512 rows (which wraps in prefill and
    in decode) gives the same tokens and logits within bf16 rounding as the same call with
    every token kept (REVIVA_WINDOW_RINGS=0), holds a ring's rows per layer, and a turn continued
    from its returned cache gives the same tokens too."""
    model = gpu_mistral_512()
    with torch.no_grad():  # (a peaked head: random bf16 weights' tokens flip on any rounding,
        model.lm_head.weight.mul_(8.0)  # as at 4b6fc75 without it)
    ids = torch.randint(1, 32000, (1, 4096), device="cuda")
    kw = dict(max_new_tokens=48, do_sample=False, output_logits=True, return_dict_in_generate=True)
    runs = {}
    for rings in ("1", "0"):
        monkeypatch.setenv("REVIVA_WINDOW_RINGS", rings)
        manager = RevivaManager(model, RevivaConfig(chunk_tokens=512))
        out = manager.generate(ids, **kw)
        st = manager.get_memory_stats()
        more = torch.cat([out.sequences, ids[:, :64]], dim=1)
        cont = manager.generate(more, past_key_values=out.past_key_values, **kw)
        runs[rings] = (
            SimpleNamespace(sequences=out.sequences.cpu(), logits=[x.cpu() for x in out.logits]),
            st,
            cont.sequences.cpu(),
        )
        del manager, out, cont
        gc.collect()
    (out, st, cont), (out0, st0, cont0) = runs["1"], runs["0"]
    assert st["window_ring_layers"] == 8 and st["window_ring_tokens"] == 511 + 512, st
    assert st0["window_ring_layers"] == 0 and st["own_decode_attention"]
    row = 2 * 8 * 64 * 2  # one token's K and V in a layer, bf16
    assert st["kv_cache_bytes"] == 8 * (511 + 512) * row
    assert st0["kv_cache_bytes"] == 8 * (4096 + 48) * row
    # Both against an fp32 run of the same weights, while their tokens agree: the rings' error
    # no more than the whole layers' by bf16 rounding. (H200 at 4b6fc75: the two runs' logits
    # 0.018 apart at step 1, norm-relative, all tokens alike; in the next run the whole layers'
    # late tokens changed while the rings' did not: other kernels' and graphs' rounding on
    # random weights' near-flat logits, as the fetch-tail test above notes)
    from reviva.cli.demo import fp32_reference_logits

    differ = (out.sequences[0, 4096:] != out0.sequences[0, 4096:]).nonzero()
    agree = int(differ[0]) if len(differ) else 48
    assert agree >= 1, "the first new token differs"
    steps = min(8, agree)
    exact = fp32_reference_logits(model, out.sequences[:, : 4096 + steps].cuda(), keep=steps)
    for j in range(steps):
        want = exact[:, j].cpu()
        errs = [((x.logits[j].float() - want).norm() / want.norm()).item() for x in (out, out0)]
        assert errs[0] <= 1.5 * errs[1] + 4e-3, (j, errs)
    # the continued turns ran (each from its own returned cache: rows parked, loaded into rings)
    assert cont.shape == cont0.shape == (1, 4096 + 48 + 64 + 48)
    assert torch.equal(cont[:, : 4096 + 48], out.sequences)
