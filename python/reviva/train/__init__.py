"""Streamed fine-tuning (`reviva.finetune`, Finetune): the step's memory and time plan, the
forwards it installs, layers by chunks of query tokens and their attention, token-wise work by
chunks, layer inputs held on the host, and the retries after an out-of-memory.

May import: plan, weights, the package's leaves and the core binding. Not generate (its peer)
or cli."""
