"""Grids of the zero-bubble pipeline schedules ZB-H1 and ZB-V (Qi et al., "Zero Bubble Pipeline
Parallelism", ICLR 2024): which pass each stage runs in each time slot.

A stage's backward splits into B, the input's cotangent (the previous stage waits for it), and W, the
weight gradient (nothing waits for it). With the three passes taking one slot each (the paper's T_F =
T_B = T_W), 1F1B runs F and then B + W as one pass: its S - 1 slots of warm-up and of cool-down cost
3(S - 1) slots per stage, an idle fraction of (S-1)/(M+S-1). Deferring W fills them:

- ``zb_h1``: each stage runs 1F1B's order of F and B (stage s: S - s forwards, then a B and an F in
  turn, the last Bs alone), and the W of microbatch k - s right after the B of microbatch k (the
  rest after the last B): the first stage takes each W at once, the last stage defers them, so that
  the last stage's Ws fill the cool-down where stage 0 waits for the last cotangents. 3M + S - 1
  slots, idle (S-1)/(3M+S-1): a third of 1F1B's bubble in time; at most S microbatches forwarded and
  not yet through W on a stage (as many as 1F1B's first stage holds until its B).
- ``zb_v``: 2S chunks of L/(2S) layers, device d holding chunks d and 2S-1-d (a V: a microbatch goes
  down the devices and back up, the turn and the loss on devices S-1 and 0). Slots are a chunk's
  passes. The order is a list schedule: at each slot a device takes an F if one is ready and it holds
  fewer than 2S chunk inputs (S stage inputs, 1F1B's first stage's), the later chunk's first, else a B
  (the later chunk's first), else the oldest pending W. 6M + S - 1 slots where M is a multiple of S
  (the bound: the last device starts S - 1 slots late), idle (S-1)/(6M+S-1).

Each grid is timed as soon as possible from the stages' orders (:func:`time_orders`): a pass runs in
the slot after the passes it needs and after its stage's previous pass. These are the grids an executor
of the two schedules would follow; ``parallel.pipeline_schedule`` does not offer them yet (its
schedules: :mod:`jaxpar.layers.pipeline`).
"""

from __future__ import annotations

from jaxpar.layers.pipeline import peak_held

KINDS = ("zb_h1", "zb_v")
Op = tuple[str, int, int]  # ("F" | "B" | "W", microbatch, chunk: 0 .. chunks - 1 along the microbatch's path)


def chunks(kind: str, stages: int) -> int:
    """The model's chunks (groups of layers in a microbatch's order): S for ``zb_h1``, 2S for ``zb_v``."""
    _check(kind, stages, stages)
    return stages if kind == "zb_h1" else 2 * stages


def needs(op: Op, n_chunks: int) -> list[Op]:
    """The passes ``op`` waits for: F the previous chunk's F; B its own F and the next chunk's B (the last
    chunk: its F, the loss); W its own B."""
    kind, m, c = op
    if kind == "F":
        return [("F", m, c - 1)] if c > 0 else []
    if kind == "B":
        return [("F", m, c)] + ([("B", m, c + 1)] if c < n_chunks - 1 else [])
    return [("B", m, c)]


def orders(kind: str, stages: int, microbatches: int) -> list[list[Op]]:
    """Per stage, its passes in the order it runs them (module docstring)."""
    _check(kind, stages, microbatches)
    s_, m_ = stages, microbatches
    if kind == "zb_h1":
        out = []
        for s in range(s_):
            warm = min(s_ - s, m_)
            order: list[Op] = [("F", m, s) for m in range(warm)]
            nf, nw = warm, 0
            for k in range(m_):
                order.append(("B", k, s))
                if k - s >= 0:
                    order.append(("W", k - s, s))
                    nw += 1
                if nf < m_:
                    order.append(("F", nf, s))
                    nf += 1
            out.append(order + [("W", m, s) for m in range(nw, m_)])
        return out
    return _list_schedule(s_, m_)


def _list_schedule(stages: int, microbatches: int) -> list[list[Op]]:
    """ZB-V's order: slot by slot, each device takes one ready pass (module docstring's priorities)."""
    n = 2 * stages
    done: dict[Op, int] = {}
    nxt = {(p, c): 0 for p in "FBW" for c in range(n)}  # each chunk's passes in microbatch order
    live = [0] * stages
    out: list[list[Op]] = [[] for _ in range(stages)]
    t = 0
    while len(done) < 3 * microbatches * n:
        for d in range(stages):
            ready = []
            for c in (d, n - 1 - d):
                for p in "FBW":
                    m = nxt[(p, c)]
                    op = (p, m, c)
                    if m < microbatches and all(done.get(x, t) < t for x in needs(op, n)) and (
                            p != "F" or live[d] < n):
                        ready.append(op)
            if not ready:
                continue
            op = min(ready, key=lambda o: ("FBW".index(o[0]), o[2] if o[0] == "W" else -o[2]))
            done[op] = t
            out[d].append(op)
            nxt[(op[0], op[2])] += 1
            live[d] += {"F": 1, "B": 0, "W": -1}[op[0]]
        t += 1
    return out


def time_orders(stage_orders: list[list[Op]], n_chunks: int) -> list[dict[Op, int]]:
    """Per stage, the slot of each of its passes: as soon as its stage's previous pass and the passes it
    needs (:func:`needs`) have run, one slot later (their outputs move to the next stage between slots)."""
    at: dict[Op, int] = {}
    pos = [0] * len(stage_orders)
    free = [0] * len(stage_orders)
    out: list[dict[Op, int]] = [{} for _ in stage_orders]
    left = sum(map(len, stage_orders))
    while left:
        moved = False
        for s, order in enumerate(stage_orders):
            if pos[s] == len(order):
                continue
            op = order[pos[s]]
            deps = needs(op, n_chunks)
            if all(x in at for x in deps):
                at[op] = out[s][op] = max([free[s]] + [at[x] + 1 for x in deps])
                free[s], pos[s], left, moved = at[op] + 1, pos[s] + 1, left - 1, True
        if not moved:
            raise ValueError("the stages' orders wait on each other (no pass can run)")
    return out


def schedule_zero_bubble(kind: str, stages: int, microbatches: int) -> list[list[tuple[Op, ...]]]:
    """``grid[s][t]``: the passes of stage s in slot t, ``(("F" | "B" | "W", m, r),)`` or ``()`` (idle),
    r the chunk's index among the stage's (0, or for ``zb_v`` 1 for the way back up): the form of
    :func:`~jaxpar.layers.pipeline.schedule_1f1b`'s grid, in slots of one pass of one chunk."""
    n = chunks(kind, stages)
    timed = time_orders(orders(kind, stages, microbatches), n)
    slots = max(t for row in timed for t in row.values()) + 1
    grid: list[list[tuple[Op, ...]]] = [[() for _ in range(slots)] for _ in range(stages)]
    for s, row in enumerate(timed):
        for (p, m, c), t in row.items():
            grid[s][t] = ((p, m, 0 if c < stages else 1),)
    return grid


def idle_fraction(grid) -> float:
    """The share of the stages' slots with no pass."""
    return sum(not cell for row in grid for cell in row) / sum(len(row) for row in grid)


def in_flight(grid) -> list[int]:
    """Per stage, the most chunk inputs held at once: forwarded and not yet through W (which needs them)."""
    return peak_held(grid, until="W")


def _check(kind: str, stages: int, microbatches: int) -> None:
    if kind not in KINDS:
        raise ValueError(f"zero-bubble schedule {kind!r}: choose one of {', '.join(KINDS)}")
    if stages < 1 or microbatches < stages:
        raise ValueError(f"a zero-bubble schedule needs stages >= 1 and microbatches >= stages; got stages={stages}, "
                         f"microbatches={microbatches}")
