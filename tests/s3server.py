"""A real S3-compatible server on 127.0.0.1 for tests and benchmarks: moto's HTTP server in a thread of
this process, reached by the real clients (s3fs over aiobotocore, boto) through the standard AWS
environment variables, which subprocesses (launchers, workers, pool processes) inherit."""
from __future__ import annotations

import logging
import os

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "phalanx-test", "AWS_SECRET_ACCESS_KEY": "phalanx-test",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


class S3Server:
    """`with S3Server() as s3:` starts the server and points this process's environment at it."""

    def __init__(self):
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.saved: dict[str, str | None] = {}

    def __enter__(self) -> S3Server:
        self.server.start()
        self.endpoint = f"http://127.0.0.1:{self.server.get_host_and_port()[1]}"
        self.env = {"AWS_ENDPOINT_URL": self.endpoint, **CREDENTIALS}
        self.saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()  # fsspec keeps clients by arguments: not one of an earlier server
        self.fs = s3fs.S3FileSystem(endpoint_url=self.endpoint, skip_instance_cache=True)  # the tests' own client
        return self

    def __exit__(self, *exc) -> None:
        for key, value in self.saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self.server.stop()
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()  # its clients would reach a closed port (the next module's server)

    def bucket(self, name: str) -> str:
        """A new bucket; its URL."""
        self.fs.mkdir(name)
        return f"s3://{name}"

    def put(self, url: str, data: bytes) -> str:
        self.fs.pipe_file(url, data)
        return url
