"""Import and export of the formats flaxheads reads and writes (transformers, sentence-transformers, head files)."""
