"""The planner's per-device memory against the compiled train step, by rematerialisation policy.

    python benchmarks/plan_memory.py                              # every policy, every layout
    python benchmarks/plan_memory.py --remat none save_dots

For each ``model.remat`` policy, the layouts of ``tests/test_plan.py`` (``LAYOUTS``) (which holds them to 10%
under ``full``) are estimated by :class:`jaxpar.plan.Planner` and compiled on 8 simulated CPU devices
(abstract arrays, nothing is allocated); each line is predicted / compiled total memory per device
(arguments + outputs + temporaries - aliased), and each policy ends with how many are within 10%.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from jaxpar.cli import ArgumentParser  # noqa: E402

POLICIES = ("full", "save_qkv_proj", "save_dots_except_mlp", "save_dots", "none")


def main(argv=None) -> int:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--remat", nargs="+", default=list(POLICIES), choices=POLICIES)
    a = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from jaxpar.mesh import request_cpu_devices

    request_cpu_devices(8)
    from helpers import trainer
    from test_plan import LAYOUTS, layout

    from jaxpar.plan import CLUSTERS, Planner

    for policy in a.remat:
        ratios = []
        for arch, par in LAYOUTS:
            cfg, ov = layout(arch, par, [f"model.remat={policy}"])
            planner = Planner(cfg, CLUSTERS["cpu"], 1, platform="cpu")
            est = planner.estimate(ov)
            mem = trainer(planner.config(ov)).compile()["memory"]
            total = mem["argument_size"] + mem["output_size"] + mem["temp_size"] - mem["alias_size"]
            ratios.append(est.memory["total"] / total)
            shown = ", ".join(f"{k}={v}" for k, v in par.items())
            print(f"{policy:22s} {arch:4s} {shown:75s} {est.memory['total'] / 2**20:6.2f} / {total / 2**20:6.2f} MiB"
                  f"  {ratios[-1]:.2f}", flush=True)
        within = sum(0.9 < r < 1.1 for r in ratios)
        print(f"{policy}: {within} of {len(ratios)} within 10% ({min(ratios):.2f} to {max(ratios):.2f})\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
