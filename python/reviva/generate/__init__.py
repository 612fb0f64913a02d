"""Long-context generation: RevivaManager (wraps a HF model), one generate call step by step
(its inputs, phases, stats and stop check), the Llama-layout layer Reviva computes and its decode
graphs, the HF surface, pinned host copies, and `reviva.from_pretrained`.

May import: plan, cache, weights, activations, the package's leaves and the core binding. Not
train (its peer) or cli."""
