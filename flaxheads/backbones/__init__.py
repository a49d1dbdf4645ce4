"""Backbones: encoders as pure functions of (params, tokens), loaded from Hugging Face folders."""
