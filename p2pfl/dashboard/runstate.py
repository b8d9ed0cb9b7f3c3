"""The run directory as the dashboard reads it, while the run writes it (layout:
:mod:`p2pfl.metrics`).

:class:`JsonlTail` reads one node's ``nodes/<id>.jsonl`` incrementally: each poll reads only
the bytes appended since the last one, keeps a last line without its newline until it is
complete (a record being written), skips and counts a malformed line, and starts over when
the file is truncated or replaced (a new run into the same directory).

:class:`RunState` holds the run: the topology from ``config.yaml`` (reloaded when the file
changes), every node's records (only the fields the page shows, :func:`kept_fields`) and
``summary.json``. The files are the run's own but may be hand-edited or from another
version: nothing in them is assumed well-formed.

A node's robustness facts (p2pfl/services/bundle.py, ``robust_facts``; docs/design.md,
"Robust aggregation") are kept apart from its records, in a :class:`Robustness` updated as
each record is read: its latest record's ``rejected``, ``distrusted``, ``capped``,
``attack`` and ``diverged``, the refusals and rollbacks so far, and the last reason it gave
for refusing each peer. Records of older runs lack them: absent means none.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from p2pfl.check.load import load_yaml
from p2pfl.config.schema import BrokerAddress, TopologyConfig
from p2pfl.errors import P2PFLError
from p2pfl.metrics import method_facts

log = logging.getLogger(__name__)

# what the dashboard shows of a round record (p2pfl/services/bundle.py, ``round_record``,
# fills it for both drivers); the rest is dropped to bound memory
KEPT_FIELDS = (
    "round",
    "test_acc",
    "bytes_sent",
    "bytes_recv",
    "round_s",
    "t",
    "peers",
    "chosen",
    "pulled",
    "dropout",
    "aggregator",
    "attempt",
    "observer",
    "caught_up_from",
    "epsilon",  # privacy.dp only
    "dp_exhausted",
)
# the method's facts it shows (UA-PDFL's decisions, whose states a merge took), kept beside
# the fields above: a record has them under its ``method`` map, an older run's record at
# its top level (:func:`p2pfl.metrics.method_facts`)
KEPT_METHOD_FACTS = ("dropout_peer", "h_peers", "merged_from")
MAX_PEERS = 512  # entries kept of one record's peer maps (rejected, distrusted, capped)
MAX_REASON = 200  # characters kept of a refusal's reason
MAX_LINE_BYTES = 1 << 20  # a longer "line" is not a record of ours: skipped
READ_CHUNK = 8 << 20  # at most this much of one file per poll


@dataclass
class JsonlTail:
    """The complete JSON-object lines appended to ``path`` since the last :meth:`poll`."""

    path: Path
    max_line: int = MAX_LINE_BYTES
    offset: int = 0
    malformed: int = 0  # complete lines that were not a JSON object, skipped
    _inode: int | None = None
    _partial: bytes = b""
    _skipping: bool = False  # inside an overlong line: drop bytes up to its newline

    def _restart(self, inode: int | None) -> None:
        self.offset, self._partial, self._skipping, self._inode = 0, b"", False, inode

    def poll(self) -> tuple[list[dict[str, Any]], bool]:
        """``(new records, reset)``: ``reset`` is True when the file was truncated, replaced
        or removed since the last poll, and the records start from its beginning again."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            reset = self._inode is not None
            self._restart(None)
            return [], reset
        reset = False
        if self._inode is not None and (st.st_ino != self._inode or st.st_size < self.offset):
            reset = True
        if reset or self._inode is None:
            self._restart(st.st_ino)
        if st.st_size == self.offset:
            return [], reset
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read(min(st.st_size - self.offset, READ_CHUNK))
        except OSError as exc:
            log.debug("%s: not read: %s", self.path, exc)
            return [], reset
        self.offset += len(data)
        return self._lines(data), reset

    def _lines(self, data: bytes) -> list[dict[str, Any]]:
        out = []
        *complete, rest = (self._partial + data).split(b"\n")
        for line in complete:
            if self._skipping:  # the end of an overlong line
                self._skipping = False
                continue
            if not line.strip():
                continue
            rec = _parse(line) if len(line) <= self.max_line else None
            if rec is None:
                self.malformed += 1
            else:
                out.append(rec)
        if len(rest) > self.max_line:
            if not self._skipping:
                self.malformed += 1
            self._skipping, rest = True, b""
        self._partial = rest
        return out


def _parse(line: bytes) -> dict[str, Any] | None:
    try:
        rec = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    return rec if isinstance(rec, dict) else None


def kept_fields(rec: dict[str, Any]) -> dict[str, Any]:
    """What the page keeps of a record: its :data:`KEPT_FIELDS`, and the method's facts of
    :data:`KEPT_METHOD_FACTS` (from its ``method`` map, or its top level in an older run)."""
    kept = {k: rec[k] for k in KEPT_FIELDS if k in rec}
    facts = method_facts(rec)
    kept.update({k: facts[k] for k in KEPT_METHOD_FACTS if k in facts})
    return kept


def _round_of(rec: dict[str, Any]) -> int | None:
    r = rec.get("round")
    return r if isinstance(r, int) and not isinstance(r, bool) and r >= 0 else None


def finite(value: Any) -> float | None:
    """``value`` as a float when it is a finite number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _peer_map(value: Any, conv: Any) -> dict[str, Any]:
    """A record's ``{peer id: value}`` field, each value through ``conv`` (None: dropped);
    anything but a dict is empty."""
    if not isinstance(value, dict):
        return {}
    out = {}
    for peer, v in value.items():
        if len(out) >= MAX_PEERS:
            break
        if isinstance(peer, str) and peer and len(peer) <= 128:
            v = conv(v)
            if v is not None:
                out[peer] = v
    return out


def _reason(value: Any) -> str:
    return (value if isinstance(value, str) else json.dumps(value, default=str))[:MAX_REASON]


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _diverged(value: Any) -> dict[str, Any] | None:
    """A record's ``diverged``: None, or ``{"merged_from": [ids], "rolled_back_to": round
    or None}``."""
    if not value:
        return None
    value = value if isinstance(value, dict) else {}
    merged = value.get("merged_from")
    return {
        "merged_from": [p for p in merged if isinstance(p, str)][:MAX_PEERS]
        if isinstance(merged, list)
        else [],
        "rolled_back_to": _int(value.get("rolled_back_to")),
    }


@dataclass
class Robustness:
    """One node's robustness facts, as its records have told them so far."""

    rejected: dict[str, str] = field(default_factory=dict)  # latest record: peer -> reason
    distrusted: dict[str, int] = field(default_factory=dict)  # peer -> drawn again from
    capped: dict[str, float] = field(default_factory=dict)  # peer -> the count it claimed
    attack: list[str] | None = None  # latest record's attack kinds (None: not an attacker)
    diverged: dict[str, Any] | None = None  # latest record's rollback
    refusals: int = 0  # peers refused over all its records
    rollbacks: int = 0  # records with a rollback
    # peer -> (round, reason) of the latest record that refused it
    last_refused: dict[str, tuple[int, str]] = field(default_factory=dict)

    def update(self, rec: dict[str, Any], round_no: int) -> None:
        """Take in the node's next record (``rec``, of round ``round_no``)."""
        self.rejected = _peer_map(rec.get("rejected"), _reason)
        self.distrusted = _peer_map(rec.get("distrusted"), _int)
        self.capped = _peer_map(rec.get("capped"), finite)
        attack = rec.get("attack")
        self.attack = (
            [k[:64] for k in attack if isinstance(k, str)][:16]
            if isinstance(attack, list)
            else None
        )
        self.diverged = _diverged(rec.get("diverged"))
        self.refusals += len(self.rejected)
        self.rollbacks += self.diverged is not None
        for peer, reason in self.rejected.items():
            if peer in self.last_refused or len(self.last_refused) < MAX_PEERS:
                self.last_refused[peer] = (round_no, reason)


@dataclass
class _FileMark:
    """What a whole-file read saw (to re-read only when the file changes)."""

    inode: int = -1
    mtime_ns: int = -1
    size: int = -1

    @classmethod
    def of(cls, path: Path) -> _FileMark | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        return cls(st.st_ino, st.st_mtime_ns, st.st_size)


@dataclass
class RunState:
    """A run directory, refreshed by :meth:`refresh` (cheap when nothing changed)."""

    run_dir: Path
    cfg: TopologyConfig | None = None
    config_error: str | None = None
    records: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    robust: dict[str, Robustness] = field(default_factory=dict)  # per node, when recorded
    summary: dict[str, Any] | None = None
    version: int = 0  # grows whenever anything above changes
    _tails: dict[str, JsonlTail] = field(default_factory=dict)
    _config_mark: _FileMark | None = None
    _summary_mark: _FileMark | None = None

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)

    @property
    def node_ids(self) -> list[str]:
        return self.cfg.node_ids if self.cfg is not None else []

    @property
    def config_path(self) -> Path:
        return self.run_dir / "config.yaml"

    @property
    def finished(self) -> bool:
        """Whether the run is over: ``summary.json`` (the launcher writes it last, and
        ``p2pfl summarize`` after) is at least as new as ``config.yaml``."""
        if self.summary is None or self._summary_mark is None or self._config_mark is None:
            return False
        return self._summary_mark.mtime_ns >= self._config_mark.mtime_ns

    def broker(self) -> BrokerAddress | None:
        """The broker the run's config names (None: none known, or found by mDNS)."""
        if self.cfg is None or self.cfg.broker.mdns:
            return None
        return self.cfg.broker

    def refresh(self) -> bool:
        """Re-read what changed: the config, new record lines, the summary. True when
        anything did."""
        changed = self._refresh_config()
        for nid in self.node_ids:
            tail = self._tails.get(nid)
            if tail is None:
                tail = self._tails[nid] = JsonlTail(self.run_dir / "nodes" / f"{nid}.jsonl")
            new, reset = tail.poll()
            if reset and self.records.get(nid):
                self.records[nid] = []
                self.robust.pop(nid, None)
                changed = True
            kept = []
            for rec in new:
                r = _round_of(rec)
                if r is None:
                    continue
                kept.append(kept_fields(rec))
                self.robust.setdefault(nid, Robustness()).update(rec, r)
            if kept:
                self.records.setdefault(nid, []).extend(kept)
                changed = True
        changed = self._refresh_summary() or changed
        if changed:
            self.version += 1
        return changed

    def _refresh_config(self) -> bool:
        mark = _FileMark.of(self.config_path)
        if mark == self._config_mark:
            return False
        self._config_mark = mark
        if mark is None:
            had = self.cfg is not None
            self.cfg, self.config_error = None, "waiting for config.yaml"
            return had
        try:
            cfg = TopologyConfig.model_validate(load_yaml(self.config_path))
        except (P2PFLError, ValidationError, ValueError) as exc:
            self.config_error = f"config.yaml: {str(exc).splitlines()[0][:300]}"
            return True
        if self.cfg is None or cfg.node_ids != self.cfg.node_ids:
            self.records, self.robust, self._tails = {}, {}, {}
        self.cfg, self.config_error = cfg, None
        return True

    def _refresh_summary(self) -> bool:
        path = self.run_dir / "summary.json"
        mark = _FileMark.of(path)
        if mark == self._summary_mark:
            return False
        self._summary_mark = mark
        summary = None
        if mark is not None:
            try:
                loaded = json.loads(path.read_text())
            except (OSError, ValueError):
                loaded = None
            summary = loaded if isinstance(loaded, dict) else None
        self.summary = summary
        return True

    @property
    def refusals(self) -> int:
        """Peers refused so far, over every node's records (``len(rejected)`` summed)."""
        return sum(rob.refusals for rob in self.robust.values())

    def last_round(self, node_id: str) -> int:
        """The latest round ``node_id`` recorded (0: none)."""
        rounds = [_round_of(r) or 0 for r in self.records.get(node_id, [])]
        return max(rounds, default=0)

    def mean_by_round(self, key: str) -> list[tuple[int, float]]:
        """``[(round, mean of key over the nodes that recorded that round)]``, rounds in
        order; records whose value is not a finite number are left out."""
        sums: dict[int, list[float]] = {}
        for recs in self.records.values():
            for rec in recs:
                r, v = _round_of(rec), finite(rec.get(key))
                if r is not None and v is not None:
                    sums.setdefault(r, []).append(v)
        return [(r, sum(vs) / len(vs)) for r, vs in sorted(sums.items())]

    def series(self, node_id: str, key: str) -> list[tuple[int, float]]:
        """``[(round, value)]`` of one node, in record order, finite numbers only."""
        out = []
        for rec in self.records.get(node_id, []):
            r, v = _round_of(rec), finite(rec.get(key))
            if r is not None and v is not None:
                out.append((r, v))
        return out
