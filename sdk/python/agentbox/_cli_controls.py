"""``agentbox usage``, ``agentbox metrics SBX``, ``agentbox logs SBX``: metering and a
sandbox's own figures and logs (added to the client CLI by ``agentbox.client_cli``; same
``--json`` and error rules)."""

from __future__ import annotations

import argparse
import datetime
from collections.abc import Callable

from agentbox import _cli_output as out
from agentbox.client_cli import _client

AddCommand = Callable[..., argparse.ArgumentParser]


def add_commands(cmd: AddCommand) -> None:
    p = cmd("usage", cmd_usage, "metered use of this key (admin: --key ID or --key '*')")
    p.add_argument("--from", dest="start", type=_when, help="Unix time or ISO date (UTC)")
    p.add_argument("--to", dest="end", type=_when, help="Unix time or ISO date (default now)")
    p.add_argument("--key", help="admin key only: another key's id, or * for every key")
    p.add_argument("--sandboxes", action="store_true", help="one line per sandbox too")
    cmd("metrics", cmd_metrics, "CPU, memory and disk use of a sandbox").add_argument("sandbox")
    p = cmd("logs", cmd_logs, "a sandbox's console log tail and state changes")
    p.add_argument("sandbox")
    p.add_argument("--tail", type=int, default=None, help="lines of console (default 200)")
    p.add_argument("--events", action="store_true", help="print the state changes too")


def _when(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = datetime.datetime.fromisoformat(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a Unix time or ISO date: {text!r}") from exc
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    return moment.timestamp()


def cmd_usage(args: argparse.Namespace) -> int:
    with _client(args) as box:
        usage = box.usage(args.start, args.end, key=args.key)
    if args.json:
        out.print_json(usage)
        return 0
    rows = []
    for k in usage.keys:
        rows.append((k.key, "", f"{k.vcpu_seconds:.1f}", f"{k.gib_seconds:.1f}",
                     f"{k.snapshot_gib_hours:.4f}", k.restores, k.created, k.destroyed))
        if args.sandboxes:
            rows += [("", s.sandbox_id, f"{s.vcpu_seconds:.1f}", f"{s.gib_seconds:.1f}",
                      f"{s.snapshot_gib_hours:.4f}", s.restores, s.created, s.destroyed)
                     for s in k.sandboxes]
    out.table(rows, ("KEY", "SANDBOX", "VCPU-S", "GIB-S", "SNAPSHOT-GIB-H", "RESTORES",
                     "CREATED", "DESTROYED"))
    return 0


def cmd_metrics(args: argparse.Namespace) -> int:
    with _client(args) as box:
        metrics = box.connect(args.sandbox).metrics()
    if args.json:
        out.print_json(metrics)
    else:
        for key, value in out.to_jsonable(metrics).items():
            print(f"{key:16} {'-' if value is None else value}")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    with _client(args) as box:
        logs = box.connect(args.sandbox).logs(args.tail)
    if args.json:
        out.print_json(logs)
        return 0
    if args.events:
        for ev in logs.events:
            print(f"{_iso(ev.at)} {ev.from_ or '-'} -> {ev.to} ({ev.event}): {ev.cause}")
    for line in logs.console:
        print(line)
    return 0


def _iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
