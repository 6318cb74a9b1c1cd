"""RunIndex: the coordinator's own record of the runs it holds, so that a restarted coordinator takes them up again.

One JSON file, ``<runs root>/.coordinator/runs.json``, rewritten atomically (written beside it, then renamed) when
a run is submitted, recovers, or ends: run id, run directory, the validated config, state and recoveries. A
coordinator that starts and finds runs there that had not ended resumes each one from its newest checkpoint,
inside the same run id, once workers register again (workers re-register by themselves when a restarted
coordinator does not know them). Finished runs stay listed until the file holds ``KEEP_FINISHED`` of them.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)
KEEP_FINISHED = 1000


class RunIndex:
    def __init__(self, runs_root: Path):
        self.path = runs_root / ".coordinator" / "runs.json"

    def load(self) -> list[dict]:
        """The recorded runs, oldest first; an unreadable file is reported and treated as empty (nothing resumes)."""
        if not self.path.exists():
            return []
        try:
            doc = json.loads(self.path.read_text())
            return [r for r in doc["runs"] if isinstance(r, dict) and {"run_id", "run_dir", "config_json",
                                                                        "state"} <= r.keys()]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.error("cannot read the run index %s (%s): runs it held are not resumed", self.path, exc)
            return []

    def save(self, runs: list[dict]) -> None:
        finished = [r for r in runs if r["state"] in ("SUCCEEDED", "FAILED", "STOPPED")]
        drop = {id(r) for r in finished[:max(0, len(finished) - KEEP_FINISHED)]}
        doc = {"runs": [r for r in runs if id(r) not in drop]}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps(doc))
            os.replace(tmp, self.path)
        except OSError as exc:  # a full disk must not fail the runs themselves; it is loud in the log
            log.error("cannot write the run index %s (%s): a coordinator restart would not resume these runs",
                      self.path, exc)
