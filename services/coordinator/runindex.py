"""RunIndex: the coordinator's own record of the runs it holds, so that a restarted coordinator takes them up again.

One JSON file, ``<runs root>/.coordinator/runs.json``, rewritten atomically (written beside it, then renamed) when
a run is submitted, recovers, or ends: run id, run directory, the validated config (its secrets redacted: a run
taken up again takes them from its workers' environment), state and recoveries. A
coordinator that starts and finds runs there that had not ended resumes each one from its newest checkpoint,
inside the same run id, once workers register again (workers re-register by themselves when a restarted
coordinator does not know them). Finished runs stay listed until the file holds ``KEEP_FINISHED`` of them.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from prometheus_client import Counter

log = logging.getLogger(__name__)
KEEP_FINISHED = 1000
RUN_INDEX_ERRORS = Counter("rlfabric_coordinator_run_index_errors_total", "run index problems: an unreadable file "
                           "(kept aside), a malformed record, a recorded run whose config no longer validates (marked "
                           "FAILED), a write that failed", ["kind"])


class RunIndex:
    def __init__(self, runs_root: Path):
        self.path = runs_root / ".coordinator" / "runs.json"

    def load(self) -> list[dict]:
        """The recorded runs, oldest first. An unreadable file is never overwritten: it is kept aside as
        ``runs.json.corrupt-<time>`` (for a person to read), logged as an error and counted in
        ``rlfabric_coordinator_run_index_errors_total``, and nothing resumes from it. A record without the fields a
        run needs is reported and counted the same way."""
        if not self.path.exists():
            return []
        try:
            doc = json.loads(self.path.read_text())
            records = doc["runs"]
            if not isinstance(records, list):
                raise TypeError(f"'runs' is a {type(records).__name__}, not a list")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            aside = self.path.with_name(f"{self.path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
            try:
                os.replace(self.path, aside)
                where = f"kept aside as {aside}"
            except OSError as move:
                where = f"and it could not be moved aside ({move}): the next write replaces it"
            RUN_INDEX_ERRORS.labels("unreadable").inc()
            log.error("cannot read the run index %s (%s): the runs it held are not resumed; the file is %s. Fix: "
                      "read it, and resume each run that had not ended with `rlfabric resume RUN_DIR`",
                      self.path, exc, where)
            return []
        runs = []
        for record in records:
            if isinstance(record, dict) and {"run_id", "run_dir", "config_json", "state"} <= record.keys():
                runs.append(record)
            else:
                RUN_INDEX_ERRORS.labels("malformed_record").inc()
                log.error("the run index %s holds a record without run_id, run_dir, config_json and state: %.200r",
                          self.path, record)
        return runs

    def save(self, runs: list[dict]) -> None:
        """Rewrite the index atomically, owner-only (0600 in a 0700 directory): it holds every run's spec."""
        finished = [r for r in runs if r["state"] in ("SUCCEEDED", "FAILED", "STOPPED")]
        drop = {id(r) for r in finished[:max(0, len(finished) - KEEP_FINISHED)]}
        doc = {"runs": [r for r in runs if id(r) not in drop]}
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(self.path.parent, 0o700)
            tmp = self.path.with_name(self.path.name + ".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "w") as f:
                os.fchmod(f.fileno(), 0o600)
                f.write(json.dumps(doc))
            os.replace(tmp, self.path)
        except OSError as exc:  # a full disk must not fail the runs themselves; it is loud in the log
            RUN_INDEX_ERRORS.labels("unwritable").inc()
            log.error("cannot write the run index %s (%s): a coordinator restart would not resume these runs",
                      self.path, exc)
