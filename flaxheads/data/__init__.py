"""Data: tables, splits, batches and buckets, packing, ranking groups, streaming."""
