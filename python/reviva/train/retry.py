"""A fine-tuning step that runs out of device memory streams more layers and goes on (Note [Out
of memory inside a step]); the residency a step of some length settled on stays for the next
steps (Note [Residency across lengths]).

FinetuneRetry is a mixin of Finetune (train/finetune.py). State it reads: the tuner's dims, weights,
memory_model, device, _cuda, attention_chunk_tokens, _chunks_refused and _plan. State it writes:
_plan, _caps, _whole_failed and stats_
(oom_retries, retried_in, resident_layers, streamed_layers), the weights' residency.

Note [Out of memory inside a step]
The plan's working set is a model fitted on one card (or the peak measured by the last step of that
length): another card's allocator, cuBLAS's workspaces or its attention kernels can need more (the
H100 ran out of memory at 128k in a layer's backward where the H200's fit said it fits). So a torch
out-of-memory inside the work Reviva runs for a step (a layer's forward, a layer's recompute and
backward, the loss's chunks and their backward, the logits returned beside the loss) is caught where
it happened: resident layers' weights go back to their host copies, the freed device memory goes
back to the device (the arena unmaps it, torch's cache empties), and that piece of work runs again
from its own inputs: a layer's forward from its input (no autograd there; the generators set back
where they were, so dropout draws the same masks); a layer's backward from its checkpoint, with the
.grad of the layer's trained parameters put back as they were before it (the failed backward may
have accumulated some): nothing is counted twice, and the step's gradients are the ones it would
have had. The training loop never sees it; stats() counts the retries (oom_retries, retried_in). The
layers given back are those the plan would give up first (train_plan.preference, read backwards),
enough for the bytes torch asked for, else half the resident ones; the length's residency stays
capped at what was left (_caps) for the next steps of that length and longer ones. With every layer
streamed already, under attention_chunk_tokens="auto" (finetune's default) and rows longer than
AUTO_CHUNK_TOKENS, the step's layers turn to chunks of query tokens (_to_chunks; Note [Layers by
chunks of query tokens] in train/chunked_layer.py) and the work runs again so; the layers whose
forward ran whole go back by chunks too, unless they drew random numbers (their masks could not be
replayed by chunks: they go back whole). Steps of that row length and longer ones are planned by
chunks from then on (_whole_failed). Where that cannot help (chunks not "auto", a short row, a
refusal, a layer already by chunks), or a layer's trained gradients are too large to keep a copy of
(RETRY_GRAD_COPY_BYTES: a full fine-tune's), the error is raised as before (FinetuneOutOfMemoryError
naming the plan). The loss's backward keeps the head's gradients in leaves of its own until it
returns, so a failed run leaves nothing behind. Not retried: an out-of-memory in autograd's own work
outside these pieces (the embedding's backward), or in the optimizer's step.

Note [Residency across lengths]
Steps of different lengths in one process (variable-length batches) each get a plan; changing
the resident layers refills them (their weights cross PCIe again). So a step of another length
than the last keeps the residency in place where its plan keeps at least as many layers, and
gives up layers where its plan keeps fewer; it takes more layers only where the plan's working
set was measured (a step of that length ran: Finetune._measured, CUDA), not on the model's
estimate alone, which was fitted on another card. A step of the last one's length takes its plan
as it is (a budget changed between steps moves it). A cap left by an out-of-memory (Note [Out of
memory inside a step]) bounds all of them.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from reviva.train import plan as train_plan
from reviva.train.plan import (
    AUTO,
    FinetuneOutOfMemoryError,
    TrainPlan,
    preference,
    runs_by_chunks,
)

if TYPE_CHECKING:
    from reviva.train.chunked_layer import LayerChunks

log = logging.getLogger("reviva.finetune")

T = TypeVar("T")

# A layer's trained gradients are copied before its backward only up to this size (LoRA's are a
# few MB; a full fine-tune's are the layer's size, which a retry cannot afford to double).
RETRY_GRAD_COPY_BYTES = 256 << 20

_UNITS = {"B": 1, "bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_ASKED = re.compile(r"Tried to allocate ([0-9.]+) ?(bytes|B|KiB|MiB|GiB|TiB)")


def requested_bytes(message: str) -> int | None:
    """The bytes torch's out-of-memory message says it tried to allocate, None if it says not."""
    m = _ASKED.search(message)
    return int(float(m.group(1)) * _UNITS[m.group(2)]) if m else None


def layers_to_give_up(
    resident: Iterable[int], layer_bytes: tuple[int, ...], asked: int | None
) -> list[int]:
    """The resident layers to stream from now on (Note [Out of memory inside a step]): in
    reverse preference order, enough for `asked` bytes, else half of them (at least one)."""
    keep = [i for i in preference(len(layer_bytes)) if i in set(resident)]
    if not keep:
        return []
    target = asked if asked is not None else sum(layer_bytes[i] for i in keep) // 2
    given: list[int] = []
    while keep and (not given or sum(layer_bytes[i] for i in given) < target):
        given.append(keep.pop())
    return given


def grad_snapshot(params: Iterable[torch.Tensor]) -> list[tuple[torch.Tensor, Any]] | None:
    """Each trained parameter's .grad (None, or a copy) before a backward that may fail; None
    when the copies would exceed RETRY_GRAD_COPY_BYTES (no retry then)."""
    trained = [p for p in params if p.requires_grad]
    size = sum(p.grad.numel() * p.grad.element_size() for p in trained if p.grad is not None)
    if size > RETRY_GRAD_COPY_BYTES:
        return None
    return [(p, None if p.grad is None else p.grad.detach().clone()) for p in trained]


def restore_grads(snapshot: list[tuple[torch.Tensor, Any]]) -> None:
    """The trained parameters' .grad as grad_snapshot found them."""
    for p, g in snapshot:
        if g is None:
            p.grad = None
        elif p.grad is None:
            p.grad = g.clone()
        else:
            with torch.no_grad():
                p.grad.copy_(g)


def set_rng(state: tuple[torch.Tensor, torch.Tensor | None] | None, device: torch.device) -> None:
    """The generators at `state` (token_chunks.rng_state), from here on; None: left as they are."""
    if state is None:
        return
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


class FinetuneRetry:
    """Retries of a step's work after an out-of-memory, and the residency kept across lengths
    (Finetune's mixin; see the module docstring)."""

    def _retrying(
        self,
        where: str,
        run: Callable[[], T],
        undo: Callable[[], bool] | None = None,
        by_chunks: Callable[[], bool] | None = None,
    ) -> T:
        """`run()`, run again after each torch out-of-memory once more layers stream (Note [Out
        of memory inside a step]); `undo()` puts back what a failed run changed and says
        whether it could; with every layer streamed, `by_chunks()` makes the work run by chunks
        of query tokens and says whether it could. Raises FinetuneOutOfMemoryError where no
        retry can help."""

        while True:
            try:
                return run()
            except FinetuneOutOfMemoryError:
                raise
            except torch.OutOfMemoryError as e:
                plan = self._plan
                if plan is None or (undo is not None and not undo()):
                    raise self._out_of_memory(e, where) from e
                if not plan.resident_layers and (by_chunks is None or not by_chunks()):
                    raise self._out_of_memory(e, where) from e
                message = str(e)
            # (out of the except clause: the failed run's frames, and the tensors they held,
            # went with the exception)
            if plan.resident_layers:
                self._stream_more(message, where)
            else:
                self._count_retry(where, message, "the layers run by chunks of query tokens")

    def _count_retry(self, where: str, message: str, what: str) -> None:
        """stats() and the log after an out-of-memory in `where`, retried as `what` says."""
        st = self.stats_
        st.oom_retries += 1
        st.retried_in.append(where)
        plan = self._plan
        assert plan is not None
        st.plan = plan
        st.resident_layers, st.streamed_layers = len(plan.resident_layers), plan.streamed_layers
        log.warning(
            "reviva.finetune: out of device memory in %s at %d tokens; %s, and the work runs "
            "again. torch: %s",
            where,
            plan.tokens,
            what,
            message.splitlines()[0] if message else "",
        )

    def _to_chunks(
        self, i: int, x: torch.Tensor, args: tuple, kwargs: dict[str, Any]
    ) -> LayerChunks | None:
        """Under attention_chunk_tokens="auto", after an out-of-memory with every layer's
        weights streamed: the step's layers by chunks of AUTO_CHUNK_TOKENS query tokens from now
        on (its plan says so; steps of this row length and longer ones are planned so:
        _whole_failed), and layer i's call as LayerChunks; None where chunks are not auto, the
        row is no longer than a chunk, or the layer refuses them (chunked_layer.refusal)."""
        plan = self._plan
        if self.attention_chunk_tokens != AUTO or plan is None or self._chunks_refused:
            return None
        if x.dim() != 3 or not runs_by_chunks(x.shape[1], train_plan.AUTO_CHUNK_TOKENS):
            return None
        self._plan = dataclasses.replace(plan, attention_chunk_tokens=train_plan.AUTO_CHUNK_TOKENS)
        chunks = self._chunks(i, x, args, kwargs)
        if chunks is None:  # (refused, said once in the log: the plan stays whole layers)
            self._plan = plan
            return None
        self._whole_failed.add(int(x.shape[1]))
        return chunks

    def _stream_more(self, message: str, where: str) -> None:
        """Gives up resident layers after an out-of-memory in `where` (layers_to_give_up), their
        device memory back to the device; the plan, the cap of its length and stats() follow."""
        plan = self._plan
        assert plan is not None
        given = layers_to_give_up(
            plan.resident_layers, self.dims.layer_bytes, requested_bytes(message)
        )
        kept = tuple(i for i in plan.resident_layers if i not in given)
        self._set_resident(kept)
        self.weights.unmap_unused()
        if self._cuda:
            torch.cuda.empty_cache()
        self._plan = self._with_resident(plan, kept)
        self._caps[plan.tokens] = min(len(kept), self._caps.get(plan.tokens, len(kept)))
        self._count_retry(
            where,
            message,
            f"{self._plan.streamed_layers} layers' weights stream from now on "
            f"({len(kept)} resident)",
        )

    def _with_resident(self, plan: TrainPlan, kept: tuple[int, ...]) -> TrainPlan:
        """`plan` with only `kept` of its layers resident."""
        dims = self.dims
        streams = len(kept) < dims.num_layers
        return dataclasses.replace(
            plan,
            resident_layers=tuple(sorted(kept)),
            streamed_layers=dims.num_layers - len(kept),
            resident_bytes=sum(dims.layer_bytes[i] for i in kept),
            slot_bytes=self.memory_model.weight_slots * dims.largest_layer if streams else 0,
        )

    def _settled(self, plan: TrainPlan) -> TrainPlan:
        """The plan a step runs with (Note [Residency across lengths]): its length's cap (and
        shorter lengths'), and the residency in place kept where the plan keeps at least as
        many layers, grown only on a measured working set."""
        order = preference(self.dims.num_layers)
        caps = [c for t, c in self._caps.items() if t <= plan.tokens]
        wanted = [i for i in order if i in set(plan.resident_layers)]
        before = self._plan
        if (
            before is not None
            and before.tokens != plan.tokens
            and len(wanted) >= len(before.resident_layers)
            and not plan.working_measured
        ):
            wanted = [i for i in order if i in set(before.resident_layers)]
        wanted = wanted[: min(caps)] if caps else wanted
        if tuple(sorted(wanted)) == plan.resident_layers:
            return plan
        return self._with_resident(plan, tuple(wanted))
