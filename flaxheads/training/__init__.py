"""Pure train/eval steps, data parallelism, the fit loop, optimizers, data, metrics and feature caches."""
