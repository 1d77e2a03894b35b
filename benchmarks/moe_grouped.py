"""The sorted MoE dispatch's grouped matmul, forward and backward, by implementation and tiling.

    python benchmarks/moe_grouped.py                                   # Qwen3-30B-A3B's experts, 8192 tokens
    python benchmarks/moe_grouped.py --tokens 2048 --variants tiles,ragged_dot
    python benchmarks/moe_grouped.py --experts 16 --d-model 7168 --d-ff 2048 --variants tiles:256:1,tiles:256:8

Each variant runs :func:`jaxpar.layers.moe_dispatch.sorted_experts` (SwiGLU experts, bfloat16 on an
accelerator, float32 on a CPU) on ``--tokens`` tokens routed uniformly at random to ``--top-k`` of
``--experts`` experts, and the gradient of a sum of squares of its output with respect to the tokens
and both weights, compiled once. A variant is ``ragged_dot`` (``jax.lax.ragged_dot``), ``tiles``
(the platform's rule: :func:`~jaxpar.layers.moe_dispatch.tile_rows` and
:func:`~jaxpar.layers.moe_dispatch.tiles_per_step`), or ``tiles:M:P`` (tiles of M rows, P per loop
step; either may be 0 for the rule's). Printed per variant: compile seconds, the median of ``--steps``
timed calls, the routed work's TFLOP/s (``6 x tokens x top_k x d_model x 3 d_ff``: forward and backward
of the three expert matmuls), the compiled program's temporaries, and the largest difference from the
first variant's output and gradients (relative to their largest entry). The tile constants of
``moe_dispatch`` were measured with it on an H200 (``docs/concepts/expert.md``).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import write_jsonl  # noqa: E402

from jaxpar.cli import ArgumentParser  # noqa: E402


def parse_variant(v: str) -> tuple[str, int, int]:
    """``ragged_dot`` | ``tiles`` | ``tiles:M:P`` -> (impl, tile rows or 0, tiles per step or 0)."""
    impl, *rest = v.split(":")
    if impl not in ("tiles", "ragged_dot") or len(rest) > 2 or (rest and impl != "tiles"):
        raise ValueError(f"--variants: {v!r} is not ragged_dot, tiles or tiles:M:P")
    try:
        m, per = (int(x or 0) for x in (rest + ["0", "0"])[:2])
    except ValueError:
        raise ValueError(f"--variants: {v!r}: M and P are integers (0: the platform's rule)") from None
    if m < 0 or per < 0:
        raise ValueError(f"--variants: {v!r}: M and P must be >= 0")
    return impl, m, per


def run_variant(variant: str, args, inputs, platform: str) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxpar.layers import moe_dispatch as md

    impl, m, per = parse_variant(variant)
    x, w_in, w_out, experts, gates = inputs
    rules = md.tile_rows, md.tiles_per_step
    md.tile_rows = (lambda a, e, p="cpu": m) if m else rules[0]
    md.tiles_per_step = (lambda mm, p, w: per) if per else rules[1]
    try:
        def loss(x, w_in, w_out):
            y = md.sorted_experts(x, experts, gates, w_in, w_out, "swiglu", impl, platform=platform)
            return jnp.sum(y.astype(jnp.float32) ** 2), y

        f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
        t0 = time.perf_counter()
        compiled = f.lower(x, w_in, w_out).compile()
        compile_s = time.perf_counter() - t0
        out = jax.block_until_ready(compiled(x, w_in, w_out))
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(x, w_in, w_out))
            times.append(time.perf_counter() - t0)
    finally:
        md.tile_rows, md.tiles_per_step = rules
    step = statistics.median(times)
    flops = 6 * args.tokens * args.top_k * args.d_model * 3 * args.d_ff
    mem = compiled.memory_analysis()
    return {"variant": variant, "compile_s": compile_s, "step_s": step, "tflops": flops / step / 1e12,
            "temp_bytes": int(getattr(mem, "temp_size_in_bytes", 0) or 0), "out": out}


def main(argv=None) -> int:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192, help="tokens routed (assignments: tokens x top_k)")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--d-ff", type=int, default=768, help="an expert's width")
    ap.add_argument("--variants", default="tiles,ragged_dot", help="comma-separated: ragged_dot, tiles, tiles:M:P")
    ap.add_argument("--steps", type=int, default=8, help="timed calls per variant (median reported)")
    ap.add_argument("--json", default="", help="write the results (one JSON object per line) to this file")
    args = ap.parse_args(argv)
    try:
        variants = [v for v in args.variants.split(",") if v]
        for v in variants:
            parse_variant(v)
        for key in ("tokens", "experts", "top_k", "d_model", "d_ff", "steps"):
            if getattr(args, key) < 1:
                raise ValueError(f"--{key.replace('_', '-')}={getattr(args, key)} must be >= 1")
        if args.top_k > args.experts:
            raise ValueError(f"--top-k={args.top_k} must be <= --experts={args.experts}")
        if not variants:
            raise ValueError("--variants is empty: give ragged_dot, tiles or tiles:M:P")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    import jax
    import jax.numpy as jnp

    platform = jax.devices()[0].platform
    dtype = jnp.float32 if platform == "cpu" else jnp.bfloat16
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    e, d, f = args.experts, args.d_model, args.d_ff
    inputs = ((jax.random.normal(k1, (args.tokens, d)) * 0.5).astype(dtype),
              (jax.random.normal(k2, (e, d, 2, f)) * d ** -0.5).astype(dtype),
              (jax.random.normal(k3, (e, f, d)) * f ** -0.5).astype(dtype),
              jax.random.randint(k4, (args.tokens, args.top_k), 0, e),
              jnp.full((args.tokens, args.top_k), 1.0 / args.top_k, dtype))
    print(f"{args.tokens} tokens, top-{args.top_k} of {e} experts, d_model {d}, expert width {f}, "
          f"{jnp.dtype(dtype).name} on {jax.devices()[0].device_kind}")
    results, first = [], None
    for v in variants:
        r = run_variant(v, args, inputs, platform)
        leaves = [a.astype(jnp.float32) for a in jax.tree.leaves(r.pop("out"))]
        if first is None:
            first, r["max_rel_diff"] = leaves, 0.0
        else:
            r["max_rel_diff"] = max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))
                                    for a, b in zip(leaves, first))
        results.append(r)
        print(f"  {v:18s} compile {r['compile_s']:5.1f} s | {1e3 * r['step_s']:8.2f} ms | {r['tflops']:6.1f} TFLOP/s | "
              f"temporaries {r['temp_bytes'] / 2**30:6.2f} GiB | max rel diff {r['max_rel_diff']:.1e}", flush=True)
    write_jsonl(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
