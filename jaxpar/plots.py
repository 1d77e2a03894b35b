"""Charts: the pipeline schedule as a Gantt chart (stages against iterations).

    python -m jaxpar.plots --stages 4 --microbatches 8 [--repeats 2] [--schedule 1f1b|zb_h1|zb_v] --out schedule.png

``--stages`` and ``--microbatches`` default to 4 and 8 (the docs' charts): ``python -m jaxpar.plots --schedule zb_v``
draws ZB-V's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from jaxpar.cli import COUNT, ArgumentParser, command
from jaxpar.layers.pipeline import bubble_fraction, in_flight, schedule, schedule_1f1b
from jaxpar.layers.zero_bubble import KINDS as ZERO_BUBBLE
from jaxpar.layers.zero_bubble import idle_fraction, schedule_zero_bubble
from jaxpar.layers.zero_bubble import in_flight as zb_in_flight


def plot_schedule(stages: int, microbatches: int, repeats: int, path: str | Path, kind: str = "gpipe",
                  lengths: tuple = (1.0, 1.0)) -> None:
    """Forward work of each stage per iteration, coloured by microbatch (hatched: later repeats);
    white cells are the bubble. ``kind="1f1b"``: forward (upper half, ``F``) and backward (lower half,
    ``B``, hatched) cells of the 1F1B schedule (interleaved with ``repeats`` > 1: ``F m.chunk``); the
    zero-bubble ones in the order built for passes of ``lengths`` (B, W in forwards)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if kind == "1f1b":
        _plot_1f1b(stages, microbatches, repeats, path)
        return
    if kind in ZERO_BUBBLE:
        _plot_zero_bubble(kind, stages, microbatches, path, lengths)
        return
    grid = schedule(stages, microbatches, repeats)
    iters = len(grid[0])
    cmap = plt.get_cmap("tab20")
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * iters + 1.5), 0.6 * stages + 1.4))
    for s, row in enumerate(grid):
        for t, cell in enumerate(row):
            if cell is None:
                continue
            m, r = cell
            ax.add_patch(plt.Rectangle((t, stages - 1 - s), 1, 1, facecolor=cmap(m % 20), edgecolor="black",
                                       hatch="//" if r % 2 else None, linewidth=0.5))
            ax.text(t + 0.5, stages - 0.5 - s, str(m) if repeats == 1 else f"{m}.{r}", ha="center", va="center",
                    fontsize=7)
    ax.set_xlim(0, iters)
    ax.set_ylim(0, stages)
    ax.set_yticks([stages - 0.5 - s for s in range(stages)], [f"stage {s}" for s in range(stages)])
    ax.set_xlabel("iteration")
    kind = "GPipe" if repeats == 1 else f"circular, {repeats} repeats"
    ax.set_title(f"{kind}: {stages} stages, {microbatches} microbatches, {iters} iterations, "
                 f"bubble {100 * bubble_fraction(stages, microbatches, repeats):.1f}%")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_1f1b(stages: int, microbatches: int, repeats: int, path: str | Path) -> None:
    kind = "1F1B" if repeats == 1 else f"interleaved 1F1B, {repeats} chunks per stage (F/B m.chunk)"
    grid = schedule_1f1b(stages, microbatches, repeats)
    _plot_passes(grid, stages, path, halves=True, width=0.45, fontsize=7 if repeats == 1 else 6,
                 label=lambda op, m, r: f"{op}{m}" if repeats == 1 else f"{op}{m}.{r}",
                 xlabel="iteration (upper half: forward F, lower half: backward B)",
                 title=f"{kind}: {stages} stages, {microbatches} microbatches, {len(grid[0])} iterations, "
                       f"bubble {100 * bubble_fraction(stages, microbatches, repeats):.1f}%\n"
                       f"at most {max(in_flight(stages, microbatches, repeats))} stage inputs in flight per stage")


def _plot_zero_bubble(kind: str, stages: int, microbatches: int, path: str | Path,
                      lengths: tuple = (1.0, 1.0)) -> None:
    """One pass per cell: zb_v's second chunk of a device (the way back up) labelled ``m'``."""
    grid = schedule_zero_bubble(kind, stages, microbatches, tuple(lengths))
    name = {"zb_h1": "ZB-H1", "zb_v": "ZB-V (two chunks per stage, ' = the way back up)"}[kind]
    _plot_passes(grid, stages, path, halves=False, width=0.32, fontsize=6,
                 label=lambda op, m, r: f"{op}{m}" + ("'" if r else ""),
                 xlabel="slot (one pass of one chunk: F forward, B input gradient, W weight gradient)",
                 title=f"{name}: {stages} stages, {microbatches} microbatches, {len(grid[0])} slots, idle "
                       f"{100 * idle_fraction(grid):.1f}% (1F1B: {100 * bubble_fraction(stages, microbatches):.1f}%)"
                       f"\nat most {max(zb_in_flight(grid))} chunk inputs held per stage (F to W)")


def _plot_passes(grid, stages: int, path: str | Path, *, halves: bool, width: float, fontsize: int, label, xlabel: str,
                 title: str) -> None:
    """Cells of passes ``(op, m, r)`` per stage and iteration, coloured by microbatch: F plain, B hatched ``//``,
    W hatched ``..``; with ``halves`` (1F1B: a forward and a backward per iteration) F the upper half of its
    cell and B the lower."""
    import matplotlib.pyplot as plt

    iters = len(grid[0])
    cmap = plt.get_cmap("tab20")
    fig, ax = plt.subplots(figsize=(max(6.0, width * iters + 1.5), (0.8 if halves else 0.6) * stages + 1.5))
    for s, row in enumerate(grid):
        for t, cell in enumerate(row):
            for op, m, r in cell:
                y, h = (stages - 1 - s + (0.5 if op == "F" else 0.0), 0.5) if halves else (stages - 1 - s, 1.0)
                ax.add_patch(plt.Rectangle((t, y), 1, h, facecolor=cmap(m % 20), edgecolor="black",
                                           hatch={"F": None, "B": "//", "W": ".."}[op], linewidth=0.5))
                ax.text(t + 0.5, y + h / 2, label(op, m, r), ha="center", va="center", fontsize=fontsize)
    ax.set_xlim(0, iters)
    ax.set_ylim(0, stages)
    ax.set_yticks([stages - 0.5 - s for s in range(stages)], [f"stage {s}" for s in range(stages)])
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def check_schedule_args(stages: int, microbatches: int, repeats: int, out: str | Path, kind: str = "gpipe") -> None:
    """The chart's inputs, each wrong one a ValueError naming it and the valid values."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    if stages < 1 or repeats < 1 or microbatches < 1:
        raise ValueError(f"--stages={stages}, --microbatches={microbatches} and --repeats={repeats} must be >= 1")
    if kind not in ("gpipe", "1f1b", *ZERO_BUBBLE):
        raise ValueError(f"--schedule={kind}: choose gpipe, 1f1b, {' or '.join(ZERO_BUBBLE)}")
    if kind in ZERO_BUBBLE and (repeats != 1 or microbatches < stages):
        raise ValueError(f"--schedule={kind} needs --repeats 1 (zb_v's two chunks per stage are its own) and "
                         f"--microbatches >= --stages ({stages}); got --repeats={repeats}, "
                         f"--microbatches={microbatches}")
    if kind == "1f1b" and repeats > 1 and microbatches % stages:
        raise ValueError(f"--schedule=1f1b with --repeats={repeats} (interleaved) needs --microbatches a multiple "
                         f"of --stages ({stages}); got {microbatches}")
    if repeats > 1 and microbatches < stages:
        raise ValueError(f"a circular schedule (--repeats={repeats}) needs --microbatches >= --stages ({stages}); "
                         f"got {microbatches}")
    path = Path(out)
    if not path.parent.is_dir():
        raise ValueError(f"--out={out}: the folder {str(path.parent)!r} does not exist")
    formats = Figure().canvas.get_supported_filetypes()
    fmt = path.suffix.lstrip(".").lower()
    if fmt not in formats:
        raise ValueError(f"--out={out}: unknown image format {fmt!r}; use one of {', '.join(sorted(formats))}")


@command()
def main(argv=None) -> int:
    """``python -m jaxpar.plots``: exit 0, or 2 with one ``error:`` line for a bad argument."""
    import sys

    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=COUNT, default=4, help=">= 1 (default 4)")
    ap.add_argument("--microbatches", type=COUNT, default=8, help=">= 1 (default 8)")
    ap.add_argument("--repeats", type=COUNT, default=1, help=">= 1")
    ap.add_argument("--schedule", default="gpipe",
                    help="gpipe (circular with --repeats > 1), 1f1b (interleaved with --repeats > 1), zb_h1 or zb_v "
                         "(zero bubble: F, B and W passes)")
    ap.add_argument("--out", default="pipeline_schedule.png")
    a = ap.parse_args(argv)
    try:
        check_schedule_args(a.stages, a.microbatches, a.repeats, a.out, a.schedule)
        plot_schedule(a.stages, a.microbatches, a.repeats, a.out, a.schedule)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
