"""`splitserve serve …` (one service in the foreground, what a pod runs) and `splitserve up`."""

from __future__ import annotations

import argparse
import sys

from tools.commands.common import fail, positive_float, positive_int

SERVICES = ("coordinator", "prefill", "decode", "both")


def add_commands(sub) -> None:
    up = sub.add_parser("up", help="run a whole deployment on this machine (coordinator + workers)")
    up.add_argument("--config", default=None, help="deployment config YAML (default: built-in)")
    up.add_argument(
        "--host",
        default=None,
        help="coordinator bind address (default 127.0.0.1; 0.0.0.0 in a container)",
    )
    up.add_argument(
        "--port", type=_port, default=None, help="coordinator HTTP port (0: pick a free one)"
    )
    up.add_argument(
        "--startup-timeout",
        type=positive_float,
        default=300.0,
        metavar="SECONDS",
        help="give up if the stack is not ready by then (default: 300)",
    )
    up.add_argument(
        "--coordinators",
        type=positive_int,
        default=None,
        metavar="N",
        help="coordinator processes sharing the workers (default: the config's "
        "coordinator.replicas, 1)",
    )
    up.add_argument(
        "--tls",
        action="store_true",
        help="internal gRPC over mutual TLS, under a CA made for this run (a config's own "
        "internal_auth.tls certificates are used instead when it names them)",
    )
    shape = up.add_mutually_exclusive_group()
    shape.add_argument(
        "--disaggregated",
        dest="disaggregated",
        action="store_const",
        const=True,
        default=None,
        help="without --config: 1 prefill + 1 decode replica (default: chosen by the cores)",
    )
    shape.add_argument(
        "--colocated",
        dest="disaggregated",
        action="store_const",
        const=False,
        help="without --config: one replica doing both prefill and decode",
    )
    up.set_defaults(handler=run_up)

    serve = sub.add_parser("serve", help="run one service in the foreground (what a pod runs)")
    serve.add_argument("service", choices=SERVICES)
    serve.add_argument("--config", required=True, help="deployment config YAML")
    serve.add_argument(
        "--model-id", default=None, help="model this worker serves (needed if several)"
    )
    serve.add_argument(
        "--index", type=_non_negative_int, default=0, help="replica number within its role"
    )
    serve.add_argument(
        "--host",
        default=None,
        help="address to bind (coordinator) or to bind and advertise (worker; a pod's IP)",
    )
    serve.add_argument(
        "--port", type=_port, default=None, help="port to bind (worker gRPC, coordinator HTTP)"
    )
    serve.add_argument(
        "--registry-port",
        type=_port,
        default=None,
        help="coordinator: the registry's gRPC port (default: coordinator.registry_port)",
    )
    serve.set_defaults(handler=run_serve)


def run_up(args: argparse.Namespace) -> int:
    from services.launcher.up import run_up as launch
    from shared.config.schema import ConfigError, load_config

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        return fail(str(exc))
    if args.config is None:
        from services.launcher.stack import available_cpus
        from services.launcher.topology import local_topology

        topology = local_topology(config, available_cpus(), args.disaggregated)
        config = topology.config
        print(f"topology: {topology.reason}", file=sys.stderr, flush=True)
    elif args.disaggregated is not None:
        return fail(
            "--disaggregated/--colocated choose the built-in topology; with --config, "
            "set models[].pools in the file"
        )
    update = {"host": args.host, "port": args.port, "replicas": args.coordinators}
    update = {k: v for k, v in update.items() if v is not None}
    if update:
        coordinator = config.coordinator.model_copy(update=update)
        config = config.model_copy(update={"coordinator": coordinator})
    return launch(config, args.startup_timeout, tls=args.tls)


def run_serve(args: argparse.Namespace) -> int:
    from shared.config.schema import ConfigError, load_config

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        return fail(str(exc))
    if args.registry_port is not None:
        if args.service != "coordinator":
            return fail(
                "--registry-port is the coordinator's; workers read the registries from the config"
            )
        coordinator = config.coordinator.model_copy(update={"registry_port": args.registry_port})
        config = config.model_copy(update={"coordinator": coordinator})
    if args.service == "coordinator":
        from services.coordinator.main import run_coordinator

        try:  # what the config names but cannot be used: a missing token file, a model
            run_coordinator(config, bind_host=args.host, port=args.port)
        except ConfigError as exc:
            return fail(str(exc))
        return 0
    ids = [m.id for m in config.models]
    model_id = args.model_id
    if model_id is None:
        if len(ids) > 1:
            return fail(f"--model-id is required: {args.config} serves {', '.join(ids)}")
        model_id = ids[0]
    if model_id not in ids:
        return fail(f"--model-id {model_id!r} is not in {args.config} (models: {', '.join(ids)})")
    from services.worker.server import run_worker

    if args.host is not None:
        config = config.model_copy(update={"worker_host": args.host})
    try:
        run_worker(config, model_id, args.service, args.index, port=args.port or 0)
    except ConfigError as exc:
        return fail(str(exc))
    return 0


def _port(text: str) -> int:
    value = _int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (0-65535)")
    return value


def _non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
