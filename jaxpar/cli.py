"""The command-line contract shared by ``train.py``, ``python -m jaxpar.plots`` and the benchmarks:
a user's mistake is one ``error:`` line on stderr and exit status 2, never a usage block or a traceback."""

from __future__ import annotations

import argparse
import difflib


class ArgumentParser(argparse.ArgumentParser):
    """:class:`argparse.ArgumentParser` whose errors (an unknown option, a value of the wrong type, a
    missing required argument) are one line: ``error: <what>; --help lists the arguments``, exit 2.
    An unknown option names the nearest known one."""

    def error(self, message: str):
        hint = ""
        if message.startswith("unrecognized arguments:"):
            known = [o for o in self._option_string_actions if o.startswith("--")]
            for word in message.split(":", 1)[1].split():
                near = difflib.get_close_matches(word.split("=")[0], known, n=1)
                if word.startswith("-") and near:
                    hint = f" (did you mean {near[0]}?)"
                    break
        self.exit(2, f"error: {message}{hint}; --help lists the arguments\n")
