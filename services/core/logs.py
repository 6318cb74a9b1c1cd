"""Structured logs: one JSON object per line (time, level, service, logger, message, extra fields)."""

from __future__ import annotations

import json
import logging
import os
import sys
import time

_RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": round(record.created, 4),
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        doc.update({k: v for k, v in vars(record).items() if k not in _RESERVED and not k.startswith("_")})
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


class PrivateFileHandler(logging.StreamHandler):
    """Appends to a log file only its owner may read (0600, also when it existed wider), never through a symlink
    planted at its path: logs name runs, hosts and errors that are no other local user's business."""

    def __init__(self, path: str):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        os.fchmod(fd, 0o600)
        super().__init__(os.fdopen(fd, "a", encoding="utf-8"))
        self.baseFilename = os.path.abspath(path)

    def close(self) -> None:
        try:
            self.flush()
            self.stream.close()
        finally:
            super().close()


def setup_logging(service: str, log_file: str | None = None, level: str = "INFO") -> None:
    handler: logging.Handler = PrivateFileHandler(log_file) if log_file else logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.Formatter.converter = time.gmtime
