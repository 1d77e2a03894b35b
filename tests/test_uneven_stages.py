"""Uneven pipeline stages (``parallel.stage_layers``, or a layer count the stages do not divide): the split,
the padded storage order (by hand), every schedule equal to one device, MoE with dense first layers and
moving routing biases, checkpoints, Hugging Face import / export and generation across layouts, and the
errors."""

import math

import jax
import numpy as np
import pytest

from helpers import (assert_params_close, assert_trees_close, batches, check_moe_against_reference, config,
                     first_step, per_microbatch_reference, reference, rel_err, run, trainer)
from jaxpar.checkpoint import Checkpointer
from jaxpar.config import ConfigError
from jaxpar.generate import Sampling, for_trainer
from jaxpar.layers.stack import layer_positions, storage_order
from jaxpar.partitioning import layer_groups, stack_slots


def test_default_split_takes_one_layer_from_the_ends_inwards():
    """Published layouts, by hand: Llama 3 405B's 126 layers on 16 stages are 7 + 14 x 8 + 7 (the first and
    last stage hold one fewer); DeepSeek-V3's 58 MoE layers on 16 stages, 6 short stages; divisible counts
    are even; explicit counts are kept."""
    assert layer_groups(126, 16) == (7,) + (8,) * 14 + (7,)
    assert layer_groups(58, 16) == (3, 3, 3) + (4,) * 10 + (3, 3, 3)
    assert layer_groups(5, 2) == (2, 3) and layer_groups(7, 2, 2) == (1, 2, 2, 2)
    assert layer_groups(8, 4) == (2,) * 4 and layer_groups(6, 2, 1, (2, 4)) == (2, 4)
    assert stack_slots(126, 16) == 128 and stack_slots(7, 2, 2) == 8 and stack_slots(9, 1) == 9


def test_padded_storage_order_by_hand():
    """Storage position p holds layer ORDER[p] or -1 (padding): 5 layers on 2 stages as 2 + 3 are stored in
    2 x 3 slots; 7 layers on pipe=2 x repeats=2 as 1 + 2 + 2 + 2 (groups in layer order: stage 0's chunk 0,
    stage 1's chunk 0, stage 0's chunk 1, stage 1's chunk 1), stage-major, each group in 2 slots."""
    assert list(storage_order(5, 2, 1, (2, 3))) == [0, 1, -1, 2, 3, 4]
    order = storage_order(7, 2, 2, (1, 2, 2, 2))
    assert list(order) == [0, -1, 3, 4, 1, 2, 5, 6]
    assert list(layer_positions(order)) == [0, 4, 5, 2, 3, 6, 7]
    assert list(storage_order(4, 2, 1, (2, 2))) == [0, 1, 2, 3]  # even: layer order, no padding


def _in_layer_order(t, tree):
    """Stacked leaves from ``t``'s storage order (padded) back to layer order (by :func:`layer_positions`, checked
    by hand above)."""
    def back(a, ax):
        if ax[:1] != ("layers",):
            return a
        return np.asarray(a)[layer_positions(t.layer_order(sum(t.groups) if t.groups else a.shape[0]))]

    return jax.tree.map(back, tree, t.adapter.axes, is_leaf=lambda x: isinstance(x, np.ndarray))


CASES = {  # (style, layers, layout): each schedule, with data / tensor / seq, explicit and default splits
    "gpipe-5": ("gpt2", 5, dict(parallel__pipe=2, parallel__data=2)),
    "1f1b-5-tensor": ("llama_gqa", 5, dict(parallel__pipe=2, parallel__tensor=2, parallel__microbatches=4,
                                           parallel__pipeline_schedule="1f1b")),
    "1f1b-7-pipe4": ("gpt2", 7, dict(parallel__pipe=4, parallel__pipeline_schedule="1f1b", parallel__data=2)),
    "circular-7": ("llama_gqa", 7, dict(parallel__pipe=2, parallel__pipeline_repeats=2, parallel__microbatches=2)),
    "interleaved-7-seq": ("llama_gqa", 7, dict(parallel__pipe=2, parallel__pipeline_repeats=2, parallel__seq=2,
                                               parallel__pipeline_schedule="1f1b")),
    "explicit-1,5": ("gpt2", 6, dict(parallel__pipe=2, parallel__stage_layers="1,5", parallel__tensor=2,
                                     parallel__pipeline_schedule="1f1b")),
    # Gemma 3's per-layer windows (local, local, global...) follow the layers into the padded storage
    "gemma3-windows": ("gemma3", 5, dict(parallel__pipe=2, parallel__microbatches=4)),
    # ZB-V's storage (stage s: groups s and 2S-1-s), padded, with the windows; on pipe 4 with data
    "zb_v-7-windows": ("gemma3", 7, dict(parallel__pipe=2, parallel__pipeline_repeats=2, parallel__microbatches=2,
                                         parallel__pipeline_schedule="zb_v")),
    "zb_v-9-pipe4": ("gpt2", 9, dict(parallel__pipe=4, parallel__pipeline_repeats=2, parallel__microbatches=8,
                                     parallel__data=2, parallel__pipeline_schedule="zb_v")),
    # the forwards' residuals kept (parallel.stage_remat=false): a padding slot's residuals are the microbatch's too
    "1f1b-5-tensor-kept": ("llama_gqa", 5, dict(parallel__pipe=2, parallel__tensor=2, parallel__microbatches=4,
                                                parallel__pipeline_schedule="1f1b", parallel__stage_remat=False,
                                                model__remat="none")),
    "zb_v-7-windows-kept": ("gemma3", 7, dict(parallel__pipe=2, parallel__pipeline_repeats=2, parallel__microbatches=2,
                                              parallel__pipeline_schedule="zb_v", parallel__stage_remat=False)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_grads_equal_one_device(case):
    style, n, layout = CASES[case]
    ref = first_step(config(style, model__n_layers=n))
    got = first_step(config(style, model__n_layers=n, **layout))
    t = got["trainer"]
    assert t.groups is not None and sum(t.groups) == n and len(set(t.groups)) > 1
    assert rel_err(got["loss"], ref["loss"]) <= 1e-5, (got["loss"], ref["loss"])
    assert_trees_close(_in_layer_order(t, got["grads"]), ref["grads"], 1e-5, "grads ")
    params = jax.device_get(got["state"]["params"])
    assert_trees_close(_in_layer_order(t, params), jax.device_get(ref["state"]["params"]), 0.0, "init ")
    blocks = jax.tree.leaves(params["blocks"])
    pad = t.layer_order(n) < 0
    assert pad.any() and all(not np.any(a[pad]) for a in blocks)  # the padding slots hold zeros
    # each device holds max(groups) layer slots per group: the padded stack split over pipe
    s_ = t.sizes["pipe"]
    kernel = got["state"]["params"]["blocks"]["mlp"]["up"]["kernel"] if style != "gemma3" else None
    if kernel is not None:
        assert kernel.shape[0] == len(t.groups) * max(t.groups)
        assert kernel.sharding.shard_shape(kernel.shape)[0] == kernel.shape[0] // s_


MOE = dict(model__arch="moe", moe__n_experts=4, moe__top_k=2, moe__capacity_factor=2.0, moe__d_ff=64)


@pytest.mark.parametrize("sched, groups", [
    ("1f1b", (2, 3)), ("gpipe", (2, 3)),
    ("circular", (1, 1, 2, 1)),  # 5 groups on 2 stages x 2 repeats
])
def test_moe_with_dense_first_layers_and_router_losses_equals_one_device_per_microbatch(sched, groups):
    """DeepSeek's shape: one dense first layer (the lead-in: on the first stage after the embedding, per
    microbatch, its backward too), 5 MoE groups uneven on pipe=2 (1F1B, GPipe, circular), expert=2, the
    router losses on: loss, router metrics (over the 5 real layers, not the padding) and gradients equal one
    device running the 4 microbatches one at a time."""
    model = dict(MOE, model__n_layers=6, moe__first_dense=1)
    ref = per_microbatch_reference("gpt2", 4, **model)
    layout = dict(parallel__pipeline_schedule="1f1b") if sched == "1f1b" else (
        dict(parallel__pipeline_repeats=2) if sched == "circular" else {})
    cfg = config("gpt2", **model, parallel__pipe=2, parallel__expert=2, parallel__microbatches=4, **layout)
    got = first_step(cfg)
    t = got["trainer"]
    assert t.groups == groups
    check_moe_against_reference(cfg, got["loss"], got["aux"], _in_layer_order(t, got["grads"]), ref)


def test_moe_routing_bias_moves_as_on_one_device():
    """Three AdamW steps with the routing bias balanced each step (``moe.bias_update_rate``): the per-layer
    loads come out of the pipeline in layer order and go back to the padded storage order for the update;
    the parameters, biases included, equal one device's (router losses off, nothing dropped: exact)."""
    model = dict(MOE, model__n_layers=5, moe__score="sigmoid", moe__bias_update_rate=0.01, moe__aux_loss_weight=0.0,
                 moe__z_loss_weight=0.0, parallel__pipe=2, parallel__data=2)
    got = run(config("gpt2", **model, parallel__pipeline_repeats=2, parallel__microbatches=2))
    ref = reference("gpt2", **{k: v for k, v in model.items() if not k.startswith("parallel")})
    t = trainer(config("gpt2", **model, parallel__pipeline_repeats=2, parallel__microbatches=2))
    assert t.groups == (1, 1, 2, 1)  # 3 short groups: the first, the last, the second
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5)
    params = _in_layer_order(t, got["params"])
    bias, ref_bias = params["blocks"]["moe"]["mlp"]["router_bias"], ref["params"]["blocks"]["moe"]["mlp"]["router_bias"]
    assert np.any(ref_bias != 0) and np.allclose(bias, ref_bias, atol=1e-6)
    assert_params_close(params, ref["params"])


def test_checkpoint_is_layer_order_and_restores_on_other_layouts(tmp_path):
    """Two steps on pipe=2 x data=2 with 5 layers (2 + 3, stored in 6 slots), saved: the checkpoint holds the
    5 layers in layer order (restored on one device they are the one-device run's parameters after the same
    two steps), and restored on pipe=3 with ``parallel.stage_layers=2,2,1`` under 1F1B (M = 4) the run continues with
    the uninterrupted run's losses."""
    model = dict(model__n_layers=5, train__steps=6, train__warmup_steps=2)
    cfg = config("gpt2", **model, parallel__pipe=2, parallel__data=2)
    t = trainer(cfg)
    bs = batches(cfg, 4)
    state = t.init_state()
    for b in bs[:2]:
        state, _ = t.step(state, t.place_batch(b))
    ck = Checkpointer(tmp_path / "ck", keep=2)
    ck.save(2, t.state_to_layer_order(state), {"step": 2}, cfg.to_dict())
    ck.wait()
    want = []
    for b in bs[2:]:
        state, m = t.step(state, t.place_batch(b))
        want.append(float(m["loss"]))

    # the layer-order state's unpadded 5-layer dims cannot split over pipe: pipe moves to another dim, so a device
    # holds no more of it than of the training state (copied over pipe it would hold 5 layers, not 3 slots)
    held = {k: sum(math.prod(a.sharding.shard_shape(a.shape)) for a in jax.tree.leaves(tree["params"]))
            for k, tree in (("stored", t.abstract_state), ("checkpoint", t.abstract_layer_state))}
    assert held["checkpoint"] <= held["stored"], held
    one = trainer(config("gpt2", **model), 1)
    restored, _, _ = ck.restore(2, one.abstract_layer_state)
    ref = one.init_state()
    for b in bs[:2]:
        ref, _ = one.step(ref, one.place_batch(b))
    assert_params_close(jax.device_get(restored["params"]), jax.device_get(ref["params"]))

    other = trainer(config("gpt2", **model, parallel__pipe=3, parallel__stage_layers="2,2,1", parallel__microbatches=4,
                           parallel__pipeline_schedule="1f1b"))
    assert other.groups == (2, 2, 1)
    st, _, _ = ck.restore(2, other.abstract_layer_state, None)
    ck.close()
    st = other.state_from_layer_order(st)
    got = []
    for b in bs[2:]:
        st, m = other.step(st, other.place_batch(b))
        got.append(float(m["loss"]))
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("layout", [dict(parallel__pipe=2, parallel__data=2),
                                    dict(parallel__pipe=2, parallel__pipeline_repeats=2, parallel__tensor=2),
                                    dict(parallel__pipe=2, parallel__pipeline_repeats=2, parallel__tensor=2,
                                         parallel__pipeline_schedule="zb_v")],
                         ids=["uneven", "circular", "zb_v"])
def test_generation_runs_the_layers_in_layer_order(layout):
    """Generation scans the stacked layers: from a padded (uneven) or stage-major (circular) storage order it
    gets them in layer order first (``Trainer.params_in_layer_order``), so its greedy tokens are one device's."""
    n = 5 if "parallel__pipeline_repeats" not in layout else 4
    prompts = [[1, 2, 3], [4, 5]]
    out = []
    for lay in ({}, layout):
        t = trainer(config("llama_gqa", model__n_layers=n, **lay))
        out.append(for_trainer(t)(t.init_state()["params"], prompts, 6, Sampling(temperature=0.0)))
    assert out[0] == out[1]


@pytest.mark.parametrize("over, needle", [
    (dict(parallel__pipe=2, parallel__stage_layers="2,2,1"), "one count >= 1 per group of parallel.pipe = 2"),
    (dict(parallel__pipe=2, parallel__stage_layers="1,2"), "summing to the 4 stacked layers"),
    (dict(parallel__pipe=2, parallel__stage_layers="0,4"), "one count >= 1"),
    (dict(parallel__pipe=2, parallel__stage_layers="2;2"), "expected comma-separated layer counts"),
    (dict(parallel__stage_layers="2,2"), "no effect with parallel.pipe=1"),
    (dict(parallel__pipe=8, model__n_layers=4, parallel__microbatches=8), "fewer than the parallel.pipe = 8"),
])
def test_bad_stage_layers_name_the_key(over, needle):
    with pytest.raises(ConfigError, match="parallel.stage_layers|parallel.pipe") as e:
        trainer(config("gpt2", **{"model__n_layers": 4, **over}))
    assert needle in str(e.value), str(e.value)
