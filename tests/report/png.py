"""A tiny PNG decoder (zlib + numpy) for checking screenshots: 8-bit gray/RGB/RGBA, no interlace.

Rows only depend on the rows above them, so ``max_rows`` decodes just the top
of a tall screenshot.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

SIGNATURE = b"\x89PNG\r\n\x1a\n"
CHANNELS = {0: 1, 2: 3, 6: 4}


def chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    """``(type, body)`` of every chunk; raises ValueError when ``data`` is not a PNG."""
    if not data.startswith(SIGNATURE):
        raise ValueError("not a PNG: bad signature")
    out, pos = [], len(SIGNATURE)
    while pos + 8 <= len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        if zlib.crc32(kind + body) != crc:
            raise ValueError(f"PNG chunk {kind!r} has a bad CRC")
        out.append((kind, body))
        pos += 12 + length
    return out


def decode_png(data: bytes, max_rows: int | None = None) -> np.ndarray:
    """Pixels as ``(rows, width, channels)`` uint8."""
    parts = chunks(data)
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", parts[0][1])
    if depth != 8 or colour not in CHANNELS or interlace:
        raise ValueError(
            f"unsupported PNG: depth {depth}, colour type {colour}, interlace {interlace}"
        )
    bpp = CHANNELS[colour]
    stride = width * bpp
    rows = height if max_rows is None else min(height, max_rows)
    raw = zlib.decompressobj().decompress(
        b"".join(b for k, b in parts if k == b"IDAT"), rows * (stride + 1)
    )
    out = np.zeros((rows, stride), dtype=np.uint8)
    prev = np.zeros(stride, dtype=np.int64)
    for y in range(rows):
        kind = raw[y * (stride + 1)]
        line = np.frombuffer(raw, np.uint8, stride, y * (stride + 1) + 1).astype(np.int64)
        cur = _unfilter(kind, line, prev, bpp)
        out[y] = cur
        prev = cur
    return out.reshape(rows, width, bpp)


def _unfilter(kind: int, line: np.ndarray, prev: np.ndarray, bpp: int) -> np.ndarray:
    if kind == 0:
        return line
    if kind == 2:
        return (line + prev) % 256
    if kind == 1:
        # Each byte adds the reconstructed byte bpp to its left: a running sum per channel.
        return (np.cumsum(line.reshape(-1, bpp), axis=0) % 256).reshape(-1)
    cur = [0] * len(line)
    up, raw = prev.tolist(), line.tolist()
    for i, x in enumerate(raw):
        a = cur[i - bpp] if i >= bpp else 0
        b = up[i]
        if kind == 3:
            cur[i] = (x + (a + b) // 2) & 255
            continue
        c = up[i - bpp] if i >= bpp else 0
        p = a + b - c
        pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
        cur[i] = (x + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
    return np.array(cur, dtype=np.int64)
