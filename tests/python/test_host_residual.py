"""Note [Residual stream on the host]: the prompt's hidden states in pinned host memory through
prefill, streamed through each layer by chunks (RevivaConfig(prefill_residual=...))."""

from __future__ import annotations

import gc

import pytest
import torch
from test_generate import FAMILIES, budget_for, gpu_llama, tiny_model

import reviva
from reviva import RevivaConfig, RevivaManager
from reviva.plan.memory_state import device_state
from reviva.plan.planner import make_plan


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("layers", "chunk"), [(99, 32), (3, 48), (1, 150), (2, 7)])
def test_greedy_tokens_identical_with_the_residual_on_the_host(
    family: str, layers: int, chunk: int
) -> None:
    """Every family, all resident down to one slot, chunks of 7 to the whole prompt: plain HF's
    greedy tokens and last-position logits, twice in a row; the call says where its prompt's
    hidden states were and gives their pinned memory back."""
    gc.collect()  # (earlier tests' managers in cycles, and their pinned memory, go first)
    model = tiny_model(family)
    ids = torch.randint(1, 211, (2, 150), generator=torch.Generator().manual_seed(1))
    kwargs = dict(max_new_tokens=24, do_sample=False, output_logits=True)
    ref = model.generate(ids, return_dict_in_generate=True, **kwargs)
    budget = budget_for(model, 2, 150, 24, layers, chunk, "chunked")
    config = RevivaConfig(vram_budget=budget, chunk_tokens=chunk, prefill_residual="host")
    manager = RevivaManager(model, config)
    for _ in range(2):
        out = manager.generate(ids, return_dict_in_generate=True, **kwargs)
        assert torch.equal(out.sequences, ref.sequences), (out.sequences != ref.sequences).sum()
        torch.testing.assert_close(out.logits[0], ref.logits[0], atol=1e-4, rtol=1e-4)
        st = manager.get_memory_stats()
        assert st["prefill_residual"] == "host", st
        assert st.residual_host_bytes == 2 * 150 * 64 * 4
        assert manager._residual is None and manager._placeholder is None
        # The returned cache's K/V is parked in pinned memory until it is dropped (Note [A
        # returned cache] in cache/returned.py); nothing else of the call is left there.
        parked = out.past_key_values.parked_bytes
        assert reviva.pinned_memory_stats()["bytes_in_use"] >= parked > 0  # (pool rounding)
        del out
        assert reviva.pinned_memory_stats()["bytes_in_use"] == 0


def wide_model() -> torch.nn.Module:
    """Wide and shallow: at 2048 tokens its hidden states (8 MiB) outweigh decode's working set,
    so where they live decides whether a plan fits."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(3)
    cfg = LlamaConfig(
        hidden_size=1024,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=211,
        max_position_embeddings=4096,
    )
    cfg.eos_token_id = None
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def test_auto_keeps_the_residual_on_the_device_while_it_fits() -> None:
    """ "auto" (the default) plans the measured path (hidden states on the device) whenever it
    fits, and moves them to the host only when that plan does not fit: then the call that
    "device" refuses runs, with plain HF's tokens."""
    model = wide_model()
    ids = torch.randint(1, 211, (1, 2048), generator=torch.Generator().manual_seed(4))
    manager = RevivaManager(model, RevivaConfig(chunk_tokens=64))
    state = device_state(manager.layout, manager.arena)
    plan = make_plan(manager.layout, RevivaConfig(chunk_tokens=64), state, 1, 2048, 8)
    assert not plan.residual_on_host and plan.residual_host_bytes == 0
    # The smallest budget with the residual on the host: too small for the device's.
    host = RevivaConfig(chunk_tokens=64, prefill_residual="host")
    budget = budget_for_config(manager, host, 2048, 8)
    tight = dict(vram_budget=budget, chunk_tokens=64)
    with pytest.raises(reviva.RevivaOutOfMemoryError, match="2048-token prompt"):
        make_plan(
            manager.layout, RevivaConfig(**tight, prefill_residual="device"), state, 1, 2048, 8
        )
    auto = make_plan(manager.layout, RevivaConfig(**tight), state, 1, 2048, 8)
    assert auto.residual_on_host and auto.residual_host_bytes == 2048 * 1024 * 4
    ref = model.generate(ids, max_new_tokens=8, do_sample=False)
    auto_manager = RevivaManager(model, RevivaConfig(**tight))
    out = auto_manager.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(out, ref)
    assert auto_manager.get_memory_stats()["prefill_residual"] == "host"


def test_a_turn_after_a_host_residual_call_plans_its_new_tokens_alone() -> None:
    """Note [A returned cache] (cache/returned.py): a call continued from a returned cache runs
    prefill over its new tokens alone, and is planned so (Plan.past_tokens): under a budget where a
    fresh call of the first turn's length needs its hidden states on the host (a continued call
    refuses that), the next turn's 41 tokens keep theirs on the device and give plain HF's tokens.
    (Planned as a 2100-token prompt it was refused on the H200, 7ecc25f.)"""
    model = wide_model()
    ids = torch.randint(1, 211, (1, 2048), generator=torch.Generator().manual_seed(14))
    user = torch.randint(1, 211, (1, 40), generator=torch.Generator().manual_seed(15))
    manager = RevivaManager(model, RevivaConfig(chunk_tokens=64))
    budget = budget_for_config(
        manager, RevivaConfig(chunk_tokens=64, prefill_residual="host"), 2048 + 8 + 40, 8
    )
    manager = RevivaManager(model, RevivaConfig(vram_budget=budget, chunk_tokens=64))
    kw = dict(max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    out = manager.generate(ids, **kw)
    assert manager.get_memory_stats()["prefill_residual"] == "host"
    ref = model.generate(ids, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    prompt = torch.cat([out.sequences, user], dim=1)
    fresh = manager.plan(1, prompt.shape[1], 8)
    assert fresh.residual_on_host, "a fresh call of this length needs the host"
    # (the cache holds the last generated token's K/V only once it is fed back: 2055 tokens)
    turn = manager.plan(1, 41, 8, past_tokens=2055)
    assert not turn.residual_on_host and turn.capacity == fresh.capacity == 2104
    assert turn.prompt_tokens == 41 and turn.past_tokens == 2055
    assert turn.working_set < fresh.working_set
    got = manager.generate(prompt, past_key_values=out.past_key_values, **kw)
    st = manager.get_memory_stats()
    assert st["prefill_residual"] == "device" and st["continued_tokens"] == 2055, st
    assert st["prompt_tokens"] == 41, st
    ref2 = model.generate(prompt, past_key_values=ref.past_key_values, **kw)
    assert torch.equal(got.sequences, ref2.sequences)
    with pytest.raises(ValueError, match="past_tokens must be an int >= 0, got -1"):
        manager.plan(1, 40, 8, past_tokens=-1)


def budget_for_config(manager: RevivaManager, config: RevivaConfig, prompt: int, new: int) -> int:
    from reviva.plan.planner import smallest_budget

    state = device_state(manager.layout, manager.arena)
    return smallest_budget(manager.layout, config, state, 1, prompt, new, lambda p: True)


def test_working_set_independent_of_the_prompt() -> None:
    """With the residual on the host the planned prefill working set does not grow with the
    prompt (chunk fixed), while the device residual's grows by a token's hidden state and rotary
    rows per token."""
    model = tiny_model("llama")
    manager = RevivaManager(model)
    state = device_state(manager.layout, manager.arena)
    sets = {}
    for mode in ("host", "device"):
        cfg = RevivaConfig(chunk_tokens=256, prefill_residual=mode, prefill_attention="chunked")
        sets[mode] = [
            make_plan(manager.layout, cfg, state, 1, n, 8).working_set for n in (4096, 65536)
        ]
    # (the decode working set holds a few bytes per token of capacity: positions)
    assert sets["host"][1] - sets["host"][0] <= (65536 - 4096) * 8
    assert sets["device"][1] - sets["device"][0] >= (65536 - 4096) * 64 * 4


def test_options_that_need_every_position_are_refused_by_name() -> None:
    model = tiny_model("qwen2")
    ids = torch.randint(1, 211, (1, 40), generator=torch.Generator().manual_seed(5))
    manager = RevivaManager(model, RevivaConfig(chunk_tokens=16, prefill_residual="host"))
    with pytest.raises(ValueError, match="output_hidden_states=True while the prompt's hidden"):
        manager.generate(
            ids, max_new_tokens=4, output_hidden_states=True, return_dict_in_generate=True
        )
    with pytest.raises(ValueError, match=r"logits_to_keep=0"):
        manager.generate(ids, max_new_tokens=4, logits_to_keep=0)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with pytest.raises(ValueError, match="a padded batch while"):
        manager.generate(ids, attention_mask=mask, max_new_tokens=4)
    # and the manager is whole afterwards
    ref = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(manager.generate(ids, max_new_tokens=4, do_sample=False), ref)
    with pytest.raises(
        ValueError, match="prefill_residual must be 'auto', 'device' or 'host', got 'disk'"
    ):
        RevivaConfig(prefill_residual="disk")


def test_an_exception_mid_prefill_gives_everything_back() -> None:
    """A layer that raises part way through a host-residual prefill: the model is restored, the
    pinned residual is back in the pool, and the next call gives plain HF's tokens."""
    model = tiny_model("llama", seed=6)
    ids = torch.randint(1, 211, (1, 90), generator=torch.Generator().manual_seed(7))
    ref = model.generate(ids, max_new_tokens=6, do_sample=False)
    manager = RevivaManager(model, RevivaConfig(chunk_tokens=32, prefill_residual="host"))
    mlp = model.model.layers[3].mlp
    calls = []

    def boom(module, args, output):  # noqa: ANN001, ANN202
        calls.append(args[0].shape[1])
        if len(calls) == 2:
            raise torch.OutOfMemoryError("injected")

    handle = mlp.register_forward_hook(boom)
    try:
        with pytest.raises(torch.OutOfMemoryError, match="injected"):
            manager.generate(ids, max_new_tokens=6, do_sample=False)
    finally:
        handle.remove()
    gc.collect()
    assert manager._residual is None and manager._placeholder is None
    assert reviva.pinned_memory_stats()["bytes_in_use"] == 0
    assert "forward" not in model.model.embed_tokens.__dict__
    assert "forward" not in model.model.rotary_emb.__dict__
    assert torch.equal(manager.generate(ids, max_new_tokens=6, do_sample=False), ref)


def test_pinned_tensor_of_the_pool() -> None:
    pool = reviva.PinnedHostPool(reviva.Runtime("cpu"))
    t = pool.tensor([3, 5], torch.bfloat16)
    assert t.shape == (3, 5) and t.dtype == torch.bfloat16 and t.device.type == "cpu"
    assert pool.stats()["bytes_in_use"] >= 30
    t.fill_(2.0)
    assert float(t.float().sum()) == 30.0
    del t
    assert pool.stats()["bytes_in_use"] == 0
    with pytest.raises(ValueError, match="negative size"):
        pool.tensor([2, -1], torch.float32)
    with pytest.raises(ValueError, match="overflows"):
        pool.tensor([1 << 40, 1 << 40], torch.float32)


@pytest.mark.gpu
def test_gpu_host_residual_bf16_tokens_and_memory() -> None:
    """CUDA, bf16, 8k prompt: the residual on the host gives the device residual's tokens, and
    torch's peak during prefill drops by about the prompt's hidden states and rotary tables."""
    model = gpu_llama(4, 16384, torch.bfloat16)
    ids = torch.randint(1, 32000, (1, 8192), device="cuda")
    outs, peaks = {}, {}
    for mode in ("device", "host"):
        m = RevivaManager(model, RevivaConfig(chunk_tokens=1024, prefill_residual=mode))
        outs[mode] = m.generate(ids, max_new_tokens=8, do_sample=False)
        st = m.get_memory_stats()
        assert st["prefill_residual"] == mode
        peaks[mode] = st.prefill.peak_device_bytes
    assert torch.equal(outs["host"], outs["device"])
    hidden = 8192 * 2048 * 2
    assert peaks["host"] <= peaks["device"] - hidden, peaks


@pytest.mark.gpu
def test_gpu_host_residual_copy_streams_batch_and_a_short_last_chunk() -> None:
    """Note [Residual stream on the host]: on CUDA the chunks are read in and written back on
    copy streams, into two buffers used in turn; a batch of two (each chunk computes on a copy of
    its buffer) and a prompt whose last chunk is short give the device residual's tokens, and
    first logits within bf16 rounding, twice in a row, and leave no pinned memory in use. (Both
    attend by chunks; with whole-prompt attention in device mode the first logits differed by up
    to 0.047 on the H200, 617485d: bf16 rounding of another kernel. A chunk read before its copy
    landed would give another hidden state altogether.)"""
    model = gpu_llama(3, 8192, torch.bfloat16)
    ids = torch.randint(1, 32000, (2, 5000), device="cuda")
    kwargs = dict(max_new_tokens=6, do_sample=False, output_logits=True)
    outs = {}
    held = reviva.pinned_memory_stats()["bytes_in_use"]  # (by objects of earlier tests)
    for mode in ("device", "host"):
        config = RevivaConfig(chunk_tokens=1024, prefill_residual=mode, prefill_attention="chunked")
        m = RevivaManager(model, config)
        for _ in range(2):
            out = m.generate(ids, return_dict_in_generate=True, **kwargs)
            assert m.get_memory_stats()["prefill_residual"] == mode
            # (the output's cache is parked in pinned memory until dropped: Note [A returned
            # cache] in cache/returned.py; the sequences and logits are all this test keeps)
            out = (out.sequences, out.logits)
            outs.setdefault(mode, out)
            assert torch.equal(out[0], outs[mode][0])
        del out
        assert reviva.pinned_memory_stats()["bytes_in_use"] == held
    assert torch.equal(outs["host"][0], outs["device"][0])
    torch.testing.assert_close(outs["host"][1][0], outs["device"][1][0], atol=0.1, rtol=0)


def test_a_plan_never_pins_more_than_the_host_can_give(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pinned host memory a call needs (streamed K/V, and the hidden states when they live on
    the host) is checked against what the host can give (MemAvailable less a reserve, plus the
    pool's unused pinned bytes): past it the call is refused with the numbers, before any work,
    instead of pushing the machine into swap."""
    import reviva.plan.memory_state as memory_state

    model = tiny_model("llama", seed=9)
    ids = torch.randint(1, 211, (1, 150), generator=torch.Generator().manual_seed(1))
    budget = budget_for(model, 1, 150, 8, 2, 32, "chunked")
    manager = RevivaManager(model, RevivaConfig(vram_budget=budget, chunk_tokens=32))
    ref = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(manager.generate(ids, max_new_tokens=8, do_sample=False), ref)
    st = manager.get_memory_stats()
    assert st["streamed_layers"] > 0
    reviva.release_pinned_memory()  # nothing cached in the pool: the system alone counts
    host = memory_state.host_state(manager.pool)
    assert host is not None and host.available <= host.system_available - (1 << 30)
    monkeypatch.setattr(memory_state, "_mem_available", lambda: (1 << 30) + 1000)
    with pytest.raises(reviva.RevivaOutOfMemoryError, match=r"pinned host memory .* host can give"):
        manager.generate(ids, max_new_tokens=8, do_sample=False)
    monkeypatch.undo()
    assert torch.equal(manager.generate(ids, max_new_tokens=8, do_sample=False), ref)
