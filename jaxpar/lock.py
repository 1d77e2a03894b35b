"""One run per run directory: a lock file ``<train.out_dir>/.jaxpar.lock``.

The file is created exclusively (``O_CREAT | O_EXCL``) and holds the owner's host, process id and
start time. A second run of the same directory fails at once with one line naming the holder. A
lock left by a process that died without releasing it (``kill -9``, a crash of the host's
session) is stale: on the same host its process id no longer exists, and it is taken over with a
note; from another host that cannot be checked, so the message says which file to remove.
Released on every exit of the run (normal, error, signal handled by the run).
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

NAME = ".jaxpar.lock"


class RunLockError(RuntimeError):
    """The run directory is in use by another run (one line naming it)."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class RunLock:
    """Holds ``directory`` for this process until :meth:`release`."""

    def __init__(self, directory: str | Path, log=print):
        self.path = Path(directory) / NAME
        self.held = False
        self.log = log

    def acquire(self) -> None:
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        while True:  # each pass acquires, raises, or removes a stale lock
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if (holder.get("host") == me["host"] and isinstance(holder.get("pid"), int)
                        and not _alive(holder["pid"])):
                    self.log(f"note: {self.path} was left by process {holder['pid']}, which no longer runs; "
                             "taking it over")
                    self.path.unlink(missing_ok=True)
                    continue
                who = (f"process {holder.get('pid', '?')} on host {holder.get('host', '?')} (since "
                       f"{holder.get('started', '?')})" if holder else "another run (unreadable lock file)")
                raise RunLockError(f"{self.path.parent} is in use by {who}: two runs in one train.out_dir would "
                                   f"overwrite each other's checkpoints and metrics; choose another train.out_dir, or "
                                   f"remove {self.path} if that run is gone") from None
            except OSError as e:  # a read-only directory or file system, no space, ...
                raise RunLockError(f"cannot write in {self.path.parent} ({e.strerror or type(e).__name__}): a run "
                                   "needs a writable train.out_dir with free space; fix it or choose another "
                                   "train.out_dir") from None
            self.held = True  # before the writing: a Ctrl-C during it still has release() remove the file
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            return

    def _holder(self) -> dict:
        try:
            holder = json.loads(self.path.read_text())
            return holder if isinstance(holder, dict) else {}
        except (OSError, ValueError):
            return {}

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False
