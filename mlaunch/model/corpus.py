"""What counts as training text in a ``--data-path`` (stdlib only: settings validate it before
launch, the trainer reads it after)."""

from __future__ import annotations

from pathlib import Path

#: File suffixes read from a ``--data-path`` folder ("" = no suffix, e.g. ``README``).
TEXT_SUFFIXES = frozenset({".txt", ".md", ".rst", ".py", ".json", ".jsonl", ".csv", ".html", ""})


def text_files(folder: Path) -> list[Path]:
    """The files of ``folder`` (recursively) the trainer reads, in its order."""
    return sorted(
        (p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES),
        key=lambda p: p.relative_to(folder).as_posix(),
    )


def empty_data_problem(data_path: str) -> str | None:
    """Why ``data_path`` has nothing to train on (an empty file, a folder with no non-empty text
    file), or None. Only cheap checks: sizes, never contents."""
    path = Path(data_path)
    try:
        if path.is_dir():
            if not any(p.stat().st_size > 0 for p in text_files(path)):
                suffixes = ", ".join(sorted(s for s in TEXT_SUFFIXES if s))
                return (
                    f"{data_path!r} holds no non-empty text file ({suffixes} or no suffix);"
                    " give a folder with text in it, or a text file"
                )
        elif path.is_file() and path.stat().st_size == 0:
            return f"{data_path!r} is empty; give a text file with something to train on"
    except OSError as exc:
        return f"{data_path!r} cannot be read ({exc.strerror or exc})"
    return None
