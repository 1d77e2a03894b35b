"""MkDocs hooks (mkdocs.yml ``hooks:``): the generated parts of the pages and their figures.

``on_files`` adds every figure of ``jaxpar_docs.FIGURES`` as ``gen/NAME`` (made in memory, never written
into ``docs/``); ``on_page_markdown`` replaces each ``<!-- gen: NAME ARG -->`` line with
``jaxpar_docs.render``'s markdown. A generator that fails, or a marker no generator knows, fails the
build (strict or not)."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jaxpar_docs  # noqa: E402

from mkdocs.structure.files import File  # noqa: E402

MARKER = re.compile(r"^<!-- gen: (.+?) -->$", re.M)
_figures: dict[str, bytes] = {}


def on_pre_build(config):
    jaxpar_docs.prefetch()


def on_files(files, config):
    for name, make in jaxpar_docs.FIGURES.items():
        if name not in _figures:
            _figures[name] = make()
        files.append(File.generated(config, f"gen/{name}", content=_figures[name]))
    return files


def on_page_markdown(markdown, page, config, files):
    def sub(m):
        t0 = time.perf_counter()
        out = jaxpar_docs.render(m.group(1))
        took = time.perf_counter() - t0
        if took > 1:
            print(f"docs: generated {m.group(1)!r} for {page.file.src_uri} in {took:.1f} s", file=sys.stderr)
        return out

    return MARKER.sub(sub, markdown)
