"""The ``p2pfl`` command line's grammar: each command, its arguments and the types that
check them (a bad value is a usage error, exit 2, before anything starts). What each
command does is in :mod:`p2pfl.cli`."""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

from p2pfl.config.schema import BrokerAddress
from p2pfl.config.suggest import did_you_mean


class Parser(argparse.ArgumentParser):
    """argparse, except that a mistyped command or choice (``p2pfl swarn``, ``--format
    onx``) is one line naming the nearest valid names and the choices, exit 2, without the
    usage: ``p2pfl: error: unknown command 'swarn' (did you mean 'swarm'?); commands: …``.
    Subparsers are of this class too (argparse gives them their parent's)."""

    _bad_choice: str | None = None

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if action.choices is not None and value not in action.choices:
            names = [str(c) for c in action.choices]
            hint = did_you_mean(str(value), names)
            hint = f" ({hint})" if hint else ""
            if action.dest == "command":  # the subparsers' (build_parser)
                what, listed = "unknown command", "commands"
            else:
                what = f"{'/'.join(action.option_strings) or action.dest}: invalid choice"
                listed = "one of"
            self._bad_choice = f"{what} {value!r}{hint}; {listed}: {', '.join(names)}"
        super()._check_value(action, value)

    def error(self, message: str) -> NoReturn:
        if self._bad_choice is not None:
            self.exit(2, f"{self.prog}: error: {self._bad_choice}\n")
        super().error(message)


class _IntermixedParser(Parser):
    """A subcommand whose positionals may come on both sides of its options (``predict
    RUN_DIR --node N INPUT``, or ``predict --site S INPUT``): parsed as argparse's
    intermixed parsing does, so an optional positional is not taken empty before them."""

    _inner = False  # parse_known_intermixed_args calls parse_known_args itself

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        if self._inner:
            return super().parse_known_args(args, namespace)
        self._inner = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._inner = False


def _positive_int(text: str, expected: str) -> int:
    """``text`` as an int of at least 1; a usage error saying ``expected`` otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _per_process(text: str) -> int | None:
    """``--nodes-per-process``: a positive int, or ``auto`` (None)."""
    return None if text == "auto" else _positive_int(text, "a number or 'auto'")


def _seconds(text: str) -> float:
    """``--timeout``: a positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def _port(text: str) -> int:
    """A TCP port: 0 (a free one) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0..65535, got {value}")
    return value


def _rounds(text: str) -> int:
    """``--rounds``: a positive count (the schema bounds it further, naming ``rounds``)."""
    return _positive_int(text, "a number of rounds")


def _any_broker(text: str) -> BrokerAddress:
    """``--broker`` of ``swarm`` and ``node``: ``HOST:PORT``, or ``mdns``."""
    try:
        return BrokerAddress.parse(text)
    except ValueError as exc:  # pydantic's ValidationError (a port out of range) is one
        from pydantic import ValidationError

        why = str(exc) if not isinstance(exc, ValidationError) else f"bad port in {text!r}"
        raise argparse.ArgumentTypeError(why) from None


def _broker_address(text: str) -> BrokerAddress:
    """``--broker HOST:PORT`` of ``p2pfl dashboard``."""
    try:
        address = BrokerAddress.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if address.mdns:
        raise argparse.ArgumentTypeError("give HOST:PORT (the dashboard does not browse mDNS)")
    return address


class _CommandsFormatter(argparse.HelpFormatter):
    """The top-level help: each command's summary starts in one column, past the longest
    command name (argparse sizes that column by the options alone under a ``metavar``, and
    would put ``dashboard``'s summary on a line of its own)."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=16)
        self._action_max_length = 14  # 4 columns of indent, 9 of "dashboard", 1 spare


DESCRIPTION = (
    "p2pfl: peer-to-peer federated learning. Run a swarm on this machine or one node daemon "
    "per device, check a topology, and take the trained models away. "
    "'p2pfl COMMAND --help' gives a command's options."
)


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    """Every command of ``p2pfl`` with its arguments; the command's name is ``command`` of
    the parsed namespace (:data:`p2pfl.cli.COMMANDS` runs it). ``--help`` shows
    ``description`` (default :data:`DESCRIPTION`, plain text) and every command with a
    one-line summary (each short enough for one line of an 80-column terminal)."""
    p = Parser(
        prog="p2pfl",
        description=description or DESCRIPTION,
        formatter_class=_CommandsFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")
    from p2pfl.launch.broker import BROKER_KINDS

    def common(sp: argparse.ArgumentParser, optional: bool = False) -> None:
        if optional:
            sp.add_argument("topology", nargs="?", help="topology YAML (see topologies/)")
        else:
            sp.add_argument("topology", help="topology YAML (see topologies/)")
        sp.add_argument(
            "--set",
            action="append",
            metavar="KEY=VALUE",
            help="override a YAML field by dotted path (repeatable)",
        )
        sp.add_argument(
            "--method",
            help="run this method instead of the topology's (its default knobs; "
            "tune with --set algorithm.params.KEY=VALUE)",
        )
        sp.add_argument("-v", "--verbose", action="store_true")

    def broker_kind(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "--broker-kind",
            choices=BROKER_KINDS,
            default="auto",
            help="the broker to start: auto (default: Mosquitto where installed, else the "
            "embedded pure-Python one), mosquitto, or embedded",
        )

    sp = sub.add_parser("swarm", help="run a local swarm: broker + node processes")
    common(sp)
    sp.add_argument("--data-root", help="sets dataset.root")
    sp.add_argument("--rounds", type=_rounds, help="sets rounds")
    sp.add_argument("--out", help="run directory (default runs/<swarm name>)")
    sp.add_argument(
        "--nodes-per-process",
        type=_per_process,
        default=None,
        metavar="K",
        help="host K asyncio nodes in each OS process (default auto: about one process per "
        "CPU core)",
    )
    sp.add_argument(
        "--broker", type=_any_broker, help="use this host:port instead of starting a broker"
    )
    broker_kind(sp)
    sp.add_argument("--no-progress", action="store_true", help="no live table")
    sp.add_argument("--timeout", type=_seconds, help="stop the swarm after this many seconds")
    from p2pfl.launch.tracker import TRACKERS

    sp.add_argument(
        "--tracker",
        choices=TRACKERS,
        help="also log per-node and mean metrics to TensorBoard or MLflow (optional extras)",
    )
    sp.add_argument(
        "--dashboard",
        action="store_true",
        help="serve a live web dashboard of the run while it runs (it stops with the swarm)",
    )
    sp.add_argument(
        "--dashboard-keep",
        action="store_true",
        help="--dashboard, and keep serving after the swarm finished, until Ctrl-C",
    )
    sp.add_argument("--dashboard-host", default="127.0.0.1", help="dashboard address (127.0.0.1)")
    sp.add_argument(
        "--dashboard-port", type=_port, default=0, help="dashboard port (default 0: a free one)"
    )

    sp = sub.add_parser("node", help="run one node daemon (or several) in the foreground")
    common(sp)
    sp.add_argument("--id", action="append", help="node id (repeat to host several)")
    sp.add_argument(
        "--broker",
        type=_any_broker,
        help="host:port of the MQTT broker, or mdns (default: the topology's)",
    )
    sp.add_argument("--node-config", help="per-device YAML (nodes/<id>.yaml)")
    sp.add_argument("--data-root", help="this device's data root")
    sp.add_argument("--device", help="torch device, e.g. cpu or cuda:0")
    sp.add_argument("--out", help="run directory (default runs/<swarm name>)")
    sp.add_argument("--no-rich", action="store_true", help="plain log lines")
    sp.add_argument(
        "--host",
        help="without --id: run the nodes the topology pins to this host "
        "(default: this machine's hostname)",
    )
    sp.add_argument("--certs", help="this device's certificate directory (p2pfl certs)")
    sp.add_argument(
        "--fresh",
        action="store_true",
        help="start over: ignore (and replace) a checkpoint this node left in the run directory",
    )
    # p2pfl swarm's node processes read <run>/config.yaml: errors name the user's file
    sp.add_argument("--source", help=argparse.SUPPRESS)
    # p2pfl swarm's node processes: the digest of the config it checked (check/checked.py)
    sp.add_argument("--checked", help=argparse.SUPPRESS)

    sp = sub.add_parser(
        "validate", help="check a topology file (or a site file) and print every error"
    )
    common(sp, optional=True)
    sp.add_argument(
        "--site",
        help="check this site file instead: it loads, and each data binding serves a run "
        "(it opens, its label column and classes are there, its partition fits)",
    )
    sp.add_argument("--data-root", help="check the data at this root (default: dataset.root)")
    sp.add_argument(
        "--no-data",
        action="store_true",
        help="check the file only: skip opening the data and building the model",
    )

    sp = sub.add_parser("broker", help="run a broker for a swarm and announce it by mDNS")
    sp.add_argument("--swarm", default="*", help="the swarm it serves (default *: any)")
    sp.add_argument(
        "--host", default="127.0.0.1", help="address to listen on and announce (a LAN address)"
    )
    sp.add_argument("--port", type=int, default=0, help="port (default: a free one)")
    broker_kind(sp)
    sp.add_argument("--workdir", help="where its config and log go (default: a temp dir)")
    sp.add_argument(
        "--certs",
        help="a p2pfl certs directory: TLS only, client certificates required, per-node ACL",
    )
    sp.add_argument(
        "--bridge",
        action="append",
        metavar="HOST:PORT",
        help="bridge the swarm's topics to another site's broker (repeatable; TLS with the "
        "bridge identity when --certs is given); =ID,ID... names the nodes at that site, so "
        "only what they send or receive crosses (needs --topology)",
    )
    sp.add_argument("--topology", help="with --bridge HOST:PORT=IDS: the swarm's topology")
    sp.add_argument("-v", "--verbose", action="store_true")

    sp = sub.add_parser("certs", help="create a swarm CA and per-node certificates")
    common(sp)
    sp.add_argument("--out", help="directory (default: security.certs, else certs/<swarm>)")
    sp.add_argument(
        "--broker-host",
        action="append",
        metavar="HOST",
        help="an address or name the broker is reached at (repeatable; the topology's "
        "broker host, 127.0.0.1 and localhost are always included)",
    )
    sp.add_argument("--node", action="append", help="only these node ids (repeatable)")
    sp.add_argument("--days", type=int, default=825, help="validity (825 days)")
    sp.add_argument("--force", action="store_true", help="new CA and identities even if they exist")
    sp.add_argument(
        "--revoke",
        action="append",
        metavar="ID",
        help="revoke this node's certificate (repeatable): adds it to crl.pem; "
        "p2pfl:observer and p2pfl:bridge revoke the dashboard's and the bridges' identities",
    )

    _enroll_command(sub)

    sp = sub.add_parser("discover", help="list brokers, nodes and swarms visible by mDNS")
    sp.add_argument("--seconds", type=float, default=3.0, help="how long to listen (3)")
    sp.add_argument(
        "--interface",
        action="append",
        metavar="IP",
        help="listen on this interface address only (repeatable; default: all)",
    )
    sp.add_argument("-v", "--verbose", action="store_true")

    sp = sub.add_parser("track", help="export a run's records to TensorBoard or MLflow")
    sp.add_argument("run_dir")
    sp.add_argument("--tracker", choices=TRACKERS, required=True)
    sp.add_argument("-v", "--verbose", action="store_true")

    sp = sub.add_parser("dashboard", help="serve a run's live web dashboard (running or finished)")
    sp.add_argument("run_dir")
    sp.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    sp.add_argument("--port", type=int, default=0, help="port (default 0: a free one)")
    sp.add_argument(
        "--broker",
        type=_broker_address,
        help="observe this broker (default: the one the run's config.yaml records)",
    )
    sp.add_argument("--no-broker", action="store_true", help="show the records only")
    sp.add_argument(
        "--certs",
        help="a TLS swarm's certificate directory holding observer.crt/.key (default: the "
        "run's security.certs)",
    )
    sp.add_argument("-v", "--verbose", action="store_true")

    sp = sub.add_parser("summarize", help="(re)write summary.json of a run directory")
    sp.add_argument("run_dir")
    sp.add_argument("--json", action="store_true", help="print the summary as JSON")
    sp.add_argument("-v", "--verbose", action="store_true")

    sp = sub.add_parser("export", help="write trained models as safetensors, ONNX or TorchScript")
    sp.add_argument("run_dir")
    sp.add_argument("--node", help="this node only (default: every node that has a model)")
    sp.add_argument("--format", choices=("safetensors", "onnx", "torchscript"), required=True)
    sp.add_argument("--out", help="directory to write to (default: <run_dir>/export)")
    sp.add_argument("-v", "--verbose", action="store_true")

    sp = sub.add_parser(
        "predict",
        help="classify a CSV file or images with a node's or a site's model",
    )
    sp.add_argument("run_dir", nargs="?", help="the run's folder (with --node)")
    sp.add_argument("--node", help="whose model")
    sp.add_argument("--site", help="the site file: its served model (p2pfl models list)")
    sp.add_argument(
        "input", nargs="?", help="a CSV / Parquet file, an image folder or image, a .npy array"
    )
    sp.__class__ = _IntermixedParser  # its positionals come on both sides of --node
    sp.add_argument("--out", help="predictions CSV (default: ./predictions-<node>.csv)")
    sp.add_argument("-v", "--verbose", action="store_true")

    sp = sub.add_parser("methods", help="list the installed methods, their knobs and defaults")
    sp.add_argument("-v", "--verbose", action="store_true")

    sp = sub.add_parser("policy", help="check a run spec against a site's policy (a dry run)")
    sp.add_argument("action", choices=["check"], help="check: print the decision and reasons")
    sp.add_argument("spec", help="the run spec (run.yaml)")
    sp.add_argument("--site", required=True, help="the site file whose policy decides")
    sp.add_argument("--proposer", help="who proposes the run (default: the site itself)")
    sp.add_argument("--json", action="store_true", help="print the decision as JSON")
    sp.add_argument("-v", "--verbose", action="store_true")
    _site_commands(sub)
    return p


def _site_commands(sub: Any) -> None:
    """A standing federation: the site daemon and the commands that talk to it through its
    admin socket (docs/design.md, "Site policy")."""
    sp = sub.add_parser("daemon", help="run this site's daemon: admit runs by its policy")
    sp.add_argument("--site", help="the site file (site.yaml)")
    sp.add_argument(
        "--print-systemd-unit",
        action="store_true",
        help="print a systemd unit (Type=notify) that runs this daemon, and exit",
    )
    sp.add_argument(
        "--user", help="--print-systemd-unit: the User= it runs as (default: p2pfl, a system user)"
    )
    sp.add_argument("-v", "--verbose", action="store_true")

    sp = sub.add_parser("submit", help="propose a run to the federation through this site")
    sp.add_argument("spec", nargs="?", help="the run spec (run.yaml)")
    sp.add_argument(
        "--retry",
        metavar="RUN_ID",
        help="propose a failed, aborted or cancelled run's spec again, as its next attempt",
    )
    sp.add_argument("--site", required=True, help="the proposing site's file")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("-v", "--verbose", action="store_true")

    sp = sub.add_parser("vote", help="decide a run this site's policy left pending")
    sp.add_argument("run_id")
    way = sp.add_mutually_exclusive_group(required=True)
    way.add_argument("--accept", action="store_true")
    way.add_argument("--reject", action="store_true")
    sp.add_argument("--site", required=True, help="the site file")
    sp.add_argument("-v", "--verbose", action="store_true")

    sp = sub.add_parser("runs", help="the runs a site's daemon knows, with votes and status")
    sp.add_argument("--site", required=True, help="the site file")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("-v", "--verbose", action="store_true")

    sp = sub.add_parser("logs", help="a run's worker log at this site")
    sp.add_argument("run_id")
    sp.add_argument("--site", required=True, help="the site file")
    sp.add_argument("--node", help="the node (this site's own: the only log it holds)")
    sp.add_argument(
        "--tail", type=lambda t: _positive_int(t, "a number of lines"), help="the last lines"
    )
    sp.add_argument("-v", "--verbose", action="store_true")

    sp = sub.add_parser("cancel", help="stop a run (its proposer) or leave it (a member)")
    sp.add_argument("run_id")
    sp.add_argument("--site", required=True, help="the site file")
    sp.add_argument("-v", "--verbose", action="store_true")

    sp = sub.add_parser("drain", help="no new runs; finish the current round, leave, stop")
    sp.add_argument("--site", required=True, help="the site file")
    sp.add_argument("-v", "--verbose", action="store_true")

    sp = sub.add_parser("models", help="a site's trained models: list, promote, roll back")
    way = sp.add_subparsers(
        dest="models_command", required=True, metavar="{list,promote,rollback,offer}"
    )
    ms = way.add_parser("list", help="every model the site keeps, the served one marked")
    ms.add_argument("--json", action="store_true")
    ms = way.add_parser("promote", help="serve a kept model, whatever the gate said of it")
    ms.add_argument("model", help="the model's id (p2pfl models list)")
    way.add_parser("rollback", help="serve again the model served before the current one")
    ms = way.add_parser("offer", help="keep a finished run's model and judge it at the gate")
    ms.add_argument("run_id", help="a run this site trained (state_dir/runs/RUN_ID)")
    for ms in way.choices.values():
        ms.add_argument("--site", required=True, help="the site file")
        ms.add_argument("-v", "--verbose", action="store_true")

    sp = sub.add_parser("serve", help="answer /v1/predict and /v1/model with the site's model")
    sp.add_argument("--site", required=True, help="the site file")
    sp.add_argument("--listen", help="host:port (default: the site file's serving.listen)")
    sp.add_argument("-v", "--verbose", action="store_true")

    sp = sub.add_parser("trust", help="spread the swarm's revocations to every site daemon")
    way = sp.add_subparsers(dest="trust_command", required=True, metavar="{publish}")
    ts = way.add_parser("publish", help="publish CA_DIR/crl.pem as a retained trust message")
    ts.add_argument("--certs", required=True, metavar="CA_DIR", help="the swarm's CA folder")
    ts.add_argument("--site", required=True, help="the site file whose broker and identity send it")
    ts.add_argument("-v", "--verbose", action="store_true")


def _enroll_command(sub: Any) -> None:
    """``p2pfl enroll``: a node's certificate issued while its key stays on its device
    (docs/design.md, "Enrolment")."""
    sp = sub.add_parser("enroll", help="enrol a device whose key never leaves it")
    way = sp.add_subparsers(dest="enroll_command", required=True, metavar="{request,approve}")
    es = way.add_parser("request", help="on the device: make its key and a certificate request")
    es.add_argument("--site", required=True, metavar="NAME", help="the device's node id")
    es.add_argument(
        "--certs",
        required=True,
        metavar="DIR",
        help="the device's certificate folder (the key goes to DIR/nodes/NAME.key)",
    )
    es.add_argument("--out", metavar="FILE", help="the request (default: ./NAME.request.pem)")
    es.add_argument("--force", action="store_true", help="replace an existing key with a new one")
    es = way.add_parser(
        "approve", help="issue a request's certificate (--certs), or approve it as a site"
    )
    es.add_argument("request", metavar="REQ", help="the request (NAME.request.pem)")
    es.add_argument(
        "--certs",
        metavar="CA_DIR",
        help="the swarm's certificate folder holding ca.key: issue the certificate",
    )
    es.add_argument(
        "--site",
        metavar="SITE_YAML",
        help="without --certs: approve the request as this site (a signed approval beside "
        "REQ); with it: the site file whose admission: says which approvals are needed",
    )
    es.add_argument(
        "--days",
        type=lambda t: _positive_int(t, "a number of days"),
        default=825,
        help="validity (825 days)",
    )
    es.add_argument("--out", metavar="CERT", help="the certificate (default: NAME.crt beside REQ)")
    es.add_argument(
        "--replace",
        action="store_true",
        help="issue even though the name holds a valid certificate (it stays valid until revoked)",
    )
    for es in way.choices.values():
        es.add_argument("-v", "--verbose", action="store_true")
