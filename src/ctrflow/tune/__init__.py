"""Hyperparameter tuning: `ctrflow tune`, an Optuna study whose trials are real `ctrflow train` runs.

The parts:
- `space`: the search space file (config fields to ranges or choices, plus `freq_threshold`);
- `view`: another frequency threshold as a processed-data view (the vocabularies' prefixes);
- `trial`: one trial's config file and its `ctrflow train` process, watched through its metrics.jsonl;
- `study`: the study in an Optuna storage, its sampler and pruner, the recovery of interrupted trials;
- `runner`: `run_trials`, which keeps P trials running (what one worker does);
- `results`: best.yaml, trials.csv, the plots, the checkpoints kept;
- `tracking`: the study's MLflow parent run and a child run per trial;
- `report`: what a training run reports to Vertex AI or Katib (`ctrflow train --report-metrics`).

Design choices:
- **A trial is a process**, `python -m ctrflow train --config trials/<n>/trial.yaml`: the exact run
  `best.yaml` repeats. P run at a time, with the CPU threads (`--threads`) or the GPUs
  (`CUDA_VISIBLE_DEVICES`) split between them; a trial dies with the tuning process that started it.
- **Pruning is decided by the tuning process**, which reads each trial's `metrics.jsonl` as it grows:
  every validation record becomes `trial.report(value, k)` (k: the validation's number; every trial
  validates `evals_per_epoch` times an epoch, so the k-th comes after the same share of the data
  whatever the batch size) and a `should_prune()` verdict stops the process (SIGTERM). The training
  process imports no Optuna and needs no access to the study's storage (no database driver or
  credentials in the trial, one writer per worker on a SQLite file); the loop knows only the
  metrics file it always writes, and services that stop trials from outside (Katib's early stopping,
  Vertex) work the same way. The cost is a poll interval (0.2 s) of training past a verdict.
- **The study lives in its storage** (default `sqlite:///OUT/study.db`): a new `ctrflow tune` on the
  same storage and study continues it. Finished trials stay; a trial left RUNNING by a tuning process
  that is gone (a PID on this host that no longer runs, or a heartbeat older than its grace period,
  for workers elsewhere) is marked FAIL as interrupted and its parameters are queued again. So several
  workers (e.g. pipeline tasks) can share one study through a database URL: `run_trials` is the unit
  each of them runs.
"""
