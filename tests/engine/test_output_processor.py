"""Stop strings: the matcher finds what a plain scan of the whole text over every stop string
finds (the stop that completes first, cut at the start of the longest one ending there), text
arriving in pieces of any size."""
import random

from jaxserve.engine.output_processor import StopMatcher


def naive(text: str, stops) -> int:
    """-> the cut position: of the stops whose first occurrence ends earliest, the longest."""
    best = None  # (end, -length, start)
    for s in stops:
        at = text.find(s)
        if at >= 0:
            cand = (at + len(s), -len(s), at)
            best = cand if best is None or cand < best else best
    return -1 if best is None else best[2]


def stream(pieces, stops) -> tuple[int, int]:
    """Feed pieces; -> (piece index at which a stop was found, cut position) or (-1, -1)."""
    m = StopMatcher(stops)
    text = ""
    for i, p in enumerate(pieces):
        before = len(text)
        text += p
        at = m.find(text, before)
        if at >= 0:
            return i, at
    return -1, -1


def test_matches_a_plain_scan_on_random_texts():
    rng = random.Random(0)
    alphabet = "ab c\n\u00e9"
    for _ in range(2000):
        stops = {"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 6))}
        pieces = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 3))) for _ in range(rng.randint(1, 12))]
        i, at = stream(pieces, stops)
        if i < 0:
            assert naive("".join(pieces), stops) == -1
            continue
        text = "".join(pieces[: i + 1])
        assert naive("".join(pieces[:i]), stops) == -1  # nothing completed earlier
        assert at == naive(text, stops), (pieces, stops)


def test_hold_back_covers_a_partial_stop():
    m = StopMatcher(["</answer>", "\n\n"])
    assert m.hold == len("</answer>") - 1
    assert m.find("x </answ", 0) == -1 and m.find("x </answer> y", 8) == 2
    assert StopMatcher(["abc", "c"]).find("zabc", 3) == 1  # the longest stop ending at the first match
