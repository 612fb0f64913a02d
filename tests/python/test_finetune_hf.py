"""reviva.finetune where HF defines the behaviour: packed sequences (position_ids restarting
inside a row, as TRL's packing and DataCollatorWithFlattening send them: Note [Packed
sequences] in reviva/train/step.py) give the plain model's loss and gradients whatever HF's
masks make of them, and a forward with labels returns HF's logits (Note [Logits with labels] in
reviva/train/forwards.py), or, with return_logits=False, refuses `logits` by name; the
Trainer's default remove_unused_columns reads the model's own forward signature. CPU."""

from __future__ import annotations

import copy
import inspect
from pathlib import Path
from typing import Any

import pytest
import torch
from test_finetune import (
    VOCAB,
    assert_close,
    dataset,
    lora,
    one_thread,
    step,
    tiny_llama,
    trained,
)
from test_finetune import train as train_recording
from test_trainer_hook import TRAINING
from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

import reviva
from reviva.train.plan import working_set

__all__ = ["one_thread"]  # (the module-scoped fixture: one torch thread)

KW = dict(chunk_tokens=16, loss_chunk_tokens=8)


def packed_batch(seed: int, lengths: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Sequences of `lengths` tokens flattened into one row by HF's padding-free collator:
    input_ids, labels (-100 at each sequence's first token) and restarting position_ids."""
    g = torch.Generator().manual_seed(seed)
    features = [{"input_ids": torch.randint(0, VOCAB, (n,), generator=g).tolist()} for n in lengths]
    data = DataCollatorWithFlattening(return_tensors="pt")(features)
    assert data["position_ids"].shape == (1, sum(lengths)) and "attention_mask" not in data
    return {k: data[k] for k in ("input_ids", "labels", "position_ids")}


def pair(seed: int = 1) -> tuple[torch.nn.Module, torch.nn.Module]:
    base = tiny_llama(seed=seed)
    return lora(copy.deepcopy(base)), lora(copy.deepcopy(base))


@pytest.mark.parametrize("mode", ["config_cache", "use_cache_false", "checkpointing"])
def test_packed_sequences_give_the_plain_models_loss_and_gradients(mode: str) -> None:
    """Three packed steps (an SGD update between them) against the plain model called the same
    way: with the config's use_cache (HF's forward builds a DynamicCache, and its mask then
    attends across the restarts), with use_cache=False and under HF's gradient checkpointing
    (block-diagonal masks, a sequence per restart). Reviva's step runs without a cache and gave
    the block-diagonal loss for the first (4.5865 against 4.5741, gradients 2.3 off)."""
    plain, ours = pair()
    extra: dict[str, Any] = {"use_cache": False} if mode == "use_cache_false" else {}
    if mode == "checkpointing":
        for m in (plain, ours):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            m.train()
    tuner = reviva.finetune(ours, device="cpu", **KW)
    try:
        for s, lengths in enumerate([(12, 10, 18, 8), (20, 7, 21), (30, 18)]):
            data = {**packed_batch(20 + s, lengths), **extra}
            ref_loss, ref = step(plain, data)
            got_loss, got = step(ours, data)
            assert got_loss == pytest.approx(ref_loss, rel=1e-6), (mode, s)
            assert_close(ref, got, rtol=1e-5, atol=1e-7, what=f"{mode}, step {s}")
    finally:
        tuner.close()


def test_packed_rows_of_a_batch_and_evaluation_match_plain() -> None:
    """Two rows packed differently (position_ids [2, tokens]), and an evaluation forward with
    labels under no_grad: the plain model's loss either way; the two mask readings differ, so
    the comparison can tell them apart."""
    plain, ours = pair(seed=3)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (2, 40), generator=g)
    pos = torch.cat(
        [
            torch.cat([torch.arange(15), torch.arange(25)]),
            torch.cat([torch.arange(30), torch.arange(10)]),
        ]
    ).view(2, 40)
    data = {"input_ids": ids, "labels": ids.clone(), "position_ids": pos}
    tuner = reviva.finetune(ours, device="cpu", **KW)
    try:
        for extra in ({}, {"use_cache": False}):
            ref_loss, ref = step(plain, {**data, **extra})
            got_loss, got = step(ours, {**data, **extra})
            assert got_loss == pytest.approx(ref_loss, rel=1e-6), extra
            assert_close(ref, got, rtol=1e-5, atol=1e-7, what=str(extra))
            with torch.no_grad():
                ref_eval = plain(**data, **extra).loss.item()
                got_eval = ours(**data, **extra).loss.item()
            assert got_eval == pytest.approx(ref_eval, rel=1e-6), extra
        with torch.no_grad():
            cached, separate = plain(**data).loss, plain(**data, use_cache=False).loss
        assert abs(cached - separate) > 1e-3  # (HF's two readings of the packing differ)
    finally:
        tuner.close()


def test_logits_with_labels_are_hfs() -> None:
    """A forward with labels returns HF's logits (values, dtype, shape) beside the loss, under
    autograd and without; an auxiliary term on them back-propagates as in the plain model. They
    were None."""
    plain, ours = pair(seed=5)
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, VOCAB, (2, 48), generator=g)
    data = {"input_ids": ids, "labels": ids.clone()}
    tuner = reviva.finetune(ours, device="cpu", **KW)
    try:
        ref_out, got_out = plain(**data), ours(**data)
        assert got_out.logits is not None and got_out.logits.requires_grad
        assert got_out.logits.shape == ref_out.logits.shape == (2, 48, VOCAB)
        assert got_out.logits.dtype == ref_out.logits.dtype
        assert torch.allclose(got_out.logits, ref_out.logits, rtol=1e-5, atol=1e-6)
        # (what the Trainer reads; a training step here keeps no K/V cache to return)
        assert list(got_out.keys()) == [
            k for k in ref_out.keys() if k not in ("past_key_values", "cache")
        ]
        for out in (ref_out, got_out):
            (out.loss + 1e-2 * out.logits.logsumexp(-1).square().mean()).backward()
        ref = {n: p.grad for n, p in trained(plain).items()}
        got = {n: p.grad for n, p in trained(ours).items()}
        assert_close(ref, got, rtol=1e-5, atol=1e-7, what="loss and z-loss on the logits")
        with torch.no_grad():
            assert torch.allclose(ours(**data).logits, plain(**data).logits, rtol=1e-5, atol=1e-6)
        with pytest.raises(ValueError, match="logits_to_keep"):
            ours(**data, logits_to_keep=1)
    finally:
        tuner.close()


def test_return_logits_false_refuses_logits_by_name_and_the_plan_counts_them() -> None:
    """return_logits=False: the loss and gradients as before, `logits` raises naming the
    option (never a silent None). The default's plan counts the [tokens, vocab] logits."""
    plain, ours = pair(seed=6)
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, VOCAB, (1, 48), generator=g)
    data = {"input_ids": ids, "labels": ids.clone()}
    with pytest.raises(TypeError, match="return_logits"):
        reviva.finetune(copy.deepcopy(ours), device="cpu", return_logits=1)
    tuner = reviva.finetune(ours, device="cpu", return_logits=False, **KW)
    try:
        out = ours(**data)
        with pytest.raises(ValueError, match="return_logits"):
            _ = out.logits
        assert list(out.keys()) == ["loss"] and out["loss"] is out.loss
        ref_loss, ref = step(plain, data)
        got_loss, got = step(ours, data)
        assert got_loss == pytest.approx(ref_loss, rel=1e-6)
        assert_close(ref, got, rtol=1e-5, atol=1e-7, what="return_logits=False")
        dims = tuner.dims
        without = tuner.plan(4096).working_set
    finally:
        tuner.close()
    logits = 4096 * dims.vocab_size * dims.dtype_bytes
    assert working_set(dims, 4096, 16, 8, logits=True) == working_set(dims, 4096, 16, 8) + logits
    assert without == working_set(dims, 4096, 16, 8)


def test_trainer_keeps_the_forwards_arguments_by_its_signature(tmp_path: Path) -> None:
    """HF's Trainer with its default remove_unused_columns=True keeps the dataset's columns
    that the model's forward names (inspect.signature of the PEFT model's base model): under
    finetune the forward's signature is the model's own, so input_ids stay and the LoRA
    gradients are the plain Trainer's. The patched forward's (*args, labels, **kwargs) made the
    Trainer drop input_ids: the model ran without them and failed."""
    base = tiny_llama(seed=8)
    model = lora(copy.deepcopy(base))
    own = inspect.signature(model.get_base_model().forward)
    args = dict(max_steps=2, **TRAINING)
    ref = train_recording(
        Trainer(
            model=lora(copy.deepcopy(base)),
            train_dataset=dataset(50),
            args=TrainingArguments(output_dir=str(tmp_path / "p"), **args),
        )
    )
    tuner = reviva.finetune(model, device="cpu", **KW)
    try:
        assert inspect.signature(model.get_base_model().forward) == own
        got = train_recording(
            Trainer(
                model=model,
                train_dataset=dataset(50),
                args=TrainingArguments(output_dir=str(tmp_path / "r"), **args),
            )
        )
        assert len(got) == len(ref) == 2 and tuner.stats().steps == 4
        for s in range(2):
            assert_close(ref[s], got[s], rtol=1e-5, atol=1e-7, what=f"Trainer step {s}")
    finally:
        tuner.close()
