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
