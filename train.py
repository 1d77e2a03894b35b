#!/usr/bin/env python
"""Train a jaxpar model.

    python train.py [--config FILE] [section.key=value ...]

Examples:
    python train.py                                        # configs/default.yaml
    python train.py parallel.data=2 parallel.tensor=4 train.steps=50
    python train.py --config configs/gpt2_124m.yaml parallel.zero=3
    python train.py --keys                                 # every config key, documented

On a host without accelerators the mesh is simulated with XLA CPU devices. A run continues from the
newest checkpoint in its directory (checkpoint.resume=auto). Multi-process runs start the same
command once per process (see docs/guides/multihost.md); distributed.* keys or JAXPAR_COORDINATOR /
JAXPAR_NUM_PROCESSES / JAXPAR_PROCESS_ID say how the processes find each other.

Exit status: 0 done (also after a SIGTERM, which saves and stops); 1 the run failed (unusable checkpoint,
too many non-finite steps, a failed save, the run directory in use, out of device memory, a dead peer,
JAX could not start its backend); 2 bad config; 130 Ctrl-C (the first saves and stops after the step,
a second stops at once).
"""

from __future__ import annotations

import signal
import sys

# Ctrl-C while the libraries load is noted and honoured once they have: a KeyboardInterrupt inside a C
# extension's import crashes the interpreter or becomes an ImportError. After that it raises, and is
# still noted: one raised inside JAX's garbage-collection callback is swallowed there, and the next
# check honours it (jaxpar.run does the same during its start-up).
_CTRL_C: list[int] = []
_DEFER = [True]


def _on_ctrl_c(signum, _frame) -> None:
    _CTRL_C.append(signum)
    if not _DEFER:
        raise KeyboardInterrupt


def _quiet_swallowed_ctrl_c(unraisable) -> None:
    """A KeyboardInterrupt raised inside a callback Python cannot propagate from (JAX's gc callback) was
    noted by the handler: no "Exception ignored in ..." traceback for it."""
    if not isinstance(unraisable.exc_value, KeyboardInterrupt):
        sys.__unraisablehook__(unraisable)


if __name__ == "__main__" and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _on_ctrl_c)
    sys.unraisablehook = _quiet_swallowed_ctrl_c

import argparse  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "default.yaml"


def main(argv: list[str] | None = None) -> int:
    from jaxpar.cli import ArgumentParser

    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(DEFAULT_CONFIG),
                    help="YAML config file; missing keys take the built-in defaults (default: %(default)s)")
    ap.add_argument("--keys", action="store_true", help="print the table of config keys and exit")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tensor=4")
    args = ap.parse_intermixed_args(argv)  # --config may come after overrides too

    from jaxpar.config import ConfigError, config_table, load_config

    if args.keys:
        print(config_table())
        return 0
    try:
        from jaxpar.checkpoint import CheckpointError
        from jaxpar.distributed import ClusterError
        from jaxpar.lock import RunLockError
        from jaxpar.mesh import PlatformError, setup_devices
        from jaxpar.run import Interrupted, TrainingError, run

        import orbax.checkpoint  # noqa: F401 - its C extensions load here too, while Ctrl-C waits
    except KeyboardInterrupt:  # outside train.py (python -c "import train; train.main()"): no deferral
        _CTRL_C.append(signal.SIGINT)
    _DEFER.clear()
    try:
        if _CTRL_C:
            raise KeyboardInterrupt
        cfg = load_config(args.config, args.overrides)
        setup_devices(cfg.parallel, cfg.distributed)
        if _CTRL_C:  # one raised where a library swallowed it
            raise KeyboardInterrupt
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (PlatformError, ClusterError) as e:  # no backend (JAX_PLATFORMS=cuda without a GPU), no coordinator
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted (Ctrl-C) before training started; nothing was changed", file=sys.stderr)
        return 130

    try:
        summary = run(cfg)
    except KeyboardInterrupt:  # during start-up (in the loop, the first Ctrl-C stops after the step and saves)
        _exit_with_line("interrupted (Ctrl-C) during start-up; nothing was changed", 130)
    except (ConfigError, CheckpointError, TrainingError, RunLockError) as e:
        _exit_with_line(str(e), 2 if isinstance(e, ConfigError) else 130 if isinstance(e, Interrupted) else 1)
    return 130 if summary.get("interrupted") == "SIGINT" else 0


def _exit_with_line(message: str, status: int):
    """The error line last, then exit at once: after a dead peer JAX's shutdown would wait for it
    until the heartbeat timeout, and after an unreadable checkpoint tensorstore's reader threads
    print tracebacks of their own cancelled reads. Both streams go quiet before the line is written
    (through a copy of stderr), so no thread's report can land after it."""
    sys.stdout.flush()
    err, quiet = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - the process ends below
    os.dup2(quiet, 1)
    os.dup2(quiet, 2)
    os.write(err, f"error: {message}\n".encode())
    os._exit(status)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # before main() reached its own handlers (while importing)
        print("error: interrupted (Ctrl-C) before training started; nothing was changed", file=sys.stderr)
        sys.exit(130)
