"""Note [A stop decided a step late] (generate/stop_check.py): which calls defer HF's stop decision,
the scope that takes DeferredStopCheck for a Reviva call's cache alone, the cache's crop counting
the step taken back, and on the GPU the same tokens, streamed tokens, returned cache and
continuation as plain HF with an EOS that stops a call early."""

from __future__ import annotations

import pytest
import torch
from test_generate import tiny_model
from transformers import DynamicCache, GenerationConfig
from transformers.generation import utils as hf_generation
from transformers.generation.streamers import BaseStreamer

import reviva
from reviva import RevivaConfig, RevivaManager
from reviva.cache.kv_cache import RevivaCache
from reviva.generate.stop_check import deferring, defers

CUDA = torch.device("cuda")


def _supported(cache: object, device: torch.device = CUDA, assistant: bool = False) -> bool:
    return hf_generation.DeferredStopCheck.is_supported(device, cache, True, assistant)


def _cache(device: str = "cpu", layers: int = 2) -> RevivaCache:
    res = reviva.device_resources(device)
    return RevivaCache(
        res.engine,
        res.arena,
        layers,
        1,
        2,
        8,
        torch.float32,
        64,
        list(range(layers)),
        0,
        1,
        device=torch.device(device),
    )


def test_which_calls_defer() -> None:
    greedy = GenerationConfig(do_sample=False)
    assert defers(CUDA, greedy)
    assert not defers(torch.device("cpu"), greedy)
    assert not defers(CUDA, GenerationConfig(do_sample=True))
    assert not defers(CUDA, GenerationConfig(do_sample=False, num_beams=2))


def test_a_transformers_without_the_deferred_check_waits_each_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from reviva.generate import stop_check

    monkeypatch.setattr(stop_check, "_DEFERRED", None)
    assert not defers(CUDA, GenerationConfig(do_sample=False))
    cache = _cache()
    try:
        assert stop_check.stop_state(CUDA, cache) == (
            "each step (this transformers has no DeferredStopCheck)"
        )
    finally:
        cache.close()


def test_the_scope_defers_its_own_cache_alone_and_puts_hfs_rule_back() -> None:
    original = hf_generation.DeferredStopCheck.__dict__["is_supported"]
    ours, theirs, second = object(), DynamicCache(), object()
    assert not _supported(ours)
    with deferring(ours, True):
        assert _supported(ours)
        assert not _supported(ours, assistant=True)
        assert not _supported(ours, device=torch.device("cpu"))
        # another cache on CUDA: HF's own answer (MPS only in transformers 5.17)
        assert _supported(theirs) == original.__func__(CUDA, theirs, True, False)
        assert not _supported(second)
        with deferring(second, True):
            assert _supported(second) and _supported(ours)
        assert not _supported(second) and _supported(ours)  # (the first call still runs)
    assert hf_generation.DeferredStopCheck.__dict__["is_supported"] is original
    with pytest.raises(KeyError, match="raised inside"):
        with deferring(ours, True):
            raise KeyError("raised inside")
    assert hf_generation.DeferredStopCheck.__dict__["is_supported"] is original
    with deferring(ours, False):  # (a call that does not defer changes nothing)
        assert hf_generation.DeferredStopCheck.__dict__["is_supported"] is original


def test_the_cache_counts_the_step_it_takes_back() -> None:
    cache = _cache()
    try:
        for i in range(2):
            k = torch.randn(1, 2, 5, 8)
            cache.acquire(i)
            cache.write(i, 0, k, k + 1)
            cache.release(i)
        cache.crop(0)  # (HF's deferred check, every step)
        assert cache.get_seq_length(0) == 5 and cache.undone_steps == 0
        cache.crop(-1)  # not deferring: an assistant's rejected candidate, not counted
        assert cache.get_seq_length(1) == 4 and cache.undone_steps == 0
        cache.defers_stop = True
        cache.crop(-1)
        assert [cache.get_seq_length(i) for i in range(2)] == [3, 3]
        assert cache.undone_steps == 1
        cache.acquire(0)
        k3 = cache.view(0, 3)[0].clone()
        cache.write(0, 3, torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8))
        assert torch.equal(cache.view(0, 3)[0], k3)  # (the rows kept are untouched)
        cache.release(0)
        assert cache.get_seq_length(0) == 4
    finally:
        cache.close()


def test_a_cpu_call_waits_for_each_step_and_says_why() -> None:
    model = tiny_model("llama")
    ids = torch.randint(1, 200, (1, 12))
    manager = RevivaManager(model)
    out = manager.generate(ids, max_new_tokens=4, do_sample=False)
    st = manager.get_memory_stats()
    assert st["decode_stop"] == "each step (the device is cpu: deferred on CUDA only)"
    assert st["decode_steps_undone"] == 0 and st["decode_steps"] == 3
    assert torch.equal(out, model.generate(ids, max_new_tokens=4, do_sample=False))


class _Collect(BaseStreamer):
    """Each token handed over, and (given `steps`) the decode steps run when it came."""

    def __init__(self, steps: object = None) -> None:
        self.tokens: list[list[int]] = []
        self.steps_at: list[int] = []
        self.steps = steps or (lambda: -1)

    def put(self, value: torch.Tensor) -> None:
        self.tokens.append(value.flatten().tolist())
        self.steps_at.append(self.steps())

    def end(self) -> None:
        self.tokens.append([])


class _NoEvent:
    """torch.Event's stand-in on the CPU (HF's deferred check records and waits on events)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _run_stop_check(cache: object, tokens: list[int], eos: int | None) -> tuple[list, int]:
    """HF's loop around the module's DeferredStopCheck: each token's stop check after its step;
    returns (token, step when it was streamed) and the steps finish() undoes."""
    streamed: list[tuple[int, int]] = []
    step = 0

    class Streamer(BaseStreamer):
        def put(self, value: torch.Tensor) -> None:
            streamed.append((int(value.flatten()[0]), step))

    prompt = 5
    ids = torch.zeros(1, prompt, dtype=torch.long)
    check = hf_generation.DeferredStopCheck(ids, prompt + len(tokens), cache, False, Streamer())
    unfinished = torch.ones(1, dtype=torch.long)
    for step, tok in enumerate(tokens):
        if tok == eos:
            unfinished = torch.zeros(1, dtype=torch.long)
        if check(unfinished, torch.tensor([tok]), prompt + step + 1):
            break
    return streamed, check.finish()


def test_a_deferring_call_streams_its_first_token_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first new token reaches the streamer at its own step, those after it a step late, the
    last at the end; no token twice. Another cache meets HF's own check (the first token a step
    late) while a Reviva call defers."""
    monkeypatch.setattr(torch, "Event", _NoEvent)
    ours, theirs = object(), object()
    tokens = [11, 12, 13, 14, 15]
    with deferring(ours, True):
        streamed, undo = _run_stop_check(ours, tokens, None)
        assert streamed == [(11, 0), (12, 2), (13, 3), (14, 4), (15, 4)] and undo == 0
        streamed, undo = _run_stop_check(ours, tokens, 13)  # (an EOS: the step past it undone)
        assert streamed == [(11, 0), (12, 2), (13, 3)] and undo == 1
        streamed, undo = _run_stop_check(ours, tokens[:1], None)  # (one new token)
        assert streamed == [(11, 0)] and undo == 0
        streamed, undo = _run_stop_check(theirs, tokens, None)
        assert streamed == [(11, 1), (12, 2), (13, 3), (14, 4), (15, 4)] and undo == 0
    assert hf_generation.DeferredStopCheck is reviva.generate.stop_check._DEFERRED


def _eos_at(ref: torch.Tensor, prompt: int, first: int) -> tuple[int, int]:
    """A token of `ref`'s new tokens, from the `first`-th on, that is its first occurrence:
    (token, its index among the new tokens)."""
    new = ref[0, prompt:].tolist()
    for k in range(first, len(new)):
        if new[k] not in new[:k]:
            return new[k], k
    raise AssertionError(f"no new token from {first} on is a first occurrence: {new}")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "family,config",
    [
        ("llama", {}),
        ("llama", {"kv_dtype": "fp8"}),
        ("mistral_sliding", {}),  # (window rings: one token back within the ring's slack)
    ],
)
def test_gpu_an_early_stop_a_step_late_gives_hfs_tokens(family: str, config: dict) -> None:
    """On CUDA a greedy call decides its stop a step late: an EOS mid-call gives plain HF's
    tokens, its streamer's tokens and its returned cache's length, three calls in a row; the
    step run past the EOS is taken back (counted apart from the decode steps); a call that runs
    to its length runs none; a returned cache continues as HF's does."""
    model = tiny_model(family, device="cuda")
    torch.manual_seed(1)
    ids = torch.randint(1, 200, (1, 40), device="cuda")
    new = 16
    ref = model.generate(ids, max_new_tokens=new, do_sample=False)
    eos, k = _eos_at(ref, 40, 2)
    kw = dict(max_new_tokens=new, do_sample=False, eos_token_id=eos, pad_token_id=0)
    hf_streamer = _Collect()
    ref_eos = model.generate(ids, streamer=hf_streamer, **kw)
    assert ref_eos.shape[1] == 40 + k + 1  # (HF stops at the EOS)
    manager = RevivaManager(model, RevivaConfig(**config))
    for _ in range(3):
        streamer = _Collect(lambda: manager._phase.get("decode_steps", 0))
        out = manager.generate(ids, streamer=streamer, **kw)
        st = manager.get_memory_stats()
        assert torch.equal(out, ref_eos)
        assert streamer.tokens == hf_streamer.tokens
        # the prompt and the first new token before any decode step; the second a step late
        assert streamer.steps_at[:3] == [0, 0, 2], streamer.steps_at
        assert st["decode_stop"] == "deferred"
        assert st["decode_steps_undone"] == 1 and st["decode_steps"] == k
    full = manager.generate(ids, max_new_tokens=new, do_sample=False)
    st = manager.get_memory_stats()
    assert torch.equal(full, ref)
    assert st["decode_steps_undone"] == 0 and st["decode_steps"] == new - 1
    # a returned cache: HF's length, and a continuation as HF continues its own cache
    ret = dict(kw, return_dict_in_generate=True)
    hf_out = model.generate(ids, **ret)
    out = manager.generate(ids, **ret)
    assert torch.equal(out.sequences, hf_out.sequences)
    cache = out.past_key_values
    assert cache.get_seq_length() == hf_out.past_key_values.get_seq_length()
    more = torch.randint(1, 200, (1, 6), device="cuda")
    nxt = torch.cat([out.sequences, more], dim=1)
    # (a mask given: the tokens generated may hold the pad id, which HF would mask)
    again = dict(attention_mask=torch.ones_like(nxt), max_new_tokens=8, do_sample=False)
    hf_next = model.generate(nxt, past_key_values=hf_out.past_key_values, **again)
    got = manager.generate(nxt, past_key_values=cache, **again)
    assert torch.equal(got, hf_next)
    assert hf_generation.DeferredStopCheck.is_supported(CUDA, cache, True, False) is False


@pytest.mark.parametrize("padded", [False, True])
def test_decode_forwards_of_an_unpadded_call_read_no_mask(padded: bool) -> None:
    """Note [No mask read in decode steps] (generate/hf_surface.py): an unpadded call's decode
    forwards reach the model without HF's 2D mask (whose check would make the host wait each step);
    a padded call's keep it; tokens as plain HF's either way, twice."""
    model = tiny_model("llama")
    torch.manual_seed(2)
    ids = torch.randint(1, 200, (2, 10))
    mask = torch.ones_like(ids)
    if padded:
        ids[1, :3], mask[1, :3] = 0, 0
    seen: list[tuple[int, bool]] = []

    def hook(module, args, kwargs):  # noqa: ANN001, ANN202
        x = kwargs.get("input_ids")
        x = kwargs["inputs_embeds"] if x is None else x
        seen.append((x.shape[1], kwargs.get("attention_mask") is not None))

    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    handle = model.model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        ref = model.generate(ids, **kw)
        hf_prefill = seen[0]  # (transformers 5.25 passes no mask for an unpadded prompt)
        manager = RevivaManager(model)
        for _ in range(2):
            seen.clear()
            assert torch.equal(manager.generate(ids, **kw), ref)
            assert seen[0] == hf_prefill  # (prefill: the mask as HF passes it)
            assert seen[1:] == [(1, padded)] * 4
    finally:
        handle.remove()
