"""A site's trained models and the one it serves: ``state_dir/models/`` (docs/design.md,
"A site's own models").

Each model a run leaves at this site is kept as an *entry*, ``models/<id>/``: a run
directory of its own (``config.yaml`` and the site's ``nodes/<site>.safetensors`` and
``nodes/<site>.model.json``, so :func:`~p2pfl.export.classify` and
:func:`~p2pfl.export.export_model` read it as they read a run) and ``entry.json`` (which
run, cycle, round and data version it came from, its held-out accuracy, its status and
why). The model served is the personalized one the site's node trained, its personal part
included, never a global one.

**The promotion gate** (:func:`gate`): a new entry replaces the served one only when it
scores at least the served one's accuracy minus ``min_delta`` on the site's own held-out
data, both scored by the same function at the same time; a refused entry is kept, with the
reason. ``models/current.json`` names the served entry and the ones served before it (for
:meth:`ModelStore.rollback`); it and ``models/current.onnx`` (the served model for servers
that read ONNX) are replaced atomically, so a reader sees the old model or the new one,
never a mix. Every change holds ``models/.lock`` (``flock``): the daemon and ``p2pfl
models`` may change the store at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from p2pfl.errors import P2PFLError
from p2pfl.files import write_bytes_atomic

CANDIDATE, PROMOTED, REFUSED, RETIRED = "candidate", "promoted", "refused", "retired"
STATUSES = (CANDIDATE, PROMOTED, REFUSED, RETIRED)
CURRENT = "current.json"
CURRENT_ONNX = "current.onnx"
_ID = re.compile(r"^[A-Za-z0-9_.-]{1,96}$")


class ModelStoreError(P2PFLError, ValueError):
    """A request the store cannot do (no such entry, nothing to roll back to); the message
    names the store and the entry."""


LOWER_IS_BETTER = ("mae", "rmse")
"""The gate's metrics whose smaller values are better (errors); the others are scores."""


def gate(
    candidate: float, served: float | None, min_delta: float, metric: str = "accuracy"
) -> str | None:
    """Why a model scoring ``candidate`` on the site's held-out data (``metric``:
    ``promote.metric``) may not replace the served model scoring ``served`` there (None: it
    may). It must be no worse than ``served`` by more than ``min_delta``: a score at least
    ``served − min_delta``, an error (:data:`LOWER_IS_BETTER`) at most ``served +
    min_delta``; with nothing served, any model may."""
    if served is None:
        return None
    if metric in LOWER_IS_BETTER:
        if candidate <= served + min_delta:
            return None
        return (
            f"held-out {metric} {candidate:.4f} is above the served model's {served:.4f} "
            f"plus min_delta {min_delta:g}"
        )
    if candidate >= served - min_delta:
        return None
    return (
        f"held-out {metric} {candidate:.4f} is below the served model's {served:.4f} "
        f"minus min_delta {min_delta:g}"
    )


@dataclass
class ModelEntry:
    """One model kept at a site (``entry.json``)."""

    id: str
    run_id: str
    site: str
    round: int | None = None
    cycle: int | None = None
    data_version: str | None = None
    series: str | None = None  # the series the run was a cycle of
    parent: str | None = None  # the entry its run warm-started from at this site
    added: float = 0.0
    status: str = CANDIDATE
    accuracy: float | None = None  # its held-out ``metric`` when it was judged
    served_accuracy: float | None = None  # the served model's, scored beside it
    metric: str = "accuracy"  # what the two hold: the site's promote.metric then
    reason: str = ""
    history: list[dict[str, Any]] = field(default_factory=list)  # status changes, oldest first

    @classmethod
    def read(cls, path: Path) -> ModelEntry:
        try:
            data = json.loads(path.read_text())
            return cls(**data)
        except (OSError, ValueError, TypeError) as exc:
            raise ModelStoreError(f"{path}: not a readable model entry: {exc}") from None


class ModelStore:
    """The models of site ``site`` under ``state_dir/models``."""

    def __init__(self, state_dir: str | Path, site: str):
        self.root = Path(state_dir) / "models"
        self.site = site

    # ------------------------------------------------------------------ reading
    def entries(self) -> list[ModelEntry]:
        """Every entry, oldest first."""
        if not self.root.is_dir():
            return []
        found = [
            ModelEntry.read(d / "entry.json")
            for d in self.root.iterdir()
            if d.is_dir() and (d / "entry.json").is_file()
        ]
        return sorted(found, key=lambda e: (e.added, e.id))

    def entry(self, entry_id: str) -> ModelEntry:
        path = self.root / entry_id / "entry.json"
        if not _ID.match(entry_id) or not path.is_file():
            known = ", ".join(e.id for e in self.entries()) or "none"
            raise ModelStoreError(f"{self.root}: no model {entry_id!r} (models: {known})")
        return ModelEntry.read(path)

    def path(self, entry_id: str) -> Path:
        """The run directory of entry ``entry_id`` (for classify and export)."""
        return self.root / entry_id

    def served(self) -> ModelEntry | None:
        """The entry served now, None before any was promoted."""
        current = self._current()
        return None if current["current"] is None else self.entry(current["current"])

    def warm_start(self, series: str) -> Path | None:
        """The weights a new cycle of ``series`` starts from at this site: its served model
        when it is of that series, else the latest of the series' models that was ever
        promoted; None when none was (the cycle starts fresh)."""
        served = self.served()
        if served is not None and served.series == series:
            return self.weights(served.id)
        for e in reversed(self.entries()):
            if e.series == series and any(h.get("status") == PROMOTED for h in e.history):
                return self.weights(e.id)
        return None

    def weights(self, entry_id: str) -> Path:
        """Entry ``entry_id``'s safetensors file (``learning.artifacts.weights_path``'s
        layout, named here: the daemon reads it without importing torch)."""
        return self.path(entry_id) / "nodes" / f"{self.site}.safetensors"

    def lineage(self, entry_id: str) -> list[ModelEntry]:
        """The entries ``entry_id`` descends from by warm starts, its parent first (an
        entry since removed ends the chain)."""
        chain: list[ModelEntry] = []
        parent = self.entry(entry_id).parent
        while parent is not None and len(chain) < 10_000:
            try:
                chain.append(self.entry(parent))
            except ModelStoreError:
                break
            parent = chain[-1].parent
        return chain

    def before(self) -> list[str]:
        """The entries served before the current one, oldest first (what rollback takes)."""
        return self._current()["before"]

    def _current(self) -> dict[str, Any]:
        path = self.root / CURRENT
        if not path.is_file():
            return {"current": None, "before": []}
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ModelStoreError(f"{path}: not readable: {exc}") from None
        return {"current": data.get("current"), "before": list(data.get("before", []))}

    # ------------------------------------------------------------------ changing
    def add(
        self,
        run_dir: str | Path,
        run_id: str,
        *,
        round_no: int | None = None,
        cycle: int | None = None,
        data_version: str | None = None,
        series: str | None = None,
        parent: str | None = None,
    ) -> ModelEntry:
        """Keep the model this site's node left in ``run_dir`` as a new entry (a
        candidate); :class:`~p2pfl.learning.artifacts.ExportError` when the run holds none."""
        from p2pfl.export import ExportError  # deferred: the daemon imports no torch
        from p2pfl.export.model import info_path, weights_path

        run = Path(run_dir)
        sources = [
            run / "config.yaml",
            weights_path(run, self.site),
            info_path(run, self.site),
        ]
        for src in sources:
            if not src.is_file():
                raise ExportError(f"{src}: no such file: run {run_id} left no model of {self.site}")
        with self._locked():
            entry_id = self._new_id(run_id if cycle is None else f"{run_id}.c{cycle}")
            tmp = self.root / f".{entry_id}.{uuid.uuid4().hex[:8]}"
            (tmp / "nodes").mkdir(parents=True)
            try:
                shutil.copy2(sources[0], tmp / "config.yaml")
                for src in sources[1:]:
                    shutil.copy2(src, tmp / "nodes" / src.name)
                entry = ModelEntry(
                    entry_id,
                    run_id,
                    self.site,
                    round=round_no,
                    cycle=cycle,
                    data_version=data_version,
                    series=series,
                    parent=parent,
                    added=time.time(),
                )
                entry.history.append({"status": CANDIDATE, "at": entry.added, "why": "added"})
                _write_json(tmp / "entry.json", asdict(entry))
                tmp.rename(self.root / entry_id)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return entry

    def judge(
        self,
        entry_id: str,
        score: Callable[[Path], float],
        min_delta: float,
        metric: str = "accuracy",
    ) -> ModelEntry:
        """The promotion gate: score entry ``entry_id`` and the served entry with ``score``
        (a run directory → its ``metric`` on the site's held-out data; the entry's
        ``accuracy`` and ``served_accuracy`` fields hold it), then promote it (:func:`gate`
        lets it) or keep it refused, with the reason."""
        with self._locked():
            entry = self.entry(entry_id)
            served = self.served()
            entry.metric = metric
            entry.accuracy = float(score(self.path(entry_id)))
            entry.served_accuracy = None if served is None else float(score(self.path(served.id)))
            why = gate(entry.accuracy, entry.served_accuracy, min_delta, metric)
            if why is None:
                self._promote(entry, "passed the promotion gate")
            else:
                self._set_status(entry, REFUSED, why)
        return self.entry(entry_id)

    def promote(self, entry_id: str, why: str = "promoted by hand") -> ModelEntry:
        """Serve entry ``entry_id`` from now on, whatever the gate said of it."""
        with self._locked():
            entry = self.entry(entry_id)
            if self._current()["current"] == entry_id:
                raise ModelStoreError(f"{self.root}: model {entry_id!r} is served already")
            self._promote(entry, why)
        return self.entry(entry_id)

    def rollback(self) -> ModelEntry:
        """Serve again the entry served before the current one; the current one is retired."""
        with self._locked():
            current = self._current()
            if current["current"] is None or not current["before"]:
                raise ModelStoreError(f"{self.root}: no model served before this one")
            back = self.entry(current["before"][-1])
            gone = self.entry(current["current"])
            self._switch(back.id, current["before"][:-1])
            self._set_status(gone, RETIRED, f"rolled back to {back.id}")
            self._set_status(back, PROMOTED, f"rolled back from {gone.id}")
        return back

    # ------------------------------------------------------------------ inside the lock
    def _promote(self, entry: ModelEntry, why: str) -> None:
        current = self._current()
        before = current["before"]
        if current["current"] is not None:
            before = [*before, current["current"]]
        self._switch(entry.id, before)
        if current["current"] is not None:
            self._set_status(self.entry(current["current"]), RETIRED, f"replaced by {entry.id}")
        self._set_status(entry, PROMOTED, why)

    def _switch(self, entry_id: str, before: list[str]) -> None:
        """Serve ``entry_id``: ``current.onnx`` first, then ``current.json`` (what the
        server reads), each replaced atomically."""
        from p2pfl.export import export_model  # deferred: the daemon imports no torch

        export_model(self.path(entry_id), self.site, "onnx", self.root / CURRENT_ONNX)
        _write_json(self.root / CURRENT, {"current": entry_id, "before": before})

    def _set_status(self, entry: ModelEntry, status: str, why: str) -> None:
        entry.status, entry.reason = status, why
        entry.history.append({"status": status, "at": time.time(), "why": why})
        _write_json(self.root / entry.id / "entry.json", asdict(entry))

    def _new_id(self, base: str) -> str:
        stem = re.sub(r"[^A-Za-z0-9_.-]", "-", base)[:80] or "model"
        entry_id, n = stem, 1
        while (self.root / entry_id).exists():
            n += 1
            entry_id = f"{stem}.{n}"
        return entry_id

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


def _write_json(path: Path, data: Any) -> None:
    """Write ``data`` to ``path`` as JSON, whole or not at all."""
    write_bytes_atomic(path, json.dumps(data, indent=1, sort_keys=True).encode())
