"""The daemon's log lines: plain on a terminal or in a file, with syslog priority prefixes
(`<3>` error, `<4>` warning, `<6>` info, `<7>` debug) when stderr is the systemd journal, which
turns each prefix into the entry's priority (`journalctl -p warning` then finds warnings).

systemd sets JOURNAL_STREAM=<device>:<inode> to the stream it connected to stdout/stderr;
children inherit the variable even when their stderr goes elsewhere, so it counts only when
stderr's own device and inode match (as sd_journal_stream_fd(3) and systemd.exec(5) advise).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import TextIO

PREFIX = "moestream-iod: "
PRIORITIES = ((logging.ERROR, 3), (logging.WARNING, 4), (logging.INFO, 6))  # else debug: 7


def stderr_is_journal(stream: TextIO | None = None, environ: Mapping[str, str] | None = None) -> bool:
    stream = sys.stderr if stream is None else stream
    value = (os.environ if environ is None else environ).get("JOURNAL_STREAM", "")
    try:
        dev, ino = (int(x) for x in value.split(":"))
        st = os.fstat(stream.fileno())
    except (ValueError, OSError, AttributeError):  # unset or malformed, or a stream with no descriptor
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def priority(levelno: int) -> int:
    """The syslog priority of a logging level (CRITICAL counts as error)."""
    return next((p for level, p in PRIORITIES if levelno >= level), 7)


class _JournalFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"<{priority(record.levelno)}>{super().format(record)}"


def setup(level: str) -> None:
    """Log to stderr at `level` ("info", ...), prefixed for the journal when that is where stderr goes."""
    handler = logging.StreamHandler(sys.stderr)
    fmt = PREFIX + "%(levelname)s %(message)s"
    handler.setFormatter(_JournalFormatter(fmt) if stderr_is_journal() else logging.Formatter(fmt))
    logging.basicConfig(level=level.upper(), handlers=[handler])


def error_line(message: str) -> str:
    """A fatal error's one line on stderr (before or without logging)."""
    line = f"{PREFIX}error: {message}"
    return f"<3>{line}" if stderr_is_journal() else line
