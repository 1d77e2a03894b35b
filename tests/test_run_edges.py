"""The edges of a run that a new user hits (issue 32): honest throughput records on evaluation and
saving steps (against a wall clock), a rerun with nothing left to train changes nothing, a read-only
run directory, a peer that never starts, Ctrl-C at any moment of start-up, a step bigger than the
host, a checkpoint still being written is never named as complete."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import command_env, token_store

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"data.source": "tokens", "data.path": str(token_store()), "model.vocab_size": 256, "model.n_layers": 2,
         "model.d_model": 64, "model.n_heads": 4, "model.seq_len": 32, "train.batch_size": 16, "sample.tokens": 0,
         "parallel.data": 8, "parallel.tensor": 1, "train.warmup_steps": 1}


def _cfg(out: Path, **over):
    from jaxpar.config import load_config

    return load_config(None, {**SMALL, "train.out_dir": str(out), **{k.replace("__", "."): v for k, v in over.items()}})


def _snapshot(d: Path) -> dict:
    """Every entry under ``d``: file bytes, and directories as such (a new empty folder counts too)."""
    return {str(p.relative_to(d)): (p.read_bytes() if p.is_file() else "dir") for p in sorted(d.rglob("*"))}


def _env():
    return command_env()


def _train_py(*args, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], capture_output=True, text=True,
                          env={**_env(), **(env or {})}, cwd=ROOT, timeout=timeout)


def test_records_on_evaluation_and_saving_steps_agree_with_a_wall_clock(tmp_path):
    """A run that evaluates (a validation set of ~4 steps' work) and saves between steps: every record's
    step_time is the training steps' own time, as a wall clock around each step of the same run
    without evaluation or saving says (each step waited for). Measured before the step had finished,
    evaluation and saving took the step's device time out of the records (10x-440x too fast)."""
    from jaxpar.run import run

    walls: list[float] = []

    def clock(info):
        jax.block_until_ready(info.metrics)
        walls.append(time.perf_counter())

    size = {"model__n_layers": 4, "model__d_model": 128, "model__seq_len": 64, "train__steps": 10}
    run(_cfg(tmp_path / "plain", train__log_every=1, train__eval_every=0, checkpoint__enabled=False, **size),
        log=lambda *_: None, hooks=[(clock, 1)])
    wall = float(np.median(np.diff(walls[:-1])))  # the last interval holds the final evaluation
    run(_cfg(tmp_path / "run", train__log_every=2, train__eval_every=4, train__eval_batches=16, checkpoint__every=2,
             checkpoint__async_save=False, **size), log=lambda *_: None)
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # records at steps 0, 2, 4, 6, 8 (log_every), 3, 7 and 9 (evaluation, each right after a record: the step
    # alone); a save after steps 1, 3, 5, 7 and 9 (those after 1 and 5 with no record before them)
    assert [(r["step"], "val_loss" in r) for r in recs] == [
        (0, False), (2, False), (3, True), (4, False), (6, False), (7, True), (8, False), (9, True)]
    total = sum(r["step_time"] * (r["step"] - prev["step"]) for prev, r in zip(recs, recs[1:]))
    assert 0.7 < total / (9 * wall) < 1.4, (total, wall)
    for r in recs[1:]:
        assert wall / 2.5 < r["step_time"] < wall * 2.5, (r["step"], r["step_time"], wall)
        assert r["tokens_per_sec"] == pytest.approx(16 * 64 / r["step_time"])


def test_a_rerun_with_nothing_left_to_train_changes_nothing(tmp_path):
    """The same command again after the run finished, even on another layout: no file of the run
    directory is rewritten (config.yaml and compile_report.json keep describing the run that made the
    checkpoints; no new TensorBoard file, plot or sample); the summary says where the run stands."""
    from jaxpar.run import run

    out = tmp_path / "run"
    first = run(_cfg(out, train__steps=2, sample__tokens=4), log=lambda *_: None)
    before = _snapshot(out)
    lines: list[str] = []
    again = run(_cfg(out, train__steps=2, sample__tokens=4, parallel__data=4, parallel__tensor=2), log=lines.append)
    assert _snapshot(out) == before
    assert lines[-1] == (f"{out / 'checkpoints' / '2'} is at step 2 and train.steps=2: nothing left to train, nothing "
                         "was changed; raise train.steps to train on, or choose another train.out_dir for a new run")
    assert again["start_step"] == 2 and again["final_loss"] == first["final_loss"]
    assert again["val_loss"] == first["val_loss"]


def test_a_read_only_run_directory_and_an_unwritable_record_are_one_line(tmp_path):
    """/sys/kernel exists and refuses new files even to root: one line naming it, exit 1. A config.yaml
    that cannot be replaced (here a directory of that name) is one line too, and the run directory
    keeps what it had."""
    p = _train_py(*[f"{k}={v}" for k, v in SMALL.items()], "train.out_dir=/sys/kernel")
    assert p.returncode == 1, p.stderr[-2000:]
    assert p.stderr.startswith("error: cannot write in /sys/kernel (Permission denied): a run needs a writable "
                               "train.out_dir") and p.stderr.count("\n") == 1, p.stderr[-2000:]

    from jaxpar.faults import TrainingError
    from jaxpar.run import run

    out = tmp_path / "run"
    (out / "config.yaml").mkdir(parents=True)
    before = _snapshot(out)
    with pytest.raises(TrainingError, match=f"cannot write {out / 'config.yaml'} \\(Is a directory\\); the run "
                                            "directory train.out_dir must be writable"):
        run(_cfg(out, train__steps=1), log=lambda *_: None)
    assert _snapshot(out) == before


def test_a_peer_that_never_starts_is_one_line(tmp_path):
    """Process 0 of 2 waits distributed.init_timeout for process 1, which never comes: one line (JAX's
    own client would abort with a C++ fatal error and a stack trace), exit 1, nothing created."""
    port = 40000 + os.getpid() % 20000
    out = tmp_path / "new" / "run"
    p = _train_py(*[f"{k}={v}" for k, v in SMALL.items()], f"train.out_dir={out}", "parallel.data=1",
                  "parallel.cpu_devices=1", f"distributed.coordinator=127.0.0.1:{port}", "distributed.num_processes=2",
                  "distributed.process_id=0", "distributed.init_timeout=3")
    assert p.returncode == 1, p.stderr[-2000:]
    assert p.stderr == (f"error: process 0 of 2: not every process joined the run at 127.0.0.1:{port} within "
                        "distributed.init_timeout=3s; start all 2 processes (distributed.process_id 0..1) with the "
                        "same distributed.coordinator and distributed.num_processes, or raise "
                        "distributed.init_timeout\n")
    assert not (tmp_path / "new").exists()


def test_a_swallowed_ctrl_c_during_start_up_still_stops_it():
    """A library that catches KeyboardInterrupt (an ``except BaseException``, a C++ callback) cannot
    make the start go on: the handler noted it, and the next check raises it again."""
    from jaxpar.faults import StartUpSignals

    signals = StartUpSignals()
    try:
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs here
        except BaseException:  # noqa: BLE001 - the library that swallows it
            pass
        with pytest.raises(KeyboardInterrupt):
            signals.check()
    finally:
        signals.close()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_start_up_signals_keep_a_hook_installed_while_they_were_open():
    """The checkpoint reader installs its "Event loop is closed" filter during start-up (a restore);
    closing the start-up handlers must not drop it (that let tensorstore's tracebacks through)."""
    from jaxpar.checkpoint import _drop_closed_loop_reports
    from jaxpar.faults import StartUpSignals

    seen, before = [], sys.unraisablehook
    sys.unraisablehook = lambda u: seen.append(type(u.exc_value).__name__)
    try:
        signals = StartUpSignals()
        _drop_closed_loop_reports()
        signals.close()

        class U:
            def __init__(self, exc):
                self.exc_value, self.exc_type, self.exc_traceback = exc, type(exc), None
                self.object = self.err_msg = None

        sys.unraisablehook(U(RuntimeError("Event loop is closed")))  # the filter drops it
        sys.unraisablehook(U(ValueError("other")))  # everything else reaches the earlier hook
        sys.unraisablehook(U(KeyboardInterrupt()))  # after start-up no longer swallowed by the closed one
        assert seen == ["ValueError", "KeyboardInterrupt"]
    finally:
        sys.unraisablehook = before


def _loaded(pid: int, library: str) -> bool:
    try:
        return library in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.parametrize("delay", [0.0, 0.5, 2.0, 6.0])
def test_ctrl_c_at_any_moment_of_start_up_is_honoured(tmp_path, delay):
    """SIGINT at moments from the first library load (numpy's, right after train.py's first lines;
    then jaxlib's, whose import a KeyboardInterrupt crashes, JAX's garbage-collection callback, which
    swallows one, compilation) to the first steps: exit 130 and no traceback; before training, one line
    and no run directory; once training, a checkpoint to continue from."""
    out = tmp_path / "run"
    p = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *[f"{k}={v}" for k, v in SMALL.items()],
                          f"train.out_dir={out}", "train.steps=100000", "checkpoint.every=100000"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
    while not _loaded(p.pid, "numpy") and p.poll() is None:
        time.sleep(0.002)
    time.sleep(delay)
    p.send_signal(signal.SIGINT)
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr + stdout, stderr[-3000:]
    if "before training started" in stderr or "during start-up" in stderr:
        assert stderr.count("\n") == 1 and stderr.startswith("error: interrupted (Ctrl-C)"), stderr
        assert not out.exists()
    else:  # the loop had started: the first Ctrl-C stops after the step and saves it
        assert "finishing this step and saving a checkpoint" in stderr, stderr
        assert [int(d.name) for d in (out / "checkpoints").iterdir()] and (out / "config.yaml").is_file()


def test_a_checkpoint_still_being_written_is_not_listed_as_complete(tmp_path):
    """orbax lists a step from the moment its background save starts; until the save is on disk it must
    not be named as the checkpoint to resume from (a watchdog or a second Ctrl-C exits at once)."""
    import jax.numpy as jnp

    from jaxpar.checkpoint import Checkpointer

    ck = Checkpointer(tmp_path / "ck", keep=3, async_save=True)
    state = {"step": jnp.zeros((), jnp.int32), "params": {"w": jnp.ones((64, 1 << 18), jnp.float32)}}  # 64 MiB
    for step in (1, 2, 3):
        ck.save(step, state, {"pos": step}, {})
        for _ in range(20):
            listed = ck.steps()
            assert all(ck.path(s).is_dir() for s in listed), (listed, sorted(os.listdir(tmp_path / "ck")))
        ck.wait()
        assert ck.steps()[-1] == step
    ck.close()
