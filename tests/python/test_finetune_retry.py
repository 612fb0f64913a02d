"""Note [Out of memory inside a step] and Note [Residency across lengths] (reviva/train/retry.py)
on the host backend: a torch out-of-memory injected once into a layer's forward, a layer's
backward (after some LoRA gradients were accumulated) or the loss makes the tuner stream more
layers and run that work again: the step completes, its loss and gradients are a plain run's,
stats() counts the retry, and the next steps keep the smaller residency; where nothing can be
given up the error names the plan. Steps of different lengths keep the residency in place."""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_finetune import (
    TOKENS,
    assert_bf16_as_close_as_plain,
    assert_close,
    batch,
    layer_budget,
    lora,
    one_thread,  # noqa: F401  (the module's fixture: one thread)
    step,
    tiny_llama,
)
from torch import nn

import reviva
from reviva.train import forwards as finetune_forwards
from reviva.train import retry as finetune_retry
from reviva.train.plan import plan_step
from reviva.train.retry import layers_to_give_up, requested_bytes

peft = pytest.importorskip("peft", reason="peft (a dev requirement) is needed for LoRA models")

# (300 KiB: a bit more than one of the tiny model's layers, 192 KiB: two are given up)
OOM = "CUDA out of memory. Tried to allocate 300.00 KiB. GPU 0 has a total capacity of 24 GiB"


def fail_once(tuner: Any, i: int, when: Callable[[torch.Tensor], bool], late: bool) -> dict:
    """Layer i's forward (the tuner's original) raises torch's out-of-memory the first time
    `when(x)` holds: before it runs (late=False), or after it ran and drew its random numbers
    (late=True). Returns the count of raises."""
    original = tuner._original[i]
    raised = {"n": 0}

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        hit = raised["n"] == 0 and when(x)
        if hit and not late:
            raised["n"] += 1
            raise torch.OutOfMemoryError(OOM)
        y = original(x, *args, **kwargs)
        if hit:
            raised["n"] += 1
            raise torch.OutOfMemoryError(OOM)
        return y

    tuner._original[i] = forward
    return raised


def fail_in_backward_once(tuner: Any, i: int) -> dict:
    """Layer i's recompute registers a hook on its input that raises torch's out-of-memory, the
    first time: the input's gradient comes last, after the layer's LoRA gradients accumulated."""
    original = tuner._original[i]
    raised = {"n": 0}

    def boom(grad: torch.Tensor) -> torch.Tensor:
        raised["n"] += 1
        raise torch.OutOfMemoryError(OOM)

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if raised["n"] == 0 and torch.is_grad_enabled() and x.requires_grad:
            x.register_hook(boom)
        return original(x, *args, **kwargs)

    tuner._original[i] = forward
    return raised


def pair(dropout: float = 0.0, resident: int = 3) -> tuple[nn.Module, nn.Module, Any]:
    base = tiny_llama(seed=1)
    plain = lora(copy.deepcopy(base), dropout=dropout)
    ours = lora(copy.deepcopy(base), dropout=dropout)
    kw = dict(chunk_tokens=16, loss_chunk_tokens=8)
    budget = layer_budget(ours, TOKENS * 2, resident, **kw)
    return plain, ours, reviva.finetune(ours, budget=budget, device="cpu", **kw)


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_an_out_of_memory_in_a_layers_forward_is_retried(dropout: float) -> None:
    """Layer 1's forward runs out of memory once, after drawing its dropout masks: the tuner
    streams layers (300 KiB asked: the two layers it would give up first, so one stays), runs
    the forward again from the same generators' state, and the step's loss and gradients are
    a plain run's; the next step keeps one layer resident and retries nothing."""
    plain, ours, tuner = pair(dropout)
    try:
        raised = fail_once(tuner, 1, lambda x: not torch.is_grad_enabled(), late=True)
        for s in range(2):
            data = batch(seed=10 + s, rows=2)
            torch.manual_seed(100 + s)
            ref_loss, ref = step(plain, data)
            torch.manual_seed(100 + s)
            got_loss, got = step(ours, data)
            assert got_loss == pytest.approx(ref_loss, rel=1e-6)
            assert_close(ref, got, rtol=1e-5, atol=1e-7, what=f"step {s}")
            st = tuner.stats()
            assert raised["n"] == 1
            assert st.oom_retries == 1 and st.retried_in == ["layer 1's forward"]
            assert st.resident_layers == 1 and st.streamed_layers == 2, st
            assert st.plan.resident_layers == (1,)
        assert tuner.weights.resident(1) and not tuner.weights.resident(0)
    finally:
        tuner.close()


@pytest.mark.parametrize("accumulated", [False, True])
def test_an_out_of_memory_in_a_layers_backward_counts_no_gradient_twice(accumulated: bool) -> None:
    """Layer 2's backward runs out of memory once after its LoRA gradients were accumulated
    (a hook on its input raises): the gradients are put back as they were before it (None, or
    the last micro-batch's under gradient accumulation) and the backward runs again; the
    accumulated gradients are a plain run's."""
    plain, ours, tuner = pair()
    try:
        raised = fail_in_backward_once(tuner, 2)
        batches = [batch(seed=30 + k, rows=2) for k in range(2 if accumulated else 1)]
        for model in (plain, ours):
            for data in batches:
                model(**data).loss.backward()
        ref = {n: p.grad for n, p in plain.named_parameters() if p.requires_grad}
        got = {n: p.grad for n, p in ours.named_parameters() if p.requires_grad}
        assert raised["n"] == 1
        assert_close(ref, got, rtol=1e-5, atol=1e-7, what="accumulated gradients")
        st = tuner.stats()
        assert st.oom_retries == 1 and st.retried_in == ["layer 2's backward"]
        assert st.streamed_layers == 2
    finally:
        tuner.close()


@pytest.mark.parametrize("where", ["the loss", "the logits returned beside the loss"])
def test_an_out_of_memory_in_the_loss_or_the_logits_is_retried(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain, ours, tuner = pair()
    try:
        calls = {"n": 0}

        def once(run: Callable[..., Any]) -> Callable[..., Any]:
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                calls["n"] += 1
                if calls["n"] == 1:
                    raise torch.OutOfMemoryError(OOM)
                return run(*args, **kwargs)

            return wrapped

        if where == "the loss":
            monkeypatch.setattr(finetune_forwards, "head_loss", once(finetune_forwards.head_loss))
        else:
            head = tuner.causal.lm_head
            monkeypatch.setattr(head, "forward", once(head.forward))
        data = batch(seed=40, rows=2)
        ref_loss, ref = step(plain, data)
        got_loss, got = step(ours, data)
        assert calls["n"] == 2
        assert got_loss == pytest.approx(ref_loss, rel=1e-6)
        assert_close(ref, got, rtol=1e-5, atol=1e-7, what=f"after {where}'s retry")
        assert tuner.stats().retried_in == [where]
    finally:
        tuner.close()


def test_an_out_of_memory_in_the_losss_backward_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loss's backward runs out of memory in its second chunk (after the first chunk's
    gradients were computed): it runs again from the start, and the gradients are a plain run's."""
    plain, ours, tuner = pair()
    try:
        from reviva.train import token_chunks

        own = token_chunks._chunk_loss
        calls = {"n": 0, "raised": 0}

        def chunk_loss(h: torch.Tensor, *args: Any) -> torch.Tensor:
            if torch.is_grad_enabled():  # (the backward's chunks)
                calls["n"] += 1
                if calls["n"] == 2 and not calls["raised"]:
                    calls["raised"] = 1
                    raise torch.OutOfMemoryError(OOM)
            return own(h, *args)

        monkeypatch.setattr(token_chunks, "_chunk_loss", chunk_loss)
        data = batch(seed=41, rows=2)
        ref_loss, ref = step(plain, data)
        got_loss, got = step(ours, data)
        assert calls["raised"] == 1
        assert got_loss == pytest.approx(ref_loss, rel=1e-6)
        assert_close(ref, got, rtol=1e-5, atol=1e-7, what="after the loss's backward's retry")
        assert tuner.stats().retried_in == ["the loss's backward"]
    finally:
        tuner.close()


def test_nothing_left_to_give_up_raises_naming_the_plan() -> None:
    """Every layer streamed already: the out-of-memory is FinetuneOutOfMemoryError naming where
    and the plan, nothing retried; the next step runs."""
    plain, ours, tuner = pair(resident=0)
    try:
        fail_once(tuner, 0, lambda x: not torch.is_grad_enabled(), late=False)
        with pytest.raises(reviva.FinetuneOutOfMemoryError, match="layer 0's forward.*0 of 3"):
            ours(**batch(seed=50, rows=2)).loss.backward()
        assert tuner.stats().oom_retries == 0
        data = batch(seed=51, rows=2)
        _, ref = step(plain, data)
        _, got = step(ours, data)
        assert_close(ref, got, rtol=1e-5, atol=1e-7, what="after the error")
    finally:
        tuner.close()


def fail_whole(tuner: Any, i: int, when: Callable[[torch.Tensor], bool]) -> dict:
    """Layer i's whole forward (the tuner's original: HF's layer) raises torch's out-of-memory
    whenever `when(x)` holds; returns the count of raises."""
    original = tuner._original[i]
    raised = {"n": 0}

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if when(x):
            raised["n"] += 1
            raise torch.OutOfMemoryError(OOM)
        return original(x, *args, **kwargs)

    tuner._original[i] = forward
    return raised


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_whole_layers_out_of_memory_with_every_layer_streamed_run_by_chunks(
    monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """finetune's default ("auto", its chunk shrunk to 16 tokens), every layer streamed: layer
    1's whole forward (or its whole recompute, in the backward) runs out of memory at rows of 48
    tokens, whatever it is given. The step turns to layers by chunks of 16 and completes: its
    loss and gradients are a plain run's, stats() counts one retry, the plan says chunks; the
    next step of that length is planned by chunks at once (no retry), and a row of 16 runs whole.
    With attention_chunk_tokens=None the same failure raises FinetuneOutOfMemoryError."""
    from reviva.train import plan as train_plan

    monkeypatch.setattr(train_plan, "AUTO_CHUNK_TOKENS", 16)
    plain, ours, tuner = pair(resident=0)
    grad = where == "backward"
    try:
        raised = fail_whole(tuner, 1, lambda x: x.shape[1] > 16 and torch.is_grad_enabled() == grad)
        for s, tokens in enumerate((48, 48, 16)):
            data = batch(seed=120 + s, rows=2, tokens=tokens)
            ref_loss, ref = step(plain, data)
            got_loss, got = step(ours, data)
            assert got_loss == pytest.approx(ref_loss, rel=1e-6)
            assert_close(ref, got, rtol=1e-5, atol=1e-7, what=f"step {s} ({tokens} tokens)")
            st = tuner.stats()
            assert raised["n"] == 1, raised
            assert st.oom_retries == 1 and st.retried_in == [f"layer 1's {where}"], st
            assert st.plan.attention_chunk_tokens == (16 if tokens == 48 else None), st.plan
            assert st.streamed_layers == 3
    finally:
        tuner.close()
    plain, ours, tuner = pair(resident=0)
    try:
        tuner.attention_chunk_tokens = None
        fail_whole(tuner, 1, lambda x: x.shape[1] > 16 and torch.is_grad_enabled() == grad)
        with pytest.raises(reviva.FinetuneOutOfMemoryError, match=f"layer 1's {where}"):
            ours(**batch(seed=130, rows=2, tokens=48)).loss.backward()
    finally:
        tuner.close()


def test_gradients_too_large_to_copy_are_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under gradient accumulation with trained gradients over RETRY_GRAD_COPY_BYTES, a backward
    that ran out of memory cannot be put back: the error is raised, nothing retried."""
    monkeypatch.setattr(finetune_retry, "RETRY_GRAD_COPY_BYTES", 0)
    _, ours, tuner = pair()
    try:
        ours(**batch(seed=60, rows=2)).loss.backward()
        fail_in_backward_once(tuner, 1)
        with pytest.raises(reviva.FinetuneOutOfMemoryError, match="layer 1's backward"):
            ours(**batch(seed=61, rows=2)).loss.backward()
        assert tuner.stats().oom_retries == 0
    finally:
        tuner.close()


def two_length_budget(model: nn.Module, short: int, long: int) -> int:
    """A budget whose plan keeps every layer resident at `short` tokens and one at `long`."""
    probe = reviva.finetune(copy.deepcopy(model), budget="1TB", device="cpu", chunk_tokens=16)
    try:
        dims, held = probe.dims, probe.plan(short).held

        def resident(budget: int, tokens: int) -> int:
            try:
                plan = plan_step(
                    dims,
                    tokens,
                    budget,
                    held,
                    16,
                    probe.loss_chunk_tokens,
                    logits=probe.return_logits,
                )
            except reviva.RevivaOutOfMemoryError:
                return -1
            return len(plan.resident_layers)

        for budget in range(1 << 20, 1 << 34, 1 << 12):
            if resident(budget, short) == 3 and resident(budget, long) == 1:
                return budget
    finally:
        probe.close()
    raise AssertionError("no budget keeps 3 layers at the short length and 1 at the long")


def test_steps_of_other_lengths_keep_the_residency_in_place() -> None:
    """Steps of 16, 160, 16 and 160 tokens: the long one gives up two layers, the short one after
    it keeps the one left (its working set was never measured: the host backend measures none),
    so no layer is filled again; with a measured working set the short one takes them back.
    Gradients as a plain run's throughout."""
    base = tiny_llama(seed=2)
    plain, ours = lora(copy.deepcopy(base)), lora(copy.deepcopy(base))
    short, long = 16, 160
    tuner = reviva.finetune(
        ours, budget=two_length_budget(ours, short, long), device="cpu", chunk_tokens=16
    )
    try:
        seen = []
        for s, tokens in enumerate([short, long, short, long]):
            data = batch(seed=70 + s, tokens=tokens)
            _, ref = step(plain, data)
            _, got = step(ours, data)
            assert_close(ref, got, rtol=1e-5, atol=1e-7, what=f"step {s} ({tokens} tokens)")
            seen.append(tuner.stats().resident_layers)
        assert seen == [3, 1, 1, 1]
        filled = tuner.weights.store.stats()["bytes_to_device"]
        # a measured working set at the short length: its plan is trusted, the layers come back
        tuner._measured[(short, None)] = 0
        step(ours, batch(seed=80, tokens=short))
        assert tuner.stats().resident_layers == 3
        assert tuner.weights.store.stats()["bytes_to_device"] > filled
    finally:
        tuner.close()


def test_requested_bytes_and_the_layers_given_up() -> None:
    assert requested_bytes(OOM) == 300 << 10
    assert requested_bytes("Tried to allocate 1.50 GiB") == int(1.5 * (1 << 30))
    assert requested_bytes("out of memory") is None
    sizes = (10, 10, 10, 10, 10)  # preference: 1, 2, 3, then 0 and 4 (given up first)
    assert layers_to_give_up((0, 1, 2, 3, 4), sizes, 25) == [4, 0, 3]
    assert layers_to_give_up((1, 2, 3), sizes, None) == [3, 2]  # (at least half their bytes)
    assert layers_to_give_up((1, 2), sizes, 1) == [2]
    assert layers_to_give_up((), sizes, 5) == []


@pytest.mark.gpu
def test_gpu_an_out_of_memory_in_a_backward_streams_more_and_the_step_completes() -> None:
    """CUDA, bf16, a 4-layer model with every layer's weights resident (the whole card): layer
    2's backward runs out of memory once (injected); the resident layers given up leave the
    device mid-step (unmapped), the backward runs again, and the LoRA gradients of three steps
    stay as close to an fp32 run's as a plain bf16 run's are (1.5 times its distance plus a bf16
    rounding of the largest); the later steps stream, retrying nothing."""
    base = tiny_llama(seed=11, layers=4)
    fp32 = lora(copy.deepcopy(base)).cuda()
    runs = {
        "fp32": fp32,
        "plain": copy.deepcopy(fp32).to(torch.bfloat16),
        "ours": copy.deepcopy(fp32).to(torch.bfloat16),
    }
    tuner = reviva.finetune(runs["ours"], chunk_tokens=128, loss_chunk_tokens=64)
    try:
        raised = fail_in_backward_once(tuner, 2)
        for s in range(3):
            data = batch(seed=90 + s, tokens=512, device="cuda")
            grads = {name: step(m, data, lr=0.0)[1] for name, m in runs.items()}
            assert_bf16_as_close_as_plain(grads, s)
            st = tuner.stats()
            assert raised["n"] == 1 and st.oom_retries == 1, st
            assert st.streamed_layers > 0 and st.retried_in == ["layer 2's backward"]
        assert tuner.weights.store.stats()["bytes_to_device"] > 0
    finally:
        tuner.close()
        runs.clear()
        gc.collect()


def test_a_step_past_the_hosts_pinned_memory_is_refused_before_any_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The checkpoints' pinned host memory checked at a training step's start (Note
    [Checkpoints on the host]): where the host cannot give them, FinetuneOutOfMemoryError names
    the bytes and the longest sequence the host holds, before any layer ran or any checkpoint
    was saved; evaluation (no checkpoints) still runs, and with the host's room the step does."""
    from reviva.plan.memory_state import HostState
    from reviva.train import step as finetune_step

    plain, ours, tuner = pair()
    try:
        data = batch(seed=95, rows=2)
        need = tuner.plan(TOKENS * 2).checkpoint_host_bytes
        tight = HostState(need - 1, need + (1 << 30), 1 << 30, 0)
        monkeypatch.setattr(finetune_step, "host_state", lambda pool: tight)
        calls = {"n": 0}
        handle = tuner.layers[0].register_forward_pre_hook(lambda m, a: calls.update(n=1))
        # (96 tokens x 3 layers x 64 fp32: one token short of them is 95 tokens)
        with pytest.raises(
            reviva.FinetuneOutOfMemoryError,
            match="a 96-token step pins .* 3 layers' checkpoints.* about 95 tokens",
        ):
            ours(**data).loss.backward()
        assert calls["n"] == 0 and tuner.checkpoints.manager.blocks == []
        with torch.no_grad():
            ours(**data)  # (no checkpoints: not refused)
        handle.remove()
        room = HostState(need, need + (1 << 30), 1 << 30, 0)
        monkeypatch.setattr(finetune_step, "host_state", lambda pool: room)
        _, ref = step(plain, data)
        _, got = step(ours, data)
        assert_close(ref, got, rtol=1e-5, atol=1e-7, what="with the host's room")
    finally:
        tuner.close()
