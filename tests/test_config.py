"""Configuration, mesh and partitioning errors: one clear message naming the key and valid values."""

import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from helpers import config, trainer
from jaxpar.config import ConfigError, config_table, load_config, parse_override
from jaxpar.mesh import AXES, _dcn_split, axis_sizes, make_mesh, request_cpu_devices
from jaxpar.partitioning import Rules, make_rules


def test_overrides_and_yaml(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model:\n  d_model: 96\n  n_heads: 6\ntrain:\n  lr: 0.001\n")
    cfg = load_config(f, ["train.lr=2e-4", "model.style=llama", "parallel.data=-1", "model.bias=true"])
    assert (cfg.model.d_model, cfg.model.n_heads, cfg.train.lr, cfg.model.style) == (96, 6, 2e-4, "llama")
    r = cfg.model.resolved()
    assert (r.positions, r.norm, r.mlp, r.tie_embeddings, r.bias, r.head_dim) == ("rope", "rmsnorm", "swiglu",
                                                                                  False, True, 16)
    assert r.d_ff == 256  # 8/3 * 96 = 256, rounded up to 64
    assert parse_override("a.b=[1, 2]") == ("a.b", [1, 2])


@pytest.mark.parametrize("over, needle", [
    (["parallel.tensr=2"], "did you mean parallel.tensor"),
    (["modle.d_model=2"], "did you mean model"),
    (["parallel.data=0"], "parallel.data=0 must be a positive integer"),
    (["parallel.tensor=-2"], "parallel.tensor=-2 must be a positive integer"),
    (["parallel.data=-1", "parallel.tensor=-1"], "only one parallel axis may be -1"),
    (["parallel.zero=2"], "choose one of 0, 1, 3"),
    (["model.style=bert"], "choose one of gpt2, llama"),
    (["model.remat=some"], "choose one of none, full, save_dots"),
    (["train.steps=ten"], "train.steps='ten': expected int"),
    (["model.n_heads=4", "model.n_kv_heads=3"], "model.n_kv_heads=3 must divide model.n_heads=4"),
    (["train.batch_size=10", "train.grad_accum=4"], "not divisible by train.grad_accum=4"),
    (["model"], "must look like section.key=value"),
    (["checkpoint.keep=0"], "checkpoint.keep=0 is out of range: it must be >= 1"),
    (["checkpoint.resume=yes"], "choose one of auto, required, never"),
    (["train.max_bad_steps=0"], "train.max_bad_steps=0 is out of range: it must be >= 1"),
    # every numeric key has a range, named in the message
    (["train.beta1=1.0"], "train.beta1=1.0 is out of range: it must be [0, 1)"),
    (["train.beta2=-0.1"], "train.beta2=-0.1 is out of range: it must be [0, 1)"),
    (["train.eps=-1e-8"], "train.eps=-1e-08 is out of range: it must be > 0"),
    (["train.lr=0"], "train.lr=0.0 is out of range: it must be > 0"),
    (["model.norm_eps=-1e-5"], "model.norm_eps=-1e-05 is out of range: it must be > 0"),
    (["model.init_std=0"], "model.init_std=0.0 is out of range: it must be > 0"),
    (["model.rope_theta=-5"], "model.rope_theta=-5.0 is out of range: it must be > 0"),
    (["data.val_fraction=0.9"], "data.val_fraction=0.9 is out of range: it must be (0, 0.5]"),
    (["train.seed=-3"], "train.seed=-3 is out of range: it must be >= 0"),
    (["train.min_lr_ratio=2"], "train.min_lr_ratio=2.0 is out of range: it must be [0, 1]"),
    (["moe.capacity_factor=0"], "moe.capacity_factor=0.0 is out of range: it must be > 0"),
    (["sample.temperature=-1"], "sample.temperature=-1.0 is out of range: it must be >= 0"),
    (["distributed.process_id=-2"], "distributed.process_id=-2 is out of range: it must be >= -1"),
    # nonsense that used to be accepted
    (["train.out_dir="], "train.out_dir is empty"),
    (["parallel.microbatches=4"], "parallel.microbatches=4 has no effect with parallel.pipe=1"),
    (["parallel.pipeline_repeats=2"], "parallel.pipeline_repeats=2 has no effect with parallel.pipe=1"),
    (["parallel.pipe=2", "parallel.pipeline_schedule=zb_h1", "parallel.pipeline_repeats=2"],
     "parallel.pipeline_schedule=zb_h1 runs one chunk of layers per stage: it needs parallel.pipeline_repeats=1"),
    (["parallel.pipe=2", "parallel.seq=2", "parallel.pipeline_schedule=zb_h1"],
     "parallel.pipeline_schedule=zb_h1 with parallel.seq > 1 needs parallel.seq_attention=all_gather or ulysses"),
    (["parallel.pipe=2", "parallel.pipeline_schedule=zb_v", "parallel.pipeline_repeats=1"],
     "parallel.pipeline_schedule=zb_v runs two chunks of layers per stage (down the stages and back up): it needs "
     "parallel.pipeline_repeats=2; got 1"),
    (["parallel.pipeline_schedule=zb"], "parallel.pipeline_schedule='zb' is not a valid choice; choose one of gpipe, "
     "1f1b, zb_h1, zb_v"),
    (["debug.nan_steps=3,x"], "debug.nan_steps='3,x': expected comma-separated step numbers"),
    (["distributed.num_processes=2", "distributed.process_id=2"], "distributed.process_id=2 must be < "),
    (["model=3"], "model is a section"),
    # token stores
    (["data.source=tokens"], "data.source=tokens needs data.path (a token store folder) or data.mix"),
    (["data.mix=a:1"], "data.mix mixes token stores: it needs data.source=tokens (got data.source=synthetic)"),
    (["data.source=tokens", "data.mix=a:1", "data.path=b"], "data.mix and data.path both name the data"),
    (["data.prefetch=-1"], "data.prefetch=-1 is out of range: it must be >= 0"),
])
def test_bad_config_values(over, needle):
    with pytest.raises(ConfigError, match=None) as e:
        load_config(None, over)
    assert needle in str(e.value), str(e.value)


def test_zb_v_takes_its_two_chunks_when_pipeline_repeats_is_unset(tmp_path):
    """ZB-V runs two chunks per stage and nothing else: an unset ``parallel.pipeline_repeats`` becomes 2 (from
    the command line or a YAML file); an explicit other value is still an error, and with pipe=1 the message
    names the schedule, which the user set, not the implied repeats."""
    cfg = load_config(None, ["parallel.pipe=2", "parallel.pipeline_schedule=zb_v"])
    assert cfg.parallel.pipeline_repeats == 2
    f = tmp_path / "zb.yaml"
    f.write_text("parallel:\n  pipe: 4\n  pipeline_schedule: zb_v\n  microbatches: 8\n")
    assert load_config(f).parallel.pipeline_repeats == 2
    assert load_config(f, ["parallel.pipeline_schedule=1f1b"]).parallel.pipeline_repeats == 1
    with pytest.raises(ConfigError, match="it needs parallel.pipeline_repeats=2; got 3"):
        load_config(f, ["parallel.pipeline_repeats=3"])
    with pytest.raises(ConfigError, match="parallel.pipeline_schedule=zb_v has no effect with parallel.pipe=1"):
        load_config(None, ["parallel.pipeline_schedule=zb_v"])


@pytest.mark.parametrize("over, needle", [
    (dict(parallel__tensor=3, parallel__data=2), "parallel.tensor=3 does not divide model.n_heads=8"),
    # tensor=2 neither divides 3 KV heads nor is a multiple of them (tensor=8 over 4 KV heads copies each: fine)
    (dict(parallel__tensor=2, parallel__data=2, model__n_heads=12, model__n_kv_heads=3, model__head_dim=16,
          model__style="llama"), "neither divides model.n_kv_heads=3"),
    (dict(parallel__tensor=4, model__d_ff=6), "model.d_ff=6"),
    (dict(parallel__data=8, train__batch_size=12), "not divisible by the batch-parallel size data*expert=8"),
    (dict(parallel__data=8, parallel__zero=3, model__d_model=36, model__n_heads=4), "does not divide model.d_model=36"),
])
def test_model_does_not_fit_mesh(over, needle):
    cfg = config("gpt2", **over)
    with pytest.raises(ConfigError) as e:
        trainer(cfg)
    assert needle in str(e.value), str(e.value)


def test_mesh_size_mismatch_and_minus_one():
    cfg = config("gpt2", parallel__data=4, parallel__tensor=4)
    with pytest.raises(ConfigError, match="needs 16 devices but 8 are available"):
        make_mesh(cfg.parallel, jax.devices())
    cfg = config("gpt2", parallel__data=-1, parallel__tensor=2)
    mesh = make_mesh(cfg.parallel, jax.devices())
    assert tuple(mesh.axis_names) == AXES == ("data", "pipe", "expert", "seq", "tensor")
    assert dict(mesh.shape) == {"data": 4, "pipe": 1, "expert": 1, "seq": 1, "tensor": 2}
    # tensor is innermost: neighbouring device ids form a tensor group
    assert [d.id for d in mesh.devices[0, 0, 0, 0, :]] == [0, 1]
    with pytest.raises(ConfigError, match="do not divide the 8 devices"):
        axis_sizes(config("gpt2", parallel__data=-1, parallel__tensor=3).parallel, 8)


def test_hybrid_mesh_puts_hosts_on_outer_axes():
    sizes = {"data": 4, "pipe": 2, "expert": 1, "seq": 1, "tensor": 8}
    assert _dcn_split(sizes, 8) == {"data": 4, "pipe": 2, "expert": 1, "seq": 1, "tensor": 1}
    assert _dcn_split(sizes, 2) == {"data": 2, "pipe": 1, "expert": 1, "seq": 1, "tensor": 1}
    with pytest.raises(ConfigError, match="cannot lay 3 hosts"):
        _dcn_split(sizes, 3)


def test_rules_errors_and_table():
    mesh = make_mesh(load_config(None, ["parallel.data=2", "parallel.tensor=4"]).parallel, jax.devices())
    rules = make_rules(load_config(None, ["parallel.data=2", "parallel.tensor=4", "parallel.zero=3"]).parallel, mesh)
    assert rules.params.spec(("embed", "mlp")) == P("data", "tensor")
    assert rules.opt.spec(("embed", "mlp")) == P("data", "tensor")
    assert rules.compute.spec(("embed", "mlp")) == P(None, "tensor")
    assert rules.params.spec(("batch", "length", "act_embed")) == P("data")
    with pytest.raises(ConfigError, match="logical axis name 'emb' has no partitioning rule"):
        rules.params.spec(("emb",))
    with pytest.raises(ConfigError, match="both map to mesh axis 'tensor'"):
        rules.params.spec(("heads", "mlp"))
    with pytest.raises(ConfigError, match="not divisible by mesh axes tensor"):
        rules.params.spec(("mlp",), shape=(6,))
    table = rules.table()
    assert "embed" in table and "batch" in table and "tensor" in table
    with pytest.raises(ConfigError, match="both map"):
        Rules({"a": ("data",), "b": ("data",)}, mesh).spec(("a", "b"))


def test_zero1_rules_split_optimizer_state_only():
    rules = make_rules(load_config(None, ["parallel.data=8", "parallel.zero=1"]).parallel,
                       make_mesh(load_config(None, ["parallel.data=8"]).parallel, jax.devices()))
    assert rules.params.spec(("embed", "mlp")) == P()
    assert rules.opt.spec(("embed", "mlp")) == P("data")


def test_request_cpu_devices_too_late_is_clear():
    request_cpu_devices(len(jax.devices()))  # same count after start: fine
    with pytest.raises(RuntimeError, match="before any JAX computation"):
        request_cpu_devices(3)


def test_request_cpu_devices_before_start_works():
    code = ("from jaxpar.mesh import request_cpu_devices; request_cpu_devices(5); "
            "import jax; print(len(jax.devices()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"})
    assert out.stdout.strip() == "5"


def test_config_table_lists_every_key():
    table = config_table()
    for key in ("parallel.data", "parallel.tensor", "parallel.pipe", "parallel.expert", "parallel.seq",
                "parallel.zero", "model.n_layers", "model.d_model", "model.n_heads", "model.n_kv_heads",
                "model.d_ff", "model.vocab_size", "model.seq_len", "model.style", "train.steps", "train.seed",
                "train.batch_size", "train.log_every", "train.out_dir", "data.source", "debug.dump_hlo"):
        assert f"`{key}`" in table


def test_shipped_configs_load_and_fit_their_meshes():
    from pathlib import Path

    from jaxpar.mesh import axis_sizes
    from jaxpar.partitioning import check_model_fits

    files = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
    assert {f.stem for f in files} >= {"default", "gpt2_124m", "llama_1b", "long_run"}
    for f in files:
        cfg = load_config(f)
        fixed = [getattr(cfg.parallel, a) for a in AXES]
        sizes = axis_sizes(cfg.parallel, 64 if -1 in fixed else int(np.prod(fixed)))  # -1: e.g. 64 accelerators
        check_model_fits(cfg.model, cfg.parallel, sizes)


def test_distributed_plan_from_keys_environment_and_scheduler(monkeypatch):
    from jaxpar import distributed

    for var in ("JAXPAR_COORDINATOR", "JAXPAR_NUM_PROCESSES", "JAXPAR_PROCESS_ID", "SLURM_NTASKS",
                "SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(var, raising=False)
    d = config("gpt2").distributed
    assert distributed.plan(d) is None  # a plain single-process run
    keys = config("gpt2", distributed__coordinator="h:1", distributed__num_processes=4,
                  distributed__process_id=3).distributed
    p = distributed.plan(keys)
    assert (p.coordinator, p.num_processes, p.process_id, p.expected_processes()) == ("h:1", 4, 3, 4)
    monkeypatch.setenv("JAXPAR_COORDINATOR", "e:2")
    monkeypatch.setenv("JAXPAR_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAXPAR_PROCESS_ID", "1")
    assert (distributed.plan(d).coordinator, distributed.plan(d).process_id) == ("e:2", 1)
    assert distributed.plan(keys).coordinator == "h:1"  # keys win over the environment
    assert distributed.plan(config("gpt2", distributed__initialize="off").distributed) is None
    for var in ("JAXPAR_COORDINATOR", "JAXPAR_NUM_PROCESSES", "JAXPAR_PROCESS_ID"):
        monkeypatch.delenv(var)
    monkeypatch.setenv("SLURM_NTASKS", "16")  # auto-detected: JAX reads the rest from SLURM
    p = distributed.plan(d)
    assert (p.coordinator, p.num_processes, p.expected_processes()) == (None, None, 16)
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert distributed.plan(d) is None
    with pytest.raises(ConfigError, match="also needs distributed.num_processes"):
        distributed.plan(config("gpt2", distributed__coordinator="h:1").distributed)
    with pytest.raises(ConfigError, match="must be host:port"):
        distributed.plan(config("gpt2", distributed__coordinator="h", distributed__num_processes=2,
                                distributed__process_id=0).distributed)
    monkeypatch.setenv("JAXPAR_NUM_PROCESSES", "two")
    with pytest.raises(ConfigError, match="JAXPAR_NUM_PROCESSES='two' must be an integer"):
        distributed.plan(d)


# The README's key-table and Running-block tests moved to tests/test_docs.py with the table and the block.


def test_renamed_keys_still_work_for_one_release(tmp_path, capsys):
    """parallel.sequence_parallel (Megatron-SP) is now parallel.megatron_sp: the old name, as an
    override or in a YAML file, sets the new key and says so on stderr."""
    cfg = load_config(None, ["parallel.sequence_parallel=true", "parallel.tensor=2"])
    assert cfg.parallel.megatron_sp is True and not hasattr(cfg.parallel, "sequence_parallel")
    assert "parallel.sequence_parallel is now called parallel.megatron_sp" in capsys.readouterr().err
    (tmp_path / "old.yaml").write_text("parallel:\n  tensor: 2\n  sequence_parallel: true\n")
    assert load_config(tmp_path / "old.yaml").parallel.megatron_sp is True
    assert "now called parallel.megatron_sp" in capsys.readouterr().err
