"""A real S3-compatible server (moto's server mode) on 127.0.0.1 for the tests.

raymt reaches it exactly as it reaches AWS: pyarrow's S3FileSystem, pointed at it by
AWS_ENDPOINT_URL and credentials in the environment. The session's Ray head starts with
them (ENV, on a port chosen before any Ray starts), so its workers reach the bucket as
the tests' drivers do. Nothing is patched.
"""

import os
import socket

import pytest

BUCKET = "raymt-test"


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on (now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PORT = free_port()  # the server's, known before it starts: the Ray head's env points at it
ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_ENDPOINT_URL": f"http://127.0.0.1:{PORT}",
}


@pytest.fixture(scope="session")
def s3_bucket():
    """s3://BUCKET on a moto server started for this session; AWS_* variables set meanwhile."""
    server_module = pytest.importorskip("moto.server", reason="pip install 'moto[server]' (the test extra)")
    import pyarrow.fs as pafs

    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=PORT, verbose=False)
    server.start()
    saved = {k: os.environ.get(k) for k in ENV}
    os.environ.update(ENV)
    fs = pafs.S3FileSystem(endpoint_override=ENV["AWS_ENDPOINT_URL"], allow_bucket_creation=True)
    fs.create_dir(BUCKET)
    try:
        yield f"s3://{BUCKET}"
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stop()
