"""Poolers, heads and activations: Flax linen modules of (hidden states, mask) and of a vector."""
