"""Object store: where weight versions, checkpoints and run artefacts live, behind one small interface.

``FilesystemObjectStore`` is the embedded default (a directory). ``S3ObjectStore`` talks to MinIO (the compose
deployment) or any S3 service. In both, writes are atomic: a reader never sees a half-written object.

Open-time problems (bad endpoint, credentials, missing bucket) raise ``ObjectStoreError``, a ``ConfigError``
whose message names the ``storage.*`` field and the fix, so a run fails when it starts rather than at its first
checkpoint. Later failures raise ``OSError`` subclasses: ``FileNotFoundError`` for a missing object,
``PermissionError`` for denied access, ``ConnectionError`` when the endpoint stops answering.
"""

from __future__ import annotations

import io
import os
import re
import tempfile
from pathlib import Path

from rlfabric.services.core.config import ConfigError, StorageConfig

ACCESS_KEY_ENV = "RLFABRIC_S3_ACCESS_KEY"
SECRET_KEY_ENV = "RLFABRIC_S3_SECRET_KEY"


class ObjectStoreError(ConfigError):
    """The configured object store cannot be used; the message names the storage.* field and the fix."""


class ObjectStore:
    """Flat keys ('checkpoints/final.pt') to bytes. Keys are relative paths; see ``_check_key``."""

    def put_bytes(self, key: str, data: bytes) -> str:
        """Store ``data`` under ``key`` (replacing any old object atomically) and return its URI."""
        raise NotImplementedError

    def get_bytes(self, key: str) -> bytes:
        """The object's bytes; FileNotFoundError when there is none."""
        raise NotImplementedError

    def exists(self, key: str) -> bool:
        raise NotImplementedError

    def list(self, prefix: str = "") -> list[str]:
        """Sorted keys that start with ``prefix`` (a plain string prefix, not only a folder)."""
        raise NotImplementedError

    def delete(self, key: str) -> None:
        """Remove the object. Deleting a missing key is a no-op, so eviction can be retried safely."""
        raise NotImplementedError

    def uri(self, key: str) -> str:
        raise NotImplementedError


def _check_key(key: str) -> str:
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"object key {key!r} must be a relative path like 'checkpoints/final.pt' without '..'")
    return key


class FilesystemObjectStore(ObjectStore):
    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.root / _check_key(key)

    def put_bytes(self, key: str, data: bytes) -> str:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return self.uri(key)

    def get_bytes(self, key: str) -> bytes:
        path = self._path(key)
        if not path.is_file():
            raise FileNotFoundError(f"no object {key!r} in {self.root}")
        return path.read_bytes()

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str = "") -> list[str]:
        return sorted(str(p.relative_to(self.root)) for p in self.root.rglob("*")
                      if p.is_file() and not p.name.startswith(".") and str(p.relative_to(self.root)).startswith(prefix))

    def delete(self, key: str) -> None:
        # Empty parent folders stay: removing them would race a concurrent put into the same folder.
        self._path(key).unlink(missing_ok=True)

    def uri(self, key: str) -> str:
        return f"file://{self._path(key)}"


_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
# S3 error codes that mean "these credentials are not accepted" rather than "no such thing".
_AUTH_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken",
               "ExpiredToken", "AllAccessDisabled", "AccountProblem"}


class S3ObjectStore(ObjectStore):
    """Objects in an S3 bucket (MinIO in production) under an optional key prefix.

    A PUT of one object is atomic in S3; objects larger than ``part_size`` go up as a multipart upload, which
    becomes visible only when completed (and is aborted on failure), so readers never see partial data. The 64 MiB
    default keeps weight versions and small checkpoints to one PUT: against moto a 64 MiB single PUT ran ~200 MiB/s,
    in 8-16 MiB parts ~90-130 MiB/s. The HTTP client has short connect timeouts and few retries so an
    unreachable endpoint fails in seconds, not minutes (the minio default is 5 minutes per attempt).
    """

    def __init__(self, endpoint: str, bucket: str, *, access_key: str, secret_key: str, prefix: str = "",
                 region: str = "us-east-1", secure: bool = False, create_bucket: bool = True,
                 connect_timeout_s: float = 5.0, read_timeout_s: float = 30.0, retries: int = 2,
                 part_size: int = 64 << 20, parallel_uploads: int = 3):
        import certifi
        import urllib3
        from minio import Minio

        self.endpoint = self._clean_endpoint(endpoint, secure)
        self.bucket = self._check_bucket(bucket)
        self.secure = secure
        self.region = region
        self.prefix = self._clean_prefix(prefix)
        self.part_size = max(int(part_size), 5 << 20)  # S3's minimum part size
        self.parallel_uploads = max(1, int(parallel_uploads))
        if bool(access_key) != bool(secret_key) or not access_key:
            missing = [n for n, v in (("storage.access_key", access_key), ("storage.secret_key", secret_key))
                       if not v]
            raise ObjectStoreError(
                f"S3 object store at {self.endpoint}: {' and '.join(missing)} not set. Fix: set storage.access_key "
                f"and storage.secret_key, or export ${ACCESS_KEY_ENV} and ${SECRET_KEY_ENV}")

        def client(read_timeout_s: float, retries: int) -> Minio:
            http = urllib3.PoolManager(
                timeout=urllib3.Timeout(connect=connect_timeout_s, read=read_timeout_s),
                maxsize=max(10, self.parallel_uploads + 2),
                cert_reqs="CERT_REQUIRED",
                ca_certs=os.environ.get("SSL_CERT_FILE") or certifi.where(),
                retries=urllib3.Retry(total=retries, connect=retries, read=retries, status=retries,
                                      backoff_factor=0.2, status_forcelist=[500, 502, 503, 504],
                                      raise_on_status=False),
            )
            return Minio(self.endpoint, access_key=access_key, secret_key=secret_key, secure=secure,
                         region=region, http_client=http)

        try:
            self._client = client(read_timeout_s, retries)
            # The open-time check waits no longer for an answer than for a connection: a hung server fails in
            # seconds, while transfers keep the longer read timeout a busy server may need.
            self._probe = client(min(read_timeout_s, connect_timeout_s), min(retries, 1))
        except ValueError as exc:
            raise ObjectStoreError(f"storage.endpoint={endpoint!r} is not usable ({exc}). Fix: set it to "
                                   f"host:port, e.g. minio:9000") from None
        self._open(create_bucket)

    @classmethod
    def from_config(cls, config: StorageConfig, **overrides) -> S3ObjectStore:
        """Build from ``storage.*``; credentials fall back to $RLFABRIC_S3_ACCESS_KEY / $RLFABRIC_S3_SECRET_KEY."""
        kwargs = dict(
            endpoint=config.endpoint, bucket=config.bucket, prefix=config.prefix, region=config.region,
            secure=config.secure, create_bucket=config.create_bucket,
            access_key=config.access_key or os.environ.get(ACCESS_KEY_ENV, ""),
            secret_key=config.secret_key or os.environ.get(SECRET_KEY_ENV, ""),
        )
        kwargs.update(overrides)
        return cls(**kwargs)

    @staticmethod
    def _clean_endpoint(endpoint: str, secure: bool) -> str:
        endpoint = endpoint.strip()
        if not endpoint:
            raise ObjectStoreError("storage.kind is 's3' but storage.endpoint is empty. Fix: set storage.endpoint "
                                   "to the S3/MinIO host:port, e.g. minio:9000")
        for scheme, is_tls in (("http://", False), ("https://", True)):
            if endpoint.lower().startswith(scheme):
                if is_tls != secure:
                    raise ObjectStoreError(
                        f"storage.endpoint={endpoint!r} says {scheme} but storage.secure is {secure}. Fix: write "
                        f"the endpoint as host:port and choose TLS with storage.secure")
                endpoint = endpoint[len(scheme):]
        return endpoint.rstrip("/")

    @staticmethod
    def _check_bucket(bucket: str) -> str:
        """S3's naming rules, checked here because servers differ in how (and whether) they reject bad names."""
        if not _BUCKET_RE.fullmatch(bucket) or ".." in bucket:
            raise ObjectStoreError(f"storage.bucket={bucket!r} is not a valid S3 bucket name. Fix: use 3-63 "
                                   f"lowercase letters, digits, '-' or '.', starting and ending with a letter or digit")
        return bucket

    @staticmethod
    def _clean_prefix(prefix: str) -> str:
        prefix = prefix.strip("/")
        if not prefix:
            return ""
        try:
            _check_key(prefix)
        except ValueError:
            raise ObjectStoreError(f"storage.prefix={prefix!r} must be a relative path like 'team/runs' "
                                   f"without '..' or empty parts") from None
        return prefix + "/"

    # -- errors ------------------------------------------------------------------------------------------------

    def _where(self) -> str:
        return f"s3://{self.bucket}/{self.prefix} at {self.endpoint}"

    def _unreachable(self, exc: BaseException) -> ConnectionError:
        reason = getattr(exc, "reason", None) or exc
        return ConnectionError(
            f"S3 object store at storage.endpoint={self.endpoint!r} is unreachable or not answering "
            f"({type(reason).__name__}: {reason}). Fix: check that the S3/MinIO server runs and that storage.endpoint (host:port) and "
            f"storage.secure (TLS: {self.secure}) are right")

    def _denied(self, code: str, detail: str) -> str:
        if code == "InvalidAccessKeyId":
            why = "the server does not know storage.access_key"
        elif code == "SignatureDoesNotMatch":
            why = "storage.secret_key does not match storage.access_key"
        else:
            why = f"the credentials were refused or lack permission on bucket {self.bucket!r}"
        return (f"S3 object store {self._where()}: access denied ({code}: {detail}): {why}. Fix: set "
                f"storage.access_key and storage.secret_key (or ${ACCESS_KEY_ENV} / ${SECRET_KEY_ENV}) to a key "
                f"that may read and write bucket {self.bucket!r}")

    def _call(self, what: str, fn, *args, **kwargs):
        """Run one client call, turning transport and S3 errors into OSErrors whose messages say what to fix."""
        from minio.error import InvalidResponseError, S3Error, ServerError
        from urllib3.exceptions import HTTPError

        try:
            return fn(*args, **kwargs)
        except S3Error as exc:
            if exc.code in _AUTH_CODES:
                raise PermissionError(self._denied(exc.code, exc.message or "")) from None
            if exc.code == "NoSuchBucket":
                raise FileNotFoundError(f"{what}: bucket {self.bucket!r} does not exist at {self.endpoint} "
                                        f"(was it deleted?). Fix: recreate it or point storage.bucket at "
                                        f"an existing one") from None
            raise
        except (InvalidResponseError, ServerError) as exc:
            raise ConnectionError(f"{what}: storage.endpoint={self.endpoint!r} did not answer like an S3 server "
                                  f"({exc}). Fix: point storage.endpoint at the S3/MinIO API port") from None
        except HTTPError as exc:
            raise self._unreachable(exc) from None

    def _open(self, create_bucket: bool) -> None:
        """Fail early: one HEAD on the bucket checks the endpoint, the credentials and the bucket together."""
        from minio.error import S3Error

        try:
            found = self._call("open", self._probe.bucket_exists, self.bucket)
        except S3Error as exc:  # e.g. AuthorizationHeaderMalformed when the server runs in another region
            raise ObjectStoreError(
                f"S3 object store {self._where()} refused the bucket check ({exc.code}: {exc.message}). Fix: check "
                f"storage.endpoint, storage.region ({self.region!r}) and storage.bucket") from None
        except PermissionError:
            raise ObjectStoreError(self._diagnose_denied()) from None
        except ConnectionError as exc:
            raise ObjectStoreError(str(exc)) from None
        if found:
            return
        if not create_bucket:
            raise ObjectStoreError(
                f"S3 bucket storage.bucket={self.bucket!r} does not exist at {self.endpoint}. Fix: create it "
                f"(e.g. `mc mb <alias>/{self.bucket}`), set storage.create_bucket: true, or name an existing bucket")
        try:
            self._call("create bucket", self._client.make_bucket, self.bucket)
        except S3Error as exc:
            if exc.code != "BucketAlreadyOwnedByYou":  # another process created it first: fine
                raise ObjectStoreError(
                    f"could not create S3 bucket storage.bucket={self.bucket!r} at {self.endpoint} ({exc.code}: "
                    f"{exc.message}). Fix: choose another storage.bucket or create it yourself") from None
        except PermissionError as exc:
            raise ObjectStoreError(f"{exc} (creating a missing bucket needs s3:CreateBucket; or create bucket "
                                   f"{self.bucket!r} yourself)") from None
        except ConnectionError as exc:
            raise ObjectStoreError(str(exc)) from None

    def _diagnose_denied(self) -> str:
        """HEAD answers carry no error body; a bucket listing (GET) says whether the key or the secret is wrong."""
        from minio.error import S3Error

        try:
            self._probe.list_buckets()
        except S3Error as exc:
            return self._denied(exc.code, exc.message or "")
        except Exception:  # only a better message was at stake
            pass
        return self._denied("AccessDenied", "the credentials are valid but may not access this bucket")

    # -- the interface -----------------------------------------------------------------------------------------

    def _name(self, key: str) -> str:
        return self.prefix + _check_key(key)

    def put_bytes(self, key: str, data: bytes) -> str:
        name = self._name(key)
        size = memoryview(data).nbytes
        # Stay under S3's 10,000-part limit for very large objects.
        part_size = max(self.part_size, -(-size // 9_999))
        self._call(f"put {key!r}", self._client.put_object, self.bucket, name, io.BytesIO(data), size,
                   part_size=part_size, num_parallel_uploads=self.parallel_uploads)
        return self.uri(key)

    def get_bytes(self, key: str) -> bytes:
        from minio.error import S3Error

        name = self._name(key)
        try:
            response = self._call(f"get {key!r}", self._client.get_object, self.bucket, name)
        except S3Error as exc:
            if exc.code == "NoSuchKey":
                raise FileNotFoundError(f"no object {key!r} in {self._where()}") from None
            raise
        try:
            return self._call(f"get {key!r}", response.read)
        finally:
            response.close()
            response.release_conn()

    def exists(self, key: str) -> bool:
        from minio.error import S3Error

        try:
            self._call(f"exists {key!r}", self._client.stat_object, self.bucket, self._name(key))
            return True
        except S3Error as exc:
            if exc.code in ("NoSuchKey", "NoSuchObject", "NotFound"):
                return False
            raise

    def list(self, prefix: str = "") -> list[str]:
        objects = self._call(f"list {prefix!r}", lambda: list(self._client.list_objects(
            self.bucket, prefix=self.prefix + prefix, recursive=True)))
        start = len(self.prefix)
        return sorted(o.object_name[start:] for o in objects
                      if o.object_name and not o.object_name.endswith("/"))  # skip folder markers

    def delete(self, key: str) -> None:
        self._call(f"delete {key!r}", self._client.remove_object, self.bucket, self._name(key))

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._name(key)}"


def open_store(config: StorageConfig, default_root: str | Path, run_id: str | None = None) -> ObjectStore:
    """The store ``storage.kind`` names; S3 is checked (reachable, credentials, bucket) before it is returned.

    The filesystem store defaults to the run directory, so each run has its own keys. A bucket has no such
    default: pass ``run_id`` to keep runs apart under ``<storage.prefix>/<run_id>/`` (without it, every run
    shares ``storage.prefix``, and so 'checkpoints/final.pt').
    """
    if config.kind == "s3":
        prefix = "/".join(p for p in (config.prefix.strip("/"), run_id) if p)
        return S3ObjectStore.from_config(config, prefix=prefix)
    return FilesystemObjectStore(config.root or default_root)
