"""A strict unified-diff applier (pure Python; no ``patch`` or ``git`` binary needed on the target machine).

Reads git-format patches (``diff --git``, ``---``/``+++``, ``@@ -a,b +c,d @@`` hunks) and applies them to
file contents in memory. A hunk applies only where its context and removed lines match exactly; it is
looked for at the line the header names first, then at growing distances (the file may have shifted). No
fuzz: a hunk whose context differs is a conflict. Reversing a patch swaps its sides.
"""
from __future__ import annotations

import dataclasses
import re

_HUNK = re.compile(rb"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
NO_NEWLINE = b"\\ No newline at end of file"


class PatchError(ValueError):
    """A patch is malformed or does not apply."""


@dataclasses.dataclass
class Hunk:
    old_start: int
    old: list[bytes]  # lines (with their endings) the hunk expects
    new: list[bytes]  # lines it leaves

    def reversed(self) -> "Hunk":
        return Hunk(self.old_start, self.new, self.old)


@dataclasses.dataclass
class FilePatch:
    path: str  # relative to the directory the patch applies in (a/ b/ prefixes stripped)
    hunks: list[Hunk]
    new_file: bool = False
    deleted_file: bool = False

    def reversed(self) -> "FilePatch":
        return FilePatch(self.path, [h.reversed() for h in self.hunks], self.deleted_file, self.new_file)


def _strip_prefix(name: bytes) -> str:
    text = name.decode("utf-8").split("\t", 1)[0].strip()
    if text == "/dev/null":
        return text
    return text[2:] if text[:2] in ("a/", "b/") else text


def parse(text: bytes | str) -> list[FilePatch]:
    """Parse a (git-format) unified diff into file patches."""
    data = text.encode("utf-8") if isinstance(text, str) else text
    lines = data.splitlines(keepends=True)
    files: list[FilePatch] = []
    current: FilePatch | None = None
    old_name = None
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith(b"--- ") and i + 1 < len(lines) and lines[i + 1].startswith(b"+++ "):
            old_name = _strip_prefix(line[4:])
            new_name = _strip_prefix(lines[i + 1][4:])
            path = new_name if new_name != "/dev/null" else old_name
            current = FilePatch(path, [], new_file=old_name == "/dev/null", deleted_file=new_name == "/dev/null")
            files.append(current)
            i += 2
            continue
        m = _HUNK.match(line)
        if m:
            if current is None:
                raise PatchError(f"hunk before any file header: {line!r}")
            old_count = int(m.group(2)) if m.group(2) is not None else 1
            new_count = int(m.group(4)) if m.group(4) is not None else 1
            old: list[bytes] = []
            new: list[bytes] = []
            i += 1
            while i < len(lines) and (len(old) < old_count or len(new) < new_count):
                body = lines[i]
                tag, content = body[:1], body[1:]
                if body.startswith(NO_NEWLINE):
                    i += 1
                    continue
                if tag == b" " or body in (b"\n", b"\r\n"):  # some tools drop the space of empty context
                    content = content if tag == b" " else body
                    old.append(content)
                    new.append(content)
                elif tag == b"-":
                    old.append(content)
                elif tag == b"+":
                    new.append(content)
                else:
                    raise PatchError(f"{current.path}: malformed hunk line {body!r}")
                i += 1
                # "\ No newline at end of file" belongs to the line just read
                if i < len(lines) and lines[i].startswith(NO_NEWLINE):
                    for side in ((old,) if tag == b"-" else (new,) if tag == b"+" else (old, new)):
                        side[-1] = side[-1].rstrip(b"\r\n")
                    i += 1
            if len(old) != old_count or len(new) != new_count:
                raise PatchError(f"{current.path}: truncated hunk at {line.decode(errors='replace').strip()}")
            current.hunks.append(Hunk(int(m.group(1)), old, new))
            continue
        i += 1
    if not files:
        raise PatchError("no file changes found in the patch")
    return files


def _find(lines: list[bytes], needle: list[bytes], start: int, lo: int) -> int:
    """Index >= lo where ``needle`` occurs, nearest to ``start`` first; -1 when nowhere."""
    n = len(needle)
    last = len(lines) - n
    if n == 0:
        return min(max(start, lo), len(lines))
    for distance in range(0, max(last - lo, start - lo, 0) + 1):
        for pos in (start + distance, start - distance) if distance else (start,):
            if lo <= pos <= last and lines[pos:pos + n] == needle:
                return pos
    return -1


def apply_file(content: bytes | None, fp: FilePatch) -> bytes | None:
    """The patched content (None: the file is deleted). Raises :class:`PatchError` on a conflict."""
    if fp.new_file:
        if content is not None:
            raise PatchError(f"{fp.path}: the patch creates it, but it already exists")
        return b"".join(b"".join(h.new) for h in fp.hunks)
    if content is None:
        raise PatchError(f"{fp.path}: file not found")
    lines = content.splitlines(keepends=True)
    out: list[bytes] = []
    cursor = 0
    offset = 0
    for number, hunk in enumerate(fp.hunks, 1):
        want = max(hunk.old_start - 1 + offset, cursor) if hunk.old else max(hunk.old_start + offset, cursor)
        pos = _find(lines, hunk.old, want, cursor)
        if pos < 0:
            raise PatchError(f"{fp.path}: hunk {number} (line {hunk.old_start}) does not apply: "
                             "its context is not in the file")
        offset = pos - (hunk.old_start - 1)
        out.extend(lines[cursor:pos])
        out.extend(hunk.new)
        cursor = pos + len(hunk.old)
    out.extend(lines[cursor:])
    result = b"".join(out)
    if fp.deleted_file:
        if result:
            raise PatchError(f"{fp.path}: the patch deletes it, but its content differs")
        return None
    return result
