"""The command-line contract shared by ``train.py``, ``python -m jaxpar.plan`` / ``compile`` / ``generate``
/ ``plots`` and the benchmarks: a user's mistake is one ``error:`` line on stderr and exit status 2,
never a usage block or a traceback.

* :class:`ArgumentParser`: argparse's errors as that one line.
* :func:`number`: the ``type=`` of every numeric flag: the value parsed and checked against its range
  (a :class:`~jaxpar.config.Range`, as config keys declare theirs), so that ``--efficiency 5`` is
  ``error: argument --efficiency: 5 is out of range: it must be in (0, 1]``, exit 2.
* :func:`command`: the wrapper of a CLI's ``main``: Ctrl-C is one line and exit 130 (no traceback), and
  a reader that closes the output pipe early (``| head``) ends the command quietly (exit 1).
"""

from __future__ import annotations

import argparse
import difflib
import functools
import os
import sys
import time
from typing import Callable

from jaxpar.config import Range


class ArgumentParser(argparse.ArgumentParser):
    """:class:`argparse.ArgumentParser` whose errors (an unknown option, a value of the wrong type or out
    of its range, a missing required argument) are one line: ``error: <what>; --help lists the arguments``,
    exit 2. An unknown option names the nearest known one."""

    def error(self, message: str):
        hint = ""
        if message.startswith("unrecognized arguments:"):
            known = [o for o in self._option_string_actions if o.startswith("--")]
            for word in message.split(":", 1)[1].split():
                near = difflib.get_close_matches(word.split("=")[0], known, n=1)
                if word.startswith("-") and near:
                    hint = f" (did you mean {near[0]}?)"
                    break
        self.exit(2, f"error: {message}{hint}; --help lists the arguments\n")


def _bound(v: float) -> str:
    return f"{v:,}" if isinstance(v, int) or float(v).is_integer() and abs(v) >= 1e6 else f"{v:g}"


def describe(r: Range) -> str:
    """``>= 1``, ``in (0, 1]``, ``<= 10``, ``in [0, 4,294,967,295]``: the values of a range, for a message."""
    if r.hi is None:
        return f"{'>' if r.lo_open else '>='} {_bound(r.lo)}" if r.lo is not None else "finite"
    if r.lo is None:
        return f"{'<' if r.hi_open else '<='} {_bound(r.hi)}"
    return f"in {'(' if r.lo_open else '['}{_bound(r.lo)}, {_bound(r.hi)}{')' if r.hi_open else ']'}"


def number(kind: type, valid: Range, meaning: str = "") -> Callable[[str], int | float]:
    """An argparse ``type``: the argument's text as ``kind`` (``int`` or ``float``), refused unless it lies
    in ``valid`` (never NaN or infinite). ``meaning``, when given, follows the range in the message
    (e.g. ``"0 = greedy"``)."""
    noun = "an integer" if kind is int else "a number"

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        if v not in valid:  # NaN and infinities included
            raise argparse.ArgumentTypeError(f"{text} is out of range: it must be {describe(valid)}"
                                             + (f" ({meaning})" if meaning else ""))
        return v

    parse.__name__ = kind.__name__
    return parse


COUNT = number(int, Range(1))                                  # how many of something: >= 1
SIZE = number(float, Range(0, lo_open=True))                   # a memory size or a bandwidth: > 0
SEED = number(int, Range(0, 2**32 - 1), "JAX keys take 32 bits")  # larger seeds would repeat smaller ones


def command(interrupted: str = "nothing was written") -> Callable[[Callable[..., int]], Callable[..., int]]:
    """The decorator of a CLI's ``main(argv)``: Ctrl-C anywhere in it is ``error: interrupted (Ctrl-C);
    <interrupted>``, exit 130; a closed output pipe (the reader, e.g. ``head``, has all it wanted) stops
    it quietly with exit 1, without Python's report of the failed flush at exit."""

    def wrap(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def run(argv: list[str] | None = None) -> int:
            try:
                return main(argv)
            except KeyboardInterrupt:
                print(f"error: interrupted (Ctrl-C); {interrupted}", file=sys.stderr)
                return 130
            except BrokenPipeError:
                try:  # the interpreter's last flush would fail again
                    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                except (AttributeError, OSError, ValueError):  # a stdout without a file (captured)
                    pass
                return 1

        return run

    return wrap


def duration(seconds: float) -> str:
    """``42s``, ``5m 03s``, ``22h 30m``, ``3d 08h``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600:02d}h"


class Progress:
    """Progress of a long command on stderr: a rich bar on a terminal, elsewhere (a log file, a pipe) one
    line every ``every`` seconds, ``<label>: <done>/<total> <unit> (<percent>), <rate> <rate_unit>, ETA
    <time>``. Call it with the count done (``progress(done, total)``); ``per`` converts a count into what
    the rate counts (e.g. one step of 3 prompts = 3 tokens). The rate is that of the latest ``every`` to
    ``2 x every`` seconds, from the first call on (the time before it may be compilation), so there is
    none before the second call. Use it in a ``with``."""

    def __init__(self, total: int, label: str, unit: str, rate_unit: str, per: int = 1, every: float = 10.0,
                 stream=None, clock: Callable[[], float] = time.monotonic):
        self.total, self.label, self.unit, self.rate_unit, self.per = total, label, unit, rate_unit, per
        self.every, self.stream, self.clock = every, stream or sys.stderr, clock
        self.done, self.shown = 0, clock()
        self.mark: tuple[float, int] | None = None  # (time, count) the rate is measured from
        self.speed: float | None = None
        self.bar = None
        if getattr(self.stream, "isatty", lambda: False)():
            from rich.console import Console
            from rich.progress import BarColumn, TextColumn
            from rich.progress import Progress as Bar

            self.bar = Bar(TextColumn(label), BarColumn(), TextColumn("{task.completed:,}/{task.total:,} " + unit),
                           TextColumn("{task.fields[rate]}  ETA {task.fields[eta]}"),
                           console=Console(file=self.stream), transient=True)
            self.task = self.bar.add_task(label, total=total, rate="-", eta="-")

    def __enter__(self):
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()

    def eta(self) -> float | None:
        return None if not self.speed else (self.total - self.done) * self.per / self.speed

    def line(self) -> str:
        eta = self.eta()
        speed = "measuring the rate" if eta is None else f"{self.speed:,.0f} {self.rate_unit}, ETA {duration(eta)}"
        share = 100 * self.done / max(self.total, 1)
        return f"{self.label}: {self.done:,}/{self.total:,} {self.unit} ({share:.1f}%), {speed}"

    def __call__(self, done: int, total: int | None = None) -> None:
        self.done, now = done, self.clock()
        if self.mark is None:
            self.mark = (now, done)
        t0, d0 = self.mark
        if done > d0 and now > t0:
            self.speed = (done - d0) * self.per / (now - t0)
        if now - t0 >= self.every:
            self.mark = (now, done)
        if self.bar is not None:
            eta = self.eta()
            known = eta is not None
            self.bar.update(self.task, completed=done, rate=f"{self.speed:,.0f} {self.rate_unit}" if known else "-",
                            eta=duration(eta) if eta is not None else "-")
        elif now - self.shown >= self.every:
            self.shown = now
            print(self.line(), file=self.stream, flush=True)
