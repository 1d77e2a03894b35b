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
  (the bound: the last device starts S - 1 slots late), idle (S-1)/(6M+S-1). The order is built in time
  for the passes' lengths (:func:`lengths_for`): equal, the paper's; with a B that runs its chunk's forward
  again (``parallel.stage_remat``, B = 2F), the same priorities taken as the passes end, which waits less
  for the Bs coming back up the V (:func:`_list_schedule`).

Each grid is timed as soon as possible from the stages' orders (:func:`time_orders`): a pass runs in
the slot after the passes it needs and after its stage's previous pass. :func:`zero_bubble_loss` runs
either from its grid (``parallel.pipeline_schedule=zb_h1`` / ``zb_v``; B and W apart:
:mod:`jaxpar.layers.wgrad`), :func:`zero_bubble_forward` its forwards alone (an evaluation, logits: ZB-V's
storage, stage s holding groups s and 2S-1-s, is no ring for GPipe). Long by design: the grids, the
executor's tables and the executor that follows them, together.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.layers.pipeline import allocate, peak_held
from jaxpar.layers.residuals import Residuals, slot_reader
from jaxpar.partitioning import constrain

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


EQUAL = (1.0, 1.0)  # the lengths of B and W in forwards (F = 1) that the paper's grids take


def lengths_for(stage_remat: bool) -> tuple[float, float]:
    """The lengths of B and W, in forwards, that ZB-V's order is built for: W a forward's matmuls again (the
    weights' half of the backward's), B the inputs' half and, with ``parallel.stage_remat`` (a B runs its
    chunk's forward again), one forward more. (Nominal: attention's own backward and the remat policy's
    recompute lengthen B too; the time model times the order with those, :func:`stretch`.)"""
    return (2.0, 1.0) if stage_remat else EQUAL


# the remat policies whose kept residuals hold each matmul's input or what it is made of without a matmul (a norm,
# the gated product): W reads the inputs there (:func:`inputs_from_residuals` finds it so for a run's own stage)
INPUTS_KEPT = ("none", "save_dots", "minimal")


def passes_for(stage_remat: bool, remat: str) -> tuple[tuple[float, float], str]:
    """``(lengths, x_until)`` of a run's grid and buffers: the passes' lengths (:func:`lengths_for`) and the pass
    that last reads a chunk's input or residuals (:func:`tables`): W where the forward's residuals are kept under
    a policy of :data:`INPUTS_KEPT` (W reads its matmuls' inputs there), else B."""
    return lengths_for(stage_remat), "W" if not stage_remat and remat in INPUTS_KEPT else "B"


@functools.lru_cache(maxsize=256)  # (the planner asks for the same S and M many times; callers do not mutate it)
def orders(kind: str, stages: int, microbatches: int, lengths: tuple = EQUAL) -> list[list[Op]]:
    """Per stage, its passes in the order it runs them (module docstring); ZB-V's built for passes of
    ``lengths`` (B, W in forwards: :func:`lengths_for`)."""
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
    return _list_schedule(s_, m_, tuple(lengths))


def _list_schedule(stages: int, microbatches: int, lengths: tuple) -> list[list[Op]]:
    """ZB-V's order: a list schedule in time, the passes taking F 1 and B, W ``lengths``. Repeatedly, the
    device that can start a pass soonest (its previous pass and the passes the new one needs ended) takes,
    among the passes it can start then, the first by the module docstring's priorities (an F while it holds
    fewer than 2S chunk inputs, the later chunk's first; then a B, the later chunk's first; then the oldest
    W). With equal lengths this is the slot-by-slot schedule of the paper's grid (6M + S - 1 slots where S
    divides M); with B twice F (a B that runs its chunk's forward again) it waits less for the Bs coming
    back up the V: at S = 4, M = 8 a stage's time stretched 1.09x by the bubble against 1.30x in the
    equal-length order."""
    n = 2 * stages
    cost = {"F": 1.0, "B": float(lengths[0]), "W": float(lengths[1])}
    end: dict[Op, float] = {}
    nxt = {(p, c): 0 for p in "FBW" for c in range(n)}
    live = [0] * stages
    free = [0.0] * stages
    out: list[list[Op]] = [[] for _ in range(stages)]
    while len(end) < 3 * microbatches * n:
        best = None
        for d in range(stages):
            starts = []
            for c in (d, n - 1 - d):
                for p in "FBW":
                    op = (p, nxt[(p, c)], c)
                    if op[1] < microbatches and all(x in end for x in needs(op, n)) and (p != "F" or live[d] < n):
                        starts.append((max([free[d]] + [end[x] for x in needs(op, n)]), op))
            if starts:
                t0 = min(t for t, _ in starts)
                op = min((o for t, o in starts if t <= t0 + 1e-9),
                         key=lambda o: ("FBW".index(o[0]), o[2] if o[0] == "W" else -o[2]))
                if best is None or t0 < best[0]:
                    best = (t0, d, op)
        if best is None:
            raise ValueError("no pass can start")  # (the F limit leaves a B or W ready: not reached)
        t0, d, op = best
        end[op] = free[d] = t0 + cost[op[0]]
        out[d].append(op)
        nxt[(op[0], op[2])] += 1
        live[d] += {"F": 1, "B": 0, "W": -1}[op[0]]
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


@functools.lru_cache(maxsize=256)
def schedule_zero_bubble(kind: str, stages: int, microbatches: int,
                         lengths: tuple = EQUAL) -> list[list[tuple[Op, ...]]]:
    """``grid[s][t]``: the passes of stage s in slot t, ``(("F" | "B" | "W", m, r),)`` or ``()`` (idle),
    r the chunk's index among the stage's (0, or for ``zb_v`` 1 for the way back up): the form of
    :func:`~jaxpar.layers.pipeline.schedule_1f1b`'s grid, in slots of one pass of one chunk (the order of
    :func:`orders` for ``lengths``)."""
    n = chunks(kind, stages)
    timed = time_orders(orders(kind, stages, microbatches, lengths), n)
    slots = max(t for row in timed for t in row.values()) + 1
    grid: list[list[tuple[Op, ...]]] = [[() for _ in range(slots)] for _ in range(stages)]
    for s, row in enumerate(timed):
        for (p, m, c), t in row.items():
            grid[s][t] = ((p, m, 0 if c < stages else 1),)
    return grid


def describe(kind: str, stages: int, microbatches: int, log, lengths: tuple = EQUAL, x_until: str = "W") -> float:
    """``log`` the run log's line on the schedule; its idle fraction (the ``bubble_fraction`` of metrics.jsonl).
    ``lengths, x_until``: :func:`passes_for` (the defaults: the forwards' residuals kept, no remat)."""
    grid = schedule_zero_bubble(kind, stages, microbatches, lengths)
    bubble, sizes = idle_fraction(grid), tables(kind, stages, microbatches, lengths=lengths, x_until=x_until)["sizes"]
    name, unit, what = (("ZB-H1", "", "stage inputs") if kind == "zb_h1" else
                        ("ZB-V (two chunks per stage)", " of a chunk", "chunk inputs"))
    built = ("taken as equal" if kind == "zb_h1" or tuple(lengths) == EQUAL else
             f"the order built for B = {lengths[0]:g} F, W = {lengths[1]:g} F")
    log(f"pipeline: {name}, {stages} stages, {microbatches} microbatches: {len(grid[0])} slots of one pass{unit} "
        f"(F, B or W, {built}), at most {sizes['x']} {what} and {sizes['w']} chunks' deferred weight-gradient "
        f"inputs held per stage, bubble {100 * bubble:.1f}% (1F1B: "
        f"{100 * (stages - 1) / (microbatches + stages - 1):.1f}%)")
    if tuple(lengths) != EQUAL:  # parallel.stage_remat: 1F1B's backward would drop what these Ws hold
        log("pipeline: each B runs its chunk's forward again from the kept input and each deferred W holds that "
            "microbatch's matmul inputs and output cotangents, which 1F1B's backward drops at once: more memory "
            "than 1F1B at the same S and M; parallel.stage_remat=false (the forward's residuals kept, no forward "
            "run twice) holds about 1F1B's (docs/concepts/pipeline.md)")
    elif x_until == "B":  # a remat policy recomputes the matmuls' inputs: the taps hold them
        log("pipeline: model.remat recomputes the matmuls' inputs, so each deferred W holds that microbatch's "
            "inputs and output cotangents, which 1F1B's backward drops at once: more memory than 1F1B at the same "
            "S and M; with model.remat=none or save_dots W reads the inputs from the kept residuals "
            "(docs/concepts/pipeline.md)")
    return bubble


def idle_fraction(grid) -> float:
    """The share of the stages' slots with no pass."""
    return sum(not cell for row in grid for cell in row) / sum(len(row) for row in grid)


def stretch(kind: str, stages: int, microbatches: int, costs: dict, lengths: tuple = EQUAL) -> float:
    """The step's time over a stage's busy time when the passes take ``costs`` (``{"F": ..., "B": ...,
    "W": ...}``, any unit) rather than a slot each: each stage runs its passes in the grid's order, a pass as
    soon as its stage is free and the passes it needs (:func:`needs`) have ended (a send waits for its sender
    only: the slots' collective-permutes pair a sender with its receiver, and a device with nothing to
    receive does not wait). Every stage runs the same passes, so its busy time is the same; 1 + the
    bubble's share of the busy time. The order is :func:`orders`' for ``lengths``."""
    return _stretch(kind, stages, microbatches, tuple(sorted(costs.items())), tuple(lengths))


@functools.lru_cache(maxsize=1024)
def _stretch(kind: str, stages: int, microbatches: int, cost_items: tuple, lengths: tuple) -> float:
    costs = dict(cost_items)
    n = chunks(kind, stages)
    stage_orders = [[op for _, op in sorted((t, op) for op, t in row.items())]
                    for row in time_orders(orders(kind, stages, microbatches, lengths), n)]
    end: dict = {}
    free = [0.0] * stages
    pos = [0] * stages
    left = sum(map(len, stage_orders))
    while left:
        for s, order in enumerate(stage_orders):
            while pos[s] < len(order) and all(x in end for x in needs(order[pos[s]], n)):
                op = order[pos[s]]
                end[op] = max([free[s]] + [end[x] for x in needs(op, n)]) + costs[op[0]]
                free[s], pos[s], left = end[op], pos[s] + 1, left - 1
    busy = sum(costs[op[0]] for op in stage_orders[0])
    return max(free) / busy


def in_flight(grid) -> list[int]:
    """Per stage, the most chunk inputs held at once: forwarded and not yet through W (which needs them)."""
    return peak_held(grid, until="W")


def _check(kind: str, stages: int, microbatches: int) -> None:
    if kind not in KINDS:
        raise ValueError(f"zero-bubble schedule {kind!r}: choose one of {', '.join(KINDS)}")
    if stages < 1 or microbatches < stages:
        raise ValueError(f"a zero-bubble schedule needs stages >= 1 and microbatches >= stages; got stages={stages}, "
                         f"microbatches={microbatches}")


# -- the executor -------------------------------------------------------------------------------------------

IDLE, FWD, BWD, WGT = 0, 1, 2, 3
# the sends of a slot: each pass's output goes to the device of the next chunk (F) or of the previous one (B),
# one stage up or down the ring: four collective-permutes, each with one sender and one receiver per device
SENDS = (("F", 1), ("F", -1), ("B", 1), ("B", -1))


def device_of(kind: str, stages: int, c: int) -> int:
    """The device holding chunk ``c``: ``c`` for ``zb_h1``; for ``zb_v`` down the devices and back up."""
    return c if kind == "zb_h1" or c < stages else 2 * stages - 1 - c


@functools.lru_cache(maxsize=256)
def tables(kind: str, stages: int, microbatches: int, forward_only: bool = False, lengths: tuple = EQUAL,
           x_until: str = "B") -> dict:
    """The executor's program: per slot t and device d (``[T, S]`` int arrays) the pass (``op``: IDLE, FWD,
    BWD, WGT), its microbatch, its chunk's index on the device (``loc``), whether it is the model's first or
    last chunk, the buffer slots it reads and writes (``x``: the chunk input kept from its arrival to its B;
    ``g``: the output cotangent from its arrival to the B; ``w``: B's taps kept for the W), the slot a
    chunk's output goes to on its own device (``self_x`` / ``self_g``, -1: none), and per send of
    :data:`SENDS` the pattern of senders (``pattern[k][t]``: an index into ``patterns[k]``, 0 none) and
    the slot each receiver files it in (``recv[k]``, -1: none); with the buffers' sizes. ``forward_only``:
    the forwards alone, each as soon as its input is there (an evaluation, or logits), its input kept until
    it runs. ``x_until="W"``: a chunk input's slot (and the residuals kept in it) held until its W, which reads
    its matmuls' inputs from them (:func:`inputs_from_residuals`)."""
    s_, m_ = stages, microbatches
    n = chunks(kind, s_)
    stage_orders = orders(kind, s_, m_, lengths)
    if forward_only:
        stage_orders = [[op for op in order if op[0] == "F"] for order in stage_orders]
    timed = time_orders(stage_orders, n)
    slots = max(t for row in timed for t in row.values()) + 1
    at = {op: t for row in timed for op, t in row.items()}
    dev = [device_of(kind, s_, c) for c in range(n)]
    # spans in half slots: a pass of slot t computes at 2t + 1, what it sends is filed at 2t + 2
    read = "F" if forward_only else x_until  # the pass that reads a chunk's input (or its residuals) last
    xs = {(m, c): ((2 * at[("F", m, c)] + 1) if c == 0 else (2 * at[("F", m, c - 1)] + 2), 2 * at[(read, m, c)] + 1)
          for m in range(m_) for c in range(n)}
    gs = {} if forward_only else {(m, c): (2 * at[("B", m, c + 1)] + 2, 2 * at[("B", m, c)] + 1)
                                  for m in range(m_) for c in range(n - 1)}
    ws = {} if forward_only else {(m, c): (2 * at[("B", m, c)] + 1, 2 * at[("W", m, c)] + 1)
                                  for m in range(m_) for c in range(n)}
    sizes = {}
    alloc = {}
    for name, spans in (("x", xs), ("g", gs), ("w", ws)):
        per, size = {}, 1
        for d in range(s_):
            got, k = allocate({key: v for key, v in spans.items() if dev[key[1]] == d})
            per.update(got)
            size = max(size, k)
        alloc[name], sizes[name] = per, size
    z = np.zeros((slots, s_), np.int32)
    out: dict = {k: z.copy() for k in ("op", "m", "loc", "first", "last", "x", "g", "w")}
    out["self_x"], out["self_g"] = z - 1, z - 1
    out["recv"] = [z - 1 for _ in SENDS]
    senders: list[list[set]] = [[set() for _ in range(slots)] for _ in SENDS]
    for (p, m, c), t in at.items():
        d = dev[c]
        out["op"][t, d] = {"F": FWD, "B": BWD, "W": WGT}[p]
        out["m"][t, d], out["loc"][t, d] = m, int(c >= s_ and kind == "zb_v")
        out["first"][t, d], out["last"][t, d] = c == 0, c == n - 1
        out["x"][t, d], out["w"][t, d] = alloc["x"][(m, c)], alloc["w"].get((m, c), 0)
        if p == "B" and c < n - 1:
            out["g"][t, d] = alloc["g"][(m, c)]
        to = {"F": c + 1, "B": c - 1, "W": -1}[p]
        if not 0 <= to < n:
            continue
        buf, slot = ("x", alloc["x"][(m, to)]) if p == "F" else ("g", alloc["g"][(m, to)])
        if dev[to] == d:
            out[f"self_{buf}"][t, d] = slot
            continue
        k = SENDS.index((p, dev[to] - d))  # a neighbour: chunks c and c + 1 sit on one device or on adjacent ones
        senders[k][t].add(d)
        out["recv"][k][t, dev[to]] = slot
    out["patterns"], out["pattern"] = [], []
    for k, (_, step) in enumerate(SENDS):
        pats: list[tuple] = [()]
        ids = np.zeros(slots, np.int32)
        for t in range(slots):
            pairs = tuple(sorted((d, d + step) for d in senders[k][t]))
            if pairs not in pats:
                pats.append(pairs)
            ids[t] = pats.index(pairs)
        out["patterns"].append(pats)
        out["pattern"].append(ids)
    out["sizes"], out["slots"] = sizes, slots
    return out


def zero_bubble_loss(kind: str, stage_fn, first_fn, last_fn, params, outer, tokens, targets, *, stages: int,
                     microbatches: int, primal, ys_weights=None, rows=None, lead_fn=None, stage_remat: bool = True):
    """Loss and gradients of a pipelined model under ``kind`` (``zb_h1``, or ``zb_v`` with the layers stored
    for it, two chunks per stage; arguments and results as :func:`~jaxpar.layers.pipeline.one_f_one_b`).

    Lock-step slots of one pass each (:func:`tables`, from the grid of :func:`schedule_zero_bubble`): in slot
    t each device runs its pass in a ``lax.switch`` (idle, F, B or W: the same on every device of a stage,
    so that the collectives of the layers inside, over the other axes, are reached alike), then the slot's
    outputs move: one ``lax.switch`` on t (the same on every device) per direction of :data:`SENDS` picks a
    ``ppermute`` with the slot's senders only, so that each chunk's output crosses ``pipe`` once (2M(S-1)
    transfers of a microbatch's activations in a step, the minimum). F runs a chunk on its input (the
    first chunk embeds its microbatch) and keeps the input; B runs the chunk's forward again from it (its
    remat policy) and its backward with the weight gradients of its matmuls deferred
    (:mod:`jaxpar.layers.wgrad`), keeping their inputs and output cotangents; the last chunk's B starts from
    the loss of that forward (the head on the last device only), the first chunk's B ends in the lead-in
    and keeps the input gradient for the embedding's weight gradient; W turns the kept pairs into the kernels'
    gradients, and the first chunk's W of every C-th microbatch takes the embedding's weight gradient of the
    last C (:func:`_embed_chunk`: C <= 2S where the grid allows, so that the kept input gradients do not grow
    with M; one reduction over the batch axes per C microbatches). With ``stage_remat=False``
    (``parallel.stage_remat``) F keeps the residuals of B's ``jax.vjp`` (and its output, for the last
    chunk's loss) in its input's slot and B runs from them, the chunk's forward not run again
    (:class:`~jaxpar.layers.residuals.Residuals`); where the matmuls' inputs are among those residuals (no
    remat), the residuals stay until W, which reads the inputs there (:func:`inputs_from_residuals`), and
    B's taps are the output cotangents alone. Held per device: the chunk inputs (and residuals) of its
    passes between F and B, or W (``tables(...)["sizes"]["x"]``, S on ZB-H1's first stage) and the B
    taps of its passes between B and W (``["w"]``: every deferred matmul's input and output cotangent,
    a microbatch's activations of ``model.remat=none`` for each; or the cotangents alone).
    """
    from jaxpar.layers import wgrad
    from jaxpar.layers.pipeline import ACT, Around, _put, _take

    s_, m_ = stages, microbatches
    lengths = lengths_for(stage_remat)  # the order of ZB-V's passes is built for their lengths
    c_ = _embed_chunk(kind, s_, m_, lengths)  # the first chunk's input gradients kept for the embedding's gradient
    o = Around(first_fn, last_fn, lead_fn, params, outer, tokens, targets, rows, microbatches=m_,
               ys_weights=ys_weights)
    leaves, x0 = o.leaves, o.x0
    n_local = chunks(kind, s_) // s_
    lg = leaves[0].shape[0] // (s_ * n_local)  # layers per chunk
    has_ys = ys_weights is not None

    def stage(group_leaves, x, r=0, rows=None):
        return stage_fn(jax.tree.unflatten(o.treedef, group_leaves), x, select=(r * lg, lg), rows=rows)

    ys_shape = o.stage_outputs(stage, n_local * lg)
    programs: dict[str, dict] = {}  # the executor's program, by the pass that last reads a chunk's input (or residuals)
    for until in ("B",) if stage_remat else ("B", "W"):
        tab_ = tables(kind, s_, m_, lengths=lengths, x_until=until)
        programs[until] = {k: jnp.asarray(tab_[k]) for k in ("op", "m", "loc", "first", "last", "x", "g", "w",
                                                             "self_x", "self_g")}
        programs[until]["pattern"] = [jnp.asarray(p) for p in tab_["pattern"]]
        programs[until]["recv"] = [jnp.asarray(r) for r in tab_["recv"]]

    def local(p_leaves, o_leaves, toks, tgts, rws):
        s = jax.lax.axis_index("pipe")
        outer_ = jax.tree.unflatten(o.outer_def, o_leaves)
        act = jax.ShapeDtypeStruct(x0.shape, x0.dtype)
        group = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in p_leaves]
        found = wgrad.sites(lambda p, x, r: stage(p, x, 0, r), group, act, _take(rws, 0))
        kernel_at = wgrad.kernel_leaves(jax.tree.unflatten(o.treedef, list(p_leaves)), found)

        def split_vjp(kn, x):  # B's vjp (its kernels' weight gradients deferred), its output y kept for the loss
            out, pullback = wgrad.vjp(lambda p, x: stage(p, x, kn[1], kn[2]), found, lg, kn[0], x)
            return out, (pullback, (out[0] if has_ys else out).astype(x0.dtype))

        known0 = (list(p_leaves), jnp.zeros((), jnp.int32), _take(rws, 0))
        res = None if stage_remat else Residuals(split_vjp, known0, act)
        # kept residuals, no remat: W reads its matmuls' inputs from them (kept until W), the taps hold only the
        # output cotangents (:func:`inputs_from_residuals`)
        xs_of = None if stage_remat else inputs_from_residuals(res, found, known0, act)
        until = "B" if xs_of is None else "W"
        tab, program = tables(kind, s_, m_, lengths=lengths, x_until=until), programs[until]
        taps0 = wgrad.zero_taps(found, lg)
        if xs_of is not None:
            taps0 = {p: dy for p, (_, dy) in taps0.items()}
        sz = tab["sizes"]
        c = dict(
            x=jnp.zeros((sz["x"], *x0.shape), x0.dtype), g=jnp.zeros((sz["g"], *x0.shape), x0.dtype),
            kept=None if stage_remat else [jnp.zeros((sz["x"], *a.shape), a.dtype) for a in res.kept],
            w=jax.tree.map(lambda a: jnp.zeros((sz["w"], *a.shape), a.dtype), taps0),
            dins=jnp.zeros((c_, *x0.shape), x0.dtype),
            dgroups=[jnp.zeros(a.shape, a.dtype) for a in p_leaves], douter=o.zero_grads(o_leaves),
            loss=jnp.zeros((), jnp.float32),
            ys=(jax.tree.map(lambda y: jnp.zeros((n_local, *y.shape), jnp.float32), ys_shape) if has_ys else None),
        )
        # The large buffers (B's taps, the residuals F keeps, the stage's weight gradients) are read in the
        # passes and written after the switch: each pass returns what it writes into them (a pass that writes
        # nothing, the slot as it was; no gradient: zeros). Written inside the branches, XLA:CPU copies such a
        # buffer at every slot (the branches that leave it as it is pass it through) and keeps the copy: 20 MiB
        # more on the MaxText layout's ZB-H1.
        held = {"w": "w", "kept": "x"} if not stage_remat else {"w": "w"}  # a buffer -> the slot it is written at

        def writes(c, a, **new):
            got = {k: new[k] if k in new else _take(c[k], a[at]) for k, at in held.items()}
            got["dgroups"] = new.get("dgroups") or [jnp.zeros(v.shape, v.dtype) for v in p_leaves]
            return got

        def idle(c, a):
            return c, jnp.zeros(x0.shape, x0.dtype), writes(c, a)

        def forward(c, a):
            c = dict(c)
            first = a["first"] > 0
            x = o.stage_input(outer_, toks, a["m"], first, first, _take(c["x"], a["x"]))
            c["x"] = _put(c["x"], x, a["x"], first)  # the first chunk's input, kept for its B
            new = {}
            if stage_remat:
                y = stage(p_leaves, x, a["loc"], _take(rws, a["m"]))
            else:  # its residuals kept for its B (in the input's slot), which does not run the chunk again
                y, new["kept"] = res.forward((list(p_leaves), a["loc"], _take(rws, a["m"])), x)
            y, ys = y if has_ys else (y, None)
            if has_ys:
                c["ys"] = jax.tree.map(lambda acc, v: acc.at[a["loc"]].add(v.astype(jnp.float32) / m_), c["ys"], ys)
            return c, y.astype(x0.dtype), writes(c, a, **new)

        def backward(c, a):
            c = dict(c)
            m, first, last = a["m"], a["first"] > 0, a["last"] > 0
            rows_m = _take(rws, m)
            if stage_remat:
                out, (pullback, y) = split_vjp((list(p_leaves), a["loc"], rows_m), _take(c["x"], a["x"]))
            else:
                out = (None, ys_shape)
                known, read = (list(p_leaves), a["loc"], rows_m), slot_reader(c["kept"], a["x"])
                y = res.apply_reading(known, read, lambda p: p[1])

                def pullback(ct):  # the layers' backward reading the slot's residuals a layer at a time
                    return res.apply_reading(known, read, lambda p, ct: p[0](ct), ct)
            g = o.loss_cotangent(c, o_leaves, y, tgts, m, last, last, _take(c["g"], a["g"]))
            dgroup, dx, taps = pullback(o.output_cotangent(out, g))
            dx = o.lead_backward(c, o_leaves, toks, m, first, dx)
            c["dins"] = _put(c["dins"], dx, m % c_, first)  # for the embedding's weight gradient (its W)
            if xs_of is not None:  # (the inputs: read again from the residuals at the W)
                taps = {p: dy for p, (_, dy) in taps.items()}
            return c, dx, writes(c, a, w=taps, dgroups=[d.astype(v.dtype) for v, d in zip(p_leaves, dgroup)])

        def weights(c, a):
            c = dict(c)
            taps = _take(c["w"], a["w"])
            if xs_of is not None:
                xs = xs_of((list(p_leaves), a["loc"], _take(rws, a["m"])), _take(c["kept"], a["x"]))
                taps = {p: (xs[p], dy) for p, dy in taps.items()}
            grads = wgrad.weight_grads(found, taps)
            dgroups = [jnp.zeros(v.shape, v.dtype) for v in p_leaves]
            for path, dk in grads.items():
                i = kernel_at[path]
                dgroups[i] = jax.lax.dynamic_update_slice_in_dim(dgroups[i], dk.astype(dgroups[i].dtype),
                                                                 a["loc"] * lg, 0)
            # the first chunk's W of every C-th microbatch: the embedding's weight gradient of the last C (their
            # Bs ran in order, each W right after its B on the first stage; one reduction over the batch axes)
            m = a["m"]
            c["douter"] = jax.lax.cond((a["first"] > 0) & (m % c_ == c_ - 1),
                                       lambda d: o.embed_grads(d, o_leaves, toks, c["dins"], m + 1 - c_, s == 0),
                                       lambda d: d, c["douter"])
            return c, jnp.zeros(x0.shape, x0.dtype), writes(c, a, dgroups=dgroups)

        big = (*held, "dgroups")

        def slot(c, row):
            a = {k: v[s] for k, v in row.items() if k not in ("pattern", "recv", "t")}

            def run(pass_):  # the pass with the large buffers read-only (operands of the switch, not results)
                def branch(small, a):
                    c_, out, new = pass_({**small, **{k: c[k] for k in big}}, a)
                    return {k: v for k, v in c_.items() if k not in big}, out, new
                return branch

            small, out, new = jax.lax.switch(a["op"], [run(f) for f in (idle, forward, backward, weights)],
                                             {k: v for k, v in c.items() if k not in big}, a)
            put = {k: jax.tree.map(functools.partial(_write, slot=a[at]), c[k], new[k]) for k, at in held.items()}
            c = {**small, **put, "dgroups": [acc + d for acc, d in zip(c["dgroups"], new["dgroups"])]}
            out = constrain(out, ACT)
            _deliver(c, out, a, row, tab, s)
            return c, None

        c, _ = jax.lax.scan(slot, c, program)
        return o.finish(c, c["douter"])

    return o.differentiate(local, primal, ys_shape)


def inputs_from_residuals(res: Residuals, found: dict, known, act):
    """``(known, kept) -> {path: x}``: the deferred matmuls' inputs read from a chunk's kept residuals (no
    matmul run: :func:`jaxpar.layers.wgrad.inputs_from`), or None where a remat policy recomputes them."""
    from jaxpar.layers import wgrad

    out = jax.eval_shape(lambda k, x: res.forward(k, x)[0], known, act)
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (known, res.kept, out))
    fn = wgrad.inputs_from(lambda k, kept, ct: res.pullback(k, kept)[0](ct)[-1], found, *shapes)
    if fn is None:
        return None
    # (the output cotangent the cut program may still carry: zeros, nothing the inputs are made of)
    return lambda k, kept: fn(k, kept, jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), out))


def _write(buf, value, slot):
    return jax.lax.dynamic_update_index_in_dim(buf, value, slot, 0)


def _deliver(c: dict, out, a: dict, row: dict, tab: dict, s) -> None:
    """The end of a slot: the pass's output ``out`` filed on its own device (the V's turn) or sent by the slot's
    pattern of senders (one ``lax.switch`` on the slot per direction, the same on every device) into the
    receivers' buffers (``c["x"]`` chunk inputs, ``c["g"]`` output cotangents)."""
    from jaxpar.layers.pipeline import ACT, _put

    for buf in ("x", "g"):
        if buf in c:
            c[buf] = _put(c[buf], out, jnp.maximum(a[f"self_{buf}"], 0), a[f"self_{buf}"] >= 0)
    for k, (p, _) in enumerate(SENDS):
        pats = tab["patterns"][k]
        if len(pats) == 1:
            continue
        branches = [lambda v: jnp.zeros_like(v)] + [
            (lambda v, pairs=pairs: jax.lax.ppermute(v, "pipe", list(pairs))) for pairs in pats[1:]]
        got = constrain(jax.lax.switch(row["pattern"][k], branches, out), ACT)
        slot_k = row["recv"][k][s]
        buf = "x" if p == "F" else "g"
        c[buf] = _put(c[buf], got, jnp.maximum(slot_k, 0), slot_k >= 0)
    for buf in ("x", "g"):
        if buf in c:
            c[buf] = constrain(c[buf], (None, *ACT))


@functools.lru_cache(maxsize=256)
def _embed_chunk(kind: str, stages: int, microbatches: int, lengths: tuple = EQUAL) -> int:
    """Microbatches whose first-chunk input gradients the first device keeps before its W takes the embedding's
    weight gradient from them: the largest divisor C of M up to 2S (:func:`~jaxpar.layers.pipeline.embed_chunk`)
    such that the W of each C-th microbatch comes before the next microbatch's B overwrites a kept one; M (one
    gradient, at the last W) where none does."""
    from jaxpar.layers.pipeline import embed_chunk

    m_ = microbatches
    at = {op: t for row in time_orders(orders(kind, stages, m_, lengths), chunks(kind, stages))
          for op, t in row.items()}
    for c in sorted((c for c in range(1, embed_chunk(stages, m_) + 1) if m_ % c == 0), reverse=True):
        if all(at[("W", m, 0)] < at[("B", m + 1, 0)] for m in range(c - 1, m_ - 1, c)):
            return c
    return m_


def zero_bubble_forward(kind: str, stage_fn, first_fn, last_fn, params, outer, tokens, targets, *, stages: int,
                        microbatches: int, ys_weights=None, rows=None, lead_fn=None):
    """The forward of a pipelined model stored for ``kind`` without differentiation: ``(loss, ys)`` as
    :func:`~jaxpar.layers.pipeline.pipeline_loss` (an evaluation; the primal of :func:`zero_bubble_loss`), or
    with ``last_fn`` None the stack's output ``[B, ...]`` (and ``ys``; logits). ZB-V's chunks go down the
    stages and back up, which GPipe's ring cannot run: the forwards of the zero-bubble grid alone
    (:func:`tables` ``forward_only``), each as soon as its input is there, in the executor's slots; the last
    chunk's output goes to the loss (the head on its device only) or into the output buffer."""
    from jax.sharding import PartitionSpec as P

    from jaxpar.layers.onstage import only_where
    from jaxpar.layers.pipeline import ACT, _batch_of, _put, _rows_in, _rules, _split_rows, _take, _whole
    from jaxpar.partitioning import use_rules

    s_, m_ = stages, microbatches
    tab = tables(kind, s_, m_, forward_only=True)
    rules = _rules()
    leaves, treedef = jax.tree.flatten(params)
    outer_leaves, outer_def = jax.tree.flatten(outer)
    n_local = chunks(kind, s_) // s_
    lg = leaves[0].shape[0] // (s_ * n_local)
    b = _rows_in(tokens)
    mb = b // m_
    x0 = jax.eval_shape(first_fn, outer, jax.tree.map(lambda a: a[:mb], tokens))
    has_ys = ys_weights is not None

    def stage(group_leaves, x, r=0, rows=None):
        return stage_fn(jax.tree.unflatten(treedef, group_leaves), x, select=(r * lg, lg), rows=rows)

    rows_mb = _split_rows(rows, m_)
    ys_shape = None
    if has_ys:
        group = [jax.ShapeDtypeStruct((n_local * lg, *a.shape[1:]), a.dtype) for a in leaves]
        ys_shape = jax.eval_shape(lambda g, x, r: stage(g, x, 0, r), group, x0, _take(rows_mb, 0))[1]
    program: dict = {k: jnp.asarray(tab[k]) for k in ("op", "m", "loc", "first", "last", "x", "self_x")}
    program["pattern"] = [jnp.asarray(p) for p in tab["pattern"]]
    program["recv"] = [jnp.asarray(r) for r in tab["recv"]]

    def local(p_leaves, o_leaves, toks, tgts, rws):
        s = jax.lax.axis_index("pipe")
        outer_ = jax.tree.unflatten(outer_def, o_leaves)
        c = dict(x=jnp.zeros((tab["sizes"]["x"], *x0.shape), x0.dtype), loss=jnp.zeros((), jnp.float32),
                 out=jnp.zeros((m_, *x0.shape), x0.dtype) if last_fn is None else None,
                 ys=(jax.tree.map(lambda y: jnp.zeros((n_local, *y.shape), jnp.float32), ys_shape) if has_ys
                     else None))
        zero = jnp.zeros(x0.shape, x0.dtype)

        def idle(c, a):
            return c, zero

        def forward(c, a):
            c = dict(c)
            m, first, last = a["m"], a["first"] > 0, a["last"] > 0
            x = _take(c["x"], a["x"])
            with only_where(first):  # the embedding's gather on the first chunk's device only
                x = jnp.where(first, first_fn(outer_, _take(toks, m)).astype(x0.dtype), x)
            if lead_fn is not None:
                x = jnp.where(first, lead_fn(outer_, x, _take(toks, m)).astype(x0.dtype), x)
            y = stage(p_leaves, constrain(x, ACT), a["loc"], _take(rws, m))
            y, ys = y if has_ys else (y, None)
            y = constrain(y.astype(x0.dtype), ACT)
            if has_ys:
                c["ys"] = jax.tree.map(lambda acc, v: acc.at[a["loc"]].add(v.astype(jnp.float32) / m_), c["ys"], ys)
            if last_fn is None:
                c["out"] = _put(c["out"], y, m, last)
            else:
                with only_where(last):  # the head's matmuls on the last chunk's device only
                    loss = last_fn(outer_, y, _take(tgts, m)).astype(jnp.float32)
                c["loss"] = c["loss"] + jnp.where(last, loss / m_, 0.0)
            return c, y

        def slot(c, row):
            a = {k: v[s] for k, v in row.items() if k not in ("pattern", "recv")}
            c, y = jax.lax.switch(jnp.minimum(a["op"], FWD), [idle, forward], c, a)
            _deliver(c, constrain(y, ACT), a, row, tab, s)
            return c, None

        c, _ = jax.lax.scan(slot, c, program)
        ys = None if not has_ys else jax.tree.map(lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]), c["ys"])
        if last_fn is None:  # the last chunk's device holds the outputs (zeros elsewhere): summed over pipe once
            return jax.lax.psum(_batch_of(c["out"], b, ACT), "pipe"), ys
        return jax.lax.psum(c["loss"], "pipe"), ys

    def body(p_leaves, o_leaves, toks, tgts, rws):
        with use_rules(rules.manual_pipe()):
            return local(p_leaves, o_leaves, toks, tgts, rws)

    split = [_split_rows(x, m_) for x in (tokens, targets, rows)]
    ys_spec = None if ys_shape is None else jax.tree.map(lambda _: P("pipe"), ys_shape)
    fn = jax.shard_map(body, mesh=rules.mesh,
                       in_specs=([P("pipe")] * len(leaves), [P()] * len(outer_leaves), *map(_whole, split)),
                       out_specs=(P(), ys_spec), axis_names={"pipe"}, check_vma=False)
    out, ys = jax.jit(fn)(leaves, outer_leaves, *split)
    if last_fn is None:
        return constrain(out, ACT), ys
    if has_ys:
        out = out + sum(w * jnp.sum(ys[k]) for k, w in ys_weights.items())
    return out, ys
