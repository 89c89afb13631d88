"""Job command lines: a job's own flags beside any config field, `--help` with the chosen
preset's values, `--dry-run` (the placement and memory plans, nothing started), and the
entry point that turns bad input into a one-line message and exit status 2."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rayrep.cluster.memory import memory_plan
from rayrep.config import DEFAULT_PRESET, Config, ConfigError, help_text, load_preset, parse_cli
from rayrep.config.fields import get_dotted
from rayrep.config.loading import cli_sources
from rayrep.errors import InputError
from rayrep.generator.engine import cpu_engine_batch, engine_description
from rayrep.learner import LearnerDied
from rayrep.run.layout import RunFolder


def resume_base(run_dir: str) -> dict:
    """A stopped run's saved config (`RUN_DIR/config.json`), pointed at that folder."""
    path = RunFolder(Path(run_dir)).config
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"--resume {run_dir}: {path} is not a run's config ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--resume {run_dir}: {path} is not a run's config")
    folder = Path(run_dir).resolve()
    data.setdefault("logging", {}).update(out_dir=str(folder.parent), run_name=folder.name)
    return data


def job_parser(description: str, trains: bool = True, dry_run: bool = True,
               sets: dict[str, tuple[Any, str]] | None = None,
               base: Callable[[argparse.Namespace, list[str]], dict | None] | None = None):
    """An argparse parser for a job's own flags; config fields go to `parse_job_args`.

    Every job takes `--dry-run`: print the placement plan and, for a GPU run, the memory
    plan, then stop, starting nothing (exit 2 when the plan cannot fit). `trains`: the job
    starts learners (a training run), not only generators and verifiers. `dry_run=False`:
    the job has no such plan and defines its own `--dry-run` (the server). `sets`: config
    fields the job sets itself, each as (its value, how the job sets it); value None: the
    job sets it stage by stage (the pipelines). The user's other value is refused. `base`:
    (the job's flags, the config arguments) -> the config the command line's fields go on
    top of, in place of the preset (None: the preset); the server's is the served run's.
    """
    parser = argparse.ArgumentParser(
        description=description,
        epilog=_EPILOG + help_text(load_preset(), f"preset {DEFAULT_PRESET}"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if dry_run:
        parser.add_argument("--dry-run", action="store_true",
                            help="print the placement plan and the per-GPU memory plan, start nothing")
    if trains:
        parser.add_argument("--resume", nargs="?", const="", metavar="RUN_DIR",
                            help="continue a stopped run from its latest complete checkpoint: the run in "
                                 "RUN_DIR (its config.json, then any overrides given here), or without "
                                 "RUN_DIR the one --logging.run_name names")
        parser.add_argument("--auto-resume", nargs="?", type=int, const=3, default=0, metavar="N",
                            help="when a learner dies, continue the run from its latest complete checkpoint "
                                 "on its own, up to N times (default 3); without it the job stops and says "
                                 "how to resume")
    parser.set_defaults(trains=trains, plans=dry_run, sets=sets or {}, base=base)
    return parser


_EPILOG = "Any config field can be set too, e.g. --preset tiny-cpu --learner.lr 1e-5.\n\n"


def _help_config(argv: list[str]) -> tuple[Config, str]:
    """The config that `--help` describes, and where it comes from: the `--preset` and
    `--config` files of `argv` (the default preset when they do not load)."""
    preset, files, args = DEFAULT_PRESET, [], list(argv)
    while args:
        key, has_value, value = args.pop(0).partition("=")
        if key in ("--preset", "--config"):
            if not has_value:
                value = args.pop(0) if args else ""
            if key == "--preset":
                preset = value
            else:
                files.append(value)
    try:
        return parse_cli(["--preset", preset, *[arg for path in files for arg in ("--config", path)]]), \
            " + ".join([f"preset {preset}", *files])
    except ConfigError:
        return load_preset(), f"preset {DEFAULT_PRESET}"


def _apply_job_sets(parser, cfg: Config, user: dict) -> Config:
    """The fields the job sets itself (`job_parser(sets=...)`), set; a value the user gives
    one of them on the command line or in a `--config` file, other than the job's own, is
    refused rather than silently replaced. (A preset's or a resumed run's value is not the
    user's word: `jobs/grpo.py --preset qwen2.5-math-7b-rlep` is that preset's baseline.)
    `user`: what the command line and its config files set (`cli_sources`)."""
    for name, (value, how) in parser.get_default("sets").items():
        try:
            given = get_dotted(user, name)
        except (KeyError, TypeError):
            continue
        if value is None or given != value:
            raise ConfigError(f"{name} = {given!r}: {parser.prog} sets it itself ({how}); leave it out")
    return cfg.replace(**{name: value for name, (value, _) in parser.get_default("sets").items() if value is not None})


def _apply_algorithm_settings(cfg: Config, user: dict) -> Config:
    """What the chosen algorithm needs (its class's `settings`: ExGRPO's advantage without the
    std scaling), over the preset's values; a value the user gives on the command line or in
    a `--config` file stays, and the algorithm's own check refuses it if it cannot work."""
    from rayrep.algos.registry import algorithm_class  # (torch and Ray: once the command line holds)

    needed = {}
    for name, value in algorithm_class(cfg).settings.items():
        try:
            get_dotted(user, name)
        except (KeyError, TypeError):
            needed[name] = value
    return cfg.replace(**needed) if needed else cfg


def parse_job_args(parser, argv: list[str] | None = None):
    """(job flags, Config): the job's own flags, then the config from everything else.

    A config error exits with status 2 and the message, before anything starts; so does
    `--dry-run`, after printing the plans (status 0 when they fit).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:  # the values the chosen preset (and config files) set
        parser.epilog = _EPILOG + help_text(*_help_config(argv))
    args, rest = parser.parse_known_args(argv)
    try:
        base = resume_base(args.resume) if getattr(args, "resume", None) else None
        if base is None and parser.get_default("base") is not None:
            base = parser.get_default("base")(args, rest)
        cfg = parse_cli(rest, base=base)
        _, user = cli_sources(rest)  # the user's own word, which the job's and the algorithm's settings respect
        cfg = _apply_job_sets(parser, cfg, user)
        if base is None:  # (a resumed run's config.json is whole already)
            cfg = _apply_algorithm_settings(cfg, user)
        if getattr(args, "auto_resume", 0) < 0:
            raise ConfigError(f"--auto-resume {args.auto_resume}: the number of restarts cannot be negative")
        if getattr(args, "resume", None) == "" and not cfg.logging.run_name:
            raise ConfigError("--resume without a RUN_DIR needs --logging.run_name to name the run "
                              "(a pipeline: --resume <its folder>)")
    except ConfigError as err:
        parser.exit(2, f"{parser.prog}: config error: {err}\n")
    if args.plans and args.dry_run:
        from rayrep.roles.system import run_plan  # (torch and Ray: not for --help or a config error)

        lines = [run_plan(cfg, train=args.trains).describe(), engine_description(cfg)]
        plan = memory_plan(cfg, trains=args.trains)
        if plan is None:
            lines.append("memory plan: only for GPU runs of a known model (CPU run, or config.json not at hand)")
        else:
            lines.append(plan.describe())
        print("\n".join(lines))
        waves = cpu_engine_batch(cfg, cfg.model.path) if cfg.placement.device == "cpu" and args.trains else None
        parser.exit(2 if plan is not None and plan.problems() or waves and waves.problem() else 0)
    return args, cfg


def run_job(main: Callable[[list[str]], object]) -> None:
    """A job's entry point: `main(sys.argv[1:])`. Bad input (an `InputError`: a config value,
    a prompt file, a pool, one of their rows) ends the job with its one-line message and
    exit status 2, not a traceback; a learner's death (`LearnerDied`) with its message (what
    died, the checkpoint left, how to resume) and status 1."""
    try:
        main(sys.argv[1:])
    except InputError as err:
        print(f"{Path(sys.argv[0]).name}: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except LearnerDied as death:  # its message says what happened and what to do
        print(f"{Path(sys.argv[0]).name}: {death}", file=sys.stderr)
        raise SystemExit(1) from None