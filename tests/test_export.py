"""Export to a plain Hugging Face directory, prediction from it, input readers and text cleaning."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from torchloom.errors import UserError
from torchloom.model.export import export_model, read_export_info, strip_wrapper_prefixes
from torchloom.model.predict import Predictor, read_texts
from torchloom.text.clean import clean_text

LABELS = ["business", "sport", "tech"]
TEXTS = [
    "Shares rose sharply after the quarterly results.",
    "goal",
    "The new phone has a faster chip, a bigger battery and a screen that folds in half twice.",
    "",
    "Tennis final tonight",
]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> str:
    from torchloom.model.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-base"))


@pytest.fixture(scope="module")
def model(base_dir):
    from transformers import AutoTokenizer

    from torchloom.model.build import build_classifier

    torch.manual_seed(0)
    m = build_classifier(base_dir, LABELS).eval()
    # A random tiny BERT pools every text to nearly the same vector, so every text would get the same
    # label. Centre the head on the mean pooled vector and scale it: texts then get clearly different
    # outputs, and a mix-up of rows cannot hide inside the tolerance.
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    with torch.no_grad():
        enc = tokenizer([t for t in TEXTS if t], padding=True, return_tensors="pt")
        pooled = m.bert(**enc).pooler_output
        m.classifier.weight.mul_(1000.0)
        m.classifier.bias.copy_(-m.classifier.weight @ pooled.mean(dim=0))
    return m


@pytest.fixture(scope="module")
def exported(model, base_dir, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("export") / "model"
    return export_model(model, base_dir, LABELS, str(out),
                        extra_info={"data_fingerprint": "fp123", "metrics": {"accuracy": 0.5}, "max_length": 32})


def reference_probs(model, base_dir, texts, max_length=32):
    """Probabilities one text at a time (no padding, no batching), the ground truth for the Predictor."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    out = []
    with torch.no_grad():
        for text in texts:
            enc = tokenizer([clean_text(text)], truncation=True, max_length=max_length, return_tensors="pt")
            out.append(torch.softmax(model(**enc).logits, dim=-1)[0])
    return torch.stack(out)


def test_exported_dir_is_plain_hugging_face(exported):
    from safetensors import safe_open

    names = set(os.listdir(exported))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "torchloom.json"} <= names
    assert not any(n.endswith(".bin") for n in names)
    config = json.loads(open(os.path.join(exported, "config.json")).read())
    assert config["id2label"] == {"0": "business", "1": "sport", "2": "tech"}
    assert config["label2id"] == {"business": 0, "sport": 1, "tech": 2}
    with safe_open(os.path.join(exported, "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    assert "classifier.weight" in keys
    assert not [k for k in keys if k.startswith(("module.", "_orig_mod.")) or "_orig_mod" in k]
    info = read_export_info(exported)
    assert info["labels"] == LABELS
    assert info["data_fingerprint"] == "fp123" and info["metrics"] == {"accuracy": 0.5}
    assert info["max_length"] == 32 and info["torchloom_version"]


def test_export_loads_without_torchloom_and_gives_identical_logits(exported, model, base_dir, tmp_path):
    from transformers import AutoTokenizer

    script = (
        "import json, sys, torch\n"
        "from transformers import AutoModelForSequenceClassification, AutoTokenizer\n"
        "path, texts = sys.argv[1], json.loads(sys.argv[2])\n"
        "model = AutoModelForSequenceClassification.from_pretrained(path).eval()\n"
        "tokenizer = AutoTokenizer.from_pretrained(path)\n"
        "with torch.no_grad():\n"
        "    logits = model(**tokenizer(texts, padding=True, return_tensors='pt')).logits\n"
        "print(json.dumps({'logits': logits.tolist(), 'id2label': model.config.id2label,\n"
        "                  'torchloom': sorted(m for m in sys.modules if m.startswith('torchloom'))}))\n"
    )
    texts = [t for t in TEXTS if t]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    proc = subprocess.run([sys.executable, "-c", script, exported, json.dumps(texts)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["torchloom"] == []
    assert result["id2label"] == {"0": "business", "1": "sport", "2": "tech"}

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    with torch.no_grad():
        expected = model(**tokenizer(texts, padding=True, return_tensors="pt")).logits
    assert torch.allclose(torch.tensor(result["logits"]), expected, atol=1e-5)
    assert expected.argmax(-1).unique().numel() > 1  # the comparison covers more than one class


def test_export_unwraps_compile_and_ddp(model, base_dir, tmp_path):
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.nn.parallel import DistributedDataParallel

    compiled = torch.compile(model)
    assert any(k.startswith("_orig_mod.") for k in compiled.state_dict())
    out = export_model(compiled, base_dir, LABELS, str(tmp_path / "compiled"))
    weights = load_file(os.path.join(out, "model.safetensors"))
    assert torch.equal(weights["classifier.weight"], model.classifier.weight)

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this test process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        wrapped = DistributedDataParallel(torch.compile(model))
        assert any(k.startswith("module._orig_mod.") for k in wrapped.state_dict())
        out = export_model(wrapped, base_dir, LABELS, str(tmp_path / "ddp"))
    finally:
        dist.destroy_process_group()
    weights = load_file(os.path.join(out, "model.safetensors"))
    assert not [k for k in weights if "module." in k or "_orig_mod" in k]
    assert torch.equal(weights["classifier.weight"], model.classifier.weight)


def test_export_saves_a_given_state_dict_without_prefixes(model, base_dir, tmp_path):
    from safetensors.torch import load_file

    state = {f"module._orig_mod.{k}": v.clone() for k, v in model.state_dict().items()}
    state["module._orig_mod.classifier.bias"] = torch.tensor([1.0, 2.0, 3.0])
    out = export_model(model, base_dir, LABELS, str(tmp_path / "m"), state_dict=state)
    weights = load_file(os.path.join(out, "model.safetensors"))
    assert weights["classifier.bias"].tolist() == [1.0, 2.0, 3.0]
    assert strip_wrapper_prefixes({"module.a.module.b": 1}) == {"a.module.b": 1}


def test_export_replaces_existing_dir_only_when_complete(model, base_dir, tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "stale.txt").write_text("old export")
    with pytest.raises(ValueError, match="2 labels"):
        export_model(model, base_dir, ["x", "y"], str(out))
    assert (out / "stale.txt").read_text() == "old export"  # a failed export leaves the old one alone

    export_model(model, base_dir, ["x", "y", "z"], str(out))
    assert not (out / "stale.txt").exists()
    assert json.loads((out / "config.json").read_text())["id2label"]["2"] == "z"
    assert model.config.id2label[2] == "tech"  # the caller's model is not relabelled
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no temporary dirs left behind


def test_export_bad_tokenizer_dir_is_a_user_error(model, tmp_path):
    with pytest.raises(UserError, match="tokenizer"):
        export_model(model, str(tmp_path / "nowhere"), LABELS, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# predict
# ---------------------------------------------------------------------------------------------


def test_predictions_are_in_input_order_and_match_the_model(exported, model, base_dir):
    predictor = Predictor(exported, batch_size=2)
    assert predictor.max_length == 32  # from torchloom.json
    texts = TEXTS * 3
    results = predictor.predict(texts)
    expected = reference_probs(model, base_dir, texts)
    assert len(results) == len(texts)
    for result, probs in zip(results, expected):
        assert list(result["probabilities"]) == LABELS
        got = torch.tensor([result["probabilities"][label] for label in LABELS])
        assert torch.allclose(got, probs, atol=1e-5)
        assert result["label"] == LABELS[int(probs.argmax())]
        # Batches of 2 against one batch of all: padding changes the float order, as on the line above.
        assert result["score"] == pytest.approx(float(probs.max()), abs=1e-5)
        assert sum(result["probabilities"].values()) == pytest.approx(1.0, abs=1e-5)
    assert len({r["label"] for r in results}) > 1
    # Batch size changes the batching and padding, never the answers.
    one_by_one = Predictor(exported, batch_size=1).predict(texts)
    assert [r["label"] for r in one_by_one] == [r["label"] for r in results]
    assert predictor.predict([]) == []


def test_a_batch_is_cut_into_forwards_by_rows_and_padded_tokens(exported, model, base_dir):
    """On CPU a length-sorted batch runs as forwards of at most forward_tokens padded tokens, so short texts
    are not padded to a long one's length; the answers do not change."""
    predictor = Predictor(exported, batch_size=4, forward_tokens=40)
    assert Predictor(exported).forward_tokens == 1024 and Predictor(exported, forward_tokens=0).forward_tokens == 0
    lengths = [3, 5, 8, 8, 9, 20, 30, 32]
    cuts = predictor.forwards(lengths, list(range(8)))
    assert cuts == [[0, 1, 2, 3], [4, 5], [6], [7]]  # 4 rows (batch_size); 2 x 20 fits in 40, 3 x 30 does not
    assert [i for cut in cuts for i in cut] == list(range(8))
    assert Predictor(exported, batch_size=4, forward_tokens=0).forwards(lengths, list(range(8))) == [
        [0, 1, 2, 3], [4, 5, 6, 7]]
    assert predictor.forwards([500], [0]) == [[0]]  # one row over the budget still runs, alone
    texts = TEXTS * 3
    expected = reference_probs(model, base_dir, texts)
    for result, probs in zip(predictor.predict(texts), expected):
        got = torch.tensor([result["probabilities"][label] for label in LABELS])
        assert torch.allclose(got, probs, atol=1e-5)


def test_predictor_cleans_text_like_prepare(exported):
    predictor = Predictor(exported)
    messy, clean = predictor.predict(["  Shares\trose\u200b  sharply\n", "Shares rose sharply"])
    assert messy["probabilities"] == pytest.approx(clean["probabilities"], abs=1e-6)


def test_predictor_max_length_defaults_and_override(model, base_dir, tmp_path):
    plain = tmp_path / "plain"
    model.save_pretrained(plain)  # a plain Hugging Face dir, no torchloom.json
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(base_dir).save_pretrained(plain)
    assert Predictor(str(plain)).max_length == 512
    assert Predictor(str(plain), max_length=8).max_length == 8
    assert Predictor(str(plain)).labels == LABELS


def test_predictor_bad_dir_is_one_line_user_error(tmp_path):
    with pytest.raises(UserError) as missing:
        Predictor(str(tmp_path / "nope"))
    assert "no config.json" in str(missing.value) and "\n" not in str(missing.value)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(UserError) as bad:
        Predictor(str(broken))
    assert "cannot load" in str(bad.value) and "\n" not in str(bad.value)


def test_read_texts_formats(tmp_path):
    (tmp_path / "in.txt").write_text("first line\n\nsecond, line\n", encoding="utf-8")
    assert read_texts(str(tmp_path / "in.txt")) == ["first line", "second, line"]
    (tmp_path / "in.jsonl").write_text('{"text": "a", "id": 1}\n\n{"text": "b"}\n', encoding="utf-8")
    assert read_texts(str(tmp_path / "in.jsonl")) == ["a", "b"]
    (tmp_path / "in.csv").write_text('id,text\n1,"hello, world"\n2,"multi\nline"\n', encoding="utf-8")
    assert read_texts(str(tmp_path / "in.csv")) == ["hello, world", "multi\nline"]
    (tmp_path / "semi.csv").write_text('\ufeffid;text\n1;"hello, world; again"\n2;plain\n', encoding="utf-8")
    assert read_texts(str(tmp_path / "semi.csv")) == ["hello, world; again", "plain"]  # Excel's ";" export
    (tmp_path / "caps.csv").write_text("Id,Text\n1,first\n", encoding="utf-8")
    assert read_texts(str(tmp_path / "caps.csv")) == ["first"]  # "Text" for text
    (tmp_path / "body.jsonl").write_text('{"Body": "from body", "text": 3}\n', encoding="utf-8")
    assert read_texts(str(tmp_path / "body.jsonl"), column="body") == ["from body"]  # predict --text-column body


@pytest.mark.parametrize("name, content, message", [
    ("in.json", "[]", "unsupported file type"),
    ("missing.txt", None, "no such file"),
    ("bad.jsonl", '{"text": "a"}\n{oops\n', "line 2: not valid JSON"),
    ("nofield.jsonl", '{"body": "a"}\n', 'line 1: needs a string field "text", e.g. {"text": "..."} (--text-column'
                                         ' body, by its name?)'),
    ("nocol.csv", "id,body\n1,a\n", 'no "text" column (columns: id, body); name the column with the texts with'
                                   ' --text-column (--text-column body, by its name?)'),
])
def test_read_texts_errors(tmp_path, name, content, message):
    if content is not None:
        (tmp_path / name).write_text(content, encoding="utf-8")
    with pytest.raises(UserError, match="--input") as err:
        read_texts(str(tmp_path / name))
    assert message in str(err.value)


def test_read_texts_in_the_encoding_prepare_reads_them_in(tmp_path):
    # as data.encoding auto: cp1252 (or latin-1), UTF-16 with a BOM, UTF-8 with a stray byte; one line says which
    said: list[str] = []
    (tmp_path / "cp.txt").write_bytes("café costs 5 €\n“quoted”\n".encode("cp1252"))
    assert read_texts(str(tmp_path / "cp.txt"), said.append) == ["café costs 5 €", "“quoted”"]
    (tmp_path / "wide.csv").write_bytes('text,id\n"naïve, résumé",1\n'.encode("utf-16"))
    assert read_texts(str(tmp_path / "wide.csv"), said.append) == ["naïve, résumé"]
    (tmp_path / "stray.jsonl").write_bytes(b'{"text": "caf\xc3\xa9 \xff"}\n')
    assert read_texts(str(tmp_path / "stray.jsonl"), said.append) == ["café \ufffd"]
    (tmp_path / "plain.txt").write_text("ünïcode\n", encoding="utf-8")
    assert read_texts(str(tmp_path / "plain.txt"), said.append) == ["ünïcode"]
    assert said == [f"--input {tmp_path / 'cp.txt'}: not UTF-8; read as cp1252, as prepare reads such a file",
                    f"--input {tmp_path / 'wide.csv'}: not UTF-8; read as utf-16, as prepare reads such a file",
                    f"--input {tmp_path / 'stray.jsonl'}: UTF-8 but for a few stray bytes, each read as U+FFFD,"
                    " as prepare reads such a file"]


@pytest.mark.parametrize("raw, cleaned", [
    ("  a\tb\n\nc  ", "a b c"),
    ("e\u0301", "\u00e9"),  # NFC composes
    ("x\x00y\x07z", "xyz"),  # control characters go
    ("zero\u200bwidth\ufeff", "zerowidth"),
    ("non\u00a0breaking", "non breaking"),
    ("", ""),
])
def test_clean_text(raw, cleaned):
    assert clean_text(raw) == cleaned
    assert clean_text(cleaned) == cleaned  # idempotent


def _clean_text_by_definition(s: str) -> str:
    """clean_text spelled out one character at a time: the oracle for the fast version."""
    import re
    import unicodedata

    s = unicodedata.normalize("NFC", s)
    kept = []
    for ch in s:
        if ch.isspace():
            kept.append(" ")
        elif unicodedata.category(ch) != "Cc" and ch not in "\ufeff\u200b\u2060\u00ad":
            kept.append(ch)
    return re.sub(" +", " ", "".join(kept)).strip(" ")


def test_clean_text_equals_its_definition_on_every_code_point():
    import random
    import sys

    chars = [chr(cp) for cp in range(sys.maxunicode + 1) if not 0xD800 <= cp <= 0xDFFF]
    for ch in chars:
        s = f" e{ch}\u0301 "  # at the ends, between words, before a combining accent
        assert clean_text(s) == _clean_text_by_definition(s), repr(s)
    rng = random.Random(0)
    pool = [chr(cp) for cp in range(0x250)] + list("\u0300\u0301\u0308\u0323\u1e9b\u212b\u2126\u1100\u1161"
                                                   "\u11a8\uac00\u3000\u2028\u00a0\u0085\ufeff\u200b")
    for _ in range(20_000):
        s = "".join(rng.choice(pool) for _ in range(rng.randint(0, 12)))
        assert clean_text(s) == _clean_text_by_definition(s), repr(s)


def test_an_export_replaces_model_only_as_the_ledger_vouched_for_it_right_before_the_swap(tmp_path):
    """A file put into model/ between the stage's check and the swap (a user's notes) is never deleted: refused."""
    from torchloom.errors import UserError
    from torchloom.model.export import _check_unchanged

    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text("{}")
    vouched = {"config.json": ((out / "config.json").stat().st_size, (out / "config.json").stat().st_mtime_ns)}
    _check_unchanged(out, vouched)  # as it was checked: fine
    (out / "NOTES.md").write_text("mine")
    with pytest.raises(UserError, match="NOTES.md came or changed there while exporting"):
        _check_unchanged(out, vouched)


def test_a_registered_version_carries_the_validation_metrics_of_the_model_as_shipped(tmp_path):
    """A mix shipped with the baseline (torchloom.json "combine" below weight 1): the version's val_accuracy is the
    mix's, the transformer's beside it; a transformer shipped alone: the checkpoint's, as it was."""
    from torchloom.stages.export import shipped_validation

    meta = {"eval": {"accuracy": 0.976, "macro_f1": 0.97, "loss": 0.1}}
    mixed = {"combine": {"weight": 0.6, "val_accuracy": {"transformer": 0.976, "baseline": 0.95, "shipped": 0.986}}}
    (tmp_path / "torchloom.json").write_text(json.dumps(mixed))
    assert shipped_validation(str(tmp_path), meta) == {"accuracy": 0.986, "accuracy_transformer": 0.976,
                                                       "macro_f1": 0.97, "loss": 0.1}
    (tmp_path / "torchloom.json").write_text(json.dumps({"combine": {**mixed["combine"], "weight": 1.0}}))
    assert shipped_validation(str(tmp_path), meta) == meta["eval"]
    (tmp_path / "torchloom.json").write_text(json.dumps({"labels": ["a", "b"]}))
    assert shipped_validation(str(tmp_path), meta) == meta["eval"]
