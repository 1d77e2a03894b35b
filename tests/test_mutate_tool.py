"""tools/mutate.py, the mutation-testing harness: every mutant of tools/mutants.py still applies to the code
(so that code drift making a mutant stale fails here, not in a release run), and the harness's logic on a toy
git repository with a hand-written outcome for each mutant (no jaxpar test runs)."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "mutate.py"


def _tool(*args, cwd=ROOT, timeout=120):
    return subprocess.run([sys.executable, str(TOOL), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def test_every_mutant_applies_exactly_once_and_each_mechanism_has_three():
    """``--check``: each mutant's ``old`` snippet occurs exactly once in its file and the mutated file compiles;
    the list covers each mechanism with at least three mutants that are not equivalent; ``--list`` names them
    all."""
    p = _tool("--check")
    assert p.returncode == 0, p.stdout + p.stderr
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import mutate
    finally:
        sys.path.remove(str(ROOT / "tools"))
    mutants, mechanisms, _ = mutate.load_mutants(ROOT / "tools" / "mutants.py")
    for mech in mechanisms:
        real = [m for m in mutants if m.mechanism == mech and not m.equivalent]
        assert len(real) >= 3, (mech, [m.id for m in real])
    listed = _tool("--list").stdout
    assert all(m.id in listed for m in mutants)


TOY = {
    "pytest.ini": "[pytest]\ntestpaths = tests\n",
    "pkg/__init__.py": "",
    "pkg/mathy.py": textwrap.dedent('''\
        LIMIT = 10


        def add(a, b):
            return a + b


        def clamp(x):
            return min(x, LIMIT)


        def untested(x):
            return 2 * x


        def slow(n):
            return n
        '''),
    "tests/test_mathy.py": textwrap.dedent('''\
        import pkg
        from pkg.mathy import add, clamp, slow


        def test_add():
            assert add(2, 3) == 5


        def test_clamp():
            assert clamp(3) == 3 and clamp(30) == 10


        def test_slow():
            assert slow(1) == 1


        def test_runs_the_scratch_copy():
            import os
            assert os.environ["JAXPAR_MUTATE_SOURCE"] not in pkg.__file__
        '''),
}

TOY_MUTANTS = textwrap.dedent('''\
    PROBE = ("pkg.mathy",)
    MECHANISMS = {"arith": "adding", "limits": "clamping", "loops": "looping"}
    F = "pkg/mathy.py"
    MUTANTS = [
        dict(id="add-minus", mechanism="arith", file=F, old="return a + b", new="return a - b",
             tests=["tests/test_mathy.py::test_add"]),
        dict(id="untested-triple", mechanism="arith", file=F, old="return 2 * x", new="return 3 * x",
             tests=["tests/test_mathy.py::test_add"], note="nothing calls untested()"),
        dict(id="clamp-max", mechanism="limits", file=F, old="min(x, LIMIT)", new="max(x, LIMIT)",
             tests=["tests/test_mathy.py", "-k", "clamp"]),
        dict(id="clamp-swapped", mechanism="limits", file=F, old="min(x, LIMIT)", new="min(LIMIT, x)",
             tests=["tests/test_mathy.py::test_clamp"], equivalent="min is symmetric"),
        dict(id="limit-undefined", mechanism="limits", file=F, old="LIMIT = 10", new="LIMIT = LIMITS",
             tests=["tests/test_mathy.py::test_clamp"]),
        dict(id="slow-forever", mechanism="loops", file=F, old="    return n", new="    while True: pass",
             tests=["tests/test_mathy.py::test_slow"]),
        dict(id="gone", mechanism="arith", file=F, old="return a * b", new="return a / b",
             tests=["tests/test_mathy.py::test_add"]),
        dict(id="old-test-id", mechanism="arith", file=F, old="a + b", new="b + a",
             tests=["tests/test_mathy.py::test_renamed"]),
    ]
    ''')


def _toy(tmp_path: Path) -> Path:
    repo = tmp_path / "toy"
    for name, text in TOY.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "."], cwd=repo, check=True)
    (tmp_path / "mutants.py").write_text(TOY_MUTANTS)
    return repo


def test_harness_outcomes_on_a_toy_repository(tmp_path):
    """Run in scratch copies (2 workers): a caught bug is killed, an untested one survives (with its note), an
    equivalent one survives and stays out of the rate, a module that no longer imports is an import error, a
    stale snippet is refused by name (exit 1), a renamed test an error; the kill rate is 2 of 3 decided
    mutants (clamp-max and add-minus killed, untested-triple survived). An endless loop is a timeout (its
    process killed). The toy repository's own file is left unmutated."""
    repo = _toy(tmp_path)
    original = (repo / "pkg/mathy.py").read_text()
    out = tmp_path / "results.json"
    run = ("--repo", str(repo), "--mutants", str(tmp_path / "mutants.py"))
    p = _tool(*run, "--only", "arith,limits", "-j", "2", "--timeout", "120", "--json", str(out), cwd=tmp_path)
    assert p.returncode == 1, p.stdout + p.stderr  # the stale mutant
    status = {r["id"]: r["status"] for r in json.loads(out.read_text())["results"]}
    assert status == {"add-minus": "killed", "untested-triple": "survived", "clamp-max": "killed",
                      "clamp-swapped": "survived", "limit-undefined": "import-error", "gone": "stale",
                      "old-test-id": "error"}, status
    summary = json.loads(out.read_text())["summary"]
    assert (summary["killed"], summary["survived"], round(summary["rate"], 4)) == (2, 1, round(2 / 3, 4))
    assert summary["by_mechanism"]["limits"]["rate"] == 1.0 and summary["equivalent"] == 1
    assert "stale mutant gone: its `old` snippet occurs 0 times in pkg/mathy.py" in p.stdout
    assert "kill rate: 2 killed of 3 decided non-equivalent mutants = 67%" in p.stdout
    assert "untested-triple (arith, pkg/mathy.py): nothing calls untested()" in p.stdout
    assert "clamp-swapped: min is symmetric [survived, as argued]" in p.stdout
    p = _tool(*run, "--ids", "slow-forever", "--timeout", "3", "--json", str(out), cwd=tmp_path)
    assert p.returncode == 0 and [r["status"] for r in json.loads(out.read_text())["results"]] == ["timeout"]
    assert (repo / "pkg/mathy.py").read_text() == original


def test_check_refuses_stale_and_non_compiling_mutants_and_selection_errors(tmp_path):
    """``--check`` names each stale mutant and each that would not compile (exit 1); ``--only`` and ``--ids``
    with unknown names are usage errors (exit 2); ``--only`` selects by mechanism."""
    repo = _toy(tmp_path)
    extra = tmp_path / "mutants.py"
    extra.write_text(TOY_MUTANTS.replace("\n]\n", '\n    dict(id="syntax", mechanism="arith", file=F, '
                                         'old="return a + b", new="return a +", tests=["x"]),\n]\n'))
    p = _tool("--repo", str(repo), "--mutants", str(extra), "--check", cwd=tmp_path)
    assert p.returncode == 1
    assert "stale mutant gone" in p.stdout and "mutant syntax: the mutated pkg/mathy.py does not compile" in p.stdout
    p = _tool("--repo", str(repo), "--mutants", str(extra), "--only", "nope", "--list", cwd=tmp_path)
    assert p.returncode == 2 and "--only nope: no such mechanism; choose among arith, limits" in p.stderr
    p = _tool("--repo", str(repo), "--mutants", str(extra), "--ids", "add-minus,nope", cwd=tmp_path)
    assert p.returncode == 2 and "--ids: no mutant nope" in p.stderr
    listed = _tool("--repo", str(repo), "--mutants", str(extra), "--only", "limits", "--list", cwd=tmp_path).stdout
    assert "clamp-max" in listed and "add-minus" not in listed


def test_tiers_read_a_durations_report_and_the_quick_set_names_slow_tests(tmp_path):
    """tools/tiers.py: a hand-written ``--durations=0`` report (phases of one test summed; a node id with spaces
    in its parameters kept whole; other lines ignored) becomes tests/durations.json's form (over a recorded
    file: the longer of the two times, tests the run did not see dropped); a report without
    such lines is one error line. conftest's QUICK set names tests of durations.json that are over the
    threshold (a faster one, or a renamed one, would make the set say nothing)."""
    report = textwrap.dedent("""\
        ============================= slowest durations =============================
        12.50s call     tests/test_a.py::test_one[x-y]
        3.25s setup    tests/test_a.py::test_one[x-y]
        0.01s teardown tests/test_a.py::test_one[x-y]
        4.00s call     tests/test_b.py::test_two[args1-needs --stages (4) and more]
        (12 durations < 0.005s hidden.  Use -vv to show these durations.)
        2 passed in 20.00s
        """)
    (tmp_path / "full.log").write_text(report)
    out = tmp_path / "d.json"
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "tiers.py"), str(tmp_path / "full.log"), "--out",
                        str(out)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert json.loads(out.read_text()) == {"tests/test_a.py::test_one[x-y]": 15.8,
                                           "tests/test_b.py::test_two[args1-needs --stages (4) and more]": 4.0}
    assert "2 tests, 20 s in all" in p.stdout
    # run again over a recorded file: the longer time of the two stays, a test this run did not see goes
    out.write_text(json.dumps({"tests/test_a.py::test_one[x-y]": 30.0, "tests/test_b.py::test_two[args1-needs "
                                                                      "--stages (4) and more]": 1.0,
                               "tests/test_c.py::test_gone": 9.0}))
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "tiers.py"), str(tmp_path / "full.log"), "--out",
                        str(out)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert json.loads(out.read_text()) == {"tests/test_a.py::test_one[x-y]": 30.0,
                                           "tests/test_b.py::test_two[args1-needs --stages (4) and more]": 4.0}
    (tmp_path / "empty.log").write_text("3 passed in 1.00s\n")
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "tiers.py"), str(tmp_path / "empty.log")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.startswith("error: ") and p.stderr.count("\n") == 1, p.stderr
    import conftest

    for node in conftest.QUICK:
        assert conftest.DURATIONS.get(node, 0.0) > conftest.SLOW_SECONDS, node
