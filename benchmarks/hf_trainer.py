"""The reference: the same fine-tune written with the plain Hugging Face Trainer, in one process.

    python benchmarks/hf_trainer.py DATA_DIR MODEL_DIR OUT_JSON [--epochs 2] [--batch 16]

Reads the texts and labels of torchloom's prepared train and test splits (the same split), tokenizes
them with the model's tokenizer (max_length 128), trains with Trainer in --precision (auto: torchloom's
own rule, so both sides run what this CPU runs best: bf16 only where it is native) and writes
{"accuracy", "total_s", "train_s", "precision"} to OUT_JSON.
"""

import argparse
import json
import os
import time

T0 = time.perf_counter()

import numpy as np  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    Trainer,
    TrainingArguments,
)


class Encoded(torch.utils.data.Dataset):
    def __init__(self, enc, labels):
        self.enc, self.labels = enc, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"input_ids": self.enc["input_ids"][i], "attention_mask": self.enc["attention_mask"][i],
                "labels": self.labels[i]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("data_dir")
    p.add_argument("model_dir")
    p.add_argument("out")
    p.add_argument("--epochs", type=float, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto")
    a = p.parse_args()
    from torchloom.model.device import choose_precision

    precision = choose_precision(a.precision, "cpu").precision
    labels = json.load(open(os.path.join(a.data_dir, "manifest.json")))["labels"]
    tok = AutoTokenizer.from_pretrained(a.model_dir)

    def load(split):
        t = pq.read_table(os.path.join(a.data_dir, split), columns=["text", "label_id"])
        enc = tok(t.column("text").to_pylist(), truncation=True, max_length=128)
        return Encoded(enc, t.column("label_id").to_pylist())

    train, test = load("train"), load("test")
    model = AutoModelForSequenceClassification.from_pretrained(a.model_dir, num_labels=len(labels))
    args = TrainingArguments(
        output_dir=os.path.join(os.path.dirname(a.out), "hf-trainer-out"), per_device_train_batch_size=a.batch,
        per_device_eval_batch_size=64, num_train_epochs=a.epochs, bf16=precision == "bf16", use_cpu=True,
        save_strategy="no", report_to=[], logging_steps=50, dataloader_num_workers=0, seed=42,
    )
    trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=DataCollatorWithPadding(tok))
    t_train = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t_train
    pred = trainer.predict(test)
    acc = float((np.argmax(pred.predictions, axis=-1) == np.array(test.labels)).mean())
    with open(a.out, "w") as f:
        json.dump({"accuracy": acc, "train_s": train_s, "total_s": time.perf_counter() - T0, "precision": precision}, f)


if __name__ == "__main__":
    main()
