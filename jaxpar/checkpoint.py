"""Checkpoints with orbax-checkpoint: save asynchronously, keep the newest K, restore onto any mesh.

A checkpoint is a directory ``<checkpoint.dir>/<step>/`` (``step`` = optimizer steps completed)
with three items:

* ``state``  the train state ``{"step", "params", "opt", "skipped"}`` as sharded arrays (orbax
  ``StandardSave``: tensorstore, every process writes the shards it owns). Stacked layers are in
  layer order, whatever the mesh (circular pipelines keep them stage-major in memory; see
  :meth:`Trainer.state_to_layer_order`), so the checkpoint does not depend on the mesh;
* ``data``   the data iterator's position (JSON of plain ints, global: not per process);
* ``meta``   the format version, the resolved config, and the parameter shapes (JSON).

**Atomic.** orbax writes into a temporary directory and renames it to ``<step>`` only when every
item of every process is complete; a save interrupted by a crash leaves a temporary directory
that is never listed as a checkpoint (and is removed when the next run opens the directory).
A save that fails (disk full, permissions, an I/O error), in the foreground or in the
background, removes its temporary directory and stops the run with one :class:`CheckpointError`
line; the newest complete checkpoint stays the newest.

**Random state.** jaxpar has no stochastic layers; the initial weights come from ``train.seed``,
the data order and synthetic tokens from ``(train.seed, step)``: the saved config and step
determine every random draw of the rest of the run.

**Restore onto another mesh.** Arrays are read straight into the shardings of the new run
(``StandardRestore`` with abstract arrays), so a checkpoint saved on ``data=8`` continues on
``data=2 x tensor=4``, on a pipeline, with another ZeRO stage or on another device count.

Loading never unpickles: arrays come from tensorstore, the rest from JSON (configs from YAML
``safe_load``). A checkpoint that cannot be read, or that belongs to a model of another shape, is a
:class:`CheckpointError` (one line) and is left untouched.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import jax

FORMAT = 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used by this run: one line naming the directory and the cause."""


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def _storage_cause(e: BaseException) -> str:
    """The operating system's reason first (``No space left on device``, ``File too large``, ...),
    when the storage layer reports one, then the start of the error."""
    import os
    import re

    code = re.search(r"os_error_code='?(\d+)", str(e))
    reason = f"{os.strerror(int(code.group(1)))}: " if code else ""
    return (reason + _first_line(e))[:300]


def _shapes(tree) -> dict[str, tuple]:
    """``{"params/blocks/attn/qkv/kernel": shape}`` for a nested dict of arrays or array metadata."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        out["/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)] = tuple(leaf.shape)
    return out


class Checkpointer:
    """The checkpoints of one run directory (a thin layer over ``ocp.CheckpointManager``)."""

    def __init__(self, directory: str | Path, keep: int = 3, async_save: bool = True):
        """``directory``: a local path, or a ``gs://`` URL (passed to orbax as an ``epath.Path``)."""
        import orbax.checkpoint as ocp

        # orbax logs every save at INFO/WARNING, and a failed background write as an ERROR with the
        # whole tensorstore spec: the failure reaches the run as one CheckpointError instead
        logging.getLogger("absl").setLevel(logging.CRITICAL)
        logging.getLogger("asyncio").setLevel(logging.CRITICAL)
        _drop_closed_loop_reports()
        self.ocp = ocp
        self._pending: int | None = None  # the step of the newest save started (maybe still being written)
        _single_process_writes()
        if "://" in str(directory):  # a bucket (gs://...): orbax's own path type
            from etils import epath

            self.dir = epath.Path(str(directory))
        else:
            self.dir = Path(directory).absolute()
        handlers = {"state": ocp.StandardCheckpointHandler(), "data": ocp.JsonCheckpointHandler(),
                    "meta": ocp.JsonCheckpointHandler()}
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                               cleanup_tmp_directories=True, create=True)
        try:
            self.manager = ocp.CheckpointManager(self.dir, item_names=tuple(handlers), item_handlers=handlers,
                                                 options=options)
        except Exception as e:  # noqa: BLE001 - any failure to open the directory is the user's to fix
            raise CheckpointError(f"cannot open the checkpoint directory {self.dir}: {_first_line(e)}") from None

    # -- listing ---------------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first (a save still being written in the background
        is not one: orbax lists it from the moment it starts)."""
        steps = sorted(self.manager.all_steps())
        if self._pending in steps and self.manager.is_saving_in_progress():
            steps.remove(self._pending)
        return steps

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def path(self, step: int) -> Path:
        return self.dir / str(step)

    # -- saving ----------------------------------------------------------------------------------
    def save(self, step: int, state: dict, data_state: dict, config: dict) -> None:
        """Start saving ``state`` (layer order) as checkpoint ``step``; returns once the arrays are
        copied off the devices (the state may then be donated), writing goes on in the background."""
        a = self.ocp.args
        meta = {"format": FORMAT, "step": int(step), "config": config,
                "param_shapes": {k: list(v) for k, v in _shapes(state["params"]).items()}}
        self._pending = step
        with self._failing_save(step):
            self.manager.save(step, args=a.Composite(state=a.StandardSave(state), data=a.JsonSave(data_state),
                                                     meta=a.JsonSave(meta)), force=True)

    def wait(self) -> None:
        """Block until the pending save is complete on disk (a failed one: :class:`CheckpointError`)."""
        with self._failing_save(None):
            self.manager.wait_until_finished()

    def check_for_errors(self) -> None:
        """Raise :class:`CheckpointError` if a background save has failed (cheap; call after each step)."""
        with self._failing_save(None):
            self.manager.check_for_errors()

    @contextlib.contextmanager
    def _failing_save(self, step: int | None):
        """A save that fails (disk full, permissions, I/O error), now or in the background: its
        temporary directory is removed, the newest complete checkpoint stays the newest, and the run
        gets one line naming the directory and the cause."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - whatever the storage raised, the cause is in the line
            self._remove_tmp()
            newest = self.latest()
            raise CheckpointError(
                f"saving a checkpoint in {self.dir} failed ({_storage_cause(e)}); "
                + (f"the newest complete checkpoint is still {self.path(newest)}" if newest is not None
                   else "there is no complete checkpoint") + "; training stopped") from None

    def _remove_tmp(self) -> None:
        if "://" in str(self.dir):
            return
        import shutil

        for tmp in Path(self.dir).glob("*.orbax-checkpoint-tmp*"):
            shutil.rmtree(tmp, ignore_errors=True)

    def close(self) -> None:
        self.manager.close()

    # -- restoring -------------------------------------------------------------------------------
    def read_meta(self, step: int) -> dict:
        a = self.ocp.args
        try:
            meta = self.manager.restore(step, args=a.Composite(meta=a.JsonRestore()))["meta"]
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"checkpoint {self.path(step)} is unreadable (its meta item: {_first_line(e)}); "
                                  "it was left as is: move it away to resume from an older one") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or "param_shapes" not in meta:
            raise CheckpointError(f"checkpoint {self.path(step)} is not a jaxpar checkpoint of format {FORMAT} "
                                  f"(meta: {str(meta)[:120]}); it was left as is")
        return meta

    def check_compatible(self, step: int, abstract_state: dict, config: dict | None = None) -> dict:
        """The checkpoint's meta, after checking that its parameters have this run's shapes
        (``config``, this run's config dict, only serves to name the model keys that differ)."""
        meta = self.read_meta(step)
        want = _shapes(abstract_state["params"])
        have = {k: tuple(v) for k, v in meta["param_shapes"].items()}
        if have != want:
            missing = sorted(set(want) - set(have))
            extra = sorted(set(have) - set(want))
            diff = [k for k in sorted(set(want) & set(have)) if want[k] != have[k]]
            if diff:
                what = f"params/{diff[0]} has shape {have[diff[0]]} there but {want[diff[0]]} in this model"
            elif missing:
                what = f"it has no params/{missing[0]}"
            else:
                what = f"it has params/{extra[0]}, which this model does not"
            changed = _model_changes(meta.get("config", {}), config or {})
            raise CheckpointError(f"checkpoint {self.path(step)} belongs to another model: {what}"
                                  f"{changed}; it was left as is (use another checkpoint.dir or train.out_dir "
                                  "to start a new run)")
        return meta

    def restore(self, step: int, abstract_state: dict, config: dict | None = None) -> tuple[dict, dict, dict]:
        """``(state, data_state, meta)`` of checkpoint ``step``, its arrays placed with the shardings of
        ``abstract_state`` (``jax.ShapeDtypeStruct`` leaves with ``sharding``; layer order)."""
        meta = self.check_compatible(step, abstract_state, config)
        a = self.ocp.args
        _drop_closed_loop_reports()  # a failed read's cancelled siblings report "Event loop is closed"
        try:
            out = self.manager.restore(step, args=a.Composite(state=a.StandardRestore(abstract_state),
                                                              data=a.JsonRestore()))
        except Exception as e:  # noqa: BLE001
            # orbax reads arrays in asyncio tasks; the ones that failed after the first would each log
            # a traceback ("Task exception was never retrieved") when collected: this error says it all.
            logging.getLogger("asyncio").setLevel(logging.CRITICAL)
            raise CheckpointError(f"checkpoint {self.path(step)} is unreadable ({_first_line(e)}); it was left as "
                                  "is: move it away to resume from an older one") from None
        return out["state"], dict(out["data"] or {}), meta


_WRITER_SET = False


def _single_process_writes() -> None:
    """With one process, write each replicated array once from its first replica. orbax's default
    (replica-parallel writes, which spread a replicated array's bytes over the hosts holding it)
    buys nothing on one host and slices every array eagerly, which costs about 3 s of one-off
    compilation at the first save of a small model."""
    global _WRITER_SET
    if _WRITER_SET or jax.process_count() > 1:
        return
    import orbax.checkpoint as ocp

    ocp.type_handlers.register_type_handler(
        jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True)
    _WRITER_SET = True


def _drop_closed_loop_reports() -> None:
    """Silence one known harmless report: when a read fails, tensorstore completes the cancelled
    reads of its siblings into orbax's closed event loop, and each reports "Event loop is closed"
    through ``sys.unraisablehook``. Everything else still reaches the previous hook."""
    import sys

    hook = sys.unraisablehook
    if getattr(hook, "_jaxpar_filter", False):
        return

    def filtered(unraisable):
        if not (isinstance(unraisable.exc_value, RuntimeError) and "Event loop is closed" in str(unraisable.exc_value)):
            hook(unraisable)

    setattr(filtered, "_jaxpar_filter", True)  # noqa: B010 (a marker on a function object)
    sys.unraisablehook = filtered


def _model_changes(saved: dict, now: dict) -> str:
    """`` (model.d_model: 64 in the checkpoint, 128 now)`` for the model keys that differ."""
    a, b = saved.get("model", {}), now.get("model", {})
    diffs = [f"model.{k}: {a[k]!r} in the checkpoint, {b.get(k)!r} now" for k in a if k in b and a[k] != b[k]]
    return f" ({'; '.join(diffs[:3])})" if diffs else ""


def config_changes(saved: dict, now: dict, ignore=("parallel", "train.out_dir", "model.init_from", "checkpoint",
                                                     "distributed", "train.log_every", "train.eval_every",
                                                     "debug", "sample")) -> list[str]:
    """``["train.lr: 0.003 -> 0.001", ...]``: what a resumed run changed against the checkpoint's config."""
    out = []
    for sec, vals in now.items():
        if not isinstance(vals, dict) or sec in ignore:
            continue
        for k, v in vals.items():
            key = f"{sec}.{k}"
            old = saved.get(sec, {}).get(k, v)
            if key not in ignore and old != v:
                out.append(f"{key}: {old!r} -> {v!r}")
    return out


class CheckpointHook:
    """A hook (:mod:`jaxpar.loop`): save after every ``every``-th step (0 = never), the last step, and a
    step at which the loop was asked to stop. Before a final save the fault counter settles (a final
    checkpoint is never written past a fatal streak of non-finite steps); the blocking part of a save
    is not step time; ``beat`` is called after it (the watchdog's sign of life)."""

    def __init__(self, loop, ckpt: Checkpointer, every: int, save_args, faults=None, beat=lambda: None):
        self.loop, self.ckpt, self.every, self.save_args, self.faults, self.beat = \
            loop, ckpt, every, save_args, faults, beat

    def __call__(self, info) -> None:
        stop = self.loop.stop_reason is not None
        if not (info.last or stop or (self.every and (info.step + 1) % self.every == 0)):
            return
        if (info.last or stop) and self.faults is not None:
            self.faults.flush()
        with self.loop.off_the_clock(info):
            self.ckpt.save(info.step + 1, *self.save_args(info.state))
        self.beat()
