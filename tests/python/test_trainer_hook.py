"""reviva.activations.hf_trainer: the HF Trainer with Reviva's activation offload
(enable_activation_offload, RevivaTrainerMixin, act_offloading_ctx_manager in TRL's place) gives the
plain Trainer's gradients bit for bit, with gradient accumulation, over several steps and train()
calls and two trainers side by side; the offload really moved the activations; an exception in the
middle of a step leaves nothing installed or held; bad input is named. CPU (host backend)."""

from __future__ import annotations

import contextlib
import copy
import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import reviva
from reviva import ActivationOffload
from reviva.activations.hf_trainer import (
    RevivaOffloadCallback,
    RevivaTrainerMixin,
    act_offloading_ctx_manager,
    enable_activation_offload,
)

VOCAB = 97


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread for these tiny models: on a loaded 2-core CI machine two threads spun
    against each other (a 2-step train() took 4.4-5 s against 0.43 s with one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def tiny_llama(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
    )
    return AutoModelForCausalLM.from_config(cfg)


def samples(seed: int, n: int = 8, length: int = 24) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (length,), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


# The arguments every trainer of these tests shares (HF's Trainer and TRL's SFTTrainer).
TRAINING = dict(
    per_device_train_batch_size=2,
    gradient_accumulation_steps=2,
    learning_rate=1e-2,
    optim="sgd",
    report_to=[],
    use_cpu=True,
    save_strategy="no",
    logging_strategy="no",
    seed=7,
    train_sampling_strategy="sequential",
    disable_tqdm=True,
)


def training_args(out: Path, max_steps: int = 2, **more: Any) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(out), max_steps=max_steps, remove_unused_columns=False, **TRAINING, **more
    )


class GradRecorder(TrainerCallback):
    """The accumulated gradients of each optimizer step (after clipping, before the update)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = kwargs["model"]
        self.steps.append({n: p.grad.clone() for n, p in model.named_parameters()})


def train(trainer: Trainer) -> list[dict[str, torch.Tensor]]:
    recorder = GradRecorder()
    trainer.add_callback(recorder)
    try:
        trainer.train()
    finally:
        trainer.remove_callback(recorder)
    return recorder.steps


def plain_grads(model: nn.Module, data: list, out: Path, max_steps: int = 2) -> list[dict]:
    trainer = Trainer(model=model, args=training_args(out, max_steps), train_dataset=data)
    return train(trainer)


def assert_identical(ref: list[dict], got: list[dict]) -> None:
    assert len(ref) == len(got) > 0
    for step, (a, b) in enumerate(zip(ref, got, strict=True)):
        assert a.keys() == b.keys()
        for n in a:
            assert torch.equal(a[n], b[n]), f"step {step}: gradient of {n} differs"


def assert_nothing_held(offload: ActivationOffload) -> None:
    assert not offload._active
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    offload.engine.synchronize()
    gc.collect()  # an exception's traceback may hold the graph (and its blocks) in a cycle
    assert offload.manager.blocks == [] and offload.manager.device_bytes == 0
    assert offload._in_use == 0
    assert reviva.pinned_memory_stats()["bytes_in_use"] == 0  # the process's pinned pool
    for layer in offload.layers:
        assert not layer._forward_hooks and not layer._forward_pre_hooks


@pytest.mark.parametrize("checkpointing", [False, True])
def test_trainer_gradients_identical_and_offload_ran(tmp_path: Path, checkpointing: bool) -> None:
    """enable_activation_offload on a plain Trainer (and with the Trainer's gradient
    checkpointing: what the layers save, their inputs, is offloaded): each optimizer step's
    accumulated gradients are the plain Trainer's, bit for bit, and every micro-batch moved its
    activations to the host and back."""
    data = samples(1)
    # (given to the constructor: transformers 5.25 reads the name it deprecated there alone)
    args = training_args(tmp_path / "plain", gradient_checkpointing=checkpointing)
    ref = train(Trainer(model=tiny_llama(seed=2), args=args, train_dataset=data))
    model = tiny_llama(seed=2)
    args = training_args(tmp_path / "reviva", gradient_checkpointing=checkpointing)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    hook = enable_activation_offload(trainer)
    assert isinstance(hook.offload, ActivationOffload) and hook.offload.model is model
    assert_identical(ref, train(trainer))
    checkpointed = any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    assert checkpointed == checkpointing
    st = hook.offload.stats
    # 2 optimizer steps of 2 micro-batches, each one forward and backward inside the offload.
    assert st.steps == 4 and hook.micro_batches == 4
    assert st.offloaded_tensors > 0 and st.bytes_to_host > 0
    assert st.bytes_to_device == st.bytes_to_host  # everything came back exactly once
    assert_nothing_held(hook.offload)


def test_mixin_trained_twice_and_beside_another_trainer(tmp_path: Path) -> None:
    """RevivaTrainerMixin: one offload per model reused over both train() calls; a second
    trainer of another model trained in between keeps its own; every step's gradients are the
    plain Trainer's."""

    class OffloadTrainer(RevivaTrainerMixin, Trainer):
        pass

    data_a, data_b = samples(3), samples(4)
    ref_a = plain_grads(tiny_llama(seed=5), data_a, tmp_path / "plain_a")
    ref_b = plain_grads(tiny_llama(seed=6), data_b, tmp_path / "plain_b")
    a = OffloadTrainer(
        model=tiny_llama(seed=5), args=training_args(tmp_path / "a"), train_dataset=data_a
    )
    b = OffloadTrainer(
        model=tiny_llama(seed=6),
        args=training_args(tmp_path / "b"),
        train_dataset=data_b,
        reviva_offload=RevivaOffloadCallback(prefetch_layers=1, window_bytes="64KiB"),
    )
    offload_a, offload_b = a.reviva_offload.offload, b.reviva_offload.offload
    assert offload_a is not offload_b and offload_b.window_bytes == 64 * 1024
    assert_identical(ref_a, train(a))
    assert_identical(ref_b, train(b))
    # a again: from its trained weights, the same as plain training from them.
    again_ref = plain_grads(copy.deepcopy(a.model), data_a, tmp_path / "plain_again")
    assert_identical(again_ref, train(a))
    assert a.reviva_offload.offload is offload_a and offload_a.stats.steps == 8
    assert offload_b.stats.steps == 4 and offload_b.stats.bytes_to_host > 0
    assert_nothing_held(offload_a)
    assert_nothing_held(offload_b)


def test_trl_style_context_in_training_step(tmp_path: Path) -> None:
    """act_offloading_ctx_manager in place of TRL's get_act_offloading_ctx_manager: a trainer
    that enters `maybe_activation_offload_context` around Trainer.training_step (as SFTTrainer
    does; TRL itself is not installed here) gets the plain gradients, the offload having run."""

    class SFTLikeTrainer(Trainer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.maybe_activation_offload_context = contextlib.nullcontext()

        def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            with self.maybe_activation_offload_context:
                return super().training_step(*args, **kwargs)

    data = samples(8)
    ref = plain_grads(tiny_llama(seed=9), data, tmp_path / "plain")
    trainer = SFTLikeTrainer(
        model=tiny_llama(seed=9), args=training_args(tmp_path / "trl"), train_dataset=data
    )
    trainer.maybe_activation_offload_context = act_offloading_ctx_manager(trainer.model)
    assert_identical(ref, train(trainer))
    st = trainer.maybe_activation_offload_context.stats
    assert st.steps == 4 and st.bytes_to_host > 0
    with pytest.raises(ValueError, match="already a Reviva ActivationOffload"):
        enable_activation_offload(trainer)  # both at once: one would shadow the other


def sft_trainer(model: nn.Module, out: Path, **config: Any) -> Any:
    """TRL's SFTTrainer on pre-tokenized samples (a word-level tokenizer of VOCAB ids, made here:
    SFTTrainer asks for one; nothing is downloaded), TRL's own collator padding them."""
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")),
        pad_token="t0",
        eos_token="t2",
        unk_token="t1",
    )
    g = torch.Generator().manual_seed(12)
    rows = [torch.randint(3, VOCAB, (int(n),), generator=g).tolist() for n in (24, 20) * 4]
    args = SFTConfig(output_dir=str(out), max_steps=2, **TRAINING, **config)
    return SFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_dict({"input_ids": rows}),
        processing_class=tokenizer,
    )


def test_trl_sft_trainer_with_reviva_offload(tmp_path: Path) -> None:
    """TRL's own SFTTrainer (trl, a dev requirement, in CI): its maybe_activation_offload_context
    set to act_offloading_ctx_manager(trainer.model), and a second trainer through
    enable_activation_offload, each give a plain SFTTrainer's gradients bit for bit (padded
    batches of two lengths, gradient accumulation), the offload having moved the activations;
    with SFTConfig's activation_offloading=True, TRL's own offload, Reviva's is refused by name.
    Found on its first run: TRL's entropy metric, computed with grad and detached, lets saved
    tensors go before backward (test_a_graph_let_go_before_backward_leaves_the_order)."""
    import trl

    ref = train(sft_trainer(tiny_llama(seed=9), tmp_path / "plain"))
    assert len(ref) == 2
    ctx = sft_trainer(tiny_llama(seed=9), tmp_path / "ctx")
    assert isinstance(ctx, trl.SFTTrainer)
    ctx.maybe_activation_offload_context = act_offloading_ctx_manager(ctx.model)
    assert_identical(ref, train(ctx))
    st = ctx.maybe_activation_offload_context.stats
    assert st.steps == 4 and st.bytes_to_host > 0 and st.bytes_to_device > 0, st
    hooked = sft_trainer(tiny_llama(seed=9), tmp_path / "hook")
    hook = enable_activation_offload(hooked)
    assert_identical(ref, train(hooked))
    assert hook.offload.stats.steps == 4 and hook.offload.stats.bytes_to_host > 0
    # (TRL's own offload makes CUDA streams at construction: on the CPU the switch is set after)
    theirs = sft_trainer(tiny_llama(seed=9), tmp_path / "trl")
    theirs.args.activation_offloading = True
    with pytest.raises(ValueError, match="activation_offloading=True"):
        enable_activation_offload(theirs)


def test_an_exception_mid_step_leaves_nothing_held(tmp_path: Path) -> None:
    """A layer that raises in the 3rd micro-batch (the second optimizer step, after layer 0's
    activations were offloaded): the offload is left (no hooks installed, nothing held on the
    manager or in the pinned pool) and the same trainer trains again with plain gradients."""
    data = samples(10)
    model = tiny_llama(seed=11)
    trainer = Trainer(model=model, args=training_args(tmp_path / "reviva"), train_dataset=data)
    hook = enable_activation_offload(trainer)
    calls = {"n": 0}

    def boom(module: nn.Module, args: object) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom in layer 1")

    handle = model.model.layers[1].register_forward_pre_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="boom in layer 1"):
            trainer.train()
    finally:
        handle.remove()
    assert hook.offload.stats.steps == 3 and hook.micro_batches == 2
    assert_nothing_held(hook.offload)
    ref = plain_grads(copy.deepcopy(model), data, tmp_path / "plain")
    assert_identical(ref, train(trainer))
    assert hook.offload.stats.steps == 7
    assert_nothing_held(hook.offload)


class NoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        return {"loss": self.proj(x).pow(2).mean()}


def test_bad_input_is_named(tmp_path: Path) -> None:
    model = tiny_llama(seed=12)
    data = samples(13, n=4)

    def trainer_of(m: nn.Module = model) -> Trainer:
        return Trainer(model=m, args=training_args(tmp_path), train_dataset=data)

    with pytest.raises(TypeError, match="hooks a transformers.Trainer, got LlamaForCausalLM"):
        enable_activation_offload(model)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="NoLayers has no decoder layers"):
        enable_activation_offload(trainer_of(NoLayers()))
    with pytest.raises(ValueError, match="prefetch_layers must be an int >= 0, got -1"):
        enable_activation_offload(trainer_of(), prefetch_layers=-1)
    with pytest.raises(ValueError, match="memory must be 'torch' or 'arena', got 'disk'"):
        enable_activation_offload(trainer_of(), memory="disk")
    with pytest.raises(TypeError, match="budgte"):
        enable_activation_offload(trainer_of(), budgte="8GB")
    with pytest.raises(ValueError, match="budget given with offload="):
        enable_activation_offload(trainer_of(), ActivationOffload(model), budget="8GB")
    with pytest.raises(TypeError, match="offload must be a reviva.ActivationOffload, got str"):
        RevivaOffloadCallback("all")  # type: ignore[arg-type]
    other = tiny_llama(seed=14)
    with pytest.raises(ValueError, match="made for a LlamaForCausalLM that is neither"):
        enable_activation_offload(trainer_of(), ActivationOffload(other))
    # An offload of one of the model's modules (a PEFT model's base model) is accepted.
    inner = ActivationOffload(model.model, layers=list(model.model.layers))
    assert enable_activation_offload(trainer_of(), inner).offload is inner
    trainer = trainer_of()
    enable_activation_offload(trainer)
    with pytest.raises(ValueError, match="already runs Reviva's activation offload"):
        enable_activation_offload(trainer)
    trainer = trainer_of()
    trainer.args.activation_offloading = True  # TRL's SFTConfig switch
    with pytest.raises(ValueError, match="activation_offloading=True"):
        enable_activation_offload(trainer)
    with pytest.raises(TypeError, match="reviva_offload must be a RevivaOffloadCallback, got dict"):

        class OffloadTrainer(RevivaTrainerMixin, Trainer):
            pass

        OffloadTrainer(model=model, args=training_args(tmp_path), reviva_offload={"budget": 1})
    # Added as a plain callback it could wrap nothing: refused when training starts.
    trainer = Trainer(
        model=model,
        args=training_args(tmp_path),
        train_dataset=data,
        callbacks=[RevivaOffloadCallback()],
    )
    with pytest.raises(ValueError, match="added as a callback only"):
        trainer.train()


def test_a_trainer_that_bypasses_the_mixin_is_refused(tmp_path: Path) -> None:
    """The mixin after the Trainer in the bases (neither its __init__ nor its training_step
    would run) is refused when the class is made; a training_step override that skips the
    mixin's runs no micro-batch inside the offload, which the first optimizer step reports,
    instead of training silently without it."""
    with pytest.raises(TypeError, match=r"Misordered: RevivaTrainerMixin must come before"):

        class Misordered(Trainer, RevivaTrainerMixin):
            pass

    class Bypassing(RevivaTrainerMixin, Trainer):
        def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            return Trainer.training_step(self, *args, **kwargs)

    trainer = Bypassing(
        model=tiny_llama(seed=15), args=training_args(tmp_path), train_dataset=samples(16, n=4)
    )
    with pytest.raises(RuntimeError, match="step 1 ran no micro-batch inside the offload"):
        trainer.train()


def test_import_reviva_does_not_import_transformers_hook() -> None:
    import subprocess
    import sys

    code = (
        "import sys, reviva; assert 'transformers' not in sys.modules, 'transformers imported'; "
        "assert reviva.enable_activation_offload.__module__ == 'reviva.activations.hf_trainer'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
