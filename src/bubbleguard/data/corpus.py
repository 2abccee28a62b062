"""A byte-level text corpus that ships with Python, and a resumable batch iterator over it.

The corpus is the standard library's own ``*.py`` sources: real text, no download, and the
same bytes every time on a given interpreter. :class:`TokenBatches` serves it in windows with a
cursor small enough to go into a checkpoint as JSON, so a resumed run sees exactly the batches
the uninterrupted run would have seen.
"""

from __future__ import annotations

import functools
import hashlib
import sysconfig
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from torch import Tensor

__all__ = ["Target", "TokenBatches", "corpus_fingerprint", "load_corpus"]

Target = Literal["next_token", "last_token"]

_TARGETS: tuple[str, ...] = get_args(Target)


def load_corpus(max_bytes: int = 2_000_000) -> Tensor:
    """Return the standard library's top-level ``*.py`` files, concatenated, as bytes.

    Files are taken from ``sysconfig.get_paths()["stdlib"]`` in name order and the result is cut
    to ``max_bytes``. The files are read once per process (per directory and size); each call
    returns a fresh tensor, so callers may modify it freely.

    Args:
        max_bytes: Length cap of the corpus; the result is shorter only if the sources are.

    Returns:
        A 1-D ``torch.uint8`` tensor.

    Raises:
        ValueError: ``max_bytes`` is not a positive int.
        FileNotFoundError: the interpreter's standard library sources cannot be found (e.g. an
            embedded Python that ships only ``.pyc`` files or a zip).
    """
    if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes <= 0:
        raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
    data = _read_sources(sysconfig.get_paths()["stdlib"], max_bytes)
    # bytearray makes a writable copy: the cached bytes stay untouched whatever the caller does.
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@functools.lru_cache(maxsize=8)
def _read_sources(stdlib_dir: str, max_bytes: int) -> bytes:
    root = Path(stdlib_dir)
    files = sorted(root.glob("*.py")) if root.is_dir() else []
    if not files:
        raise FileNotFoundError(
            f"no standard library sources (*.py) found in {root!s}; the built-in corpus needs a "
            f"Python installation that ships its .py files"
        )
    parts: list[bytes] = []
    size = 0
    for path in files:
        if size >= max_bytes:
            break
        chunk = path.read_bytes()
        parts.append(chunk)
        size += len(chunk)
    return b"".join(parts)[:max_bytes]


def corpus_fingerprint(corpus: Tensor) -> str:
    """Short identity of a corpus: the first 16 hex digits of the SHA-256 of its bytes.

    Record it in a checkpoint to detect a resume on different data.

    Raises:
        ValueError: ``corpus`` is not a 1-D ``torch.uint8`` tensor.
    """
    _check_corpus(corpus)
    return hashlib.sha256(corpus.contiguous().numpy().tobytes()).hexdigest()[:16]


def _check_corpus(corpus: Tensor) -> None:
    if not isinstance(corpus, Tensor) or corpus.dim() != 1 or corpus.dtype != torch.uint8:
        desc = (
            f"a {corpus.dim()}-D {corpus.dtype} tensor"
            if isinstance(corpus, Tensor)
            else type(corpus).__name__
        )
        raise ValueError(f"corpus must be a 1-D torch.uint8 tensor, got {desc}")


class TokenBatches:
    """Endless, resumable batches of byte windows in a seeded, epoch-wise random order.

    The corpus is cut into ``num_windows`` non-overlapping windows of ``window + 1`` bytes (the
    tail that does not fill a window is unused). Each epoch visits every window once, in a
    permutation drawn from a private generator seeded by ``(seed, epoch)``: the order never
    depends on the global RNG, so model code cannot disturb it. A batch that runs past the end of
    an epoch continues with the next epoch's permutation, so every batch has ``batch_size`` rows.

    Call order: build it, optionally :meth:`load_state_dict` a cursor saved by
    :meth:`state_dict`, then call :meth:`next_batch` once per step.

    Args:
        corpus: 1-D ``torch.uint8`` bytes, e.g. from :func:`load_corpus`.
        window: Input length of each row (the model's ``seq_len`` or ``context``).
        batch_size: Rows per batch; at most ``num_windows``.
        seed: Seed of the window order.
        target: ``"next_token"``: targets ``(B, window)`` are the inputs shifted by one;
            ``"last_token"``: targets ``(B,)`` are the byte after each row's inputs.

    Raises:
        ValueError: ``corpus`` is not 1-D uint8, a size is not positive, ``target`` is unknown,
            or the corpus holds fewer than ``batch_size`` windows.
    """

    def __init__(
        self,
        corpus: Tensor,
        *,
        window: int,
        batch_size: int,
        seed: int,
        target: Target = "next_token",
    ) -> None:
        _check_corpus(corpus)
        for name, value in (("window", window), ("batch_size", batch_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"seed must be an int, got {seed!r}")
        if target not in _TARGETS:
            raise ValueError(f"unknown target {target!r}; accepted: {', '.join(_TARGETS)}")
        num_windows = corpus.numel() // (window + 1)
        if num_windows < batch_size:
            raise ValueError(
                f"corpus of {corpus.numel()} bytes holds {num_windows} windows of "
                f"{window + 1} bytes (window={window} + 1 target), fewer than "
                f"batch_size={batch_size}; use a larger corpus or a smaller window or batch"
            )
        self.window = window
        self.batch_size = batch_size
        self.seed = seed
        self.target: Target = target
        self._windows = corpus[: num_windows * (window + 1)].view(num_windows, window + 1)
        self._epoch = 0
        self._position = 0
        self._order = self._permutation(0)

    @property
    def num_windows(self) -> int:
        """Number of windows in one epoch."""
        return int(self._windows.shape[0])

    def _permutation(self, epoch: int) -> Tensor:
        # Hash (seed, epoch) rather than add them, so that different seeds never share an
        # epoch's order (seed s, epoch e+1 vs seed s+1, epoch e).
        digest = hashlib.sha256(f"bubbleguard.TokenBatches:{self.seed}:{epoch}".encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
        return torch.randperm(self.num_windows, generator=gen)

    def next_batch(self) -> tuple[Tensor, Tensor]:
        """Return the next ``(inputs, targets)`` and advance the cursor.

        Returns:
            int64 ``inputs`` of shape ``(batch_size, window)`` and int64 ``targets`` of shape
            ``(batch_size, window)`` (``next_token``) or ``(batch_size,)`` (``last_token``).
        """
        pieces: list[Tensor] = []
        need = self.batch_size
        while need > 0:
            take = min(need, self.num_windows - self._position)
            pieces.append(self._order[self._position : self._position + take])
            self._position += take
            need -= take
            if self._position == self.num_windows:
                # Step into the next epoch now, so the cursor has one form: position < num_windows.
                self._epoch += 1
                self._position = 0
                self._order = self._permutation(self._epoch)
        rows = self._windows[torch.cat(pieces)].long()
        inputs = rows[:, :-1].contiguous()
        targets = rows[:, 1:].contiguous() if self.target == "next_token" else rows[:, -1].clone()
        return inputs, targets

    def state_dict(self) -> dict[str, Any]:
        """The cursor and the settings it is valid for, as JSON-serialisable plain values.

        ``epoch`` and ``position`` say where the next batch starts; ``num_windows`` guards
        against resuming on a corpus of a different size.
        """
        return {
            "seed": self.seed,
            "epoch": self._epoch,
            "position": self._position,
            "window": self.window,
            "batch_size": self.batch_size,
            "target": self.target,
            "num_windows": self.num_windows,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a cursor saved by :meth:`state_dict`; the next batch is then the one the
        saving iterator would have returned next.

        Raises:
            ValueError: a key is missing, the saved settings (seed, window, batch_size, target,
                num_windows) differ from this iterator's, or the cursor is out of range.
        """
        missing = sorted(set(self.state_dict()) - set(state))
        if missing:
            raise ValueError(f"TokenBatches state is missing key(s): {', '.join(missing)}")
        for key in ("seed", "window", "batch_size", "target", "num_windows"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"TokenBatches state was saved with {key}={state[key]!r} but this iterator "
                    f"has {key}={getattr(self, key)!r}; build it with the saved settings"
                )
        epoch, position = state["epoch"], state["position"]
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ValueError(f"TokenBatches state has invalid epoch={epoch!r}")
        if (
            not isinstance(position, int)
            or isinstance(position, bool)
            or not 0 <= position < self.num_windows
        ):
            raise ValueError(
                f"TokenBatches state has position={position!r}, outside [0, {self.num_windows})"
            )
        self._epoch = epoch
        self._position = position
        self._order = self._permutation(epoch)
