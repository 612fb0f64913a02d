"""Routed experts (Note [Routed experts]): which mixture-of-experts layers a decode step can take
expert by expert (routed_experts), their sizes for the planner (routed_expert_sizes), and the
decode step's experts forward that brings in only the chosen experts' projections
(RoutedExpertsForward, a mixin of StreamedWeights in weights/streamed.py)."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn

from reviva import switches

# What a decoder layer runs before its MLP (Note [Routed experts]: nothing of the layer may run
# after its experts, whose block's views are the last a decode step takes).
_BEFORE_MLP = frozenset({"self_attn", "input_layernorm", "post_attention_layernorm"})


def _owners(module: nn.Module) -> set[str]:
    return {n for n, m in module.named_children() if any(True for _ in m.parameters())}


def routed_experts(layer: nn.Module) -> nn.Module | None:
    """The layer's experts module where a decode step can take only the experts its router
    chooses (Note [Routed experts]): an MLP of a router (`gate`) and HF's experts module, whose
    parameters are gate_up_proj [E, 2I, H] and down_proj [E, H, I] (no bias, not transposed,
    gated), in a layer whose other parts all run before the MLP (Mixtral, Qwen3-MoE). None
    otherwise, and with REVIVA_ROUTED_EXPERTS=0 (a baseline for benchmarks): the MLP is then one
    block (and every expert moves)."""
    if not switches.routed_experts():
        return None
    mlp = getattr(layer, "mlp", None)
    experts = getattr(mlp, "experts", None)
    if experts is None or not _owners(layer) <= _BEFORE_MLP | {"mlp"}:
        return None
    if any(True for _ in mlp.parameters(recurse=False)) or _owners(mlp) != {"gate", "experts"}:
        return None
    params = dict(experts.named_parameters())
    if set(params) != {"gate_up_proj", "down_proj"}:
        return None
    gu, dn = params["gate_up_proj"], params["down_proj"]
    e = getattr(experts, "num_experts", None)
    if gu.dim() != 3 or dn.dim() != 3 or gu.dtype != dn.dtype or not e or gu.shape[0] != e:
        return None
    if dn.shape[0] != e or gu.shape[1] != 2 * dn.shape[2] or gu.shape[2] != dn.shape[1]:
        return None
    if getattr(experts, "is_transposed", False) or getattr(experts, "has_bias", False):
        return None
    if not getattr(experts, "has_gate", True) or not callable(
        getattr(experts, "_apply_gate", None)
    ):
        return None
    return experts


def _expert_bytes(experts: nn.Module) -> tuple[int, int]:
    """One expert's gate_up and down projections' bytes (routed_experts' module)."""
    e = experts.num_experts
    gate_up, down = (experts.gate_up_proj, experts.down_proj)
    return gate_up.numel() * gate_up.element_size() // e, down.numel() * down.element_size() // e


def routed_expert_sizes(layers: list[nn.Module]) -> tuple[int, int, int]:
    """(one expert's bytes, experts, experts each token chooses) of the first layer with routed
    experts (Note [Routed experts]), (0, 0, 0) where none has: what the planner forecasts a
    decode step's copies by."""
    for layer in layers:
        experts = routed_experts(layer)
        if experts is None:
            continue
        e = experts.num_experts
        k = getattr(layer.mlp.gate, "top_k", None) or getattr(layer.mlp, "top_k", None) or e
        return sum(_expert_bytes(experts)), e, int(k)
    return 0, 0, 0


# Note [Routed experts]
# A mixture-of-experts layer (Mixtral, Qwen3-MoE: routed_experts) runs, per token, only the top-k
# experts its router chooses, but its experts are one block, as HF keeps them ([E, ...] tensors
# that its experts forward indexes or hands to a grouped matmul), so a decode step that took the
# block moved every expert: Mixtral-8x7B's layer is 2.9 GB of which a token uses 0.8. So a
# streamed MoE layer is two blocks, its first (attention, norms and the router) and its
# experts', and each expert's gate_up and down projections are also views of the store (Note
# [Blocks within a block] in src/weight_store.cpp: ranges of the experts' host copy, no memory
# of their own). A prefill takes both blocks whole and runs HF's own experts forward (most
# experts see some of a long prompt's tokens). A decode step takes the first block, and HF's
# experts forward is replaced there (an instance attribute on the experts module, forwarding to
# HF's own everywhere else) by `_routed_forward`: it gives the first block back (the router
# ran), learns which experts were chosen (one synchronization: the host must know what to
# fetch), and takes each chosen expert's gate_up view, then its down view, one at a time, into
# decode's room of two blocks (the store fetches a view at its acquire and lets it go at its
# release). Its arithmetic is HF's grouped_mm experts forward (HF's default: rows sorted by
# expert, each expert's rows through its projections, weights applied, a sum over the top-k)
# done expert by expert. A step then moves the attention's bytes and the chosen experts' (2 of
# 8 experts: about a quarter of Mixtral's layer); the experts' whole block stays out of
# decode's cycle (WeightStore.set_on_demand), and decode's room is two of the largest of those
# blocks.


class RoutedExpertsForward:
    """The experts forward of a decode step (StreamedWeights' mixin; Note [Routed experts]).
    State it reads: the weights' _routed, _held and store. State it writes: _routing, _held
    (the first block given back), _views_held (the expert's view acquired now)."""

    def _experts_forward(
        self, i: int, hf: Callable[..., torch.Tensor]
    ) -> Callable[..., torch.Tensor]:
        ref = weakref.ref(self)

        def forward(
            hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
        ) -> torch.Tensor:
            weights = ref()
            if weights is not None and i in weights._routing:
                return weights._routed_forward(i, hidden_states, top_k_index, top_k_weights)
            return hf(hidden_states, top_k_index, top_k_weights)

        return forward

    def _routed_forward(
        self, i: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """Note [Routed experts]: layer i's experts in a decode step, each chosen expert's
        projections brought in one at a time (HF's grouped_mm experts forward, expert by
        expert)."""
        experts, e, first = self._routed[i]
        self._routing.discard(i)  # (once per use of the layer)
        for b in self._held.get(i, []):  # the router ran: the first block's work is queued
            self._release_block(b)
        self._held[i] = []
        gu_shape = experts.gate_up_proj.shape[1:]
        dn_shape = experts.down_proj.shape[1:]
        dtype = experts.gate_up_proj.dtype
        k = top_k_index.size(-1)
        ids, order = torch.sort(top_k_index.reshape(-1))
        rows = hidden[order // k].to(dtype)
        counts = torch.bincount(ids, minlength=e).tolist()  # (the host fetches what was chosen)
        out = torch.empty(rows.shape[0], hidden.shape[-1], dtype=dtype, device=hidden.device)
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            end = start + n
            gate_up = self._take_view(i, first + 2 * expert).view(dtype).view(gu_shape)
            h = torch.mm(rows[start:end], gate_up.t())
            self._drop_view(i)
            h = experts._apply_gate(h)
            down = self._take_view(i, first + 2 * expert + 1).view(dtype).view(dn_shape)
            out[start:end] = torch.mm(h, down.t())
            self._drop_view(i)
            start = end
        weighted = out * top_k_weights.reshape(-1)[order].unsqueeze(-1)
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        tokens = hidden.shape[0]
        return weighted[back].view(tokens, k, -1).sum(dim=1).to(hidden.dtype)

    def _take_view(self, i: int, v: int) -> torch.Tensor:
        block = self.store.acquire(v)
        self._views_held[i] = v
        return block

    def _drop_view(self, i: int) -> None:
        self.store.release(self._views_held.pop(i))
