"""The AUC gate of the model registry: `ctrflow promote` moves `champion` to the `candidate` version.

The candidate is promoted when
- its AUC is above 0.5 (a model at or below chance is never promoted, champion or not), and
- there is no champion yet, or the candidate's AUC minus the champion's is at least `min_gain`
  (default 0: an equal AUC passes; a positive gain asks for a real improvement, a negative one
  tolerates a small loss for a fresher model).

With `data`, both versions are scored on the same rows, `data/split` (in the daily loop: the
held-out rows of the newest day, processed with the newest vocabulary; the champion reads the ids
its vocabulary never had as unseen, `ctrflow.evaluate.holdout`). A candidate that cannot score those
rows (other features, vocabularies the data does not extend) is refused, with the reason in one
line. Without `data`, each version's recorded AUC is compared (`recorded_auc`).
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import asdict, dataclass

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from ctrflow.errors import UserError
from ctrflow.registry import CANDIDATE, CHAMPION, CHECKPOINT, quiet_artifact_transfers

CHANCE = 0.5  # the AUC of a random ranking: a candidate must beat it


@dataclass(frozen=True)
class Promotion:
    """The gate's verdict on one registered model (what `ctrflow promote --json` prints and MLflow records)."""

    model: str
    promoted: bool  # the `champion` alias moved to the candidate
    candidate_version: str
    candidate_auc: float | None
    champion_version: str | None  # the champion before the decision
    champion_auc: float | None
    reason: str
    rows: int | None = None  # rows both were scored on (None: recorded AUCs compared)
    data: str | None = None
    split: str | None = None
    min_gain: float = 0.0

    def to_json(self) -> dict:
        """The verdict as a JSON-ready dict."""
        return asdict(self)


def alias_version(client: MlflowClient, name: str, alias: str):
    """The model version `alias` points at, or None when the alias is not set."""
    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException as err:
        if err.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
            return None
        raise


def recorded_auc(client: MlflowClient, version) -> float | None:
    """The AUC recorded for a version: its `auc` tag, its run's `auc` metric, else the `auc` of
    the evaluate step of the same pipeline run (a sibling run); None when nothing was recorded."""
    if "auc" in version.tags:
        return float(version.tags["auc"])
    if not version.run_id:
        return None
    run = client.get_run(version.run_id)
    if "auc" in run.data.metrics:
        return run.data.metrics["auc"]
    parent = run.data.tags.get("mlflow.parentRunId")
    if not parent:
        return None
    siblings = client.search_runs(
        [run.info.experiment_id],
        f"tags.`mlflow.parentRunId` = '{parent}' and tags.`ctrflow.step` = 'evaluate'",
        order_by=["attributes.start_time DESC"], max_results=5)
    found = [r.data.metrics["auc"] for r in siblings if "auc" in r.data.metrics]
    return found[0] if found else None


def recomputed_auc(client: MlflowClient, tracking_uri: str, name: str, version, role: str,
                   data: str | os.PathLike, split: str):
    """`HoldoutScore` (auc, rows) of a version's model on `data/split`, from the checkpoint inside its
    pyfunc artifact; a UserError "<role> version V cannot score DATA/SPLIT: why" when it cannot."""
    from mlflow.artifacts import download_artifacts

    from ctrflow.evaluate.holdout import score_holdout

    source = client.get_model_version_download_uri(name, version.version).rstrip("/")
    with tempfile.TemporaryDirectory(prefix="ctrflow-promote-") as tmp, quiet_artifact_transfers():
        try:
            local = download_artifacts(artifact_uri=f"{source}/artifacts/{CHECKPOINT}", dst_path=tmp,
                                       tracking_uri=tracking_uri)
        except (MlflowException, OSError) as err:
            raise UserError(f"model {name} {role} version {version.version}: no checkpoint in its artifact "
                            f"{source} (not registered by ctrflow export?): {err}") from None
        return score_holdout(local, data, split, f"{role} version {version.version} cannot score {data}/{split}")


def recorded(client: MlflowClient, name: str, version) -> float:
    """`recorded_auc`, or a UserError saying how to compute it."""
    value = recorded_auc(client, version)
    if value is None:
        raise UserError(f"model {name} version {version.version}: no AUC recorded (no `auc` version "
                        f"tag, run metric or evaluate step); pass --data DIR to recompute it")
    return value


def decide(candidate_auc: float, champion_auc: float | None, min_gain: float, names: tuple[str, str | None],
           where: str) -> tuple[bool, str]:
    """(promote?, why) for these AUCs; `names` are the candidate's and the champion's versions."""
    candidate, champion = names
    mine = f"candidate version {candidate} AUC {candidate_auc:.6f}"
    if math.isnan(candidate_auc):
        return False, f"candidate version {candidate}: AUC undefined{where} (the rows hold one class only)"
    if candidate_auc <= CHANCE:
        return False, f"{mine} is at or below chance ({CHANCE}){where}"
    if champion_auc is None:
        return True, f"no champion yet; {mine}{where}"
    gain = candidate_auc - champion_auc
    theirs = f"champion version {champion} AUC {champion_auc:.6f}"
    if gain >= min_gain:
        return True, f"{mine} >= {theirs} + min gain {min_gain:g} (gain {gain:+.6f}){where}"
    return False, f"{mine} < {theirs} + min gain {min_gain:g} (gain {gain:+.6f}){where}"


def promote(name: str, tracking_uri: str, data: str | os.PathLike | None = None, split: str = "valid",
            min_gain: float = 0.0) -> Promotion:
    """Apply the gate (module doc) to model `name`'s `candidate`: move `champion` to it and tag the
    version with the reason when it passes, else leave the aliases alone (the version is tagged with
    the refusal). The verdict says why, with both AUCs."""
    if not math.isfinite(min_gain):
        raise UserError(f"--min-gain {min_gain}: must be a finite number")
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    try:
        client.get_registered_model(name)
    except MlflowException:
        raise UserError(f"model {name}: not in the registry at {tracking_uri}") from None
    candidate = alias_version(client, name, CANDIDATE)
    if candidate is None:
        raise UserError(f"model {name}: no version has the '{CANDIDATE}' alias (`ctrflow export` sets it)")
    champion = alias_version(client, name, CHAMPION)
    verdict = dict(model=name, candidate_version=str(candidate.version),
                   champion_version=None if champion is None else str(champion.version),
                   data=None if data is None else str(data), split=split if data is not None else None,
                   min_gain=min_gain)
    if champion is not None and champion.version == candidate.version:
        return Promotion(promoted=False, candidate_auc=None, champion_auc=None, **verdict,
                         reason=f"version {candidate.version} is already the champion")
    rows = None
    if data is None:
        candidate_auc = recorded(client, name, candidate)
        champion_auc = None if champion is None else recorded(client, name, champion)
    else:
        try:
            scored = recomputed_auc(client, tracking_uri, name, candidate, "candidate", data, split)
        except UserError as err:  # refused, not an error of the gate: recorded like any refusal
            return refuse(client, Promotion(promoted=False, candidate_auc=None, champion_auc=None,
                                            **verdict, reason=str(err)))
        candidate_auc, rows = scored.auc, scored.rows
        champion_auc = None if champion is None else recomputed_auc(
            client, tracking_uri, name, champion, "champion", data, split).auc
    where = f" on {rows} rows of {data}/{split}" if data is not None else " (recorded AUCs)"
    promoted, reason = decide(candidate_auc, champion_auc, min_gain, (verdict["candidate_version"],
                                                                      verdict["champion_version"]), where)
    result = Promotion(promoted=promoted, candidate_auc=candidate_auc, champion_auc=champion_auc, rows=rows,
                       **verdict, reason=reason)
    if not promoted:
        return refuse(client, result)
    client.set_registered_model_alias(name, CHAMPION, candidate.version)
    client.set_model_version_tag(name, candidate.version, "ctrflow.promotion", reason)
    return result


def refuse(client: MlflowClient, verdict: Promotion) -> Promotion:
    """Tag the refused candidate version with the reason (the aliases stay); returns the verdict."""
    client.set_model_version_tag(verdict.model, verdict.candidate_version, "ctrflow.promotion",
                                 f"refused: {verdict.reason}"[:5000])  # MLflow caps a tag's value
    return verdict
