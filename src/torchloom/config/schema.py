"""One dataclass per stage. Defaults are the embedded demo (BBC News + all-MiniLM-L6-v2)."""

from __future__ import annotations

from dataclasses import dataclass, field

from torchloom.config.engines import ENGINES
from torchloom.text.formats import FORMATS


def choices(*allowed: str) -> dict:
    return {"choices": allowed}


@dataclass
class DataConfig:
    path: str = ""  # a file, directory, glob or URI, a Delta table, iceberg://catalog/ns.table; "": embedded BBC News
    format: str = field(default="auto", metadata=choices("auto", *FORMATS))
    # a table's version to read: a Delta version, an Iceberg snapshot id, or an ISO timestamp (the version then
    # current); "": the version current when prepare starts, pinned for the whole read (inputs/tables.py)
    version: str = ""
    # Iceberg catalogs by name (iceberg://NAME/...): pyiceberg's properties, over its own config
    # (~/.pyiceberg.yaml, PYICEBERG_CATALOG__NAME__*), e.g. {local = {uri = "sqlite:///c.db", warehouse = "..."}}
    catalogs: dict = field(default_factory=dict)
    text_column: str = "text"
    label_column: str = "label"
    # one label per text, or a set of tags (text/tags.py): "auto" reads a column of lists (JSON or Parquet lists,
    # a CSV cell holding a JSON list) as tags, and any delimiter given; "multi_label" reads every value as tags
    task: str = field(default="auto", metadata=choices("auto", "single_label", "multi_label"))
    label_delimiter: str = ""  # multi-label: the character(s) that split a string of tags ("|": "sport|money")
    keep_untagged: bool = False  # multi-label: a row with no tag is kept (a text none apply to), else set aside
    label_path_delimiter: str = ""  # hierarchical labels ("/": "Tops/Knits"): text/hierarchy.py
    # multi-label: one 0/1 column per tag, comma-separated names, read in place of label_column (inputs/read.py)
    label_columns: str = ""

    def label_sources(self) -> list[str]:
        """The input columns a row's label is read from: label_columns' names, else label_column."""
        named = [c.strip() for c in self.label_columns.split(",") if c.strip()]
        return list(dict.fromkeys(named)) or [self.label_column]
    # the encoding CSV, JSON lines and folder files are read in: "auto" (UTF-8, UTF-16 with a BOM, else
    # cp1252 or latin-1, per file: inputs/encoding.py), a Python codec name for every file, or "strict" (UTF-8
    # only; other rows are set aside as invalid_utf8)
    encoding: str = "auto"
    # The user's own split, kept: a column of train/val/test values, or separate files for val and test
    # (same format and columns as path). Without val rows, val is carved from train by val_fraction.
    split_column: str = ""
    val_path: str = ""
    test_path: str = ""


@dataclass
class PrepareConfig:
    spark_master: str = "local[*]"
    spark_conf: dict = field(default_factory=dict)  # extra Spark conf, e.g. {"spark.executor.memory" = "4g"}
    min_chars: int = field(default=1, metadata={"min": 0})  # after cleaning; shorter texts are rejected
    max_chars: int = field(default=0, metadata={"min": 0})  # 0: no limit; longer texts are rejected
    val_fraction: float = field(default=0.1, metadata={"min": 0.0, "max": 0.5})
    test_fraction: float = field(default=0.1, metadata={"min": 0.0, "max": 0.5})
    # the most rows of val and of test carved by a fraction; auto: the default fractions capped near 153,664 rows
    # (accuracy's 95 % interval within +-0.25 points; etl/split.py), a fraction you set kept as given; 0: no cap
    heldout_rows: int | str = field(default="auto", metadata={"min": 0, "auto": True, "type": int})
    seed: int = 42
    # tokens per text (or per window, with chunks); "auto": the shortest of 128/256/512 that holds the
    # 90th percentile of the data's token lengths, within the model's positions (etl/lengths.py choose_max_length)
    max_length: int = field(default=128, metadata={"min": 8, "auto": True})
    # how a longer text is cut: "head" (its start), "head_tail" (a quarter from the start, the rest from
    # the end) or "chunks" (every window of it, scored as the mean of their logits); recorded in the
    # exported model, so every inference path cuts the same way (text/truncation.py).
    # head_tail by measurement on long documents (docs/benchmarks.md, "max_length auto, chunks, and epochs")
    truncation: str = field(default="head_tail", metadata=choices("head", "head_tail", "chunks"))
    stride: int = field(default=0, metadata={"min": 0})  # chunks: tokens from a window's start to the next's; 0: 3/4
    max_chunks: int = field(default=16, metadata={"min": 0})  # chunks: windows per text at most (spread evenly); 0: all
    rows_per_group: int = field(default=1024, metadata={"min": 1})  # Parquet row group size
    partitions: int = field(default=0, metadata={"min": 0})  # shards per split and shuffle width; 0: sized to the data
    # a val/test text also in train: "report" counts it (manifest, summary); "drop" sets it aside as leaked
    leakage: str = field(default="report", metadata=choices("report", "drop"))
    # who reads a data.path on an object store on a Spark cluster: "spark" (its own s3a/gs connector),
    # "pyarrow" (the tasks stream the objects with pyarrow: inputs/store_read.py), "auto" (spark when this Spark
    # has a file system for the URI's scheme, else pyarrow)
    input_reader: str = field(default="auto", metadata=choices("auto", "spark", "pyarrow"))

    @property
    def spark_here(self) -> bool:
        """local, local[N] and local-cluster[...]: every Spark process on this machine, talking over loopback (they
        see this host's files); anything else is a cluster's. Asked here only (a Run's spark_here)."""
        master = self.spark_master.strip()
        return master == "local" or master.startswith(("local[", "local-cluster["))


@dataclass
class ModelConfig:
    path: str = ""  # a local Hugging Face model dir; "" means the embedded all-MiniLM-L6-v2
    # Dropout on attention probabilities while training. 0 lets PyTorch's fused attention kernels run:
    # MiniLM forward+backward is faster (docs/benchmarks.md, benchmarks/step_parts.py). -1 keeps the model's own value.
    attention_dropout: float = field(default=0.0, metadata={"min": -1.0, "max": 0.9})


@dataclass
class TrainConfig:
    # auto: from the data within train.budget (config/budget.py: ~45 steps a class, 2 to 5 epochs)
    epochs: int | str = field(default="auto", metadata={"min": 1, "auto": True, "type": int})
    budget: str = "auto"  # auto (at most 2.5x the old fixed 2 epochs), off (the fixed 2), or a time: 1800, 30m, 2h
    # global: samples per optimizer step, all workers; auto: 16, grown where the data has steps to spare
    # (config/budget.py)
    batch_size: int | str = field(default="auto", metadata={"min": 1, "auto": True, "type": int})
    grad_accum: int = field(default=1, metadata={"min": 1})  # micro-steps per optimizer step
    lr: float = field(default=1e-4, metadata={"min_exclusive": 0.0})
    weight_decay: float = field(default=0.01, metadata={"min": 0.0})
    warmup_ratio: float = field(default=0.1, metadata={"min": 0.0, "max": 1.0})
    schedule: str = field(default="linear", metadata=choices("linear", "cosine", "constant"))
    grad_clip: float = field(default=1.0, metadata={"min": 0.0})  # 0: off
    # auto: bf16 on a GPU that has it (else fp16 with a gradient scaler); on CPU bf16 only where the CPU runs
    # it natively (AMX, AVX512-BF16), else fp32, since emulated bf16 is many times slower (model/device.py)
    precision: str = field(default="auto", metadata=choices("auto", "fp32", "bf16", "fp16"))
    seed: int = 42
    max_steps: int = field(default=0, metadata={"min": 0})  # 0: epochs decide
    eval_every: int = field(default=0, metadata={"min": 0})  # optimizer steps; 0: at each epoch end
    log_every: int = field(default=10, metadata={"min": 1})
    checkpoint_every: int = field(default=0, metadata={"min": 0})  # optimizer steps; 0: at each epoch end
    keep_last: int = field(default=2, metadata={"min": 1})
    # evals without improvement; 0: off; auto: 2 where train.epochs auto chose more than 2, else off
    early_stopping_patience: int | str = field(default="auto", metadata={"min": 0, "auto": True, "type": int})
    metric: str = field(default="macro_f1", metadata=choices("macro_f1", "accuracy", "loss"))
    class_weights: str = field(default="none", metadata=choices("none", "balanced"))
    # a multi-label run's loss per tag: asymmetric (ASL: easy negatives weighed down; measured against bce and
    # positive weights: docs/benchmarks.md, "Multi-label: the loss"), bce, focal (gamma 2)
    tag_loss: str = field(default="asymmetric", metadata=choices("asymmetric", "bce", "focal"))
    shuffle_buffer: int = field(default=4096, metadata={"min": 1})  # rows shuffled together, all ranks
    # auto: on where the median prepared text is shorter than max_length (data/buckets.py, docs/benchmarks.md)
    length_bucketing: bool | str = field(default="auto", metadata={"auto": True, "type": bool})
    packing: bool = False  # BERT-family: each micro-batch's sequences packed into fewer rows (model/packing.py)
    trace_rows: bool = False  # every rank writes the row ids of each step to logs/rows-rankR.jsonl
    select: str = field(default="best", metadata=choices("best", "last"))  # which checkpoint is exported
    strategy: str = field(default="ddp", metadata=choices("ddp", "fsdp", "pipeline"))  # see docs/parallelism.md
    activation_checkpointing: bool = False  # recompute each transformer layer in backward: less memory
    compile: bool = False  # torch.compile each transformer layer (train/parallelize.py)
    pipeline_stages: int = field(default=0, metadata={"min": 0})  # strategy pipeline; 0: one per worker
    microbatches: int = field(default=4, metadata={"min": 1})  # strategy pipeline: per micro-step
    resume: str = ""  # "": start fresh; "latest"; or a checkpoint directory
    # a notice of preemption (SIGTERM, train.preemption_url): every rank stops after the same step and writes
    # a checkpoint, if that fits in this many seconds from the notice (else the newest periodic one stands)
    preemption_grace_s: float = field(default=25.0, metadata={"min": 0.0})
    preemption_url: str = ""  # a cloud's preemption notice URL to poll every 5 s; "": off


@dataclass
class EvalConfig:
    split: str = field(default="test", metadata=choices("test", "val", "train"))
    batch_size: int = field(default=16, metadata={"min": 1})  # small batches run faster per row on CPU
    calibration_bins: int = field(default=10, metadata={"min": 2})
    misclassified_limit: int = field(default=1000, metadata={"min": 0})
    # autocast of evaluate and in-training validation; auto: the rule of train.precision, as `serve --precision
    # auto` answers, so the reported numbers are the served ones
    precision: str = field(default="auto", metadata=choices("auto", "fp32", "bf16", "fp16"))
    baseline: bool = True  # score a TF-IDF + logistic-regression baseline beside the transformer
    # the classical baseline's path: scikit-learn on the driver, Spark MLlib, or auto (the driver up to 200k
    # train texts / 50 MB of text, Spark beyond)
    baseline_engine: str = field(default="auto", metadata=choices("auto", "driver", "spark"))
    # who scores eval.split (and export's val split for the mix): this process, Spark tasks over the prepared split
    # (the model sent to every executor; evaluate/spark_scoring.py), or auto: Spark where the run trains on Spark
    # and the split has more than spark_rows rows. The numbers are the same either way.
    score_with: str = field(default="auto", metadata=choices("auto", "process", "spark"))
    spark_rows: int = field(default=250_000, metadata={"min": 0})


@dataclass
class ExportConfig:
    # hf: the Hugging Face directory; onnx adds model.onnx, onnx-int8 also model.int8.onnx, each kept only
    # when it passes its parity gate on held-out prepared rows (model/onnx.py)
    format: str = field(default="hf", metadata=choices("hf", "onnx", "onnx-int8"))
    gate_rows: int = field(default=2000, metadata={"min": 1})  # held-out rows the gate scores, at most
    # auto: the mix with the baseline where it beats the transformer alone on val (evaluate/mix.py)
    combine: str = field(default="auto", metadata=choices("auto", "off", "on"))
    top_k: int = field(default=0, metadata={"min": 0})  # multi-label: the k most probable tags; 0: thresholds
    register: str = ""  # a model name in MLflow's registry: the exported model becomes its new version (registry.py)
    alias: str = ""  # with register: the alias the new version takes (champion, challenger, ...)


@dataclass
class EngineConfig:
    name: str = field(default="local", metadata=choices(*ENGINES))  # config/engines.py: a row each
    # auto: one per visible GPU on a GPU machine (local engine, or Ray on its own instance); else 2
    # (see docs/benchmarks.md, "Workers")
    workers: int | str = field(default="auto", metadata={"min": 1, "auto": True, "type": int})
    device: str = field(default="auto", metadata=choices("auto", "cpu", "cuda"))
    threads_per_worker: int = field(default=0, metadata={"min": 0})  # 0: cores / workers on a machine
    # local engine: auto forks the workers from a fork server holding their imports on CPU, spawn with CUDA
    start_method: str = field(default="auto", metadata=choices("auto", "spawn"))
    max_restarts: int = field(default=2, metadata={"min": 0})  # worker failures survived by resuming
    min_workers: int = field(default=0, metadata={"min": 0})  # Ray: fewest workers to go on with; 0: workers
    ray_address: str = ""  # "": start a local Ray instance; "auto" or "ray://host:10001": a cluster
    cpus_per_worker: float = field(default=0.0, metadata={"min": 0.0})  # Ray; 0: cores / workers locally, else 1
    # A collective that waits longer than this fails: how soon a lost host or a hung peer is noticed.
    # Checkpoint writes wait on a separate, 30-minute barrier, so a slow disk does not trip it.
    collective_timeout_s: float = field(default=60.0, metadata={"min": 5.0})


@dataclass
class OutputConfig:
    dir: str = "runs/bbc-minilm"
    overwrite: bool = False


@dataclass
class TrackingConfig:
    enabled: bool = True
    # "": $MLFLOW_TRACKING_URI, else sqlite:///<working dir>/mlflow.db; or http://host:5000, a database URL,
    # or a directory to keep mlflow.db in
    uri: str = ""
    experiment: str = "torchloom"
    run_name: str = ""  # "": the run dir's name
    log_model: bool = True  # the exported model as an MLflow pyfunc model
    notify_url: str = ""  # a webhook (Slack-compatible) told when training fails, is preempted or ends worse


@dataclass
class TuneConfig:
    backend: str = field(default="auto", metadata=choices("auto", "ray", "optuna"))  # auto: ray when installed
    # config key -> distribution: uniform(a, b), loguniform(a, b), int(a, b), logint(a, b), choice(x, y, ...)
    space: dict = field(default_factory=lambda: {"train.lr": "loguniform(1e-5, 3e-4)",
                                                 "train.warmup_ratio": "uniform(0, 0.2)"})
    trials: int = field(default=8, metadata={"min": 1})  # for the whole study, however many processes run it
    max_concurrent: int = field(default=0, metadata={"min": 0})  # ray: trials at once; 0: cores // workers
    time_budget_s: float = field(default=0.0, metadata={"min": 0.0})  # 0: no limit
    metric: str = field(default="macro_f1", metadata=choices("macro_f1", "accuracy", "loss"))  # on validation
    mode: str = field(default="auto", metadata=choices("auto", "max", "min"))  # auto: min for loss, else max
    scheduler: str = field(default="asha", metadata=choices("asha", "hyperband", "none"))  # early stopping
    grace_period: int = field(default=1, metadata={"min": 1})  # evaluations before a trial can be stopped
    reduction_factor: int = field(default=2, metadata={"min": 2})
    storage: str = ""  # optuna: "" is sqlite:///<output.dir>/optuna.db; or any database URL (postgresql://...)
    # optuna: how often a running trial says it is alive; silent for 4 times this, it is failed and run again
    heartbeat_s: float = field(default=30.0, metadata={"min": 1.0})
    study_name: str = ""  # "": the output dir's name
    seed: int = 42


@dataclass
class K8sConfig:
    """`torchloom k8s train|serve|loop`: what the manifests ask of the cluster (k8s/). Not read by any stage."""
    image: str = ""  # the container image with torchloom installed (the same version); required
    namespace: str = "default"
    name: str = ""  # the Job's / Deployment's name; "": from output.dir's (or the model's) last part
    nodes: int = field(default=1, metadata={"min": 1})  # train: pods, one torchrun agent each
    gpus: int = field(default=0, metadata={"min": 0})  # nvidia.com/gpu per pod; train: one rank per GPU
    cpu: str = ""  # CPU request per pod ("8", "7500m"); "": none
    memory: str = ""  # memory request and limit per pod ("64Gi"); "": none
    node_selector: dict = field(default_factory=dict)  # {"cloud.google.com/gke-accelerator" = "nvidia-h100-80gb"}
    tolerations: dict = field(default_factory=dict)  # taint key -> "Effect" (any value) or "value:Effect"
    # the Secret whose keys become the pods' environment (store credentials; serve: TORCHLOOM_API_KEY); "": none
    # (credentials from the pods' service account). Not named "secret": redaction.py would mask the name.
    env_from: str = ""
    replicas: int = field(default=1, metadata={"min": 1})  # serve: pods of the Deployment
    service_account: str = ""  # the pods' service account (workload identity); "": the namespace's default
    image_pull_secrets: str = ""  # Secrets of a private registry, comma-separated
    labels: dict = field(default_factory=dict)  # on every object and pod (a Kueue queue: kueue.x-k8s.io/queue-name)
    annotations: dict = field(default_factory=dict)  # on every object and pod
    priority_class: str = ""  # the pods' PriorityClass
    scheduler: str = ""  # the pods' scheduler (volcano, ...); "": the cluster's default
    active_deadline_s: int = field(default=0, metadata={"min": 0})  # train: the Job's deadline; 0: none
    ttl_after_finished_s: int = field(default=0, metadata={"min": 0})  # train: a finished Job deleted after; 0: kept
    run_as_user: int = field(default=10001, metadata={"min": 0})  # the pods' user (and group); 0: root, not advised
    volume_size: str = "50Gi"  # loop: the work volume's size (snapshots, the candidates' runs and checkpoints)


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    tune: TuneConfig = field(default_factory=TuneConfig)
    k8s: K8sConfig = field(default_factory=K8sConfig)

    def inputs(self) -> list[str]:
        """What the stages read from outside the run (data.path and its val and test files, model.path): never
        deleted, and a directory holding one is never replaced (ledger.deletable)."""
        return [p for p in (self.data.path, self.data.val_path, self.data.test_path, self.model.path) if p]
