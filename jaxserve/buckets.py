"""Padding buckets: the shapes serving programs are built for, and their ProgramSet names."""
from __future__ import annotations


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    n = max(n, minimum)
    return 1 << (n - 1).bit_length()


def pow2_buckets(lo: int, hi: int) -> list[int]:
    out, b = [], bucket(lo)
    while b < hi:
        out.append(b)
        b *= 2
    return out + [bucket(hi)]


def token_buckets(lo: int, hi: int) -> list[int]:
    """Prefill token-count buckets: the powers of two from ``lo`` up to cover ``hi``, plus the
    3/4 point below each one from 64 on (48, 96, 192, ...), which cuts the padding of a chunk
    just past a power of two (a 70-token prompt pads to 96, not 128)."""
    out = set()
    for b in pow2_buckets(lo, hi):
        out.add(b)
        if b >= 64 and b * 3 // 4 >= lo:
            out.add(b * 3 // 4)
    return sorted(out)


def pick_bucket(n: int, buckets: list[int]) -> int:
    """The smallest bucket >= n (buckets sorted); an n past the last is a caller bug."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def step_name(phase: str, batch: int, tokens: int) -> str:
    """The ProgramSet name of a serving step program for one bucket."""
    return f"{phase}/{batch}x{tokens}"


def weights_phase(program: str) -> str:
    """The phase whose weights a step program reads: a speculative decoding "verify" program
    (the decode step over k + 1 positions, logits at each) reads the decode weights."""
    return "decode" if program == "verify" else program
