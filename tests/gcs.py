"""The GCS emulator of the `gcs_emulator` fixture (conftest.py), through its JSON API with
the standard library only: the tests read what the trainer wrote without the trainer's
own storage code."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request


def create_bucket(url: str, name: str) -> None:
  request = urllib.request.Request(
      f"{url}/storage/v1/b?project=test", data=json.dumps({"name": name}).encode(),
      headers={"Content-Type": "application/json"}, method="POST")
  urllib.request.urlopen(request, timeout=10).close()


def objects(url: str, bucket: str, prefix: str = "") -> list[str]:
  """The names of the objects in `bucket` under `prefix`, sorted."""
  names, token = [], ""
  while True:
    query = urllib.parse.urlencode({"prefix": prefix, "pageToken": token})
    with urllib.request.urlopen(f"{url}/storage/v1/b/{bucket}/o?{query}", timeout=10) as r:
      page = json.load(r)
    names += [item["name"] for item in page.get("items", [])]
    token = page.get("nextPageToken", "")
    if not token:
      return sorted(names)


def read(url: str, bucket: str, name: str) -> bytes:
  """Object `name`'s bytes."""
  quoted = urllib.parse.quote(name, safe="")
  with urllib.request.urlopen(f"{url}/storage/v1/b/{bucket}/o/{quoted}?alt=media",
                              timeout=10) as r:
    return r.read()


def write(url: str, bucket: str, name: str, data: bytes) -> None:
  """Uploads `data` as object `name` (replacing one of that name)."""
  query = urllib.parse.urlencode({"uploadType": "media", "name": name})
  request = urllib.request.Request(f"{url}/upload/storage/v1/b/{bucket}/o?{query}", data=data,
                                   headers={"Content-Type": "application/octet-stream"},
                                   method="POST")
  urllib.request.urlopen(request, timeout=30).close()


def upload_dir(url: str, bucket: str, local, prefix: str) -> None:
  """Uploads every file under local directory `local` (a `pathlib.Path`) as
  `prefix/<its path below local>`."""
  for file in sorted(local.rglob("*")):
    if file.is_file():
      write(url, bucket, f"{prefix}/{file.relative_to(local).as_posix()}", file.read_bytes())


def delete(url: str, bucket: str, name: str) -> None:
  """Deletes object `name`."""
  quoted = urllib.parse.quote(name, safe="")
  request = urllib.request.Request(f"{url}/storage/v1/b/{bucket}/o/{quoted}", method="DELETE")
  urllib.request.urlopen(request, timeout=10).close()


def metrics(url: str, bucket: str, run: str) -> list[dict]:
  """The lines of run `run`'s metrics.jsonl (`run` the path in `bucket`), in file order."""
  return [json.loads(line) for line in read(url, bucket, f"{run}/metrics.jsonl").splitlines()]


def losses(url: str, bucket: str, run: str, key="loss") -> dict[int, float]:
  """step -> `key` of the step's last line in run `run`'s metrics.jsonl."""
  return {r["step"]: r[key] for r in metrics(url, bucket, run) if key in r}


def checkpoints(url: str, bucket: str, run: str) -> list[int]:
  """Steps of run `run` whose checkpoint is complete (on a bucket orbax marks it
  commit_success.txt)."""
  names = objects(url, bucket, f"{run}/checkpoints/")
  depth = run.count("/") + 3
  return sorted(int(n.split("/")[depth - 1]) for n in names
                if n.endswith("/commit_success.txt") and n.count("/") == depth)


class Proxy:
  """An HTTP proxy on loopback in front of the emulator at `url`, as a bucket looks to
  credentials of a narrower role: it answers 403 to each request for which `refused(method,
  path)` is true (`path` with its query) and passes the others through. A context manager;
  `address` is `host:port`, for `STORAGE_EMULATOR_HOST` (with or without `http://`).
  `refusals` lists the requests it refused."""

  def __init__(self, url: str, refused):
    import http.server
    import threading

    target = urllib.parse.urlsplit(url)
    proxy = self
    self.refusals: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
      protocol_version = "HTTP/1.1"  # clients keep their connections, as with GCS

      def _forward(self):
        body = self._body()
        if refused(self.command, self.path):
          proxy.refusals.append(f"{self.command} {self.path}")
          self._answer(403, {"Content-Type": "application/json"}, json.dumps({"error": {
              "code": 403, "message": "the caller does not have permission"}}).encode())
          return
        import http.client
        conn = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
        headers = {k: v for k, v in self.headers.items()
                   if k.lower() not in ("host", "transfer-encoding", "content-length")}
        conn.request(self.command, self.path, body=body, headers=headers)
        reply = conn.getresponse()
        data = reply.read()
        conn.close()
        # A resumable upload's session URL names the emulator: the proxy instead.
        self._answer(reply.status, {k: v.replace(url, f"http://{proxy.address}")
                                    for k, v in reply.getheaders() if k.lower() not in (
                                        "transfer-encoding", "content-length", "connection")},
                     data)

      def _body(self) -> bytes | None:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
          chunks = []
          while size := int(self.rfile.readline().split(b";")[0], 16):
            chunks.append(self.rfile.read(size))
            self.rfile.readline()
          while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
            pass
          return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else None

      def _answer(self, status: int, headers: dict, data: bytes) -> None:
        self.send_response(status)
        for k, v in headers.items():
          self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
          self.wfile.write(data)

      def handle(self):
        try:
          super().handle()
        except ConnectionError:  # a client that gave up on a request: gcsfs asks two ways
          pass  # at once and drops the slower

      do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _forward

      def log_message(self, *args):
        pass

    self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self._server.daemon_threads = True
    self.address = f"127.0.0.1:{self._server.server_address[1]}"
    self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

  def __enter__(self) -> Proxy:
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._server.shutdown()
    self._server.server_close()
