"""The planner's first choice against the measured fastest of its top 5, on the simulated CPU mesh.

    python benchmarks/plan.py                          # configs/default.yaml's model, 8 simulated devices
    python benchmarks/plan.py --top 5 --steps 5 --json out.json

:class:`jaxpar.plan.Planner` ranks the layouts of 8 devices for the model and batch of ``--config``
with the ``cpu`` cluster preset (``platform="cpu"``: float32 activations, XLA:CPU's collectives);
each of its ``--top`` first layouts is compiled and timed (median of ``--steps`` steps after two
warm-up steps, synthetic data). The report: each layout's rank, estimate and measured step time, and
whether the planner's first choice is within 10% of the fastest measured. Simulated devices share
this machine's cores, so the times measure total work and copies, not a network: read the result
as a check of the ranking's sense, not of the time model's seconds.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpar.cli import ArgumentParser  # noqa: E402


def ready_step(cfg):
    """(a Trainer of ``cfg``, its initial state, a placed batch of random tokens) for timing its step."""
    import numpy as np

    from jaxpar.trainer import Trainer

    t = Trainer(cfg)
    rng = np.random.default_rng(0)
    b, s = cfg.train.batch_size, cfg.model.seq_len
    batch = t.place_batch({k: rng.integers(0, cfg.model.vocab_size, (b, s)).astype(np.int32)
                           for k in ("inputs", "targets")})
    return t, t.init_state(), batch


def main(argv=None) -> int:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import dataclasses

    import jax

    from jaxpar.config import load_config
    from jaxpar.mesh import request_cpu_devices
    from jaxpar.plan import CLUSTERS, Planner, describe

    request_cpu_devices(8)
    cfg = load_config(a.config, ["data.source=synthetic"])
    planner = Planner(dataclasses.replace(cfg, parallel=type(cfg.parallel)()), CLUSTERS["cpu"], 1, platform="cpu")
    ok, _ = planner.plan()

    rows = []
    for rank, est in enumerate(ok[: a.top], 1):
        t, state, batch = ready_step(planner.config(est.overrides))
        times = []
        for i in range(a.steps + 2):
            t0 = time.perf_counter()
            state, m = t.step(state, batch)
            jax.block_until_ready(m["loss"])
            if i >= 2:
                times.append(time.perf_counter() - t0)
        rows.append({"rank": rank, "layout": describe(est.overrides), "estimate_s": est.step_seconds,
                     "measured_s": statistics.median(times)})
        print(f"{rank}. {rows[-1]['layout']:44s} estimate {est.step_seconds:.3f} s   measured "
              f"{rows[-1]['measured_s']:.3f} s", flush=True)
    fastest = min(r["measured_s"] for r in rows)
    ratio = rows[0]["measured_s"] / fastest
    print(f"first choice: {ratio:.2f} x the fastest measured of the top {len(rows)} "
          f"({'within' if ratio <= 1.1 else 'NOT within'} 10%)")
    if a.json:
        a.json.write_text(json.dumps({"layouts": rows, "first_over_fastest": ratio}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
