"""Encoders of flaxheads' own for architectures where HF's Flax wrapper is slow on CPU.

They use HF's parameter trees unchanged, so checkpoints load the same way; the HF wrapper
remains the general path for every other architecture."""
from .bert import SUPPORTED_MODEL_TYPES, FastBertBackbone, attention_chunks, encode, maybe_fast, supports

__all__ = ["FastBertBackbone", "SUPPORTED_MODEL_TYPES", "attention_chunks", "encode", "maybe_fast", "supports"]
