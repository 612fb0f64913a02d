"""The memory model and its plans, made before a call runs: a generate call's plan (chunk,
attention mode, K/V residency, weight rooms), its arithmetic and the model's coefficients, what
the device and host can count on, where decode attends, and a shape's forecast.

May import: cache and weights (the sizes of what they hold), the package's leaves and the core
binding. Not activations or anything above (generate, train, cli)."""
