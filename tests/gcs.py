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
