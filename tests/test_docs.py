"""The documentation site (mkdocs.yml, docs/): it builds strictly and offline, its generated parts come from
the code (a change of a collective changes the tables), its key reference is complete, and every command its
code blocks (and the README's) show names real config keys and real flags.

The README's key-table and Running-block checks live here now that both moved to docs/ (the key table is
generated into docs/reference/config.md, the Running block is in docs/guides/quickstart.md)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from jaxpar.config import Config, config_table, load_config

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS / "gen"))

import jaxpar_docs  # noqa: E402


def pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def dataclass_keys(cls=Config, prefix: str = "") -> set[str]:
    """Every field of the config dataclasses, dotted (``model.d_model``), found by walking them."""
    out = set()
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            out |= dataclass_keys(type(default), f"{prefix}{f.name}.")
        else:
            out.add(f"{prefix}{f.name}")
    return out


TABLE_KEYS = set(re.findall(r"^\| `([\w.]+)` \|", config_table(), re.M))


# -- the build --------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_site_builds_strictly_offline(tmp_path):
    """`mkdocs build --strict` (broken links, missing references, a failing generator: each fails it), with no
    network: the theme's fonts are off and nothing is fetched. The built pages hold the generated parts."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "no_proxy": "*", "http_proxy": "http://0.0.0.0:9",
           "https_proxy": "http://0.0.0.0:9"}
    site = tmp_path / "site"
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    for name in ("data", "tensor", "pipeline", "expert", "sequence", "combining"):
        html = (site / "concepts" / name / "index.html").read_text()
        assert "<table>" in html and "compiled KiB" in html and "gen/mesh-" in html, name
        assert "<!-- gen:" not in html, name
    assert (site / "gen" / "schedule-1f1b.png").read_bytes()[:4] == b"\x89PNG"
    choosing = (site / "concepts" / "choosing" / "index.html").read_text()
    assert "jaxpar.plan" in choosing and "layouts fit on" in choosing
    keys = (site / "reference" / "config" / "index.html").read_text()
    missing = [k for k in dataclass_keys() if f"<code>{k}</code>" not in keys]
    assert not missing, missing
    cli = (site / "reference" / "cli" / "index.html").read_text()
    for entry in jaxpar_docs.ENTRY_POINTS:
        assert "usage:" in cli and entry.split(".")[-1] in cli
    api = (site / "reference" / "api" / "index.html").read_text()
    assert "jaxpar.api.Layout" in api
    fonts = [f for f in site.rglob("*.html") if "fonts.googleapis" in f.read_text()]
    assert not fonts, fonts


def test_every_concepts_page_has_a_generated_part():
    for page in sorted((DOCS / "concepts").glob("*.md")):
        text = page.read_text()
        markers = re.findall(r"^<!-- gen: (\S+)", text, re.M)
        assert set(markers) - {"model"}, f"{page.name} has no table or figure generated from jaxpar"
        for marker in markers:
            assert marker in jaxpar_docs.GENERATORS, (page.name, marker)
        for fig in re.findall(r"\]\(\.\./gen/([\w.-]+)\)", text):
            assert fig in jaxpar_docs.FIGURES, (page.name, fig)


# -- generated from the code ------------------------------------------------------------------------------------

def test_key_reference_is_generated_and_complete():
    """The key reference is config_table() (generated from the dataclasses), and that table lists every field
    of every config dataclass (what the README's key-table test held the README to)."""
    page = (DOCS / "reference" / "config.md").read_text()
    assert "\n<!-- gen: keys -->\n" in page
    assert jaxpar_docs.render("keys") == config_table()
    assert TABLE_KEYS == dataclass_keys(), TABLE_KEYS ^ dataclass_keys()
    assert "<!-- keys:start -->" not in (ROOT / "README.md").read_text()  # one copy of the table: the docs'


def test_a_changed_collective_changes_the_generated_table(monkeypatch):
    """The collective tables are the compiled program and jaxpar.comm's model: a layout with other
    collectives, a model that counts one collective differently, or a compiled program with one collective
    fewer gives another table."""
    from jaxpar import comm, hlo

    base = jaxpar_docs.collectives_table("data")
    assert "| all-reduce | `data` |" in base and "all-gather" not in base
    zero1 = jaxpar_docs.collectives_table("zero1")
    assert "| all-gather | `data` |" in zero1  # ZeRO-1's gather of the updated parameters

    real = comm.traffic

    def doubled(*a, **k):
        terms = real(*a, **k)
        for t in terms:
            if t.kind == "all-reduce":
                t.count *= 2
        return terms

    monkeypatch.setattr(comm, "traffic", doubled)
    changed = jaxpar_docs.collectives_table("data")
    monkeypatch.setattr(comm, "traffic", real)
    assert changed != base
    model = lambda table: re.search(r"\| all-reduce \| `data` \| \d+ \| [\d,.]+ \| ([\d,.]+) \|", table)[1]  # noqa
    assert float(model(changed).replace(",", "")) == pytest.approx(2 * float(model(base).replace(",", "")), 0.01)

    real_collectives = hlo.collectives
    monkeypatch.setattr(hlo, "collectives",
                        lambda *a, **k: {k_: v for k_, v in real_collectives(*a, **k).items() if k_ != "all-reduce"})
    dropped = jaxpar_docs.collectives_table("data")
    assert dropped != base and "| all-reduce | `data` | 0 | 0.0 |" in dropped


def test_the_planner_block_is_its_output():
    """The choosing page's planner blocks are `python -m jaxpar.plan`'s stdout, run through one function (the
    place a planner flag is added for every block)."""
    args = jaxpar_docs.RULES[0][2]
    block = jaxpar_docs.plan_block(args)
    out = subprocess.run([sys.executable, "-m", "jaxpar.plan", *args.split(), *jaxpar_docs.PLAN_FLAGS], cwd=ROOT,
                         capture_output=True, text=True, timeout=300).stdout
    assert out.strip() and out.rstrip() in block
    assert jaxpar_docs.plan_first(args) in out


# -- the commands the pages show --------------------------------------------------------------------------------

ENTRY = re.compile(r"python3? (train\.py|-m (jaxpar[\w.]*))")


def shown_commands() -> list[tuple[str, str, list[str]]]:
    """``(page, entry point, words after it)`` for every train.py / python -m jaxpar.* command in the code
    blocks of the docs and the README (continuation lines joined; shell comments dropped)."""
    out = []
    for page in [*pages(), ROOT / "README.md"]:
        for block in re.findall(r"^```(?:bash|console|sh)\n(.*?)^```", page.read_text(), re.M | re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.removeprefix("$ ")
                for m in ENTRY.finditer(line):
                    rest = line[m.end():].split(";")[0].split("&&")[0].split(" & ")[0].split("|")[0]
                    try:
                        words = shlex.split(rest, comments=True)
                    except ValueError:  # an unterminated quote: the command goes on in a string of the shell line
                        words = shlex.split(rest.split('"')[0], comments=True)
                    out.append((page.name, m[2] or m[1], words))
    return out


@functools.lru_cache(maxsize=None)
def parser_flags(entry: str) -> set[str]:
    """The flags of an entry point's parser: its ``main(["--help"])``, run in this process (the docs'
    reference page runs the same as ``python ENTRY --help``)."""
    if entry == "train.py":
        spec = importlib.util.spec_from_file_location("train_script", ROOT / "train.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(entry)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        module.main(["--help"])
    return set(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", out.getvalue()))


def problems(cmds) -> list[tuple[str, str, str]]:
    """``(page, entry, word)`` for each --flag its parser lacks and each dotted key=value that is no config key."""
    bad = []
    for page, entry, words in cmds:
        if entry not in jaxpar_docs.ENTRY_POINTS:
            bad.append((page, entry, "(no such entry point)"))
            continue
        flags = parser_flags(entry)
        for w in words:
            if w.startswith("-"):
                if w.split("=")[0] not in flags:
                    bad.append((page, entry, w))
            elif "=" in w and "." in w.split("=")[0] and w.split("=")[0] not in TABLE_KEYS:
                bad.append((page, entry, w))
    return bad


def test_every_shown_command_names_real_keys_and_flags():
    cmds = shown_commands()
    assert len(cmds) >= 30 and {e for _, e, _ in cmds} >= {"train.py", "jaxpar.plan", "jaxpar.compile",
                                                          "jaxpar.generate", "jaxpar.hf", "jaxpar.data.prepare"}
    assert not problems(cmds), problems(cmds)
    # the check itself: a misspelt key, a flag of another command, an unknown module
    wrong = [("p", "train.py", ["parallel.dat=2", "--keys"]), ("p", "jaxpar.plan", ["--hbm-gib", "80"]),
             ("p", "jaxpar.compile", ["--hbm-gib", "80", "model.remat=full"]), ("p", "jaxpar.nope", [])]
    assert problems(wrong) == [("p", "train.py", "parallel.dat=2"), ("p", "jaxpar.plan", "--hbm-gib"),
                               ("p", "jaxpar.nope", "(no such entry point)")]


def test_quickstart_commands_fit_the_eight_simulated_devices():
    """Every `python train.py` line of the quick start's Running block loads and fits 8 devices (what a CPU host
    simulates) or, with -1, a mesh that 8 devices fill; and each writes its own run directory, so that pasting
    the block after the quick start runs every line (a line sharing a directory would resume another line's
    run, or find nothing left to train). (The README's Running section moved to docs/guides/quickstart.md.)"""
    from jaxpar.mesh import axis_sizes
    from jaxpar.partitioning import check_model_fits

    text = (DOCS / "guides" / "quickstart.md").read_text()
    block = text.split("## Running\n", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [shlex.split(line, comments=True) for line in block.splitlines() if line.startswith("python train.py")]
    assert len(lines) >= 8
    out_dirs = []
    for words in lines:
        if "--keys" in words:
            continue
        path = words[words.index("--config") + 1] if "--config" in words else "configs/default.yaml"
        over = [w for w in words[2:] if "=" in w]
        cfg = load_config(ROOT / path, over)
        sizes = axis_sizes(cfg.parallel, 8)
        check_model_fits(cfg.model, cfg.parallel, sizes)
        out_dirs.append(cfg.train.out_dir)
    assert len(set(out_dirs)) == len(out_dirs), out_dirs


def test_readme_is_a_front_page_that_links_into_the_docs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    links = set(re.findall(r"\]\((docs/[\w/.-]+\.md)(?:#[\w-]+)?\)", readme))
    assert links and all((ROOT / link).is_file() for link in links), links
    nav = set(re.findall(r": ([\w/-]+\.md)$", (ROOT / "mkdocs.yml").read_text(), re.M))
    assert {f"docs/{p}" for p in nav if p != "index.md"} - links == set(), "a docs page the README does not link"


def test_ci_runs_the_readme_commands_as_written():
    """.ci/run runs the README's install (command one without its `&& python train.py`) and its test command
    word for word, so CI installs what a reader installs: the docs extra with the tests, which build the docs."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"^```bash\n(.*?)\n```", readme, re.M | re.S)
    one = next(b for b in blocks if b.startswith("python3 -m venv"))
    two = next(b for b in blocks if "pytest" in b)
    assert one.endswith(" && python train.py") and ".[hf" not in one and "torch" not in one
    assert ".[hf,docs]" in two
    ci = (ROOT / ".ci" / "run").read_text()
    install = one.removesuffix(" && python train.py").split(" && ", 2)[2]  # after the venv and its activation
    assert install in ci.splitlines() and two in ci.splitlines()
    assert ci.index(install) < ci.index(two)


def test_the_command_line_page_covers_every_entry_point():
    """Every module of jaxpar that runs as a program (`python -m jaxpar.X`), and train.py, has its --help on
    docs/reference/cli.md."""
    mains = {"train.py"} | {".".join(p.relative_to(ROOT).with_suffix("").parts) for p in (ROOT / "jaxpar").rglob("*.py")
                            if 'if __name__ == "__main__"' in p.read_text()}
    assert mains == set(jaxpar_docs.ENTRY_POINTS)
    page = (DOCS / "reference" / "cli.md").read_text()
    assert {e for e in mains if f"<!-- gen: help {e} -->" in page} == mains
