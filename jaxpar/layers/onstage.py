"""Work done on some devices only (a pipeline's embedding on its first stage, its head on its last), with
every collective outside the conditional.

A pipeline sets a per-device predicate with :func:`only_where` around its embedding and its head; the
layers that do their heavy work there (:class:`~jaxpar.layers.embedding.VocabParallelEmbed`'s gather,
:func:`~jaxpar.layers.loss.head_cross_entropy`'s matmuls) read it with :func:`predicate` and run that work
under :func:`when`: a ``lax.cond`` whose branches hold only local computation, inside their ``shard_map``
manual over every mesh axis (so that XLA's partitioner adds no collective to a branch). Their collectives
(the sums over ``tensor`` of per-token statistics, of the lookup and of the input gradient, the loss's sum
over the token axes, the weight gradient's reduction over the batch axes) run on every device, on zeros
where the predicate is false: every device issues the same collectives in the same order, and a stage
that does not hold the work runs none of its matmuls.

Why no collective in a branch, even one whose group takes the same branch on all its devices (a group
over ``tensor`` or ``data`` lies inside one stage): XLA:CPU's runtime orders collectives by when they
*start* only (the thunk executor's scheduling edges). A ``conditional`` (or ``while``) whose branch has
not finished (its matmuls still running on the thread pool) lets the collectives after it in the program
start, and the ones inside the branch run later; two devices of a group may then issue the two in
different orders and each wait in a different rendezvous (measured on the quick start's GPipe command with
the embedding and head under a ``lax.cond``: the embedding's weight-gradient all-reduce over ``data``
inside the branch and the gradient norm's all-reduce after it issued in opposite orders by devices 1
and 5, every thread of the pool blocked, the rendezvous aborting after 40 s). Collectives in a branch
also share their channel ids with others (XLA numbers them per computation), and XLA:CPU keys a
rendezvous by that id: issued out of order, two different collectives of one group can pair up.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

_PRED: contextvars.ContextVar = contextvars.ContextVar("jaxpar_only_where", default=None)

# primitives that communicate, or whose transpose does (pvary / pcast to varying: a psum)
COMMUNICATING = frozenset({"psum", "pmax", "pmin", "ppermute", "pbroadcast", "all_gather", "all_to_all",
                           "psum_scatter", "reduce_scatter", "ragged_all_to_all", "psum_invariant",
                           "all_gather_invariant", "pvary", "pcast"})


@contextlib.contextmanager
def only_where(pred):
    """Within it, layers that honour it (module docstring) do their heavy work only where ``pred`` (a
    traced boolean scalar, e.g. the device's stage is the last) holds, and compute zeros elsewhere."""
    token = _PRED.set(pred)
    try:
        yield
    finally:
        _PRED.reset(token)


def predicate():
    """The predicate of the innermost :func:`only_where` (None outside any)."""
    return _PRED.get()


def when(pred, fn, skip, *operands):
    """``fn(*operands)`` where ``pred`` holds, else ``skip(*operands)`` (the same types), by a ``lax.cond``;
    ``fn(*operands)`` itself when ``pred`` is None. Neither may hold a collective (module docstring), and
    the cond must run where every mesh axis of size > 1 is manual: both are checked while tracing."""
    if pred is None:
        return fn(*operands)
    mesh = jax.sharding.get_abstract_mesh()
    auto = [a for a in mesh.axis_names if mesh.shape[a] > 1 and a not in mesh.manual_axes]
    if auto:
        raise RuntimeError(f"onstage.when runs inside a shard_map manual over every mesh axis; {auto} are not "
                           "(XLA's partitioner could put their collectives inside the branch)")
    for branch in (fn, skip):
        found = communicating(jax.make_jaxpr(branch)(*operands).jaxpr)
        if found:
            raise ValueError(f"a branch of onstage.when holds collectives {sorted(found)}: run them outside it, "
                             "on every device (see jaxpar.layers.onstage)")
    return jax.lax.cond(pred, fn, skip, *operands)


def varying(x) -> frozenset:
    """The manual mesh axes over which ``x`` varies (inside a ``shard_map`` checking it)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)  # (the name on some JAX versions; 0.10.2 keeps it in `mat`)
    return frozenset(vma if vma is not None else getattr(getattr(aval, "mat", None), "varying", ()))


def communicating(jaxpr, tainted_in=None) -> set[str]:
    """The names of the :data:`COMMUNICATING` primitives in ``jaxpr`` and its sub-jaxprs, less casts to
    varying of integers or of values that depend on none of its inputs (such a cast has no transpose);
    ``tainted_in``: which inputs count (default all)."""
    found: set[str] = set()
    flags = [True] * len(jaxpr.invars) if tainted_in is None else list(tainted_in)
    tainted = {id(v) for v, f in zip(jaxpr.invars, flags) if f} | {id(v) for v in jaxpr.constvars}
    for e in jaxpr.eqns:
        ins = [not hasattr(v, "val") and id(v) in tainted for v in e.invars]
        if any(ins):
            tainted |= {id(v) for v in e.outvars}
        cast = e.primitive.name in ("pvary", "pcast")
        if e.primitive.name in COMMUNICATING and (not cast or any(f and _inexact(v) for f, v in zip(ins, e.invars))):
            found.add(e.primitive.name)
        for v in e.params.values():
            for sub in _subjaxprs(v):  # a call's inputs are the equation's; other sub-jaxprs: all count
                found |= communicating(sub, ins if len(sub.invars) == len(ins) and "jaxpr" in e.params else None)
    return found


def _inexact(v) -> bool:
    dtype = getattr(getattr(v, "aval", None), "dtype", None)
    return dtype is not None and jax.numpy.issubdtype(dtype, jax.numpy.inexact)


def _subjaxprs(v):
    if hasattr(v, "eqns"):
        yield v
    elif hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):  # a ClosedJaxpr
        yield v.jaxpr
    elif isinstance(v, (tuple, list)):
        for u in v:
            yield from _subjaxprs(u)
