"""The edges of Hugging Face import and export (jaxpar.hf, jaxpar.hf_files) a user hits, without torch:
exports that never overwrite what they should not (and replace what they may whole), imports that refuse
a directory whose files disagree, the CLI's one-line faults, and the model.max_positions key.

Every refusal is checked the same way: one ``error:`` line (CLI) or one exception, and every file under
the test's directory byte-identical before and after (hashes), no staging directory left behind. The
Hugging Face directories are written by jaxpar's own export (the torch-free way to make one; the
transformers side of the same paths is tests/test_hf.py's).
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from jaxpar import hf, hf_files
from jaxpar.config import ConfigError, load_config
from helpers import command_env
from helpers import trainer as Trainer

ROOT = Path(__file__).resolve().parents[1]
V, T = 300, 16
TINY = ["model.style=gpt2", "model.n_layers=1", "model.d_model=32", "model.n_heads=4", f"model.vocab_size={V}",
        f"model.seq_len={T}", "train.batch_size=8"]


def tree(d: Path) -> dict[str, str]:
    """Every entry under ``d``: a file's sha256, a directory as such."""
    out = {}
    for p in sorted(Path(d).rglob("*")):
        out[str(p.relative_to(d))] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
    return out


def random_params(trainer, seed: int = 0) -> dict:
    """Every parameter random (biases and norms included), placed as the trainer places them (built from
    the shapes, not by the compiled initialiser: seconds saved per model)."""
    import jax

    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a, s: jax.device_put((0.5 * rng.standard_normal(a.shape)).astype(a.dtype), s),
                        trainer.adapter.abstract, trainer.state_shardings["params"])


@pytest.fixture(scope="module")
def tiny():
    """A one-layer GPT-2 on one device and random parameters."""
    trainer = Trainer(load_config(None, TINY), 1)
    return trainer, random_params(trainer)


def export(tiny, out, run, **kw):
    trainer, params = tiny
    return hf.export(trainer, params, out, run=run, **kw)


def refused(tmp_path, fn, match, error=ConfigError):
    before = tree(tmp_path)
    with pytest.raises(error, match=match) as e:
        fn()
    assert "\n" not in str(e.value)
    assert tree(tmp_path) == before
    return str(e.value)


def test_export_targets_new_empty_same_run_and_refusals(tmp_path, tiny):
    run_a, run_b = tmp_path / "run_a", tmp_path / "run_b"
    # new, with parents; then the same run again (a new step) replaces it whole
    out = tmp_path / "a" / "b" / "out"
    files = export(tiny, out, run_a, step=1)
    assert sorted(f.name for f in files) == ["config.json", hf_files.MARKER, "model.safetensors"]
    marker = json.loads((out / hf_files.MARKER).read_text())
    assert marker["source"] == str(run_a.resolve()) and marker["step"] == 1
    assert sorted(marker["files"]) == ["config.json", "model.safetensors"]
    # a sharded export of the same run replaces the single file: no model.safetensors is left beside the index
    export(tiny, out, run_a, step=2, shard_bytes=20_000)
    names = sorted(os.listdir(out))
    shards = [n for n in names if n.startswith("model-")]
    assert len(shards) > 2 and "model.safetensors" not in names and hf_files.INDEX in names
    assert names == sorted(["config.json", hf_files.MARKER, hf_files.INDEX, *shards])
    index = json.loads((out / hf_files.INDEX).read_text())["weight_map"]
    assert sorted(set(index.values())) == sorted(shards)
    # ... and back: one file, no stale shards or index
    export(tiny, out, run_a, step=3)
    assert sorted(os.listdir(out)) == ["config.json", hf_files.MARKER, "model.safetensors"]
    assert json.loads((out / hf_files.MARKER).read_text())["step"] == 3
    assert sorted(os.listdir(out.parent)) == ["out"]  # no staging directory beside it
    # an empty directory (kept: its inode, e.g. a mount point or the working directory) is filled
    empty = tmp_path / "empty"
    empty.mkdir()
    inode = empty.stat().st_ino
    export(tiny, empty, run_a)
    assert sorted(os.listdir(empty)) == ["config.json", hf_files.MARKER, "model.safetensors"]
    assert empty.stat().st_ino == inode

    # refusals, each with every file under tmp_path unchanged
    msg = refused(tmp_path, lambda: export(tiny, out, run_b), "holds the jaxpar export of .*run_a, not of .*run_b")
    assert str(out) in msg and "--overwrite" in msg
    (out / "notes.txt").write_text("mine")
    refused(tmp_path, lambda: export(tiny, out, run_a), r"holds 'notes.txt' beside this run's export")
    os.remove(out / "notes.txt")
    model = tmp_path / "model"  # a Hugging Face model jaxpar did not write (no marker)
    shutil.copytree(out, model)
    os.remove(model / hf_files.MARKER)
    refused(tmp_path, lambda: export(tiny, model, run_a), r"holds a model jaxpar did not export \(config.json")
    other = tmp_path / "other"
    other.mkdir()
    (other / "a.txt").write_text("x")
    refused(tmp_path, lambda: export(tiny, other, run_a), r"holds files jaxpar did not write \(a.txt\)")
    (tmp_path / "file").write_text("x")
    refused(tmp_path, lambda: export(tiny, tmp_path / "file", run_a), "is a file")
    refused(tmp_path, lambda: export(tiny, tmp_path / "file" / "out", run_a), "cannot be created: .*file is a file")
    # never the run itself, nor a directory holding it, overwrite or not
    run_a.mkdir()
    (run_a / "config.yaml").write_text("train: {out_dir: elsewhere}\n")
    refused(tmp_path, lambda: export(tiny, run_a, run_a, overwrite=True), "is the run directory")
    refused(tmp_path, lambda: export(tiny, tmp_path, run_a, overwrite=True), "holds the run directory")

    # --overwrite replaces another run's export and a foreign directory whole (nothing of them is left)
    export(tiny, out, run_b, overwrite=True, shard_bytes=20_000)
    assert json.loads((out / hf_files.MARKER).read_text())["source"] == str(run_b.resolve())
    export(tiny, other, run_a, overwrite=True)
    assert sorted(os.listdir(other)) == ["config.json", hf_files.MARKER, "model.safetensors"]
    assert not [n for n in os.listdir(tmp_path) if ".jaxpar-" in n]


def test_export_io_fault_changes_nothing(tmp_path, tiny, monkeypatch):
    """A write that fails half-way (a full disk) is one ExportError; a replaced export, a new directory
    and its parents are as they were, and no staging directory is left."""
    out = tmp_path / "out"
    export(tiny, out, tmp_path / "run", shard_bytes=20_000)
    calls = []

    def full(path, tensors, metadata):
        if calls:
            raise OSError(28, "No space left on device", str(path))
        calls.append(path)
        hf_files.save(path, tensors, metadata)

    monkeypatch.setattr(hf, "save", full)
    before = tree(tmp_path)
    for target in (out, tmp_path / "new" / "deeper" / "out"):
        calls.clear()
        with pytest.raises(hf_files.ExportError, match=r"cannot be written \(No space left on device.*nothing was "
                                                        "changed"):
            export(tiny, target, tmp_path / "run", shard_bytes=20_000)
        assert calls and tree(tmp_path) == before


def test_import_refuses_files_that_disagree(tmp_path, tiny):
    src, sharded = tmp_path / "src", tmp_path / "sharded"
    export(tiny, src, "run")
    export(tiny, sharded, "run", shard_bytes=20_000)
    single, many = hf._Files(src), hf._Files(sharded)  # the good directories read the same tensors
    assert len(set(many.where.values())) > 2 and set(single.where) == set(many.where)
    for name in single.where:
        np.testing.assert_array_equal(single.files.read(name), many.files.read(name))
    shards = sorted(set(many.where.values()))

    def case(name, change, match):
        d = tmp_path / name
        shutil.copytree(sharded, d)
        change(d)
        msg = refused(tmp_path, lambda: hf._Files(d), match)
        assert str(d) in msg

    def move(d):  # the index maps a tensor to another shard
        index = json.loads((d / hf_files.INDEX).read_text())
        name = next(k for k, v in index["weight_map"].items() if v == shards[0])
        index["weight_map"][name] = shards[1]
        (d / hf_files.INDEX).write_text(json.dumps(index))

    def unmapped(d):  # a tensor of a shard that holds several is left out of the index
        index = json.loads((d / hf_files.INDEX).read_text())
        files = list(index["weight_map"].values())
        index["weight_map"].pop(next(k for k, v in index["weight_map"].items() if files.count(v) > 1))
        (d / hf_files.INDEX).write_text(json.dumps(index))

    def truncate(d):
        data = (d / shards[0]).read_bytes()
        (d / shards[0]).write_bytes(data[: len(data) - 100])

    case("missing", lambda d: os.remove(d / shards[1]), f"names {shards[1]}, which is missing")
    case("truncated", truncate, f"{shards[0]} is not a readable safetensors file .*truncated")
    case("empty_shard", lambda d: (d / shards[0]).write_bytes(b""), f"{shards[0]} is not a readable safetensors")
    case("moved", move, f"maps tensor .* to {shards[1]}, which does not hold it")
    case("unmapped", unmapped, "holds tensor .*, which model.safetensors.index.json does not map")
    case("both", lambda d: shutil.copy(src / "model.safetensors", d), "holds both model.safetensors and")
    case("bad_index", lambda d: (d / hf_files.INDEX).write_text("{"), "cannot be read as an index")
    case("outside", lambda d: (d / hf_files.INDEX).write_text(json.dumps({"weight_map": {"a": "../x.safetensors"}})),
         r"names '../x.safetensors', not a file of")


def test_cli_import_of_an_incomplete_model_is_one_line(tmp_path, tiny, capsys):
    """``python -m jaxpar.hf hf:DIR OUT`` over a model with a tensor missing: one line naming the tensor,
    exit 2, nothing created."""
    src = tmp_path / "src"
    export(tiny, src, "run")
    files = hf._Files(src)
    tensors = {k: np.array(files.files.read(k)) for k in files.where if k != "transformer.h.0.ln_1.weight"}
    del files
    hf_files.save(src / "model.safetensors", tensors, {"format": "pt"})
    before = tree(tmp_path)
    assert hf.main([f"hf:{src}", str(tmp_path / "out"), "data.tokenizer=byte", "parallel.data=8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "'transformer.h.0.ln_1.weight' is missing" in err
    assert tree(tmp_path) == before


def test_train_py_refuses_a_missing_shard_in_one_line(tmp_path, tiny):
    src = tmp_path / "src"
    export(tiny, src, "run", shard_bytes=20_000)
    shard = sorted(n for n in os.listdir(src) if n.startswith("model-"))[-1]
    os.remove(src / shard)
    before = tree(tmp_path)
    env = command_env()
    p = subprocess.run([sys.executable, str(ROOT / "train.py"), f"model.init_from=hf:{src}", "data.tokenizer=byte",
                        "data.source=synthetic", f"model.seq_len={T}", "train.batch_size=8", "train.steps=1",
                        "parallel.data=1", "parallel.tensor=1", "parallel.zero=0", "sample.tokens=0",
                        f"train.out_dir={tmp_path / 'run'}"], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=600)
    assert p.returncode == 2, p.stderr[-3000:]
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("error: ")
    assert f"names {shard}, which is missing" in p.stderr
    assert tree(tmp_path) == before  # the run directory was not left behind


def test_bfloat16_checkpoint_imports(tmp_path):
    """Published checkpoints are bfloat16, which numpy (and safetensors' numpy reader) lacks: the import
    reads it, the float32 weights equal the bfloat16 ones."""
    cfg = load_config(None, [*TINY, "model.param_dtype=bfloat16"])
    trainer = Trainer(cfg, 1)
    params = random_params(trainer)
    hf.export(trainer, params, tmp_path / "bf16", run="run")
    data = (tmp_path / "bf16" / "model.safetensors").read_bytes()
    meta = json.loads(data[8: 8 + int.from_bytes(data[:8], "little")])
    assert meta["transformer.wte.weight"]["dtype"] == "BF16"
    again = Trainer(load_config(None, [f"model.init_from=hf:{tmp_path / 'bf16'}", f"model.seq_len={T}",
                                       "train.batch_size=8", "data.tokenizer=byte"]), 1)
    back = dict(hf.hf_tensors(again, hf.load_params(again, tmp_path / "bf16")))  # (the vocabulary padding aside)
    for name, a in hf.hf_tensors(trainer, params):
        assert back[name].dtype == np.float32
        np.testing.assert_array_equal(a.astype(np.float32), back.pop(name), err_msg=name)
    assert not back


def main(args: list[str]) -> int:
    """``python -m jaxpar.hf ARGS``' exit status (argparse's errors exit through SystemExit)."""
    try:
        return hf.main(args)
    except SystemExit as e:
        return int(e.code or 0)


def fake_run(d: Path, *extra) -> Path:
    """A run directory's config.yaml (no checkpoint: the refusals come before one is read)."""
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump(load_config(None, [*TINY, f"train.out_dir={d}", *extra]).to_dict()))
    return d


@pytest.mark.parametrize("args, status, match", [
    (["--shard-gb", "0"], 2, "--shard-gb: 0 is out of range"),
    (["--shard-gb", "nan"], 2, "--shard-gb: nan is out of range"),
    (["--shard-gb", "inf"], 2, "--shard-gb: inf is out of range"),
    (["--shard-gb", "-1"], 2, "--shard-gb: -1 is out of range"),
    (["model.d_model"], 2, "override 'model.d_model' must look like section.key=value"),
    (["model.dmodel=3"], 2, "unknown config key 'model.dmodel'"),
])
def test_cli_flags_and_overrides_are_one_line(tmp_path, capsys, args, status, match):
    run = fake_run(tmp_path / "run")
    before = tree(tmp_path)
    assert main([str(run), str(tmp_path / "out"), *args]) == status
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert match in err, err
    assert tree(tmp_path) == before


def test_cli_run_paths_are_one_line(tmp_path, capsys):
    """A missing run, a file, a folder without config.yaml, a run without checkpoints, a model no family
    exports, the run's own directory or the model it was imported from as the target."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "folder").mkdir()
    nockpt = fake_run(tmp_path / "nockpt")
    empty = fake_run(tmp_path / "empty")
    (empty / "checkpoints").mkdir()
    llama = fake_run(tmp_path / "llama", "model.style=llama", "model.bias=true")
    imported = fake_run(tmp_path / "imported")
    source = tmp_path / "source"
    source.mkdir()
    saved = yaml.safe_load((imported / "config.yaml").read_text())
    saved["model"]["init_from"] = f"hf:{source}"
    (imported / "config.yaml").write_text(yaml.safe_dump(saved))
    (source / "config.json").write_text("{}")
    out = str(tmp_path / "out")
    for args, status, match in [
        ([str(tmp_path / "nothing"), out], 2, "nothing is not a run directory (it does not exist)"),
        ([str(tmp_path / "file"), out], 2, "file is not a run directory (it is a file)"),
        ([str(tmp_path / "folder"), out], 2, "is not a run directory (no config.yaml)"),
        ([str(nockpt), out, "parallel.data=8"], 1, "checkpoints does not exist: the run holds no checkpoint"),
        ([str(empty), out, "parallel.data=8"], 1, "checkpoints holds no complete checkpoint"),
        ([str(llama), out], 2, "model.bias=True cannot be exported"),
        ([str(nockpt), str(nockpt), "--overwrite"], 2, "is the run directory"),
        ([str(imported), str(source), "--overwrite"], 2, "is the Hugging Face model this run was imported from"),
        ([str(nockpt), str(source)], 2, "holds a model jaxpar did not export"),
        ([f"hf:{source}", out], 2, "source has no tokenizer.json: give data.tokenizer=PATH"),
        ([f"hf:{tmp_path / 'folder'}", out], 2, "folder has no config.json"),
        (["hf:", out], 2, "hf: names no folder; give hf:DIR"),
    ]:
        before = tree(tmp_path)
        assert main(args) == status, args
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and match in err, (args, err)
        assert tree(tmp_path) == before, args


def test_max_positions_key():
    assert load_config(None, ["model.seq_len=64"]).model.resolved().max_positions == 64  # 0: model.seq_len
    assert load_config(None, ["model.max_positions=1024", "model.seq_len=64"]).model.resolved().max_positions == 1024
    for args, match in [(["model.max_positions=32", "model.seq_len=64"], "seq_len=64 exceeds model.max_positions=32"),
                        (["model.max_positions=-1"], "model.max_positions=-1 is out of range")]:
        with pytest.raises(ConfigError, match=match):
            load_config(None, args)


def test_learned_table_is_max_positions_and_import_keeps_it(tmp_path, tiny):
    """A model with a position table longer than its training context exports n_positions = the table;
    imported, that is model.max_positions (a config.json key the command line may not contradict), the
    table read whole, and model.seq_len at most that."""
    trainer = Trainer(load_config(None, [*TINY, "model.max_positions=40"]), 1)
    assert trainer.adapter.abstract["pos_embed"].shape == (40, 32)
    params = random_params(trainer)
    hf.export(trainer, params, tmp_path / "m", run="run")
    conf = json.loads((tmp_path / "m" / "config.json").read_text())
    assert conf["n_positions"] == 40 and conf["n_ctx"] == 40
    init = f"model.init_from=hf:{tmp_path / 'm'}"
    cfg = load_config(None, [init, "model.seq_len=8", "data.tokenizer=byte"])
    assert (cfg.model.seq_len, cfg.model.max_positions) == (8, 40)
    assert load_config(None, [init, "data.tokenizer=byte"]).model.seq_len == 40
    again = Trainer(cfg, 1)
    np.testing.assert_array_equal(np.asarray(hf.load_params(again, tmp_path / "m")["pos_embed"]),
                                  np.asarray(params["pos_embed"]))
    with pytest.raises(ConfigError, match="model.max_positions=16 contradicts"):
        load_config(None, [init, "model.max_positions=16", "data.tokenizer=byte"])
    with pytest.raises(ConfigError, match="model.seq_len=64 exceeds the 40 learned positions"):
        load_config(None, [init, "model.seq_len=64", "data.tokenizer=byte"])


def test_mixtral_aux_loss_coefficient_maps_through_top_k_over_layers():
    """Hugging Face pools every layer's routing into one balance term and counts each choice rank apart
    (top_k x a layer's balance, tests/test_moe.py); jaxpar sums per-layer terms. Mixtral's
    ``router_aux_loss_coef`` c is therefore ``moe.aux_loss_weight`` = c * top_k / L (hand values: c = 0.02,
    top-2 of 8, 4 layers -> 0.01), and the export writes the inverse (0.01 -> 0.02)."""
    cfg = load_config(None, ["model.arch=moe", "model.style=llama", "model.n_layers=4", "model.d_model=32",
                             "model.n_heads=4", "moe.n_experts=8", "moe.top_k=2", "moe.aux_loss_weight=0.01",
                             f"model.vocab_size={V}", f"model.seq_len={T}"])
    exported = hf.hf_config(cfg)
    assert exported["router_aux_loss_coef"] == pytest.approx(0.02)
    from jaxpar.hf_config import config_keys

    _, soft = config_keys({**exported, "router_aux_loss_coef": 0.02, "num_hidden_layers": 4, "num_experts_per_tok": 2})
    assert soft["moe.aux_loss_weight"] == pytest.approx(0.01)
    _, soft = config_keys({**exported, "router_aux_loss_coef": 0.03, "num_hidden_layers": 6, "num_experts_per_tok": 1})
    assert soft["moe.aux_loss_weight"] == pytest.approx(0.005)


def test_rope_context_is_kept_by_the_import_and_written_by_the_export():
    """RoPE has no position table: model.max_positions is the context the model is made for. An import keeps the
    checkpoint's max_position_embeddings (131072, a Llama 3.x), the user may change it, and the export writes it,
    not the training context (model.seq_len, 64 here), unless that is longer (context extension)."""
    from jaxpar.hf_config import config_keys

    base = ["model.style=llama", "model.n_layers=2", "model.d_model=32", "model.n_heads=4", f"model.vocab_size={V}"]
    made = load_config(None, [*base, "model.seq_len=64", "model.max_positions=131072"])
    assert made.model.resolved().max_positions == 131072
    exported = hf.hf_config(made)
    assert exported["max_position_embeddings"] == 131072
    hard, soft = config_keys(exported)
    assert soft["model.max_positions"] == 131072 and "model.max_positions" not in hard  # the user may change it
    assert load_config(None, [*base, "model.seq_len=64"]).model.resolved().max_positions == 64  # 0 = seq_len
    assert hf.hf_config(load_config(None, [*base, "model.seq_len=64"]))["max_position_embeddings"] == 64
    longer = load_config(None, [*base, "model.seq_len=256", "model.max_positions=128"])  # trained past it
    assert hf.hf_config(longer)["max_position_embeddings"] == 256
