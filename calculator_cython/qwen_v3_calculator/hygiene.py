"""Text hygiene shared by billing and the gateway: remove invisible characters users paste by accident.

Removed: zero-width characters (U+200B, U+2060, U+FEFF, U+00AD), bidi controls (U+202A–U+202E,
U+2066–U+2069), TAG characters (U+E0000–U+E007F) except inside valid emoji tag sequences (a black flag
U+1F3F4 followed by tags U+E0020–U+E007E and ended by CANCEL TAG U+E007F, e.g. the flag of Scotland),
and C0/C1 control characters other than TAB, LF and CR. Kept: ZWJ (U+200D) and ZWNJ (U+200C), which
change how emoji and Indic/Persian text render. Pasted U+200B is otherwise counted by some layers and not
others, so the bills they compute disagree.
"""
from __future__ import annotations

import re

_SIMPLE = (
    [0x200B, 0x2060, 0xFEFF, 0x00AD]
    + list(range(0x202A, 0x202F))
    + list(range(0x2066, 0x206A))
    + [c for c in range(0x00, 0x20) if c not in (0x09, 0x0A, 0x0D)]
    + list(range(0x7F, 0xA0))
)
_DELETE = dict.fromkeys(_SIMPLE)
# An emoji tag sequence is kept whole; any other TAG character is removed.
_TAGS = re.compile("(\U0001F3F4[\U000E0020-\U000E007E]+\U000E007F)|[\U000E0000-\U000E007F]")


def sanitize(text: str) -> str:
    """``text`` without the invisible characters listed in the module docstring."""
    if not isinstance(text, str):
        raise TypeError(f"text must be str, not {type(text).__name__}")
    out = text.translate(_DELETE)
    if _TAGS.search(out):
        out = _TAGS.sub(lambda m: m.group(1) or "", out)
    return out


def removed_count(original: str, cleaned: str) -> int:
    return len(original) - len(cleaned)
