"""Every parameter and optimizer-state leaf carries the spec the rules say (expected specs written by
hand here from the Megatron / ZeRO layouts, not computed by the code under test)."""

import jax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import config, trainer

# GPT-2 tiny: path -> spec under tensor parallelism only (stacked block weights have a leading layer dim).
TP = {
    "embed/embedding": P("tensor", None),
    "pos_embed": P(),
    "blocks/attn/qkv/kernel": P(None, None, "tensor", None, None),
    "blocks/attn/q_bias": P(None, "tensor", None), "blocks/attn/v_bias": P(None, "tensor", None),
    "blocks/attn/o/kernel": P(None, "tensor", None, None), "blocks/attn/o/bias": P(),
    "blocks/mlp/up/kernel": P(None, None, "tensor"), "blocks/mlp/up/bias": P(None, "tensor"),
    "blocks/mlp/down/kernel": P(None, "tensor", None), "blocks/mlp/down/bias": P(),
    "blocks/norm1/scale": P(), "blocks/norm1/bias": P(), "blocks/norm2/scale": P(), "blocks/norm2/bias": P(),
    "norm_f/scale": P(), "norm_f/bias": P(),
}
# The same with the d_model ("embed") dim additionally split over data (ZeRO-3 params / ZeRO-1 moments).
ZERO = {
    "embed/embedding": P("tensor", "data"),
    "pos_embed": P(None, "data"),
    "blocks/attn/qkv/kernel": P(None, "data", "tensor", None, None),
    "blocks/attn/q_bias": P(None, "tensor", None), "blocks/attn/v_bias": P(None, "tensor", None),
    "blocks/attn/o/kernel": P(None, "tensor", None, "data"), "blocks/attn/o/bias": P(None, "data"),
    "blocks/mlp/up/kernel": P(None, "data", "tensor"), "blocks/mlp/up/bias": P(None, "tensor"),
    "blocks/mlp/down/kernel": P(None, "tensor", "data"), "blocks/mlp/down/bias": P(None, "data"),
    "blocks/norm1/scale": P(), "blocks/norm1/bias": P(), "blocks/norm2/scale": P(), "blocks/norm2/bias": P(),
    "norm_f/scale": P(), "norm_f/bias": P(),
}


def _flat(tree):
    return {"/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path): x
            for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _check(arrays: dict, expected: dict, mesh, what: str):
    assert set(arrays) == set(expected), f"{what}: leaves {sorted(set(arrays) ^ set(expected))}"
    for name, x in arrays.items():
        want = NamedSharding(mesh, expected[name])
        assert x.sharding.is_equivalent_to(want, x.ndim), f"{what} {name}: {x.sharding.spec} != {expected[name]}"


def _moments(opt_state) -> list[dict]:
    """The Adam mu and nu trees (param-shaped) inside the optax state."""
    found = []
    for s in jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "mu") and hasattr(x, "nu")):
        if hasattr(s, "mu"):
            found += [_flat(s.mu), _flat(s.nu)]
    assert len(found) == 2
    return found


@pytest.mark.parametrize("zero, layout", [
    (0, dict(parallel__data=2, parallel__tensor=4)),
    (1, dict(parallel__data=2, parallel__tensor=4)),
    (3, dict(parallel__data=2, parallel__tensor=4)),
    (3, dict(parallel__data=8)),
    (1, dict(parallel__data=8)),
])
def test_state_specs_follow_rules(zero, layout):
    t = trainer(config("gpt2", parallel__zero=zero, **layout))
    state = t.init_state()
    drop_tensor = layout.get("parallel__tensor", 1) == 1

    def expect(table):
        if not drop_tensor:
            return table
        return {k: P(*[None if a == "tensor" else a for a in spec]) for k, spec in table.items()}

    _check(_flat(state["params"]), expect(ZERO if zero == 3 else TP), t.mesh, "param")
    for m in _moments(state["opt"]):
        _check(m, expect(ZERO if zero >= 1 else TP), t.mesh, "adam moment")


def test_zero3_splits_every_matrix_over_data():
    t = trainer(config("llama", parallel__data=8, parallel__zero=3))
    state = t.init_state()
    for name, x in _flat(state["params"]).items():
        if name.endswith("kernel") or name.endswith("embedding"):
            assert "data" in jax.tree.leaves(tuple(x.sharding.spec)), name
            assert x.addressable_shards[0].data.size * 8 == x.size, name


def test_same_initial_weights_on_every_mesh():
    """Same seed -> bit-identical initial parameters whatever the layout."""
    ref = jax.device_get(trainer(config("llama")).init_state()["params"])
    for lay in (dict(parallel__tensor=8), dict(parallel__data=2, parallel__tensor=2, parallel__zero=3)):
        got = jax.device_get(trainer(config("llama", **lay)).init_state()["params"])
        for (p, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(ref)):
            assert (a == b).all(), jax.tree_util.keystr(p)
