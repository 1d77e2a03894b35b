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
from helpers import command_env, config, token_store

ROOT = Path(__file__).resolve().parents[1]
STEPS = 16
ARGS = ["data.source=tokens", f"data.path={token_store()}", "model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.vocab_size=256",
        "model.seq_len=32", "train.batch_size=16", "train.log_every=1", "train.eval_every=0", "sample.tokens=0",
        "parallel.data=8", "parallel.tensor=1", "train.warmup_steps=2", "train.min_lr_ratio=1.0",
        "checkpoint.every=3"]


def _env():
    return command_env()


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


# --- the run's lifecycle: Ctrl-C, failed saves, one run per directory, failed starts -----------------

def test_ctrl_c_saves_after_the_step_and_the_resume_is_exact(tmp_path, reference):
    """The first Ctrl-C (SIGINT) at a random step: the run finishes that step, saves, says how to
    continue and exits 130; the resumed run's losses equal the uninterrupted run's bit for bit."""
    out = tmp_path / "run"
    at = random.Random().randint(1, STEPS - 4)
    p = start(out, f"train.steps={STEPS}")
    wait_for(lambda: last_step(out) >= at, p, poll=0.01)
    p.send_signal(signal.SIGINT)
    assert p.wait(300) == 130
    text = out.with_suffix(".log").read_text()
    k = int(text.split("interrupted (Ctrl-C): stopping after step ")[1].split(";")[0]) + 1
    assert f"checkpoint {out / 'checkpoints' / str(k)} saved, run the same command to continue" in text
    assert "Traceback" not in text
    train(out, f"train.steps={STEPS}")
    assert losses(out) == reference


def test_a_second_ctrl_c_stops_at_once():
    """The handler behind Ctrl-C: the first asks for a save after the step, the second interrupts."""
    from jaxpar.faults import Preemption as _Preemption

    p = _Preemption()
    try:
        p._interrupt()
        assert p.reached(1) and p.signal_name == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            p._interrupt()
    finally:
        p.close()


FSIZE = ("import resource, runpy, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
         "resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000)); sys.argv = sys.argv[1:]; "
         "runpy.run_path(sys.argv[0], run_name='__main__')")


def test_a_failed_save_is_one_line_and_the_newest_checkpoint_stays(tmp_path, reference_run):
    """Saving fails (the files may not grow past 20 kB: "File too large", as a full disk would fail
    it): one error line naming the directory and the cause, exit 1, the temporary directory removed,
    the previous checkpoints untouched and the newest still the newest."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(reference_run, out)
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    p = subprocess.run([sys.executable, "-c", FSIZE, str(ROOT / "train.py"), *ARGS, f"train.out_dir={out}",
                        f"train.steps={STEPS + 3}"], capture_output=True, text=True, cwd=ROOT, timeout=600,
                       # (the file size limit would also stop JAX writing the run's compilation cache, with a warning)
                       env={**_env(), "JAX_ENABLE_COMPILATION_CACHE": "false"})
    assert p.returncode == 1, p.stderr[-3000:]
    assert p.stderr.startswith(f"error: saving a checkpoint in {out / 'checkpoints'} failed (File too large: "), p.stderr
    assert p.stderr.endswith(f"the newest complete checkpoint is still {out / 'checkpoints' / str(STEPS)}; "
                             "training stopped\n")
    assert p.stderr.count("\n") == 1, p.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before  # no temporary directory left


def _snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_one_run_per_directory(tmp_path):
    """A second run of a directory in use fails at once with one line naming the holder; the lock is
    gone when the first run ends."""
    out = tmp_path / "run"
    first = start(out, "train.steps=100000")
    wait_for(lambda: last_step(out) >= 1, first, poll=0.05)
    p = subprocess.run([sys.executable, str(ROOT / "train.py"), *ARGS, f"train.out_dir={out}", "train.steps=3"],
                       capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    assert p.returncode == 1
    assert p.stderr.startswith(f"error: {out} is in use by process {first.pid} on host "), p.stderr
    assert p.stderr.count("\n") == 1, p.stderr
    first.send_signal(signal.SIGTERM)
    assert first.wait(300) == 0
    assert not (out / ".jaxpar.lock").exists()


def test_a_stale_lock_is_taken_over_and_a_foreign_one_is_named(tmp_path):
    """A lock of a process that no longer runs on this host is taken over with a note; one from
    another host cannot be checked, so the error names the file to remove."""
    from jaxpar.lock import RunLock, RunLockError

    dead = subprocess.Popen(["true"])
    dead.wait()
    path = tmp_path / ".jaxpar.lock"
    path.write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "started": "then"}))
    notes = []
    lock = RunLock(tmp_path, log=notes.append)
    lock.acquire()
    assert notes == [f"note: {path} was left by process {dead.pid}, which no longer runs; taking it over"]
    assert json.loads(path.read_text())["pid"] == os.getpid()
    lock.release()
    assert not path.exists()
    path.write_text(json.dumps({"host": "elsewhere", "pid": 1, "started": "then"}))
    with pytest.raises(RunLockError, match=f"is in use by process 1 on host elsewhere .*remove {path} if that run"):
        RunLock(tmp_path).acquire()
    assert json.loads(path.read_text())["host"] == "elsewhere"  # not ours: untouched


LOCKED = "lock held by a live process"


@pytest.mark.parametrize("args, env, status, needle", [
    (["train.beta1=1.0"], {}, 2, "train.beta1=1.0 is out of range: it must be [0, 1)"),
    (["train.beta2=-0.5"], {}, 2, "train.beta2=-0.5 is out of range: it must be [0, 1)"),
    (["train.eps=-1e-8"], {}, 2, "train.eps=-1e-08 is out of range: it must be > 0"),
    (["model.norm_eps=-1"], {}, 2, "model.norm_eps=-1.0 is out of range: it must be > 0"),
    (["model.init_std=0"], {}, 2, "model.init_std=0.0 is out of range: it must be > 0"),
    (["train.lr=-3e-4"], {}, 2, "train.lr=-0.0003 is out of range"),
    (["data.val_fraction=1.5"], {}, 2, "data.val_fraction=1.5 is out of range"),
    (["parallel.microbatches=4"], {}, 2, "parallel.microbatches=4 has no effect with parallel.pipe=1"),
    (["parallel.tensr=2"], {}, 2, "did you mean parallel.tensor"),
    (["data.source=shakespeare", "model.vocab_size=100000"], {}, 2, "more than twice what the tokenizer yields"),
    (["--config", "nope.yaml"], {}, 2, "config file 'nope.yaml' does not exist"),  # --config after overrides
    (["--confg", "x.yaml"], {}, 2, "unrecognized arguments: --confg x.yaml (did you mean --config?)"),
    (["data.source=files", "data.path=/no/such/corpus/*.txt"], {}, 2, "data.path"),
    ([], {"XLA_FLAGS": "--xla_force_host_platform_device_count=3"}, 2,
     "XLA_FLAGS sets --xla_force_host_platform_device_count=3, but the mesh needs 8"),
    (["model.d_model=32", f"train.steps={STEPS + 3}"], {}, 1, "belongs to another model"),  # a refused resume
    ([], {"JAX_PLATFORMS": "cuda"}, 1, "JAX could not start its backend ("),
    (LOCKED, {}, 1, "is in use by process"),
    (["train.lr=nan"], {}, 2, "train.lr=nan is out of range: it must be a finite number > 0"),
    (["--config", "{tmp}/broken.yaml"], {}, 2, "broken.yaml' is not valid YAML (line 2, column 1: expected"),
    (["checkpoint.dir=/proc/no/such/dir"], {}, 2, "checkpoint.dir='/proc/no/such/dir': cannot create the directory"),
    (["data.path={tmp}"], {}, 2, "is not a token store (no store.json); make one with `python -m jaxpar.data.prepare"),
    (["model.vocab_size=200"], {}, 2, "holds ids up to 255 (tokenizer of 256 ids) but model.vocab_size=200"),
    (["data.source=shakespeare", "data.tokenizer=byte"], {}, 1, "was saved training on data.source=tokens, and this run has "
                                         "data.source=shakespeare: its data position does not apply"),
], ids=lambda v: None if isinstance(v, (int, dict)) else v if isinstance(v, str) else " ".join(v) or None)
def test_cli_errors_are_one_line_and_leave_the_run_untouched(tmp_path, reference_run, args, env, status, needle):
    """Bad input against an existing run directory: one `error:` line on stderr, exit 2 for a config
    error and 1 for a run failure, no traceback, and every file of the run byte for byte as it was
    (config.yaml and the checkpoints included)."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(reference_run, out)
    (tmp_path / "broken.yaml").write_text("model: [1, 2\n")
    if args == LOCKED:  # held by this (live) pytest process
        (out / ".jaxpar.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": "now"}))
        args = []
    before = _snapshot(out)
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    p = subprocess.run([sys.executable, str(ROOT / "train.py"), *ARGS, f"train.out_dir={out}", *args],
                       capture_output=True, text=True, env={**_env(), **env}, cwd=ROOT, timeout=300)
    assert p.returncode == status, p.stderr[-3000:]
    assert p.stderr.startswith("error: ") and p.stderr.count("\n") == 1 and needle in p.stderr, p.stderr[-3000:]
    assert "Traceback" not in p.stdout
    assert _snapshot(out) == before


def test_a_failed_start_in_a_new_directory_leaves_nothing(tmp_path):
    """A start that fails on its data, on its platform or on its coordinator leaves no directory behind."""
    new = tmp_path / "new" / "run"
    for env, args, status, needle in [
            ({}, ["data.source=files", f"data.path={tmp_path / 'no-such-corpus'}/*.txt"], 2, "error: "),
            ({"JAX_PLATFORMS": "cuda"}, [], 1, "error: JAX could not start its backend ("),
            ({}, ["parallel.data=2", "parallel.cpu_devices=1", "distributed.coordinator=localhost:1",
                  "distributed.num_processes=2", "distributed.process_id=1", "distributed.init_timeout=2"], 1,
             "error: cannot reach the coordinator at localhost:1 (distributed.coordinator) within")]:
        p = subprocess.run([sys.executable, str(ROOT / "train.py"), *ARGS, f"train.out_dir={new}", *args],
                           capture_output=True, text=True, env={**_env(), **env}, cwd=ROOT, timeout=300)
        assert p.returncode == status and p.stderr.startswith(needle) and p.stderr.count("\n") == 1, p.stderr
        assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("args, needle", [
    (["--stages", "0", "--microbatches", "4"], "argument --stages: 0 is out of range: it must be >= 1"),
    (["--stages", "2", "--microbatches", "4", "--repeats", "0"], "argument --repeats: 0 is out of range: it must be >= 1"),
    (["--stages", "4", "--microbatches", "2", "--repeats", "2"], "needs --microbatches >= --stages (4)"),
    (["--stages", "2", "--microbatches", "4", "--out", "/no/such/folder/s.png"], "the folder '/no/such/folder' does"),
    (["--stages", "2", "--microbatches", "4", "--out", "{tmp}/s.xyz"], "unknown image format 'xyz'; use one of"),
    (["--stages", "two", "--microbatches", "4"], "argument --stages: 'two' is not an integer"),
    (["--stages", "2", "--microbatches", "4", "--schedule", "zb"], "--schedule=zb: choose gpipe, 1f1b, zb_h1 or zb_v"),
    (["--stages", "2", "--microbatches", "4", "--schedule", "zb_v", "--repeats", "2"], "needs --repeats 1"),
])
def test_plots_cli_errors_are_one_line(tmp_path, args, needle):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    p = subprocess.run([sys.executable, "-m", "jaxpar.plots", *args], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert p.returncode == 2 and p.stderr.startswith("error: ") and p.stderr.count("\n") == 1, p.stderr
    assert needle in p.stderr, p.stderr
    assert list(tmp_path.iterdir()) == []


def test_plots_cli_draws_the_docs_chart_with_no_sizes_given(tmp_path):
    """``python -m jaxpar.plots --schedule zb_v`` (as the docs write it): 4 stages and 8 microbatches, a PNG."""
    p = subprocess.run([sys.executable, "-m", "jaxpar.plots", "--schedule", "zb_v"], capture_output=True, text=True,
                       cwd=tmp_path, timeout=120)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "pipeline_schedule.png").read_bytes()[:4] == b"\x89PNG"


def test_out_of_memory_message_names_the_need_and_the_cure():
    from types import SimpleNamespace

    from jaxpar.run import out_of_memory_message

    device = SimpleNamespace(device_kind="NVIDIA H200", platform="gpu", memory_stats=lambda: {"bytes_limit": 140 * 2**30})
    report = {"memory": {"argument_size": 100 * 2**30, "temp_size": 60 * 2**30, "output_size": 100 * 2**30,
                         "alias_size": 100 * 2**30}}
    msg = out_of_memory_message(RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.2GiB"),
                                device, report)
    assert msg.startswith("out of device memory (RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.2GiB)")
    assert "the train step needs 160.0 GiB per device and NVIDIA H200 has 140.0 GiB" in msg
    assert "model.remat=save_dots or full" in msg and "parallel.zero=3" in msg


AS_LIMIT = ("import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30)); "
            "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")


@pytest.mark.parametrize("limit, layers, have", [(8, 2, "this process may use 8.0 GiB (its address-space limit"),
                                                 (0, 16, "this host has ")])
def test_a_step_bigger_than_the_host_is_refused_before_it_allocates(tmp_path, limit, layers, have):
    """Simulated CPU devices share the host's memory: a model whose compiled step needs more than the
    process may use (an 8 GiB address-space limit; or 16 layers of d_model 8192, 13 B parameters,
    about 230 GiB: more than the hosts that run the tests have free) is one line naming the need, the
    host and the cures, exit 1, before anything is allocated (it used to allocate until the OS killed
    it)."""
    prefix = [sys.executable, "-c", AS_LIMIT.replace("8 << 30", f"{limit} << 30")] if limit else [sys.executable]
    p = subprocess.run([*prefix, str(ROOT / "train.py"), "data.source=synthetic",
                        "model.d_model=8192", "model.n_heads=4", f"model.n_layers={layers}", "model.seq_len=32",
                        "train.batch_size=2", "parallel.data=1", "parallel.tensor=1", "sample.tokens=0",
                        f"train.out_dir={tmp_path / 'run'}"], capture_output=True, text=True, env=_env(), cwd=ROOT,
                       timeout=300)
    assert p.returncode == 1, p.stderr[-3000:]
    assert p.stderr.startswith("error: the compiled train step needs ") and p.stderr.count("\n") == 1, p.stderr[-3000:]
    value, unit = p.stderr.split("the compiled train step needs ")[1].split(" of host memory")[0].split()
    need = float(value) * {"GiB": 1, "TiB": 1024}[unit]
    n = int(p.stdout.split("parameters: ")[1].split()[0].replace(",", ""))
    assert need >= 3 * 4 * n / 2**30, (need, n)  # at least the float32 parameters and both Adam moments
    assert f"on each of the 1 simulated CPU devices) and {have}" in p.stderr
    assert "parallel.zero=3" in p.stderr and "model.remat=full" in p.stderr
    assert not (tmp_path / "run").exists()


def test_host_memory_need_is_every_simulated_device_s(monkeypatch):
    """The host-memory check counts each of the 8 simulated devices' step (they share the host): 1 GiB per
    device does not fit 6 GiB free (8 GiB needed), and fits 9 GiB; the line names both sizes and the count."""
    import resource
    from types import SimpleNamespace

    from jaxpar import faults
    from jaxpar.run import TrainingError

    mesh = SimpleNamespace(devices=np.array(jax.devices()[:8]))
    # by hand: 512 MiB arguments + 256 MiB temporaries + 384 MiB outputs - 128 MiB of them donated = 1 GiB
    report = {"memory": {"argument_size": 1 << 29, "temp_size": 1 << 28, "output_size": 3 << 27,
                         "alias_size": 1 << 27}}
    monkeypatch.setattr(resource, "getrlimit", lambda _: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    monkeypatch.setattr(faults, "host_memory", lambda: (6 << 30, 16 << 30))
    with pytest.raises(TrainingError, match=r"needs 8\.0 GiB of host memory \(1\.0 GiB on each of the 8 simulated"):
        faults.check_host_memory(report, mesh)
    monkeypatch.setattr(faults, "host_memory", lambda: (9 << 30, 16 << 30))
    faults.check_host_memory(report, mesh)


def test_running_out_of_device_memory_in_a_step_is_one_line():
    """Where the device runs out anyway (its own estimate was short): the runtime's error becomes one
    TrainingError line with the step's need, the device's size and the cures."""
    from types import SimpleNamespace

    from jaxpar.run import OutOfMemoryAsError, TrainingError

    device = SimpleNamespace(device_kind="NVIDIA H200", platform="gpu", memory_stats=lambda: {"bytes_limit": 2**30})
    guard = OutOfMemoryAsError(SimpleNamespace(mesh=SimpleNamespace(devices=np.array([device]))))
    guard.report = {"memory": {"argument_size": 2**30, "temp_size": 2**30}}
    with pytest.raises(TrainingError, match=r"^out of device memory \(RESOURCE_EXHAUSTED: Out of memory while trying "
                                            r"to allocate 2.0GiB\): the train step needs 2.0 GiB per device and "
                                            r"NVIDIA H200 has 1.0 GiB"):
        with guard:
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2.0GiB")
