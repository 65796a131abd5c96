"""One line per event on stderr, each with the syslog ``<N>`` priority prefix journald reads.

journald (SyslogLevelPrefix=yes, the default for services) strips the prefix and stores the
priority; timestamps and the unit name come from journald itself, so lines carry neither.
"""

from __future__ import annotations

import logging
import sys

# syslog priorities (RFC 5424): 2 crit, 3 err, 4 warning, 5 notice, 6 info, 7 debug.
_PRIORITY = {
    logging.CRITICAL: 2,
    logging.ERROR: 3,
    logging.WARNING: 4,
    logging.INFO: 6,
    logging.DEBUG: 7,
}


def syslog_priority(levelno: int) -> int:
    for level in (logging.CRITICAL, logging.ERROR, logging.WARNING, logging.INFO):
        if levelno >= level:
            return _PRIORITY[level]
    return 7


class JournalLineFormatter(logging.Formatter):
    """``<N>logger: message`` on one line; embedded newlines (tracebacks too) become `` | ``."""

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.exc_info:
            text = f"{text} | {self.formatException(record.exc_info)}"
        text = text.replace("\r", "").replace("\n", " | ")
        return f"<{syslog_priority(record.levelno)}>{record.name}: {text}"


def setup_logging(level: str = "info", stream=None) -> None:
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JournalLineFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # httpx/hpack/hypercorn chatter stays below our events unless asked for.
    for noisy in ("httpx", "httpcore", "hpack", "hypercorn", "trio-websocket"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
