"""Submitting jobs to a Regatta head from Python, with the method names of Ray's
``ray.job_submission.JobSubmissionClient``.

    from regatta.job_submission import JobSubmissionClient, JobStatus

    client = JobSubmissionClient("https://head:8265")        # token: REGATTA_TOKEN or ~/.regatta/token
    job = client.submit_job(entrypoint="python train.py", runtime_env={"env_vars": {"SEED": "1"}})
    for chunk in client.tail_job_logs_sync(job): print(chunk, end="")
    print(client.get_job_status(job))

Trust: by default the head's certificate is checked against the cluster's own authority,
fetched from the head with the join token's proof of it (checked before the token is
sent), under the head's name ``head.regatta`` as Regatta's own clients do; ``verify``
takes a CA file for a head started with its own certificate, or False to skip the check.
"""

import asyncio
import enum
import http.client
import json
import os
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from .exceptions import RegattaError

# The name the head's certificate from the cluster's authority carries (workers' do not).
HEAD_NAME = "head.regatta"


class _HTTPSConnection(http.client.HTTPSConnection):
    """An HTTPS connection that checks the server's certificate under a fixed name."""

    server_hostname = None

    def connect(self):
        http.client.HTTPConnection.connect(self)
        self.sock = self._context.wrap_socket(self.sock, server_hostname=self.server_hostname or self.host)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    """urllib's HTTPS handler with ``context`` and, when given, a fixed certificate name."""

    def __init__(self, context, server_hostname):
        super().__init__(context=context)
        self._tls = context
        self._name = server_hostname

    def https_open(self, req):
        name = self._name

        def connection(host, **kwargs):
            conn = _HTTPSConnection(host, **kwargs)
            conn.server_hostname = name
            return conn

        return self.do_open(connection, req, context=self._tls)


class JobStatus(str, enum.Enum):
    """A job's state (Ray's names)."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    STOPPED = "STOPPED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"

    def is_terminal(self):
        return self in (JobStatus.STOPPED, JobStatus.SUCCEEDED, JobStatus.FAILED)

    def __str__(self):
        return self.value


@dataclass
class JobDetails:
    """A job as the head describes it (Ray's ``JobDetails`` fields; ``raw`` holds all)."""

    submission_id: str
    status: JobStatus
    entrypoint: str
    message: Optional[str] = None
    error_type: Optional[str] = None
    start_time: Optional[int] = None
    end_time: Optional[int] = None
    metadata: Dict[str, str] = field(default_factory=dict)
    runtime_env: Dict[str, Any] = field(default_factory=dict)
    driver_exit_code: Optional[int] = None
    driver_node_id: Optional[str] = None
    job_id: Optional[str] = None
    type: str = "SUBMISSION"
    raw: Dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data):
        return cls(
            submission_id=data["submission_id"],
            status=JobStatus(data["status"]),
            entrypoint=data["entrypoint"],
            message=data.get("message"),
            error_type=data.get("error_type"),
            start_time=data.get("start_time"),
            end_time=data.get("end_time"),
            metadata=data.get("metadata") or {},
            runtime_env=data.get("runtime_env") or {},
            driver_exit_code=data.get("driver_exit_code"),
            driver_node_id=data.get("driver_node_id"),
            job_id=data.get("job_id"),
            type=data.get("type", "SUBMISSION"),
            raw=data,
        )


class JobSubmissionClient:
    """A client of a head's job API (``https://HOST:8265``)."""

    def __init__(self, address=None, *, token=None, headers=None, verify=True):
        if address is None:
            address = os.environ.get("REGATTA_JOB_ADDRESS", "https://127.0.0.1:8265")
        if "://" not in address:
            address = "https://" + address
        self._address = address.rstrip("/")
        if token is None:
            from . import _read_token

            token = _read_token(None)
        self._headers = {"Authorization": f"Bearer {token}", **(headers or {})}
        self._context = None
        self._server_hostname = None
        if self._address.startswith("https://"):
            if verify is False:
                self._context = ssl._create_unverified_context()
            elif isinstance(verify, str):
                self._context = ssl.create_default_context(cafile=verify)
            else:
                from . import _native

                # The cluster's authority signs the head's certificate, which names
                # `head.regatta` (not a host): the chain and that name are checked.
                try:
                    authorities = _native.cluster_authorities_der(self._address, token)
                except RuntimeError as error:
                    raise ConnectionError(str(error)) from None
                pem = "".join(ssl.DER_cert_to_PEM_cert(der) for der in authorities)
                self._context = ssl.create_default_context(cadata=pem)
                self._server_hostname = HEAD_NAME
        self._opener = urllib.request.build_opener(_HTTPSHandler(self._context, self._server_hostname))
        self._request("GET", "/api/version")

    def _request(self, method, path, body=None, stream=False):
        data = None if body is None else json.dumps(body).encode()
        headers = dict(self._headers)
        if data is not None:
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(self._address + path, data=data, method=method, headers=headers)
        try:
            response = self._opener.open(request, timeout=None if stream else 60)
        except urllib.error.HTTPError as error:
            text = error.read().decode("utf-8", "replace")
            try:
                text = json.loads(text).get("error", text)
            except ValueError:
                pass
            raise RegattaError(f"{method} {path} failed with status {error.code}: {text}") from None
        except urllib.error.URLError as error:
            raise ConnectionError(f"cannot reach the job API at {self._address}: {error.reason}") from None
        if stream:
            return response
        with response:
            return json.loads(response.read() or b"null")

    def submit_job(self, *, entrypoint, submission_id=None, runtime_env=None, metadata=None,
                   entrypoint_num_cpus=None, entrypoint_num_gpus=None, entrypoint_memory=None,
                   entrypoint_resources=None):
        """Submits a job; returns its id."""
        body = {"entrypoint": entrypoint, "runtime_env": runtime_env or {}, "metadata": metadata or {}}
        for key, value in (("submission_id", submission_id), ("entrypoint_num_cpus", entrypoint_num_cpus),
                           ("entrypoint_num_gpus", entrypoint_num_gpus), ("entrypoint_memory", entrypoint_memory),
                           ("entrypoint_resources", entrypoint_resources)):
            if value is not None:
                body[key] = value
        return self._request("POST", "/api/jobs/", body)["submission_id"]

    def get_job_info(self, job_id):
        return JobDetails.from_json(self._request("GET", f"/api/jobs/{job_id}"))

    def get_job_status(self, job_id):
        return self.get_job_info(job_id).status

    def list_jobs(self):
        return [JobDetails.from_json(job) for job in self._request("GET", "/api/jobs/")]

    def get_job_logs(self, job_id):
        return self._request("GET", f"/api/jobs/{job_id}/logs")["logs"]

    def stop_job(self, job_id):
        return self._request("POST", f"/api/jobs/{job_id}/stop")["stopped"]

    def delete_job(self, job_id):
        return self._request("DELETE", f"/api/jobs/{job_id}")["deleted"]

    def tail_job_logs_sync(self, job_id):
        """The log as it grows, until the job ends (a generator of text chunks)."""
        response = self._request("GET", f"/api/jobs/{job_id}/logs/tail", stream=True)
        decoder = __import__("codecs").getincrementaldecoder("utf-8")("replace")
        with response:
            while True:
                chunk = response.read1(1 << 16)
                if not chunk:
                    break
                text = decoder.decode(chunk)
                if text:
                    yield text
        rest = decoder.decode(b"", final=True)
        if rest:
            yield rest

    async def tail_job_logs(self, job_id):
        """Ray's async form of :meth:`tail_job_logs_sync`."""
        loop = asyncio.get_running_loop()
        chunks = self.tail_job_logs_sync(job_id)
        done = object()
        while True:
            chunk = await loop.run_in_executor(None, next, chunks, done)
            if chunk is done:
                return
            yield chunk
