"""Serve a policy checkpoint with Ray Serve behind the OpenAI API.

    python jobs/serve.py --checkpoint runs/rlep-pipeline-x/rlep/checkpoints/final
    python jobs/serve.py                      # the embedded tiny policy (built on first use)
    python jobs/serve.py --follow runs/rlep-1 # a training run's newest checkpoint, then each new one
    ray job submit --working-dir . -- python jobs/serve.py --checkpoint <folder on the cluster> --detach

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (streaming too),
GET /health, on http://<serve.host>:<serve.port> (127.0.0.1:8000 by default). With API
keys (`--serve.api_keys_file`, `RAYREP_SERVE_API_KEY`) every route but /health needs
`Authorization: Bearer <key>`; an address other machines reach is refused without one
(unless `--serve.allow_unauthenticated true`). Replicas,
autoscaling, per-replica concurrency and the caps on what a request may ask for are the
`serve.*` config fields. The job serves until it is interrupted (Ctrl-C, `ray job stop`),
then shuts Serve down; with --detach it deploys onto a running cluster and returns.

With --follow RUN_DIR the server waits for the run's first complete checkpoint, serves it
as `<run>/step-<N>` and switches to each newer one as training writes it (every
`serve.follow_every_s`), in place and without dropping a request; clients that ask for the
model `<run>` (or --name) always get the newest.

A run's checkpoint (and a followed run) is served with that run's config (device, dtype,
engine settings); any other folder with the default preset's, its own dtype, and a GPU
where this machine or cluster has one; `--preset` and fields on the command line go on top.
An engine that cannot hold one sequence of the served context, and GPU replicas the cluster
cannot place, are refused before anything starts (`--dry-run` prints the GPU memory plan).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path

from rayrep.cli import job_parser, parse_job_args, run_job
from rayrep.config import InputError


def served_base(args, config_args: list[str]) -> dict | None:
    """The config the command line's fields go on top of (`rayrep.serve.settings.serving_base`)."""
    from rayrep.config import DEFAULT_PRESET
    from rayrep.config.loading import cli_sources
    from rayrep.serve.settings import serving_base

    return serving_base(args.checkpoint, args.follow, preset_named=cli_sources(config_args)[0] != DEFAULT_PRESET)


def main(argv: list[str]) -> None:
    parser = job_parser(__doc__, trains=False, dry_run=False, base=served_base)
    parser.add_argument("--checkpoint", help="policy folder to serve (default: the config's model.path)")
    parser.add_argument("--follow", metavar="RUN_DIR",
                        help="serve this training run's newest checkpoint and switch to each new one as it is written")
    parser.add_argument("--name", help="model name clients ask for (default: named after the checkpoint, or the run)")
    parser.add_argument("--detach", action="store_true",
                        help="deploy onto the running cluster (RAY_ADDRESS) and return, leaving it serving")
    parser.add_argument("--dry-run", action="store_true", help="check the checkpoint, print the deployment, start nothing")
    args, cfg = parse_job_args(parser, argv)

    import os

    from rayrep.models import resolve_policy
    from rayrep.run.layout import RunFolder
    from rayrep.serve.app import build_app, check_checkpoint, deployment_options, model_name, served_context
    from rayrep.serve.keys import check_exposure, load_api_keys
    from rayrep.generator.engine import engine_description
    from rayrep.serve.settings import check_replicas_fit, check_serving_memory

    keys = load_api_keys(cfg.serve)  # before anything starts, as every other check
    warning = check_exposure(cfg.serve, keys)
    if args.follow:
        if args.checkpoint:
            raise InputError("--follow serves a run's checkpoints: give it or --checkpoint, not both")
        run = RunFolder(Path(args.follow))
        if not run.path.is_dir():
            raise InputError(f"--follow {args.follow}: no such run folder")
        if any(run.path.glob("*.safetensors")):
            raise InputError(f"--follow {args.follow}: a checkpoint, not a run's folder; serve it with --checkpoint")
        name = args.name or run.path.name
    else:
        checkpoint = args.checkpoint or resolve_policy(cfg)
        name = args.name or ("tiny" if not args.checkpoint and cfg.model.path == "tiny" else model_name(checkpoint))
    if args.detach and not os.environ.get("RAY_ADDRESS"):
        raise InputError("--detach needs a running cluster to leave the server on (RAY_ADDRESS, as under ray job submit)")
    if args.follow:
        checkpoint = first_checkpoint(run, cfg.serve.follow_every_s, waits=not args.dry_run)
        if checkpoint is None:
            print(f"would follow {run.path}: no complete checkpoint yet; the server would wait for the first")
            return
    check_checkpoint(checkpoint)
    context = served_context(cfg, checkpoint)
    plan = check_serving_memory(cfg, checkpoint, context)
    url = f"http://{cfg.serve.host}:{cfg.serve.port}/v1"
    access = f"{len(keys)} API key(s)" if keys else "no API key"
    if warning:
        print(warning, flush=True)
    what = f"{checkpoint} as {name!r}" if not args.follow else f"{run.path}'s checkpoints, now {checkpoint}, as {name!r}"
    if args.dry_run:
        print(f"would serve {what} at {url} (context {context} tokens, {access}; {cfg.placement.device}, "
              f"{cfg.model.dtype})")
        print(f"deployment: {deployment_options(cfg)}")
        print(engine_description(cfg))
        if plan is not None:
            print(plan.describe())
        return

    from rayrep.generator.engine import check_vllm_version

    check_vllm_version()  # before Ray starts: a replica would fail later, and less clearly
    import ray
    from ray import serve

    started_ray = not ray.is_initialized() and not os.environ.get("RAY_ADDRESS")
    # Ray's start-up notices only at ERROR: the terminal is for the server's own lines.
    if started_ray:
        ray.init(address="local", include_dashboard=False, logging_level=logging.ERROR)
    else:
        ray.init(ignore_reinit_error=True, logging_level=logging.ERROR)
    from rayrep.cluster.placement import cluster_capacity

    capacity, _, grows = cluster_capacity(cfg.placement.cluster_can_grow, cfg.placement.autoscaling_config)
    try:
        check_replicas_fit(cfg, capacity.get("GPU", 0.0), grows)
    except InputError:
        if started_ray:
            ray.shutdown()
        raise
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # `ray job stop` sends SIGTERM; set after ray.init, which sets its own
        signal.signal(sig, lambda *_: stop.set())
    deployed = False
    try:
        serve.start(http_options={"host": cfg.serve.host, "port": cfg.serve.port})
        source = str(run.path) if args.follow else checkpoint
        serve.run(build_app(cfg, source, name, keys, follow=bool(args.follow)), name="rayrep-policy",
                  route_prefix="/", blocking=False)
        deployed = True
        print(f"serving {what} at {url} (context {context} tokens, {access})", flush=True)
        auth = " -H 'Authorization: Bearer <key>'" if keys else ""
        print(f"  curl {url}/completions{auth} -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{name}\", \"prompt\": \"Q: 2+3=?\\nA: \", \"max_tokens\": 32}}'", flush=True)
        while not args.detach and not stop.is_set():
            time.sleep(0.5)
    finally:
        if not (args.detach and deployed):  # a failed deployment is taken down too
            print("shutting down the server", flush=True)
            serve.shutdown()
            if started_ray:
                ray.shutdown()
            print("server stopped", flush=True)


def first_checkpoint(run, every_s: float, waits: bool) -> str | None:
    """The run's newest complete checkpoint; if it has none yet, wait for one (`waits`: until
    interrupted), or give None."""
    newest = run.newest_checkpoint()
    if newest is None and waits:
        print(f"waiting for the first complete checkpoint of {run.path}", flush=True)
        while newest is None:
            time.sleep(every_s)
            newest = run.newest_checkpoint()
    return None if newest is None else str(newest)


if __name__ == "__main__":
    run_job(main)
