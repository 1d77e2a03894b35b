"""Per-device memory of the pipeline schedules, from the compiled train step on 8 simulated CPU devices.

    python benchmarks/pipeline_memory.py               # both tables
    python benchmarks/pipeline_memory.py --json out.json

1. The MaxText comparison layout (Llama-style, emb 256, 4 heads, MLP 1024, 4 layers, vocab 8192 untied,
   seq 256, batch 8, float32, remat full, pipe=2 x data=4, 2 microbatches): arguments + outputs +
   temporaries - aliased (``memory_analysis()``) for the circular schedule (2 repeats), 1F1B,
   interleaved 1F1B (2 chunks per stage), 1F1B with ZeRO-1, ZB-H1 and ZB-V, each stage's forward run again for
   its backward (``parallel.stage_remat=true``).
2. Temporaries against the microbatch count M at a fixed microbatch size (Llama, d 64, 4 layers,
   seq 16, pipe=2, 4 sequences per microbatch): GPipe keeps every microbatch, 1F1B at most 2S - 1,
   interleaved 1F1B at most (R + 1) S - 1 chunk inputs, ZB-H1 at most S stage inputs and the deferred weight
   gradients' inputs of at most S microbatches (``parallel.stage_remat=true`` too).
3. Both with ``model.remat=none`` and the default ``parallel.stage_remat=false`` ("kept": each backward from the
   residuals its forward kept, no forward run twice; the zero-bubble paper's setting): 1F1B, ZB-H1 and ZB-V.
4. ZB-H1's and ZB-V's temporaries over 1F1B's at the issue's S = 4, M = 8 (the layout of 2. in 8 layers) for
   each ``parallel.stage_remat`` and ``model.remat`` none, save_dots and full (docs/concepts/pipeline.md).

Nothing is timed: the numbers are the compiler's buffer assignment, the same on any machine.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpar.cli import ArgumentParser  # noqa: E402

MIB = 2 ** 20
MAXTEXT = {"model.style": "llama", "model.d_model": 256, "model.n_heads": 4, "model.d_ff": 1024, "model.n_layers": 4,
           "model.vocab_size": 8192, "model.tie_embeddings": False, "model.seq_len": 256, "model.remat": "full",
           "model.compute_dtype": "float32", "train.batch_size": 8, "parallel.pipe": 2, "parallel.data": 4,
           "parallel.tensor": 1, "parallel.microbatches": 2, "data.source": "synthetic"}
KEPT = {"parallel.stage_remat": False, "model.remat": "none"}
AGAIN = {"parallel.stage_remat": True}  # each stage's forward run again for its backward
TINY = {"model.style": "llama", "model.n_layers": 4, "model.d_model": 64, "model.n_heads": 8, "model.n_kv_heads": 8,
        "model.d_ff": 128, "model.vocab_size": 250, "model.seq_len": 16, "parallel.pipe": 2, "parallel.data": 1,
        "parallel.tensor": 1, "data.source": "synthetic"}


def main(argv=None) -> int:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from jaxpar.mesh import request_cpu_devices

    request_cpu_devices(8)
    import jax

    from jaxpar.config import load_config
    from jaxpar.mesh import make_mesh
    from jaxpar.trainer import Trainer

    def memory(over: dict) -> dict:
        cfg = load_config(None, over)
        p = cfg.parallel
        n = p.data * p.pipe * p.tensor * p.expert * p.seq
        mem = Trainer(cfg, mesh=make_mesh(p, jax.devices()[:n])).compile()["memory"]
        mem["total"] = mem["argument_size"] + mem["output_size"] + mem["temp_size"] - mem["alias_size"]
        return mem

    out: dict = {"maxtext": {}, "microbatches": {}}
    print("MaxText comparison layout, per device (arguments + outputs + temporaries - aliased):")
    for name, extra in [("circular (2 repeats)", {"parallel.pipeline_repeats": 2}),
                        ("1f1b", {"parallel.pipeline_schedule": "1f1b", **AGAIN}),
                        ("interleaved 1f1b (R=2)", {"parallel.pipeline_schedule": "1f1b",
                                                    "parallel.pipeline_repeats": 2, **AGAIN}),
                        ("1f1b, zero=1", {"parallel.pipeline_schedule": "1f1b", "parallel.zero": 1, **AGAIN}),
                        ("zb_h1", {"parallel.pipeline_schedule": "zb_h1", **AGAIN}),
                        ("zb_v", {"parallel.pipeline_schedule": "zb_v", "parallel.pipeline_repeats": 2, **AGAIN}),
                        *((f"{n}, kept, remat none", {**o, **KEPT}) for n, o in (
                            ("1f1b", {"parallel.pipeline_schedule": "1f1b"}),
                            ("zb_h1", {"parallel.pipeline_schedule": "zb_h1"}),
                            ("zb_v", {"parallel.pipeline_schedule": "zb_v", "parallel.pipeline_repeats": 2})))]:
        mem = memory({**MAXTEXT, **extra})
        out["maxtext"][name] = mem
        print(f"  {name:29s} total {mem['total'] / MIB:7.1f} MiB  (arguments {mem['argument_size'] / MIB:.1f}, "
              f"temporaries {mem['temp_size'] / MIB:.1f})")
    print("temporaries against M, 4 sequences per microbatch:")
    for name, sched, r, extra in (("gpipe", "gpipe", 1, {}), ("1f1b", "1f1b", 1, AGAIN),
                                  ("interleaved 1f1b (R=2)", "1f1b", 2, AGAIN), ("zb_h1", "zb_h1", 1, AGAIN),
                                  ("zb_v", "zb_v", 2, AGAIN), ("1f1b, kept, remat none", "1f1b", 1, KEPT),
                                  ("zb_h1, kept, remat none", "zb_h1", 1, KEPT),
                                  ("zb_v, kept, remat none", "zb_v", 2, KEPT)):
        temps = {m: memory({**TINY, "parallel.microbatches": m, "parallel.pipeline_schedule": sched,
                            "parallel.pipeline_repeats": r, "train.batch_size": 4 * m, **extra})["temp_size"]
                 for m in (2, 16)}
        out["microbatches"][name] = temps
        print(f"  {name:29s} M=2 {temps[2] / MIB:6.2f} MiB   M=16 {temps[16] / MIB:6.2f} MiB   "
              f"ratio {temps[16] / temps[2]:.2f}")
    print("temporaries over 1F1B's at S = 4, M = 8 (8 layers), per setting:")
    out["settings"] = {}
    for again in (False, True):
        for remat in ("none", "save_dots", "full"):
            temps = {sched: memory({**TINY, "model.n_layers": 8, "parallel.pipe": 4, "parallel.microbatches": 8,
                                    "parallel.pipeline_schedule": sched, "parallel.pipeline_repeats": r,
                                    "train.batch_size": 32, "model.remat": remat,
                                    "parallel.stage_remat": again})["temp_size"]
                     for sched, r in (("1f1b", 1), ("zb_h1", 1), ("zb_v", 2))}
            name = f"stage_remat={str(again).lower()}, remat={remat}"
            out["settings"][name] = temps
            print(f"  {name:36s} 1F1B {temps['1f1b'] / MIB:6.2f} MiB   ZB-H1 {temps['zb_h1'] / temps['1f1b']:.2f}x   "
                  f"ZB-V {temps['zb_v'] / temps['1f1b']:.2f}x")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
