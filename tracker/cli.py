"""The ``kmq-tracker`` command line: run, migrate, demo, decode-marker."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import tomllib
from collections.abc import Sequence

from pydantic import ValidationError
from pydantic_settings import SettingsError

from tracker import __version__
from tracker.errors import KmqError, MarkerError
from tracker.gc_policy import apply_gc_policy
from tracker.protocol import decode_marker
from tracker.settings import CONFIG_FILE_ENV, TrackerSettings
from tracker.settings_loading import ConfigFileError, load_settings, unknown_environment

log = logging.getLogger("tracker.cli")


def _settings(args: argparse.Namespace) -> TrackerSettings:
    """Load the settings, configure logging from them, and warn about ignored variables."""
    from tracker.logs import configure_logging  # noqa: PLC0415

    settings = load_settings(args.config)
    configure_logging(settings.log_level, settings.log_format)
    for warning in unknown_environment(os.environ):
        log.warning("%s", warning)
    return settings


def _one_line(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error["loc"]) or "settings"
        parts.append(f"{where}: {error['msg']}")
    return "invalid configuration: " + "; ".join(parts)


async def _run(settings: TrackerSettings) -> None:
    """Run the tracker until SIGTERM/SIGINT, which stop it cleanly also while it starts.

    ``Tracker.stop`` is heard only once the tracker runs, and starting can wait a long time
    for a broker that is away (creating a topic alone waits up to 30 s). So a signal during
    startup cancels the startup instead; ``Tracker.start`` then closes what it had opened.
    Only the first signal acts: a second one must not interrupt that cleanup.
    """
    from tracker.runtime import create_tracker  # noqa: PLC0415 - keep `--help` fast

    tracker = create_tracker(settings)
    startup = asyncio.create_task(tracker.start(), name="kmq-startup")
    signalled = False

    def stop() -> None:
        nonlocal signalled
        if not signalled:
            signalled = True
            tracker.stop()
            startup.cancel()  # no effect once started

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    await asyncio.wait({startup})
    if startup.cancelled():
        log.info("stopped while starting")
        return
    startup.result()  # a failed start raises here
    await tracker.run()


def _cmd_run(args: argparse.Namespace) -> int:
    """Run the tracker (ingest, redelivery, redrive jobs, HTTP API) until SIGTERM/SIGINT."""
    settings = _settings(args)
    apply_gc_policy(settings.gc_gen0_threshold)
    asyncio.run(_run(settings))
    return 0


def _cmd_migrate(args: argparse.Namespace) -> int:
    """Bring the database schema to the latest version."""
    from tracker.store.dialects import create_engine  # noqa: PLC0415
    from tracker.store.migrate import (  # noqa: PLC0415
        current_revision,
        database_errors,
        upgrade,
    )

    settings = _settings(args)

    async def migrate() -> str | None:
        engine = create_engine(settings.database_url)
        try:
            async with database_errors(engine):
                await upgrade(engine, args.revision)
                return await current_revision(engine)
        finally:
            await engine.dispose()

    revision = asyncio.run(migrate())
    print(f"database schema at revision {revision}")
    return 0


def _cmd_rebind(args: argparse.Namespace) -> int:
    """Move the database from a retired markers topic to the configured one (markers_topic)."""
    from tracker.clock import SystemClock, to_millis  # noqa: PLC0415
    from tracker.store.database import SqlDatabase  # noqa: PLC0415
    from tracker.store.migrate import check_schema, database_errors  # noqa: PLC0415
    from tracker.store.topic_binding import rebind_markers_topic  # noqa: PLC0415

    settings = _settings(args)

    async def rebind() -> None:
        database = SqlDatabase.from_url(settings.database_url)
        try:
            async with database_errors(database.engine):
                await check_schema(database.engine)
                await rebind_markers_topic(
                    database,
                    args.old,
                    settings.markers_topic,
                    by=f"{settings.replica_id}/rebind-markers-topic",
                    now_ms=to_millis(SystemClock().now()),
                )
        finally:
            await database.close()

    asyncio.run(rebind())
    print(f"the database now serves markers topic {settings.markers_topic!r} (was {args.old!r})")
    return 0


def _cmd_api(args: argparse.Namespace) -> int:
    """Serve the admin API alone (own store and Kafka clients; runs redrive jobs)."""
    from tracker.runtime import serve_standalone  # noqa: PLC0415

    settings = _settings(args)
    apply_gc_policy(settings.gc_gen0_threshold)

    async def serve() -> None:
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopping.set)
        await serve_standalone(settings, stopping)

    asyncio.run(serve())
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    """Run a local broker, the tracker on SQLite and a demo workload; Ctrl-C stops."""
    from tracker.demo import run_demo  # noqa: PLC0415

    return run_demo(duration=args.duration, workdir=args.workdir)


def _run_pipeline(argv: Sequence[str]) -> int:
    """Spark jobs: delivery ledger, audit, analytics report, bulk redrive (extra [spark])."""
    from pipeline.commands import main as pipeline_main  # noqa: PLC0415

    return pipeline_main(list(argv))


def _cmd_decode(args: argparse.Namespace) -> int:
    """Decode marker values given as hex (one per argument, or one per line on stdin)."""
    values: list[str] = list(args.hex) or [line.strip() for line in sys.stdin if line.strip()]
    status = 0
    for text in values:
        try:
            marker = decode_marker(bytes.fromhex(text.replace(" ", "")))
        except ValueError as exc:  # MarkerError is a ValueError; so is bad hex
            kind = "invalid marker" if isinstance(exc, MarkerError) else "invalid hex"
            print(f"{kind}: {exc}", file=sys.stderr)
            status = 1
            continue
        fields = {k: v for k, v in marker._asdict().items() if v not in ("", 0, False)}
        fields["kind"] = marker.kind.name
        print(" ".join(f"{k}={v}" for k, v in fields.items()))
    return status


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kmq-tracker",
        description="Job-queue semantics for Kafka consumer groups, tracked by markers.",
    )
    parser.add_argument("--version", action="version", version=f"kmq-tracker {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser("run", help=_cmd_run.__doc__)
    run.add_argument("--config", help="TOML settings file (else KMQ_CONFIG_FILE / env only)")
    run.set_defaults(func=_cmd_run)

    migrate = commands.add_parser("migrate", help=_cmd_migrate.__doc__)
    migrate.add_argument("--config", help="TOML settings file")
    migrate.add_argument("--revision", default="head", help="target revision (default: head)")
    migrate.set_defaults(func=_cmd_migrate)

    rebind = commands.add_parser("rebind-markers-topic", help=_cmd_rebind.__doc__)
    rebind.add_argument("--config", help="TOML settings file")
    rebind.add_argument(
        "--from",
        dest="old",
        required=True,
        metavar="TOPIC",
        help="the markers topic the database serves now (refused if it serves another)",
    )
    rebind.set_defaults(func=_cmd_rebind)

    api = commands.add_parser("api", help=_cmd_api.__doc__)
    api.add_argument("--config", help="TOML settings file")
    api.set_defaults(func=_cmd_api)

    demo = commands.add_parser("demo", help=_cmd_demo.__doc__)
    demo.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    demo.add_argument("--workdir", default=None, help="where the demo keeps its SQLite file")
    demo.set_defaults(func=_cmd_demo)

    pipeline = commands.add_parser("pipeline", help=_run_pipeline.__doc__, add_help=False)
    pipeline.add_argument("pipeline_args", nargs=argparse.REMAINDER)
    pipeline.set_defaults(func=lambda a: _run_pipeline(a.pipeline_args))

    decode = commands.add_parser("decode-marker", help=_cmd_decode.__doc__)
    decode.add_argument("hex", nargs="*", help="marker values in hex; stdin if none")
    decode.set_defaults(func=_cmd_decode)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["pipeline"]:
        # The pipeline has its own parser (and --help); argparse.REMAINDER would refuse it.
        return _run_pipeline(arguments[1:])
    args = build_parser().parse_args(arguments)
    try:
        status: int = args.func(args)
    except ValidationError as exc:
        print(f"kmq-tracker: {_one_line(exc)}", file=sys.stderr)
        return 2
    except (ConfigFileError, KmqError) as exc:
        print(f"kmq-tracker: {exc}", file=sys.stderr)
        return 2
    except SettingsError as exc:  # e.g. a dict setting whose environment value is not JSON
        print(f"kmq-tracker: invalid configuration: {exc}", file=sys.stderr)
        return 2
    except tomllib.TOMLDecodeError as exc:
        path = getattr(args, "config", None) or os.environ.get(CONFIG_FILE_ENV, "")
        print(f"kmq-tracker: config file {path!r} is not valid TOML: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return status


if __name__ == "__main__":
    raise SystemExit(main())
