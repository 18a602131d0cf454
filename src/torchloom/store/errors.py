"""What a store's failure means and how long an operation asks again: the one-line errors of store/storage.py (no key in
them: an error's URL may carry a SAS token's sig=...), and the bounded retry of transient errors.

A store that does not answer for a moment (a reset connection, a timeout, HTTP 5xx, SlowDown) is asked again
with backoff for a bounded window (retry_window), with one warning line per operation; an error that a retry
cannot mend (no bucket, access denied, unknown keys) is one line at once.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import time
from collections.abc import Callable

from torchloom.errors import UserError
from torchloom.redaction import redact_text
from torchloom.store import clients as store_clients
from torchloom.store.clients import SCHEMES
from torchloom.uri import URI, redact


class NoBucket(OSError):
    """A write that found no bucket (an S3 or Azure store says so in its error; GCS answers 404)."""


def reason(e: BaseException, uri: str = "") -> str:
    """What went wrong, in words, with no key in them (an error's URL may carry a SAS token's sig=...)."""
    if isinstance(e, NoBucket):
        return "the bucket does not exist"
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    unanswered = f"the store does not answer: check {endpoint_hint(uri)} and the network"
    for code, say in (("NO_SUCH_BUCKET", "the bucket does not exist"),
                      ("ACCESS_DENIED", "access denied: the credentials may not use this bucket or prefix"),
                      ("INVALID_ACCESS_KEY_ID", "the access key is not known to the store"),
                      ("SIGNATURE_DOES_NOT_MATCH", "the secret key does not match the access key"),
                      *store_clients.REASONS,
                      ("NETWORK_CONNECTION", unanswered), ("Unable to connect to endpoint", unanswered),
                      ("No response body", unanswered), *((u, unanswered) for u in store_clients.UNANSWERED)):
        if code in text:
            return say
    return redact_text(text)[:200]


def kind_of(uri: str) -> str:
    m = URI.match(uri)
    return SCHEMES.get(m.group(1).lower(), "") if m else ""


def endpoint_hint(uri: str) -> str:
    return store_clients.ENDPOINTS.get(kind_of(uri), "the endpoint")


def what_to_check(uri: str) -> str:
    """What a user checks when the store refuses: the credentials and endpoint of this URI's kind of store."""
    return store_clients.CREDENTIALS.get(kind_of(uri), "the credentials")


class StoreUnavailable(UserError):
    """A store that kept failing with transient errors for the whole retry window. Still one line for the user,
    but in a training worker it counts like a lost process (engines/common.failure_cause reads `transient` from
    the rank's error file), so engine.max_restarts decides whether the workers try again."""

    transient = True


def store_error(uri: str, action: str, e: BaseException, retried_s: float = 0.0) -> UserError:
    if not is_transient(e):
        return UserError(f"{redact(uri)}: cannot {action} ({reason(e, uri)}); check the URI, {what_to_check(uri)}")
    waited = f", for {retried_s:g} s" if retried_s else ""
    return StoreUnavailable(f"{redact(uri)}: cannot {action} ({reason(e, uri)}{waited}); check the URI, the"
                            f" credentials and {endpoint_hint(uri)}, or give the store longer with {RETRY_ENV}")


# -- transient errors: asked again, for a bounded window ------------------------------------------------

RETRY_ENV = "TORCHLOOM_STORE_RETRY_S"
# 30 s rides out what S3 and its kin document as passing (503 SlowDown while a prefix scales, a reset
# connection, a load balancer's restart) and stays under engine.collective_timeout_s (60 s): a rank that waits
# on the store inside a step is not yet taken for lost by its peers. Longer outages are a restart's business.
RETRY_S = 30.0
CHECK_RETRY_S = 3.0  # the pre-flight checks: a wrong endpoint is still one line within seconds
BACKOFF_S = (0.2, 5.0)  # the first wait, doubled after each failure up to the second
_TRANSIENT = ("NETWORK_CONNECTION", "Unable to connect", "No response body", "curlCode", "SLOW_DOWN", "SlowDown",
              "INTERNAL_FAILURE", "InternalError", "SERVICE_UNAVAILABLE", "ServiceUnavailable", "REQUEST_TIMEOUT",
              "RequestTimeout", "THROTTLING", "Connection reset", "Broken pipe", "timed out", "Timeout was reached")
_HTTP_5XX = re.compile(r"HTTP (?:status|response code)\D{0,3}5\d\d")
_window = threading.local()  # a thread's override of the window (retrying_for)


def is_transient(e: BaseException) -> bool:
    """An error the same request may not meet again in a moment: the store did not answer, or said so (5xx)."""
    text = str(e)
    if any(t in text for t in store_clients.NOT_TRANSIENT):
        return False
    return isinstance(e, (ConnectionError, TimeoutError)) or any(
        t in text for t in (*_TRANSIENT, *store_clients.UNANSWERED)) or bool(_HTTP_5XX.search(text))


def retry_window() -> float:
    """Seconds a store operation retries transient errors: this thread's retrying_for, else $TORCHLOOM_STORE_RETRY_S,
    else RETRY_S."""
    seconds = getattr(_window, "seconds", None)
    if seconds is not None:
        return seconds
    raw = os.environ.get(RETRY_ENV, "").strip()
    if not raw:
        return RETRY_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise UserError(f"{RETRY_ENV}={raw!r}: not a number of seconds >= 0; set it to e.g. 30 (0: never retry),"
                        " or unset it")
    return value


@contextlib.contextmanager
def retrying_for(seconds: float):
    """Store operations of this thread retry for at most `seconds` (0: not at all) inside the block: what is
    tried again anyway a moment later (a heartbeat, a progress file) must not hold its caller."""
    saved = getattr(_window, "seconds", None)
    _window.seconds = seconds
    try:
        yield
    finally:
        _window.seconds = saved


def attempts(uri: str, action: str, op: Callable, window: float | None = None,
              fail: Callable[[BaseException, float], UserError] | None = None):
    """op() until it returns. A transient error is retried with backoff (BACKOFF_S) for `window` seconds from the
    first failure (None: retry_window()), with one warning line; anything else, or the window spent, is `fail`'s
    one line (default store_error). FileNotFoundError is the caller's business and passes through; op must
    start over whole (an upload re-sends the whole object), since it is called again from the top."""
    window = retry_window() if window is None else window
    fail = fail or (lambda e, waited: store_error(uri, action, e, waited))
    started = delay = None
    while True:
        try:
            return op()
        except FileNotFoundError:
            raise
        except OSError as e:
            now = time.monotonic()
            started = now if started is None else started
            if not is_transient(e) or now - started >= window:
                raise fail(e, round(now - started, 1)) from None
            if delay is None:
                delay = BACKOFF_S[0]
                print(f"torchloom: warning: {redact(uri)}: could not {action} ({reason(e, uri)}); retrying for up to"
                      f" {window:g} s", file=sys.stderr, flush=True)
            time.sleep(min(delay, started + window - now))
            delay = min(delay * 2, BACKOFF_S[1])
