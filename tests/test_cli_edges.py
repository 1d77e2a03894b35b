"""The edges of ``python -m jaxpar.plan`` / ``compile`` / ``generate`` and of the library API, as a new user
meets them: every numeric flag has a range (one ``error:`` line naming the flag, the value and the range,
exit 2); a bad path, an output that would overwrite a file of the user's, a request that cannot fit, Ctrl-C
and a closed output pipe are one line (or a quiet stop), never a traceback; the user's files stay
byte-identical. ``main([...])`` in-process; nothing is compiled but where a docstring says so.

References: the ranges as the README states them, hand-computed progress numbers, file hashes before and
after a refusal.
"""

import hashlib
import io
import json
import shlex
from pathlib import Path

import numpy as np
import pytest
import yaml

from jaxpar import cli, compile as compile_cli, generate, plan
from jaxpar.config import load_config

PLAN_TINY = ["model.style=llama", "model.n_layers=2", "model.d_model=64", "model.n_heads=8", "model.n_kv_heads=4",
             "model.seq_len=64", "model.vocab_size=512", "train.batch_size=16"]


def one_line(err: str) -> str:
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("main, argv, message", [
    (plan.main, ["--efficiency", "5"], "argument --efficiency: 5 is out of range: it must be in (0, 1]"),
    (plan.main, ["--efficiency", "0"], "argument --efficiency: 0 is out of range: it must be in (0, 1]"),
    (plan.main, ["--efficiency", "nan"], "argument --efficiency: nan is out of range: it must be in (0, 1]"),
    (plan.main, ["--nodes", "0"], "argument --nodes: 0 is out of range: it must be >= 1"),
    (plan.main, ["--nodes", "1.5"], "argument --nodes: '1.5' is not an integer"),
    (plan.main, ["--top", "0"], "argument --top: 0 is out of range: it must be >= 1"),
    (plan.main, ["--check", "-1"], "argument --check: -1 is out of range: it must be >= 0 (0 = none)"),
    (compile_cli.main, ["--config", "x.yaml", "--devices", "0"],
     "argument --devices: 0 is out of range: it must be >= 1"),
    (compile_cli.main, ["--config", "x.yaml", "--hbm-gib", "0"],
     "argument --hbm-gib: 0 is out of range: it must be > 0"),
    (compile_cli.main, ["--config", "x.yaml", "--hbm-gib", "inf"],
     "argument --hbm-gib: inf is out of range: it must be > 0"),
    (generate.main, ["run", "--tokens", "0"], "argument --tokens: 0 is out of range: it must be >= 1"),
    (generate.main, ["run", "--temperature", "-0.5"],
     "argument --temperature: -0.5 is out of range: it must be >= 0 (0 = greedy)"),
    (generate.main, ["run", "--top-k", "-1"], "argument --top-k: -1 is out of range: it must be >= 0 (0 = all tokens)"),
    (generate.main, ["run", "--top-p", "1.5"],
     "argument --top-p: 1.5 is out of range: it must be in (0, 1] (1 = all tokens)"),
    (generate.main, ["run", "--seed", str(2**32)],
     f"argument --seed: {2**32} is out of range: it must be in [0, 4,294,967,295] (JAX keys take 32 bits)"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_every_numeric_flag_has_a_range(main, argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert one_line(capsys.readouterr().err) == f"error: {message}; --help lists the arguments\n"


def test_the_planner_refuses_what_it_would_drop_and_prints_a_command_to_paste(capsys):
    # an override of what the planner chooses itself would be silently replaced
    for o in ("parallel.tensor=2", "model.remat=save_dots"):
        assert plan.main(["--cluster", "cpu", *PLAN_TINY, o]) == 2
        assert one_line(capsys.readouterr().err).startswith(f"error: {o}: the planner chooses the parallel layout")
    # the best layout's command is one a shell reads back word for word (an override with a space, quoted)
    assert plan.main(["--cluster", "cpu", *PLAN_TINY, "sample.prompt=O Romeo"]) == 0
    best = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("best: "))
    words = shlex.split(best[len("best: "):])
    assert words[:2] == ["python", "train.py"] and "sample.prompt=O Romeo" in words
    # no layout of 8 devices passes the checks: one line with the reason of the all-data layout
    assert plan.main(["--cluster", "cpu", "train.batch_size=4", "model.n_heads=1", "model.n_layers=1",
                      "model.seq_len=3"]) == 2
    err = one_line(capsys.readouterr().err)
    assert err.startswith("error: no layout of 8 devices passes the checks (e.g. data=8 (zero=0, remat=none): ")
    assert "not divisible by the batch-parallel size data*expert=8" in err
    with pytest.raises(plan.ConfigError, match="efficiency in"):
        plan.Planner(load_config(None, PLAN_TINY), plan.CLUSTERS["cpu"], efficiency=5)


def test_ctrl_c_is_one_line_and_a_closed_pipe_stops_quietly(monkeypatch, capsys, tmp_path):
    def interrupt(self):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(plan.Planner, "plan", interrupt)
        assert plan.main(["--cluster", "cpu", *PLAN_TINY]) == 130
    assert one_line(capsys.readouterr().err) == "error: interrupted (Ctrl-C); nothing was written\n"

    class Closed(io.TextIOBase):  # `python -m jaxpar.plan ... | head -1`: the reader is gone
        def write(self, s):
            raise BrokenPipeError(32, "Broken pipe")

        def fileno(self):
            return held

    held = open(tmp_path / "stdout", "w").fileno()
    monkeypatch.setattr("sys.stdout", Closed())
    assert plan.main(["--cluster", "cpu", *PLAN_TINY]) == 1
    assert capsys.readouterr().err == ""


def test_compile_writes_its_report_only_where_no_file_of_the_user_is(tmp_path, capsys, monkeypatch):
    """A --json path that exists and is not a report of the command is refused (the file byte-identical),
    as are a missing folder and a folder, before anything is compiled; a previous report is replaced,
    whole (one compile of a tiny model, in-process on the 8 test devices)."""
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"n_layers": 1, "d_model": 32, "n_heads": 4, "vocab_size": 128,
                                             "seq_len": 16}, "train": {"batch_size": 8}, "parallel": {"data": 8}}))
    mine = tmp_path / "notes.json"
    mine.write_text('{"my": "notes"}\n')
    before = sha(mine), sha(cfg)
    for out, needle in [(mine, "exists and is not a report of python -m jaxpar.compile; it was left as is"),
                        (cfg, "exists and is not a report"), (tmp_path / "no" / "r.json", "does not exist"),
                        (tmp_path, "is a folder")]:
        assert compile_cli.main(["--config", str(cfg), "--json", str(out)]) == 2
        assert needle in one_line(capsys.readouterr().err)
    assert (sha(mine), sha(cfg)) == before
    # JAX started with 8 devices: a compile for 4 cannot run in this process, said in one line
    assert compile_cli.main(["--config", str(cfg), "--devices", "4", "parallel.data=4"]) == 2
    assert "asked for 4 simulated CPU devices after JAX had already started with 8" in one_line(capsys.readouterr().err)

    report = tmp_path / "report.json"
    report.write_text(json.dumps({k: 0 for k in compile_cli.REPORT_KEYS}))
    monkeypatch.setenv("XLA_FLAGS", "")  # compile's main adds a flag for XLA:CPU; the later tests' subprocesses
    assert compile_cli.main(["--config", str(cfg), "--json", str(report)]) == 0
    r = json.loads(report.read_text())
    assert r["devices"] == 8 and r["mesh"]["data"] == 8 and r["per_device"]["total"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.json", "report.json", "tiny.yaml"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory with one checkpoint of a tiny byte-level model (no training: its initial weights)."""
    from helpers import token_store
    from jaxpar.checkpoint import Checkpointer
    from jaxpar.trainer import Trainer

    out = tmp_path_factory.mktemp("run")
    cfg = load_config(None, {"model.style": "gpt2", "model.n_layers": 1, "model.d_model": 32, "model.n_heads": 4,
                             "model.vocab_size": 256, "model.seq_len": 16, "data.source": "tokens",
                             "data.path": str(token_store()), "parallel.data": 8, "train.batch_size": 8,
                             "train.out_dir": str(out)})
    ck = Checkpointer(out / "checkpoints", async_save=False)
    ck.save(1, Trainer(cfg).init_state(), {}, cfg.to_dict())
    ck.close()
    (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return out


def test_generate_refuses_bad_input_in_one_line(run_dir, tmp_path, capsys, monkeypatch):
    """A run without checkpoints, ``hf:`` without a folder, an empty prompt (no BOS to start from), a stop
    text of two tokens, top-p with greedy decoding, a KV cache the devices cannot hold: each one line,
    before any generation."""
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.yaml").write_text((run_dir / "config.yaml").read_text().replace(str(run_dir), str(bare)))
    assert generate.main([str(bare)]) == 1
    err = one_line(capsys.readouterr().err)
    assert str(bare / "checkpoints") in err and "no checkpoint" in err
    assert [p.name for p in bare.iterdir()] == ["config.yaml"]  # nothing created in the user's folder
    assert generate.main(["hf:"]) == 2
    assert one_line(capsys.readouterr().err) == ("error: hf: names no folder; give hf:DIR, a Hugging Face model "
                                                 "directory\n")
    for argv, needle in [(["--prompt", ""],
                          "error: --prompt '' has no token to start from (this tokenizer adds no BOS)"),
                         (["--stop", "ki"], "error: --stop 'ki' is 2 tokens [107, 105] for this tokenizer; a stop is "
                                            "the text of one token"),
                         (["--temperature", "0", "--top-p", "0.9"],
                          "error: --top-p 0.9 has no effect on greedy decoding (temperature 0)")]:
        assert generate.main([str(run_dir), "--tokens", "4", *argv]) == 2
        assert one_line(capsys.readouterr().err).startswith(needle)
    monkeypatch.setattr(generate, "free_memory", lambda devices: (1024, "the test's device has 1 KiB free"))
    assert generate.main([str(run_dir), "--tokens", "4", "--prompt", "a", "--prompt", "b"]) == 2
    err = one_line(capsys.readouterr().err)
    # the cache by hand: 1 layer x (K and V) x 2 rows x 16 positions x 4 kv heads x 8 dims x 4 bytes = 8 KiB,
    # one device's share (the 2 rows cannot be split over data=8)
    assert err.startswith("error: generating for 2 prompt(s) needs ") and "x 1 layers: 8.0 KiB;" in err
    assert capsys.readouterr().out == ""


def test_generate_shows_progress_and_ctrl_c_stops_it_in_one_line(run_dir, capsys, monkeypatch):
    """40 tokens from an 8-token prompt in a window of 16: 8 tokens a segment (each one compiled call);
    Ctrl-C after the second: one error line with the count, nothing printed, exit 130. (One compile.)"""
    seen = []
    report = cli.Progress.__call__

    def interrupting(self, done, total=None):
        report(self, done, total)
        seen.append(self.line())
        if done >= 16:
            raise KeyboardInterrupt

    monkeypatch.setattr(cli.Progress, "__call__", interrupting)
    assert generate.main([str(run_dir), "--prompt", "the king", "--tokens", "40", "--temperature", "0"]) == 130
    out, err = capsys.readouterr()
    assert out == "" and err.endswith("\nerror: interrupted (Ctrl-C) after 16 of 40 tokens; nothing was printed\n")
    assert err.count("error:") == 1 and "Traceback" not in err
    assert "# the KV cache holds 16 positions (model.max_positions, the learned position table's rows)" in err
    assert seen[0] == "generating: 8/40 tokens (20.0%), measuring the rate"
    assert seen[1].startswith("generating: 16/40 tokens (40.0%), ") and " tok/s, ETA " in seen[1]


def test_progress_lines_and_their_numbers():
    """Off a terminal: a line every 10 s; the rate (x 2 rows) over the latest 10 to 20 s, from the first
    report on (the time before it may be compiling); numbers by hand."""
    clock = iter([0.0, 5.0, 15.0, 20.0, 26.0]).__next__
    stream = io.StringIO()
    p = cli.Progress(1000, "generating", "tokens", "tok/s", per=2, every=10, stream=stream, clock=clock)
    p(100)  # t=5: the first report (no rate yet), 5 s after the start: no line
    p(300)  # t=15: (300 - 100) x 2 / 10 s = 40 tok/s; (1000 - 300) x 2 / 40 = 35 s left
    p(400)  # t=20: 5 s after the last line: none
    p(900)  # t=26: since t=15, (900 - 300) x 2 / 11 s = 109.1 tok/s; 100 x 2 / 109.1 = 1.8 s
    assert stream.getvalue().splitlines() == ["generating: 300/1,000 tokens (30.0%), 40 tok/s, ETA 35s",
                                              "generating: 900/1,000 tokens (90.0%), 109 tok/s, ETA 2s"]
    assert [cli.duration(s) for s in (59, 61, 22 * 3600 + 1800, 3 * 86400 + 8 * 3600)] == \
        ["59s", "1m 01s", "22h 30m", "3d 08h"]

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    with cli.Progress(10, "generating", "tokens", "tok/s", stream=Terminal()) as bar:  # a rich bar
        bar(5)
        bar(10)
    assert bar.done == 10


def test_library_api_edges_are_named():
    """jaxpar.Layout: a batch the batch axes cannot split, a scalar batch, a loss that is no function, an
    explicit device list too short: each an error naming it (not JAX's multi-line sharding error)."""
    import jaxpar

    layout = jaxpar.Layout(data=4, tensor=2)
    with pytest.raises(ValueError, match=r"batch: array 1 has 6 rows, which the batch axes \(data=4\) cannot split; "
                                         "give a multiple of 4"):
        layout.batch(np.zeros((8, 2)), np.zeros((6, 2)))
    with pytest.raises(ValueError, match="array 0 is a scalar"):
        layout.batch(np.float32(1))
    with pytest.raises(TypeError, match="loss_fn must be a function"):
        layout.train_step(3)
    import jax

    with pytest.raises(ValueError, match=r"needs 8 devices and devices= lists 2"):
        jaxpar.Layout(data=8, devices=jax.devices()[:2])
