"""The daemon's hotness history on disk: how often each expert was asked for, kept across
restarts so `moestream warm --top N` can refill the arena with what decoders use most.

One small JSON file (`history_file`): the model's identity (content, `Fingerprint.identity`)
and `[[layer, expert, requests], ...]`. Written every `history_interval_s` when it changed and
at shutdown, atomically (a temporary file in the same directory, fsync, rename): a crash leaves
the old file or the new one, never half of one. A file for another model, or one that cannot
be read, is set aside with a warning (the daemon starts with no history, never refuses to start).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

log = logging.getLogger("moestream.iod")
VERSION = 1
Key = tuple[int, int]


class History:
    def __init__(self, path: Path, identity: dict[str, Any], n_layer: int, n_expert: int):
        self.path, self.identity = path, identity
        self.n_layer, self.n_expert = n_layer, n_expert
        self.saved_total = -1  # the request total at the last save (-1: never saved)

    def load(self) -> Counter:
        """The saved counts for this model, or an empty Counter (with a warning saying why)."""
        try:
            doc = json.loads(self.path.read_text())
        except FileNotFoundError:
            return Counter()
        except (OSError, ValueError) as e:
            log.warning("hotness history %s unreadable (%s): starting without history", self.path, e)
            return Counter()
        problem = self._problem(doc)
        if problem is not None:
            log.warning("hotness history %s %s: starting without history", self.path, problem)
            return Counter()
        counts = Counter({(int(layer), int(e)): int(n) for layer, e, n in doc["counts"]})
        log.info("hotness history: %d experts, %d requests, from %s", len(counts), sum(counts.values()), self.path)
        return counts

    def _problem(self, doc: Any) -> str | None:
        if not isinstance(doc, dict) or doc.get("version") != VERSION or not isinstance(doc.get("counts"), list):
            return "is not a version-1 history file"
        if doc.get("model") != self.identity:
            return "is for another model (its identity differs)"
        for row in doc["counts"]:
            ok = isinstance(row, list) and len(row) == 3 and all(isinstance(x, int) and x >= 0 for x in row)
            if not ok or row[0] >= self.n_layer or row[1] >= self.n_expert:
                return f"has a bad entry {row!r:.40}"
        return None

    def save(self, counts: Counter, total: int) -> None:
        """Write `counts` if anything changed since the last save (`total`: requests so far)."""
        if total == self.saved_total:
            return
        doc = {"version": VERSION, "model": self.identity,
               "counts": [[layer, e, n] for (layer, e), n in sorted(counts.items())]}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(doc, f, separators=(",", ":"))
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as e:  # a full or read-only disk must not stop the daemon serving
            log.warning("hotness history not saved to %s: %s", self.path, e)
            return
        self.saved_total = total
