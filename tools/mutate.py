#!/usr/bin/env python
"""Mutation testing of jaxpar's tests: plant realistic one-line bugs, one at a time, and see the tests fail.

Each mutant of ``tools/mutants.py`` is a bug a developer could plausibly write in one mechanism (data, tensor,
pipeline, expert and sequence parallelism, ZeRO, the loss, generation, checkpoints, the Hugging Face mapping,
the communication and memory models): an exact ``old`` snippet of a file, the ``new`` text that replaces it,
and the tests that should catch it. The harness copies the repository's files (``git ls-files``: tracked,
plus untracked files git does not ignore) once into a scratch folder per worker, applies one mutant there,
runs its tests with ``python -m pytest -x -q -p no:cacheprovider -W ignore::DeprecationWarning <tests>``
(the current interpreter, working directory and ``PYTHONPATH`` the scratch copy, and an editable install's
import hook for this checkout switched off there, so that ``jaxpar`` and ``jaxpar.models`` are the scratch
copy's: checked before any mutant runs), restores the file and records the outcome:

    killed         the tests failed (pytest exit 1): the bug is caught
    survived       the tests passed (exit 0): nothing pins this behaviour, a test gap (or an equivalent mutant)
    timeout        the tests ran past ``--timeout`` (the process group is killed)
    import-error   the mutated file does not compile, or a test module fails to import (collection error)
    error          any other pytest exit (usage error, a test id that no longer exists, no test selected)
    stale          ``old`` does not occur exactly once in the file: the code moved on; update the mutant

**The kill rate** is killed / (killed + survived) over the mutants not marked ``equivalent``: the share of
decided, real bugs that the targeted tests catch. Timeouts, import errors, errors and stale mutants are
left out of it (they prove nothing either way) and counted apart. Equivalent mutants (they compute what
the original computes, for the reason given) are run too, to check the argument, and left out of the
rate; one that is killed is flagged. A survivor is a test gap until shown equivalent: its ``note`` in
``tools/mutants.py`` says which test would kill it. The rate is only as broad as the mutant list and
only as strong as the targeted tests (the fastest that should catch each bug, not the whole suite).

Not run in CI: a mutant runs its tests in a fresh process, from about 3 s (a hand count, a schedule grid)
to about 40 s (a pipeline equivalence test with its one-device references; ``-x`` stops at the first failure),
so the whole list takes about 11 minutes with ``-j 2`` on two CPU cores. Run it before a release and after big
changes. ``tests/test_mutate_tool.py`` keeps it working in CI:
every mutant still applies (``--check``) and the harness logic on a toy repository.

Usage::

    python tools/mutate.py                         # every mutant, one worker
    python tools/mutate.py --only pipeline-1f1b,zero   # mechanisms (a prefix selects several: --only pipeline)
    python tools/mutate.py --ids tp-embed-shard-offset,sp-ring-direction
    python tools/mutate.py --list                  # the table, without running anything
    python tools/mutate.py --check [--collect]     # every `old` occurs exactly once (--collect: and every
                                                   # test target still collects); no test runs
    python tools/mutate.py -j 2 --json mutants.json --timeout 1200

Options: ``--skip-equivalent`` (do not run them), ``--rev REV`` (copy a git revision's files, e.g. ``HEAD``,
instead of the working tree, which may hold someone's edit in progress), ``--repo DIR`` and ``--mutants FILE``
(another repository or mutant list: the harness's own tests), ``--scratch DIR`` (where the copies go) and
``--keep-scratch``.
Exit status: 0 when every selected mutant was run, 1 when some are stale (or ``--check`` found a problem),
2 on a usage error.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
PYTEST = ["-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning"]
STATUSES = ("killed", "survived", "timeout", "import-error", "error", "stale")
TAIL = 4000  # characters of a run's output kept in the results

# Put first on PYTHONPATH of every run in a scratch copy (runs at interpreter start-up, after the .pth files):
# an editable install's finder that maps packages into the source checkout is removed, so that `jaxpar` and
# `jaxpar.models` (which the finder would map to the checkout's models/) come from the scratch copy.
SITECUSTOMIZE = '''"""Written by tools/mutate.py: imports in this scratch copy must not reach the source checkout."""
import importlib.machinery
import importlib.util
import os
import sys


def _inside(path, root):
    try:
        return os.path.commonpath([os.path.realpath(str(path)), root]) == root
    except ValueError:
        return False


def _drop_editable_finders():
    src = os.environ.get("JAXPAR_MUTATE_SOURCE")
    if not src:
        return
    src = os.path.realpath(src)
    keep = []
    for finder in sys.meta_path:
        mapping = getattr(sys.modules.get(getattr(finder, "__module__", None) or ""), "MAPPING", None)
        if isinstance(mapping, dict) and any(_inside(p, src) for p in mapping.values()):
            continue
        keep.append(finder)
    sys.meta_path[:] = keep


def _chain():
    """Run the sitecustomize module this one shadows, if there is one."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.origin and spec.loader is not None:
        shadowed = importlib.util.spec_from_file_location("_sitecustomize_shadowed", spec.origin)
        if shadowed is not None and shadowed.loader is not None:
            shadowed.loader.exec_module(importlib.util.module_from_spec(shadowed))


_drop_editable_finders()
_chain()
'''

PROBE_CODE = ("import importlib, sys\n"
              "for name in sys.argv[1:]:\n"
              "    m = importlib.import_module(name)\n"
              "    print(name, getattr(m, '__file__', None) or list(getattr(m, '__path__', [])), sep='\\t')\n")


class UsageError(Exception):
    pass


@dataclass(frozen=True)
class Mutant:
    id: str
    mechanism: str
    file: str
    old: str
    new: str
    tests: tuple
    equivalent: str | None = None
    note: str | None = None


def _mutant(entry) -> Mutant:
    """A mutant from an entry of a mutants file (an object with the attributes, or a dict)."""
    get = entry.get if isinstance(entry, dict) else lambda k, d=None: getattr(entry, k, d)
    tests = get("tests", ())
    return Mutant(str(get("id")), str(get("mechanism")), str(get("file")), get("old"), get("new"),
                  (tests,) if isinstance(tests, str) else tuple(tests), get("equivalent"), get("note"))


def load_mutants(path: Path):
    """``(mutants, mechanisms, probe)`` of a mutants file (``MUTANTS``; optional ``MECHANISMS``, ``PROBE``)."""
    spec = importlib.util.spec_from_file_location(f"_jaxpar_mutants_{abs(hash(str(path)))}", path)
    if spec is None or spec.loader is None:
        raise UsageError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    mutants = [_mutant(e) for e in module.MUTANTS]
    mechanisms = dict(getattr(module, "MECHANISMS", {}) or {m.mechanism: "" for m in mutants})
    return mutants, mechanisms, tuple(getattr(module, "PROBE", ()))


# ---------------------------------------------------------------------------------------------------------
# Checks (no test runs)

def stale_reason(m: Mutant, text: str | None) -> str | None:
    """Why ``m`` cannot be applied to ``text`` (its file's content; None: no such file), or None."""
    if text is None:
        return f"stale mutant {m.id}: {m.file} does not exist"
    n = text.count(m.old)
    if n != 1:
        return (f"stale mutant {m.id}: its `old` snippet occurs {n} times in {m.file} (it must occur exactly once); "
                f"update it in the mutants file")
    return None


def problems(mutants: list[Mutant], mechanisms: dict, source: Source) -> list[str]:
    """Everything wrong with the mutant list against the files of ``source`` (empty: all good)."""
    out, seen = [], set()
    for m in mutants:
        if m.id in seen:
            out.append(f"mutant id {m.id} is used twice")
        seen.add(m.id)
        if mechanisms and m.mechanism not in mechanisms:
            out.append(f"mutant {m.id}: unknown mechanism {m.mechanism!r} (known: {', '.join(mechanisms)})")
        if not isinstance(m.old, str) or not isinstance(m.new, str) or not m.old or m.old == m.new:
            out.append(f"mutant {m.id}: `old` and `new` must be different non-empty strings")
            continue
        if not m.tests:
            out.append(f"mutant {m.id}: no tests target it")
        text = source.read(m.file)
        reason = stale_reason(m, text)
        if reason:
            out.append(reason)
        elif m.file.endswith(".py"):
            try:
                compile(text.replace(m.old, m.new, 1), m.file, "exec")
            except SyntaxError as e:
                out.append(f"mutant {m.id}: the mutated {m.file} does not compile ({e.msg}, line {e.lineno}); a "
                           "mutant is a bug that runs, not a syntax error")
    return out


def _target_groups(mutants: list[Mutant]) -> list[tuple]:
    """Pytest argument lists to collect: all plain node ids at once, each ``-k`` selection on its own."""
    plain = sorted({t for m in mutants if "-k" not in m.tests for t in m.tests})
    selections = sorted({m.tests for m in mutants if "-k" in m.tests})
    return ([tuple(plain)] if plain else []) + selections


def collect_problems(mutants: list[Mutant], source: Source) -> list[str]:
    """Test targets that no longer collect in the unmutated code: ``pytest --collect-only`` of them (in the
    repository for the working tree, in a scratch copy for a revision)."""
    out = []
    with tempfile.TemporaryDirectory(prefix="jaxpar-mutate-collect-") as tmp:
        where, env = source.repo, _clean_env(os.environ)
        if source.rev is not None:
            scratch = Scratch(source, Path(tmp) / "w", ())
            where, env = scratch.root, scratch.env
        for args in _target_groups(mutants):
            out += _collect(args, where, env)
    return out


def _collect(args: tuple, where: Path, env: dict) -> list[str]:
    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        "-W", "ignore::DeprecationWarning", *args], cwd=where, capture_output=True, text=True, env=env)
    text = p.stdout + p.stderr
    missing = [line.split("not found:", 1)[1].strip() for line in text.splitlines() if "not found:" in line]
    out = [f"test target no longer exists: {t}" for t in missing]
    if p.returncode and not missing:
        last = text.strip().splitlines()[-1] if text.strip() else ""
        out.append(f"collecting {' '.join(args)[:200]} failed (pytest exit {p.returncode}): {last}")
    return out


# ---------------------------------------------------------------------------------------------------------
# Scratch copies

def _clean_env(env) -> dict:
    """The environment without the variables of a pytest run this harness may be running in."""
    return {k: v for k, v in env.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT_TEST"))}


class Source:
    """The files the scratch copies are made of: the working tree of ``repo`` (tracked files present on disk and
    untracked ones git does not ignore), or with ``rev`` the tracked files of that git revision."""

    def __init__(self, repo: Path, rev: str | None = None):
        self.repo, self.rev = repo, rev
        if rev is None:
            args = ["ls-files", "-z", "--cached", "--others", "--exclude-standard"]
        else:
            args = ["ls-tree", "-r", "-z", "--name-only", rev]
        try:
            p = subprocess.run(["git", *args], cwd=repo, capture_output=True, check=True)
        except (OSError, subprocess.CalledProcessError) as e:
            why = e.stderr.decode().strip() if isinstance(e, subprocess.CalledProcessError) else e
            raise UsageError(f"{repo}: `git {' '.join(args[:2])}` failed ({why}); the harness copies a git "
                             "checkout") from None
        names = sorted({n for n in p.stdout.decode().split("\0") if n})
        if rev is None:
            names = [n for n in names if (repo / n).is_file() or (repo / n).is_symlink()]
        self.files = names

    def read(self, name: str) -> str | None:
        if self.rev is None:
            path = self.repo / name
            return path.read_text() if path.is_file() else None
        p = subprocess.run(["git", "show", f"{self.rev}:{name}"], cwd=self.repo, capture_output=True)
        return p.stdout.decode() if p.returncode == 0 else None

    def copy_to(self, dest: Path) -> None:
        dest.mkdir(parents=True)
        if self.rev is not None:
            archive = subprocess.run(["git", "archive", "--format=tar", self.rev], cwd=self.repo, capture_output=True,
                                     check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
            return
        for name in self.files:
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(self.repo / name, target, follow_symlinks=False)


class Scratch:
    """One scratch copy of the repository, with the environment its runs use."""

    def __init__(self, source: Source, base: Path, probe: tuple):
        self.base, self.root = base, base / "repo"
        source.copy_to(self.root)
        repo = source.repo
        boot = base / "boot"
        boot.mkdir()
        (boot / "sitecustomize.py").write_text(SITECUSTOMIZE)
        env = _clean_env(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(self.root), str(boot)] + ([env["PYTHONPATH"]] if env.get(
            "PYTHONPATH") else []))
        env["JAXPAR_MUTATE_SOURCE"] = str(repo)
        env["PYTHONDONTWRITEBYTECODE"] = "1"  # a restored file never meets a stale .pyc of its mutant
        self.env = env
        if probe:
            self.check_imports(probe)

    def check_imports(self, modules: tuple) -> None:
        """Each module imports from this copy (not from an editable install's checkout)."""
        p = subprocess.run([sys.executable, "-c", PROBE_CODE, *modules], cwd=self.root, env=self.env,
                           capture_output=True, text=True, timeout=600)
        if p.returncode:
            raise UsageError(f"importing {', '.join(modules)} in the scratch copy failed:\n{p.stderr[-2000:]}")
        root = os.path.realpath(self.root)
        for line in p.stdout.splitlines():
            name, where = line.split("\t", 1)
            path = where.strip("[]'\" ")
            if os.path.commonpath([os.path.realpath(path), root]) != root:
                raise UsageError(f"in the scratch copy {name} imports from {path}, not from {self.root}: the mutants "
                                 "would run against the unmutated code")


# ---------------------------------------------------------------------------------------------------------
# Running

class Runner:
    def __init__(self, timeout: float):
        self.timeout = timeout
        self.running: set = set()
        self.lock = threading.Lock()
        self.stopping = False

    def stop(self) -> None:
        """Kill the process groups of the runs in progress (each started by this harness)."""
        self.stopping = True
        with self.lock:
            for proc in list(self.running):
                _kill_group(proc)

    def run(self, m: Mutant, scratch: Scratch, original: str | None) -> dict:
        result = _result(m)
        reason = stale_reason(m, original)
        if reason:
            return {**result, "status": "stale", "output": reason}
        assert original is not None
        mutated = original.replace(m.old, m.new, 1)
        if m.file.endswith(".py"):
            try:
                compile(mutated, m.file, "exec")
            except SyntaxError as e:
                return {**result, "status": "import-error", "output": f"does not compile: {e}"}
        path = scratch.root / m.file
        path.write_text(mutated)
        t0 = time.monotonic()
        try:
            status, rc, out = self._pytest(m.tests, scratch)
        finally:
            path.write_text(original)
        return {**result, "status": status, "returncode": rc, "seconds": round(time.monotonic() - t0, 1),
                "output": out[-TAIL:]}

    def _pytest(self, tests: tuple, scratch: Scratch) -> tuple[str, int | None, str]:
        if self.stopping:
            return "error", None, "interrupted"
        log = tempfile.TemporaryFile(dir=scratch.base)
        proc = subprocess.Popen([sys.executable, *PYTEST, *tests], cwd=scratch.root, env=scratch.env,
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        with self.lock:
            self.running.add(proc)
        try:
            try:
                rc = proc.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                proc.wait()
                rc = None
        finally:
            with self.lock:
                self.running.discard(proc)
        log.seek(0)
        out = log.read().decode(errors="replace")
        log.close()
        if rc is None:
            return "timeout", None, out + f"\n[killed after {self.timeout:g} s]"
        return classify(rc, out), rc, out


def _result(m: Mutant, **values) -> dict:
    return {"id": m.id, "mechanism": m.mechanism, "file": m.file, "tests": list(m.tests), "equivalent": m.equivalent,
            "note": m.note, "status": None, "seconds": 0.0, "returncode": None, "output": "", **values}


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the run's own session, started by this harness
    except (ProcessLookupError, PermissionError):
        pass


def classify(rc: int, output: str) -> str:
    """A pytest exit status (and its output) as a mutant status."""
    if rc == 0:
        return "survived"
    if rc == 1:
        return "killed"
    if rc in (2, 4) and ("ERROR collecting" in output or "error during collection" in output
                         or "errors during collection" in output):  # 4: a node id whose module did not import
        return "import-error"
    return "error"


# ---------------------------------------------------------------------------------------------------------
# Reports

def summarize(results: list[dict]) -> dict:
    by: dict = {}
    for r in results:
        row = by.setdefault(r["mechanism"], {**{s: 0 for s in STATUSES}, "equivalent": 0, "mutants": 0})
        row["mutants"] += 1
        if r["equivalent"]:
            row["equivalent"] += 1
        else:
            row[r["status"]] += 1
    for row in by.values():
        decided = row["killed"] + row["survived"]
        row["rate"] = row["killed"] / decided if decided else None
    real = [r for r in results if not r["equivalent"]]
    killed = sum(r["status"] == "killed" for r in real)
    survived = sum(r["status"] == "survived" for r in real)
    return {"by_mechanism": by, "killed": killed, "survived": survived,
            "rate": killed / (killed + survived) if killed + survived else None,
            "undecided": {s: sum(r["status"] == s for r in real) for s in STATUSES[2:]},
            "equivalent": sum(bool(r["equivalent"]) for r in results)}


def report(results: list[dict]) -> str:
    s = summarize(results)
    pct = lambda x: "-" if x is None else f"{100 * x:.0f}%"  # noqa: E731
    cols = ("mutants", "killed", "survived", "timeout", "import-error", "error", "stale", "equivalent")
    lines = ["", f"{'mechanism':22s} " + " ".join(f"{c:>8s}" if c != "import-error" else "import-err" for c in cols)
             + "  kill rate"]
    for mech, row in s["by_mechanism"].items():
        lines.append(f"{mech:22s} " + " ".join(f"{row[c]:>{10 if c == 'import-error' else 8}d}" for c in cols)
                     + f"  {pct(row['rate']):>9s}")
    und = ", ".join(f"{n} {k}" for k, n in s["undecided"].items() if n) or "none"
    lines.append(f"\nkill rate: {s['killed']} killed of {s['killed'] + s['survived']} decided non-equivalent mutants "
                 f"= {pct(s['rate'])} (left out: {und}; {s['equivalent']} equivalent)")
    survivors = [r for r in results if r["status"] == "survived" and not r["equivalent"]]
    if survivors:
        lines.append("\nsurvivors (test gaps until shown equivalent):")
        for r in survivors:
            lines.append(f"  {r['id']} ({r['mechanism']}, {r['file']})" + (f": {r['note']}" if r["note"] else ""))
    others = [r for r in results if r["status"] not in ("killed", "survived")]
    if others:
        lines.append("\nnot decided:")
        for r in others:
            last = r["output"].strip().splitlines()[-1] if r["output"].strip() else ""
            lines.append(f"  {r['id']}: {r['status']}" + (f" ({last[:200]})" if last else ""))
    equivalents = [r for r in results if r["equivalent"]]
    if equivalents:
        lines.append("\nequivalent mutants (left out of the rate):")
        for r in equivalents:
            verdict = {"survived": "survived, as argued", "killed": "KILLED: the equivalence argument (or the "
                       "test) is wrong"}.get(r["status"], r["status"])
            lines.append(f"  {r['id']}: {r['equivalent']} [{verdict}]")
    return "\n".join(lines)


def table(mutants: list[Mutant]) -> str:
    lines = [f"{'id':38s} {'mechanism':21s} {'file':36s} tests"]
    for m in mutants:
        flag = " [equivalent]" if m.equivalent else " [suspected gap]" if m.note else ""
        lines.append(f"{m.id:38s} {m.mechanism:21s} {m.file:36s} {' '.join(m.tests)}{flag}")
    return "\n".join(lines)


def _git(repo: Path, *args) -> str:
    p = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)
    return p.stdout.strip() if p.returncode == 0 else ""


# ---------------------------------------------------------------------------------------------------------

def select(mutants: list[Mutant], mechanisms: dict, only: str | None, ids: str | None) -> list[Mutant]:
    chosen = mutants
    if only:
        wanted = [w.strip() for w in only.split(",") if w.strip()]
        known = set(mechanisms) | {m.mechanism for m in mutants}
        for w in wanted:
            if not any(k == w or k.startswith(w + "-") for k in known):
                raise UsageError(f"--only {w}: no such mechanism; choose among {', '.join(sorted(known))}")
        chosen = [m for m in chosen if any(m.mechanism == w or m.mechanism.startswith(w + "-") for w in wanted)]
    if ids:
        wanted = [w.strip() for w in ids.split(",") if w.strip()]
        by_id = {m.id: m for m in mutants}
        unknown = [w for w in wanted if w not in by_id]
        if unknown:
            raise UsageError(f"--ids: no mutant {', '.join(unknown)} (see --list)")
        chosen = [m for m in chosen if m.id in wanted]
    return chosen


def run_all(source: Source, mutants: list[Mutant], probe: tuple, *, jobs: int, timeout: float, json_path: Path | None,
            scratch_dir: Path | None, keep: bool, out=print) -> list[dict]:
    repo = source.repo
    originals = {f: source.read(f) for f in {m.file for m in mutants}}
    base = Path(tempfile.mkdtemp(prefix="jaxpar-mutate-", dir=scratch_dir))
    runner = Runner(timeout)
    results: list[dict] = []
    meta = {"repo": str(repo), "rev": source.rev or "working tree",
            "commit": _git(repo, "rev-parse", source.rev or "HEAD"),
            "dirty": source.rev is None and bool(_git(repo, "status", "--porcelain")), "python": sys.executable,
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "timeout": timeout, "jobs": jobs}
    write_lock = threading.Lock()
    t_start = time.monotonic()

    def save():
        if json_path is not None:
            with write_lock:
                json_path.write_text(json.dumps({**meta, "seconds": round(time.monotonic() - t_start, 1),
                                                 "results": results, "summary": summarize(results)}, indent=2))

    try:
        todo = []
        for m in mutants:
            reason = stale_reason(m, originals[m.file])
            if reason:  # refused, by name; the others run
                results.append(_result(m, status="stale", output=reason))
                out(f"refused: {reason}")
            else:
                todo.append(m)
        n_workers = max(1, min(jobs, len(todo)))
        out(f"{len(todo)} mutant(s) to run on {n_workers} worker(s); copying {len(source.files)} files of {repo} "
            f"({source.rev or 'working tree'}) to {base}")
        pool_of: list[Scratch] = []
        for i in range(n_workers if todo else 0):
            pool_of.append(Scratch(source, base / f"w{i}", probe))
        if probe and todo:
            out(f"imports checked: {', '.join(probe)} come from the scratch copies")
        free = list(pool_of)
        free_lock = threading.Lock()

        def work(m: Mutant) -> dict:
            with free_lock:
                scratch = free.pop()
            try:
                return runner.run(m, scratch, originals[m.file])
            finally:
                with free_lock:
                    free.append(scratch)

        done = 0
        with ThreadPoolExecutor(max_workers=n_workers) as pool:
            futures = [pool.submit(work, m) for m in todo]
            try:
                for fut in as_completed(futures):
                    r = fut.result()
                    done += 1
                    results.append(r)
                    tag = "  (equivalent)" if r["equivalent"] else ""
                    out(f"[{done:>3}/{len(todo)}] {r['id']:38s} {r['mechanism']:21s} {r['status']:12s} "
                        f"{r['seconds']:7.1f} s{tag}")
                    save()
            except KeyboardInterrupt:
                for f in futures:
                    f.cancel()
                runner.stop()
                raise
        order = {m.id: i for i, m in enumerate(mutants)}
        results.sort(key=lambda r: order[r["id"]])
        save()
        for f, text in originals.items():  # paranoia: the scratch copies hold the original files again
            for s in pool_of:
                if text is not None and (s.root / f).read_text() != text:
                    raise RuntimeError(f"{s.root / f} was not restored")
        out(report(results))
        return results
    finally:
        if keep:
            out(f"scratch copies kept in {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/mutate.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", metavar="MECH[,MECH]", help="mechanisms to run (a prefix selects every MECH-...)")
    ap.add_argument("--ids", metavar="ID[,ID]", help="mutants to run, by id")
    ap.add_argument("--list", action="store_true", help="print the mutants and their tests; run nothing")
    ap.add_argument("--check", action="store_true", help="verify that every `old` occurs exactly once; run no test")
    ap.add_argument("--collect", action="store_true", help="with --check: also collect every test target")
    ap.add_argument("--json", metavar="FILE", type=Path, help="write the results there (updated as they come)")
    ap.add_argument("-j", "--jobs", type=int, default=1, help="parallel workers, each with its own copy (default 1)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per mutant before it is a timeout")
    ap.add_argument("--skip-equivalent", action="store_true", help="do not run the mutants marked equivalent")
    ap.add_argument("--repo", type=Path, default=TOOLS.parent, help="the repository (default: this checkout)")
    ap.add_argument("--rev", default=None, help="copy the files of this git revision (e.g. HEAD) instead of the "
                    "working tree (which may hold someone's edits in progress)")
    ap.add_argument("--mutants", type=Path, default=None, help="the mutants file (default: tools/mutants.py)")
    ap.add_argument("--scratch", type=Path, default=None, help="where the scratch copies go (default: the temp folder)")
    ap.add_argument("--keep-scratch", action="store_true", help="keep the scratch copies afterwards")
    a = ap.parse_args(argv)
    try:
        if a.jobs < 1 or a.timeout <= 0:
            raise UsageError("-j must be >= 1 and --timeout > 0")
        source = Source(a.repo.resolve(), a.rev)
        mutants, mechanisms, probe = load_mutants((a.mutants or TOOLS / "mutants.py").resolve())
        chosen = select(mutants, mechanisms, a.only, a.ids)
        if a.skip_equivalent:
            chosen = [m for m in chosen if not m.equivalent]
        if a.list:
            print(table(chosen))
            counts = {k: sum(m.mechanism == k for m in chosen) for k in mechanisms}
            print(f"\n{len(chosen)} mutant(s); mechanisms: " + ", ".join(f"{k} {n}" for k, n in counts.items() if n))
            return 0
        if a.check:
            found = problems(chosen, mechanisms, source)
            if a.collect and not found:
                found = collect_problems(chosen, source)
            for p in found:
                print(p)
            if found:
                print(f"{len(found)} problem(s) in {len(chosen)} mutant(s)")
                return 1
            print(f"{len(chosen)} mutant(s) of {len({m.mechanism for m in chosen})} mechanism(s): each `old` occurs "
                  "exactly once and the mutated file compiles" + ("; every test target collects" if a.collect else ""))
            return 0
        if not chosen:
            raise UsageError("no mutant selected")
        bad = [p for p in problems(chosen, mechanisms, source) if not p.startswith("stale mutant")]
        if bad:
            raise UsageError("\n".join(bad))
        results = run_all(source, chosen, probe, jobs=a.jobs, timeout=a.timeout, json_path=a.json,
                          scratch_dir=a.scratch, keep=a.keep_scratch, out=lambda s: print(s, flush=True))
        return 1 if any(r["status"] == "stale" for r in results) else 0
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
