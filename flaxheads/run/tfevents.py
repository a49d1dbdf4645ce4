"""TensorBoard's event file format, scalars only, with the standard library alone.

An event file is a sequence of TFRecords (length, its masked CRC-32C, the bytes, their masked
CRC-32C), each holding one serialized ``tensorflow.Event`` protocol buffer. A run writes three
kinds: the file version (first), a session start (a resumed run's first new step: TensorBoard then
hides the steps an interrupted run had logged from there on) and summaries of ``simple_value``
scalars. Writing them directly keeps TensorBoard logging free of protobuf, TensorFlow and torch
(tensorboardX's writer imports torch where it is installed: seconds at every run's start).
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Iterable
from pathlib import Path


def _crc_table() -> tuple[int, ...]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return tuple(table)


_CRC_TABLE = _crc_table()


def _crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), which TFRecords use."""
    crc = 0xFFFFFFFF
    for b in data:
        crc = _CRC_TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> bytes:
    crc = _crc32c(data)
    return struct.pack("<I", (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


def record(data: bytes) -> bytes:
    """One TFRecord around ``data``."""
    length = struct.pack("<Q", len(data))
    return length + _masked_crc(length) + data + _masked_crc(data)


# ---- protocol buffer wire format: just the fields an event needs -----------------------------------
def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 fields: a negative value is its two's complement
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (a string or an embedded message)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def event(
    step: int,
    *,
    wall_time: float | None = None,
    file_version: str | None = None,
    session_start: bool = False,
    scalars: Iterable[tuple[str, float]] = (),
) -> bytes:
    """A serialized ``Event``: wall_time (1, double), step (2, int64), file_version (3, string),
    summary (5: repeated value (1) of tag (1, string) and simple_value (2, float)), session_log
    (7: status (1) START = 1)."""
    out = b"\x09" + struct.pack("<d", time.time() if wall_time is None else wall_time) + b"\x10" + _varint(step)
    if file_version is not None:
        out += _field(3, file_version.encode())
    values = b"".join(_field(1, _field(1, tag.encode()) + b"\x15" + struct.pack("<f", value)) for tag, value in scalars)
    if values:
        out += _field(5, values)
    if session_start:
        out += _field(7, b"\x08\x01")
    return out


class EventFile:
    """A new ``events.out.tfevents.<time>.<host>.<pid>`` file in ``folder``, appended one event at a time.
    ``purge_step``: the first step of a resumed run (see the module docstring)."""

    def __init__(self, folder: str | os.PathLike, purge_step: int | None = None):
        Path(folder).mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
        self.path = Path(folder) / name
        self._file = open(self.path, "ab")
        self._file.write(record(event(purge_step or 0, file_version="brain.Event:2")))
        if purge_step is not None:
            self._file.write(record(event(purge_step, session_start=True)))
        self._file.flush()

    def add_scalars(self, step: int, scalars: Iterable[tuple[str, float]]) -> None:
        """One event with every ``(tag, value)`` of ``step``, flushed at once: TensorBoard shows a
        run as it goes, and a killed run loses nothing it logged."""
        scalars = list(scalars)
        if scalars:
            self._file.write(record(event(step, scalars=scalars)))
            self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
