"""Reading the compiled program: collectives (kind, mesh axes, count, bytes), memory and flops.

``flops`` is XLA's ``cost_analysis()`` (on XLA:CPU a loop body counts once, whatever its trip
count); ``matmul_flops`` counts every executed ``dot`` with the loops' trip counts (per device).

The optimised HLO text lists each collective once per computation; a collective inside a ``while``
body (a ``lax.scan``) runs once per iteration. :func:`collectives` walks the call graph from the
entry computation and multiplies by the loops' known trip counts, so ``count`` and ``bytes`` are
per executed step; ``static_count`` is the number of HLO instructions.

Bytes: ``bytes`` is the size of the collective's result on one device (for an all-reduce this is
the reduced array; for an all-gather the gathered array; for a reduce-scatter the scattered shard),
``operand_bytes`` the size of its inputs. ``wire_bytes`` is what one device sends over the links
with the bandwidth-optimal algorithms (ring or tree), for a group of ``g`` devices and a result of
``S`` bytes (:func:`wire_bytes`): all-reduce ``2 (g-1)/g S``, all-gather ``(g-1)/g S``,
reduce-scatter ``(g-1) S``, all-to-all ``(g-1)/g S``, collective-permute ``S``. It is the number
the analytic communication model (:mod:`jaxpar.comm`) predicts, and the one that makes a
reduce-scatter + all-gather cost what one all-reduce costs. Each collective is labelled with the
mesh axes its replica groups span (``data``, ``tensor``, ``data+expert`` ...), read from any of the
replica-group notations XLA prints.
"""

from __future__ import annotations

import itertools
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
               "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 1, "u4": 1}

_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


def type_bytes(t: str) -> int:
    """Bytes of an HLO type string (array or tuple)."""
    total = 0
    for dt, dims in _ARRAY.findall(t):
        if dt not in DTYPE_BYTES:
            continue
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * DTYPE_BYTES[dt]
    return total


def _split_type(rest: str) -> tuple[str, str]:
    """``'(f32[2], f32[3]) all-reduce(...)'`` -> (type, remainder)."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[: i + 1], rest[i + 1:].lstrip()
    t, _, r = rest.partition(" ")
    return t, r


@dataclass
class Instr:
    name: str
    type: str
    opcode: str
    text: str
    operands: list = field(default_factory=list)


def parse_computations(hlo: str) -> tuple[dict[str, list[Instr]], str | None]:
    """The computations of an HLO module by name, and the entry's name (None: no computation)."""
    comps: dict[str, list[Instr]] = {}
    entry, cur = None, None
    for line in hlo.splitlines():
        h = _HEADER.match(line)
        if h and not line.startswith(" "):
            cur = h.group(2)
            comps[cur] = []
            if h.group(1):
                entry = cur
            continue
        if cur is None:
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        t, rest = _split_type(m.group(2))
        op = re.match(r"([a-z][\w\-]*)\((.*)", rest)
        if not op:
            continue
        args = op.group(2)
        depth, end = 1, len(args)
        for i, ch in enumerate(args):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                end = i
                break
        operands = re.findall(r"%([\w.\-]+)", args[:end])
        comps[cur].append(Instr(m.group(1), t, op.group(1), rest, operands))
    if entry is None and comps:
        entry = list(comps)[-1]
    return comps, entry


def _multiplicity(comps: dict[str, list[Instr]], entry: str | None) -> tuple[dict[str, int], bool]:
    mult: dict[str, int] = defaultdict(int)
    unknown = False

    def visit(c: str, m: int):
        nonlocal unknown
        mult[c] += m
        for ins in comps.get(c, []):
            if ins.opcode == "while":
                body = re.search(r"body=%?([\w.\-]+)", ins.text)
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.text)
                if not trip:
                    unknown = True
                if body:
                    visit(body.group(1), m * (int(trip.group(1)) if trip else 1))
                continue
            for key in ("to_apply", "calls", "true_computation", "false_computation"):
                for callee in re.findall(key + r"=%?([\w.\-]+)", ins.text):
                    if callee in comps and ins.opcode not in ("all-reduce", "reduce-scatter", "reduce",
                                                              "all-reduce-start", "scatter", "sort", "map",
                                                              "reduce-window", "select-and-scatter"):
                        visit(callee, m)
            br = re.search(r"branch_computations=\{([^}]*)\}", ins.text)
            if br:
                for callee in re.findall(r"%?([\w.\-]+)", br.group(1)):
                    visit(callee, m)

    if entry is not None:
        visit(entry, 1)
    return mult, unknown


# ---------------------------------------------------------------------------------------------
# Replica groups -> mesh axes


def _iota(spec: str, n: int | None = None) -> np.ndarray:
    """``'[2,4]T(1,0)'`` -> device ids laid out by the iota-with-transpose notation."""
    m = re.match(r"\[([0-9,]*)\](?:T\(([0-9,]*)\))?", spec.strip())
    if m is None:
        raise ValueError(f"not an iota device list (like [2,4]T(1,0)): {spec!r}")
    dims = [int(d) for d in m.group(1).split(",") if d]
    arr = np.arange(int(np.prod(dims))).reshape(dims)
    if m.group(2):
        arr = arr.transpose([int(p) for p in m.group(2).split(",")])
    return arr


def replica_groups(text: str, n_devices: int) -> list[list[int]] | None:
    """The groups of a collective, from whichever notation XLA printed; None if none found."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(([^)]*\)?)\))?\s*\{([^}]*)\}", text)
    if m:
        axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        names = [a for a, _ in axes]
        shape = [int(s) for _, s in axes]
        ids = _iota(m.group(2)).reshape(shape) if m.group(2) else np.arange(int(np.prod(shape))).reshape(shape)
        grouped = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(3))]
        rest = [i for i in range(len(shape)) if i not in grouped]
        arr = ids.transpose(rest + grouped).reshape(-1, int(np.prod([shape[i] for i in grouped])) if grouped else 1)
        return arr.tolist()
    m = re.search(r"replica_groups=(\[[0-9,]*\])<=(\[[0-9,]*\](?:T\([0-9,]*\))?)", text)
    if m:
        gshape = [int(d) for d in m.group(1)[1:-1].split(",")]
        return _iota(m.group(2)).reshape(gshape).tolist()
    m = re.search(r"replica_groups=\{(\{[0-9,{} ]*\})?\}", text)
    if m:
        groups = [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([0-9, ]*)\}", m.group(0))]
        groups = [g for g in groups if g]
        return groups or [list(range(n_devices))]
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", text)
    if m:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(0))]
    return None


def axes_of_groups(groups: list[list[int]] | None, mesh_shape: dict[str, int]) -> str:
    """Mesh axes along which the devices of each group differ (``'data+tensor'``), ``'?'`` if unknown."""
    if groups is None:
        return "?"
    names = list(mesh_shape)
    shape = tuple(mesh_shape.values())
    n = int(np.prod(shape))
    varying = set()
    for g in groups:
        if any(d >= n for d in g):
            return "?"
        coords = [np.unravel_index(d, shape) for d in g]
        for a, b in itertools.combinations(coords, 2) if len(coords) > 1 else []:
            varying |= {names[i] for i in range(len(shape)) if a[i] != b[i]}
    return "+".join(a for a in names if a in varying) or "none"


def wire_bytes(kind: str, result_bytes: float, group: int) -> float:
    """Bytes one device sends for a collective of ``kind`` over ``group`` devices whose result on a
    device is ``result_bytes`` (the module docstring gives the formulas)."""
    if kind == "collective-permute":
        return result_bytes
    if group <= 1:
        return 0.0
    factor = {"all-reduce": 2 * (group - 1) / group, "all-gather": (group - 1) / group,
              "reduce-scatter": group - 1, "all-to-all": (group - 1) / group}[kind]
    return factor * result_bytes


def collectives(hlo: str, mesh_shape: dict[str, int] | None = None, min_bytes: int = 0) -> dict:
    """``{kind: {count, static_count, bytes, wire_bytes, operand_bytes, max_bytes, by_axes: {axes:
    {count, bytes, wire_bytes}}}}`` (``max_bytes``: the largest single instance); instances whose
    result is smaller than ``min_bytes`` (scalars, statistics) are left out."""
    comps, entry = parse_computations(hlo)
    mult, unknown = _multiplicity(comps, entry)
    n = int(np.prod(list(mesh_shape.values()))) if mesh_shape else 0
    out: dict[str, Any] = {k: {"count": 0, "static_count": 0, "bytes": 0, "wire_bytes": 0.0, "operand_bytes": 0,
                               "max_bytes": 0, "by_axes": {}} for k in KINDS}
    for cname, instrs in comps.items():
        m = mult.get(cname, 0)
        if m == 0:
            continue
        types = {i.name: i.type for i in instrs}
        done_type = {i.operands[0]: i.type for i in instrs if i.opcode.endswith("-done") and i.operands}
        for ins in instrs:
            kind = ins.opcode[:-6] if ins.opcode.endswith("-start") else ins.opcode
            if kind not in KINDS:
                continue
            res_type = done_type.get(ins.name, ins.type) if ins.opcode.endswith("-start") else ins.type
            rb = type_bytes(res_type)
            if rb < min_bytes:
                continue
            ob = sum(type_bytes(types.get(o, "")) for o in ins.operands)
            groups = replica_groups(ins.text, n)
            wb = wire_bytes(kind, rb, len(groups[0]) if groups else n) * m
            e = out[kind]
            e["count"] += m
            e["static_count"] += 1
            e["bytes"] += rb * m
            e["wire_bytes"] += wb
            e["operand_bytes"] += ob * m
            e["max_bytes"] = max(e["max_bytes"], rb)
            label = axes_of_groups(groups, mesh_shape) if mesh_shape else "?"
            a = e["by_axes"].setdefault(label, {"count": 0, "bytes": 0, "wire_bytes": 0.0})
            a["count"] += m
            a["bytes"] += rb * m
            a["wire_bytes"] += wb
    out["unknown_trip_count"] = unknown
    return out


def _callees(ins: Instr, branches: bool = True) -> list[str]:
    out = [c for key in ("to_apply", "calls", "body", "condition")
           for c in re.findall(key + r"=%?([\w.\-]+)", ins.text)]
    br = re.search(r"branch_computations=\{([^}]*)\}", ins.text)
    if branches:
        out += re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", ins.text)
        out += re.findall(r"%?([\w.\-]+)", br.group(1)) if br else []
    return out


def _reach(comps: dict[str, list[Instr]], start: str, branches: bool = True) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        c = todo.pop()
        if c in seen or c not in comps:
            continue
        seen.add(c)
        todo += [k for ins in comps[c] for k in _callees(ins, branches)]
    return seen


def conditional_branches(hlo: str) -> tuple[set[str], list[tuple[str, list[set[str]]]]]:
    """Where each computation runs: the computations the entry reaches without entering a ``conditional``'s
    branch (they run on every device, loops included), and for each conditional its name and, per branch,
    the computations that branch reaches without entering a nested conditional's branch (they run only on
    the devices that take it, and the nested conditional decides the rest)."""
    comps, entry = parse_computations(hlo)
    always = _reach(comps, entry, branches=False) if entry else set()
    conds = []
    for instrs in comps.values():
        for ins in instrs:
            if ins.opcode == "conditional":
                br = re.search(r"branch_computations=\{([^}]*)\}", ins.text)
                names = (re.findall(r"%?([\w.\-]+)", br.group(1)) if br else
                         re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", ins.text))
                conds.append((ins.name, [_reach(comps, b, branches=False) for b in names]))
    return always, conds


def _dims(t: str) -> list[int]:
    m = _ARRAY.search(t)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def matmul_flops(hlo: str) -> float:
    """Flops of the dot / convolution-free matmuls actually executed: 2 x output elements x contracted
    size for every ``dot``, times the trip counts of the loops around it (XLA:CPU's cost analysis
    counts a loop body once, so it undercounts scanned layers and pipelines). A dot in a conditional's
    branch counts as if the branch ran: the busiest device's count (a pipeline's head matmuls run on its
    last stage only, :func:`conditional_branches`)."""
    comps, entry = parse_computations(hlo)
    mult, _ = _multiplicity(comps, entry)
    total = 0.0
    for cname, instrs in comps.items():
        m = mult.get(cname, 0)
        if m == 0:
            continue
        types = {i.name: i.type for i in instrs}
        for ins in instrs:
            if ins.opcode != "dot" or not ins.operands:
                continue
            contract = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", ins.text)
            lhs = _dims(types.get(ins.operands[0], ""))
            k = 1
            for d in (contract.group(1).split(",") if contract else []):
                if d and int(d) < len(lhs):
                    k *= lhs[int(d)]
            out = 1
            for d in _dims(ins.type):
                out *= d
            total += 2.0 * out * k * m
    return total


def compile_report(compiled, mesh_shape: dict[str, int] | None = None) -> dict:
    """Per-device memory, flops and collectives of a compiled (``jit(...).lower(...).compile()``) program."""
    rep: dict = {}
    mem = compiled.memory_analysis()
    if mem is not None:
        rep["memory"] = {k: int(getattr(mem, f"{k}_in_bytes")) for k in (
            "argument_size", "output_size", "temp_size", "alias_size", "generated_code_size")
            if hasattr(mem, f"{k}_in_bytes")}
        peak = getattr(mem, "peak_memory_in_bytes", None)
        if peak is not None:
            rep["memory"]["peak"] = int(peak)
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    cost = cost or {}
    rep["flops"] = float(cost.get("flops", 0.0))
    rep["bytes_accessed"] = float(cost.get("bytes accessed", 0.0))
    text = compiled.as_text()
    rep["matmul_flops"] = matmul_flops(text)
    rep["hardware_counts"] = ("flops, bytes_accessed and matmul_flops are counted from the compiled program: what "
                              "the device executes (rematerialisation and pipeline bubbles included), per device. "
                              "XLA:CPU's flops count a loop body once; matmul_flops counts HLO dots, so it misses "
                              "the cuBLAS / cuDNN custom calls of a GPU program. MFU uses model_flops instead.")
    rep["collectives"] = collectives(text, mesh_shape)
    return rep
