"""In-memory fakes of the run's state store and bucket, for the service layer's unit tests (no AWS, no moto).

`FakeBucket` is the real `store.blobs.Bucket` over an in-memory S3 client, `FakeStateStore` the real
`store.table.StateStore` over an in-memory table: only what AWS does is faked, every decision the store and bucket
make is their own. tests/functional/test_fakes_contract.py runs the same assertions against them and against moto.
"""

from tests.fakes.bucket import FakeBucket, FakeS3
from tests.fakes.deps import fake_deps
from tests.fakes.store import FakeStateStore

__all__ = ["FakeBucket", "FakeS3", "FakeStateStore", "fake_deps"]
