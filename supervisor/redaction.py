"""One redaction filter for every log line of the guard and its proxies.

Masks, in the formatted message, the exception text, the stack text and every extra string
attribute of a log record:

- the values of `Cookie`, `Set-Cookie`, `Authorization` and `Proxy-Authorization` headers
  (in `Name: value` lines, `name=value`, dict/tuple reprs such as `{'cookie': '...'}`),
- `Bearer <token>` and `Basic <credentials>` values,
- CDP WebSocket addresses (`ws://host:port/devtools/...`, also `wss://`),
- credentials in URLs (`scheme://user:pass@host` -> `scheme://[REDACTED]@host`),
- every value registered at run time with `register_secret(value)` (and its URL-encoded form).

How to use: call `install()` once at process start (the daemon, `sfguard proxy`, every CLI
command that logs). It does two things:

1. wraps `logging.Logger.handle` (class level, once): every record of every logger is masked
   BEFORE any handler sees it, so handlers added later (by us, mitmproxy or aiohttp) are
   covered without further calls, and so are `extra=` fields;
2. adds `RedactionFilter` to the handlers the root logger (or `logger`) has now, as a second
   line for records that reach a handler without going through a Logger.

Records are formatted first (msg % args), then masked; `args` is cleared and the exception
text is stored masked in `exc_text` (with `exc_info` cleared) so no formatter can re-render
the raw values.
"""
from __future__ import annotations

import contextvars
import json
import logging
import os
import re
import threading
import time
import traceback
import urllib.parse

MASK = "[REDACTED]"
_MIN_SECRET = 6

_lock = threading.Lock()
_secrets: set[str] = set()
_secret_re: re.Pattern | None = None
_installed = False

_HEADER_RE = re.compile(
    r"(?i)(?P<name>\b(?:proxy-authorization|authorization|set-cookie|cookie))"
    r"(?P<q>['\"]?)(?P<sep>\s*[:=,]\s*)"
    r"(?P<val>b?'[^'\r\n]*'|b?\"[^\"\r\n]*\"|[^\r\n]*)")
_AUTH_SCHEME_RE = re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]{4,}")
_CDP_RE = re.compile(r"(?i)\bwss?://[^\s'\"<>]*?/devtools/[^\s'\"<>]*")
_URL_CRED_RE = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@'\"<>]+@")

# Standard LogRecord attributes; anything else on a record came from `extra=`.
_STD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


def register_secret(value: str) -> None:
    """Mask `value` (and its URL-encoded form) in every log line from now on.

    Values shorter than 6 characters are refused (they would mask ordinary words).
    """
    global _secret_re
    if not isinstance(value, str) or len(value) < _MIN_SECRET:
        raise ValueError(f"a registered secret must be a string of at least {_MIN_SECRET} characters")
    with _lock:
        _secrets.add(value)
        quoted = urllib.parse.quote(value, safe="")
        if quoted != value:
            _secrets.add(quoted)
        ordered = sorted(_secrets, key=len, reverse=True)
        _secret_re = re.compile("|".join(re.escape(s) for s in ordered))


def forget_secrets() -> None:
    """Drop every registered secret (tests, or when a run ends and its secrets die)."""
    global _secret_re
    with _lock:
        _secrets.clear()
        _secret_re = None


def _mask_header(m: re.Match) -> str:
    val = m.group("val")
    if val[:1] == "b" and val[1:2] in ("'", '"'):
        masked = f"b{val[1]}{MASK}{val[1]}"
    elif val[:1] in ("'", '"'):
        masked = f"{val[0]}{MASK}{val[0]}"
    else:
        masked = MASK if val.strip() else val
    return f"{m.group('name')}{m.group('q')}{m.group('sep')}{masked}"


def redact(text: str) -> str:
    """Return `text` with every known secret shape and registered value masked."""
    if not text:
        return text
    pattern = _secret_re
    if pattern is not None:
        text = pattern.sub(MASK, text)
    text = _CDP_RE.sub(f"ws://{MASK}", text)
    text = _URL_CRED_RE.sub(lambda m: f"{m.group(1)}{MASK}@", text)
    text = _AUTH_SCHEME_RE.sub(lambda m: f"{m.group(1)} {MASK}", text)
    text = _HEADER_RE.sub(_mask_header, text)
    return text


def redact_record(record: logging.LogRecord) -> logging.LogRecord:
    """Mask a record in place (idempotent): message, args, exception, stack and extras."""
    if getattr(record, "sfguard_redacted", False):
        return record
    try:
        message = record.getMessage()
    except Exception:  # a log call never raises (a broken format string, an argument's str): keep the parts
        message = f"{record.msg!s} {record.args!r}"
    record.msg = redact(message)
    record.args = None
    if record.exc_info:
        text = record.exc_text or "".join(traceback.format_exception(*record.exc_info)).rstrip("\n")
        record.exc_text = redact(text)
        record.exc_info = None
    elif record.exc_text:
        record.exc_text = redact(record.exc_text)
    if record.stack_info:
        record.stack_info = redact(record.stack_info)
    for name, value in list(vars(record).items()):
        if name not in _STD_ATTRS and isinstance(value, str):
            setattr(record, name, redact(value))
        elif name not in _STD_ATTRS and isinstance(value, (dict, list, tuple)):
            setattr(record, name, redact(repr(value)))
    record.sfguard_redacted = True   # masked once (a record passes several handlers)
    return record


class RedactionFilter(logging.Filter):
    """A logging.Filter that masks the record and always lets it through."""

    def filter(self, record: logging.LogRecord) -> bool:
        redact_record(record)
        return True


_FILTER = RedactionFilter()


def install(logger: logging.Logger | None = None) -> RedactionFilter:
    """Redact every log record of this process. Call once at process start; idempotent."""
    global _installed
    with _lock:
        if not _installed:
            original = logging.Logger.handle

            def handle(self, record, _original=original):
                _add_bound_ids(record)
                redact_record(record)
                return _original(self, record)

            handle.__sfguard_original__ = original  # type: ignore[attr-defined]  # for uninstall
            logging.Logger.handle = handle  # type: ignore[method-assign]  # process-wide, on purpose
            _installed = True
    target = logger or logging.getLogger()
    for h in target.handlers:
        if _FILTER not in h.filters:
            h.addFilter(_FILTER)
    return _FILTER


#: The one line format of every guard process's log (the daemon, its run proxies): time,
#: level, logger, message; a message never spans lines.
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: `sfguard start --log-format json` sets this for the daemon and its run proxies
LOG_FORMAT_ENV = "SFGUARD_LOG_FORMAT"
#: ids a log call may carry (`log.info(..., extra={"run": run_id})`): copied into a JSON line
LOG_IDS = ("run", "stage", "profile", "session")
#: ids of what this task works for (`bind_log_ids`): a record without its own gets them
_log_ids: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("sfguard_log_ids", default=None)


def bind_log_ids(**ids: str | None) -> contextvars.Token[dict[str, str] | None]:
    """Every record logged from here on in this task (and the tasks it starts) carries these
    ids (`run`, `stage`, ...) unless the call gives its own; `unbind_log_ids(token)` ends it.
    The control API binds a route's run and stage; a run proxy process its run."""
    bound = {**(_log_ids.get() or {}), **{k: v for k, v in ids.items() if k in LOG_IDS and v}}
    return _log_ids.set(bound)


def unbind_log_ids(token: contextvars.Token[dict[str, str] | None]) -> None:
    _log_ids.reset(token)


def _add_bound_ids(record: logging.LogRecord) -> None:
    bound = _log_ids.get()
    if bound:
        for key, value in bound.items():
            if not isinstance(getattr(record, key, None), str):
                setattr(record, key, value)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (UTC, ISO 8601), level, logger, event (the message, masked
    like every record), pid, the ids a record carries, and exc (a traceback, one string)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname, "logger": record.name, "event": record.getMessage(),
            "pid": record.process}
        for key in LOG_IDS:
            value = getattr(record, key, None)
            if isinstance(value, str):
                out[key] = value
        if record.exc_text:          # masked by redact_record, which every record passes
            out["exc"] = record.exc_text
        elif record.exc_info:
            out["exc"] = redact(self.formatException(record.exc_info))
        return json.dumps(out, ensure_ascii=True, separators=(",", ":"))


def log_line(event: str, *, logger: str = "sfguard.start", level: str = "INFO",
             kind: str | None = None) -> str:
    """A line a guard process prints itself rather than logs (the start banner, the stop line,
    a start-up error): as is in the text format, one JSON object like a log record's in the
    json format (`kind` or $SFGUARD_LOG_FORMAT). Printed as given: the banner names the TCP
    token on purpose when no --token-file is given."""
    kind = kind or os.environ.get(LOG_FORMAT_ENV) or "text"
    if kind != "json":
        return event
    now = time.time()
    return json.dumps({"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z",
                       "level": level, "logger": logger, "event": event, "pid": os.getpid()},
                      ensure_ascii=True, separators=(",", ":"))


def formatter(kind: str | None = None) -> logging.Formatter:
    """The formatter of this process's log: `kind` or $SFGUARD_LOG_FORMAT, `text` or `json`."""
    kind = kind or os.environ.get(LOG_FORMAT_ENV) or "text"
    return JsonFormatter() if kind == "json" else logging.Formatter(LOG_FORMAT)
