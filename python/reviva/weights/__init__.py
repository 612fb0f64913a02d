"""Weights that live in pinned host memory: StreamedWeights (a decoder's layers brought to the
device per use through the core's WeightStore), the input embedding read on the host, a layer
packed into parts, routed experts, and what the user's parameters are meanwhile.

May import: the package's leaves and the core binding. Not cache, activations or anything above
(plan, generate, train, cli)."""
