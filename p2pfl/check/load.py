"""Topology YAML → validated :mod:`p2pfl.config.schema` models, with errors that name the
file and the field.

``--set a.b.c=value`` overrides are applied to the raw YAML mapping before validation, so
they are validated exactly like the file itself. Every topology read here also has its
``algorithm.params`` checked against the named method's own model in the registry
(:func:`p2pfl.algorithms.validate_params`, defaults filled in); the schema cannot do that
itself, as it sits below the registry (docs/design.md, "Configuration").

Paths in a file (``dataset.root``, ``dataset.stats``, ``security.certs``, ``code_dir``; a
``nodes/`` file's ``data_root`` and ``certs``) resolve against the file's folder, those an
override sets against the current directory (:mod:`p2pfl.config.paths`): a topology read
here holds absolute paths, and ``code_dir`` defaults to the file's folder.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, TypeVar, get_args

import yaml
from pydantic import BaseModel, ValidationError

from p2pfl.config.bounds import MAX_FILE_BYTES, MAX_VALUES, expanded_size
from p2pfl.config.paths import (
    NODE_PATHS,
    TOPOLOGY_PATHS,
    PathBase,
    field_value,
    resolve_fields,
    use_code_dir,
)
from p2pfl.config.schema import PARAMS_CHECK, BrokerAddress, NodeOverrides, TopologyConfig
from p2pfl.config.suggest import with_suggestion
from p2pfl.errors import ConfigError

ModelT = TypeVar("ModelT", bound=BaseModel)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` → (["a","b","c"], value); the value is parsed as YAML (so 3, 0.5,
    true, [1,2] and strings all work)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--set expects key=value, got {text!r}")
    path = [p for p in key.strip().split(".") if p]
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return path, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each dotted path in ``data`` (creating maps as needed)."""
    for text in overrides:
        path, value = parse_override(text)
        cur: Any = data
        for i, key in enumerate(path[:-1]):
            nxt = cur.get(key) if isinstance(cur, dict) else None
            if isinstance(nxt, str) and key in ("edges", "broker"):
                nxt = {"kind": nxt} if key == "edges" else BrokerAddress.parse(nxt).model_dump()
                cur[key] = nxt
            if not isinstance(nxt, dict):
                if nxt is not None:
                    raise ValueError(f"--set {text}: {'.'.join(path[: i + 1])} is not a mapping")
                nxt = cur[key] = {}
            cur = nxt
        cur[path[-1]] = value
    return data


def _format_loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            # pydantic reports union branches by type name; they are noise for users
            if part in ("GeneratedEdges", "list[tuple[str,str]]", "function-after[_check_graph()]"):
                continue
            out += f".{part}" if out else str(part)
    return out


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (``X | None``, ``list[X]``, ``A | list[...]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def fields_at(root: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The field names valid where the last part of ``loc`` (pydantic's error location
    under ``root``) sits: the fields of the section that holds it; empty when the location
    is not under a section (a mapping of free keys such as ``algorithm.params``)."""
    candidates: list[type[BaseModel]] = [root]
    for part in loc[:-1]:
        if isinstance(part, int):  # a list's index: the same models
            continue
        tagged = [m for m in candidates if m.__name__ == part]  # a union's branch
        if tagged:
            candidates = tagged
            continue
        owner = next((m for m in candidates if part in m.model_fields), None)
        if owner is None:
            return []
        candidates = _models_in(owner.model_fields[part].annotation)
    return [name for m in candidates for name in m.model_fields]


def validation_errors(
    exc: ValidationError, model: type[BaseModel] | None = None
) -> list[tuple[str, str]]:
    """pydantic's errors as ``(field, message)``; an unknown field (under ``model``, the
    validated class) or a value outside a fixed set says which valid names are nearest."""
    errors = []
    for err in exc.errors():
        msg = err["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
            key = err["loc"][-1] if err["loc"] else None
            if model is not None and isinstance(key, str):
                msg = with_suggestion(msg, key, fields_at(model, err["loc"]))
        elif err["type"] == "literal_error" and isinstance(err.get("input"), str):
            expected = re.findall(r"'([^']*)'", str((err.get("ctx") or {}).get("expected", "")))
            msg = with_suggestion(msg, err["input"], expected)
        elif err["type"] in ("less_than_equal", "less_than", "greater_than", "greater_than_equal"):
            msg = f"{msg}, got {err['input']!r}"  # the value as the file (or --set) gave it
        loc = _format_loc(err["loc"])
        # whole-model checks say which field they are about as "field: message"
        m = re.match(r"^([A-Za-z_][\w.]*): (.*)$", msg, re.S)
        if not loc and m:
            loc, msg = m.group(1), m.group(2)
        errors.append((loc, msg))
    return errors


def read_text(path: str | Path) -> str:
    """The file at ``path`` as text, or a :class:`ConfigError` naming it: it cannot be read
    (missing, a directory, no permission), it is larger than
    :data:`~p2pfl.config.bounds.MAX_FILE_BYTES`, or it is not UTF-8 text (a binary file)."""
    p = Path(path)
    try:
        if p.is_dir():
            raise ConfigError(str(p), [("", "is a directory, not a YAML file")])
        with p.open("rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise ConfigError(str(p), [("", f"cannot read file: {why}")]) from None
    if len(raw) > MAX_FILE_BYTES:
        why = f"larger than {MAX_FILE_BYTES >> 20} MiB: not a topology (a YAML text file)"
        raise ConfigError(str(p), [("", why)])
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        why = (
            f"not a text file: byte {raw[exc.start]:#04x} at offset {exc.start} is not UTF-8 "
            "(expected a YAML text file)"
        )
        raise ConfigError(str(p), [("", why)]) from None


def load_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping a YAML file holds (``{}`` for an empty file), or a :class:`ConfigError`
    naming the file (and the line, for invalid YAML): see :func:`read_text`, and the top
    level must be a mapping whose values, aliases expanded, stay within
    :data:`~p2pfl.config.bounds.MAX_VALUES`."""
    p = Path(path)
    text = read_text(p)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(str(p), [(where, f"invalid YAML: {problem}")]) from None
    except RecursionError:  # nesting deeper than the parser's stack
        raise ConfigError(str(p), [("", "invalid YAML: nested too deeply")]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        what = "a list" if isinstance(data, list) else f"a single {type(data).__name__} value"
        raise ConfigError(
            str(p), [("", f"top level must be a mapping (field: value lines), not {what}")]
        )
    if expanded_size(data) > MAX_VALUES:
        why = (
            f"more than {MAX_VALUES:,} values once its anchors and aliases are expanded: "
            "not a topology"
        )
        raise ConfigError(str(p), [("", why)])
    return data


def load_topology(path: str | Path, overrides: list[str] | None = None) -> TopologyConfig:
    """Read, override and validate a topology file; raise ``ConfigError`` naming file+field.
    Its paths resolve against its folder, those ``overrides`` set against the current
    directory."""
    data = load_yaml(path)
    file_notes = resolve_file_paths(data, path)
    try:
        apply_overrides(data, overrides or [])
    except ValueError as exc:
        raise ConfigError(str(path), [("", str(exc))]) from None
    notes = resolve_override_paths(data, file_notes)
    try:
        cfg = topology_from_dict(data, source=str(path))
    except ConfigError as exc:
        if not overrides:
            raise
        raise ConfigError(exc.source, _blame_overrides(exc.errors, overrides)) from None
    cfg.note_paths(notes)
    return cfg


def resolve_file_paths(data: dict[str, Any], path: str | Path) -> dict[str, tuple[str, Any]]:
    """Resolve the relative paths of the topology mapping ``data``, read from the file at
    ``path``, against the file's folder, in place, and default ``code_dir`` to it; for
    :func:`resolve_override_paths`, ``{field: (note, resolved value)}``."""
    base = PathBase.of_file(path)
    notes = resolve_fields(data, TOPOLOGY_PATHS, base)
    data.setdefault("code_dir", base.folder)
    return {name: (note, field_value(data, name)) for name, note in notes.items()}


def resolve_override_paths(
    data: dict[str, Any], file_notes: dict[str, tuple[str, Any]] | None = None
) -> dict[str, str]:
    """Once overrides are applied to ``data``: resolve the relative paths left (the file's
    are absolute already, so these are the command line's, or a mapping's) against the
    current directory, in place; ``{field: note}`` of every path resolved, the file's
    (:func:`resolve_file_paths`) that no override replaced included."""
    kept = {
        name: note
        for name, (note, value) in (file_notes or {}).items()
        if field_value(data, name) == value
    }
    return {**kept, **resolve_fields(data, TOPOLOGY_PATHS, PathBase.cwd())}


def _blame_overrides(errors: list[tuple[str, str]], overrides: list[str]) -> list[tuple[str, str]]:
    """``errors`` with each one on a field the command line set (``--set``, ``--rounds``,
    ``--data-root``, ``--method``) saying so: the value is not the file's."""
    last = {text.partition("=")[0].strip(): text for text in overrides}  # the last one wins
    out = []
    for loc, msg in errors:
        given = [
            text
            for key, text in last.items()
            if loc and (loc == key or loc.startswith(key + ".") or key.startswith(loc + "."))
        ]
        if given:
            msg = f"{msg} (set on the command line: {', '.join(given)})"
        out.append((loc, msg))
    return out


def topology_from_dict(data: dict[str, Any], source: str = "<config>") -> TopologyConfig:
    """Validate a topology mapping, ``algorithm.params`` included; raise ``ConfigError``
    naming ``source`` and the field."""
    # here, not at the top: the registry imports torch, which `p2pfl certs` and the other
    # commands that read no topology need not load
    from p2pfl.algorithms import validate_params

    code_dir = data.get("code_dir")
    if isinstance(code_dir, str) and os.path.isabs(code_dir) and _names_user_code(data):
        use_code_dir(code_dir)  # before validation: a method's path is imported there
    return validated(TopologyConfig, data, source, context={PARAMS_CHECK: validate_params})


def _names_user_code(data: dict[str, Any]) -> bool:
    """Whether a raw topology mapping names a ``package.module:name`` (model, dataset or
    method); the schema checks the names themselves."""
    for section in ("model", "dataset", "algorithm"):
        part = data.get(section)
        name = part.get("name") if isinstance(part, dict) else None
        if isinstance(name, str) and ":" in name:
            return True
    return False


def validated(
    model: type[ModelT], data: Any, source: str | Path, context: dict[str, Any] | None = None
) -> ModelT:
    """``data`` validated as ``model`` (with ``context``), or a :class:`ConfigError` naming
    ``source`` and each field (:func:`validation_errors`)."""
    try:
        return model.model_validate(data, context=context)
    except ValidationError as exc:
        raise ConfigError(str(source), validation_errors(exc, model)) from None


def load_node_overrides(path: str | Path) -> NodeOverrides:
    """A device's ``nodes/`` file, its ``data_root`` and ``certs`` resolved against its
    folder; a ``ConfigError`` naming the file and the field otherwise."""
    data = load_yaml(path)
    notes = resolve_fields(data, NODE_PATHS, PathBase.of_file(path))
    over = validated(NodeOverrides, data, path)
    over.note_paths(notes)
    return over
