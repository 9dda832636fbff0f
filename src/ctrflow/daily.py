"""What the daily training cycle carries from one day to the next, in one folder (the loop's state).

Each day (the KFP pipeline `ctrflow-daily`, or `ctrflow pipeline run --local --pipeline daily`):
preprocess the new day with the previous day's vocabularies, warm-start the champion on it, score
candidate and champion on the day's held-out rows, export the candidate as the next version of the
served repository, promote it or not. The state folder holds:

    STATE/state.json              the commit point: day count, the current entries below, history
    STATE/vocabularies/day-N/     schema.json + vocab/ of the newest day (what --vocab-from reads)
    STATE/checkpoints/day-N/      the champion's checkpoint, optimizer state included (--init-from)
    STATE/repository/             the served Triton repository (`ctrflow serve --poll-secs` watches it)

The vocabulary advances every day, promoted or not (tomorrow's ids extend today's, so they extend
the champion's too); the champion and the served version advance only on promotion. A day is
recorded by writing `state.json` last (atomically): a step that fails before leaves yesterday's
state in force, and the folders it left are removed by the next day's record.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from ctrflow.errors import UserError

STATE_FILE = "state.json"
KEEP = 2  # vocabularies and checkpoints kept besides the current ones (the lineage's last steps)


@dataclass(frozen=True)
class DailyState:
    """The loop's state in folder `root` (module doc); a fresh folder is day 0 with nothing yet."""

    root: Path
    day: int = 0  # days recorded so far
    vocabulary: str | None = None  # relative to root
    champion: str | None = None  # relative to root
    history: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def load(cls, root: str | os.PathLike) -> "DailyState":
        """The state recorded in `root/state.json` (none yet: day 0)."""
        root = Path(root)
        path = root / STATE_FILE
        if not path.exists():
            if root.exists() and not root.is_dir():
                raise UserError(f"state {root}: not a directory")
            return cls(root)
        try:
            raw = json.loads(path.read_text())
            return cls(root, int(raw["day"]), raw.get("vocabulary"), raw.get("champion"), list(raw.get("history", [])))
        except (ValueError, KeyError, TypeError) as err:
            raise UserError(f"{path}: not a ctrflow daily state ({err})") from None

    @property
    def repository(self) -> Path:
        """The served Triton repository."""
        return self.root / "repository"

    def inputs(self) -> dict[str, str]:
        """The day's inputs as flags take them ("" when there is none yet): `vocab_from` (preprocess
        --vocab-from), `init_from` (train --init-from), `base` (export --base)."""
        served = self.repository.exists() and any(self.repository.iterdir())
        return {"vocab_from": str(self.root / self.vocabulary) if self.vocabulary else "",
                "init_from": str(self.root / self.champion) if self.champion else "",
                "base": str(self.repository) if served else ""}

    def save(self) -> None:
        """Write state.json atomically (the commit point of a day)."""
        raw = {"day": self.day, "vocabulary": self.vocabulary, "champion": self.champion, "history": self.history}
        tmp = self.root / f".{STATE_FILE}.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(raw, indent=2) + "\n")
        os.replace(tmp, self.root / STATE_FILE)


def resolve_day_files(pattern: str, when: datetime | None = None, days_back: int = 1) -> str:
    """`pattern` with `{date}` replaced by the date (YYYY-MM-DD) `days_back` days before `when` (default:
    now, UTC): one recurring run, each day the files of the day before (complete when the run starts)."""
    if "{date}" not in pattern:
        return pattern
    if days_back < 0:
        raise UserError(f"days_back {days_back}: must be 0 or more")
    moment = (when or datetime.now(timezone.utc)) - timedelta(days=days_back)
    return pattern.replace("{date}", moment.strftime("%Y-%m-%d"))


def copy_atomically(source: Path, target: Path, names: tuple[str, ...] | None = None) -> None:
    """Copy folder `source` (only `names` in it, when given) to `target`, which appears whole or not at all."""
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    if names is None:
        shutil.copytree(source, tmp)
    else:
        tmp.mkdir(parents=True)
        for name in names:
            (shutil.copytree if (source / name).is_dir() else shutil.copy2)(source / name, tmp / name)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)


def publish_champion(state: DailyState, checkpoint: str | os.PathLike, data: str | os.PathLike, name: str,
                     backend: str) -> dict:
    """Export the promoted checkpoint into the served repository: the next version beside the served one
    (atomic, the server switches without downtime), or version 1 when nothing is served yet."""
    from ctrflow.export import export

    base = state.inputs()["base"]
    if base:
        return export(checkpoint, data, None, name, base=base)
    return export(checkpoint, data, state.repository, name, backend=backend)


def record_day(root: str | os.PathLike, data: str | os.PathLike, checkpoint: str | os.PathLike,
               promoted: bool, name: str = "ctr", backend: str = "onnxruntime",
               verdict: dict | None = None) -> DailyState:
    """Record one day in the state at `root` (module doc): keep the day's vocabularies; when `promoted`,
    keep its checkpoint as the champion and publish it to the served repository. Returns the new state."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    state = DailyState.load(root)
    day = state.day + 1
    label = f"day-{day:04d}"
    vocabulary = f"vocabularies/{label}"
    copy_atomically(Path(data), root / vocabulary, ("schema.json", "vocab"))
    champion, published = state.champion, None
    if promoted:
        champion = f"checkpoints/{label}"
        copy_atomically(Path(checkpoint), root / champion)
        summary = publish_champion(state, root / champion, data, name, backend)
        published = summary.get("version", 1)
    entry = {"day": day, "data": str(data), "promoted": promoted, "served_version": published,
             **({"verdict": verdict} if verdict else {})}
    new = DailyState(root, day, vocabulary, champion, [*state.history, entry])
    new.save()
    prune(new)
    return new


def prune(state: DailyState) -> list[Path]:
    """Remove the vocabularies and checkpoints older than the newest KEEP that the state no longer
    names (and any an interrupted day left); returns what was removed."""
    removed = []
    for kind in ("vocabularies", "checkpoints"):
        folder = state.root / kind
        if not folder.exists():
            continue
        current = {state.vocabulary, state.champion}
        entries = sorted(p for p in folder.iterdir() if not p.name.startswith("."))
        for path in entries[:-KEEP] if len(entries) > KEEP else []:
            if f"{kind}/{path.name}" not in current:
                shutil.rmtree(path)
                removed.append(path)
        for path in folder.glob(".*.tmp-*"):
            shutil.rmtree(path, ignore_errors=True)
    return removed
