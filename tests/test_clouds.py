"""gs:// and abfs:// against real servers on 127.0.0.1: gcp-storage-emulator and Azurite (tests/support/clouds.py),
reached through the variables each cloud's own tools read (STORAGE_EMULATOR_HOST, AZURE_STORAGE_CONNECTION_STRING).
For each: the storage layer's round trip, a whole `torchloom run` with its input and run directory on the store,
predict from a host with an empty cache, and a resume on another host from the store alone (as tests/test_storage.py
does on S3). The configuration of the clients (store/clients.py) is tested without a server."""

from __future__ import annotations

import json
import re

import pytest
from support.clouds import AZURITE_ACCOUNT, AZURITE_KEY, azurite_server, gcs_server
from support.runs import torchloom

from torchloom.errors import UserError
from torchloom.redaction import redact_text
from torchloom.store import clients as store_clients
from torchloom.store import errors as store_errors
from torchloom.store import storage
from torchloom.uri import redact

pytestmark = pytest.mark.heavy(12)  # see tests/support/schedule.py

BUCKET = "torchloom-test"  # a GCS bucket's name and an Azure container's


@pytest.fixture(scope="module", params=["gs", "abfs"])
def cloud(request, tmp_path_factory):
    """The server of one cloud, with BUCKET; this process and its children reach it through the environment."""
    logs = tmp_path_factory.mktemp(f"{request.param}-server")
    server = gcs_server(logs, BUCKET) if request.param == "gs" else azurite_server(logs, BUCKET)
    with server:
        yield request.param


def uri(cloud: str, *parts: str) -> str:
    return storage.join(f"{cloud}://{BUCKET}", *parts)


# -- the storage layer ------------------------------------------------------------------------------


def test_a_store_that_refuses_is_one_line(cloud):
    missing = f"{cloud}://no-such-bucket/run"
    what = "the bucket does not exist" if cloud == "gs" else "the container does not exist"
    with pytest.raises(UserError, match=rf"^output.dir {missing}: the store refused a test write \({what}\)") as e:
        storage.check_writable(missing, "output.dir")
    assert "GOOGLE_APPLICATION_CREDENTIALS" in str(e.value) if cloud == "gs" else "AZURE_STORAGE_KEY" in str(e.value)
    with pytest.raises(UserError, match=rf"data.path {uri(cloud, 'none.csv')}: no such object"):
        storage.check_readable(uri(cloud, "none.csv"), "data.path")
    if cloud == "abfs":
        with pytest.raises(UserError, match=r"names storage account other, but AZURE_STORAGE_CONNECTION_STRING is for"
                                            rf" account {AZURITE_ACCOUNT}"):
            storage.resolve(f"abfs://{BUCKET}@other.dfs.core.windows.net/x")


def test_objects_round_trip_and_list(cloud, tmp_path):
    storage.write_bytes(uri(cloud, "a/b.txt"), b"hello")
    assert storage.read_bytes(uri(cloud, "a/b.txt")) == b"hello"
    assert storage.exists(uri(cloud, "a/b.txt")) and not storage.exists(uri(cloud, "a/none.txt"))
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "meta.json").write_text("{}")
    (tmp_path / "d" / "sub" / "x.bin").write_bytes(b"\1" * 1000)
    assert storage.push_tree(tmp_path / "d", uri(cloud, "tree"), last=("meta.json",)) == 1002
    assert storage.list_files(uri(cloud, "tree")) == {"meta.json": 2, "sub/x.bin": 1000}
    assert storage.pull_tree(uri(cloud, "tree"), tmp_path / "back") == 2
    assert (tmp_path / "back" / "sub" / "x.bin").read_bytes() == b"\1" * 1000
    assert storage.pull_tree(uri(cloud, "tree"), tmp_path / "back") == 0  # the same sizes: kept
    with storage.open_input(uri(cloud, "tree/sub/x.bin")) as f:  # a ranged read, not a download
        assert f.read_at(10, 500) == b"\1" * 10
    storage.delete(uri(cloud, "tree/meta.json"))
    storage.delete(uri(cloud, "tree/meta.json"))  # none there is fine
    assert storage.list_files(uri(cloud, "tree")) == {"sub/x.bin": 1000}
    storage.delete_tree(uri(cloud, "tree"))
    assert storage.list_files(uri(cloud, "tree")) == {}
    assert storage.exists(uri(cloud, "a/b.txt"))  # the bucket and the rest of it are still there
    with pytest.raises(FileNotFoundError):
        storage.read_bytes(uri(cloud, "a/none.txt"))
    storage.check_writable(uri(cloud, "runs/x"), "output.dir")
    if cloud == "abfs":  # Hadoop's form names the account: the same objects
        hadoop = f"abfs://{BUCKET}@{AZURITE_ACCOUNT}.dfs.core.windows.net/a/b.txt"
        assert storage.read_bytes(hadoop) == storage.read_bytes(hadoop.replace("abfs", "abfss")) == b"hello"
        assert redact(hadoop) == hadoop and redact_text(hadoop) == hadoop  # a container is no secret


def test_azurite_that_refuses_pyarrows_api_version_is_one_line(tmp_path):
    """Azurite checks the x-ms-version of each request; pyarrow's Azure SDK may be newer than it. Without
    --skipApiVersionCheck that is one line saying so, or it works (an Azurite that knows the version)."""
    with azurite_server(tmp_path, "", skip_api_version_check=False), pytest.raises(UserError) as e:
        storage.check_writable(f"abfs://{BUCKET}/run", "output.dir")
    said = str(e.value).split(" (", 1)[1]
    assert str(e.value).startswith(f"output.dir abfs://{BUCKET}/run: the store refused a test write (")
    assert said.startswith(("this Azurite does not know the API version pyarrow's Azure client speaks; start it with"
                            " --skipApiVersionCheck, or use a newer Azurite)",
                            "the container does not exist)")), said  # the latter: an Azurite that knows it


# -- the clients' configuration, from the places each cloud's own tools read -------------------------


def test_azure_clients_take_the_standard_variables(monkeypatch):
    for k in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_ACCOUNT_NAME",
              "AZURE_STORAGE_KEY", "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    options = store_clients.azure_options
    # an emulator's path-style BlobEndpoint serves pyarrow's blob and DFS clients both (Azurite has no DFS endpoint)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", "UseDevelopmentStorage=true")
    assert options(None, None) == {"account_name": AZURITE_ACCOUNT, "account_key": AZURITE_KEY,
                                   "blob_storage_scheme": "http", "blob_storage_authority": "127.0.0.1:10000",
                                   "dfs_storage_scheme": "http", "dfs_storage_authority": "127.0.0.1:10000"}
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", "DefaultEndpointsProtocol=https;AccountName=acct;"
                       "SharedAccessSignature=sv=2024&sig=abc%3D;EndpointSuffix=core.chinacloudapi.cn")
    assert options("acct", None) == {
        "account_name": "acct", "sas_token": "sv=2024&sig=abc%3D", "blob_storage_scheme": "https",
        "blob_storage_authority": ".blob.core.chinacloudapi.cn", "dfs_storage_scheme": "https",
        "dfs_storage_authority": ".dfs.core.chinacloudapi.cn"}
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", "AccountName=acct;AccountKey=k==;"
                       "BlobEndpoint=https://acct.blob.core.windows.net/")
    assert options(None, None)["dfs_storage_authority"] == ".dfs.core.windows.net"
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", "AccountName=acct;AccountKey=k==;"
                       "BlobEndpoint=https://files.example.com")
    with pytest.raises(UserError, match="custom domain") as e:
        options(None, None)
    assert "k==" not in str(e.value)
    # a SAS token in an error's URL never reaches a line
    said = store_errors.reason(OSError("GetProperties for 'https://acct.blob.core.windows.net/c/x?sv=2024&sig=SECRET%3D'"
                                   " failed"), "abfs://c/x")
    assert "SECRET" not in said and "sig=***" in said
    # a port that is not a number: one line here (the Azure SDK would abort the process with it)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", f"AccountName={AZURITE_ACCOUNT};AccountKey=k==;"
                       f"BlobEndpoint=http://127.0.0.1:10000x/{AZURITE_ACCOUNT}")
    with pytest.raises(UserError, match=r"BlobEndpoint is not an http\(s\)://host\[:port\] URL"):
        options(None, None)
    # az's variables, without a connection string; neither key nor token: pyarrow's DefaultAzureCredential
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING")
    with pytest.raises(UserError, match=r"^no storage account; name it in the URI"):
        options(None, None)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT", "acct")
    assert options(None, None) == {"account_name": "acct"}
    monkeypatch.setenv("AZURE_STORAGE_SAS_TOKEN", "?sv=1&sig=x")
    assert options("other", "core.usgovcloudapi.net") == {
        "account_name": "other", "sas_token": "sv=1&sig=x", "blob_storage_scheme": "https",
        "blob_storage_authority": ".blob.core.usgovcloudapi.net", "dfs_storage_scheme": "https",
        "dfs_storage_authority": ".dfs.core.usgovcloudapi.net"}
    monkeypatch.setenv("AZURE_STORAGE_KEY", "key==")
    assert options(None, None) == {"account_name": "acct", "account_key": "key=="}
    # the URI's forms: Hadoop's (container@account.dfs.<suffix>) and the short one (the account from the environment)
    parse = store_clients.azure_path
    assert parse("u", "runs@acct.dfs.core.windows.net/a/b") == store_clients.AzurePath("acct", "core.windows.net",
                                                                                       "runs/a/b")
    assert parse("u", "runs/a/b/") == store_clients.AzurePath(None, None, "runs/a/b")
    with pytest.raises(UserError, match="not an Azure storage URI"):
        parse("abfs://runs@host:10000/x", "runs@host:10000/x")


def test_gcs_client_goes_anonymous_to_the_emulator_named_by_storage_emulator_host(monkeypatch):
    seen = {}
    monkeypatch.setattr("pyarrow.fs.GcsFileSystem", lambda **kw: seen.update(kw))
    for name, value, expect in (("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9023", ("http", "127.0.0.1:9023")),
                                ("STORAGE_EMULATOR_HOST", "localhost:4443", ("http", "localhost:4443")),
                                ("CLOUD_STORAGE_EMULATOR_ENDPOINT", "https://gcs.internal", ("https", "gcs.internal"))):
        monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
        monkeypatch.delenv("CLOUD_STORAGE_EMULATOR_ENDPOINT", raising=False)
        monkeypatch.setenv(name, value)
        seen.clear()
        store_clients.gcs()
        assert seen["anonymous"] and (seen["scheme"], seen["endpoint_override"]) == expect
    monkeypatch.setenv("CLOUD_STORAGE_EMULATOR_ENDPOINT", "localhost:port")
    with pytest.raises(UserError, match=r"^CLOUD_STORAGE_EMULATOR_ENDPOINT is not an http\(s\)://host\[:port\] URL"):
        store_clients.gcs()
    monkeypatch.delenv("CLOUD_STORAGE_EMULATOR_ENDPOINT")
    seen.clear()
    store_clients.gcs()  # Application Default Credentials, pyarrow's own; its retries bounded
    assert set(seen) == {"retry_time_limit"} and seen["retry_time_limit"].total_seconds() == 2


# -- the whole run on the store, as a user runs it --------------------------------------------------


@pytest.fixture(scope="module")
def store_run(cloud, tmp_path_factory, tiny_model_dir):
    """`torchloom run` with its data (train, val and test files) and its run directory on the store: nothing shared
    but the store (tests/test_storage.py's store_run, smaller: 10 rows a class, local[1], one worker, one epoch)."""
    words = {"sport": "match goal team win league", "money": "bank market price shares profit",
             "music": "album song band concert guitar"}
    lines = ["body,topic"] + [f"{vocab} number {i} {' '.join(reversed(vocab.split()))},{label}"
                              for label, vocab in words.items() for i in range(10)]
    storage.write_bytes(uri(cloud, "input/reviews.csv"), ("\n".join(lines) + "\n").encode())
    for split in ("val", "test"):
        held_out = ["body,topic"] + [f"{vocab} {split} text {i},{label}" for label, vocab in words.items()
                                     for i in range(4)]
        storage.write_bytes(uri(cloud, f"input/{split}.csv"), ("\n".join(held_out) + "\n").encode())
    host_a = tmp_path_factory.mktemp(f"{cloud}-host-a")
    proc = torchloom("run", "--data.path", uri(cloud, "input/reviews.csv"), "--data.val_path",
                     uri(cloud, "input/val.csv"), "--data.test_path", uri(cloud, "input/test.csv"),
                     "--data.text_column", "body", "--data.label_column", "topic", "--model.path", tiny_model_dir,
                     "--output.dir", uri(cloud, "runs/reviews"), "--prepare.spark_master", "local[1]",
                     "--engine.workers", "1", "--train.epochs", "1", "--train.batch_size", "8", "--train.lr", "3e-3",
                     "--train.checkpoint_every", "2", "--train.keep_last", "1", "--tracking.enabled", "false",
                     cache=host_a)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, host_a


def test_run_on_the_store_leaves_the_whole_run_there(cloud, store_run):
    proc, host_a = store_run
    run = uri(cloud, "runs/reviews")
    on_store = storage.list_files(run)
    for name in ("config.toml", "data/manifest.json", "baseline.json", "metrics.jsonl", "train_result.json",
                 "model/config.json", "model/model.safetensors", "report.md", "report.json", "summary.json"):
        assert name in on_store, name
    steps = {n.split("/")[1] for n in on_store if n.startswith("checkpoints/")}
    assert 1 <= len(steps) <= 2 and all(f"checkpoints/{s}/meta.json" in on_store for s in steps)
    summary = json.loads(storage.read_bytes(f"{run}/summary.json"))
    assert summary["run_dir"] == run and summary["model_dir"] == f"{run}/model"
    assert summary["uploads"]["checkpoints_uploaded"] >= 1
    manifest = json.loads(storage.read_bytes(f"{run}/data/manifest.json"))
    assert manifest["inputs"]["path"] == uri(cloud, "input/reviews.csv")
    assert manifest["splits"]["train"]["rows"] == 30 and manifest["splits"]["val"]["rows"] == 12
    assert re.search(rf"export: step-\d+ -> {re.escape(run)}/model\n", proc.stderr), proc.stderr[-3000:]
    # no credential in any line or in the run's files: the key (Azurite's) and the connection string stay in the env
    written = proc.stdout + proc.stderr + storage.read_bytes(f"{run}/config.toml").decode()
    assert AZURITE_KEY not in written and "AccountKey" not in written and str(host_a) not in proc.stderr


def test_another_host_predicts_and_resumes_from_the_store_alone(cloud, store_run, tmp_path):
    proc, host_a = store_run
    run = uri(cloud, "runs/reviews")
    text = "match goal team win league"
    remote = torchloom("predict", "--model", f"{run}/model", text, cache=tmp_path / "host-b")  # an empty cache
    assert remote.returncode == 0, remote.stderr[-2000:]
    assert json.loads(remote.stdout.splitlines()[0])["label"] in ("sport", "money", "music"), remote.stdout
    # what it answered with is the store's model, fetched into that host's cache (the files of the run's model)
    fetched = next((tmp_path / "host-b").glob("models/*/model.safetensors")).parent
    staged = next(p for p in (host_a / "staging").iterdir() if p.is_dir()) / "model"
    files = [p for p in staged.rglob("*") if p.is_file()]
    assert files and all((fetched / p.relative_to(staged)).read_bytes() == p.read_bytes() for p in files)
    # resume on a third host: data and the newest complete checkpoint come from the store
    resumed = torchloom("train", "--output.dir", run, "--train.resume", "latest", "--train.epochs", "2",
                        "--engine.workers", "1", "--tracking.enabled", "false", "--train.batch_size", "8",
                        cache=tmp_path / "host-d")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    result = json.loads(storage.read_bytes(f"{run}/train_result.json"))
    assert result["resumed_at_step"] and result["steps"] > result["resumed_at_step"]
