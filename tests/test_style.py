"""The code checks CI holds the library to (configured in pyproject.toml): ruff (line length 120,
pycodestyle, pyflakes, bugbear) over the package, the models, the scripts, the examples and the
benchmarks, the tools and the documentation's generators (docs/gen); mypy over the jaxpar package."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_is_clean():
    p = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "jaxpar", "models", "train.py",
                        "examples", "benchmarks", "tools", "docs/gen"], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-5000:] + p.stderr[-2000:]


def test_mypy_is_clean():
    p = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", "--cache-dir", "/dev/null"],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stdout[-5000:] + p.stderr[-2000:]
