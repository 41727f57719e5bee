"""``swarmloco data serve``: an HTTP mirror of a prepared dataset, for runs whose manifest
names it (``--dataset-mirror``). It serves the dataset's own files only (``index.json``,
``tokenizer.json``, ``shard-NNNNN.bin``), read-only, nothing else of the directory: no
listing, no other path. A static file server (nginx, a bucket) does as well."""

from __future__ import annotations

import contextlib
import http.server
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

from swarmloco.dataset.index import INDEX, TOKENIZER, read_index

_NAMES = re.compile(rf"^/({re.escape(INDEX)}|{re.escape(TOKENIZER)}|shard-\d{{5,}}\.bin)$")


def _handler(directory: Path) -> type[http.server.BaseHTTPRequestHandler]:
    class Files(http.server.BaseHTTPRequestHandler):
        server_version = "swarmloco-dataset"

        def do_GET(self) -> None:
            match = _NAMES.match(self.path.split("?", 1)[0])
            path = directory / match.group(1) if match else None
            if path is None or not path.is_file():
                self.send_error(404, "not a file of this dataset")
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(path.stat().st_size))
            self.end_headers()
            with path.open("rb") as f, contextlib.suppress(ConnectionError):
                shutil.copyfileobj(f, self.wfile)

        def log_message(self, format: str, *args: object) -> None:
            pass  # one line per shard fetched is noise in a peer's log

    return Files


@contextlib.contextmanager
def serve_dataset(directory: Path, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve the dataset in ``directory`` (its index checked first) on ``host:port`` (0:
    any free port) until the block ends; yields its base URL."""
    read_index(directory)
    server = http.server.ThreadingHTTPServer((host, port), _handler(directory))
    thread = threading.Thread(target=server.serve_forever, name="swarmloco-mirror", daemon=True)
    thread.start()
    try:
        name = f"[{host}]" if ":" in host else host
        yield f"http://{name}:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join()
        server.server_close()
