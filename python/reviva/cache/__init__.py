"""K/V residency: RevivaCache (HF's Cache over the core's KVStore) and what a call's K/V needs
beside it: its layers as HF's per-layer caches, fp8 rows and their reads, window rings, a
prompt's rows shared by several sequences, a cache returned to the user, attention over K/V in
blocks and on the host's cores.

May import: the leaves at the package's top (config, sizes, stats, trace, switches, resources,
adapters, hf_versions, placement) and the core binding (reviva._C). Not weights, activations or
anything above (plan, generate, train, cli)."""
