"""The model: SequenceModel and from_pretrained, LoRA, quantised bases, base dtypes, hub ids."""
