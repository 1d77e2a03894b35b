"""Per-device memory of the compiled step and of the live train state: what ZeRO-1, ZeRO-3 (over data, expert
and seq), tensor, expert and pipeline parallelism save, against counts written by hand from the model's dims."""

import jax
import numpy as np
import pytest

from helpers import command_env, config, trainer
from jaxpar.config import ConfigError

F32 = 4


def _leaves(t):
    axes = jax.tree.leaves(t.adapter.axes, is_leaf=lambda x: isinstance(x, tuple))
    return list(zip(jax.tree.leaves(t.adapter.abstract), axes))


def test_zero3_argument_bytes_are_an_eighth():
    """zero=3, data=8: params + Adam moments per device <= 1/8 of the whole + the small leaves that
    have no d_model dim to split (norm scales), which stay replicated; plus the batch shard."""
    t = trainer(config("llama", parallel__data=8, parallel__zero=3))
    mem = t.compile()["memory"]
    whole = sum(int(np.prod(a.shape)) for a, _ in _leaves(t)) * F32 * 3  # params, mu, nu
    small = sum(int(np.prod(a.shape)) for a, ax in _leaves(t) if "embed" not in ax) * F32 * 3
    cfg = t.cfg
    batch = 2 * cfg.train.batch_size * cfg.model.seq_len * 4 // 8
    scalars = 64  # step, Adam count
    assert small < whole / 50
    assert mem["argument_size"] <= whole / 8 + small + batch + scalars, (mem["argument_size"], whole / 8, small)


def test_tensor8_matrices_are_an_eighth():
    """tensor=8: every matrix holds 1/8 of its elements per device (checked on the live arrays)."""
    for style in ("gpt2", "llama"):
        t = trainer(config(style, parallel__tensor=8))
        state = t.init_state()
        flat = jax.tree_util.tree_flatten_with_path(state["params"])[0]
        for (path, x), (_, ax) in zip(flat, _leaves(t)):
            name = jax.tree_util.keystr(path)
            if sum(a not in ("layers",) for a in ax) < 2 or "positions" in ax:
                continue  # vectors, and GPT-2's [seq_len, d_model] position table (replicated, small)
            assert x.addressable_shards[0].data.size * 8 == x.size, (style, name)
        mem = t.compile()["memory"]
        whole = sum(int(np.prod(a.shape)) for a, _ in _leaves(t)) * F32 * 3
        assert mem["argument_size"] < whole / 4  # vectors and positions replicated, matrices / 8


# The tiny llama of tests/helpers.py: L = 2 layers, d = 64, H = KV = 8 heads of hd = 8 (H hd = d), SwiGLU
# d_ff = 128, vocabulary 250 padded to V = 256 (model.vocab_multiple = 128); the MoE variant has E = 4
# experts of the same d_ff in place of the MLP. Element counts by kind of weight, written from those dims:
D, FF, V, E = 64, 128, 256, 4


def _elements(layers: int, moe: bool) -> dict:
    attn = 3 * D * D + D * D  # QKV [d, KV, 3, hd] and out-projection [H, hd, d]
    return {"layer_matrix": layers * (attn + (0 if moe else 3 * D * FF)),  # + gate/up [d, 2, ff], down [ff, d]
            "router": layers * D * E if moe else 0,
            "experts": layers * E * 3 * D * FF if moe else 0,  # w_in [E, d, 2, ff], w_out [E, ff, d]
            "layer_norm": layers * 2 * D, "final_norm": D, "table": 2 * V * D}  # embedding [V, d], head [d, V]


def _kind(path: str) -> str:
    """The kind of a parameter (or of its Adam moment) from its name in the model, not from its logical axes."""
    for key, kind in (("norm_f", "final_norm"), ("norm", "layer_norm"), ("router", "router"), ("w_in", "experts"),
                      ("w_out", "experts"), ("'embed'", "table"), ("'head'", "table")):
        if key in path:
            return kind
    assert path.startswith("['blocks']") or ".mu['blocks']" in path or ".nu['blocks']" in path, path
    return "layer_matrix"


# Per layout, hand-written from its device counts: (parameter, Adam moment) divisors of each kind of weight,
# i.e. the number of devices that share one copy of it. Norm scales (d_model long, but no matrix) are never
# split (the design keeps them whole: they are tiny), except over the pipeline's stages. ZeRO splits every
# d_model dim of a matrix over all the axes that split the batch (data, expert, seq): ZeRO-1 the optimizer
# state only, ZeRO-3 the parameters too; an expert weight's experts dim is on expert already, so its d_model
# goes over data x seq. Tensor splits the attention / MLP matrices (heads, d_ff) and the embedding / head
# (vocabulary), never the router.
WHOLE = (1, 1)
HAND = {
    "dp8": ("llama", dict(parallel__data=8), dict(layer_matrix=WHOLE, table=WHOLE)),
    "zero1-data8": ("llama", dict(parallel__data=8, parallel__zero=1),
                    dict(layer_matrix=(1, 8), table=(1, 8))),
    "zero3-data8": ("llama", dict(parallel__data=8, parallel__zero=3), dict(layer_matrix=(8, 8), table=(8, 8))),
    "tensor8": ("llama", dict(parallel__tensor=8), dict(layer_matrix=(8, 8), table=(8, 8))),
    # ZeRO-1 over data=2 x seq=2: moments / 4, and / 8 with tensor=2 on every matrix; parameters / 2 (tensor)
    "zero1-data2-seq2-tensor2": ("llama", dict(parallel__data=2, parallel__seq=2, parallel__tensor=2,
                                               parallel__zero=1), dict(layer_matrix=(2, 8), table=(2, 8))),
    "zero3-data2-seq4": ("llama", dict(parallel__data=2, parallel__seq=4, parallel__zero=3),
                         dict(layer_matrix=(8, 8), table=(8, 8))),
    "zero1-seq4": ("llama", dict(parallel__seq=4, parallel__zero=1), dict(layer_matrix=(1, 4), table=(1, 4))),
    "zero3-seq8": ("llama", dict(parallel__seq=8, parallel__zero=3), dict(layer_matrix=(8, 8), table=(8, 8))),
    # 4 layers on pipe=2: every stacked weight / 2 (its stage); the embedding / head live on all stages
    "zero1-pipe2-data4": ("llama", dict(parallel__pipe=2, parallel__data=4, parallel__zero=1, model__n_layers=4),
                          dict(layer_matrix=(2, 8), layer_norm=(2, 2), table=(1, 4))),
    "moe-zero3-data2-expert4": ("llama", dict(model__arch="moe", moe__n_experts=E, parallel__data=2,
                                              parallel__expert=4, parallel__zero=3),
                                dict(layer_matrix=(8, 8), router=(8, 8), experts=(8, 8), table=(8, 8))),
    "moe-zero1-data2-expert2-seq2": ("llama", dict(model__arch="moe", moe__n_experts=E, parallel__data=2,
                                                   parallel__expert=2, parallel__seq=2, parallel__zero=1),
                                     dict(layer_matrix=(1, 8), router=(1, 8), experts=(2, 8), table=(1, 8))),
    # experts: expert=2 x tensor=2 (d_ff) x data=2 (ZeRO-3); the router: data x expert only
    "moe-zero3-data2-expert2-tensor2": ("llama", dict(model__arch="moe", moe__n_experts=E, parallel__data=2,
                                                      parallel__expert=2, parallel__tensor=2, parallel__zero=3),
                                        dict(layer_matrix=(8, 8), router=(4, 4), experts=(8, 8), table=(8, 8))),
}


def _per_device_by_kind(tree) -> dict:
    """Bytes of one device's shards of the arrays of ``tree`` (scalars, i.e. step counters, left out) by kind."""
    out: dict = {}
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if x.ndim:
            k = _kind(jax.tree_util.keystr(path))
            out[k] = out.get(k, 0) + x.addressable_shards[0].data.nbytes
    return out


@pytest.mark.parametrize("name", list(HAND))
def test_state_bytes_per_device_match_a_hand_count(name):
    """The live arrays' per-device bytes of parameters (4 per weight) and Adam moments (8 per weight), kind of
    weight by kind, equal the hand-written split of each layout (``HAND``), exactly: a ZeRO-1 that stops
    splitting the optimizer state, a ZeRO that skips ``seq`` or ``expert``, a tensor split that misses a matrix,
    or a norm scale split where it cannot be, each changes one of these numbers."""
    style, layout, split = HAND[name]
    t = trainer(config(style, **layout))
    n = _elements(t.cfg.model.n_layers, t.cfg.model.arch == "moe")
    shapes: dict = {}
    for path, a in jax.tree_util.tree_flatten_with_path(t.adapter.abstract)[0]:
        k = _kind(jax.tree_util.keystr(path))
        shapes[k] = shapes.get(k, 0) + int(np.prod(a.shape))
    assert shapes == {k: v for k, v in n.items() if v}, (shapes, n)  # the hand element counts are the model's
    want_p = {k: F32 * v // split.get(k, WHOLE)[0] for k, v in n.items() if v}
    want_o = {k: 2 * F32 * v // split.get(k, WHOLE)[1] for k, v in n.items() if v}
    state = t.init_state()
    got_p, got_o = _per_device_by_kind(state["params"]), _per_device_by_kind(state["opt"])
    print(f"{name}: params {got_p}\n  hand {want_p}\n  moments {got_o}\n  hand {want_o}")
    assert got_p == want_p and got_o == want_o


def test_zero3_splits_dense_weights_over_data_and_expert():
    """MoE with data=2 x expert=4, zero=3: the dense weights (attention, embedding) are split over all
    8 devices (ZeRO over every axis that splits the batch), the experts over expert and then data."""
    t = trainer(config("gpt2", model__arch="moe", moe__n_experts=4, parallel__data=2, parallel__expert=4,
                       parallel__zero=3))
    state = t.init_state()
    p = state["params"]
    for leaf in (p["embed"]["embedding"], p["blocks"]["moe"]["attn"]["qkv"]["kernel"]):
        assert leaf.addressable_shards[0].data.size * 8 == leaf.size
    w_in = p["blocks"]["moe"]["mlp"]["w_in"]
    assert w_in.addressable_shards[0].data.size * 8 == w_in.size  # experts / 4, embed / 2


def test_replication_report_and_guard():
    dp = trainer(config("llama", parallel__data=8)).replication()
    assert abs(dp["fraction"] - 7 / 8) < 1e-9  # eight full replicas
    z3 = trainer(config("llama", parallel__data=8, parallel__zero=3)).replication()
    assert z3["fraction"] < 0.05  # only the norm scales stay replicated
    with pytest.raises(ConfigError, match=r"parallel.max_replicated_fraction=0.5: this layout keeps 87.5%"):
        trainer(config("llama", parallel__data=8, parallel__max_replicated_fraction=0.5))
    trainer(config("llama", parallel__data=8, parallel__zero=3, parallel__max_replicated_fraction=0.05))


def test_xla_memory_tool_finds_the_peak_with_the_loop_carried_buffers(tmp_path):
    """``tools/xla_memory.py`` on a dump of a scan's gradient: its heap is the compiled program's temp_size, its
    live peak within it, and the buffers it lists at the peak include the scan's stacked residuals (a loop's
    carried value, ``(phi)`` in the buffer assignment: 8 layers x [256, 256] float32, counted by hand), which a
    reading of the plain values alone misses."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = (
        "import json, sys, jax, jax.numpy as jnp\n"
        "def f(x, w):\n"
        "    def layer(h, wi):\n"
        "        return jnp.tanh(h @ wi), None\n"
        "    return jnp.sum(jax.lax.scan(layer, x, w)[0])\n"
        "x, w = jnp.ones((256, 256)), jnp.ones((8, 256, 256)) * 0.01\n"
        "c = jax.jit(jax.grad(f, argnums=1)).lower(x, w).compile()\n"
        "json.dump({'temp': c.memory_analysis().temp_size_in_bytes}, open(sys.argv[1], 'w'))\n")
    out = tmp_path / "mem.json"
    import os

    # the tests' flags and a dump; no compilation cache (a program read from it is not compiled, nor dumped)
    env = command_env(1, XLA_FLAGS=os.environ["JAXPAR_TEST_XLA_FLAGS"] + f" --xla_dump_to={tmp_path / 'dump'}",
                      JAX_ENABLE_COMPILATION_CACHE="false")
    p = subprocess.run([sys.executable, "-c", code, str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    temp = json.loads(out.read_text())["temp"]
    sys.path.insert(0, str(root / "tools"))
    try:
        import xla_memory
    finally:
        sys.path.remove(str(root / "tools"))
    dump = tmp_path / "dump"
    found = max(dump.glob("*jit_f*-buffer-assignment.txt"), key=lambda p: p.stat().st_size)
    prog = xla_memory.read(found, found.with_name(found.name.replace("-buffer-assignment", "-live-range")))
    assert prog["heap"] == temp
    stacked = 8 * 256 * 256 * 4
    length = max(prog["sequence"]) + 1
    live = xla_memory.live_bytes(prog["values"], length)
    assert stacked <= max(live) <= temp, (max(live), temp)
    carried = [v for v in prog["values"] if v[1] == stacked and "{" in v[0]]
    assert carried, [v[:2] for v in prog["values"] if v[1] >= stacked]
    text = xla_memory.report(dump, "jit_f", top=5)
    assert f"heap (temp_size): {temp / 2**20:.2f} MiB" in text, text
    assert f"{stacked / 2**20:9.2f} MiB" in text.split("largest:")[1], text
