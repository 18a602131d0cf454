"""Predict labels for texts with an exported model directory (the one `export_model` writes)."""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError

from torchloom.errors import UserError, first_line
from torchloom.inputs.encoding import file_codec, read_note
from torchloom.lexical import Lexical
from torchloom.model.env import use_model_env
from torchloom.model.export import check_exported, read_export_info, weights_error
from torchloom.model.traced import TracedForward
from torchloom.scoring import LOSS_EPS, mix, text_scores
from torchloom.tag_scoring import Thresholds
from torchloom.tag_scoring import predict as predict_tags
from torchloom.text.clean import clean_text
from torchloom.text.formats import column_named, default_separator, separator_in, spreadsheet_hint, text_column_hint
from torchloom.text.hierarchy import describe
from torchloom.text.truncation import STRATEGIES, cut, default_stride, prefix, prefix_holds, special_layout, windows

MAX_LENGTH_CAP = 512
RUNTIMES = ("torch", "onnx")
# Texts are tokenized and length-sorted this many at a time, so a huge input file is not held
# tokenized all at once.
SORT_CHUNK = 4096
# On a CPU a forward gains nothing past a few hundred rows x tokens (its matmuls are already large), while
# every padded token costs as much as a real one; a length-sorted batch is therefore cut into forwards of at
# most this many padded tokens, so texts of different lengths merged into one batch (a server's requests)
# are not all padded to the longest. On CUDA the batch runs whole: a GPU wants large forwards.
CPU_FORWARD_TOKENS = 1024
INPUT_SUFFIXES = (".txt", ".jsonl", ".csv")
# Lone surrogates (U+D800-U+DFFF; JSON's "\ud800", a non-UTF-8 argv) no tokenizer encodes nor stdout prints.
_SURROGATE = re.compile("[\ud800-\udfff]")
REPLACEMENT_CHARACTER = "\ufffd"


def well_formed(text: str) -> str:
    """`text` with each lone surrogate replaced by U+FFFD, as a UTF-8 decoder replaces bytes it cannot read: the
    one rule for texts that are not Unicode, in predict, both servers and batch scoring (never an error)."""
    return _SURROGATE.sub(REPLACEMENT_CHARACTER, text)


def repair_note(texts: list[str]) -> str | None:
    """One line naming the texts `well_formed` changes (None when it changes none), for a command to print."""
    changed = [i for i, t in enumerate(texts) if _SURROGATE.search(t)]
    if not changed:
        return None
    shown = ", ".join(map(str, changed[:5])) + (", ..." if len(changed) > 5 else "")
    return (f"{len(changed)} text(s) ({shown}, counted from 0) are not valid Unicode (lone surrogates, e.g. an"
            " argument that is not UTF-8); each such character was replaced with U+FFFD")


def tagging(info: dict, config, labels: list[str]) -> tuple[bool, Thresholds | None]:
    """Whether the model is multi-label (torchloom.json's task, or a config that says so), and the thresholds its
    tags are predicted over (chosen on val at export; 0.5 where none were stored)."""
    multi = info.get("task") == "multi_label" or getattr(config, "problem_type", None) == "multi_label_classification"
    return multi, Thresholds.from_record(info.get("thresholds") or {}, labels) if multi else None


class Predictor:
    """A loaded model and tokenizer; `predict` returns label, score and all class probabilities per text."""

    multi_label = False  # a sigmoid per tag, and `labels` in each prediction (tagging)
    thresholds: Thresholds | None = None
    path_delimiter = ""  # hierarchical labels: each prediction's parents too (text/hierarchy.py)
    lexical: Lexical | None = None  # the baseline mixed into the shipped probabilities (torchloom.json "combine")
    weight: float = 1.0  # the transformer's weight in that mix
    # Each forward is padded to a multiple of this many tokens (at most max_length), so that forwards come in few
    # shapes that a server can warm up (length_buckets); 1: to its longest row.
    length_bucket: int = 1
    # The forward as a traced graph where TracedForward.choose chose one (a server, at warm-up); None: eager
    traced: TracedForward | None = None
    # A monitor's random projection of the pooled representation (hidden x dims, monitor/profile.py): with it,
    # predict_encoded's signals hold each text's "sketch" (PyTorch runtimes; an ONNX graph gives logits only)
    sketch: np.ndarray | None = None

    def __init__(self, model_dir: str, device: str = "cpu", max_length: int | None = None,
                 batch_size: int = 32, runtime: str = "torch", threads: int | None = None,
                 forward_tokens: int | None = None) -> None:
        """forward_tokens: padded tokens (rows x longest row) one forward may hold, besides batch_size rows;
        None: CPU_FORWARD_TOKENS on CPU, no limit on CUDA; 0: no limit."""
        use_model_env()
        import torch
        import transformers
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars on every load
        path = check_exported(model_dir)
        if batch_size < 1:
            raise UserError(f"batch_size {batch_size}: must be at least 1")
        if runtime not in RUNTIMES:
            raise UserError(f"--runtime {runtime}: unknown; use one of {', '.join(RUNTIMES)}")
        info = read_export_info(path)
        self.runtime = runtime
        self.model = self.session = None
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            if runtime == "torch":  # safetensors only: a pickle's weights are refused (check_exported)
                self.model = AutoModelForSequenceClassification.from_pretrained(path, use_safetensors=True)
            config = AutoConfig.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError, KeyError) as e:
            raise UserError(f"model dir {model_dir}: cannot load the model or tokenizer ({first_line(e)});"
                            " export the model again") from None
        except SafetensorError as e:  # damaged after check_exported read its header
            raise weights_error(Path(model_dir) / "model.safetensors", e) from None
        self.device = torch.device(device)
        if self.model is not None:
            self.model.to(self.device).eval()
        else:  # the ONNX file the export's gate passed (int8 when that was exported)
            from torchloom.model.onnx import onnx_file, session

            self.onnx_file = onnx_file(path)
            self.session = session(self.onnx_file, threads, str(self.device))
        self.labels = [str(config.id2label[i]) for i in range(config.num_labels)]
        if max_length is None:
            max_length = info.get("max_length") or min(int(self.tokenizer.model_max_length), MAX_LENGTH_CAP)
        self.max_length = int(max_length)
        self.truncation = info.get("truncation", "head")  # as prepare cut the texts the model trained on
        if self.truncation not in STRATEGIES:
            raise UserError(f"model dir {model_dir}: truncation {self.truncation!r} in torchloom.json is unknown to"
                            f" this torchloom ({', '.join(STRATEGIES)}); upgrade torchloom or export again")
        if self.truncation == "chunks":
            self.stride = int(info.get("stride") or default_stride(self.max_length))
            self.max_chunks = int(info.get("max_chunks", 0))
            mask = self.tokenizer("a", return_special_tokens_mask=True)["special_tokens_mask"]
            self.layout = special_layout(mask)
        self.batch_size = batch_size
        if forward_tokens is None:
            forward_tokens = 0 if self.device.type == "cuda" else CPU_FORWARD_TOKENS
        self.forward_tokens = max(0, int(forward_tokens))
        self.info = info
        self.lexical, self.weight = shipped_baseline(path, info)
        self.multi_label, self.thresholds = tagging(info, config, self.labels)
        self.path_delimiter = str(info.get("label_path_delimiter") or "")

    def predict(self, texts: list[str], with_logits: bool = False, with_signals: bool = False
                ) -> list[dict[str, Any]]:
        """One {"label", "score", "probabilities"} per text, in input order; texts are cleaned like prepare's.
        with_logits: also "logits" (label -> the logit; a chunked text's, its windows' mean); with_signals: also
        "tokens" and "unknown" (predict_encoded)."""
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise UserError("predict takes a list of strings")
        results: list[dict[str, Any]] = []
        for start in range(0, len(texts), SORT_CHUNK):
            results += self._predict_chunk(texts[start:start + SORT_CHUNK], with_logits, with_signals)
        return results

    def encode(self, texts: list[str], cleaned: list[str] | None = None, lengths: list[int] | None = None
               ) -> list[dict[str, list[int]]]:
        """The model's inputs for each text: cleaned like prepare's (`cleaned`, where the caller has them), cut
        like prepare's (self.truncation). `lengths`, a list: each text's tokens before the cut are appended to it
        (estimated, in proportion to characters, for a text longer than the start `head` encodes)."""
        cleaned = [clean_text(well_formed(t)) for t in texts] if cleaned is None else cleaned
        if self.truncation == "head":
            # prepare's shortcut (truncation.prefix, prefix_holds): a long text's start alone, when its tokens pass
            # max_length by MARGIN, gives the same ids as the whole text at a fraction of the work and memory
            size = self.max_length
            starts = [prefix(t, size) for t in cleaned]
            first = self.tokenizer(starts, truncation=False)
            counts = [len(ids) for ids in first["input_ids"]]
            if lengths is not None:
                lengths += [n if len(start) == len(text) else round(n * len(text) / max(1, len(start)))
                            for start, text, n in zip(starts, cleaned, counts)]
            rows = [dict(zip(first.keys(), values)) for values in zip(*first.values())]
            # A whole text within max_length is already encoded as the cut would encode it: only the others are
            # encoded again (with short texts, as a server's, that halves the tokenizer's work)
            redo = [i for i, (start, text, n) in enumerate(zip(starts, cleaned, counts))
                    if len(start) != len(text) or n > size]
            if redo:
                use = [starts[i] if prefix_holds(cleaned[i], starts[i], counts[i] - size) else cleaned[i] for i in redo]
                again = self.tokenizer(use, truncation=True, max_length=size)
                for i, values in zip(redo, zip(*again.values())):
                    rows[i] = dict(zip(again.keys(), values))
            return rows
        if self.truncation == "chunks":
            raise ValueError("truncation chunks gives several windows per text: use encode_windows")
        encoded = self.tokenizer(cleaned, truncation=False)  # whole, then cut: every per-token list alike
        if lengths is not None:
            lengths += [len(ids) for ids in encoded["input_ids"]]
        return [{k: cut(v, self.max_length, self.truncation) for k, v in zip(encoded.keys(), values)}
                for values in zip(*encoded.values())]

    def encode_windows(self, texts: list[str], signals: bool = False) -> list[Windows]:
        """The model's inputs for each text as a list: its windows with truncation chunks (cut like
        prepare's: truncation.windows), else the one input `encode` gives. A model that ships the mix with the
        baseline carries each text's baseline probabilities with its windows (`Windows.lexical`); with `signals`,
        each text's tokens before the cut and share of unknown tokens (`Windows.tokens`, `.unknown`)."""
        cleaned = [clean_text(well_formed(t)) for t in texts]
        lengths: list[int] = []
        if self.truncation != "chunks":
            out = [Windows([f]) for f in self.encode(texts, cleaned, lengths)]
        else:
            encoded = self.tokenizer(cleaned, truncation=False)
            lengths = [len(ids) for ids in encoded["input_ids"]]
            front, back = self.layout
            out = []
            for values in zip(*encoded.values()):
                per_key = {k: windows(v, self.max_length, self.stride, self.max_chunks, front, back)
                           for k, v in zip(encoded.keys(), values)}
                out.append(Windows(dict(zip(per_key, parts)) for parts in zip(*per_key.values())))
        unk = self.tokenizer.unk_token_id
        for item, n in zip(out, lengths if signals else ()):  # what a monitor compares (monitor/profile.py)
            item.tokens = n
            read = sum(len(f["input_ids"]) for f in item)
            item.unknown = (sum(f["input_ids"].count(unk) for f in item) / read) if read and unk is not None else 0.0
        if self.lexical is not None:
            for item, probs in zip(out, self.lexical.probabilities(cleaned)):
                item.lexical = probs
        return out

    def logits(self, batch: dict) -> Any:
        """Float32 logits (a CPU tensor) of one padded batch from the tokenizer, on this runtime."""
        return self.forward(batch)[0]

    def forward(self, batch: dict, pooled: bool = False) -> tuple[Any, Any]:
        """(float32 logits, float32 pooled representation or None), CPU tensors, of one padded batch; pooled only
        where asked and the runtime is PyTorch's (traced.eager_forward says what it is)."""
        import torch

        from torchloom.model.traced import eager_forward

        if self.session is not None:
            feeds = {"input_ids": batch["input_ids"].numpy().astype("int64"),
                     "attention_mask": batch["attention_mask"].numpy().astype("int64")}
            return torch.from_numpy(self.session.run(["logits"], feeds)[0]).float(), None
        batch = {k: v.to(self.device) for k, v in batch.items()}
        if self.traced is not None and self.traced.pooled == pooled:
            logits, rows = self.traced.forward(batch)
        else:
            logits, rows = eager_forward(self.model, batch, pooled)
        return logits.float().cpu(), rows.float().cpu() if rows is not None else None

    def _predict_chunk(self, texts: list[str], with_logits: bool = False, with_signals: bool = False
                       ) -> list[dict[str, Any]]:
        return (self.predict_encoded(self.encode_windows(texts, with_signals), with_logits, with_signals)
            if texts else [])

    def forwards(self, lengths: list[int], ids: list[int]) -> list[list[int]]:
        """`ids` (sorted by `lengths[id]`, ascending) cut into forwards: at most batch_size rows and
        forward_tokens padded tokens (rows x the last row's length) each, at least one row."""
        out: list[list[int]] = []
        start = 0
        for i in range(1, len(ids) + 1):
            if i == len(ids) or i - start >= self.batch_size or (
                    self.forward_tokens and (i + 1 - start) * lengths[ids[i]] > self.forward_tokens):
                out.append(ids[start:i])
                start = i
        return out

    def padded_length(self, longest: int) -> int:
        """The length a forward whose longest row has `longest` tokens is padded to (its length bucket)."""
        bucket = self.length_bucket
        if bucket <= 1:  # no buckets (the default; a TablePredictor for Spark scoring has no max_length of its own)
            return longest
        return max(longest, min(-(-longest // bucket) * bucket, self.max_length))

    def length_buckets(self) -> list[int]:
        """Every length padded_length gives for rows of 1 to max_length tokens."""
        return sorted({self.padded_length(n) for n in range(1, self.max_length + 1)})

    def predict_encoded(self, per_text: list[list[dict[str, list[int]]]], with_logits: bool = False,
                        with_signals: bool = False) -> list[dict[str, Any]]:
        """predict's answers for texts already encoded by encode_windows (one list of model inputs per text).
        with_signals: also "tokens" (before truncation) and "unknown" (the share of unknown tokens the model read),
        what a monitor compares (monitor/profile.py)."""
        import torch

        if not per_text:
            return []
        features = [f for windows_ in per_text for f in windows_]
        owner = [i for i, windows_ in enumerate(per_text) for _ in windows_]
        # Similar lengths in one batch means little padding; results are put back in input order.
        lengths = [len(f["input_ids"]) for f in features]
        order = sorted(range(len(features)), key=lengths.__getitem__)
        logits = torch.zeros(len(features), len(self.labels))
        baseline_alone = self.lexical is not None and self.weight == 0.0  # the export found the baseline best
        sketch = (self.sketch if with_signals and getattr(self, "session", None) is None and not baseline_alone
            else None)
        sketched = np.zeros((len(features), sketch.shape[1]), np.float32) if sketch is not None else None
        with torch.inference_mode():
            for batch_ids in [] if baseline_alone else self.forwards(lengths, order):
                longest = lengths[batch_ids[-1]]
                batch = pad_batch([features[i] for i in batch_ids], self.tokenizer, self.padded_length(longest))
                if sketched is None:
                    logits[batch_ids] = self.logits(batch)
                else:
                    logits[batch_ids], pooled = self.forward(batch, True)
                    sketched[batch_ids] = pooled.numpy() @ sketch
        # a text's score: the softmax of its windows' mean logits (one window: its own), as everywhere
        scores = text_scores(logits.numpy(), np.asarray(owner), multi_label=self.multi_label)
        if len(scores.first) != len(per_text):
            raise ValueError("predict_encoded: every text needs at least one window of model inputs")
        probs, means = scores.probs, scores.logits
        if self.lexical is not None:  # the shipped mix; its log-probabilities stand for the logits
            probs = mix(probs, np.stack([item.lexical for item in per_text]), self.weight)
            means = np.log(np.clip(probs, LOSS_EPS, 1.0))
        tagged = predict_tags(probs, self.thresholds).tolist() if self.multi_label else None
        results = []
        for i, (row, mean) in enumerate(zip(probs.astype(np.float32).tolist(), means.astype(np.float32).tolist())):
            best = max(range(len(row)), key=row.__getitem__)
            results.append({"label": self.labels[best], "score": row[best],
                            "probabilities": dict(zip(self.labels, row))})
            if tagged is not None:  # the tags over their thresholds, the most probable first
                on = sorted((j for j, hit in enumerate(tagged[i]) if hit), key=lambda j: -row[j])
                results[-1]["labels"] = [self.labels[j] for j in on]
            if with_logits:
                results[-1]["logits"] = dict(zip(self.labels, mean))
        results = [describe(r, self.path_delimiter) for r in results] if self.path_delimiter else results
        if with_signals:
            for result, item in zip(results, per_text):
                result["tokens"], result["unknown"] = item.tokens, item.unknown
        if sketched is not None:  # a text's sketch: its windows' mean (owner runs in order, one run per text)
            if len(sketched) != len(per_text):
                starts = np.flatnonzero(np.r_[True, np.diff(owner) != 0])
                sketched = np.add.reduceat(sketched, starts, axis=0) / np.diff(np.r_[starts, len(owner)])[:, None]
            for result, row in zip(results, sketched):
                result["sketch"] = row
        return results


class Windows(list):
    """One text's model inputs (its windows), and, where the model ships the mix, its baseline probabilities."""

    lexical: np.ndarray | None = None
    tokens: int = 0  # the text's tokens before truncation (Predictor.encode's `lengths`)
    unknown: float = 0.0  # the share of unknown tokens among those the model reads


def shipped_baseline(model_dir: Path, info: dict[str, Any]) -> tuple[Lexical | None, float]:
    """The baseline an exported model mixes in and the transformer's weight (torchloom.json "combine"); (None, 1.0)
    for a model that ships the transformer alone."""
    combine = info.get("combine") or {}
    raw = combine.get("weight", 1.0) if isinstance(combine, dict) else None
    try:
        weight = float(raw)
    except (TypeError, ValueError):
        weight = float("nan")
    if not 0.0 <= weight <= 1.0:  # NaN fails this too: never a probability outside 0..1
        raise UserError(f"model dir {model_dir}: torchloom.json's combine.weight is {raw!r}, not a number from 0 to 1"
                        " (the transformer's share of the mix); export the model again")
    if weight >= 1.0:
        return None, 1.0
    where = Path(model_dir) / str(combine.get("baseline") or "baseline")
    try:
        return Lexical.load(where), weight
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"model dir {model_dir}: ships a mix with the baseline, but {where} cannot be read"
                        f" ({first_line(e)}); export the model again") from None


def pad_batch(features: list[dict[str, list[int]]], tokenizer, length: int = 0) -> dict[str, Any]:
    """One padded batch of model inputs as int64 tensors: what `tokenizer.pad` gives (its pad id and pad
    side), without its Python walk over every token, which on a GPU was most of a batch's time. length: pad
    to at least this many tokens (default: the longest row)."""
    import torch

    if getattr(tokenizer, "pad_token_id", None) is None or not all(
            isinstance(v, list) for v in features[0].values()):
        # no pad token (the tokenizer's own error says what is missing), or inputs that are not token lists
        return tokenizer.pad(features, return_tensors="pt")
    longest = max(length, max(len(f["input_ids"]) for f in features))
    fill = {"input_ids": tokenizer.pad_token_id, "token_type_ids": tokenizer.pad_token_type_id}
    left = tokenizer.padding_side == "left"
    batch = {}
    for key in features[0]:
        rows = np.full((len(features), longest), fill.get(key, 0), dtype=np.int64)
        for row, feature in zip(rows, features):
            values = feature[key]
            if left:
                row[longest - len(values):] = values
            else:
                row[:len(values)] = values
        batch[key] = torch.from_numpy(rows)
    return batch


def read_texts(path: str, say: Callable[[str], object] | None = None, column: str = "text") -> list[str]:
    """Texts from a .txt (one per line, blank lines skipped), .jsonl (field `column`) or .csv (column `column`),
    in the encoding prepare's data.encoding auto would read the file in (inputs/encoding.py); `say` is told
    which, where it is not UTF-8."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in INPUT_SUFFIXES and spreadsheet_hint(path):
        raise UserError(f"--input {path}: {spreadsheet_hint(path)}")
    if suffix not in INPUT_SUFFIXES:
        raise UserError(f"--input {path}: unsupported file type {suffix or '(none)'!r};"
                        f" use one of {', '.join(INPUT_SUFFIXES)}")
    if not p.is_file():
        raise UserError(f"--input {path}: no such file")
    codec = file_codec(str(p))
    note = read_note(f"--input {path}", codec)
    if say is not None and note:
        say(note)
    if suffix == ".txt":
        with open(p, encoding=codec) as f:
            return [line.rstrip("\r\n") for line in f if line.strip()]
    if suffix == ".jsonl":
        return _read_jsonl(p, codec, column)
    return _read_csv(p, codec, column)


def _read_jsonl(p: Path, codec: str, column: str) -> list[str]:
    texts = []
    with open(p, encoding=codec) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (ValueError, RecursionError) as e:  # also an integer past int_max_str_digits, deep nesting
                reason = e.msg if isinstance(e, json.JSONDecodeError) else first_line(e)
                raise UserError(f"--input {p} line {number}: not valid JSON ({reason});"
                                " one object per line") from None
            field = column_named(list(row), column) if isinstance(row, dict) else None  # or "Text"
            if field is None or not isinstance(row[field], str):
                raise UserError(f"--input {p} line {number}: needs a string field {json.dumps(column)}, e.g."
                                f" {{{json.dumps(column)}: \"...\"}}" + text_column_hint(list(row or ())))
            texts.append(row[field])
    return texts


def _read_csv(p: Path, codec: str, column: str) -> list[str]:
    # News articles and reviews can exceed csv's default 128 KiB field limit.
    csv.field_size_limit(min(2**31 - 1, 1 << 30))
    with open(p, encoding=codec, newline="") as f:
        sep = default_separator(p.name)  # or ";", a tab or "|" where the header line shows it (an Excel export)
        sep = separator_in(f.readline().split(sep), sep) or sep
        f.seek(0)
        reader = csv.DictReader(f, delimiter=sep)
        columns = reader.fieldnames or []
        found = column_named(columns, column)  # or "Text"
        if found is None:
            raise UserError(f"--input {p}: no {json.dumps(column)} column (columns: {', '.join(columns) or 'none'});"
                            " name the column with the texts with --text-column" + text_column_hint(columns))
        texts = []
        for number, row in enumerate(reader, start=2):
            text = row.get(found)
            if text is None:
                raise UserError(f"--input {p} line {number}: the row is shorter than the header")
            texts.append(text)
    return texts
