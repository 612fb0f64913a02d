"""Reviva's activation offload in the HF Trainer: each micro-batch's forward and its backward
run inside the model's one ActivationOffload (reviva.activations.offload), on any Trainer subclass
(TRL's SFTTrainer is one); the gradients are those of the plain Trainer, bit for bit.

    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
    from reviva.activations.hf_trainer import enable_activation_offload

    model = AutoModelForCausalLM.from_pretrained(model_id, dtype=torch.bfloat16)
    args = TrainingArguments("out", per_device_train_batch_size=8, gradient_accumulation_steps=4)
    trainer = Trainer(model=model, args=args, train_dataset=train_data)
    hook = enable_activation_offload(trainer, budget="8GB")  # after the Trainer placed the model
    trainer.train()
    print(hook.offload.stats)  # bytes_to_host, stall_s, overlap_ratio, ...
    # Or, as a class: class OffloadTrainer(RevivaTrainerMixin, SFTTrainer): pass

Note [Why training_step] (transformers 5.17, Trainer._run_epoch). An ActivationOffload is one
forward and its backward per `with`: the backward order, the prefetch window and budget mode's
plan are per step. The callback events do not bracket a micro-batch: on_step_begin fires once
per optimizer step, before the first of its gradient_accumulation_steps micro-batches;
on_substep_end after each of the others; on_pre_optimizer_step after the last one's backward
and the gradient clipping. Entering and leaving at those events would work while nothing fails,
but no event follows an exception: the saved-tensor hooks would stay installed on the thread,
and every later autograd op of the process (the caller's next forward, another trainer's) would
be offloaded into a step that never ends. The micro-batch is Trainer.training_step: compute_loss
(the forward) and accelerator.backward both run inside it, and nothing else of the loop saves
tensors for backward (evaluation runs under no_grad). So the step is wrapped in a `with`, which
leaves on any exit: by RevivaTrainerMixin (a class before the Trainer in the bases) or by
enable_activation_offload (one trainer instance, its training_step replaced on the instance).
Both install a RevivaOffloadCallback: it holds the offload (one per model, reused across
steps and train() calls), refuses at on_train_begin to run where it was only added as a callback
(it would offload nothing), and at on_step_end if an optimizer step ran no micro-batch inside
the offload (a training_step overridden without super()).

TRL: SFTTrainer's training_step runs `with self.maybe_activation_offload_context:` around
Trainer.training_step; __init__ sets that attribute to TRL's
get_act_offloading_ctx_manager(model=self.model) with SFTConfig(activation_offloading=True),
else to a nullcontext (trl/trainer/sft_trainer.py). act_offloading_ctx_manager has its call
shape (the model first; one reusable context manager entered per training_step), so with
activation_offloading=False a TRL user switches to Reviva's by

    trainer.maybe_activation_offload_context = act_offloading_ctx_manager(trainer.model)

or by enable_activation_offload(trainer). TRL is not a dependency; tests/python/
test_trainer_hook.py runs both against TRL 1.16's SFTTrainer (a dev requirement). Both offloads
at once are refused: TRL's hooks, entered inside
Reviva's, would take every saved tensor (only the innermost saved_tensors_hooks runs).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from reviva.activations.offload import ActivationOffload, _decoder_layers
from reviva.adapters import base_model_of
from reviva.sizes import format_bytes

log = logging.getLogger("reviva.hf_training")  # (the name users filter on)

_WINDOW_BYTES = 512 << 20  # ActivationOffload's default window


@dataclass(frozen=True)
class OffloadSettings:
    """ActivationOffload's settings (its docstring says what each means), kept to make the
    offload once the Trainer has placed its model on the device, and again for a new model
    (a Trainer with model_init makes one in each train() call)."""

    budget: int | str | None = None
    prefetch_layers: int = 2
    min_bytes: int = 0
    window_bytes: int | str = _WINDOW_BYTES
    memory: str = "torch"

    def make(self, model: nn.Module) -> ActivationOffload:
        if not _decoder_layers(base_model_of(model)):
            raise ValueError(
                f"RevivaOffloadCallback: the trainer's {type(model).__name__} has no decoder "
                "layers (model.model.layers) to find the offload's regions by; pass "
                "offload=ActivationOffload(module, layers=[...]) made for it or for one of its "
                "modules"
            )
        return ActivationOffload(
            model,
            budget=self.budget,
            prefetch_layers=self.prefetch_layers,
            min_bytes=self.min_bytes,
            window_bytes=self.window_bytes,
            memory=self.memory,
        )


class RevivaOffloadCallback(TrainerCallback):
    """Holds the ActivationOffload of one Trainer's model; RevivaTrainerMixin and
    enable_activation_offload enter it around each training_step (Note [Why training_step]).

    offload: an ActivationOffload made for the trainer's model or one of its modules (its
    settings are its own: passing any beside it raises, naming it); without it, one is made
    with the settings given when the callback is installed, after the Trainer placed the model
    on its device, and again if the trainer's model or its device changes.
    """

    def __init__(
        self,
        offload: ActivationOffload | None = None,
        *,
        budget: int | str | None = None,
        prefetch_layers: int = 2,
        min_bytes: int = 0,
        window_bytes: int | str = _WINDOW_BYTES,
        memory: str = "torch",
    ) -> None:
        settings = OffloadSettings(budget, prefetch_layers, min_bytes, window_bytes, memory)
        if offload is not None:
            if not isinstance(offload, ActivationOffload):
                raise TypeError(
                    f"RevivaOffloadCallback: offload must be a reviva.ActivationOffload, got "
                    f"{type(offload).__name__}"
                )
            given = [
                f.name
                for f in dataclasses.fields(settings)
                if getattr(settings, f.name) != f.default
            ]
            if given:
                raise ValueError(
                    f"RevivaOffloadCallback: {', '.join(given)} given with offload=: an "
                    "ActivationOffload keeps the settings it was made with; pass them to "
                    "ActivationOffload(...) instead"
                )
        self.settings = settings
        self.offload = offload
        self._made_here = offload is None  # made from settings: made again for a new model
        self._installed = False
        # Micro-batches run inside the offload, and their count when the optimizer step began.
        self.micro_batches = 0
        self._at_step_begin = 0

    # --- installing ------------------------------------------------------------------------------

    def _install(self, trainer: Trainer) -> None:
        """Checks that the trainer can run under the offload, makes or checks the offload for
        its model (placed on its device by now) and adds this callback to it."""
        if not isinstance(trainer, Trainer):
            raise TypeError(
                f"Reviva's activation offload hooks a transformers.Trainer, got "
                f"{type(trainer).__name__}"
            )
        if self._installed:
            raise ValueError("RevivaOffloadCallback: already installed on a trainer")
        if any(isinstance(cb, RevivaOffloadCallback) for cb in trainer.callback_handler.callbacks):
            raise ValueError(
                f"{type(trainer).__name__} already runs Reviva's activation offload (a "
                "RevivaOffloadCallback is installed): one offload per step"
            )
        if getattr(trainer.args, "activation_offloading", False):
            raise ValueError(
                f"{type(trainer).__name__}: args.activation_offloading=True turns on TRL's "
                "activation offload, whose hooks would take every saved tensor inside Reviva's; "
                "set activation_offloading=False to use Reviva's"
            )
        if isinstance(
            getattr(trainer, "maybe_activation_offload_context", None), ActivationOffload
        ):
            raise ValueError(
                f"{type(trainer).__name__}: maybe_activation_offload_context is already a "
                "Reviva ActivationOffload (act_offloading_ctx_manager); use that or "
                "enable_activation_offload, not both"
            )
        if trainer.args.n_gpu > 1:
            # DataParallel runs the replicas in threads of its own, where the saved-tensor hooks
            # (thread-local) are not installed.
            raise ValueError(
                f"Reviva's activation offload does not run under torch.nn.DataParallel "
                f"(args.n_gpu={trainer.args.n_gpu}): run one process per GPU (torchrun)"
            )
        self._offload_for(trainer.model)
        trainer.add_callback(self)
        self._installed = True

    def _offload_for(self, model: nn.Module) -> ActivationOffload:
        """The offload for the trainer's model as it is now: the one held, if made for it (or
        one of its modules) on its device; else, when made from settings, a new one."""
        offload = self.offload
        device = _device_of(model)
        if offload is not None and _is_within(offload.model, model) and offload.device == device:
            return offload
        if offload is not None and not self._made_here:
            if not _is_within(offload.model, model):
                raise ValueError(
                    f"RevivaOffloadCallback: offload= was made for a "
                    f"{type(offload.model).__name__} that is neither the trainer's "
                    f"{type(model).__name__} nor one of its modules"
                )
            raise ValueError(
                f"RevivaOffloadCallback: offload= is on {offload.device}, the trainer's model on "
                f"{device}: make the ActivationOffload after the Trainer placed the model"
            )
        self.offload = self.settings.make(model)
        return self.offload

    # --- the step --------------------------------------------------------------------------------

    def run_step(
        self, trainer: Trainer, step: Callable[..., torch.Tensor], *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        """One micro-batch: `step` (the Trainer's training_step: forward and backward) inside
        the offload of the trainer's model."""
        with self._offload_for(trainer.model):
            loss = step(*args, **kwargs)
        self.micro_batches += 1
        return loss

    # --- events ----------------------------------------------------------------------------------

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if not self._installed:
            raise ValueError(
                "RevivaOffloadCallback was added as a callback only: a callback cannot wrap a "
                "micro-batch (Note [Why training_step] in reviva.activations.hf_trainer), so "
                "it would offload nothing; use enable_activation_offload(trainer) or "
                "RevivaTrainerMixin"
            )

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._at_step_begin = self.micro_batches

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.micro_batches == self._at_step_begin:
            raise RuntimeError(
                f"Reviva's activation offload: optimizer step {state.global_step} ran no "
                "micro-batch inside the offload: the trainer's training_step does not reach "
                "the offload's (an override that does not call super().training_step?)"
            )

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.offload is None:
            return
        st = self.offload.stats
        log.info(
            "reviva: activation offload over %d micro-batches: %s to the host, %s back, "
            "stall %.3f s, overlap ratio %.3f",
            st.steps,
            format_bytes(st.bytes_to_host),
            format_bytes(st.bytes_to_device),
            st.stall_s,
            st.overlap_ratio,
        )


class RevivaTrainerMixin:
    """A Trainer whose every micro-batch runs inside Reviva's activation offload; first in the
    bases, before the Trainer class (any subclass: TRL's SFTTrainer is one):

        class OffloadTrainer(RevivaTrainerMixin, Trainer):
            pass

        trainer = OffloadTrainer(model=model, args=args, train_dataset=data,
                                 reviva_offload=RevivaOffloadCallback(budget="8GB"))

    reviva_offload: the callback holding the offload and its settings (default: offload every
    activation of at least 0 bytes, ActivationOffload's defaults).
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # After the Trainer in the bases, neither this __init__ nor this training_step would
        # run (Trainer's come first and do not call on): the trainer would train without the
        # offload and say nothing.
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        if Trainer in mro and mro.index(Trainer) < mro.index(RevivaTrainerMixin):
            raise TypeError(
                f"{cls.__name__}: RevivaTrainerMixin must come before the Trainer class in the "
                f"bases (class {cls.__name__}(RevivaTrainerMixin, ...)), got bases "
                f"({', '.join(b.__name__ for b in cls.__bases__)})"
            )

    def __init__(
        self, *args: Any, reviva_offload: RevivaOffloadCallback | None = None, **kwargs: Any
    ) -> None:
        if reviva_offload is not None and not isinstance(reviva_offload, RevivaOffloadCallback):
            raise TypeError(
                f"reviva_offload must be a RevivaOffloadCallback, got "
                f"{type(reviva_offload).__name__}"
            )
        super().__init__(*args, **kwargs)
        self.reviva_offload = (
            reviva_offload if reviva_offload is not None else RevivaOffloadCallback()
        )
        self.reviva_offload._install(self)

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        return self.reviva_offload.run_step(
            self, super().training_step, model, inputs, *args, **kwargs
        )


def enable_activation_offload(
    trainer: Trainer, offload: ActivationOffload | None = None, **settings: Any
) -> RevivaOffloadCallback:
    """Runs every micro-batch of this trainer (any Trainer subclass) inside Reviva's activation
    offload, from its next train() on: its training_step is replaced on the instance by one that
    enters the offload around the class's. Call it after the Trainer was made (it placed the
    model on its device). settings: RevivaOffloadCallback's (budget, prefetch_layers,
    min_bytes, window_bytes, memory). Returns the installed callback (`.offload.stats`)."""
    callback = RevivaOffloadCallback(offload, **settings)
    callback._install(trainer)
    step = trainer.training_step

    def training_step(
        model: nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        return callback.run_step(trainer, step, model, inputs, *args, **kwargs)

    trainer.training_step = training_step
    return callback


def act_offloading_ctx_manager(
    model: nn.Module,
    *,
    budget: int | str | None = None,
    prefetch_layers: int = 2,
    min_bytes: int = 0,
    window_bytes: int | str = _WINDOW_BYTES,
    memory: str = "torch",
) -> ActivationOffload:
    """Reviva's counterpart of TRL's get_act_offloading_ctx_manager(model): one reusable
    context manager for the model, entered around each training_step (one forward and its
    backward). For SFTTrainer's maybe_activation_offload_context (module docstring). TRL's own
    options (use_pin_memory, use_streams, min_offload_size, max_fwd_stash_size) are not taken:
    Reviva's host memory is always pinned and its copies always on their own streams."""
    return ActivationOffload(
        model,
        budget=budget,
        prefetch_layers=prefetch_layers,
        min_bytes=min_bytes,
        window_bytes=window_bytes,
        memory=memory,
    )


def _device_of(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _is_within(module: nn.Module, model: nn.Module) -> bool:
    return module is model or any(m is module for m in model.modules())
