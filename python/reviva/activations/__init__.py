"""Activation offload for the backward pass (`reviva.offload_activations`, ActivationOffload):
the saved-tensor hooks, the layer boundaries and the backward's prefetches, the budget mode,
and the HF Trainer's hook. Used by training loops and by RevivaManager.offload_activations.

May import: the package's leaves and the core binding. Not cache, weights or anything above
(plan, generate, train, cli)."""
