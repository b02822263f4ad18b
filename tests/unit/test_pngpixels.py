"""``tests.pngpixels``: the colour count the GUI tests judge screenshots by, on PNGs whose rows use
each of the five filters (libpng picks per row, so a screendump mixes them)."""

from __future__ import annotations

import struct
import zlib

import pytest

from tests.pngpixels import png_pixels

MAGENTA, GREEN, GREY = (255, 0, 255), (0, 255, 0), (40, 40, 40)


def _paeth(a: int, b: int, c: int) -> int:
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    return a if pa <= pb and pa <= pc else b if pb <= pc else c


def encode(rows: list[list[tuple[int, int, int]]], kind: int) -> bytes:
    """An 8-bit RGB PNG of ``rows``, every row filtered with ``kind`` (PNG spec, 9.2)."""
    w, bpp = len(rows[0]), 3
    raw, prev = b"", bytes(w * bpp)
    for row in rows:
        line = bytes(c for px in row for c in px)
        out = bytearray()
        for x, v in enumerate(line):
            a = line[x - bpp] if x >= bpp else 0
            b, c = prev[x], prev[x - bpp] if x >= bpp else 0
            pred = [0, a, b, (a + b) // 2, _paeth(a, b, c)][kind]
            out.append((v - pred) & 255)
        raw += bytes([kind]) + bytes(out)
        prev = line

    def chunk(t: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + t + body + struct.pack(">I", zlib.crc32(t + body))

    ihdr = struct.pack(">IIBBBBB", w, len(rows), 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


@pytest.mark.parametrize("kind", [0, 1, 2, 3, 4], ids=["none", "sub", "up", "average", "paeth"])
def test_counts_exact_colour_under_every_filter(kind: int) -> None:
    rows = [[MAGENTA if (x + y) % 3 else GREY for x in range(7)] for y in range(5)]
    rows[2][3] = (254, 0, 255)  # one off by one: not the colour
    png = encode(rows, kind)
    want = sum(px == MAGENTA for row in rows for px in row)
    assert png_pixels(png, MAGENTA) == want and want > 0
    assert png_pixels(png, GREY) == sum(px == GREY for row in rows for px in row)
    assert png_pixels(png, GREEN) == 0  # a colour the image lacks

