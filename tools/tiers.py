#!/usr/bin/env python
"""The test tiers' data: how long each test took in the last full run, from pytest's ``--durations=0`` report.

``tests/durations.json`` maps each test's node id to its seconds (setup + call + teardown) in one full run of
the suite on the reference 2-core machine. ``tests/conftest.py`` marks ``slow`` every test that took more than
``SLOW_SECONDS`` there (and every test decorated ``@pytest.mark.slow``); ``-m "not slow"`` is the quick tier.
A test that is not in the file (a new one) is quick until the file is remade. Remake it after adding slow
tests or changing what a test compiles::

    python -m pytest -n 2 -q -W ignore::DeprecationWarning --durations=0 | tee /tmp/full.log
    python tools/tiers.py /tmp/full.log              # updates tests/durations.json
    python tools/tiers.py /tmp/full.log --print      # the tiers' sums, without writing
    python tools/tiers.py /tmp/full.log --fresh      # this run's times alone

One run's times are noisy where a module's fixture runs: its cost lands on whichever of the module's tests an
xdist worker runs first. So by default a test keeps the longer of its recorded time and this run's (a test
slow in either run stays slow); tests the run did not see are dropped (renamed or removed). ``--fresh``
starts over from this run.

The report's lines are ``<seconds>s <setup|call|teardown> <node id>`` (a node id may hold spaces: its
parameters' text); phases under 0.005 s are not listed by pytest and count as 0.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "durations.json"
LINE = re.compile(r"^\s*(\d+(?:\.\d+)?)s (setup|call|teardown)\s+(tests/\S.*?)\s*$", re.M)


def parse(text: str) -> dict[str, float]:
    """Seconds per node id (phases summed) of a ``--durations=0`` report."""
    per: Counter = Counter()
    for m in LINE.finditer(text):
        per[m.group(3)] += float(m.group(1))
    return {k: round(v, 1) for k, v in sorted(per.items())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log", help="the output of a full run with --durations=0")
    ap.add_argument("--print", action="store_true", help="print the tiers' sums; do not write the file")
    ap.add_argument("--out", default=str(OUT), help=f"where to write (default {OUT.relative_to(ROOT)})")
    ap.add_argument("--fresh", action="store_true", help="this run's times alone, not the longer of them and the "
                                                          "recorded ones")
    args = ap.parse_args(argv)
    try:
        durations = parse(Path(args.log).read_text(errors="replace"))
    except OSError as e:
        print(f"error: cannot read {args.log}: {e.strerror}", file=sys.stderr)
        return 2
    if not durations:
        print(f"error: {args.log} holds no '--durations=0' lines (run pytest with --durations=0)", file=sys.stderr)
        return 2
    out = Path(args.out)
    if not args.fresh and out.exists():
        recorded = json.loads(out.read_text())
        durations = {k: max(v, recorded.get(k, 0.0)) for k, v in durations.items()}
    # the threshold the tiers use, read from tests/conftest.py (importing it would start JAX)
    threshold = float(re.search(r"^SLOW_SECONDS = (\S+)", (ROOT / "tests" / "conftest.py").read_text(), re.M)[1])
    slow = sum(v for v in durations.values() if v > threshold)
    print(f"{len(durations)} tests, {sum(durations.values()):.0f} s in all; over {threshold} s (slow): "
          f"{sum(v > threshold for v in durations.values())} tests, {slow:.0f} s; quick: "
          f"{sum(durations.values()) - slow:.0f} s (divide by the xdist workers for the wall time)")
    if not args.print:
        out.write_text(json.dumps(durations, indent=0, sort_keys=True) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
