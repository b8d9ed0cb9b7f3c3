"""A site's served model over HTTP, on ``serving.listen`` (docs/design.md, "A site's own
models"): ``p2pfl serve --site``, which the site daemon starts and restarts as a process of
its own (the daemon imports no torch, and a crash here never takes it down).

- ``POST /v1/predict``: rows to classify, answered with classes and probabilities;
- ``GET /v1/model``: which model answers (entry, run, cycle, round, data version, held-out
  accuracy), its lineage (the models it was warm-started from, its parent first) and the
  models served before it (what a rollback goes back to).

The model is the site's served entry in its model store (:class:`~p2pfl.sites.models.store.
ModelStore`, ``models/current.json``), the personalized model its node trained. A watcher
re-reads ``current.json`` every :data:`POLL_S` and swaps in a newly promoted (or rolled
back) model once it is loaded: a request is answered wholly by the old model or wholly by
the new one. Answers come from :class:`~p2pfl.export.predict.Classifier`, as ``p2pfl
predict``'s do, so the same rows and model give the same classes and probabilities: to
1e-6 through the ONNX export and onnxruntime (``serving.runtime: onnx``, the default),
exactly with ``runtime: torch``. The HTTP side (aiohttp on one event loop, the routes,
the statuses, each answer counted by route and status with its latency) is
:mod:`~p2pfl.sites.models.serving_http`'s; the processes that run this server are
:mod:`~p2pfl.sites.models.serving_pool`'s.

A predict request's body, by its ``Content-Type``:

- ``application/json``: a list of records (``[{"column": value, ...}, ...]``), or
  ``{"records": [...]}``, or ``{"columns": [...], "rows": [[...], ...]}`` (JSON rows), the
  columns of the site's data binding (its feature columns; others are ignored), or, for an
  image model, ``{"images": [base64, ...]}``;
- ``text/csv``: a batch of records with a header line;
- ``image/*`` or ``application/octet-stream``: one image file's bytes (image models).

The answer: ``{"model", "run_id", "classes", "predictions": [{"predicted", "label",
"probabilities"}]}``, ``probabilities`` in the order of ``classes``. Bad input is a 400 that
says what is wrong; more than ``serving.max_request_bytes`` a 413; no model served yet a
503.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import io
import json
import logging
import os
import socket
import threading
from dataclasses import asdict, dataclass
from http import HTTPStatus
from typing import Any

from p2pfl.errors import P2PFLError
from p2pfl.sites.models import oip, serving_http
from p2pfl.sites.models.serving_http import BadRequest
from p2pfl.sites.models.store import CURRENT, ModelEntry, ModelStore, ModelStoreError

log = logging.getLogger(__name__)

POLL_S = 0.2
"""How often the server looks for a newly served model (``models/current.json``)."""
LISTEN_BACKLOG = 128
"""Connections the listening socket holds before a worker accepts them."""

IMAGE_TYPES = ("image/", "application/octet-stream")


class ServingError(P2PFLError, RuntimeError):
    """The server cannot start (its address is taken, the store is unreadable)."""


@dataclass(frozen=True)
class Served:
    """The model answering now: its entry, what it was served after, and its classifier."""

    entry: ModelEntry
    lineage: list[dict[str, Any]]
    served_before: list[dict[str, Any]]
    classifier: Any  # p2pfl.export.predict.Classifier (torch, imported when serving)

    def describe(self) -> dict[str, Any]:
        """``GET /v1/model``'s answer."""
        entry = asdict(self.entry)
        entry.pop("history", None)
        spec = self.classifier.spec
        return {
            "model": entry,
            "lineage": self.lineage,
            "served_before": self.served_before,
            "classes": self.classifier.classes,
            "runtime": self.classifier.runtime,
            "input": {k: spec[k] for k in ("kind", "features", "channels", "size") if k in spec},
        }


class ModelServer:
    """Serve site ``store``'s current model on ``host:port`` (port 0: a free one). Explicit
    lifecycle: :meth:`start` (binds, loads the served model, starts the watcher), then
    :meth:`serve_forever` or :meth:`close`; ``with`` closes it."""

    def __init__(
        self,
        store: ModelStore,
        host: str,
        port: int,
        *,
        max_request_bytes: int = 16 << 20,
        missing: str = "refuse",
        runtime: str = "onnx",
    ):
        self.store = store
        self.max_request_bytes = max_request_bytes
        self.missing = missing  # serving.missing: refuse or impute a missing value
        self.runtime = runtime  # serving.runtime: onnx (onnxruntime) or torch
        self.served: Served | None = None
        self._seen: tuple[int, ...] | None = None  # current.json's (inode, mtime, size) loaded
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        # serve_forever's loop and the event that ends it (set from another thread)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._shut = False
        self._idle = threading.Event()
        self._idle.set()  # set while no serve_forever runs
        try:
            self.sock = socket.create_server((host, port), backlog=LISTEN_BACKLOG)
        except OSError as exc:
            raise ServingError(f"serving.listen {host}:{port}: {exc.strerror or exc}") from None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.sock.getsockname()[:2]
        return str(host), int(port)

    def start(self) -> ModelServer:
        self.refresh()
        self._watcher = threading.Thread(target=self._watch, name="serving-watch", daemon=True)
        self._watcher.start()
        return self

    def serve_forever(self) -> None:
        """Answer requests (:mod:`~p2pfl.sites.models.serving_http`) on an event loop of
        this thread's own until :meth:`shutdown` (from another thread)."""
        self._idle.clear()
        loop = _new_loop()
        try:
            loop.run_until_complete(self._serve())
        finally:
            self._loop = self._stopping = None
            loop.close()
            self._idle.set()

    async def _serve(self) -> None:
        self._stopping = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        if not self._shut:
            await serving_http.serve(self, self.sock, self._stopping)

    def shutdown(self) -> None:
        """Stop :meth:`serve_forever` (call from another thread: it waits for it)."""
        self._shut = True
        loop, stopping = self._loop, self._stopping
        if loop is not None and stopping is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(stopping.set)
        self._idle.wait()

    def close(self) -> None:
        self._stop.set()
        self.shutdown()
        self.sock.close()
        if self._watcher is not None:
            self._watcher.join(5)

    def __enter__(self) -> ModelServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the served model
    def refresh(self) -> bool:
        """Load the store's served model when ``current.json`` changed; True when the
        model answering changed. A model that cannot be loaded leaves the old one
        answering (logged)."""
        path = self.store.root / CURRENT
        try:
            st = os.stat(path)
            seen: tuple[int, ...] | None = (st.st_ino, st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            seen = None
        if seen == self._seen:
            return False
        try:
            served = self._load()
        except (P2PFLError, OSError, ValueError) as exc:
            log.error("%s: the served model cannot be loaded: %s", self.store.root, exc)
            return False
        self._seen = seen
        if served is None or self.served is None or served.entry.id != self.served.entry.id:
            self.served = served  # one assignment: a request holds one model or the other
            if served is not None:
                log.info(
                    "%s: serving %s (run %s)", self.store.site, served.entry.id, served.entry.run_id
                )
            return True
        return False

    def _load(self) -> Served | None:
        import pandas  # noqa: F401  (CSV and v2 requests read it: imported before the first)

        from p2pfl.export import ExportError
        from p2pfl.export.predict import Classifier  # torch: only in the serving process

        entry = self.store.served()
        if entry is None:
            return None

        def brief(e: ModelEntry) -> dict[str, Any]:
            return {"id": e.id, "run_id": e.run_id, "cycle": e.cycle, "round": e.round}

        lineage = [brief(e) for e in self.store.lineage(entry.id)]
        served_before = []
        for before in reversed(self.store.before()):
            with contextlib.suppress(ModelStoreError):
                served_before.append(brief(self.store.entry(before)))
        classifier = Classifier.load(self.store.path(entry.id), self.store.site)
        if self.runtime == "onnx":
            try:
                classifier.use_onnx(f"model {entry.id}")
            except ExportError as exc:  # served all the same, by the module itself
                log.warning("%s: %s; answering with torch", self.store.site, exc)
        return Served(entry, lineage, served_before, classifier)

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.refresh()
            except Exception:  # the watcher must outlive a bad store read
                log.exception("%s: reading the served model failed", self.store.root)

    # ------------------------------------------------------------------ answers
    def predict(self, content_type: str, body: bytes) -> dict[str, Any]:
        """``POST /v1/predict``'s answer for ``body``; :class:`BadRequest` otherwise."""
        from p2pfl.export import ExportError

        served = self.served_or_503()
        model = served.classifier
        kind = content_type.split(";", 1)[0].strip().lower()
        extra: list[str] = []  # the request's columns that are no feature of the model
        try:
            if kind.startswith(IMAGE_TYPES):
                probs = model.images([body], "the request's image")
            elif kind == "text/csv":
                frame = _csv_frame(body)
                probs = model.table(frame, "the request's CSV", self.missing)
                features = set(model.spec.get("features") or [])
                extra = sorted(str(c) for c in frame.columns if str(c) not in features)
            elif kind in ("application/json", ""):
                data = _json(body)
                if isinstance(data, dict) and "images" in data:
                    probs = model.images(_images(data["images"]), "the request's images")
                else:
                    probs, extra = model.records(
                        _json_records(data), "the request's rows", self.missing
                    )
            else:
                raise BadRequest(
                    HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                    f"Content-Type {content_type!r}: send application/json, text/csv or an image",
                )
        except ExportError as exc:
            raise BadRequest(HTTPStatus.BAD_REQUEST, str(exc)) from None
        # named, so a misspelt column is seen (the label may travel along)
        ignored = {"ignored_columns": extra} if extra else {}
        if model.values:  # regression, a risk score: the model's outputs
            return {
                "model": served.entry.id,
                "run_id": served.entry.run_id,
                **ignored,
                "predictions": [
                    {"value": float(row[0])}
                    if len(row) == 1
                    else {"values": [float(v) for v in row]}
                    for row in probs
                ],
            }
        classes = model.classes
        pred = probs.argmax(axis=1)
        return {
            "model": served.entry.id,
            "run_id": served.entry.run_id,
            **ignored,
            "classes": classes,
            "predictions": [
                {
                    "predicted": int(k),
                    "label": classes[int(k)],
                    "probabilities": [float(v) for v in row],
                }
                for k, row in zip(pred, probs, strict=True)
            ],
        }

    # ------------------------------------------------------------------ the v2 protocol
    def model_name(self) -> str:
        """The Open Inference Protocol's name of the served model: the site's."""
        return self.store.site

    def v2_metadata(self) -> dict[str, Any]:
        served = self.served_or_503()
        extra = {"run_id": served.entry.run_id, "round": served.entry.round}
        return oip.metadata(self.model_name(), served.entry.id, served.classifier, extra)

    def v2_infer(self, body: bytes, header_length: str | None) -> dict[str, Any]:
        """``POST /v2/models/{name}/infer``'s answer; :class:`BadRequest` otherwise."""
        from p2pfl.export import ExportError

        served = self.served_or_503()
        model = served.classifier
        try:
            request = oip.read_request(body, header_length)
            if model.kind == "image":
                outputs = model.images(oip.image_blobs(request), "input 'images'")
            else:
                frame = oip.table_rows(request, list(model.spec.get("features") or []))
                outputs = model.table(frame, "the request's inputs", self.missing)
            parameters = {
                "run_id": served.entry.run_id,
                "round": served.entry.round,
                **({} if model.values else {"classes": list(model.classes)}),
            }
            return oip.response(
                request, self.model_name(), served.entry.id, model, outputs, parameters
            )
        except (oip.ProtocolError, ExportError) as exc:
            raise BadRequest(HTTPStatus.BAD_REQUEST, str(exc)) from None

    def served_or_503(self) -> Served:
        """The model answering now; a 503 :class:`BadRequest` before any is served."""
        served = self.served
        if served is None:
            raise BadRequest(
                HTTPStatus.SERVICE_UNAVAILABLE,
                f"site {self.store.site} serves no model yet (p2pfl models list)",
            )
        return served


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError as exc:
        raise BadRequest(HTTPStatus.BAD_REQUEST, f"the body is not JSON: {exc}") from None


def _json_records(data: Any) -> list[dict[str, Any]]:
    """The records of a JSON body: a list of records, ``{"records": [...]}``, or
    ``{"columns", "rows"}`` (each row made a record)."""
    if isinstance(data, dict) and "rows" in data:
        columns, rows = data.get("columns"), data["rows"]
        if not isinstance(columns, list) or not all(isinstance(c, str) for c in columns):
            raise BadRequest(HTTPStatus.BAD_REQUEST, "rows need 'columns': a list of names")
        if not isinstance(rows, list) or not all(
            isinstance(r, list) and len(r) == len(columns) for r in rows
        ):
            raise BadRequest(
                HTTPStatus.BAD_REQUEST, f"'rows' must be lists of {len(columns)} values each"
            )
        records = [dict(zip(columns, r, strict=True)) for r in rows]
    else:
        records = data.get("records") if isinstance(data, dict) else data
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise BadRequest(
            HTTPStatus.BAD_REQUEST,
            "send a list of records ({column: value}), {'records': [...]} or "
            "{'columns': [...], 'rows': [[...]]}",
        )
    if not records:
        raise BadRequest(HTTPStatus.BAD_REQUEST, "no records to classify")
    return records


def _csv_frame(body: bytes):
    import pandas as pd

    try:
        return pd.read_csv(io.BytesIO(body))
    except (ValueError, pd.errors.ParserError) as exc:
        raise BadRequest(HTTPStatus.BAD_REQUEST, f"the body is not a readable CSV: {exc}") from None


def _images(items: Any) -> list[bytes]:
    if not isinstance(items, list) or not items or not all(isinstance(i, str) for i in items):
        raise BadRequest(HTTPStatus.BAD_REQUEST, "'images' must be a list of base64 strings")
    try:
        return [base64.b64decode(i, validate=True) for i in items]
    except (binascii.Error, ValueError) as exc:
        raise BadRequest(HTTPStatus.BAD_REQUEST, f"'images': not base64: {exc}") from None


def _new_loop() -> asyncio.AbstractEventLoop:
    """uvloop's where it is installed (a third less CPU an answer than asyncio's here)."""
    try:
        import uvloop
    except ImportError:  # Windows: no uvloop
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
