"""How long a checkpoint stops training: asynchronous vs synchronous save, and restore onto another mesh.

    python benchmarks/checkpoint.py [--layers 8] [--d-model 512] [--devices 8] [--out /tmp/jaxpar-ckpt-bench]

``--out`` is replaced on each run, so it must be a new folder or one this benchmark wrote.

Builds a GPT (default ~29M parameters + AdamW state, ZeRO-1 over data=N), then measures:

* ``step``           seconds per train step (the unit to compare against);
* ``async_blocking`` seconds ``save()`` holds the training loop with ``checkpoint.async_save=true``
                     (the device-to-host copy), and ``async_total`` until the save is on disk;
* ``sync``           seconds of a synchronous save;
* ``restore_*``      seconds to restore onto the same mesh and onto data=N/2 x tensor=2.

Prints one JSON object. On a CPU host the devices are simulated (``--devices``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def check_args(args) -> None:
    """Each bad argument a ValueError naming it and the valid values; nothing is built before."""
    if args.layers < 1:
        raise ValueError(f"--layers={args.layers} must be >= 1")
    if args.d_model < 8 or args.d_model % 8:
        raise ValueError(f"--d-model={args.d_model} must be a positive multiple of 8 (the model has 8 heads)")
    if args.devices < 2 or args.devices % 2:
        raise ValueError(f"--devices={args.devices} must be even and >= 2 (the restore test uses data=N/2 x tensor=2)")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or set(p.name for p in out.iterdir()) - {"async", "sync"}):
        raise ValueError(f"--out={args.out} exists and is not this benchmark's folder (it holds only async/ and "
                         "sync/); name a new folder")


def main() -> int:
    from jaxpar.cli import ArgumentParser

    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--out", default="/tmp/jaxpar-ckpt-bench")
    args = ap.parse_args()
    try:
        check_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from jaxpar.config import load_config
    from jaxpar.mesh import request_cpu_devices

    request_cpu_devices(args.devices)
    import jax

    from jaxpar.checkpoint import Checkpointer
    from jaxpar.data import SyntheticSource
    from jaxpar.mesh import make_mesh
    from jaxpar.trainer import Trainer

    n = len(jax.devices())
    over = {"model.n_layers": args.layers, "model.d_model": args.d_model, "model.n_heads": 8, "model.seq_len": 64,
            "model.vocab_size": 8192, "train.batch_size": n, "parallel.data": n, "parallel.tensor": 1,
            "parallel.zero": 1}
    cfg = load_config(None, over)
    t = Trainer(cfg, mesh=make_mesh(cfg.parallel))
    state = t.init_state()
    src = SyntheticSource(0, cfg.train.batch_size, cfg.model.seq_len, cfg.model.vocab_size)
    batch = t.place_batch(src.batch(0))
    state, m = t.step(state, batch)  # compile
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for _ in range(3):
        state, m = t.step(state, batch)
    jax.block_until_ready(m)
    res = {"parameters": t.param_count(), "devices": n, "step": (time.perf_counter() - t0) / 3}

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    for mode in ("async", "sync"):
        ck = Checkpointer(out / mode, keep=2, async_save=mode == "async")
        ck.save(0, state, {"step": 0}, cfg.to_dict())  # the first save sets up orbax's threads
        ck.wait()
        t0 = time.perf_counter()
        ck.save(1, state, {"step": 1}, cfg.to_dict())
        blocking = time.perf_counter() - t0
        ck.wait()
        total = time.perf_counter() - t0
        if mode == "async":
            res["async_blocking"], res["async_total"] = blocking, total
        else:
            res["sync"] = total
        ck.close()
    res["checkpoint_bytes"] = sum(f.stat().st_size for f in (out / "sync" / "1").rglob("*") if f.is_file())

    ck = Checkpointer(out / "sync")
    for name, par in (("restore_same_mesh", {}),
                      ("restore_other_mesh", {"parallel.data": n // 2, "parallel.tensor": 2})):
        c2 = load_config(None, {**over, **par})
        t2 = Trainer(c2, mesh=make_mesh(c2.parallel))
        t0 = time.perf_counter()
        restored, _, _ = ck.restore(1, t2.abstract_state)
        jax.block_until_ready(restored)
        res[name] = time.perf_counter() - t0
    ck.close()
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in res.items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
