"""The pyarrow client of each kind of object store, configured from the places that cloud's own tools read.

store/storage.py asks here for the pyarrow file system of a URI's store; nothing here is written anywhere, and no
error line carries a key (the one-line errors name the variables, never their values).

- s3://   pyarrow's S3 client reads AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, a profile,
          an instance role; the endpoint of an S3-compatible store is AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3),
          as for the AWS SDKs and CLI.
- gs://   Application Default Credentials, read by pyarrow's GCS client itself: GOOGLE_APPLICATION_CREDENTIALS,
          `gcloud auth application-default login`, the VM's service account. STORAGE_EMULATOR_HOST (what
          google-cloud-storage and gsutil's successors read; CLOUD_STORAGE_EMULATOR_ENDPOINT, google-cloud-cpp's
          own name, too) points at an emulator such as gcp-storage-emulator: then anonymous, as those libraries
          do (google-cloud-cpp alone would still ask the metadata server for a token).
- abfs:// AZURE_STORAGE_CONNECTION_STRING (what az and every Azure SDK read: AccountName, AccountKey or
          SharedAccessSignature, BlobEndpoint or DefaultEndpointsProtocol + EndpointSuffix, or
          UseDevelopmentStorage=true); else AZURE_STORAGE_ACCOUNT with AZURE_STORAGE_KEY or AZURE_STORAGE_SAS_TOKEN
          (az's names; AZURE_STORAGE_ACCOUNT_NAME / AZURE_STORAGE_ACCOUNT_KEY, adlfs's, too); else pyarrow's
          DefaultAzureCredential (AZURE_CLIENT_ID + AZURE_TENANT_ID + AZURE_CLIENT_SECRET, a workload or managed
          identity, `az login`). URIs: abfs[s]://CONTAINER@ACCOUNT.dfs.core.windows.net/path (Hadoop's, Databricks')
          or abfs://CONTAINER/path (az://CONTAINER/path) with the account from the environment.

The emulators' limits (docs/engines.md, "On a cloud cluster"): pyarrow's Azure client asks the account's Data Lake
(DFS) endpoint whether the account has a hierarchical namespace before its first write, listing or delete; Azurite
has no DFS endpoint, so a path-style BlobEndpoint (an emulator's, `http://host:port/account`) is given to both
of pyarrow's clients, and Azurite's answer there (404) reads as a flat namespace. Azurite also refuses API
versions newer than it knows, which pyarrow's Azure SDK may send: `reason` in store/errors.py says so in one line.
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass
from urllib.parse import urlsplit

from torchloom.errors import UserError
from torchloom.uri import has_scheme

LOCAL_STORE = "file+store"

# The schemes pyarrow.fs opens (hdfs:// and viewfs:// where libhdfs is installed).
# file+store:///path is a local directory used as a store (pyarrow's local file system): for a file system every
# host mounts where each host should still work in a staging copy, and for the tests of the staging path.
SCHEMES = {"s3": "s3", "s3a": "s3", "gs": "gs", "gcs": "gs", "abfs": "abfs", "abfss": "abfs", "az": "abfs",
           "hdfs": "hdfs", "viewfs": "viewfs", LOCAL_STORE: LOCAL_STORE}

# What each error line tells a user to check, by the scheme store/storage.py canonicalised the URI to.
CREDENTIALS = {
    "s3": "the credentials (AWS_ACCESS_KEY_ID / a profile / an instance role) and AWS_ENDPOINT_URL",
    "gs": "the credentials (GOOGLE_APPLICATION_CREDENTIALS / gcloud auth application-default login / the VM's"
          " service account) and STORAGE_EMULATOR_HOST",
    "abfs": "the credentials (AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT with AZURE_STORAGE_KEY or"
            " AZURE_STORAGE_SAS_TOKEN, or az login / a managed identity)",
}
ENDPOINTS = {"s3": "AWS_ENDPOINT_URL", "gs": "STORAGE_EMULATOR_HOST",
             "abfs": "the BlobEndpoint of AZURE_STORAGE_CONNECTION_STRING"}

# How long pyarrow's GCS client retries a failing request itself (its default: 15 minutes, during which a
# store that does not answer holds the caller). store_errors.attempts retries on top, within its own window.
GCS_CLIENT_RETRY_S = 2.0

# The errors of the GCS and Azure clients that a user fixes, in words (store_errors.reason; S3's are there).
REASONS = (
    ("Could not create a OAuth2 access token", "no Google credentials here: set GOOGLE_APPLICATION_CREDENTIALS, run"
     " gcloud auth application-default login, or run on a VM with a service account (an emulator: set"
     " STORAGE_EMULATOR_HOST)"),
    ("PERMISSION_DENIED", "access denied: the credentials may not use this bucket or prefix"),
    ("UNAUTHENTICATED", "the store does not accept the credentials"),
    ("ContainerNotFound", "the container does not exist"),
    ("AuthenticationFailed", "the store does not accept the account key or SAS token"),
    ("AuthorizationPermissionMismatch", "access denied: the credentials may not use this container or prefix"),
    ("AuthorizationFailure", "access denied: the credentials may not use this container or prefix"),
    ("is not supported by Azurite", "this Azurite does not know the API version pyarrow's Azure client speaks;"
     " start it with --skipApiVersionCheck, or use a newer Azurite"),
)
# Nobody at the endpoint (curl's words in the GCS client, the Azure SDK's): transient, like S3's.
UNANSWERED = ("Could not connect to server", "Fail to get a new connection")
# Never transient, whatever else the message says (a token that cannot be had is not had a moment later).
NOT_TRANSIENT = ("OAuth2 access token", "is not supported by Azurite")

AZURE_SUFFIX = "core.windows.net"
# UseDevelopmentStorage=true means Azurite's (and the old storage emulator's) published account and key.
DEV_ACCOUNT = "devstoreaccount1"
DEV_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="  # public
DEV_BLOB = "http://127.0.0.1:10000/devstoreaccount1"
CONNECTION_ENV = "AZURE_STORAGE_CONNECTION_STRING"


def s3():
    from pyarrow import fs as pafs

    # A plain http:// endpoint (moto, MinIO) needs the scheme said explicitly.
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    options = {}
    if endpoint:
        options["endpoint_override"] = endpoint
        options["scheme"] = "http" if endpoint.startswith("http://") else "https"
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        options["region"] = region
    return pafs.S3FileSystem(**options)


def gcs_emulator():
    """The GCS emulator's URL the environment names (STORAGE_EMULATOR_HOST, CLOUD_STORAGE_EMULATOR_ENDPOINT), or
    None."""
    name = "STORAGE_EMULATOR_HOST" if os.environ.get("STORAGE_EMULATOR_HOST") else "CLOUD_STORAGE_EMULATOR_ENDPOINT"
    emulator = os.environ.get(name)
    if not emulator:
        return None
    return _url(emulator if has_scheme(emulator) else f"http://{emulator}", name, "http://127.0.0.1:9023")


def gcs():
    from pyarrow import fs as pafs

    options = {"retry_time_limit": datetime.timedelta(seconds=GCS_CLIENT_RETRY_S)}
    url = gcs_emulator()
    if url:
        options.update(anonymous=True, scheme=url.scheme, endpoint_override=url.netloc)
    return pafs.GcsFileSystem(**options)


def delta_gcs_options() -> dict[str, str]:
    """delta-rs's options for a gs:// table. Its Google client reads Application Default Credentials itself, but
    not an emulator's variable: an emulator is given to it as object_store's own testing key (a service account
    whose `gcs_base_url` is the emulator, without OAuth). Its client speaks GCS's XML API (fake-gcs-server serves
    it; gcp-storage-emulator does not)."""
    url = gcs_emulator()
    if not url:
        return {}
    key = {"gcs_base_url": f"{url.scheme}://{url.netloc}", "disable_oauth": True, "client_email": "",
           "private_key": "", "private_key_id": ""}
    return {"google_service_account_key": json.dumps(key), **({"allow_http": "true"} if url.scheme == "http" else {})}


def _url(text: str, name: str, example: str):
    """An endpoint's URL, checked here: the clients below abort the process on a malformed one (the Azure SDK
    throws std::invalid_argument past pyarrow for a port that is not a number)."""
    url = urlsplit(text)
    try:
        port_ok = url.port is None or 0 < url.port < 65536
    except ValueError:
        port_ok = False
    if url.scheme not in ("http", "https") or not url.hostname or not port_ok or "@" in url.netloc:
        raise UserError(f"{name} is not an http(s)://host[:port] URL; give e.g. {example}")
    return url


# -- Azure --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AzurePath:
    """An abfs:// URI's parts: the account and endpoint suffix it names (None: from the environment), and the
    path inside pyarrow's Azure file system (`container/prefix`)."""

    account: str | None
    suffix: str | None
    path: str


def azure_path(shown: str, rest: str) -> AzurePath:
    """`rest` is the URI without its scheme; `shown` the URI as an error line may name it."""
    head, _, tail = rest.partition("/")
    account = suffix = None
    container = head
    if "@" in head:
        container, host = head.split("@", 1)
        account, _, domain = host.partition(".")
        service, _, suffix = domain.partition(".")
        if not account or service not in ("dfs", "blob") or not suffix:
            raise UserError(f"{shown}: not an Azure storage URI; use abfs://CONTAINER@ACCOUNT.dfs.core.windows.net/path"
                            " or abfs://CONTAINER/path with the account in AZURE_STORAGE_CONNECTION_STRING or"
                            " AZURE_STORAGE_ACCOUNT")
    if not container:
        raise UserError(f"{shown}: no container in the URI; use abfs://CONTAINER/path or"
                        " abfs://CONTAINER@ACCOUNT.dfs.core.windows.net/path")
    return AzurePath(account, suffix, "/".join(p for p in (container, tail.strip("/")) if p))


def connection_string(text: str) -> dict[str, str]:
    """An Azure storage connection string's fields, by lower-cased name (`AccountKey=...==` keeps its `=`s)."""
    fields = {}
    for part in text.split(";"):
        name, sep, value = part.partition("=")
        if sep and name.strip():
            fields[name.strip().lower()] = value.strip()
    return fields


def _endpoint_options(blob_endpoint: str, account: str) -> dict[str, str]:
    """pyarrow's blob and DFS endpoints from a BlobEndpoint URL. A path-style one (`http://host:port/ACCOUNT`,
    an emulator's) serves both: Azurite has no Data Lake endpoint (see the module's docstring)."""
    url = _url(blob_endpoint, f"{CONNECTION_ENV}: BlobEndpoint", f"https://ACCOUNT.blob.{AZURE_SUFFIX}")
    if url.path.strip("/") == account:
        return {"blob_storage_scheme": url.scheme, "blob_storage_authority": url.netloc,
                "dfs_storage_scheme": url.scheme, "dfs_storage_authority": url.netloc}
    if url.netloc.startswith(f"{account}.blob.") and url.path.strip("/") == "":
        authority = url.netloc[len(account):]
        return {"blob_storage_scheme": url.scheme, "blob_storage_authority": authority,
                "dfs_storage_scheme": url.scheme, "dfs_storage_authority": authority.replace(".blob.", ".dfs.", 1)}
    raise UserError(f"{CONNECTION_ENV}: BlobEndpoint names neither ACCOUNT.blob.<suffix> nor host:port/ACCOUNT"
                    f" (a custom domain, which pyarrow's Azure client cannot address); give the account's own endpoint")


def _suffix_options(scheme: str, suffix: str) -> dict[str, str]:
    if scheme == "https" and suffix == AZURE_SUFFIX:
        return {}  # pyarrow's defaults
    return {"blob_storage_scheme": scheme, "blob_storage_authority": f".blob.{suffix}",
            "dfs_storage_scheme": scheme, "dfs_storage_authority": f".dfs.{suffix}"}


def _from_connection_string(text: str, account: str | None) -> dict[str, str]:
    fields = connection_string(text)
    if fields.get("usedevelopmentstorage", "").lower() == "true":
        proxy = fields.get("developmentstorageproxyuri", "").rstrip("/")
        fields = {"accountname": DEV_ACCOUNT, "accountkey": DEV_KEY,
                  "blobendpoint": f"{proxy}:10000/{DEV_ACCOUNT}" if proxy else DEV_BLOB}
    named = fields.get("accountname")
    if not named:
        raise UserError(f"{CONNECTION_ENV}: no AccountName in it; copy the account's connection string whole")
    if account and account != named:
        raise UserError(f"the URI names storage account {account}, but {CONNECTION_ENV} is for account {named};"
                        " use that account's connection string, or name its account in the URI")
    options = {"account_name": named}
    if fields.get("accountkey"):
        options["account_key"] = fields["accountkey"]
    elif fields.get("sharedaccesssignature"):
        options["sas_token"] = fields["sharedaccesssignature"]
    if fields.get("blobendpoint"):
        return {**options, **_endpoint_options(fields["blobendpoint"], named)}
    return {**options, **_suffix_options(fields.get("defaultendpointsprotocol", "https").lower(),
                                         fields.get("endpointsuffix", AZURE_SUFFIX))}


def azure_options(account: str | None, suffix: str | None) -> dict[str, str]:
    """pyarrow.fs.AzureFileSystem's arguments for the account a URI names (None: the environment's)."""
    if os.environ.get(CONNECTION_ENV):
        return _from_connection_string(os.environ[CONNECTION_ENV], account)
    account = account or os.environ.get("AZURE_STORAGE_ACCOUNT") or os.environ.get("AZURE_STORAGE_ACCOUNT_NAME")
    if not account:
        raise UserError("no storage account; name it in the URI (abfs://CONTAINER@ACCOUNT.dfs.core.windows.net/path)"
                        f" or set AZURE_STORAGE_ACCOUNT (or {CONNECTION_ENV})")
    options = {"account_name": account, **_suffix_options("https", suffix or AZURE_SUFFIX)}
    key = os.environ.get("AZURE_STORAGE_KEY") or os.environ.get("AZURE_STORAGE_ACCOUNT_KEY")
    sas = os.environ.get("AZURE_STORAGE_SAS_TOKEN")
    if key:
        options["account_key"] = key
    elif sas:
        options["sas_token"] = sas.lstrip("?")
    return options  # neither: pyarrow's DefaultAzureCredential


def azure(account: str | None, suffix: str | None):
    from pyarrow import fs as pafs

    return pafs.AzureFileSystem(**azure_options(account, suffix))


def delta_azure_options(path: str, shown: str) -> dict[str, str]:
    """delta-rs's options for an abfs:// table from the variables every other abfs:// input reads
    (azure_options: AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT with a key or a SAS token): delta-rs
    reads only its own names otherwise, and an emulator's endpoint not at all. `shown`: the URI as a line names it."""
    parts = azure_path(shown, path.split("://", 1)[1])
    given = azure_options(parts.account, parts.suffix)
    options = {"azure_storage_account_name": given["account_name"]}
    if "account_key" in given:
        options["azure_storage_account_key"] = given["account_key"]
    elif "sas_token" in given:
        options["azure_storage_sas_key"] = given["sas_token"]
    scheme, authority = given.get("blob_storage_scheme"), given.get("blob_storage_authority")
    if authority:  # an emulator's host:port (path-style: the account in the path), or another cloud's suffix
        host = authority if not authority.startswith(".") else given["account_name"] + authority
        path_style = not authority.startswith(".")
        options["azure_storage_endpoint"] = f"{scheme}://{host}" + (f"/{given['account_name']}" if path_style else "")
        if scheme == "http":
            options["allow_http"] = "true"
    return options
