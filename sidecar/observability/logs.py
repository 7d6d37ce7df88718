"""Log lines: text or JSON, one per line, for the sidecar's loggers and uvicorn's alike.

A record may carry ``fields`` (``extra={"fields": {...}}``): the JSON format writes them as keys
of the line's object, the text format as ``key=value`` after the message. A request's id (the
client's ``X-Request-Id``, or one the sidecar made) is a context variable set by the generation
path: every line logged while that request runs carries it as ``request_id``, and, when tracing
is on, its span's ids as ``trace_id`` and ``span_id`` (W3C hex, as the trace backend shows them),
to go from a line to its trace.

The access log (logger ``sidecar.access``) writes one line per request from a
:class:`RequestRecord`, a closed set of fields: nothing from the request's headers but its id,
nothing from its body but the model name. Authorization headers, API keys, prompts and message
content never reach a log line.

>>> import logging
>>> record = logging.LogRecord("sidecar", logging.INFO, "", 0, "vLLM %s", ("up",), None)
>>> record.created = 0.0
>>> JsonFormatter().format(record)
'{"time":"1970-01-01T00:00:00.000Z","level":"INFO","logger":"sidecar","message":"vLLM up"}'
>>> record.fields = {"status": 200, "reason": None}
>>> TextFormatter().format(record).split(" ", 2)[2]
'INFO sidecar: vLLM up status=200'
"""

from __future__ import annotations

import contextvars
import json
import logging
import logging.config
import time
from typing import Any

from sidecar.config import LogFormat

ACCESS = logging.getLogger("sidecar.access")

#: the id of the request whose task is running (None: not in a request)
REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "kv_sidecar_request_id", default=None
)
#: the (trace_id, span_id) of the request span whose task is running (None: no tracing)
TRACE_IDS: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar(
    "kv_sidecar_trace_ids", default=None
)
#: longest client-chosen string (request id, model name) written to a line
MAX_FIELD_CHARS = 200


def _rfc3339(created: float) -> str:
    seconds = int(created)
    return (
        time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
        + f".{int((created - seconds) * 1000):03d}Z"
    )


def _fields(record: logging.LogRecord) -> dict[str, Any] | None:
    fields: dict[str, Any] | None = getattr(record, "fields", None)
    request_id = REQUEST_ID.get()
    if request_id is not None and (fields is None or "request_id" not in fields):
        fields = {"request_id": request_id, **(fields or {})}
    ids = TRACE_IDS.get()
    if ids is not None:
        fields = {**(fields or {}), "trace_id": ids[0], "span_id": ids[1]}
    return fields


class TextFormatter(logging.Formatter):
    """``time LEVEL logger: message key=value ...`` (fields that are None left out)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        fields = _fields(record)
        if not fields:
            return line
        pairs = " ".join(
            f"{key}={_text(value)}" for key, value in fields.items() if value is not None
        )
        return f"{line} {pairs}" if pairs else line


def _text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6f}".rstrip("0").rstrip(".") or "0"
    text = str(value)
    return json.dumps(text) if (not text or " " in text or '"' in text) else text


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``time`` (RFC 3339, UTC), ``level``, ``logger``, ``message``,
    then the record's fields, and ``exception`` with a traceback."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": _rfc3339(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = _fields(record)
        if fields:
            out.update(fields)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, separators=(",", ":"), default=str)


def logging_config(level: str, fmt: LogFormat) -> dict[str, Any]:
    """A :func:`logging.config.dictConfig` that sends every logger, uvicorn's included, to
    stderr in ``fmt``. uvicorn's own access log is off: ``sidecar.access`` replaces it."""
    formatter = JsonFormatter if fmt is LogFormat.json else TextFormatter
    through_root = {"handlers": [], "propagate": True}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"sidecar": {"()": formatter}},
        "handlers": {
            "stderr": {
                "class": "logging.StreamHandler",
                "formatter": "sidecar",
                "stream": "ext://sys.stderr",
            }
        },
        "root": {"level": level.upper(), "handlers": ["stderr"]},
        "loggers": {
            "uvicorn": through_root,
            "uvicorn.error": through_root,
            "uvicorn.access": {"handlers": [], "propagate": False},
            # one line per upstream request would drown the sidecar's own log
            "httpx": {"level": "WARNING"},
        },
    }


def configure(level: str, fmt: LogFormat) -> None:
    """Set up the process's logging (once, before the servers start)."""
    logging.config.dictConfig(logging_config(level, fmt))
    logging.captureWarnings(True)  # Python's warnings as log lines (py.warnings), not raw text


def clip(value: str) -> str:
    return value if len(value) <= MAX_FIELD_CHARS else value[:MAX_FIELD_CHARS] + "..."


class RequestRecord:
    """What one generation request did, filled in as it goes: the access log line and the
    request's spans are written from it. Times are ``time.perf_counter()`` readings."""

    __slots__ = (
        "admit_end",
        "admit_start",
        "completion_tokens",
        "count_end",
        "count_method",
        "count_start",
        "decision",
        "endpoint",
        "generated_id",
        "id_header",
        "model",
        "path",
        "projected_blocks",
        "prompt_tokens",
        "queue_wait_s",
        "reason",
        "request_id",
        "reserved_blocks",
        "start",
        "status",
        "stream",
        "upstream_error",
    )

    def __init__(self, request_id: str, path: str, endpoint: str) -> None:
        self.request_id = request_id
        self.path = path
        self.endpoint = endpoint
        self.generated_id = False  # the sidecar made the id: it goes to vLLM as X-Request-Id
        #: the X-Request-Id the client's answer carries: the client's as sent, else the made one
        self.id_header = request_id.encode("latin-1")
        self.start = time.perf_counter()
        self.model: str | None = None
        self.stream: bool | None = None
        self.count_start: float | None = None
        self.count_end: float | None = None
        self.count_method: str | None = None
        self.prompt_tokens: int | None = None
        self.projected_blocks: int | None = None
        self.admit_start: float | None = None
        self.admit_end: float | None = None
        self.decision: str | None = None  # admit, reject or cancel
        self.reason: str | None = None  # the decision's reason (kv_sidecar_requests_total's)
        self.queue_wait_s: float | None = None
        self.reserved_blocks: int | None = None
        #: the status sent to the client; 499 (nginx's): the client left before an answer began
        self.status = 499
        self.completion_tokens: int | None = None
        self.upstream_error: str | None = None

    def access_fields(self, duration_s: float) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "method": "POST",
            "path": self.path,
            "endpoint": self.endpoint,
            "model": self.model,
            "stream": self.stream,
            "decision": self.decision,
            "reason": self.reason,
            "prompt_tokens": self.prompt_tokens,
            "count_method": self.count_method,
            "projected_blocks": self.projected_blocks,
            "reserved_blocks": self.reserved_blocks,
            "queue_wait_s": self.queue_wait_s,
            "status": self.status,
            "completion_tokens": self.completion_tokens,
            "upstream_error": self.upstream_error,
            "duration_s": round(duration_s, 6),
        }


def log_generation(record: RequestRecord, duration_s: float) -> None:
    """The access log line of one generation request."""
    ACCESS.info(
        "POST %s %d",
        record.path,
        record.status,
        extra={"fields": record.access_fields(duration_s)},
    )


def log_passthrough(
    method: str, path: str, status: int, duration_s: float, request_id: str | None
) -> None:
    """The access log line of one pass-through request (with ``--access-log all``)."""
    ACCESS.info(
        "%s %s %d",
        method,
        path,
        status,
        extra={
            "fields": {
                "request_id": request_id,
                "method": method,
                "path": path,
                "status": status,
                "duration_s": round(duration_s, 6),
            }
        },
    )
