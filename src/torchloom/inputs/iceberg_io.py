"""An Iceberg table's files on gs:// and abfs:// read through torchloom's store clients (store/clients.py).

pyiceberg opens those stores itself from `gcs.*` and `adls.*` catalog properties only: not from the variables
every other input on the same store is read with (STORAGE_EMULATOR_HOST, AZURE_STORAGE_CONNECTION_STRING,
AZURE_STORAGE_ACCOUNT with a key, ...), and its Azure paths keep the `container@account...` authority that pyarrow's
Azure client does not take. StoreFileIO is pyiceberg's pyarrow FileIO with those two stores given by
store/storage.resolve, unless the catalog's settings configure that store for pyiceberg themselves (any `gcs.` or
`adls.` key): then pyiceberg's own client, as written. S3 and local files are pyiceberg's, unchanged (the S3
endpoint and region reach it as catalog settings, inputs/tables.py).

The FileIO travels with the scan's plan to Spark's tasks (pickled without its clients, opened again there).
"""

from __future__ import annotations

from urllib.parse import urlparse

from pyiceberg.io.pyarrow import PyArrowFileIO

from torchloom.store import storage

# the scheme as pyiceberg names it -> the prefix of the catalog settings that configure it for pyiceberg
OURS = {"gs": "gcs.", "gcs": "gcs.", "abfs": "adls.", "abfss": "adls.", "wasb": "adls.", "wasbs": "adls."}


def _ours(scheme: str, properties) -> bool:
    prefix = OURS.get(scheme)
    return prefix is not None and not any(str(k).startswith(prefix) for k in properties)


def _store_uri(scheme: str, netloc: str, path: str = "") -> str:
    return f"{'gs' if scheme in ('gs', 'gcs') else 'abfs'}://{netloc}/{path.lstrip('/')}"


class StoreFileIO(PyArrowFileIO):
    @staticmethod
    def parse_location(location: str, properties=None) -> tuple[str, str, str]:
        properties = properties or {}
        uri = urlparse(location)
        scheme = uri.scheme.lower()
        if not _ours(scheme, properties):
            return PyArrowFileIO.parse_location(location, properties)
        _, path = storage.resolve(_store_uri(scheme, uri.netloc, uri.path))
        return scheme, uri.netloc, path

    def _initialize_fs(self, scheme: str, netloc: str | None = None):
        if not _ours(scheme, self.properties):
            return super()._initialize_fs(scheme, netloc)
        return storage.resolve(_store_uri(scheme, netloc or ""))[0]
