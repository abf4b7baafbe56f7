"""Where a run's files live: a local directory or a Google Cloud Storage bucket
(`gs://BUCKET/PATH`), through one path type, etils' `epath.Path` (the one orbax uses), so
that the trainer, `train.export`, `train.sample` and `train.compile` read and write both
alike and no code sees a `pathlib.Path` of a URL (which would be a local directory named
`gs:`).

  p = storage.path(cfg.run_dir) / "config.json"   # epath.Path, local or gs://
  storage.write_atomic(p, text)

What a bucket lacks, these calls provide: an atomic replace (an object upload is whole or
absent, so a bucket needs no temporary file), an append (`append`: the new bytes as an
object, composed onto the end server-side), and a move (`move`: copies, then deletes);
readers and writers of local files only (safetensors) get a local copy (`local_dir`,
`upload`). For readers of many small parts of large files (a corpus's records), `files`
lists a directory tree and `read_range` reads a byte range in one request, where a file
object of gcsfs would also read ahead megabytes that a random read never uses.

A bucket goes through gcsfs (etils' backend for `gs://`; the `train` extra installs it)
and orbax's TensorStore. `check` refuses, before anything is written and within about 30
s, a location the clients would read differently (see `path`), a machine without Google
Cloud credentials, an endpoint that does not answer, a bucket that does not exist or may
not be listed, and (for a location the run writes) one that may not be written. A
listing is never cached (`ls` asks the bucket each time): TensorStore, the other processes
of a job and etils' own gcsfs instance write beside it. A folder's placeholder object (a
zero-byte `name/`, as the Cloud console's "create folder" makes) is neither a file nor an
entry of its folder (`iterdir`, `files`).

A request that gets no byte for `REQUEST_TIMEOUT_S` fails and is retried by its client
(gcsfs sets no timeout itself; TensorStore gets the values JAX sets on Cloud TPU VMs), so no
call waits forever on an endpoint that accepts connections and never answers.

The GCS emulator: `STORAGE_EMULATOR_HOST` (the standard variable, `host:port` or a URL) is
all a user sets. The first use of a `gs://` path rewrites it as a URL (google-cloud-storage,
which orbax uses, takes it as one) and derives from it what the other clients need, where
the user has not set them: `TENSORSTORE_GCS_HTTP_URL`, a placeholder token for TensorStore
(`GOOGLE_AUTH_TOKEN_FOR_TESTING`; an emulator checks none) and gcsfs's anonymous access.
gcsfs's experimental zonal-bucket support (`GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT`) is off
unless set: it asks a gRPC control API about every bucket, which an emulator does not
serve (a minute's timeout per bucket) and a standard bucket does not need.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import re
import shutil
import socket
import tempfile
import urllib.parse
import uuid

from etils import epath

from train.config import ConfigError

log = logging.getLogger(__name__)

SCHEMES = ("gs",)
# Storage schemes (fsspec's names) that a location is taken to mean where it starts with one
# and a colon without "//" after it (`gs:/bucket/run`, `gs:bucket`): else a local directory
# named `gs:` would take the run.
_URL_SCHEMES = SCHEMES + ("gcs", "s3", "s3a", "az", "abfs", "abfss", "hf", "http", "https",
                          "file")
# Characters of a path that a client reads differently from the others: urllib's URL parsing,
# through which orbax passes a checkpoint's path to TensorStore, ends the path at "#" or "?"
# and drops tabs and newlines; fsspec's glob, recursive copy and delete read "*", "?", "["
# and "]" as wildcards. Two run_dirs could share objects either way.
_UNSAFE = re.compile(r"[#?*\[\]\x00-\x1f\x7f]")
_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]")  # GCS's bucket names
_PUBLIC_ENDPOINT = "https://storage.googleapis.com"
_CONNECT_TIMEOUT_S = 10.0
REQUEST_TIMEOUT_S = 60  # a request that gets no byte for this long fails (and is retried)
_CHECK_TIMEOUT_S = 20.0  # each request of `check`
_configured = False


def is_url(location: str) -> bool:
  """Whether `location` is a URL (`scheme://...`) rather than a local path."""
  return "://" in location


def path(location: str) -> epath.Path:
  """`location` (a local path or a `gs://` URL) as an `epath.Path`; a local one is made
  absolute.

  Raises:
    ConfigError: a location that `check` refuses by its form alone: a URL whose scheme is not
      in `SCHEMES`, a malformed URL (also one missing its "//", as `gs:/bucket/run`), or a
      path with characters the clients read differently.
  """
  _check_form(location, "path")
  if not is_url(location):
    return epath.Path(os.path.abspath(location))
  _configure_gcs()
  return epath.Path(location)


def _check_form(location: str, key: str) -> None:
  """Refuses, naming `key`, a `location` that is neither a local path nor a gs://BUCKET/PATH
  URL that every client reads as the same objects."""
  if not is_url(location):
    head = re.match(r"([A-Za-z][A-Za-z0-9+.-]*):", location)
    if head and head.group(1).lower() in _URL_SCHEMES:
      raise ConfigError(
          f"{key} expects a local path or a gs://BUCKET/PATH URL, got {location!r}, a URL"
          f" without '//' after {head.group(0)!r} (it would be a local directory named"
          f" {head.group(0)!r}); write gs://BUCKET/PATH.")
    return
  scheme, rest = location.split("://", 1)
  if scheme not in SCHEMES:
    case = (f" (scheme names are lowercase: {scheme.lower()}://)"
            if scheme.lower() in SCHEMES else "")
    raise ConfigError(f"{key} expects a local path or a gs://BUCKET/PATH URL, got {location!r}"
                      f" (scheme {scheme!r}){case}; the trainer's storage speaks "
                      + ", ".join(f"{s}://" for s in SCHEMES) + " only: pass a gs:// URL or a"
                      " local path.")
  bucket, _, name = rest.partition("/")
  if not bucket:
    raise ConfigError(f"{key} expects gs://BUCKET/PATH, got {location!r} without a bucket.")
  if not _BUCKET.fullmatch(bucket):
    raise ConfigError(f"{key} expects gs://BUCKET/PATH with a bucket name of lowercase letters,"
                      f" digits, '-', '_' and '.' (first and last a letter or digit), got"
                      f" {location!r} (bucket {bucket!r}); fix the name.")
  if unsafe := sorted(set(_UNSAFE.findall(name))):
    raise ConfigError(
        f"{key} expects a gs:// URL whose path has no '#', '?', '*', '[', ']' or control"
        f" character, got {location!r} (with {', '.join(map(repr, unsafe))}): the storage"
        " clients read them differently (TensorStore's path ends at '#' or '?', gcsfs reads"
        " '*?[]' as wildcards), so two runs could share their objects; rename it, e.g. with"
        " '-' in their place.")
  if {".", ".."} & set(name.split("/")):
    raise ConfigError(f"{key} expects a gs:// URL without '.' or '..' in its path (a bucket"
                      f" has no directories to resolve them in), got {location!r}; write the"
                      " path without them.")


def _configure_gcs() -> None:
  """Settings for gcsfs, TensorStore and google-cloud-storage (see the module docstring);
  once per process, before any of them opens a bucket."""
  global _configured
  if _configured:
    return
  import aiohttp
  from fsspec.config import conf

  os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # read at gcsfs' import
  os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", str(REQUEST_TIMEOUT_S))
  os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES", "256")
  gcs = conf.setdefault("gcs", {})
  gcs.setdefault("requests_timeout", aiohttp.ClientTimeout(sock_connect=_CONNECT_TIMEOUT_S,
                                                           sock_read=REQUEST_TIMEOUT_S))
  gcs["use_listings_cache"] = False
  emulator = _emulator()
  if emulator:
    os.environ["STORAGE_EMULATOR_HOST"] = emulator
    os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", emulator)
    os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
    gcs.setdefault("token", "anon")
  _configured = True


def _emulator() -> str | None:
  """The emulator's URL from `STORAGE_EMULATOR_HOST`, or None."""
  host = os.environ.get("STORAGE_EMULATOR_HOST", "")
  if host in ("", "default"):
    return None
  return host if "://" in host else f"http://{host}"


def _gcs():
  """gcsfs's file system (the instance fsspec keeps), configured (`_configure_gcs`).

  Raises:
    ConfigError: gcsfs is not installed.
  """
  _configure_gcs()
  try:
    import fsspec
    return fsspec.filesystem("gcs")
  except ImportError:
    raise ConfigError("gs:// paths need gcsfs, which the trainer's extra installs: pip install"
                      " -e '.[train]'.") from None


def _forbidden(error: BaseException) -> bool:
  """Whether `error` (of gcsfs) is the server's 403: the credentials lack a permission."""
  return type(error) is OSError and str(error).startswith("Forbidden")


def check(location: str, key: str, write: bool = False) -> None:
  """Refuses, with a one-line ConfigError naming `key`, a `location` that the run cannot
  use, within about 30 s: one of a form `path` refuses (also a local path that is a URL
  missing its "//"), no Google Cloud credentials (not asked of an emulator), an endpoint
  that does not answer (a connection within 10 s, each request within 20 s), a bucket that
  does not exist or that the credentials may not list, and, with `write` (a location the
  run writes), one where they may not create and delete an object: a probe object is
  written there and deleted. Other local paths are left to their users.
  """
  _check_form(location, key)
  if not is_url(location):
    return
  _configure_gcs()
  bucket = location.split("://", 1)[1].split("/", 1)[0]
  endpoint = _emulator()
  what = f"{key} {location!r}"
  fix = ", or STORAGE_EMULATOR_HOST (the emulator's address)" if endpoint else ""
  if endpoint is None:
    endpoint = _PUBLIC_ENDPOINT
    import google.auth
    from google.auth.exceptions import DefaultCredentialsError
    try:
      google.auth.default()
    except DefaultCredentialsError as e:
      raise ConfigError(
          f"{what}: no Google Cloud credentials found ({_first_line(e)}). On a Cloud TPU VM or"
          " a GCE instance the VM's service account is used; elsewhere run `gcloud auth"
          " application-default login` or set GOOGLE_APPLICATION_CREDENTIALS.") from None
  host = urllib.parse.urlsplit(endpoint)
  port = host.port or (443 if host.scheme == "https" else 80)
  try:
    socket.create_connection((host.hostname, port), timeout=_CONNECT_TIMEOUT_S).close()
  except OSError as e:
    raise ConfigError(f"{what}: the storage endpoint {endpoint} does not answer ({e}); check the"
                      f" network{fix}.") from None
  fs = _gcs()
  role = ("give the credentials roles/storage.objectAdmin on it (objects listed, read,"
          " written and deleted)")

  def ask(request, failed):
    """`request` (a coroutine of gcsfs) run on gcsfs's loop and cancelled after 20 s;
    ConfigError `failed(error)` where it fails."""
    import fsspec.asyn

    async def bounded():
      return await asyncio.wait_for(request, _CHECK_TIMEOUT_S)
    try:
      fsspec.asyn.sync(fs.loop, bounded)
    except TimeoutError:
      raise ConfigError(f"{what}: the storage endpoint {endpoint} accepts connections but did"
                        f" not answer a request within {_CHECK_TIMEOUT_S:.0f} s; check the"
                        f" network{fix}.") from None
    except FileNotFoundError:
      raise ConfigError(f"{what}: bucket {bucket!r} does not exist at {endpoint}; create it"
                        f" (gcloud storage buckets create gs://{bucket}) or fix the name."
                        ) from None
    except Exception as e:  # gcsfs: OSError for 403, its HttpError for 401 and others
      raise ConfigError(failed(_first_line(e))) from None

  # Listing one object: the permission a run needs, where reading the bucket's own metadata
  # takes another (storage.buckets.get) that object roles lack.
  ask(fs._call("GET", "b/{}/o", bucket, maxResults=1, json_out=True),
      lambda e: f"{what}: listing bucket {bucket!r} failed ({e}); {role}.")
  if not write:
    return
  probe = f"{location.rstrip('/')}/.write-check-{uuid.uuid4().hex[:12]}"
  ask(fs._pipe_file(probe, b""),
      lambda e: f"{what}: the credentials may list bucket {bucket!r} but not write there ({e});"
                f" {role}, or choose a location they may write.")
  ask(fs._rm_file(probe),
      lambda e: f"{what}: the credentials may write to bucket {bucket!r} but not delete there"
                f" ({e}), as a run does (old checkpoints, files set aside); {role}, then"
                f" delete the probe object {probe}.")


def _first_line(error: BaseException) -> str:
  return (str(error).strip().splitlines() or [type(error).__name__])[0]


def hierarchical_namespace(location) -> bool:
  """Whether `location` is on a bucket with a hierarchical namespace (orbax asks, to list
  and delete a checkpoint's folders there), from the bucket's metadata. Credentials with
  object roles only (roles/storage.objectAdmin) may not read it: their bucket is taken for
  a flat one, where the same listings and deletes work, and a hierarchical bucket keeps the
  empty folders of deleted checkpoints (no listing shows them). False for a local path.

  Raises:
    OSError: the metadata does not read for another reason than a permission.
  """
  text = str(location)
  if not text.startswith("gs://"):
    return False
  return _hierarchical(_emulator() or _PUBLIC_ENDPOINT, text[len("gs://"):].split("/", 1)[0])


@functools.cache
def _hierarchical(endpoint: str, bucket: str) -> bool:
  del endpoint  # a key of the cache only: a bucket of this name elsewhere is another bucket
  try:
    meta = _gcs().call("GET", "b/{}", bucket, fields="hierarchicalNamespace", json_out=True)
  except OSError as e:
    if not _forbidden(e):
      raise
    log.info("bucket %r: its metadata may not be read (%s); taking it for a flat namespace.",
             bucket, _first_line(e))
    return False
  return bool(meta.get("hierarchicalNamespace", {}).get("enabled"))


def iterdir(directory: epath.Path) -> list[epath.Path]:
  """The entries of `directory`, sorted. On a bucket a folder's placeholder object (`name/`,
  which the Cloud console's "create folder" writes) is not an entry: gcsfs lists it as an
  entry of itself."""
  if not is_url(str(directory)):
    return sorted(directory.iterdir())
  own = str(directory).split("://", 1)[1].rstrip("/")
  return sorted(directory / name.rstrip("/").rsplit("/", 1)[-1]
                for name in _gcs().ls(str(directory), detail=False)
                if name.rstrip("/") != own)


def files(root: epath.Path) -> list[str]:
  """The files under directory `root`, recursively, as paths relative to it ("a/b.txt"),
  sorted; on a bucket without the placeholder objects of folders (see `iterdir`)."""
  # gcsfs walks folders named without their protocol ("bucket/x"), so a folder's path below
  # `root` is taken from the names, not from `relative_to`.
  top = str(root).split("://", 1)[-1].rstrip("/")
  out = []
  for folder, _, names in root.walk():
    below = str(folder).split("://", 1)[-1].removeprefix(top).strip("/")
    out += [f"{below}/{name}" if below else name for name in names
            if name and not name.endswith("/")]  # not a folder's placeholder (`iterdir`)
  return sorted(out)


def read_range(file: epath.Path, start: int, end: int) -> bytes:
  """Bytes `start` to `end` of `file` (fewer where it ends first): locally a seek and a
  read; on a bucket one ranged request.

  Raises:
    OSError: the file does not read (FileNotFoundError: it is gone).
  """
  if is_url(str(file)):
    return _gcs().cat_file(str(file), start=start, end=end)
  with open(file, "rb") as f:
    f.seek(start)
    return f.read(end - start)


def write_atomic(target: epath.Path, data: str | bytes) -> None:
  """Writes `data` to `target` so that a reader (or a run killed meanwhile) sees the old
  file or the new one, never part of it: locally through a temporary file and a rename, on
  a bucket in one upload (an object is whole or absent)."""
  raw = data.encode() if isinstance(data, str) else data
  if is_url(str(target)):
    target.write_bytes(raw)
    return
  tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.tmp")
  tmp.write_bytes(raw)
  os.replace(tmp, target)


def write_dir(target: epath.Path, files: dict[str, bytes]) -> None:
  """Writes directory `target` with `files` (name -> bytes). Locally it is written beside
  and renamed into place (all or nothing); on a bucket each file is an object, written
  whole; a directory missing some of `files` (a run killed between two uploads) is
  completed by the next call."""
  if is_url(str(target)):
    for name, data in files.items():
      (target / name).write_bytes(data)
    return
  tmp = target.with_name(f".{target.name}.tmp")
  shutil.rmtree(tmp, ignore_errors=True)
  tmp.mkdir(parents=True)
  for name, data in files.items():
    (tmp / name).write_bytes(data)
  os.replace(tmp, target)


def append(target: epath.Path, data: bytes) -> None:
  """Appends `data` to file `target` (created if missing). On a bucket: `data` is uploaded
  as an object beside it and composed onto its end by the server (GCS compose), so an
  append costs two requests whatever the file's size."""
  if not data:
    return
  if not is_url(str(target)):
    with open(target, "ab") as f:
      f.write(data)
    return
  fs = _gcs()
  if not target.exists():
    target.write_bytes(data)
    return
  part = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.part")
  part.write_bytes(data)
  try:
    fs.merge(str(target), [str(target), str(part)])
  finally:
    fs.rm(str(part))


def move(source: epath.Path, target: epath.Path) -> None:
  """Moves file or directory `source` to `target` (its parent directories created). On a
  bucket, each object is copied, then the sources deleted: a kill meanwhile leaves both
  copies, never neither."""
  if not is_url(str(source)):
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(os.fspath(source), os.fspath(target))
    return
  fs = _gcs()
  fs.copy(str(source), str(target), recursive=source.is_dir())
  fs.rm(str(source), recursive=True)


def upload(local: os.PathLike, target: epath.Path) -> None:
  """Copies local file `local` to `target` (a bucket's object is streamed from the file,
  not read into memory first)."""
  if is_url(str(target)):
    _gcs().put(os.fspath(local), str(target))
  else:
    shutil.copyfile(local, target)


@contextlib.contextmanager
def local_dir(location: str, names: tuple[str, ...] | None = None):
  """Yields a local directory with the files of directory `location` (those of `names`
  only, where given; no subdirectories), for readers of local files only (safetensors'
  memory map): `location` itself where it is local; for a URL a temporary copy, removed
  afterwards (a checkpoint's size on the local disk meanwhile)."""
  if not is_url(location):
    yield location
    return
  source = path(location)
  with tempfile.TemporaryDirectory(prefix="flaxattn-") as local:
    for file in iterdir(source):
      if (names is None or file.name in names) and file.is_file():
        _gcs().get(str(file), os.path.join(local, file.name))
    yield local
