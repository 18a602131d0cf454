"""The ledger of a command's output file or directory (`predict --output`, `monitor --report`, `predict --model A
--model B --report`): torchloom replaces an earlier output only where its ledger lists every file in it as it is
now, and never one that holds an input of the command. The ledger's format and rules are runs/ledger.py's."""

from __future__ import annotations

import os
from pathlib import Path

from torchloom.jsonio import write_atomic
from torchloom.runs.ledger import LEDGER_FILE, Ledger, LocalTree, parse, under_any
from torchloom.runs.runrecord import holds_cwd

# Its ledger: inside a directory (Spark's and pyarrow's readers skip names that start with `_`), beside a file.
OUTPUT_LEDGER = "_torchloom-ledger.json"


def _output_ledger(out: Path) -> Path:
    return out / OUTPUT_LEDGER if out.is_dir() and not out.is_symlink() else out.with_name(f".{out.name}.{LEDGER_FILE}")


def check_output(out: str | Path, inputs: list[str], key: str = "--output") -> None:
    """Before --overwrite replaces a predictions output: it is one that torchloom wrote (its ledger lists every file
    in it as it is now) and holds no input of the command; one line otherwise, before anything is deleted."""
    from torchloom.errors import UserError

    out = Path(out)
    if not out.exists() and not out.is_symlink():
        return
    if holds_cwd(out):
        raise UserError(f"{key} {out}: is the working directory or holds it; pass another {key}")
    here = os.path.realpath(out)
    for given in inputs:
        if under_any(os.path.realpath(given), [here]):
            raise UserError(f"{key} {out}: holds the input {given}; --overwrite would delete it; write the predictions"
                            f" elsewhere (another {key})")
    listed = parse(LocalTree(out.parent).read(_output_ledger(out).relative_to(out.parent).as_posix()))
    files = listed.files if listed is not None else {}
    if out.is_dir() and not out.is_symlink():
        found = {rel: st for rel, st in LocalTree(out).inventory().items() if rel != OUTPUT_LEDGER}
    else:
        st = out.lstat()
        found = {out.name: (st.st_size, st.st_mtime_ns)}
    foreign = sorted(rel for rel, st in found.items() if files.get(rel) != st)
    if foreign:
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        raise UserError(f"{key} {out}: not replaced, nothing deleted: it holds {', '.join(foreign[:3])}{more}, which"
                        f" torchloom did not write as predictions (or changed since); pass another {key}")


def clear_output(out: str | Path, inputs: list[str], key: str = "--output") -> None:
    """Delete an earlier output of torchloom's before a command writes it again: checked once more here, right
    before anything goes (check_output ran when the command began; the work since may have taken minutes)."""
    import shutil

    out = Path(out)
    check_output(out, inputs, key)
    if out.is_dir() and not out.is_symlink():
        shutil.rmtree(out)
    elif out.exists() or out.is_symlink():
        out.unlink()  # a file's ledger beside it: rewritten by record_output


def record_output(out: str | Path) -> None:
    """After predictions are written to `out`: their ledger, so that a later --overwrite may replace them."""
    out = Path(out)
    if out.is_dir():
        files = {rel: st for rel, st in LocalTree(out).inventory().items() if rel != OUTPUT_LEDGER}
    elif out.is_file():
        st = out.stat()
        files = {out.name: (st.st_size, st.st_mtime_ns)}
    else:
        return
    write_atomic(_output_ledger(out), Ledger(files).dumps())
