"""What a compiled XLA:CPU program did with oneDNN's matmul calls (for the constant-weights tests)."""

from __future__ import annotations


def weight_counts(hlo_text: str) -> dict[str, int]:
    """In an optimized HLO text: oneDNN matmul calls (``calls``), those whose weights are a
    constant (``dense``: parameters compiled in) and those whose weights XLA reordered for oneDNN
    at compile time (``prepacked``)."""
    calls = [line for line in hlo_text.splitlines() if "__onednn$matmul" in line and "custom-call(" in line]
    dense = sum(line.split("custom-call(")[1].split(",")[1].strip().startswith("%constant") for line in calls)
    return {"calls": len(calls), "dense": dense, "prepacked": hlo_text.count('"weights_prepacked":true')}
