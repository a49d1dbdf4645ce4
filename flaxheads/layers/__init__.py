"""Pieces every backbone family shares, as pure functions, one module per concern:

* :mod:`.norms`: LayerNorm with an explicit derivative;
* :mod:`.dense`: the one matmul of a backbone's projections (bf16 backward arranged for XLA:CPU),
  ``dense``, the embedding lookup;
* :mod:`.dropout`: counter-hash dropout bits and dropout;
* :mod:`.attention`: the attention arrangements in one registry (the compute plan picks), batch chunks
  and groups, the causal mask, fused q/k/v;
* :mod:`.masks`: additive key masks (padded rows) and block-diagonal masks (packed rows);
* :mod:`.positions`: absolute, relative and rotary positions;
* :mod:`.init`: Hugging Face's initialiser;
* :mod:`.activations`: activations by their Hugging Face names.

Import from the concern module (``from flaxheads.layers.attention import attend``); nothing is
re-exported here. This package imports :mod:`flaxheads.errors` and :mod:`flaxheads.runtime` only; every
host-dependent choice comes in as a :class:`~flaxheads.runtime.plan.ComputePlan` argument.
"""
