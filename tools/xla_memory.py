#!/usr/bin/env python
"""Where a compiled XLA program's temporaries peak: the heap XLA allocates against what is live, from a dump.

``memory_analysis().temp_size`` is the length of the heap XLA's buffer assignment packs the program's
temporaries into. Whether a gap between a memory model and that number is a tensor the model misses or the
packing shows only in the dump: compile with ``XLA_FLAGS=--xla_dump_to=DIR`` (e.g. ``python -m jaxpar.compile
--config ...``), then::

    python tools/xla_memory.py DIR                 # the largest module's temporaries: heap, live peak, top 25
    python tools/xla_memory.py DIR --at 873        # what is live at position 873 of the schedule
    python tools/xla_memory.py DIR --module step --top 50

It reads ``*-buffer-assignment.txt`` (each value's offset and size in the preallocated-temp allocation) and
``*-live-range.txt`` (each value's first and last position in the schedule). Values of one buffer share
their offset and size, and two buffers never overlap while both are live, so the bytes live at a position
are the sum over distinct (offset, size) slots live there. Loop-carried values (a ``while``'s tuple
elements, ``(phi)`` in the assignment, e.g. a scan's stacked residuals) are values like any other: a reading
that drops them misses exactly the buffers that live longest.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

_ALLOC = re.compile(r"allocation (\d+): size (\d+), (.*)")
_VALUE = re.compile(r" value: <\d+ (\S+?)(?:\{\})?(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): (.*)")
_RANGE = re.compile(r"\s+(\S+?)\{(.*)\}:(\d+)-(\d+)$")
_SEQ = re.compile(r"\s+(\d+):(\S+)$")


def read(assignment: Path, live_range: Path) -> dict:
    """``{"heap": bytes, "values": [(name, size, offset, shape, first, last)], "sequence": {position: name}}``
    for the preallocated-temp allocation (values without a live range are left out)."""
    values, in_temp, heap = [], False, 0
    for line in assignment.read_text().splitlines():
        if m := _ALLOC.match(line):
            in_temp = "preallocated-temp" in m.group(3)
            heap = int(m.group(2)) if in_temp else heap
        elif in_temp and (m := _VALUE.match(line)):
            values.append((m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)))
    ranges, sequence, section = {}, {}, ""
    for line in live_range.read_text().splitlines():
        if line.strip() in ("InstructionSequence:", "BufferLiveRange:") or line.strip().startswith("Live ranges"):
            section = line.strip()
        elif section == "InstructionSequence:" and (m := _SEQ.match(line)):
            sequence[int(m.group(1))] = m.group(2)
        elif section == "BufferLiveRange:" and (m := _RANGE.match(line)):
            ranges[m.group(1) + (f"{{{m.group(2)}}}" if m.group(2) else "")] = (int(m.group(3)), int(m.group(4)))
    kept = [(n, s, o, shape, *ranges[n]) for n, s, o, shape in values if n in ranges]
    return {"heap": heap, "values": kept, "sequence": sequence}


def live_bytes(values: list, length: int) -> list[int]:
    """Bytes live at each position ``0 .. length - 1``: each (offset, size) slot counted once where any of
    its values is live."""
    by_slot: dict = defaultdict(list)
    for _, size, offset, _, first, last in values:
        by_slot[offset, size].append((first, last))
    diff = [0] * (length + 1)
    for (_, size), spans in by_slot.items():
        spans.sort()
        start, end = spans[0]
        for a, b in spans[1:] + [(length + 1, length + 1)]:
            if a > end + 1:
                diff[start] += size
                diff[min(end + 1, length)] -= size
                start, end = a, b
            else:
                end = max(end, b)
    out, run = [], 0
    for d in diff[:length]:
        run += d
        out.append(run)
    return out


def report(dump: Path, module: str = "", at: int | None = None, top: int = 25) -> str:
    """The text ``main`` prints for the largest module in ``dump`` whose name contains ``module``."""
    found = sorted((p for p in dump.glob("*-buffer-assignment.txt") if module in p.name),
                   key=lambda p: p.stat().st_size)
    if not found:
        raise SystemExit(f"error: no *-buffer-assignment.txt{f' matching {module!r}' if module else ''} in {dump}; "
                         "compile with XLA_FLAGS=--xla_dump_to=DIR")
    assignment = found[-1]
    live_range = assignment.with_name(assignment.name.replace("-buffer-assignment.txt", "-live-range.txt"))
    if not live_range.exists():
        raise SystemExit(f"error: {live_range.name} is missing beside {assignment.name}")
    prog = read(assignment, live_range)
    length = max(prog["sequence"], default=0) + 1
    live = live_bytes(prog["values"], length)
    peak = max(range(length), key=live.__getitem__) if live else 0
    t = peak if at is None else at
    if not 0 <= t < length:
        raise SystemExit(f"error: --at {at} is outside the schedule's positions 0 .. {length - 1}")
    mib = 2 ** 20
    lines = [f"{assignment.name}",
             f"heap (temp_size): {prog['heap'] / mib:.2f} MiB; live peak: {live[peak] / mib:.2f} MiB at position "
             f"{peak} ({prog['sequence'].get(peak, '?')}), {live[peak] / max(prog['heap'], 1):.0%} of the heap"]
    here, seen = [], set()
    for name, size, offset, shape, first, last in prog["values"]:
        if first <= t <= last and (offset, size) not in seen:
            seen.add((offset, size))
            here.append((size, offset, name, shape, first, last))
    here.sort(reverse=True)
    lines.append(f"live at {t} ({prog['sequence'].get(t, '?')}): {live[t] / mib:.2f} MiB in {len(here)} buffers; "
                 f"the {min(top, len(here))} largest:")
    lines += [f"  {size / mib:9.2f} MiB  @{offset / mib:9.2f}  [{first}-{last}]  {name}  {shape[:70]}"
              for size, offset, name, shape, first, last in here[:top]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dump", type=Path, help="the --xla_dump_to directory")
    ap.add_argument("--module", default="", help="a substring of the module's file name (default: the largest)")
    ap.add_argument("--at", type=int, default=None, help="a schedule position to list (default: the live peak)")
    ap.add_argument("--top", type=int, default=25, help="how many of the largest live buffers to list")
    a = ap.parse_args(argv)
    print(report(a.dump, a.module, a.at, a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
