"""A message as far as its text is certain (the prefix parsers' result)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Call:
    name: str
    arguments: str = ""  # JSON text of the arguments, as far as known
    done: bool = False  # the call's closing marker was seen
    id: str | None = None  # the model's own id for it (Kimi K2), else the server makes one


@dataclasses.dataclass
class Snapshot:
    content: str = ""
    calls: list[Call] = dataclasses.field(default_factory=list)
    reasoning: str = ""


def held_back(text: str, markers) -> str:
    """``text`` without its longest suffix that could still grow into one of ``markers``."""
    cut = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), cut, -1):
            if text.endswith(m[:n]):
                cut = n
                break
    return text[: len(text) - cut] if cut else text


def until(text: str, pos: int, marker: str, final: bool, hold=()) -> tuple[str, int | None]:
    """The text from ``pos`` to ``marker`` -> (piece, position after the marker); when the
    marker is not there yet: (the piece so far, less what could start the marker or one of
    ``hold``, unless final; None)."""
    i = text.find(marker, pos)
    if i >= 0:
        return text[pos:i], i + len(marker)
    rest = text[pos:]
    return (rest if final else held_back(rest, (marker, *hold))), None


def scan(text: str, opener: str, final: bool, read_calls) -> Snapshot:
    """The content around a format's call blocks: text up to each ``opener`` is content, and
    ``read_calls(text, after_opener, final, snap)`` reads what follows into ``snap``, returning
    the position after the block (None: the block has not ended yet)."""
    snap, pos = Snapshot(), 0
    while True:
        piece, after = until(text, pos, opener, final)
        snap.content += piece
        if after is None:
            return snap
        pos = read_calls(text, after, final, snap)
        if pos is None:
            return snap
