"""The compiled program emits the collectives the theory predicts (counted by hand), no more."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import config, trainer
from jaxpar import hlo
from jaxpar.mesh import make_mesh
from jaxpar.partitioning import make_rules, use_rules
from jaxpar.trainer import ModelAdapter
from jaxpar.models.gpt import Block

F32 = 4


def _kinds(report):
    return {k: v for k, v in report["collectives"].items() if isinstance(v, dict) and v["count"]}


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_megatron_block_forward_has_one_allreduce_per_sublayer(style):
    """tensor=4 x data=2, no ZeRO: one transformer block forward = 2 all-reduces over `tensor`
    (after attention-out and after MLP-down), each of the [local batch, T, d_model] activation."""
    cfg = config(style, parallel__data=2, parallel__tensor=4)
    m = cfg.model.resolved()
    mesh = make_mesh(cfg.parallel, jax.devices()[:8])
    rules = make_rules(cfg.parallel, mesh)
    adapter = ModelAdapter(lambda: Block(m, rngs=nnx.Rngs(0)))
    params = jax.tree.map(
        lambda a, ax: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rules.params.sharding(ax, a.shape)),
        adapter.abstract, adapter.axes)
    b, t = 8, m.seq_len
    x = jax.ShapeDtypeStruct((b, t, m.d_model), jnp.float32, sharding=rules.params.sharding(("batch", "length", "act_embed")))

    def fwd(p, x):
        with use_rules(rules):
            return adapter.model(p)(x, jnp.arange(t))

    rep = hlo.compile_report(jax.jit(fwd).lower(params, x).compile(), dict(mesh.shape))
    kinds = _kinds(rep)
    assert set(kinds) == {"all-reduce"}, kinds
    ar = kinds["all-reduce"]
    assert ar["count"] == 2 and list(ar["by_axes"]) == ["tensor"], ar
    assert ar["bytes"] == 2 * (b // 2) * t * m.d_model * F32


def _param_bytes(t):
    return sum(int(np.prod(a.shape)) * F32 for a in jax.tree.leaves(t.adapter.abstract))


def test_data_parallel_allreduces_gradients_once():
    """data=8 (untied Llama): gradient all-reduce bytes = parameter bytes (+ the 4-byte loss); no
    all-gather of weights."""
    t = trainer(config("llama", parallel__data=8))
    kinds = _kinds(t.compile())
    assert set(kinds) == {"all-reduce"}, kinds
    ar = kinds["all-reduce"]
    assert list(ar["by_axes"]) == ["data"]
    assert abs(ar["bytes"] / _param_bytes(t) - 1) < 0.05, (ar["bytes"], _param_bytes(t))


def test_data_parallel_tied_embedding():
    """GPT-2 (tied): the table's gradient has two contributions (lookup, head) which XLA:CPU reduces
    separately, so the bytes are parameters + one table (GPU/TPU reassociate them into one)."""
    t = trainer(config("gpt2", parallel__data=8))
    ar = _kinds(t.compile())["all-reduce"]
    table = int(np.prod(t.adapter.abstract["embed"]["embedding"].shape)) * F32
    assert abs(ar["bytes"] / (_param_bytes(t) + table) - 1) < 0.01


def test_zero3_gathers_weights_and_reduces_gradients_over_data():
    t = trainer(config("llama", parallel__data=8, parallel__zero=3))
    kinds = _kinds(t.compile())
    ag = kinds["all-gather"]
    assert list(ag["by_axes"]) == ["data"]
    # every matrix (all parameters but the replicated norm scales) is gathered before use
    matrices = sum(int(np.prod(a.shape)) * F32 for a, ax in zip(jax.tree.leaves(t.adapter.abstract),
                   jax.tree.leaves(t.adapter.axes, is_leaf=lambda x: isinstance(x, tuple))) if "embed" in ax
                   and "norm" not in ax)
    assert ag["bytes"] >= matrices
    assert ag["bytes"] <= 2 * matrices  # at most once forward and once again for the backward
    # gradients are reduced over data and kept sharded: reduce-scatter on GPU/TPU; XLA:CPU emits the
    # same reduction as an all-reduce followed by a slice.
    red = kinds.get("reduce-scatter", {"bytes": 0}), kinds.get("all-reduce", {"bytes": 0})
    assert sum(r["bytes"] for r in red) >= _param_bytes(t) * (1 / 8)
    assert "data" in set(kinds.get("reduce-scatter", {}).get("by_axes", {})) | set(kinds["all-reduce"]["by_axes"])


def test_zero1_gathers_updated_parameters():
    """zero=1: gradients all-reduced as in DP; each updated matrix shard is all-gathered once."""
    t = trainer(config("llama", parallel__data=8, parallel__zero=1))
    kinds = _kinds(t.compile())
    assert abs(kinds["all-reduce"]["bytes"] / _param_bytes(t) - 1) < 0.05
    ag = kinds["all-gather"]
    assert ag["static_count"] == ag["count"]  # outside the layer loop: once per step
    assert ag["bytes"] <= _param_bytes(t)


def test_tensor_parallel_never_gathers():
    """tensor=8: no all-gather / all-to-all at all, so the vocab-parallel logits are never gathered."""
    t = trainer(config("gpt2", parallel__tensor=8))
    kinds = _kinds(t.compile())
    assert set(kinds) == {"all-reduce"}, kinds
    cfg = t.cfg
    logits = cfg.train.batch_size * cfg.model.seq_len * t.adapter.abstract["embed"]["embedding"].shape[0] * F32
    # the largest all-reduce is an activation [B, T, d_model] (here 1/4 of the logits), never logits
    assert kinds["all-reduce"]["max_bytes"] == cfg.train.batch_size * cfg.model.seq_len * cfg.model.d_model * F32
    assert kinds["all-reduce"]["max_bytes"] < logits


# --- the HLO reader itself, on hand-written programs -------------------------------------------

HLO = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]) parameter(0)
  %x = f32[4,8]{1,0} get-tuple-element(%p), index=1
  %ar = f32[4,8]{1,0} all-reduce(%x), replica_groups=[2,4]<=[8], to_apply=%add
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[4,8]) tuple(%i, %ar)
}

%cond (p: (s32[], f32[4,8])) -> pred[] {
  %p = (s32[], f32[4,8]) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: f32[4,8]) -> f32[16,8] {
  %x = f32[4,8]{1,0} parameter(0)
  %z = s32[] constant(0)
  %t = (s32[], f32[4,8]) tuple(%z, %x)
  %w = (s32[], f32[4,8]) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %y = f32[4,8]{1,0} get-tuple-element(%w), index=1
  %ag = f32[16,8]{1,0} all-gather(%y), replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_1'}, dimensions={0}
  %cp = f32[4,8]{1,0} collective-permute(%y), source_target_pairs={{0,1},{1,0},{2,3},{3,2}}
  ROOT %rs = f32[2,8]{1,0} reduce-scatter(%y), replica_groups={{0,2},{1,3},{4,6},{5,7}}, dimensions={0}, to_apply=%add
}
"""


def test_hlo_reader_counts_loops_bytes_and_axes():
    mesh = {"data": 2, "tensor": 4}  # device d = 4*data + tensor
    c = hlo.collectives(HLO, mesh)
    ar = c["all-reduce"]
    assert (ar["count"], ar["static_count"], ar["bytes"]) == (5, 1, 5 * 4 * 8 * 4)
    # groups {0..3},{4..7}; on the wire a 4-device all-reduce sends 2 * 3/4 of the array
    assert ar["by_axes"] == {"tensor": {"count": 5, "bytes": 640, "wire_bytes": 960.0}}
    # device_ids [2,4]T(1,0) = [[0,4],[1,5],[2,6],[3,7]] as mesh [4,2], grouped on axis_1 -> {d, d+4}
    assert c["all-gather"]["by_axes"] == {"data": {"count": 1, "bytes": 16 * 8 * 4, "wire_bytes": 256.0}}
    assert c["collective-permute"]["by_axes"] == {"tensor": {"count": 1, "bytes": 128, "wire_bytes": 128.0}}
    # a 2-device reduce-scatter sends the other device's half: (2-1) x the 64-byte shard
    assert c["reduce-scatter"]["by_axes"] == {"tensor": {"count": 1, "bytes": 64, "wire_bytes": 64.0}}
    assert c["reduce-scatter"]["operand_bytes"] == 128
    assert not c["unknown_trip_count"]


def test_replica_group_notations():
    assert hlo.replica_groups("replica_groups=[2,4]<=[4,2]T(1,0)", 8) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert hlo.replica_groups("replica_groups={}", 4) == [[0, 1, 2, 3]]
    g = hlo.replica_groups("replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_2'}", 8)
    assert g == [[0, 1, 2, 3], [4, 5, 6, 7]]
