"""``python -m jaxpar.plan --calibrate`` against measured step times, on the simulated CPU mesh.

    python benchmarks/plan_calibrate.py                       # configs/default.yaml's model, 8 simulated devices
    python benchmarks/plan_calibrate.py --rounds 7 --json out.json

Four layouts of the same model on 8 simulated devices are compiled and timed in interleaved rounds (one
step of each per round, after two warm-up steps each, so that the machine's drift falls on all alike; the
median per layout). The first layout's times are written as a train.py run directory (``config.yaml``,
``metrics.jsonl``, ``compile_report.json``) and :func:`jaxpar.plan_report.calibrate` fits the ``cpu``
cluster to it; the fitted planner then estimates the other three. The report: each layout's estimate at
the preset and after the fit, its measured time, and whether the fitted estimates rank the three as
measured. Simulated devices share this machine's cores: the fit absorbs that (its efficiency and
bandwidths are the machine's, not a GPU's).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpar.cli import ArgumentParser  # noqa: E402

LAYOUTS = [  # the calibration run first, then the three to rank
    {"parallel.data": 8, "parallel.tensor": 1, "parallel.zero": 1},
    {"parallel.data": 4, "parallel.tensor": 2, "parallel.zero": 1},
    {"parallel.data": 2, "parallel.tensor": 4, "parallel.zero": 0},
    {"parallel.data": 2, "parallel.seq": 2, "parallel.tensor": 2, "parallel.zero": 0},
]


def main(argv=None) -> int:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import dataclasses

    import jax
    import yaml

    from jaxpar.config import load_config
    from jaxpar.mesh import AXES, request_cpu_devices
    from jaxpar.plan import CLUSTERS, Planner, describe
    from jaxpar.plan_report import calibrate
    from plan import ready_step  # benchmarks/plan.py (this script's folder is on sys.path)

    request_cpu_devices(8)
    base_cfg = load_config(a.config, ["data.source=synthetic"])
    full = [{**{f"parallel.{x}": 1 for x in AXES}, "parallel.microbatches": 0, "model.remat": base_cfg.model.remat,
             "parallel.megatron_sp": False, "train.grad_accum": base_cfg.train.grad_accum, **ov} for ov in LAYOUTS]
    base = dataclasses.replace(base_cfg, parallel=type(base_cfg.parallel)())
    preset = Planner(base, CLUSTERS["cpu"], 1, platform="cpu")
    runs = []
    for ov in full:
        cfg = preset.config(ov)
        t, state, batch = ready_step(cfg)
        for _ in range(2):  # compile and warm up
            state, m = t.step(state, batch)
        jax.block_until_ready(m["loss"])
        runs.append({"cfg": cfg, "trainer": t, "state": state, "batch": batch, "times": []})
    for _ in range(a.rounds):  # interleaved: one step of each layout per round
        for r in runs:
            t0 = time.perf_counter()
            r["state"], m = r["trainer"].step(r["state"], r["batch"])
            jax.block_until_ready(m["loss"])
            r["times"].append(time.perf_counter() - t0)
    measured = [statistics.median(r["times"]) for r in runs]
    with tempfile.TemporaryDirectory() as d:  # the calibration layout as a train.py run directory
        run = Path(d)
        first = runs[0]
        (run / "config.yaml").write_text(yaml.safe_dump(first["cfg"].to_dict(), sort_keys=False))
        (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "step_time": x}) + "\n"
                                                   for i, x in enumerate(first["times"])))
        (run / "compile_report.json").write_text(json.dumps(first["trainer"].compile()))
        fitted, lines = calibrate([run], CLUSTERS["cpu"], "cpu", Planner)
    print("\n".join(lines))
    after = Planner(base, fitted, 1, platform="cpu")
    rows = []
    for ov, got in zip(full, measured):
        rows.append({"layout": describe(ov), "preset_s": preset.estimate(ov).step_seconds,
                     "fitted_s": after.estimate(ov).step_seconds, "measured_s": got})
        print(f"{rows[-1]['layout']:40s} preset {rows[-1]['preset_s']:8.3f} s  fitted {rows[-1]['fitted_s']:8.3f} s  "
              f"measured {got:8.3f} s")
    rest = rows[1:]
    by_fit = [r["layout"] for r in sorted(rest, key=lambda r: r["fitted_s"])]
    by_time = [r["layout"] for r in sorted(rest, key=lambda r: r["measured_s"])]
    same = by_fit == by_time
    print(f"the three other layouts ranked by the fitted planner: {by_fit}\n"
          f"by their measured step times:                       {by_time}\n"
          f"{'the same order' if same else 'NOT the same order'}")
    if a.json:
        a.json.write_text(json.dumps({"layouts": rows, "same_order": same}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
