"""Atomic, verified, resumable checkpoints.

Layout (Megatron-LM's, ``torch`` format)::

    <save>/latest_checkpointed_iteration.txt      the marker, replaced atomically after a commit
    <save>/iter_0000010/manifest.json             written last: every file's size and sha256
    <save>/iter_0000010/mp_rank_00[_PPP]/model_optim_rng.pt   one shard per pipeline stage

A save writes into ``<save>/.tmp.iter_XXXXXXX/``; data-parallel rank 0 of each stage writes its
stage's shard (and a small sidecar with its checksum, hashed from the bytes in memory, so nothing
is read back); rank 0 then writes the manifest, renames the directory into place and only then
moves the marker. A crash at any point leaves either the previous checkpoint or a ``.tmp``
directory that nothing treats as a checkpoint. Loading verifies the manifest and falls back to the
newest older checkpoint that verifies, saying which one and why.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mlaunch import envcontract, telemetry
from mlaunch.model.groups import SpanGroup
from mlaunch.model.spans import Attr, SpanName
from mlaunch.rundir import layout as lay
from mlaunch.rundir.atomic import fsync_dir, write_atomic
from mlaunch.trainer.parallel import Topology

# The layout's names are the run-directory schema's (the launcher reads them too).
TRACKER_FILE = lay.CHECKPOINT_TRACKER_FILE
MANIFEST_FILE = lay.CHECKPOINT_MANIFEST_FILE
MODEL_FILE = lay.CHECKPOINT_MODEL_FILE
_SIDECAR = ".sha256.json"

Log = Callable[[str], None]


def iter_dir_name(iteration: int) -> str:
    """``iter_0000010`` for iteration 10."""
    return lay.CHECKPOINT_ITER_DIR.name(iteration)


def shard_dir_name(pp_rank: int, pp: int) -> str:
    """Megatron's shard directory: ``mp_rank_00`` without PP, ``mp_rank_00_001`` with it."""
    return "mp_rank_00" if pp == 1 else f"mp_rank_00_{pp_rank:03d}"


def _barrier(topo: Topology) -> None:
    if topo.distributed and topo.world_size > 1:
        dist.barrier()


SHARED_TOKEN_PREFIX = ".mlaunch-shared-check-"


class SaveDirNotShared(RuntimeError):
    """The save directory is not one directory for every node (see :func:`check_shared`)."""


def check_shared(root: str | Path, topo: Topology, environ: dict[str, str] | None = None) -> None:
    """Stop at start-up when ``root`` is not shared by every node of the job.

    Saves and resumes assume one directory that every node sees (rank 0 creates and commits the
    iteration directory, each stage's writer puts its shard in it, every rank reads its shard on
    resume). On nodes without a shared filesystem that fails late (a writer's ``mkdir`` or a resume's
    ``torch.load``), or worse, resumes nodes from different iterations. So: rank 0 writes a fresh
    token file there, and the local rank 0 of every node looks for it; if any node does not see it,
    every rank raises :class:`SaveDirNotShared` naming the ranks that did not. Single-node jobs
    (``LOCAL_WORLD_SIZE == WORLD_SIZE``) skip the check: one filesystem is trivially shared.
    Collective over all ranks."""
    env = os.environ if environ is None else environ
    if not (topo.distributed and topo.world_size > 1):
        return
    local_world = int(env.get("LOCAL_WORLD_SIZE", str(topo.world_size)) or topo.world_size)
    if local_world >= topo.world_size:
        return
    root = Path(root)
    nonce = torch.zeros(1, dtype=torch.int64, device=topo.device)
    if topo.rank == 0:
        nonce[0] = int.from_bytes(os.urandom(7), "big")
    dist.broadcast(nonce, src=0)
    token = root / f"{SHARED_TOKEN_PREFIX}{int(nonce.item()):014x}"
    if topo.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        write_atomic(
            token, b"written by rank 0 to check that every node sees this directory\n", fsync=True
        )
    _barrier(topo)
    missing = torch.zeros(topo.world_size, dtype=torch.int64, device=topo.device)
    if int(env.get("LOCAL_RANK", "0") or 0) == 0 and not token.is_file():
        missing[topo.rank] = 1
    dist.all_reduce(missing)
    if topo.rank == 0:
        token.unlink(missing_ok=True)
    absent = [r for r, flag in enumerate(missing.tolist()) if flag]
    if absent:
        raise SaveDirNotShared(
            f"--save {root} is not shared between the nodes: rank 0 wrote {token.name} there, "
            f"but the local rank 0 of the node(s) of rank(s) {', '.join(map(str, absent))} does "
            "not see it. Checkpoints need one directory every node sees (a shared filesystem at "
            "the same path); give --save such a directory, or run without --save"
        )


def committed_iterations(root: Path) -> list[int]:
    """Iterations with a committed (renamed into place) directory, oldest first."""
    if not root.is_dir():
        return []
    found = (lay.CHECKPOINT_ITER_DIR.parse(p.name) for p in root.iterdir() if p.is_dir())
    return sorted(it for it in found if it is not None)


def save_checkpoint(
    root: str | Path,
    iteration: int,
    topo: Topology,
    build_state: Callable[[], dict[str, Any]],
    *,
    keep_last: int,
    log: Log,
) -> None:
    """Save this stage's shard of iteration ``iteration`` (collective over all ranks)."""
    root = Path(root)
    final = root / iter_dir_name(iteration)
    tmp = root / (lay.CHECKPOINT_TMP_PREFIX + iter_dir_name(iteration))
    writer = topo.dp_rank == 0
    with telemetry.span(
        SpanGroup.CHECKPOINT, SpanName.CHECKPOINT_SAVE, {Attr.ITERATION: iteration}
    ):
        with telemetry.span(SpanGroup.CHECKPOINT, SpanName.CHECKPOINT_SAVE_STATE_DICT):
            state = build_state() if writer else None
        with telemetry.span(SpanGroup.CHECKPOINT, SpanName.CHECKPOINT_SAVE_IO_WRITE):
            if topo.rank == 0:
                with telemetry.trace_region("checkpoint.prepare"):
                    root.mkdir(parents=True, exist_ok=True)
                    for stale in root.glob(lay.CHECKPOINT_TMP_GLOB):  # left over by crashed saves
                        shutil.rmtree(stale, ignore_errors=True)
                    tmp.mkdir()
            _barrier(topo)
            if writer:
                shard = tmp / shard_dir_name(topo.pp_rank, topo.pp)
                shard.mkdir()
                with telemetry.trace_region("checkpoint.serialize"):
                    buf = io.BytesIO()
                    torch.save(state, buf)
                    data = buf.getvalue()
                with telemetry.trace_region("checkpoint.write"):
                    rel = f"{shard.name}/{MODEL_FILE}"
                    with open(shard / MODEL_FILE, "wb") as f:
                        f.write(data)
                        f.flush()
                        os.fsync(f.fileno())
                    entry = {
                        "path": rel,
                        "size": len(data),
                        "sha256": hashlib.sha256(data).hexdigest(),
                    }
                    (shard / _SIDECAR).write_text(json.dumps(entry))
                _maybe_pause_in_save(iteration, topo.rank, root)
            _barrier(topo)
            if topo.rank == 0:
                with telemetry.trace_region("checkpoint.commit"):
                    _commit(root, tmp, final, iteration, topo.pp)
                    _prune(root, keep_last)
            _barrier(topo)
    log(f"saved checkpoint {final}")


def _maybe_pause_in_save(iteration: int, rank: int, root: Path) -> None:
    """The test hook MLAUNCH_TEST_PAUSE_IN_SAVE=k: after writing iteration k's shard data and before
    the manifest and the rename, announce the pause (``<save>/.paused-in-save-rank{R}``) and wait,
    so a test can kill -9 the process in the middle of a save."""
    at = os.environ.get(envcontract.PAUSE_IN_SAVE)
    if not at or int(at) != iteration:
        return
    (root / f".paused-in-save-rank{rank}").write_text(f"{os.getpid()}\n")
    time.sleep(3600)  # the test kills us long before this ends


def _commit(root: Path, tmp: Path, final: Path, iteration: int, pp: int) -> None:
    files = []
    for stage in range(pp):
        sidecar = tmp / shard_dir_name(stage, pp) / _SIDECAR
        files.append(json.loads(sidecar.read_text()))
        sidecar.unlink()
    # One manifest covers every stage's shard: an iteration is valid only when all stages saved it,
    # so pipeline stages can never resume from different iterations.
    manifest = {"iteration": iteration, "format": "torch", "pipeline_stages": pp, "files": files}
    # The manifest is written last: a directory without one never verifies.
    write_atomic(tmp / MANIFEST_FILE, json.dumps(manifest, indent=1), fsync=True)
    fsync_dir(tmp)
    if final.exists():  # re-saving an iteration after a resume
        shutil.rmtree(final)
    # A directory rename, not rundir.atomic's file write: the shards are written in place in
    # ``tmp`` (too large to copy) and the folder is renamed whole; the tracker, written last
    # through write_atomic, is what makes it the resume point.
    os.replace(tmp, final)
    fsync_dir(root)
    write_atomic(root / TRACKER_FILE, f"{iteration}\n", fsync=True)
    fsync_dir(root)


def _prune(root: Path, keep_last: int) -> None:
    if keep_last <= 0:
        return
    for it in committed_iterations(root)[:-keep_last]:
        shutil.rmtree(root / iter_dir_name(it), ignore_errors=True)


def verify(directory: Path) -> str | None:
    """Why ``directory`` is not a valid checkpoint, or None when its manifest checks out."""
    manifest_path = directory / MANIFEST_FILE
    if not manifest_path.is_file():
        return "no manifest (the save did not finish)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        stages = int(manifest.get("pipeline_stages", 1))
        paths = {entry["path"] for entry in files}
    except (ValueError, KeyError, TypeError) as exc:
        return f"unreadable manifest ({exc})"
    # Every pipeline stage's shard must be listed (and verify below), not just the ones present.
    missing = [
        shard_dir_name(stage, stages)
        for stage in range(stages)
        if f"{shard_dir_name(stage, stages)}/{MODEL_FILE}" not in paths
    ]
    if missing:
        return f"the manifest lists no shard for {', '.join(missing)} of {stages} pipeline stages"
    for entry in files:
        path = directory / entry["path"]
        if not path.is_file():
            return f"{entry['path']} is missing"
        size = path.stat().st_size
        if size != entry["size"]:
            return f"{entry['path']} has {size} bytes, the manifest says {entry['size']}"
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        if digest.hexdigest() != entry["sha256"]:
            return f"{entry['path']} fails its sha256 check"
    return None


def find_valid_checkpoint(root: Path, log: Log) -> int | None:
    """The iteration to resume from: the marker's, else the newest older one that verifies."""
    marker: int | None = None
    try:
        marker = int((root / TRACKER_FILE).read_text().strip())
    except (OSError, ValueError) as exc:
        if root.is_dir() and committed_iterations(root):
            log(f"checkpoint marker {root / TRACKER_FILE} unusable ({exc}); scanning directories")
    candidates = [
        it for it in reversed(committed_iterations(root)) if marker is None or it <= marker
    ]
    if marker is not None and marker not in candidates:
        log(f"checkpoint {root / iter_dir_name(marker)} named by the marker does not exist")
    found = None
    for it in candidates:
        problem = verify(root / iter_dir_name(it))
        if problem is None:
            found = it
            break
        log(f"checkpoint {root / iter_dir_name(it)} is invalid: {problem}; trying the previous one")
    for unfinished in sorted(root.glob(lay.CHECKPOINT_TMP_GLOB)) if root.is_dir() else ():
        log(
            f"ignoring unfinished checkpoint save {unfinished} (no manifest: the save did not finish)"
        )
    return found


def has_checkpoint(root: str | Path) -> bool:
    """Whether ``root`` holds anything a resume could start from (a marker or a committed
    directory); verification happens at load time."""
    root = Path(root)
    return (root / TRACKER_FILE).is_file() or bool(committed_iterations(root))


def load_checkpoint(
    root: str | Path, topo: Topology, log: Log
) -> tuple[int, dict[str, Any] | None]:
    """Rank 0 picks a verified checkpoint and tells everyone; each rank reads its stage's shard.

    Returns (iteration, state) or (0, None) when there is nothing to resume from. Runs inside the
    caller's ``megatron.load_checkpoint`` span.
    """
    root = Path(root)
    chosen = -1
    if topo.rank == 0:
        with telemetry.trace_region("checkpoint.verify"):
            found = find_valid_checkpoint(root, log)
        chosen = -1 if found is None else found
    if topo.distributed and topo.world_size > 1:
        t = torch.tensor([chosen], dtype=torch.int64, device=topo.device)
        dist.broadcast(t, src=0)
        chosen = int(t.item())
    if chosen < 0:
        log(f"no valid checkpoint in {root}; starting from scratch")
        return 0, None
    path = root / iter_dir_name(chosen) / shard_dir_name(topo.pp_rank, topo.pp) / MODEL_FILE
    with (
        telemetry.span(SpanGroup.LOAD_CHECKPOINT, SpanName.CHECKPOINT_LOAD_IO_READ),
        telemetry.trace_region("checkpoint.read"),
    ):
        # weights_only=False: the file passed the manifest's sha256 check and holds RNG
        # states and the scheduler dict next to the tensors.
        state = torch.load(path, map_location="cpu", weights_only=False)
    newest = _newest_attempted(root) if topo.rank == 0 else None
    if newest is not None and newest > chosen:
        log(
            f"resuming from checkpoint {root / iter_dir_name(chosen)}, the previous valid one "
            f"(the save of iteration {newest} is unfinished or damaged)"
        )
    else:
        log(f"resuming from checkpoint {root / iter_dir_name(chosen)}")
    return chosen, state


def _newest_attempted(root: Path) -> int | None:
    """The newest iteration a save was started for: committed or left unfinished (``.tmp``)."""
    found = committed_iterations(root)
    for tmp in root.glob(lay.CHECKPOINT_TMP_GLOB):
        it = lay.CHECKPOINT_ITER_DIR.parse(tmp.name.removeprefix(lay.CHECKPOINT_TMP_PREFIX))
        if it is not None:
            found.append(it)
    return max(found) if found else None


def resume_from_save(save: str | None, topo: Topology, log: Log) -> str | None:
    """``--load`` defaults to ``--save`` when a checkpoint is there (Megatron's convention), in
    the trainer itself: a torchrun restart re-runs the same argv and must resume, not start
    over. Rank 0 decides and tells everyone, so all ranks take the same (collective) path."""
    if not save:
        return None
    found = has_checkpoint(save) if topo.rank == 0 else False
    if topo.distributed and topo.world_size > 1:
        t = torch.tensor([int(found)], dtype=torch.int64, device=topo.device)
        dist.broadcast(t, src=0)
        found = bool(t.item())
    if found:
        log(f"--load not given: resuming from --save {save}, which holds a checkpoint")
    return save if found else None
