"""Named replay pools that outlive runs: start, inspect, snapshot, export, import, stop.

    ray start --head                                              # a cluster the pool lives on
    python jobs/pool.py start --name shared --snapshot-dir pools/shared --shards 2 [--from pool.parquet | --from-run RUN_DIR]
    python jobs/train.py --algorithm.name rlep --replay.pool shared  # runs attach instead of starting shards
    python jobs/pool.py stats --name shared
    python jobs/pool.py snapshot --name shared
    python jobs/pool.py export --name shared --out shared.parquet
    python jobs/pool.py import --name shared pool.parquet runs/exgrpo-x other-snapshot/
    python jobs/pool.py stop --name shared                        # snapshot, then stop; start again from --snapshot-dir

A pool's shards are detached Ray actors (namespace `rayrep-pools`): they stay up when this
command ends, on the cluster it joined (RAY_ADDRESS, or the one `ray start` runs here). Each
keeps a snapshot and a journal of its writes in the snapshot folder, so a shard that dies
comes back with every write it answered, and a pool stopped (or lost with its cluster) starts
again from that folder as it was. See docs/pool.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def connect() -> None:
    """Join the running cluster (RAY_ADDRESS, else the one on this machine): a pool outlives
    jobs only on a cluster that does."""
    import ray

    try:
        ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=False, logging_level="ERROR")
    except ConnectionError as err:
        sys.exit(f"jobs/pool.py: no Ray cluster to keep a pool on ({err}); start one with `ray start --head`, "
                 f"or set RAY_ADDRESS")


def main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    start = commands.add_parser("start", help="start a pool (empty, or from its snapshot folder, or from a file)")
    start.add_argument("--snapshot-dir", required=True, help="folder the pool keeps its snapshots and journals in")
    start.add_argument("--shards", type=int, default=2, help="shard actors (questions routed by a stable hash)")
    start.add_argument("--cap", type=int, default=0, help="stored answers kept per question, oldest evicted (0: all)")
    start.add_argument("--from", dest="source", help="fill it from a Parquet pool or a buffer snapshot folder")
    start.add_argument("--from-run", help="fill it from a run's folder (its buffer's last snapshot)")
    commands.add_parser("stop", help="snapshot the pool, then stop its shards")
    commands.add_parser("stats", help="questions, answers, bytes; answers by source, run and policy version")
    commands.add_parser("snapshot", help="write every shard's snapshot now (and start new journals)")
    export = commands.add_parser("export", help="every stored answer as one Parquet experience pool")
    export.add_argument("--out", required=True, help="the .parquet file to write")
    imports = commands.add_parser("import", help="add Parquet pools, buffer snapshots, runs' snapshots, or "
                                                  "another model's text traces")
    imports.add_argument("sources", nargs="*", help="pool .parquet files, snapshot folders, run folders")
    imports.add_argument("--text", nargs="+", default=[], metavar="FILE",
                         help="text pools (verl/DAPO rows with reward_model.candidates): verified, encoded and "
                              "scored by --policy, marked external")
    imports.add_argument("--policy", help="the policy whose tokenizer encodes and whose log-probs score text "
                                          "traces (default: the preset's model)")
    imports.add_argument("--preset", default="tiny-cpu", help="config preset for the text traces' lengths, "
                                                               "temperature and verifier (default tiny-cpu)")
    imports.add_argument("--writer", default="", help="the model that wrote the text traces (their origin)")
    for command in commands.choices.values():
        command.add_argument("--name", required=True, help="the pool's name")
    args = parser.parse_args(argv)

    from rayrep.buffer.pool import (check_pool_settings, export_pool, import_into, read_source, snapshot_pool,
                                    start_pool, stop_pool)
    from rayrep.buffer.replay import AttachedPool

    paths = []
    if args.command == "start":
        if args.source and args.from_run:
            parser.error("start: --from and --from-run are two sources; give one (import adds more)")
        check_pool_settings(args.name, args.shards, args.cap)
        paths = [args.source or args.from_run] if args.source or args.from_run else []
    elif args.command == "import":
        paths = args.sources
    # Every source is read (and a text pool verified and scored) before anything starts or is
    # written: a bad one fails the command with the pool as it was.
    sources = [read_source(path) for path in paths]
    texts = []
    if args.command == "import" and args.text:
        from rayrep.config import load_preset
        from rayrep.models import resolve_policy
        from rayrep.pipelines.text_import import read_text

        cfg = load_preset(args.preset)
        policy = args.policy or resolve_policy(cfg, log=lambda _: None)
        texts = [read_text(cfg, policy, text, args.writer, log=lambda _: None) for text in args.text]
    connect()
    if args.command == "start":
        shards = start_pool(args.name, args.snapshot_dir, args.shards, args.cap)
        result = {"name": args.name, "shards": len(shards), "snapshot_dir": os.path.abspath(args.snapshot_dir)}
        if sources:
            result["imported"] = import_into(AttachedPool(args.name, writer="import"), sources[0])
    elif args.command == "stop":
        result = {"name": args.name, "version": stop_pool(args.name)}
    else:
        pool = AttachedPool(args.name, writer=args.command)
        if args.command == "stats":
            stats = pool.stats()
            result = {"name": args.name, **{k: stats[k] for k in ("questions", "answers", "retired", "evicted", "bytes")},
                      "buckets": stats["buckets"], **pool.census()}
        elif args.command == "snapshot":
            result = {"name": args.name, "version": snapshot_pool(args.name)}
        elif args.command == "export":
            result = export_pool(pool, args.out)
        else:
            result = {"name": args.name, "imported": [import_into(pool, source) for source in sources]}
            for text, counts in texts:
                result["imported"].append({**import_into(pool, text), **counts})
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    from rayrep.errors import InputError

    try:
        main(sys.argv[1:])
    except InputError as err:
        sys.exit(f"jobs/pool.py: {err}")
