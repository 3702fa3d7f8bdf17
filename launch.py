"""Train a DFlash drafter: ``python launch.py --topology 2-2``.

Thin on purpose: parse arguments, build and check the config, hand over to the
supervisor. Bad input exits with status 2 and one line, before any actor starts.
"""

from __future__ import annotations

import argparse
import json
import sys

from dflash_actors.config import ConfigError, load_config
from dflash_actors.data import DatasetError

DEFAULT_CONFIG = "configs/default.yaml"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=DEFAULT_CONFIG, help="YAML config (default: %(default)s)")
    ap.add_argument("--topology", help="N-M: N target actors, M drafter actors (e.g. 2-2)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key, e.g. --set train.lr=3e-4 (repeatable)")
    ap.add_argument("--run-dir", help="where status.json, events.log and checkpoints go")
    ap.add_argument("--plan-only", action="store_true",
                    help="validate config and data, print the epoch plan, and exit")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    overrides = list(args.overrides)
    if args.run_dir:
        overrides.append(f"runtime.run_dir={args.run_dir}")
    try:
        cfg = load_config(args.config, overrides, topology=args.topology)
        from dflash_actors.preflight import preflight
        pre = preflight(cfg)
    except (ConfigError, DatasetError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stats = pre.plan0.stats(pre.dataset.lengths, cfg.batching.token_budget)
    print(json.dumps({"dataset": str(pre.train_path), "samples": len(pre.dataset),
                      "tokens": pre.dataset.num_tokens, "truncated": pre.dataset.n_truncated,
                      "dropped": pre.dataset.n_dropped, "targets": pre.devices.targets,
                      "drafters": pre.devices.drafters, "epoch0": stats}))
    if args.plan_only:
        return 0
    print("error: the training pipeline is not built yet (issue #5); use --plan-only", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
