"""End to end: `python train.py` as a user runs it, in a subprocess with its own device count."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import command_env

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.vocab_size=256", "model.seq_len=32",
         "train.batch_size=8", "train.steps=4", "train.log_every=1", "data.source=synthetic",
         "parallel.data=1", "parallel.tensor=1", "parallel.zero=0", "sample.tokens=0",
         "checkpoint.enabled=false"]  # checkpoints: test_faults.py, test_checkpoint.py


def train(*args, check=True):
    env = command_env()
    p = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(p.stdout[-3000:] + p.stderr[-3000:])
    return p


def metrics(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def test_train_py_contract_and_mesh_independent_losses(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    train(*SMALL, "parallel.data=2", "parallel.tensor=2", "parallel.zero=1", f"train.out_dir={a}", "debug.dump_hlo=true")
    train(*SMALL, "parallel.data=4", f"train.out_dir={b}", "--config", str(ROOT / "configs" / "default.yaml"))
    ma, mb = metrics(a), metrics(b)
    assert [m["step"] for m in ma] == [0, 1, 2, 3]
    for x, y in zip(ma, mb):
        assert abs(x["loss"] - y["loss"]) <= 1e-5 * abs(y["loss"]), (ma, mb)
        for k in ("lr", "grad_norm", "step_time", "tokens_per_sec"):
            assert k in x
    rep = json.loads((a / "compile_report.json").read_text())
    assert rep["memory"]["argument_size"] > 0 and rep["flops"] > 0
    assert rep["collectives"]["all-reduce"]["by_axes"]["tensor"]["count"] > 0
    assert "all-reduce" in (a / "train_step.hlo.txt").read_text()
    assert (a / "config.yaml").exists()


@pytest.mark.parametrize("args, needle", [
    (["parallel.tensr=2"], "did you mean parallel.tensor"),
    (["parallel.data=3", "parallel.tensor=1", "parallel.cpu_devices=4"], "needs 3 devices but 4 are available"),
    (["parallel.data=1", "parallel.tensor=3", "model.n_heads=4"], "parallel.tensor=3 does not divide model.n_heads=4"),
    (["--config", "nope.yaml"], "config file 'nope.yaml' does not exist"),
    (["model.attention=cudnn"], "model.attention=cudnn: cuDNN flash attention needs a GPU (this run is on cpu)"),
    (["model.remat=save_everything"], "model.remat='save_everything' is not a valid choice; choose one of none"),
    (["model.loss_chunk_tokens=-1"], "model.loss_chunk_tokens=-1 is out of range: it must be >= 0"),
])
def test_user_errors_are_one_line(args, needle):
    p = train(*args, check=False)
    assert p.returncode == 2
    assert needle in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_shakespeare_run_writes_everything(tmp_path):
    """The main job's outputs, on a tiny model: validation loss, plot, TensorBoard, a greedy sample; then
    `python -m jaxpar.generate` on the run's checkpoint, on another mesh (1 device), gives the same
    completion of the run's prompt (and one for a second prompt)."""
    out = tmp_path / "s"
    p = train(*SMALL, "data.source=shakespeare", "train.steps=6", "train.eval_every=3", "train.eval_batches=1",
              "parallel.data=2", "parallel.tensor=2", "sample.tokens=12", "sample.temperature=0",
              "model.vocab_size=300", f"data.cache_dir={tmp_path}/cache", "checkpoint.enabled=true",
              f"train.out_dir={out}")
    ms = metrics(out)
    assert [m["step"] for m in ms if "val_loss" in m] == [2, 5]
    assert (out / "loss.png").stat().st_size > 1000
    assert list((out / "tb").glob("events.out.tfevents.*"))
    sample = (out / "sample.txt").read_text()
    assert sample.startswith("ROMEO:")
    assert "--- sample" in p.stdout and "tokenizer bpe with 300 ids" in p.stdout
    assert list((tmp_path / "cache").glob("bpe-v300-*.tokenizer.json"))
    env = command_env()
    g = subprocess.run([sys.executable, "-m", "jaxpar.generate", str(out), "--prompt", "ROMEO:\n", "--prompt",
                        "JULIET:\nO", "--tokens", "12", "parallel.data=1", "parallel.tensor=1"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert g.returncode == 0, g.stderr[-3000:]
    completions = g.stdout.split("\n---\n")
    assert completions[0] + "\n" == sample and completions[1].startswith("JULIET:\nO")
    assert f"{out}: step 6" in g.stderr
    bad = subprocess.run([sys.executable, "-m", "jaxpar.generate", str(tmp_path / "nope")], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=600)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "is not a run directory" in bad.stderr
    assert bad.stderr.count("\n") == 1


def test_pipeline_run_on_text_evaluates_and_samples(tmp_path):
    """The README's 1F1B command on text (a layout that used to fail at the end: sampling built a batch
    the pipeline could not cut into its 4 microbatches): training, evaluation and the sample run, exit 0,
    and the schedule chart is 1F1B's."""
    out = tmp_path / "t"
    p = train(*SMALL, "data.source=shakespeare", "model.vocab_size=300", f"data.cache_dir={tmp_path}/cache",
              "parallel.pipe=2", "parallel.data=4", "parallel.tensor=1", "parallel.microbatches=4",
              "parallel.pipeline_schedule=1f1b", "train.batch_size=16", "train.steps=2",
              "train.eval_batches=1", "sample.tokens=6", f"train.out_dir={out}")
    assert "--- sample" in p.stdout and (out / "sample.txt").read_text().startswith("ROMEO:")
    assert "pipeline: 1F1B, 2 stages, 4 microbatches: 6 iterations" in p.stdout
    assert "bubble (S-1)/(M+S-1) = 20.0%" in p.stdout
    steps = [m for m in metrics(out) if "loss" in m]
    assert steps and all(abs(m["bubble_fraction"] - 1 / 5) < 1e-9 for m in steps)
    assert (out / "pipeline_schedule.png").stat().st_size > 5000
    assert "val_loss" in metrics(out)[-1]
