"""The one place that decides what of a config, a parameter or a line of text is a secret, and masks it.

Everything torchloom writes where others read it goes through here: config.toml and best_config.toml, the
MLflow params, summary.json, hooks.json, the tracking and error lines. Two rules:
  - a URI's userinfo (`scheme://user:password@host`) becomes `scheme://***@host`, wherever it appears (an
    Azure URI's `abfs://container@account...` names a container, and stays);
  - the value of a key whose name says secret, password, token, credential, access key, api key, account
    key, private key or signature becomes `***` (a config key such as `spark.hadoop.fs.s3a.secret.key`, a
    `key=value` in a line of text, a presigned URL's signature).
  - a password this process has seen in a URL of its config (remember: the config as built, a worker's) is masked
    wherever it appears, by its value: in every line this process prints (MaskingStream on the CLI's stdout and
    stderr, tracebacks included) and every file written through jsonio.write_atomic, in the forms a library may
    print it (as given, percent-decoded, percent-encoded). A password shorter than MIN_REMEMBERED, or of letters
    alone, is left to the first rule (masking `secret` or `password` by value would mask those words everywhere).
Secrets belong in the environment (AWS_*, MLFLOW_TRACKING_PASSWORD, a Hadoop credential provider), where
torchloom neither writes nor logs them; a masked config file says so by its `***`.
Standard library only: the contracts and the CLI import it."""

from __future__ import annotations

import re
import threading
from typing import Any
from urllib.parse import quote, unquote

from torchloom import jsonio
from torchloom.uri import mask_userinfo, passwords

MASK = "***"
# A study database URL with a password reaches the workers' pruner in this variable (every engine forwards
# it, engines/worker.FORWARDED), never through hooks.json.
TUNE_STORAGE_ENV = "TORCHLOOM_TUNE_STORAGE"
_SECRET_WORDS = {"secret", "secrets", "password", "passwd", "pwd", "passphrase", "token", "credential",
                 "credentials", "signature", "sig", "sas", "apikey", "accesskey", "secretkey", "privatekey",
                 "accountkey", "authorization", "auth"}
_KEY_QUALIFIERS = {"access", "api", "private", "account", "secret", "master", "encryption", "client"}
_WORD_SPLIT = re.compile(r"[^A-Za-z0-9]+|(?<=[a-z0-9])(?=[A-Z])")
# key=value or "key": "value" in free text (a query string, a Spark conf line, a JSON body). A bare
# `key: text` is not one: it is how torchloom's own error lines start (`--api-key: use at least 8 ...`).
_PAIR = re.compile(r"(?P<key>[A-Za-z][\w.\-]*)(?P<sep>\s*=\s*|[\"']\s*:\s*)"
                   r"(?P<value>\"[^\"]*\"|'[^']*'|[^\s,;&'\"}]+)")


def is_secret_name(name: str) -> bool:
    """Does a key's name say its value is a secret? Judged by its words: `fs.s3a.secret.key`, `api_key`,
    `X-Amz-Signature`, `sessionToken` do; `max_batch_tokens`, `tokenizer`, `author` do not."""
    words = [w.lower() for w in _WORD_SPLIT.split(str(name)) if w]
    if any(w in _SECRET_WORDS for w in words):
        return True
    return any(a in _KEY_QUALIFIERS and b == "key" for a, b in zip(words, words[1:]))


def _mask_pair(m: re.Match) -> str:
    value = m.group("value")
    if not is_secret_name(m.group("key")) or value.strip("\"'") in ("", MASK) or value.startswith("//"):
        return m.group(0)
    quote = value[0] if value[0] in "\"'" else ""
    return f"{m.group('key')}{m.group('sep')}{quote}{MASK}{quote}"


MIN_REMEMBERED = 8
_remembered: set[str] = set()
_remembered_lock = threading.Lock()


def remember(value: Any) -> None:
    """The passwords in a value's URLs (a config's dict walked), masked by value from now on in this process."""
    if isinstance(value, dict):
        for v in value.values():
            remember(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            remember(v)
    elif isinstance(value, str):
        for password in passwords(value):
            forms = {password, unquote(password), quote(unquote(password), safe=""), quote(password, safe="")}
            with _remembered_lock:
                _remembered.update(f for f in forms if len(f) >= MIN_REMEMBERED and not f.isalpha())


def mask_remembered(text: Any) -> Any:
    """`text` (str or bytes) with every remembered password replaced by MASK; the same object when none is in it."""
    if not _remembered:
        return text
    for secret in sorted(_remembered, key=len, reverse=True):
        if isinstance(text, bytes):
            raw = secret.encode()
            if raw in text:
                text = text.replace(raw, MASK.encode())
        elif secret in text:
            text = text.replace(secret, MASK)
    return text


jsonio.MASKERS.append(mask_remembered)  # every file written whole (config.toml, records, reports, hooks.json)


class MaskingStream:
    """A text stream (the CLI's stdout and stderr) that writes what it is given with remembered passwords masked."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(mask_remembered(text))
        return len(text)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def mask_streams() -> None:
    """This process's stdout and stderr through MaskingStream (once)."""
    import sys

    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, MaskingStream):
            setattr(sys, name, MaskingStream(stream))


def redact_text(text: Any) -> str:
    """A line fit for a log or an error: no URI userinfo, no value of a secret-named key, no remembered password."""
    return _PAIR.sub(_mask_pair, mask_userinfo(mask_remembered(str(text)), MASK))


def redact_value(key: str, value: Any) -> Any:
    """One config value: masked whole when its key names a secret; strings stripped of userinfo and secret
    pairs; dicts and lists walked, each dict entry judged by its own key."""
    if isinstance(value, dict):
        return {k: redact_value(str(k), v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_value(key, v) for v in value)
    if isinstance(value, str) and value and is_secret_name(key):
        return MASK
    if isinstance(value, str):
        return redact_text(value)
    return value


def redact_config(data: dict[str, Any]) -> dict[str, Any]:
    """A config's dict (sections of keys, or any nesting) with every secret masked; the input is unchanged."""
    return {k: redact_value(str(k), v) for k, v in data.items()}
