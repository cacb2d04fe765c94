#!/usr/bin/env python3
"""Writes a synthetic image-classification set for `parallax run --data` (no downloads).

Ten classes of simple shapes (disc, square, triangle, horizontal bar, vertical bar, cross,
diagonal, ring, checker, X), each drawn at a random place and size in a random colour on a
noisy background, so a small CNN has something real to learn. Standard library only.

Format "parallax-images/1" (little-endian): the 8 bytes b"PXIMG1\\n\\0"; five u32 — count,
channels, height, width, classes; then `count` records of one u8 label followed by
channels × height × width u8 pixels, channel-major (CHW). parallax reads pixels as
(p / 255 − 0.5) / 0.25.

    python3 scripts/make_shapes.py --out shapes.pximg [--count 2048] [--size 16] [--seed 0]
"""

import argparse
import random
import struct

CLASSES = 10


def inside(cls, x, y, cx, cy, r):
    dx, dy = x - cx, y - cy
    if cls == 0:  # disc
        return dx * dx + dy * dy <= r * r
    if cls == 1:  # square
        return abs(dx) <= r and abs(dy) <= r
    if cls == 2:  # triangle, apex up
        return -r <= dy <= r and abs(dx) <= (dy + r) / 2
    if cls == 3:  # horizontal bar
        return abs(dy) <= max(1, r // 3) and abs(dx) <= r
    if cls == 4:  # vertical bar
        return abs(dx) <= max(1, r // 3) and abs(dy) <= r
    if cls == 5:  # cross
        t = max(1, r // 3)
        return (abs(dx) <= t and abs(dy) <= r) or (abs(dy) <= t and abs(dx) <= r)
    if cls == 6:  # diagonal stroke
        return abs(dx - dy) <= 1 and abs(dx) <= r
    if cls == 7:  # ring
        d = dx * dx + dy * dy
        return (r - 1.5) ** 2 <= d <= r * r
    if cls == 8:  # checker
        return abs(dx) <= r and abs(dy) <= r and ((x // 2 + y // 2) % 2 == 0)
    # X
    return (abs(dx - dy) <= 1 or abs(dx + dy) <= 1) and abs(dx) <= r


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--count", type=int, default=2048)
    ap.add_argument("--size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    s = a.size
    with open(a.out, "wb") as f:
        f.write(b"PXIMG1\n\0")
        f.write(struct.pack("<5I", a.count, 3, s, s, CLASSES))
        for _ in range(a.count):
            cls = rng.randrange(CLASSES)
            r = rng.randint(max(2, s // 5), max(3, s // 3))
            cx, cy = rng.randint(r, s - 1 - r), rng.randint(r, s - 1 - r)
            colour = [rng.randint(128, 255) for _ in range(3)]
            pixels = bytearray()
            for ch in range(3):
                for y in range(s):
                    for x in range(s):
                        v = rng.randint(0, 60)
                        if inside(cls, x, y, cx, cy, r):
                            v = colour[ch]
                        pixels.append(v)
            f.write(bytes([cls]))
            f.write(pixels)


if __name__ == "__main__":
    main()
