"""Note [Saved tensors' versions]: under reviva.offload_activations every in-place change that
plain autograd refuses between forward and backward is refused the same way (its RuntimeError,
its words): a parameter changed under torch.no_grad(), the caller's input_ids, a saved tensor
changed and then let go before backward; and a normal step, repeated with an optimizer between
steps, raises nothing and gives the plain gradients. CPU (host backend)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

from reviva import ActivationOffload, offload_activations

VERSION_ERROR = "modified by an inplace operation"


def tiny_llama(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=211,
        max_position_embeddings=512,
    )
    return AutoModelForCausalLM.from_config(cfg)


def ids_of(seed: int) -> torch.Tensor:
    return torch.randint(0, 211, (2, 48), generator=torch.Generator().manual_seed(seed))


def step_with_change(
    offload: bool, change: Callable[[nn.Module, torch.Tensor], None]
) -> dict[str, torch.Tensor]:
    """One forward, `change` (between forward and backward), backward; the gradients."""
    model = tiny_llama()
    ids = ids_of(1)
    ctx = offload_activations(model) if offload else contextlib.nullcontext()
    with ctx:
        loss = model(input_ids=ids, labels=ids.clone()).loss
        change(model, ids)
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def change_parameter(model: nn.Module, ids: torch.Tensor) -> None:
    with torch.no_grad():  # (as an optimizer or an EMA update would, too early)
        model.model.layers[0].mlp.up_proj.weight.mul_(1.1)


def change_input(model: nn.Module, ids: torch.Tensor) -> None:
    ids.remainder_(7)  # the embedding saved these indices for its gradient


@pytest.mark.parametrize("change", [change_parameter, change_input], ids=["parameter", "input_ids"])
def test_kept_tensors_changed_in_place_are_refused_as_autograd_refuses_them(
    change: Callable[[nn.Module, torch.Tensor], None],
) -> None:
    """A parameter and an input are kept where they are (never offloaded): the hooks returned
    them detached and autograd, which checks no version once hooks are set, took a gradient of
    the changed values (7.5% off, silently)."""
    with pytest.raises(RuntimeError, match=VERSION_ERROR):
        step_with_change(False, change)
    with pytest.raises(RuntimeError, match=VERSION_ERROR):
        step_with_change(True, change)


def test_an_offloaded_tensor_changed_then_let_go_is_refused() -> None:
    """Saved, changed in place, and gone before backward (no later save, no live view): the
    offloaded copy still holds the saved values, but autograd refuses this step, so offload does
    too; the version counter, not the tensor, is what the saved tensor carries."""

    class Changed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(64, 64))
            self.layer = nn.Identity()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.layer(x)
            h = x @ self.w
            out = (h * h).sum()  # saves h
            h.mul_(3.0)  # changed; h dies when forward returns
            return out

    def run(offload: bool) -> None:
        torch.manual_seed(5)
        model = Changed()
        ctx = contextlib.nullcontext()
        if offload:
            off = ActivationOffload(model, min_bytes=0, layers=[model.layer])
            off._make_post_hook = lambda i: (lambda module, args, output: None)  # noqa: E731
            ctx = offload_activations(model, offload=off)
        with ctx:
            model(torch.randn(32, 64)).backward()

    with pytest.raises(RuntimeError, match=VERSION_ERROR):
        run(False)
    with pytest.raises(RuntimeError, match=VERSION_ERROR):
        run(True)


def test_changes_autograd_allows_raise_nothing() -> None:
    """No false positive: a change after backward used the saved tensors, and one before
    forward, are autograd's business as usual; gradients equal the plain ones."""

    def after_backward(offload: bool) -> dict[str, torch.Tensor]:
        model = tiny_llama()
        ids = ids_of(2)
        with torch.no_grad():
            model.model.layers[1].self_attn.q_proj.weight.mul_(0.9)  # before forward: fine
        ctx = offload_activations(model) if offload else contextlib.nullcontext()
        with ctx:
            model(input_ids=ids, labels=ids.clone()).loss.backward()
        with torch.no_grad():
            model.model.layers[0].mlp.up_proj.weight.mul_(1.1)  # after backward: fine
        ids.remainder_(7)
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    ref, got = after_backward(False), after_backward(True)
    assert ref.keys() == got.keys()
    for n in ref:
        assert torch.equal(ref[n], got[n]), f"gradient of {n} differs"


def test_normal_steps_repeated_raise_nothing_and_match_plain() -> None:
    """Several steps with one offload, an optimizer changing every parameter in place between
    them (new versions each step), and gradient checkpointing's recompute on the last ones:
    nothing refused, and parameters after the steps equal the plain run's."""

    def train(offload: bool) -> dict[str, torch.Tensor]:
        model = tiny_llama(seed=3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        off = ActivationOffload(model, min_bytes=0) if offload else None
        for step in range(4):
            if step == 2:
                model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False}
                )
                model.train()
            ids = ids_of(10 + step)
            ctx = offload_activations(model, offload=off) if off else contextlib.nullcontext()
            with ctx:
                model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if off is not None:
            assert off.stats.steps == 4 and off.stats.offloaded_tensors > 0
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    ref, got = train(False), train(True)
    for n in ref:
        assert torch.equal(ref[n], got[n]), f"{n} differs after the steps"
