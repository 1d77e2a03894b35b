"""Checkpoints in process: restore onto other meshes, skipped non-finite steps, unusable checkpoints."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from helpers import batches, config, trainer

from jaxpar.checkpoint import Checkpointer, CheckpointError

# 4 layers so that pipe=2 can also run circular (2 repeats of 1-layer groups).
MODEL = {"model__n_layers": 4, "train__steps": 6, "train__warmup_steps": 2}


def _steps(t, state, bs):
    losses = []
    for b in bs:
        state, m = t.step(state, t.place_batch(b))
        losses.append(float(m["loss"]))
    return state, losses


def _save(tmp_path, t, state, cfg, step):
    ck = Checkpointer(tmp_path / "ck", keep=2)
    ck.save(step, t.state_to_layer_order(state), {"step": step}, cfg.to_dict())
    ck.wait()
    return ck  # the caller closes it


@pytest.fixture(scope="session")  # session: kept while a worker runs tests of other modules
def saved_on_data8(tmp_path_factory):
    """2 steps on data=8 (ZeRO-1), saved; then 2 more steps uninterrupted (the reference losses)."""
    tmp = tmp_path_factory.mktemp("ck8")
    cfg = config("gpt2", parallel__data=8, parallel__zero=1, **MODEL)
    t = trainer(cfg)
    bs = batches(cfg, 4)
    state, _ = _steps(t, t.init_state(), bs[:2])
    _save(tmp, t, state, cfg, 2).close()
    _, later = _steps(t, state, bs[2:])
    return tmp / "ck", later, bs


@pytest.mark.parametrize("layout", [
    {"parallel__data": 2, "parallel__tensor": 4},
    {"parallel__pipe": 2, "parallel__data": 4, "parallel__pipeline_schedule": "1f1b"},
    {"parallel__pipe": 2, "parallel__data": 2, "parallel__tensor": 2, "parallel__pipeline_repeats": 2},
    {"parallel__data": 2, "parallel__tensor": 2, "parallel__zero": 3},  # 4 devices
    {"parallel__data": 2, "parallel__expert": 2, "parallel__seq": 2},
    # uneven stages (1 + 3 layers): stored padded to 2 x 3 slots, the checkpoint's 4 layers split over pipe by d_model
    {"parallel__pipe": 2, "parallel__data": 2, "parallel__tensor": 2, "parallel__stage_layers": "1,3",
     "parallel__pipeline_schedule": "1f1b"},
], ids=["data2xtensor4", "1f1b-pipe2xdata4", "circular-pipe2xdata2xtensor2", "4devices-zero3", "data2xexpert2xseq2",
        "uneven-1f1b-pipe2xdata2xtensor2"])
def test_restore_on_another_mesh_continues_the_same_losses(saved_on_data8, layout):
    directory, want, bs = saved_on_data8
    cfg = config("gpt2", **MODEL, **layout)
    t = trainer(cfg)
    ck = Checkpointer(directory)
    state, data, meta = ck.restore(2, t.abstract_layer_state, cfg.to_dict())
    ck.close()
    assert data == {"step": 2} and meta["step"] == 2 and int(state["step"]) == 2
    for leaf, target in zip(jax.tree.leaves(state), jax.tree.leaves(t.abstract_layer_state)):
        assert leaf.sharding == target.sharding  # read straight into this mesh's layout
    _, got = _steps(t, t.state_from_layer_order(state), bs[2:])
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_circular_pipeline_checkpoint_is_in_layer_order(tmp_path):
    """A circular pipeline stores layers stage-major; its checkpoint holds them in layer order, equal to
    the layer-ordered initial weights of a one-device run of the same seed."""
    cfg = config("gpt2", parallel__pipe=2, parallel__data=2, parallel__pipeline_repeats=2, **MODEL)
    t = trainer(cfg)
    state = t.init_state()
    ck = _save(tmp_path, t, state, cfg, 0)
    one = trainer(config("gpt2", **MODEL), 1)
    restored, _, _ = ck.restore(0, one.abstract_state)
    ck.close()
    np.testing.assert_array_equal(np.asarray(restored["params"]["blocks"]["mlp"]["up"]["kernel"]),
                                  np.asarray(one.init_state()["params"]["blocks"]["mlp"]["up"]["kernel"]))
    assert not np.array_equal(np.asarray(state["params"]["blocks"]["mlp"]["up"]["kernel"]),
                              np.asarray(restored["params"]["blocks"]["mlp"]["up"]["kernel"]))


def test_nonfinite_step_is_skipped_bit_exactly():
    """Step 1's gradients are NaN: parameters and optimizer state stay bit-identical, the step is
    counted, and the run continues exactly like a run that never saw batch 1."""
    cfg = config("gpt2", parallel__data=2, parallel__zero=1, debug__nan_steps="1")
    t = trainer(cfg)
    bs = batches(cfg, 3)
    state, _ = _steps(t, t.init_state(), bs[:1])
    before = jax.device_get({k: state[k] for k in ("params", "opt")})
    state, m = t.step(state, t.place_batch(bs[1]))
    after = jax.device_get({k: state[k] for k in ("params", "opt")})
    assert int(m["nonfinite"]) == 1 and int(m["skipped_steps"]) == 1 and np.isnan(float(m["loss"]))
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_array_equal(x, y)
    state, _ = _steps(t, state, bs[2:])
    assert int(state["step"]) == 3 and int(state["skipped"]) == 1

    # the same program, its injected step never reached: bit-exact comparisons hold within one program
    clean = trainer(config("gpt2", parallel__data=2, parallel__zero=1, debug__nan_steps="99"))
    ref, _ = _steps(clean, clean.init_state(), [bs[0], bs[2]])
    for x, y in zip(jax.tree.leaves(jax.device_get(state["params"])), jax.tree.leaves(jax.device_get(ref["params"]))):
        np.testing.assert_array_equal(x, y)


@pytest.fixture(scope="session")  # session: kept while a worker runs tests of other modules
def one_checkpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad")
    cfg = config("gpt2", parallel__data=2)
    t = trainer(cfg)
    _save(tmp, t, t.init_state(), cfg, 0).close()
    return tmp / "ck", t, cfg


def _snapshot(directory):
    return {p: p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _one_line_error(directory, t, cfg, needle):
    before = _snapshot(directory)
    ck = Checkpointer(directory)
    with pytest.raises(CheckpointError) as e:
        ck.restore(0, t.abstract_state, cfg.to_dict())
    ck.close()
    msg = str(e.value)
    print(msg)
    assert "\n" not in msg and needle in msg and str(directory) in msg, msg
    assert _snapshot(directory) == before  # never overwritten or cleaned up
    return msg


def test_checkpoint_of_another_model_is_one_clear_error(one_checkpoint):
    directory, _, _ = one_checkpoint
    cfg = config("gpt2", parallel__data=2, model__d_model=32)
    msg = _one_line_error(directory, trainer(cfg), cfg, "belongs to another model")
    assert "model.d_model: 64 in the checkpoint, 32 now" in msg


def test_malformed_checkpoint_is_one_clear_error(tmp_path, one_checkpoint):
    import shutil

    src, t, cfg = one_checkpoint
    for i, damage in enumerate(["meta", "arrays", "sharding"]):
        directory = tmp_path / damage
        shutil.copytree(src, directory)
        step = directory / "0"
        if damage == "meta":
            (step / "meta" / "metadata").write_text("{not json")
        elif damage == "arrays":  # truncate every array data file
            for f in (step / "state").rglob("d/*"):
                f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 3])
        else:
            (step / "state" / "_METADATA").write_text(json.dumps({"tree_metadata": 7}))
        _one_line_error(directory, t, cfg, "unreadable")


def test_resume_modes(tmp_path, one_checkpoint):
    from jaxpar.run import open_checkpoints

    directory = one_checkpoint[0]
    ck, step = open_checkpoints(config("gpt2", checkpoint__dir=str(directory)), print)
    ck.close()
    assert step == 0
    with pytest.raises(CheckpointError, match="checkpoint.resume=never would overwrite them"):
        open_checkpoints(config("gpt2", checkpoint__dir=str(directory), checkpoint__resume="never"), print)
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        open_checkpoints(config("gpt2", checkpoint__dir=str(tmp_path / "empty"), checkpoint__resume="required"), print)
    ck, step = open_checkpoints(config("gpt2", checkpoint__dir=str(tmp_path / "empty")), print)
    ck.close()
    assert step is None
    assert open_checkpoints(config("gpt2", checkpoint__enabled=False), print) == (None, None)
