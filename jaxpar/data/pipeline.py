"""From a token stream to the per-process share of each global batch, resumable at any step.

**Packing.** Documents are encoded and joined into one int32 stream, each followed by the EOS id
(or by a blank line for the byte tokenizer: see :func:`jaxpar.data.tokenizer.encode_documents`).
:func:`pack` cuts the stream into ``N = (len - 1) // seq_len`` rows of ``seq_len + 1`` tokens; row
``i`` holds ``tokens[i*seq_len : i*seq_len + seq_len + 1]``, so consecutive rows overlap by one
token and every token (except the very first) is a target exactly once. ``inputs = row[:-1]``,
``targets = row[1:]``. Rows are views into the stream; nothing is padded, documents may straddle
rows (the model sees EOS inside a row, as in GPT-2 style pretraining), and the last
``(len - 1) % seq_len`` tokens are unused.

**Order.** Training sees the rows in epochs. Epoch ``e`` visits them in the order
``np.random.default_rng([seed, e]).permutation(N)``, cut into ``N // global_batch`` global batches;
the remaining ``N % global_batch`` rows of that permutation are skipped in that epoch (a batch
never straddles two epochs, and each epoch skips different rows). The global batch at step ``s``
is therefore a pure function of ``(rows, global_batch, seed, s)`` and does not depend on the number
of processes or on the mesh.

A store's rows (:class:`jaxpar.data.store.StoreRows`) behave like ``pack``'s array but are gathered
from memory maps on demand. In a mixture (``data.mix``) each store has its own order, with ``key``
(the store's index) mixed into the seed.

**Per-process share.** Each process builds a :class:`PackedBatches` with the same rows, batch and
seed, and the ``row_slice`` of the global batch that it feeds to its local devices (the caller
derives it from the batch sharding). It indexes the permutation with that slice and gathers only
those rows; the concatenation of all processes' shares in slice order is the global batch.

**Resumable position.** ``state()`` is a dict of plain ints (``epoch``, ``position`` = batches
already taken in that epoch, plus ``n_rows``, ``global_batch`` and ``seed`` to catch a checkpoint
restored onto other data). ``restore(state)`` continues with exactly the batches an uninterrupted
run would have seen, also with a different process count (the state is global, not per-process).

**Validation.** :func:`eval_batches` is a fixed list: the first rows in order, no shuffle.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from jaxpar.config import ConfigError


class Rows(Protocol):
    """What :class:`PackedBatches` and :func:`eval_batches` read: ``pack``'s array, or a store's rows."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def ndim(self) -> int: ...

    def __len__(self) -> int: ...

    def __getitem__(self, ids: Any) -> np.ndarray | dict[str, np.ndarray]: ...


def pack(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """Rows ``[N, seq_len + 1]`` (int32, a read-only view when ``tokens`` is int32) of the stream."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"pack expects a 1-D token stream, got shape {tokens.shape}")
    if seq_len < 1:
        raise ConfigError(f"model.seq_len={seq_len} must be >= 1")
    if len(tokens) < seq_len + 1:
        raise ConfigError(f"the text has {len(tokens)} tokens, fewer than one row of model.seq_len + 1 = "
                          f"{seq_len + 1}; use more text or a shorter model.seq_len")
    tokens = tokens.astype(np.int32, copy=False)
    n = (len(tokens) - 1) // seq_len
    return np.lib.stride_tricks.sliding_window_view(tokens, seq_len + 1)[::seq_len][:n]


def split_rows(x: np.ndarray | dict) -> dict[str, np.ndarray]:
    """``{inputs: rows[:, :-1], targets: rows[:, 1:]}`` (contiguous copies); rows of packed documents
    (:class:`jaxpar.data.packing.DocumentRows`) come as that dict already, with their segment ids,
    positions and weights, and pass through."""
    if isinstance(x, dict):
        return x
    return {"inputs": np.ascontiguousarray(x[:, :-1]), "targets": np.ascontiguousarray(x[:, 1:])}


class PackedBatches:
    """Shuffled global batches of packed rows, of which this process gathers ``row_slice``.

    ``next()`` -> ``{"inputs": int32 [local_rows, seq_len], "targets": int32 [local_rows, seq_len]}``
    where ``local_rows = len(range(global_batch)[row_slice])``. See the module docstring for the order.
    """

    def __init__(self, rows: Rows, global_batch: int, seed: int, row_slice: slice | np.ndarray = slice(None),
                 key: int | None = None):
        if rows.ndim != 2 or rows.shape[1] < 2:
            raise ValueError(f"rows must be [N, seq_len + 1], got shape {rows.shape}")
        if global_batch < 1:
            raise ConfigError(f"global batch size {global_batch} must be >= 1")
        self.rows, self.global_batch, self.seed, self.key = rows, int(global_batch), int(seed), key
        self.n_rows = len(rows)
        self.steps_per_epoch = self.n_rows // self.global_batch
        if self.steps_per_epoch == 0:
            raise ConfigError(f"the training text packs into {self.n_rows} rows of {rows.shape[1]} tokens, fewer "
                              f"than one global batch of {global_batch} rows; use more text, a smaller batch "
                              f"or a shorter model.seq_len")
        self.local = np.arange(self.global_batch)[row_slice]
        if len(self.local) == 0:
            raise ValueError(f"row_slice {row_slice} selects no row of a global batch of {global_batch}")
        self.epoch, self.position = 0, 0
        self._perm: tuple[int, np.ndarray | None] = (-1, None)

    # -- order ------------------------------------------------------------------------------

    def permutation(self, epoch: int) -> np.ndarray:
        """The order in which epoch ``epoch`` visits the rows (cached for the current epoch)."""
        cached = self._perm  # (epoch, order): one object, so a prefetch thread never sees a torn pair
        if cached[0] != epoch:
            entropy = [self.seed, epoch] if self.key is None else [self.seed, self.key, epoch]
            cached = self._perm = (epoch, np.random.default_rng(entropy).permutation(self.n_rows))
        order = cached[1]
        assert order is not None
        return order

    def row_ids(self, step: int) -> np.ndarray:
        """Indices (into ``rows``) of this process's rows of the global batch at ``step``."""
        epoch, pos = divmod(int(step), self.steps_per_epoch)
        b = self.global_batch
        return self.permutation(epoch)[pos * b:(pos + 1) * b][self.local]

    def batch_at(self, step: int) -> dict[str, np.ndarray]:
        """This process's share of the global batch at ``step`` (does not move the position)."""
        return split_rows(self.rows[self.row_ids(step)])

    # -- iteration --------------------------------------------------------------------------

    @property
    def step(self) -> int:
        """Global batches taken so far."""
        return self.epoch * self.steps_per_epoch + self.position

    def advance(self) -> None:
        """Move to the next step without gathering its batch."""
        if self.position == self.steps_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        self.position += 1

    def next(self) -> dict[str, np.ndarray]:
        batch = self.batch_at(self.step)
        self.advance()
        return batch

    __next__ = next

    def __iter__(self):
        return self

    # -- checkpointing ----------------------------------------------------------------------

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "n_rows": self.n_rows,
                "global_batch": self.global_batch, "seed": self.seed}

    def restore(self, state: dict) -> None:
        """Continue from ``state()`` of a (possibly other-process, other-process-count) iterator."""
        for key in ("n_rows", "global_batch", "seed"):
            if key in state and int(state[key]) != getattr(self, key):
                raise ConfigError(f"the checkpoint's data position was saved with {key}={int(state[key])}, "
                                  f"but this run has {key}={getattr(self, key)}: the data, seq_len, batch "
                                  f"size or seed changed since the checkpoint")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.steps_per_epoch:
            raise ValueError(f"invalid data state {state} ({self.steps_per_epoch} steps per epoch)")
        self.epoch, self.position = epoch, position


def eval_batches(rows: Rows, batch: int, n_batches: int,
                 row_slice: slice = slice(None)) -> list[dict[str, np.ndarray]]:
    """Validation batches: batch ``k`` is ``rows[k*batch:(k+1)*batch]`` in order, ``row_slice`` of it.

    Gives ``min(n_batches, len(rows) // batch)`` batches (at least one, else ``ConfigError``).
    """
    if batch < 1 or n_batches < 1:
        raise ConfigError(f"eval batch size ({batch}) and number of eval batches ({n_batches}) must be >= 1")
    n = min(int(n_batches), len(rows) // batch)
    if n < 1:
        raise ConfigError(f"the validation text packs into {len(rows)} rows, fewer than one eval batch of "
                          f"{batch}; raise data.val_fraction or lower the eval batch size")
    local = np.arange(batch)[row_slice]
    return [split_rows(rows[k * batch + local]) for k in range(n)]
