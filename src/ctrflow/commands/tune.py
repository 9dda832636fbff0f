"""`ctrflow tune`: an Optuna study over `ctrflow train` runs; best.yaml, trials.csv and plots in --out.

Each trial is `ctrflow train --config OUT/trials/<n>/trial.yaml` (the base `--config` with the trial's
sampled values over it), `--parallel` at a time. The study lives in `--storage` (default
`sqlite:///OUT/study.db`): running the same command again continues it.
"""

from __future__ import annotations

import argparse
import sys

from ctrflow.tracking import add_tracking_flags


def configure(parser: argparse.ArgumentParser) -> None:
    """Flags of `ctrflow tune`."""
    from ctrflow.config.files import preset_names
    from ctrflow.models import MODELS

    parser.add_argument("--data", required=True, metavar="DIR", help="processed data (ctrflow preprocess --out), "
                                                                      "with a validation split")
    parser.add_argument("--model", choices=list(MODELS), default=None, help="ranking model (default: the --config's)")
    parser.add_argument("--space", required=True, metavar="FILE",
                        help="search space YAML: config fields (lr, optim.lr, embedding_dim, ...) or freq_threshold "
                             "to {low, high[, log][, step]} or {choices: [...]}")
    parser.add_argument("--trials", type=int, default=16, metavar="N", help="trials in the study (default 16)")
    parser.add_argument("--parallel", type=int, default=1, metavar="P",
                        help="trials at once, each a process with 1/P of the CPU threads or of the GPUs (default 1)")
    parser.add_argument("--out", required=True, metavar="DIR", help="study folder: trials/, best.yaml, trials.csv, "
                                                                     "plots/, study.db")
    parser.add_argument("--budget-minutes", type=float, default=None, metavar="T",
                        help="start no trial after T minutes (running ones finish)")
    parser.add_argument("--config", default=None, metavar="FILE|PRESET",
                        help="base training config every trial starts from (presets: " + ", ".join(preset_names())
                             + ")")
    parser.add_argument("--storage", default=None, metavar="URL",
                        help="Optuna storage shared by workers (default: sqlite:///OUT/study.db)")
    parser.add_argument("--study", default="ctrflow-tune", metavar="NAME", help="study name in the storage")
    parser.add_argument("--sampler", choices=("tpe", "random"), default="tpe", help="how trials are drawn")
    parser.add_argument("--pruner", choices=("median", "hyperband", "successive-halving", "none"), default="median",
                        help="how trials are stopped early from their validation metrics (default median)")
    parser.add_argument("--keep-best", type=int, default=3, metavar="K",
                        help="checkpoints kept for the best K trials (default 3)")
    parser.add_argument("--metric", choices=("auc", "logloss"), default="auc",
                        help="validation metric optimized (auc up, logloss down)")
    parser.add_argument("--evals-per-epoch", type=int, default=4, metavar="E",
                        help="validations per epoch of each trial: the steps the pruner compares (default 4)")
    add_tracking_flags(parser)


def run(args: argparse.Namespace) -> int:
    """Check every input, run the study, write its results; prints one line per trial and the best."""
    from ctrflow.tune.run import TuneOptions, check_options, prepare, tune

    options = TuneOptions(trials=args.trials, parallel=args.parallel, budget_minutes=args.budget_minutes,
                          storage=args.storage, study=args.study, sampler=args.sampler, pruner=args.pruner,
                          keep_best=args.keep_best)
    check_options(options)
    settings = prepare(args.data, args.space, args.out, args.model, args.config, args.metric, args.evals_per_epoch)
    tags = dict(t.split("=", 1) for t in args.tag)
    tracking = {"uri": args.tracking_uri, "experiment": args.experiment, "parent_run_id": args.parent_run_id,
                "tags": tags}
    try:
        result = tune(settings, options, tracking, log=lambda line: print(f"ctrflow tune: {line}", flush=True))
    except KeyboardInterrupt:
        print("ctrflow tune: interrupted; the same command continues the study", file=sys.stderr)
        return 130
    states = ", ".join(f"{n} {s.lower()}" for s, n in sorted(result["states"].items()))
    best = result["best_trial"]
    metric = settings.metric
    if best is None:
        print(f"ctrflow tune: {states}; no trial completed")
        return 1
    print(f"ctrflow tune: {states}; best trial {best}: {metric} {result[f'best_{metric}']:.6f} "
          f"{result['best_params']}\nctrflow tune: wrote {', '.join(result['files'])}")
    return 0
