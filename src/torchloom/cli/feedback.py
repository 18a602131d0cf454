"""`torchloom feedback --input FILE --url URL`: the true labels of a server's predictions, from a file (CSV, JSON
lines or Parquet with an id and a label column; or a text and a label column: labels sent with their texts, kept
in the server's prediction log for retraining), sent to its POST /v1/feedback in bulk (serve/fleet_api.py), a
list of up to --batch labels a request. The API key comes from an environment variable (--api-key-env, default
TORCHLOOM_API_KEY), never from the command line. One line at the end: sent, recorded, refused by reason; exit 0
once every batch was answered (labels refused by the server are counted, not an error), 2 for a bad input or a
server that cannot be reached or refuses the key."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator

from torchloom.errors import UserError, clipped

MAX_BATCH = 10_000  # serve/fleet_api.MAX_FEEDBACK


def add_feedback_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--input", required=True, help="a CSV, JSON lines or Parquet file (or directory) of labels")
    sp.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    sp.add_argument("--id-column", default="id", help="the prediction ids' column (default id)")
    sp.add_argument("--label-column", default="label", help="the true labels' column (default label)")
    sp.add_argument("--text-column", default="text",
                    help="where the file has no id column: the texts' column (default text); each label is sent"
                         " with its text, kept in the server's prediction log (--log) for retraining")
    sp.add_argument("--batch", type=int, default=1000, help=f"labels per request (1 to {MAX_BATCH}; default 1000)")
    sp.add_argument("--api-key-env", default="TORCHLOOM_API_KEY", metavar="NAME",
                    help="the environment variable holding the server's API key (default TORCHLOOM_API_KEY)")


def rows(path: str, id_column: str, label_column: str, text_column: str = "text"
         ) -> Iterator[tuple[str, str, str] | None]:
    """("id" or "text", its value, label) of each row: by the id column, else the text column; None for a row
    without both (set aside, counted)."""
    from torchloom.inputs.text_files import input_format, stream_batches
    from torchloom.text.formats import column_named

    schema, batches = stream_batches(path, input_format(path))
    names = list(schema.names)
    found = {want: column_named(names, want) for want in (id_column, label_column, text_column)}
    key, by = (id_column, "id") if found[id_column] is not None or found[text_column] is None else (text_column, "text")
    for want, flag in ((key, "--id-column"), (label_column, "--label-column")):
        if found[want] is None:
            raise UserError(f"--input {path}: no column {want!r} (columns: {', '.join(names[:12])}); name it with"
                            f" {flag}")
    for batch in batches:
        ids = batch.column(found[key]).to_pylist()
        labels = batch.column(found[label_column]).to_pylist()
        for i, y in zip(ids, labels):
            yield (by, str(i), str(y)) if i not in (None, "") and y not in (None, "") else None


def post(url: str, items: list[dict], key: str | None) -> dict:
    request = urllib.request.Request(f"{url.rstrip('/')}/v1/feedback", data=json.dumps(items).encode(),
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read()).get("error", {}).get("message", "")
        except (ValueError, AttributeError):
            message = ""
        fix = {401: "set the API key in the variable --api-key-env names", 501: "serve a fleet (feedback needs the"
               " predictions' ids)"}.get(e.code, "see the server's log")
        raise UserError(f"--url {url}: POST /v1/feedback answered {e.code} ({clipped(message)}); {fix}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise UserError(f"--url {url}: cannot reach the server ({clipped(str(reason))}); start it or fix the URL"
                        ) from None


def cmd_feedback(args: argparse.Namespace, rest: list[str]) -> int:
    if rest:
        raise UserError(f"feedback: unexpected arguments {' '.join(rest)}; see torchloom feedback --help")
    if not 1 <= args.batch <= MAX_BATCH:
        raise UserError(f"--batch {args.batch}: send 1 to {MAX_BATCH} labels a request")
    key = os.environ.get(args.api_key_env) or None
    sent, set_aside, reasons, recorded = 0, 0, Counter(), 0
    started = time.monotonic()
    pending: list[dict] = []

    def flush() -> None:
        nonlocal recorded
        if not pending:
            return
        answer = post(args.url, pending, key)
        recorded += answer.get("recorded", 0)
        reasons.update(r["error"]["code"] for r in answer.get("results", []) if "error" in r)
        pending.clear()
        print(f"feedback: {sent} labels sent ({sent / max(1e-9, time.monotonic() - started):.0f}/s)",
              file=sys.stderr, flush=True)

    for row in rows(args.input, args.id_column, args.label_column, args.text_column):
        if row is None:
            set_aside += 1
            continue
        pending.append({row[0]: row[1], "label": row[2]})
        sent += 1
        if len(pending) >= args.batch:
            flush()
    flush()
    refused = ", ".join(f"{code} {n}" for code, n in reasons.most_common())
    aside = f"; {set_aside} rows without an id or a label set aside" if set_aside else ""
    print(f"feedback: {sent} labels sent to {args.url}: {recorded} recorded, {sum(reasons.values())} refused"
          f"{f' ({refused})' if refused else ''}{aside}")
    return 0
