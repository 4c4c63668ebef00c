"""`space logs [COMPONENT] [--follow] [--since] [--request-id ID]`: this machine's SPACE logs, merged and
pretty-printed (ADR 0071).

Where they are read from (`--source auto`): the journal (`journalctl -u space-…`) when SPACE is installed as
systemd services (`space service install`), else the files a local installation writes in its data
directory (`space up`, `space node join`): controlplane.log, agent.log (the egress gateway's lines are in
it), helper.log and space.log (the supervisor's events).

Lines are JSON objects (SPACE_LOG_FORMAT=json, the services' default: space.rest.log_records) or text (the
default of `space up`); both are shown, filtered by component, request id and time. `--raw` prints the
lines as they are (for jq or grep).

Invariants:
- A log line is data, never markup: it is printed as plain text with control characters (ANSI escapes,
  carriage returns) replaced, so a line a sandbox's request put into a log cannot restyle or rewrite the
  operator's terminal.
- Files are read from their last MAX_TAIL_BYTES only (logs grow without bound); `--follow` reads what is
  appended after that, from each file's end.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Final, TextIO

import typer
from rich.console import Console
from rich.text import Text

from space.cli import service_units
from space.cli._common import handles_errors
from space.cli.installation import DEFAULT_DATA_DIR
from space.cli.service import DEFAULT_UNIT_DIR
from space.core import errors

#: Components and the file a local installation writes each to.
FILES: Final = {"controlplane": "controlplane.log", "agent": "agent.log", "helper": "helper.log",
                "supervisor": "space.log"}  # fmt: skip
#: The gateway logs inside the agent's process (space.rest.log_records.component_of).
COMPONENTS: Final = (*FILES, "gateway")
MAX_TAIL_BYTES: Final = 4 << 20
FOLLOW_POLL_S: Final = 0.5
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_TEXT_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d)(?:[,.](\d{1,6}))?")
_TEXT_IDS = re.compile(r"\[request_id=([A-Za-z0-9._-]+)")
_LEVEL_STYLES: Final = {"error": "bold red", "critical": "bold red", "warning": "yellow", "debug": "dim"}
_DURATION = re.compile(r"^(\d{1,9})([smhd])$")
_UNITS_S: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400}


@dataclass(frozen=True)
class Line:
    """One log line and what is known of it."""

    raw: str
    component: str
    ts: datetime | None = None
    level: str | None = None
    logger: str | None = None
    msg: str | None = None
    request_id: str | None = None
    sandbox_id: str | None = None
    error: str | None = None


def parse_since(value: str, now: datetime | None = None) -> datetime:
    """`10m`, `2h`, `30s`, `1d` ago, or an ISO 8601 time (UTC if it names no zone)."""
    now = now or datetime.now(UTC)
    found = _DURATION.fullmatch(value.strip())
    if found:
        return now - timedelta(seconds=int(found.group(1)) * _UNITS_S[found.group(2)])
    try:
        moment = datetime.fromisoformat(value.strip())
    except ValueError as exc:
        raise errors.InvalidArgument(
            f"--since is a duration (30s, 10m, 2h, 1d) or an ISO time, not {value[:40]!r}", field="since"
        ) from exc
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _time(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        return None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def parse_line(raw: str, component: str) -> Line:
    """A JSON line (ours, or the supervisor's events) or a text line of `component`'s log."""
    raw = raw.rstrip("\n")
    if raw.startswith("{"):
        try:
            record: Any = json.loads(raw)
        except ValueError:
            record = None
        if isinstance(record, dict):
            return _json_line(raw, record, component)
    stamp = _TEXT_STAMP.match(raw)
    ts = None
    if stamp:  # `logging`'s asctime is local time
        ts = datetime.fromisoformat(stamp.group(1).replace(" ", "T")).astimezone(UTC)
    ids = _TEXT_IDS.search(raw)
    gateway = component == "agent" and " space.node.egress" in raw
    return Line(
        raw, "gateway" if gateway else component, ts, msg=raw, request_id=ids.group(1) if ids else None
    )


def _json_line(raw: str, record: dict[str, Any], component: str) -> Line:
    if record.get("source") == "supervisor":  # space up's events: {"ts", "source", "event", ...}
        details = " ".join(f"{k}={v}" for k, v in record.items() if k not in {"ts", "source", "event"})
        msg = f"{record.get('event')} {details}".strip()
        return Line(raw, "supervisor", _time(record.get("ts")), "info", "supervisor", msg)
    return Line(
        raw, _text(record.get("component")) or component, _time(record.get("ts")), _text(record.get("level")),
        _text(record.get("logger")), _text(record.get("msg")), _text(record.get("request_id")),
        _text(record.get("sandbox_id")), _text(record.get("error")),
    )  # fmt: skip


@dataclass(frozen=True)
class Filter:
    """Which lines are shown (None: any)."""

    component: str | None = None
    request_id: str | None = None
    since: datetime | None = None

    def __call__(self, line: Line) -> bool:
        if self.component is not None and line.component != self.component:
            return False
        if self.request_id is not None and line.request_id != self.request_id:
            return False
        return self.since is None or (line.ts is not None and line.ts >= self.since)


def _clean(text: str) -> str:
    return _CONTROL.sub("?", text)


def render(line: Line) -> Text:
    """One line for the terminal (plain text, never markup; control characters replaced)."""
    if line.level is None:
        return Text(_clean(line.raw))
    out = Text()
    if line.ts is not None:
        out.append(line.ts.astimezone(UTC).strftime("%H:%M:%S.%f")[:-3] + " ", style="dim")
    out.append(f"{line.level.upper():<7} ", style=_LEVEL_STYLES.get(line.level, "green"))
    out.append(f"{line.component:<12} ", style="cyan")
    if line.logger:
        out.append(_clean(line.logger) + ": ", style="dim")
    out.append(_clean(line.msg or ""))
    ids = [f"{name}={value}" for name, value in (("req", line.request_id), ("sb", line.sandbox_id)) if value]
    if ids:
        out.append("  " + _clean(" ".join(ids)), style="magenta")
    if line.error:
        out.append("\n    " + _clean(line.error).replace("\n", "\n    "), style="red")
    return out


def _tail(path: pathlib.Path) -> tuple[list[str], int]:
    """The complete lines of the file's last MAX_TAIL_BYTES, and the offset its end had."""
    with path.open("rb") as handle:
        size = handle.seek(0, 2)
        start = max(0, size - MAX_TAIL_BYTES)
        handle.seek(start)
        data = handle.read(size - start)
    lines = data.decode("utf-8", "replace").splitlines()
    if start > 0 and lines:
        lines = lines[1:]  # the first one was cut
    return lines, size


def file_sources(data_dir: pathlib.Path, component: str | None) -> dict[str, pathlib.Path]:
    """The log files of the installation in `data_dir` (those that exist) for `component`."""
    names = dict(FILES)
    if component == "gateway":
        names = {"agent": FILES["agent"]}
    elif component is not None:
        names = {component: FILES[component]}
    return {name: data_dir / file for name, file in names.items() if (data_dir / file).is_file()}


def read_files(sources: dict[str, pathlib.Path]) -> tuple[list[Line], dict[str, int]]:
    """Every line of the sources' tails, ordered by time (lines without one keep their file's order)."""
    lines: list[Line] = []
    offsets = {}
    for component, path in sources.items():
        raw_lines, offsets[component] = _tail(path)
        lines.extend(parse_line(raw, component) for raw in raw_lines)
    epoch = datetime.min.replace(tzinfo=UTC)
    lines.sort(key=lambda line: line.ts or epoch)  # stable: untimed lines stay after their predecessors
    return lines, offsets


def follow_files(sources: dict[str, pathlib.Path], offsets: dict[str, int]) -> Iterator[Line]:
    """Lines appended to the sources from `offsets` on, as they come (a rotated, shorter file is read
    from its start)."""
    partial = dict.fromkeys(sources, "")
    while True:
        for component, path in sources.items():
            try:
                size = path.stat().st_size
            except OSError:
                continue
            offset = offsets.get(component, 0)
            if size < offset:
                offset = 0
            if size == offset:
                continue
            with path.open("rb") as handle:
                handle.seek(offset)
                data = handle.read(min(size - offset, MAX_TAIL_BYTES))
            offsets[component] = offset + len(data)
            text = partial[component] + data.decode("utf-8", "replace")
            *complete, partial[component] = text.split("\n")
            for raw in complete:
                yield parse_line(raw, component)
        time.sleep(FOLLOW_POLL_S)


def journal_installed(unit_dir: pathlib.Path = DEFAULT_UNIT_DIR) -> bool:
    """Whether SPACE runs as systemd services here (its units are installed and the journal is readable)."""
    return any((unit_dir / name).exists() for name in service_units.UNIT_NAMES) and bool(
        shutil.which("journalctl")
    )


def journal_argv(since: datetime | None, *, follow: bool, lines: int | None) -> list[str]:
    """journalctl for SPACE's units: the message of each entry only (the services write JSON lines);
    `lines` None: every entry (since `since`), for a filter that keeps the last matches itself."""
    argv = ["journalctl", "--output=cat", "--no-pager", *([f"--lines={lines}"] if lines is not None else [])]
    argv += [f"--unit={name}" for name in service_units.UNIT_NAMES]
    if since is not None:
        argv.append(f"--since={since.astimezone(UTC).strftime('%Y-%m-%d %H:%M:%S')} UTC")
    if follow:
        argv.append("--follow")
    return argv


def _journal_lines(argv: list[str]) -> Iterator[Line]:
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, errors="replace") as process:
        assert process.stdout is not None
        for raw in process.stdout:
            yield parse_line(raw, "journal")


def _emit(lines: Iterable[Line], out: Console, raw_out: TextIO | None, keep: Filter) -> None:
    for line in lines:
        if not keep(line):
            continue
        if raw_out is not None:
            raw_out.write(line.raw + "\n")
            raw_out.flush()
        else:
            out.print(render(line), markup=False, highlight=False, soft_wrap=True)


ComponentArgument = Annotated[
    str | None,
    typer.Argument(
        help="controlplane, agent, gateway, helper or supervisor (default: all)", show_default=False
    ),
]


@handles_errors
def logs_command(
    component: ComponentArgument = None,
    *,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="keep printing new lines")] = False,
    since: Annotated[
        str | None, typer.Option("--since", metavar="WHEN", help="30s, 10m, 2h, 1d or an ISO time")
    ] = None,
    request_id: Annotated[
        str | None, typer.Option("--request-id", metavar="ID", help="only the lines of this request")
    ] = None,
    lines: Annotated[int, typer.Option("--lines", "-n", min=1, max=100_000, help="lines shown first")] = 200,
    raw: Annotated[bool, typer.Option("--raw", help="the lines as written (JSON or text)")] = False,
    source: Annotated[str, typer.Option("--source", help="auto, files or journal")] = "auto",
    data_dir: Annotated[
        pathlib.Path, typer.Option("--data-dir", help="the local installation's directory")
    ] = DEFAULT_DATA_DIR,
) -> None:
    """This machine's SPACE logs (the journal of its services, or a local installation's files)."""
    if component is not None and component not in COMPONENTS:
        raise errors.InvalidArgument(f"COMPONENT is one of {', '.join(COMPONENTS)}", field="component")
    if source not in {"auto", "files", "journal"}:
        raise errors.InvalidArgument("--source is auto, files or journal", field="source")
    keep = Filter(component, request_id, parse_since(since) if since else None)
    out = Console()
    raw_out = typer.get_text_stream("stdout") if raw else None
    try:
        if source == "journal" or (source == "auto" and journal_installed()):
            if follow:  # journalctl shows its last lines, then follows
                _emit(_journal_lines(journal_argv(keep.since, follow=True, lines=lines)), out, raw_out, keep)
                return
            # The last `lines` of those that match (a request's lines may be older than the last lines).
            every = _journal_lines(journal_argv(keep.since, follow=False, lines=None))
            _emit([line for line in every if keep(line)][-lines:], out, raw_out, Filter())
            return
        sources = file_sources(data_dir, component)
        if not sources:
            raise errors.NotFound(f"no SPACE log files in {data_dir} (and no SPACE service installed)")
        first, offsets = read_files(sources)
        _emit([line for line in first if keep(line)][-lines:], out, raw_out, Filter())
        if follow:
            _emit(follow_files(sources, offsets), out, raw_out, keep)
    except KeyboardInterrupt:
        return
