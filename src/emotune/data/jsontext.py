"""JSON text the readers cannot take as written.

Nesting deeper than they go: Python's json stops at its recursion limit (about 1,000 levels), and Arrow's JSON reader
overflows its stack (a segmentation fault) from about 20,000, so such lines are found before Arrow reads. Half of a
UTF-16 surrogate pair written as an escape (`\ud83d` alone: JavaScript's JSON.stringify writes an emoji cut in two
so): Python reads it into a string no UTF-8 can hold, which Arrow refused with a traceback; it becomes U+FFFD, as a
byte that does not decode does.
"""

from __future__ import annotations

import mmap
import re

import numpy as np
import pyarrow as pa

TOO_DEEP = "nests lists or objects deeper than Python's JSON reader goes (about 1,000 levels)"
_DEEP = re.compile(rb'(?:[\[{]\s*(?:"(?:[^"\\\n]|\\.)*"\s*:\s*)?){1000}')  # 1,000 opening brackets in a row, keys between


def deep_line(source: str | pa.Buffer) -> int | None:
    """The first line that opens 1,000 lists or objects in a row (a file's bytes searched in place, not copied)."""
    if not isinstance(source, str):
        return _deep_in(memoryview(source))
    with open(source, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return _deep_in(data)


def _deep_in(data) -> int | None:
    """Only lines long enough to hold such a run are searched: a regex over every byte of a large file costs more
    than Arrow's whole read; the line ends are found by numpy, a chunk at a time."""
    view, previous, chunk = np.frombuffer(data, dtype=np.uint8), -1, 1 << 26
    for offset in range(0, len(view) + 1, chunk):
        ends = np.flatnonzero(view[offset:offset + chunk] == 10) + offset
        if offset + chunk >= len(view):
            ends = np.append(ends, len(view))  # the last line, with or without its line break
        bounds = np.concatenate(([previous], ends))
        for at in np.flatnonzero(np.diff(bounds) > 2000):
            if _DEEP.search(data, int(bounds[at]) + 1, int(bounds[at + 1])):
                return int(np.count_nonzero(view[:bounds[at] + 1] == 10)) + 1
        previous = int(bounds[-1])
    return None


_ESCAPE = r'(?<!\\)((?:\\\\)*)'  # a backslash that starts an escape: none before it, or escaped ones in pairs
_LONE = re.compile(_ESCAPE + r'\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})|'
                   + _ESCAPE + r'(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}')
_SURROGATE = re.compile(r'\\u[dD][89a-fA-F]')


def without_lone_surrogates(text: str) -> str:
    """JSON text with each escape of half a surrogate pair (a high one not followed by a low one, or a low one alone)
    written as U+FFFD's; whole pairs (an emoji as Python's json.dumps writes it) stay."""
    if not _SURROGATE.search(text):
        return text
    return _LONE.sub(lambda m: (m.group(1) or m.group(2) or "") + "\\ufffd", text)
