"""Bytes on disk: checksums of what flaxheads writes, free-space and writability checks."""
