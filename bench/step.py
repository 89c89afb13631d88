"""Where a training step's time goes, how fast weights sync, and what replay costs per step.

    python bench/step.py [--steps 8] [--rounds 2] [--algorithms grpo,rlep,exgrpo] [config overrides...]
    python bench/step.py --max-policy-lag 0 1 2 --placement.mode disaggregated   # asynchronous rollouts

Runs short runs of each algorithm on a local Ray cluster, in rounds (every algorithm once
per round, the order rotated each round, since this machine's speed drifts), and prints
for each the share of every phase in the step time (median over steps, the first step of
each run left out as warm-up), its median step time and trained tokens per step as
ratios to the baseline's measured in the same run, then the weight-sync rate next to the
rate of a plain in-memory copy of the same bytes, and their ratio.

RLEP replays a pool collected from the base policy first (the preset's samples per
question); ExGRPO starts collecting at once (start_pass_rate 0) so that its steps mix in
replayed questions.

`--max-policy-lag 0 1 2`: the first algorithm at each lag instead (`run.max_policy_lag`;
the generators sample the next steps while the learners update), compared with lag 0. Its
`generate` phase is the wait for the round's answers: what the update did not hide.
`--vary FIELD V1 V2 ...` does the same for any config field, e.g. `--vary
learner.micro_batch_tokens 0 2048` (each variant's share of padding in the update is
printed too), or for several at once, comma-separated: `--vary
generator.num_workers,learner.num_workers 1,1 2,2`. Verification overlapping generation: `--vary generator.answer_parts 1 8`
(`verify` is then the wait for verdicts after the last answers), or `--overlap`: a step's
rollouts alone (no learner), scored after the last answer or part by part as the answers
arrive, alternating. Long answers of varied lengths: `--generator.temperature 2
--generator.min_response_tokens 512 --generator.max_response_tokens 1024
--model.max_position_embeddings 1152`.

Last, the learner against plain PyTorch (`--learner-only`: that alone): one step's rows
(the task's first questions, `algorithm.group_size` answers each, of 10-36 random tokens:
the tiny policy's answers average 23) trained by a learner group as a run trains them, and
by a plain loop in this process over the same rows, micro-batches and loss (forward, the
same log-prob and loss functions, backward; clip and AdamW per mini-batch), with as many
threads; no actor, no sharding, no old-log-prob pass, no metrics. Alternating, trained
tokens per second of each and their ratio.
"""

import statistics
import sys
import time
from pathlib import Path

import torch

from rayrep.run.layout import RunFolder

from rayrep.cli import job_parser, parse_job_args
from rayrep.config import parse_cli
from rayrep.config.fields import get_dotted
from rayrep.run.phases import NESTED_PHASES, PHASES
from rayrep.run.log import read_metrics


def in_memory_copy_gbps(num_bytes: int, repeats: int = 20) -> float:
    source = torch.empty(num_bytes, dtype=torch.uint8).random_()
    target = torch.empty_like(source)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - start)
    return num_bytes / statistics.median(times) / 1e9


def trained_tokens(record: dict) -> float:
    return record.get("fresh_tokens", 0.0) + record.get("replay_tokens", 0.0)


def measured_steps(run_dir: Path) -> list[dict]:
    records = [r for r in read_metrics(RunFolder(run_dir).metrics) if r["step"] >= 2 and "time_step" in r]
    for r in records:
        for nested, parent in NESTED_PHASES.items():  # the learners' passes inside the update (and the build)
            r[f"time_{parent}"] = r.get(f"time_{parent}", 0.0) - r.get(f"time_{nested}", 0.0)
    return records


def parsed(fields: list[str], texts: list[str], cfg) -> dict:
    """`texts` as the command line reads values of the config `fields` (each its own type),
    together on top of `cfg` (a value may need others to be valid)."""
    read = parse_cli([arg for field, text in zip(fields, texts) for arg in (f"--{field}", text)], base=cfg.to_dict())
    return {field: get_dotted(read, field) for field in fields}


def main(argv=None):
    parser = job_parser(__doc__)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each algorithm, in a rotated order each round")
    parser.add_argument("--algorithms", default="grpo,rlep,exgrpo")
    parser.add_argument("--max-policy-lag", type=int, nargs="+", metavar="N",
                        help="compare these run.max_policy_lag values of the first algorithm instead")
    parser.add_argument("--vary", nargs="+", metavar=("FIELD", "VALUE"),
                        help="compare these values of one config field for the first algorithm instead")
    parser.add_argument("--learner-only", action="store_true", help="only the learner against plain PyTorch")
    parser.add_argument("--overlap", action="store_true",
                        help="only a step's rollouts, scored after the last answer or as parts arrive")
    args, cfg = parse_job_args(parser, argv)
    stamp = int(time.time())
    cfg = cfg.replace(**{"run.steps": args.steps, "run.eval_every": 0, "logging.out_dir": f"runs/bench-step-{stamp}"})

    from rayrep.models import resolve_policy
    from rayrep.pipelines.collect import collect_pool
    from rayrep.train import train

    if args.learner_only:
        learner_against_plain(cfg, resolve_policy(cfg, log=lambda _: None), max(4, args.rounds))
        return
    if args.overlap:
        scoring_overlap(cfg, resolve_policy(cfg, log=lambda _: None), max(4, args.rounds))
        return
    names = args.algorithms.split(",")
    variants = {
        "grpo": {"algorithm.name": "grpo"},
        "rlep": {"algorithm.name": "rlep"},
        "exgrpo": {"algorithm.name": "exgrpo", "algorithm.std_normalize": False, "algorithm.exgrpo.start_pass_rate": 0.0},
    }
    if args.max_policy_lag:
        args.vary = ["run.max_policy_lag", *map(str, args.max_policy_lag)]
    if args.vary:
        if len(args.vary) < 2:
            parser.error("--vary takes a config field and at least one value")
        fields, values = args.vary[0].split(","), [value.split(",") for value in args.vary[1:]]
        if any(len(value) != len(fields) for value in values):
            parser.error(f"--vary {args.vary[0]}: each value names {len(fields)} values, comma-separated")
        algorithm = variants[names[0]]
        names = [",".join(f"{field.rsplit('.', 1)[-1]}={v}" for field, v in zip(fields, value)) for value in values]
        variants = {name: {**algorithm, **parsed(fields, value, cfg)} for name, value in zip(names, values)}
    if any(variants[name]["algorithm.name"] == "rlep" for name in names):
        pool_cfg = cfg.replace(**{"algorithm.rlep.collect_questions": args.steps * cfg.algorithm.prompts_per_step})
        pool = collect_pool(pool_cfg, resolve_policy(cfg), f"{cfg.logging.out_dir}/pool.parquet", log=lambda _: None)
        for name in names:
            if variants[name]["algorithm.name"] == "rlep":
                variants[name]["algorithm.rlep.pool"] = pool["pool"]
    # The machine's speed drifts: each round runs every algorithm once, in a rotated order,
    # and the medians pool every round's steps.
    results: dict[str, list[dict]] = {name: [] for name in names}
    for round_index in range(args.rounds):
        for name in names[round_index % len(names):] + names[: round_index % len(names)]:
            run_cfg = cfg.replace(**{**variants[name], "logging.run_name": f"{name}-{round_index}"})
            results[name] += measured_steps(train(run_cfg, log=lambda _: None).run_dir)

    baseline = names[0]
    base_step = statistics.median(r["time_step"] for r in results[baseline])
    base_tokens = statistics.median(trained_tokens(r) for r in results[baseline])
    for name, records in results.items():
        step_time = statistics.median(r["time_step"] for r in records)
        tokens = statistics.median(trained_tokens(r) for r in records)
        print(f"\n{name}: {len(records)} steps measured over {args.rounds} rounds, median step {step_time:.2f} s "
              f"({step_time / base_step:.3f}x the {baseline} step); trained tokens per step {tokens:.0f} "
              f"({tokens / base_tokens:.3f}x)")
        print(f"{'phase':<14}{'median s':>10}{'share':>8}")
        for phase in PHASES:
            seconds = statistics.median(r.get(f"time_{phase}", 0.0) for r in records)
            print(f"{phase:<14}{seconds:>10.3f}{100 * seconds / step_time:>7.1f}%")
        print(f"replayed answers: {100 * statistics.median(r['replay_share'] for r in records):.1f}% of the batch; "
              f"replayed questions per step: {statistics.median(r['replayed_questions'] for r in records):.0f}")
        rollouts = statistics.median(r.get("time_generate", 0.0) + r.get("time_verify", 0.0) for r in records)
        print(f"rollouts (generate + verify): {rollouts:.3f} s, {100 * rollouts / step_time:.1f}% of the step")
        generated = statistics.median(r["generated_tokens"] for r in records)
        per_second = statistics.median(r["generated_tokens"] / r["time_step"] for r in records)
        print(f"generated tokens per step {generated:.0f}, per second of step {per_second:.0f}; sampled by an older "
              f"policy than the one that finished their answer (partial rollouts): "
              f"{100 * statistics.mean(r.get('fresh_earlier_token_share', 0.0) for r in records):.1f}% of the trained "
              f"fresh tokens; questions asked again at a checkpoint: "
              f"{sum(r.get('partial_groups_asked_again', 0) for r in records)}")
        print(f"fresh answers' policy lag: mean {statistics.mean(r.get('fresh_lag_mean', 0.0) for r in records):.2f}, "
              f"max {max(r.get('fresh_lag_max', 0) for r in records)}; padding in the update: "
              f"{100 * statistics.median(r.get('padding_frac', 0.0) for r in records):.1f}% of computed positions")

    records = results[baseline]
    size = records[-1]["sync_bytes"]
    sync = statistics.median(r["sync_gbps"] for r in records)
    copy = in_memory_copy_gbps(size)
    print(f"\nweight sync of {size / 1e6:.1f} MB: {sync:.3f} GB/s; in-memory copy of the same bytes: "
          f"{copy:.2f} GB/s; ratio sync/copy = {sync / copy:.4f}")
    print(f"generated tokens/s (median): {statistics.median(r['tokens_per_second'] for r in records):.0f}")
    if not args.vary:  # (a knob's comparison does not need it)
        learner_against_plain(cfg, resolve_policy(cfg, log=lambda _: None), max(4, args.rounds))


def one_step_of_rows(cfg, policy: str):
    """A TrainBatch shaped as one step of `cfg`: real prompts, random answers of 10-36 tokens."""
    import random

    from transformers import AutoTokenizer

    from rayrep.data import encode_prompts, load_split
    from rayrep.types import TrainBatch

    algo, rng = cfg.algorithm, random.Random(0)
    prompts = encode_prompts(AutoTokenizer.from_pretrained(policy), load_split(cfg.data, "train")[: algo.prompts_per_step],
                             cfg.data.max_prompt_tokens)
    rows = [(q, ids, [rng.randrange(3, 259) for _ in range(rng.randint(10, 36))])
            for q, ids in enumerate(prompts) for _ in range(algo.group_size)]
    return TrainBatch.of_sequences([p for _, p, _ in rows], [r for _, _, r in rows], [q for q, _, _ in rows],
                                   logprobs=[[-3.0] * len(r) for _, _, r in rows],
                                   advantages=[rng.uniform(-1.5, 1.5) for _ in rows], recompute_old=[True] * len(rows))


def plain_update(model, optimizer, batch, cfg, loss) -> None:
    """The update as plain PyTorch does it: per mini-batch, forward and backward of each
    micro-batch (old log-probs: the pass's own), then clip and step."""
    from rayrep.learner.logprobs import token_logprobs
    from rayrep.learner.loss import mini_batch_totals, policy_loss
    from rayrep.learner.forward import mini_batches, questions_by_length, rows_per_rank

    learner = cfg.learner
    for prompts in mini_batches(batch.num_prompts, learner.mini_batch_prompts):
        rows = rows_per_rank(batch.prompt_index, prompts, 1)[0]
        totals = mini_batch_totals(batch.response_mask[rows], loss.agg, learner.micro_batch_size)
        count = max(1, -(-len(rows) // learner.micro_batch_size))
        for chunk in questions_by_length(rows, batch.prompt_index, batch.lengths, count):
            width = int(batch.lengths[chunk].max())
            ids = batch.input_ids[chunk, :width]
            attention = torch.arange(width)[None, :] < batch.lengths[chunk, None]
            logits = model(input_ids=ids, attention_mask=attention.long()).logits
            logp, entropy = token_logprobs(logits, ids, batch.temperature, "detached", learner.logit_chunk_tokens)
            value, _ = policy_loss(logp, logp.detach(), batch.advantages[chunk], batch.response_mask[chunk, :width], loss,
                                   entropy=entropy, totals=totals)
            value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), learner.grad_clip or float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def scoring_overlap(cfg, policy: str, rounds: int) -> None:
    """A step's rollouts on the config's generators and verifiers (no learner), three ways,
    alternating, each round with new seeds: each share whole, scored after its last answer
    (`generator.answer_parts` 1); in 8 parts, scored after the last; in 8 parts, each scored
    as it arrives (8, as a run does it). Median seconds to the last answer and to the last
    verdict, and the latter against the first way's."""
    import ray
    from transformers import AutoTokenizer

    from rayrep.cluster.placement import Placement, make_plan
    from rayrep.data import encode_prompts, load_split
    from rayrep.generator.group import GeneratorGroup
    from rayrep.verifier.group import VerifierGroup

    algo, gen = cfg.algorithm, cfg.generator
    prompts = load_split(cfg.data, "train")[: algo.prompts_per_step]
    prompt_ids = encode_prompts(AutoTokenizer.from_pretrained(policy), prompts, cfg.data.max_prompt_tokens)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    placement = Placement(make_plan(cfg, learners=False))
    generators, verifiers = GeneratorGroup.create(cfg, policy, placement), VerifierGroup.create(cfg, placement)

    def rollouts(parts: int, as_they_come: bool, round_index: int) -> tuple[float, float, int]:
        checking = verifiers.checking(prompts)
        start = time.perf_counter()
        shares = generators.generate(prompt_ids, n=algo.group_size, temperature=gen.temperature, top_p=gen.top_p,
                                     max_tokens=gen.max_response_tokens, parts=parts,
                                     seeds=cfg.sampling_seeds(f"overlap-{round_index}", len(prompt_ids)))
        arrived, sampled = generators.complete(shares, on_arrival=checking.send if as_they_come else None)
        answers = time.perf_counter() - start
        for part in [] if as_they_come else arrived:
            checking.send(part)
        checking.result()
        return answers, time.perf_counter() - start, sum(len(r.response_ids) for group in sampled for r in group)

    ways = {"whole, scored after": (1, False), "8 parts, scored after": (8, False),
            "8 parts, as they come": (8, True)}
    times: dict[str, list[tuple[float, float, int]]] = {name: [] for name in ways}
    try:
        for way in ways.values():  # warm-up
            rollouts(*way, round_index=-1)
        for round_index in range(rounds):
            for name, way in ways.items():
                times[name].append(rollouts(*way, round_index=round_index))
    finally:
        verifiers.shutdown()
        placement.remove()
        ray.shutdown()
    answers = len(prompt_ids) * algo.group_size
    tokens = statistics.median(t[2] for t in times["whole, scored after"]) / answers
    print(f"\n{len(prompt_ids)} prompts x {algo.group_size} answers ({tokens:.0f} tokens each on average), "
          f"{rounds} rounds alternating; median seconds to the last answer, to the last verdict:")
    first = statistics.median(t[1] for t in times["whole, scored after"])
    for name, measured in times.items():
        last_answer, last_verdict = (statistics.median(t[i] for t in measured) for i in (0, 1))
        print(f"{name:<24}{last_answer:>8.3f} s{last_verdict:>9.3f} s{last_verdict / first:>8.3f}x")


def learner_against_plain(cfg, policy: str, rounds: int) -> None:
    """Trained tokens per second of a one-rank learner group's update and of `plain_update`
    on the same rows, alternating; prints both and their ratio."""
    import ray
    from transformers import AutoModelForCausalLM

    from rayrep.cluster.placement import Placement, make_plan
    from rayrep.learner.group import LearnerGroup
    from rayrep.types import LossSpec

    cfg = cfg.replace(**{"learner.num_workers": 1, "generator.num_workers": 1, "verifier.num_workers": 0})
    batch, loss = one_step_of_rows(cfg, policy), LossSpec()
    tokens = float(batch.response_mask.sum())
    torch.set_num_threads(cfg.placement.threads)
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    model.config.use_cache = False
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learner.lr, weight_decay=cfg.learner.weight_decay)
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    placement = Placement(make_plan(cfg))
    learners = LearnerGroup(cfg, policy, placement)
    times: dict[str, list[float]] = {"learner": [], "plain": []}
    try:
        for round_index in range(rounds + 1):  # the first round warms both up, unmeasured
            for name in ("learner", "plain") if round_index % 2 == 0 else ("plain", "learner"):
                start = time.perf_counter()
                if name == "learner":
                    learners.update(batch, loss)
                else:
                    plain_update(model, optimizer, batch, cfg, loss)
                if round_index:
                    times[name].append(time.perf_counter() - start)
    finally:
        learners.shutdown()
        placement.remove()
        ray.shutdown()
    learner, plain = (statistics.median(times[n]) for n in ("learner", "plain"))
    print(f"\nthe update of one step ({len(batch.lengths)} rows, {tokens:.0f} trained tokens, mini-batches of "
          f"{cfg.learner.mini_batch_prompts} questions, {cfg.placement.threads} threads), median of {rounds}:")
    print(f"{'':<14}{'s':>8}{'tokens/s':>10}")
    print(f"{'learner':<14}{learner:>8.3f}{tokens / learner:>10.0f}")
    print(f"{'plain PyTorch':<14}{plain:>8.3f}{tokens / plain:>10.0f}")
    print(f"learner / plain tokens per second: {plain / learner:.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
