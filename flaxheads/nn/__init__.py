"""Poolers and heads: Flax linen modules of (hidden states, mask) and of a vector."""
