"""A topology's data opened for a node, every failure a
:class:`~p2pfl.errors.ConfigError` naming the file, the node and the field to fix.

:func:`check_dataset` opens a built-in dataset (or the device's files under a partition)
whole; :func:`check_node_data` opens one node's own data (``dataset.partition: none``). A
root that does not exist is named with where it was resolved from (:func:`root_note`); a
reader's :class:`~p2pfl.learning.arrays.DatasetError` keeps its field (``dataset.label``,
``dataset.classes``, ``dataset.name``, ``dataset.stats``); anything else a reader raises on a
corrupt file is ``dataset.root``. ``p2pfl validate`` (:mod:`p2pfl.check.preflight`) and every
node as it loads (:mod:`p2pfl.node.daemon`) open their data through these.
"""

from __future__ import annotations

from pathlib import Path

from p2pfl.config.dataset_schema import DOWNLOADABLE
from p2pfl.config.paths import PathBase, is_relative
from p2pfl.config.schema import DatasetConfig, TopologyConfig, is_import_path
from p2pfl.errors import ConfigError
from p2pfl.learning.arrays import DatasetArrays, DatasetError, NodeData
from p2pfl.learning.data import load_arrays, load_node_data
from p2pfl.learning.user_code import describe


def missing_root(ds: DatasetConfig, root: str | None) -> Path | None:
    """``root`` as an absolute path when the dataset reads files there and it does not
    exist (and cannot be downloaded); None otherwise (no root, synthetic data, a user
    function)."""
    if not root or ds.name == "synthetic" or is_import_path(ds.name):
        return None
    path = Path(root).expanduser()
    if path.exists() or (ds.download and ds.name in DOWNLOADABLE):
        return None
    return path.absolute()


def root_note(cfg: TopologyConfig, data_root: str | None = None) -> str:
    """`` (relative paths resolve against …)`` for a message on the data root: where the
    device's ``data_root`` (when given) or ``dataset.root`` was resolved from; empty when
    it was written absolute."""
    if data_root is not None:
        note = cfg.path_note("data_root") or (PathBase.cwd().note if is_relative(data_root) else "")
    else:
        note = cfg.path_note("dataset.root")
    return f" ({note})" if note else ""


def check_dataset(
    ds: DatasetConfig, seed: int, source: str, cache_dir=None, note: str = ""
) -> DatasetArrays:
    """The dataset's arrays, or a :class:`ConfigError` on ``dataset.root`` saying why not
    (a missing root: the path looked at, then ``note``, :func:`root_note`)."""
    missing = missing_root(ds, ds.root)
    if missing is not None:
        raise ConfigError(source, [("dataset.root", f"{missing} does not exist{note}")])
    try:
        return load_arrays(ds, seed, cache_dir)
    except DatasetError as exc:
        raise ConfigError(source, [(exc.field, f"dataset {ds.name!r}: {exc}")]) from None
    except (OSError, ValueError, ImportError, RuntimeError) as exc:
        what = "" if str(exc).startswith("dataset ") else f"dataset {ds.name!r}: "
        raise ConfigError(source, [("dataset.root", f"{what}{exc}")]) from None
    except Exception as exc:  # a reader's own failure on corrupt files (torchvision asserts)
        why = f"dataset {ds.name!r}: cannot read its files under {ds.root}: {describe(exc)}"
        raise ConfigError(source, [("dataset.root", why)]) from exc


def check_node_data(
    cfg: TopologyConfig,
    node_id: str,
    *,
    source: str = "topology",
    data_root: str | None = None,
    cache_dir=None,
) -> NodeData:
    """Node ``node_id``'s own data (``dataset.partition: none``), loaded whole from its root
    (``data_root`` when given, else ``dataset.root``; ``{id}`` replaced by the node id), or
    a :class:`ConfigError` naming ``source`` and the field to fix (``dataset.root``,
    ``dataset.label``, ``dataset.classes``, ``dataset.name``, ``dataset.stats``) whose
    message names the node and the file."""
    ds = cfg.dataset.with_root(data_root)
    who = f"node {node_id!r}"
    missing = missing_root(ds, ds.root_for(node_id))
    if missing is not None:
        why = f"{who}: {missing} does not exist{root_note(cfg, data_root)}"
        raise ConfigError(source, [("dataset.root", why)])
    try:
        return load_node_data(ds, cfg.node_ids, node_id, cfg.seed, cache_dir)
    except DatasetError as exc:
        raise ConfigError(source, [(exc.field, f"{who}: {exc}")]) from None
    except (OSError, ValueError, ImportError, RuntimeError) as exc:
        what = "" if str(exc).startswith("dataset ") else f"dataset {ds.name!r}: "
        raise ConfigError(source, [("dataset.root", f"{who}: {what}{exc}")]) from None
    except Exception as exc:  # a reader's own failure on a corrupt file
        where = ds.root_for(node_id)
        why = f"{who}: dataset {ds.name!r}: cannot read {where}: {describe(exc)}"
        raise ConfigError(source, [("dataset.root", why)]) from exc
