"""Scripts the namespace cluster tests run on the store's host (python -c SCRIPT ENDPOINT BUCKET ...)."""

# Make the bucket (argv[1] the endpoint, argv[2] the bucket); what follows it uses argv[3:].
BUCKET = """
import sys
from pyarrow import fs
from torchloom.store import storage
fs.S3FileSystem(endpoint_override=sys.argv[1], scheme="http", allow_bucket_creation=True,
                region="us-east-1").create_dir(sys.argv[2])
"""


def with_bucket(then: str) -> str:
    """The bucket made, then `then` (a line using `storage` and sys.argv[3:])."""
    return BUCKET + then + "\n"
