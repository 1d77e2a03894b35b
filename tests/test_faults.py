"""Faults end to end, with `python train.py` in subprocesses: kill -9 and resume, kill -9 during an
asynchronous save, two processes through jax.distributed (stopped together by a SIGTERM), a dead
peer, an unreadable checkpoint; in process: a streak of NaN steps, a SIGTERM.

The learning rate is constant after warm-up (``train.min_lr_ratio=1``), so runs of different
``train.steps`` share the losses of the steps they have in common.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import config

ROOT = Path(__file__).resolve().parents[1]
STEPS = 16
ARGS = ["data.source=synthetic", "model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.vocab_size=256",
        "model.seq_len=32", "train.batch_size=16", "train.log_every=1", "train.eval_every=0", "sample.tokens=0",
        "parallel.data=8", "parallel.tensor=1", "train.warmup_steps=2", "train.min_lr_ratio=1.0",
        "checkpoint.every=3"]


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    return env


def start(out: Path, *extra, log: Path | None = None) -> subprocess.Popen:
    log = log or out.with_suffix(".log")
    return subprocess.Popen([sys.executable, str(ROOT / "train.py"), *ARGS, f"train.out_dir={out}", *extra],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, env=_env(), cwd=ROOT)


def train(out: Path, *extra, expect: int = 0) -> str:
    log = out.with_suffix(".log")
    rc = start(out, *extra, log=log).wait(600)
    text = log.read_text()
    assert rc == expect, f"exit {rc}, expected {expect}:\n{text[-3000:]}"
    return text


def losses(out: Path) -> list[float]:
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(len(recs))), [r["step"] for r in recs]
    return [r["loss"] for r in recs]


def last_step(out: Path) -> int:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return -1
    lines = [line for line in path.read_text().splitlines() if line.endswith("}")]
    return json.loads(lines[-1])["step"] if lines else -1


def wait_for(cond, p: subprocess.Popen, timeout: float = 300, poll: float = 0.001) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert p.poll() is None, f"process exited ({p.returncode}) before the awaited moment"
        assert time.monotonic() < end, "timed out"
        time.sleep(poll)


@pytest.fixture(scope="session")  # session: kept while a worker runs tests of other modules
def reference_run(tmp_path_factory) -> Path:
    """The uninterrupted run, one process, 8 devices."""
    out = tmp_path_factory.mktemp("ref") / "run"
    train(out, f"train.steps={STEPS}")
    return out


@pytest.fixture(scope="session")  # session: kept while a worker runs tests of other modules
def reference(reference_run) -> list[float]:
    got = losses(reference_run)
    assert len(got) == STEPS
    return got


def test_unreadable_checkpoint_is_one_error_line_from_train_py(tmp_path, reference_run):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(reference_run, out)
    for f in (out / "checkpoints" / str(STEPS) / "state").rglob("d/*"):
        f.write_bytes(f.read_bytes()[:100])
    p = subprocess.run([sys.executable, str(ROOT / "train.py"), *ARGS, f"train.out_dir={out}", f"train.steps={STEPS + 3}"],
                       capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=600)
    assert p.returncode == 1
    assert p.stderr.startswith(f"error: checkpoint {out / 'checkpoints' / str(STEPS)} is unreadable (")
    assert p.stderr.count("\n") == 1, p.stderr  # one line: no traceback from orbax or tensorstore


def _tmp_saves(ck: Path) -> list[str]:
    return [p.name for p in ck.iterdir() if "tmp" in p.name] if ck.is_dir() else []


def test_kill9_at_a_random_step_and_during_a_save_then_resume_exactly(tmp_path, reference):
    out, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    kill_at = random.Random().randint(2, STEPS - 4)
    p = start(out, f"train.steps={STEPS}")
    wait_for(lambda: last_step(out) >= kill_at, p, poll=0.01)
    p.send_signal(signal.SIGKILL)
    p.wait()
    saved = sorted(int(d.name) for d in ck.iterdir() if d.name.isdigit())
    assert max(saved, default=0) <= kill_at + 1, saved  # none yet when killed before step 3

    # Resume, and kill it again while its next asynchronous save is being written (a save takes about
    # 0.1 s here; a kill that lands a moment too late finds it complete, and the attempt is repeated).
    for _ in range(3):
        p = start(out, f"train.steps={STEPS}")
        wait_for(lambda: bool(_tmp_saves(ck)), p)
        p.send_signal(signal.SIGKILL)
        p.wait()
        torn = _tmp_saves(ck)
        if torn:
            break
    assert torn, "three kills all landed after the save had completed"
    complete = sorted(int(d.name) for d in ck.iterdir() if d.name.isdigit())

    text = train(out, f"train.steps={STEPS}")
    if complete:
        assert f"resumed from {ck / str(complete[-1])} (step {complete[-1]}" in text, text[-2000:]
    else:  # both kills came before the first save completed: a fresh start
        assert "resumed" not in text
    assert not set(torn) & {p.name for p in ck.iterdir()}  # the torn save was discarded, never restored
    got = losses(out)
    assert got == reference, f"killed at step {kill_at}: {got} != {reference}"  # bit for bit


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _two_processes(out: Path, *extra) -> list[subprocess.Popen]:
    port = _free_port()
    return [start(out, "parallel.cpu_devices=4", f"distributed.coordinator=localhost:{port}",
                  "distributed.num_processes=2", f"distributed.process_id={i}", *extra,
                  log=out.parent / f"{out.name}.{i}.log") for i in range(2)]


def test_two_processes_match_one_stop_together_on_sigterm_and_restore_in_one(tmp_path, reference):
    out = tmp_path / "mp"
    procs = _two_processes(out, "train.steps=1000")
    wait_for(lambda: last_step(out) >= 2, procs[0], poll=0.01)
    procs[1].send_signal(signal.SIGTERM)  # a preemption notice to one of the hosts
    rcs = [p.wait(600) for p in procs]
    logs = [(tmp_path / f"mp.{i}.log").read_text() for i in range(2)]
    assert rcs == [0, 0], logs[0][-2000:] + logs[1][-2000:]
    assert "process 0/2: 4 local devices, loads rows 0:8 of each global batch of 16" in logs[0]
    assert "process 1/2: 4 local devices, loads rows 8:16 of each global batch of 16" in logs[1]
    k = len(losses(out))  # both processes stopped after the same step and saved it
    assert f"preempted (SIGTERM): stopping after step {k - 1}; checkpoint {out / 'checkpoints' / str(k)} saved" \
        in logs[0]
    assert 3 <= k <= STEPS - 3, f"the two processes stopped at step {k}"
    np.testing.assert_allclose(losses(out), reference[:k], rtol=1e-6)  # gloo sums in another order

    text = train(out, f"train.steps={k + 3}")  # one process, 8 devices, from the two processes' checkpoint
    assert f"resumed from {out / 'checkpoints' / str(k)} (step {k}" in text
    np.testing.assert_allclose(losses(out), reference[:k + 3], rtol=1e-5)


def test_a_dead_peer_stops_the_other_process_with_a_clear_error(tmp_path):
    out = tmp_path / "dead"
    procs = _two_processes(out, "train.steps=100000", "checkpoint.every=0", "distributed.heartbeat_timeout=10")
    wait_for(lambda: last_step(out) >= 2, procs[0], poll=0.05)
    procs[1].send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    try:
        rc = procs[0].wait(60)
    except subprocess.TimeoutExpired:
        procs[0].kill()
        pytest.fail("the surviving process did not stop within 60 s of its peer's death")
    text = (tmp_path / "dead.0.log").read_text()
    assert rc != 0
    assert "a peer process probably died" in text or "another task died" in text, text[-2000:]
    print(f"survivor exited {rc} after {time.monotonic() - t0:.1f} s")


def test_a_streak_of_nan_steps_stops_the_run_and_keeps_the_checkpoint(tmp_path):
    """In process: steps 3-5 are NaN with train.max_bad_steps=3; the run stops with one clear error
    after step 5; the checkpoints of step 3 and 6 (written during the streak) hold the same weights."""
    from jaxpar.checkpoint import Checkpointer
    from jaxpar.run import TrainingError, run
    from jaxpar.trainer import Trainer

    from jaxpar.mesh import make_mesh

    cfg = config("gpt2", train__steps=10, train__log_every=1, checkpoint__every=3, train__max_bad_steps=3,
                 debug__nan_steps="3,4,5", sample__tokens=0, train__out_dir=str(tmp_path / "nan"))
    mesh = make_mesh(cfg.parallel, jax.devices()[:1])  # the skipping on a sharded mesh: test_checkpoint
    with pytest.raises(TrainingError) as e:
        run(cfg, mesh=mesh, log=lambda *a: None)
    msg = str(e.value)
    assert "3 consecutive steps (3-5)" in msg and "train.max_bad_steps=3" in msg and "\n" not in msg, msg
    recs = [json.loads(line) for line in (tmp_path / "nan" / "metrics.jsonl").read_text().splitlines()]
    assert [r["nonfinite"] for r in recs] == [0, 0, 0, 1, 1, 1]
    assert all(r["loss"] is None for r in recs[3:]) and recs[-1]["skipped_steps"] == 3
    ck = Checkpointer(tmp_path / "nan" / "checkpoints")
    assert ck.steps() == [3, 6], ck.steps()
    t = Trainer(cfg, mesh=mesh)
    a, _, _ = ck.restore(3, t.abstract_state)
    b, _, _ = ck.restore(6, t.abstract_state)
    ck.close()
    for x, y in zip(jax.tree.leaves(a["params"]), jax.tree.leaves(b["params"])):  # skipped steps changed nothing
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_sigterm_saves_a_checkpoint_and_the_resumed_run_matches(tmp_path):
    """In process: a SIGTERM (a scheduler's preemption notice) after step 2 ends the run with a checkpoint
    of the steps done; resuming gives exactly the losses of an uninterrupted run."""
    import threading

    from jaxpar.run import run

    from jaxpar.mesh import make_mesh

    def cfg(name):
        return config("gpt2", train__steps=6, train__log_every=1, checkpoint__every=100, sample__tokens=0,
                      train__out_dir=str(tmp_path / name))

    one_device = make_mesh(cfg("x").parallel, jax.devices()[:1])  # the notice, not the layout, is under test

    def recs(name):
        return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    def notice():
        while last_step(tmp_path / "pre") < 2:
            time.sleep(0.005)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=notice, daemon=True).start()
    quiet = lambda *a: None  # noqa: E731
    handler = signal.getsignal(signal.SIGTERM)
    first = run(cfg("pre"), mesh=one_device, log=quiet)
    k = first["preempted_at"]
    assert k is not None and 3 <= k < 6 and first["checkpoint"].endswith(f"checkpoints/{k}")
    assert signal.getsignal(signal.SIGTERM) is handler  # the run's handler is gone with the run
    second = run(cfg("pre"), mesh=one_device, log=quiet)
    assert second["start_step"] == k and second["preempted_at"] is None
    run(dataclasses.replace(cfg("ref"), checkpoint=dataclasses.replace(cfg("ref").checkpoint, enabled=False)),
        mesh=one_device, log=quiet)
    assert [r["loss"] for r in recs("pre")] == [r["loss"] for r in recs("ref")]


def test_watchdog_fires_only_without_progress():
    """The hang detector behind train.step_timeout, with a fake action instead of exiting."""
    from jaxpar.run import Watchdog

    fired = []
    w = Watchdog(0.3, fired.append, poll=0.02)
    for _ in range(10):  # progress every 0.1 s: never fires
        time.sleep(0.1)
        w.beat()
    assert fired == []
    time.sleep(0.6)  # no progress: fires once, after about 0.3 s of silence
    w.close()
    assert len(fired) == 1 and 0.3 < fired[0] < 0.6, fired
    idle = Watchdog(0, fired.append)  # 0 = no limit: no thread at all
    assert idle._thread is None
