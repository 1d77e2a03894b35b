"""jaxpar as a library: the package and its version, the models under a safe import name, no import
cycles, the Layout API on a user's model (8 devices against 1), its errors, and the examples."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.config import ConfigError
from helpers import command_env
from jaxpar.layers import MLP, ColumnParallelLinear, RMSNorm, RowParallelLinear, Stack

ROOT = Path(__file__).resolve().parents[1]


def _env():
    env = command_env()
    env.pop("PYTHONPATH", None)
    return env


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, env=_env(), timeout=300)


def test_package_version_lazy_api_and_no_bare_models(tmp_path):
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    p = _python("import sys, jaxpar; print(jaxpar.__version__, 'jax' in sys.modules); "
                "import jaxpar.models; print(jaxpar.models.GPT.__module__); import models", tmp_path)
    lines = p.stdout.split()
    assert lines[:3] == [version, "False", "jaxpar.models.gpt"], p.stdout + p.stderr
    assert "No module named 'models'" in p.stderr  # the install adds no top-level `models`
    assert {"Layout", "Trainer", "load_config", "layers", "models"} <= set(jaxpar.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        jaxpar.nope  # noqa: B018


def test_a_project_with_its_own_models_package_trains_with_jaxpar(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "__init__.py").write_text("MINE = 'the user project models package'\n")
    (tmp_path / "train_mine.py").write_text(
        "import models\n"
        "from jaxpar import Trainer, load_config\n"
        "cfg = load_config(None, {'model.n_layers': 1, 'model.d_model': 32, 'model.n_heads': 4, 'model.vocab_size': 64,\n"
        "                         'model.seq_len': 8, 'train.batch_size': 4, 'train.out_dir': 'run'})\n"
        "t = Trainer(cfg)\n"
        "state = t.init_state()\n"
        "import numpy as np\n"
        "x = np.arange(36, dtype=np.int32).reshape(4, 9) % 64\n"
        "state, m = t.step(state, t.place_batch({'inputs': x[:, :-1], 'targets': x[:, 1:]}))\n"
        "print(models.MINE, float(m['loss']))\n")
    p = subprocess.run([sys.executable, "train_mine.py"], capture_output=True, text=True, cwd=tmp_path, env=_env(),
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    mine, loss = p.stdout.strip().rsplit(" ", 1)
    assert mine == "the user project models package" and abs(float(loss) - np.log(64)) < 0.5


def _imports(path: Path, files: dict) -> set[str]:
    """The jaxpar modules the file ``path`` imports, at any depth of its code (function-level imports
    included); ``from pkg import sub`` counts as importing the module ``pkg.sub``."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("jaxpar.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jaxpar"):
            out |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                    for a in node.names}
    return out


def test_no_import_cycles_in_the_package():
    files = {}
    for f in (ROOT / "jaxpar").rglob("*.py"):
        mod = ".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        files[mod] = f
    for f in (ROOT / "models").rglob("*.py"):
        files[("jaxpar.models." + f.stem).removesuffix(".__init__")] = f
    graph = {m: {i for i in _imports(f, files) if i in files and i != m} for m, f in files.items()}
    assert "jaxpar.layers.attention_ops" in graph["jaxpar.layers.attention"]
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(m, stack):
        state[m] = 1
        for n in sorted(graph[m]):
            if n == "jaxpar" or m == "jaxpar":
                continue  # the package's lazy __init__ imports nothing at import time
            assert state.get(n) != 1, f"import cycle: {' -> '.join(stack + [m, n])}"
            if n not in state:
                visit(n, stack + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


class Mixed(nnx.Module):
    """A user's model: jaxpar layers, a hand-made column/row pair, and a plain nnx.Linear named by a mapping."""

    def __init__(self, rngs):
        self.norm = RMSNorm(32)
        self.mlp = MLP(32, 64, kind="swiglu", use_bias=False, rngs=rngs)
        self.up = ColumnParallelLinear(32, 16, rngs=rngs)
        self.down = RowParallelLinear(16, 32, rngs=rngs)
        self.head = nnx.Linear(32, 8, use_bias=False, rngs=rngs)

    def __call__(self, x):
        x = x + self.mlp(self.norm(x))
        x = x + self.down(jax.nn.relu(self.up(x)))
        return self.head(x)


def _mixed_loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def test_layout_trains_a_users_model_like_one_device_and_keeps_its_placement():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 6, 32)).astype(np.float32), rng.normal(size=(8, 6, 8)).astype(np.float32)
    names = {"head/kernel": ("embed", None)}

    def run(layout):
        model = layout.shard(Mixed(nnx.Rngs(0)), names=names)
        opt = layout.optimizer(model, optax.adam(1e-2))
        step = layout.train_step(_mixed_loss)
        return [float(step(model, opt, *layout.batch(x, y))) for _ in range(3)], model, opt

    ref, _, _ = run(jaxpar.Layout(data=1))
    layout = jaxpar.Layout(data=2, tensor=4, zero=1)
    got, model, opt = run(layout)
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    assert model.up.kernel[...].sharding.spec == layout.rules.params.spec(("embed", "mlp"))
    mu = opt.opt_state[0].mu["up"]["kernel"][...]  # ZeRO-1: the optimizer state also splits over data
    assert mu.sharding.spec == layout.rules.opt.spec(("embed", "mlp")) != model.up.kernel[...].sharding.spec


class Tower(nnx.Module):
    """A user's model with its own repeated block in a jaxpar Stack: pipelined when the layout has pipe > 1."""

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.norm = RMSNorm(32)
            self.mlp = MLP(32, 64, kind="swiglu", use_bias=False, rngs=rngs)

        def __call__(self, x):
            return x + self.mlp(self.norm(x))

    def __init__(self, rngs):
        self.blocks = Stack.create(lambda r: Tower.Block(r), 4, rngs)
        self.head = nnx.Linear(32, 8, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.head(Stack(self.blocks, remat="save_dots")(x))


def test_a_users_stack_pipelines_like_one_device():
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(8, 6, 32)).astype(np.float32), rng.normal(size=(8, 6, 8)).astype(np.float32)

    def run(layout):
        model = layout.shard(Tower(nnx.Rngs(0)), names={"head/kernel": ("embed", None)})
        opt = layout.optimizer(model, optax.adam(1e-2))
        step = layout.train_step(_mixed_loss)
        return [float(step(model, opt, *layout.batch(x, y))) for _ in range(3)], model

    ref, _ = run(jaxpar.Layout(data=1))
    layout = jaxpar.Layout(pipe=2, data=2, microbatches=4)
    got, model = run(layout)
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    w = model.blocks.mlp.down.kernel[...]  # [layers, mlp, embed]: each pipe device holds its 2 layers
    assert w.addressable_shards[0].data.shape[0] == 2


def test_layout_errors_name_the_problem():
    with pytest.raises(TypeError, match=r"parameter 'head/kernel' \(shape \(32, 8\)\) has no logical axis names"):
        jaxpar.Layout(data=2).shard(Mixed(nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"needs 64 devices and 8 are visible; on a CPU host call "
                                         r"jaxpar.simulate_devices\(64\)"):
        jaxpar.Layout(data=64)
    with pytest.raises(ConfigError, match="unknown config key 'parallel.tensro'; did you mean parallel.tensor"):
        jaxpar.Layout(tensro=2)
    assert issubclass(ConfigError, ValueError)
    layout = jaxpar.Layout(data=2, tensor=2)
    model = layout.shard(Mixed(nnx.Rngs(0)), names={"head/kernel": ("embed", None)})
    x = jnp.ones((4, 6, 32))
    with jax.set_mesh(layout.mesh), pytest.raises(RuntimeError, match="no jaxpar rules are active: run it under"):
        jax.jit(lambda m, x: m(x))(model, x)
    with layout:
        out = nnx.jit(lambda m, x: m(x))(model, x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(Mixed(nnx.Rngs(0))(x)), rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="after JAX had already started with 8"):
        jaxpar.simulate_devices(4)


@pytest.mark.parametrize("script", ["own_model.py", "finetune_gpt.py"])
def test_examples_run_on_8_simulated_devices_and_match_one(script):
    p = subprocess.run([sys.executable, str(ROOT / "examples" / script), "--steps", "3"], capture_output=True,
                       text=True, cwd=ROOT, env=_env(), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    np.testing.assert_allclose(r["losses_8_devices"], r["losses_1_device"], rtol=2e-6)
    assert r["losses_8_devices"][-1] < r["losses_8_devices"][0]


def test_modules_stay_small_or_say_why():
    for f in list((ROOT / "jaxpar").rglob("*.py")) + list((ROOT / "models").rglob("*.py")):
        text = f.read_text()
        if text.count("\n") > 420:
            doc = ast.get_docstring(ast.parse(text)) or ""
            assert "Long by design" in doc, f"{f.relative_to(ROOT)} has {text.count(chr(10))} lines and no reason"


def test_the_loop_runs_user_hooks_and_a_hook_can_stop_the_run(tmp_path):
    from helpers import config

    from jaxpar.loop import TrainLoop
    from jaxpar.run import run

    seen = []
    cfg = config("gpt2", data__source="synthetic", train__steps=6, train__out_dir=str(tmp_path / "run"),
                 train__eval_every=0, train__log_every=1, sample__tokens=0, checkpoint__every=0, parallel__data=8)

    def record(info):
        seen.append((info.step, info.last, float(info.metrics["loss"])))

    def stop_after_step_3(info):
        if info.step == 3:
            info.loop.request_stop("enough")

    summary = run(cfg, log=lambda *_: None, hooks=[(record, 2), (stop_after_step_3, 1)])
    assert [s[0] for s in seen] == [1, 3]  # after steps 2 and 4 counted from 1; then the stop
    recs = {r["step"]: r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())}
    assert seen[1][2] == recs[3]["loss"] and max(recs) == 3  # the hook saw the logged loss; nothing after the stop
    assert summary["preempted_at"] == 4 and summary["interrupted"] is None
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["4"]  # the stop step is saved
    with pytest.raises(ValueError, match="every=0 must be a positive number of steps"):
        TrainLoop(None, None, None, 0, 1).add_hook(print, every=0)
