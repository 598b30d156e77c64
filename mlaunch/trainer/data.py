"""Byte-level text data: the corpus (a file, a folder, or a default that needs no download), the
train / held-out split, and deterministic batches.

Batch ``b`` of a split is a pure function of (seed, b): every rank draws the same global batch and
keeps its own rows, so the data position is just the number of batches consumed, data parallelism
sees exactly the rows a single process would, and a resume continues the same sequence.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from mlaunch.model.corpus import text_files

#: The default corpus is capped so setup stays fast and identical on every machine with the
#: same Python (files are read in sorted order, so the cap cuts at the same place).
DEFAULT_CORPUS_BYTES = 4 * 1024 * 1024
_EVAL_STREAM = 1 << 40  # separates the eval generator seeds from the train ones


def _read_files(files: Iterable[Path], cap: int | None) -> bytes:
    chunks: list[bytes] = []
    total = 0
    for f in files:
        data = f.read_bytes()
        if cap is not None and total + len(data) > cap:
            chunks.append(data[: cap - total])
            break
        chunks.append(data)
        total += len(data)
    return b"\n".join(chunks)


#: Folders of the standard library left out of the default corpus.
_NOT_CORPUS = frozenset({"site-packages", "test"})


def _python_files_in_order(folder: Path) -> Iterator[Path]:
    """The ``*.py`` files under ``folder`` (symlinked folders not followed, :data:`_NOT_CORPUS`
    skipped), in the order of their paths as text, found as they are read: the cap is reached
    a few folders in, and listing the whole standard library first (18,000 paths) cost every
    rank most of a CPU-second at startup. A folder sorts as its name plus "/", which is where
    the text of its files' paths falls among its siblings'."""
    try:
        with os.scandir(folder) as it:
            entries = [(e.name + "/" if e.is_dir(follow_symlinks=False) else e.name, e) for e in it]
    except PermissionError:
        return
    for key, entry in sorted(entries, key=lambda ke: ke[0]):
        if key.endswith("/"):
            if entry.name not in _NOT_CORPUS:
                yield from _python_files_in_order(Path(entry.path))
        elif entry.name.endswith(".py"):
            yield Path(entry.path)


def default_corpus(cap: int = DEFAULT_CORPUS_BYTES) -> bytes:
    """The source of Python's standard library (sorted, capped): text that exists on every
    machine that runs this trainer, with no download."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if _NOT_CORPUS & set(root.parts):
        return _read_files([], cap)
    return _read_files(_python_files_in_order(root), cap)


def load_corpus(data_path: str | None) -> bytes:
    """The raw bytes to train on: ``data_path`` (a file, or a folder read in sorted order) or the
    default corpus."""
    if data_path is None:
        return default_corpus()
    path = Path(data_path)
    if path.is_dir():
        return _read_files(text_files(path), None)
    return path.read_bytes()


@dataclass
class Batch:
    """One iteration's rows for this rank, split into microbatches."""

    tokens: list[torch.Tensor]  # [micro, seq] int64 inputs per microbatch
    targets: list[torch.Tensor]  # [micro, seq] int64 next-token targets per microbatch


class TokenData:
    """A byte corpus split into a training part and a held-out tail, with deterministic batches."""

    def __init__(self, corpus: bytes, *, seq_length: int, eval_fraction: float, seed: int) -> None:
        tokens = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
        n_eval = max(seq_length + 2, int(len(tokens) * eval_fraction))
        if len(tokens) - n_eval < seq_length + 2:
            raise ValueError(
                f"the corpus has {len(tokens)} bytes, too few for --seq-length {seq_length} with a "
                "held-out split; give a larger --data-path or a shorter --seq-length"
            )
        self.train = tokens[:-n_eval]
        self.eval = tokens[-n_eval:]
        self.seq_length = seq_length
        self.seed = seed

    def batch(
        self,
        index: int,
        *,
        global_batch: int,
        first_row: int,
        micro: int,
        num_micro: int,
        eval_split: bool = False,
    ) -> Batch:
        """Rows ``first_row .. first_row + micro*num_micro`` of global batch ``index``."""
        source = self.eval if eval_split else self.train
        g = torch.Generator().manual_seed(
            self.seed * 1_000_003 + index + (_EVAL_STREAM if eval_split else 0)
        )
        starts = torch.randint(0, len(source) - self.seq_length - 1, (global_batch,), generator=g)
        rows = starts[first_row : first_row + micro * num_micro]
        window = torch.arange(self.seq_length + 1)
        sample = source[rows[:, None] + window].long()  # [rows, seq+1]
        x, y = sample[:, :-1], sample[:, 1:]
        return Batch(list(x.split(micro)), list(y.split(micro)))

    def prompt(self, length: int) -> torch.Tensor:
        """The first ``length`` held-out bytes, used as the text-completion prompt."""
        return self.eval[:length].long()


def decode(tokens: torch.Tensor | list[int]) -> str:
    """Bytes back to text (invalid UTF-8 replaced)."""
    values = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
    return bytes(int(v) for v in values).decode("utf-8", errors="replace")
