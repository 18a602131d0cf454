"""The traced forward (model/traced.py): used only where it answers as eager does, and eager otherwise."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from torchloom.model.predict import Predictor, pad_batch  # noqa: E402
from torchloom.model.traced import TracedForward  # noqa: E402

WORDS = ["the", "market", "rose", "as", "team", "won", "a", "late", "goal", "and", "shares", "in", "bank", "fell"]


@pytest.fixture(scope="module")
def predictor(tiny_model_dir):
    return Predictor(tiny_model_dir, batch_size=16)


def batches(predictor, seed: int = 0):
    """Padded batches of 1-16 texts of 1-40 words: every batch but the one-row ones holds padding."""
    rng = random.Random(seed)
    for rows in (1, 3, 16, 7):
        texts = [" ".join(rng.choices(WORDS, k=rng.randint(1, 40))) for _ in range(rows)]
        features = [f for windows in predictor.encode_windows(texts) for f in windows]
        yield pad_batch(features, predictor.tokenizer)


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_a_traced_graph_gives_eager_logits_on_batches_of_every_shape(predictor, dtype):
    def context():
        return torch.autocast("cpu", dtype=getattr(torch, dtype)) if dtype else torch.autocast("cpu", enabled=False)

    forward = TracedForward(predictor.model)
    first = next(batches(predictor, seed=1))
    with torch.inference_mode():
        used, why = forward.choose(first, context, gain=float("inf"))  # the graph whatever its speed
        assert used and forward.traced, why
        for batch in batches(predictor):
            with context():
                want, got = predictor.model(**batch).logits.float(), forward.logits(batch).float()
            assert got.shape == want.shape
            assert torch.allclose(got, want, atol=1e-5 if dtype is None else 2e-2, rtol=0), (got - want).abs().max()
        # another autocast dtype than the one chosen under runs eager, not the graph traced with other casts
        other = (lambda: torch.autocast("cpu", enabled=False)) if dtype else (
            lambda: torch.autocast("cpu", dtype=torch.bfloat16))
        with other():
            assert torch.equal(forward.logits(first), predictor.model(**first).logits)


def test_a_traced_graph_for_a_monitor_gives_eager_pooled_representations_too(predictor):
    """With pooled=True (a server whose monitor sketches), the graph gives (logits, pooled) as eager_forward does:
    each row's last hidden states averaged over its own tokens, padding left out."""
    from torchloom.model.traced import eager_forward

    forward = TracedForward(predictor.model, pooled=True)
    first = next(batches(predictor, seed=1))
    with torch.inference_mode():
        used, why = forward.choose(first, gain=float("inf"))
        assert used, why
        for batch in batches(predictor):
            (want_logits, want_pooled), (got_logits, got_pooled) = eager_forward(predictor.model, batch, True), \
                forward.forward(batch)
            assert torch.allclose(got_logits, want_logits, atol=1e-5, rtol=0)
            assert got_pooled.shape == (len(batch["input_ids"]), predictor.model.config.hidden_size)
            assert torch.allclose(got_pooled, want_pooled, atol=1e-5, rtol=0)
        # a padded row's pooled representation is its own, unpadded: padding does not move it
        row = {k: v[-1:] for k, v in first.items()}
        real = int(row["attention_mask"].sum())
        alone = {k: v[:, :real] for k, v in row.items()}
        assert torch.allclose(eager_forward(predictor.model, row, True)[1],
                              eager_forward(predictor.model, alone, True)[1], atol=1e-5, rtol=0)


class _Model(torch.nn.Module):
    """A classifier-shaped model that misbehaves only while it is being traced: it raises, or answers twice."""

    def __init__(self, while_tracing: str) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(1, 2)
        self.while_tracing = while_tracing

    def forward(self, input_ids, attention_mask):
        logits = self.linear((input_ids * attention_mask).float().mean(1, keepdim=True))
        if torch.jit.is_tracing():
            if self.while_tracing == "raise":
                raise RuntimeError("cannot trace this model")
            logits = logits * 2
        return SimpleNamespace(logits=logits)


@pytest.mark.parametrize("fault,reason", [("raise", "does not trace (RuntimeError: cannot trace this model)"),
                                          ("differ", "traced logits differ from eager")])
def test_a_model_that_does_not_trace_or_traces_wrong_stays_eager(fault, reason):
    model = _Model(fault)
    batch = {"input_ids": torch.tensor([[101, 7, 8, 102], [101, 9, 102, 0]]),
             "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])}
    forward = TracedForward(model)
    used, why = forward.choose(batch, gain=float("inf"))
    assert not used and not forward.traced and reason in why
    assert torch.equal(forward.logits(batch), model(**batch).logits)  # eager answers
