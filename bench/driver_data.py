"""What a training step's answers cost the driver: bytes in and out, CPU seconds, memory.

    python bench/driver_data.py [--shapes tiny paper] [--repeats 3]

Three data paths of a step's answers, each run in a driver of a local Ray instance of its
own, without actors, on synthetic answers of a given shape put into the object store as a
generator's result is:

- `refs` (rayrep's): the driver reads each generator part's facts (`PartFacts`: each
  answer's record, its length, finish reason and version), holds the answers as `Answer`s
  that say where their arrays are, builds the groups and
  `GRPO.build`'s `BatchRecipe` (rewards, advantages, the rows by reference), and puts the
  recipe for the learners; each learner rank then reads the rows and collates the batch
  (`BatchRecipe.collate`, timed here as `rank s`: work done on every rank, not the driver);
- `arrays`: every rollout's token ids and log-probs (int32 and float32 arrays) come to the
  driver (`ray.get` of the parts), the driver collates the `TrainBatch` and puts it;
- `lists`: the same with the arrays as lists of Python numbers.

Measured per path:
- `in`: the bytes the driver reads (pickle protocol 5, arrays out of band, as Ray lays
  them out) and its CPU seconds to `ray.get` them;
- `build`: the groups and `GRPO.build`, in CPU seconds;
- `out`: the bytes of what the driver puts for the learners, and the CPU seconds of the `ray.put`;
- `peak`: the driver's resident memory at its highest during the three, above where it
  started (each shape and path runs in a process of its own).

The ratios of `refs` and `arrays` to `lists` are printed last.

Shapes: `tiny` is the tiny-cpu preset's step (64 questions x 8 answers, 10-36 response
tokens, 34-token prompts); `paper` is the RLEP preset's (512 questions x 18 answers:
16 fresh and 2 replayed, responses of 1,000-3,072 tokens, 200-token prompts). Repeats are
run one after another in the same process; the median is printed.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {
    "tiny": dict(preset="tiny-cpu", questions=64, fresh=8, replays=0, prompt=34, response=(10, 36)),
    "paper": dict(preset="qwen2.5-math-7b-rlep", questions=512, fresh=16, replays=2, prompt=200,
                  response=(1000, 3072)),
}


KINDS = ("lists", "arrays", "refs")


def serialized_bytes(value) -> int:
    """The bytes of `value` as Ray's serializer lays it out: pickle 5, contiguous buffers out of band."""
    buffers: list = []
    data = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    return len(data) + sum(memoryview(b).nbytes for b in buffers)


class PeakMemory:
    """The process's resident memory at its highest while the block runs, above where it
    started (sampled every 2 ms; psutil's RSS, as bench/buffer.py reads it)."""

    def __enter__(self):
        self.start = self.peak = self.rss()
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()

    @staticmethod
    def rss() -> int:
        return psutil.Process().memory_info().rss

    def _sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, self.rss())
            time.sleep(0.002)

    @property
    def above_start_mib(self) -> float:
        return (self.peak - self.start) / 2**20


def make_answers(shape: str, lists: bool):
    """One generator's result for the step, as its worker returns it: per question, its
    rollouts (`RolloutPart`), or (`lists`) the lists of Python numbers rollouts held before."""
    import numpy as np

    from rayrep.types import Rollout, RolloutPart

    spec = SHAPES[shape]
    rng = np.random.default_rng(0)
    low, high = spec["response"]
    shares = RolloutPart()
    for _ in range(spec["questions"]):
        prompt_ids = rng.integers(3, 30000, spec["prompt"]).tolist()
        per_question = []
        for _ in range(spec["fresh"] + spec["replays"]):
            n = int(rng.integers(low, high + 1))
            rollout = Rollout(prompt_ids, rng.integers(3, 30000, n).tolist(),
                              (-rng.random(n)).astype(np.float32).tolist(), "", "stop", 0)
            if lists:  # as rollouts were before they held arrays: Python numbers, one object each
                for name in ("prompt_ids", "response_ids", "logprobs"):
                    object.__setattr__(rollout, name, getattr(rollout, name).tolist())
            per_question.append(rollout)
        shares.append(per_question)
    return shares


def measure(shape: str, kind: str, repeats: int) -> dict:
    """The shape's answers put into a local Ray object store (as a generator's result is),
    then, `repeats` times, the driver's part of the step for path `kind`."""
    import gc

    import ray

    from rayrep.algos.grpo import GRPO
    from rayrep.config import load_preset
    from rayrep.types import Answer, Group, PartFacts, Prompt

    spec = SHAPES[shape]
    cfg = load_preset(spec["preset"])
    answers = spec["fresh"] + spec["replays"]
    prompts = [Prompt(uid=f"q{q}", messages=({"role": "user", "content": f"question {q}"},), ground_truth="1")
               for q in range(spec["questions"])]
    correct = [(q % 3 == 0,) * answers for q in range(spec["questions"])]
    replayed = (False,) * spec["fresh"] + (True,) * spec["replays"]
    ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        shares = make_answers(shape, lists=kind == "lists")
        facts = PartFacts(list(range(len(shares))), [[Answer.sampled(None, (p, a), r) for a, r in enumerate(per_question)]
                                                     for p, per_question in enumerate(shares)])
        result, facts_ref = ray.put(shares), ray.put(facts)
        bytes_in = serialized_bytes(facts if kind == "refs" else shares)
        del shares
        gc.collect()
        runs = []
        for _ in range(repeats):
            figures = {}
            with PeakMemory() as memory:
                begin = time.process_time()
                if kind == "refs":  # the facts; the part stays where it is
                    read = ray.get(facts_ref)
                    held = [[a._replace(at=result) for a in per_question] for per_question in read.answers]
                else:
                    held = [[Answer.of(r) for r in per_question] for per_question in ray.get(result)]
                figures["in_seconds"] = time.process_time() - begin
                begin = time.process_time()
                groups = [Group(p, tuple(a._replace(correct=right, replayed=again) for a, right, again in zip(r, ok, replayed)))
                          for p, r, ok in zip(prompts, held, correct)]
                built = GRPO(cfg).build(groups, step=1)
                sending = built.recipe if kind == "refs" else built.batch
                figures["build_seconds"] = time.process_time() - begin
                begin = time.process_time()
                sent = ray.put(sending)
                figures["out_seconds"] = time.process_time() - begin
            figures["out_bytes"] = serialized_bytes(sending)
            figures["peak_mib_above_start"] = memory.above_start_mib
            begin = time.process_time()
            batch = built.recipe.collate()  # what each learner rank does with a recipe (outside the peak)
            figures["rank_seconds"] = time.process_time() - begin if kind == "refs" else 0.0
            tokens = int(batch.response_mask.sum())
            runs.append(figures)
            del held, groups, built, sending, sent, batch
            gc.collect()
    finally:
        ray.shutdown()
    median = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    return {"shape": shape, "kind": kind, "answers": spec["questions"] * answers, "response_tokens": tokens,
            "in_bytes": bytes_in, **median}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["tiny", "paper"], choices=sorted(SHAPES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # SHAPE KIND: measure it, in this process
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(measure(*args.one, args.repeats)))
        return
    rows = []
    for shape in args.shapes:
        for kind in KINDS:  # each in a fresh process (and Ray instance) of its own
            done = subprocess.run([sys.executable, __file__, "--one", shape, kind, "--repeats", str(args.repeats)],
                                  capture_output=True, text=True, check=True)
            rows.append(json.loads(next(line for line in done.stdout.splitlines()
                                        if line.startswith("RESULT "))[len("RESULT "):]))
    print(f"{'shape':<6} {'path':<7} {'answers':>8} {'tokens':>11} {'in MB':>9} {'in s':>6} {'build s':>8} "
          f"{'out MB':>9} {'out s':>6} {'peak MiB':>9} {'rank s':>7}")
    for r in rows:
        print(f"{r['shape']:<6} {r['kind']:<7} {r['answers']:>8,} {r['response_tokens']:>11,} {r['in_bytes'] / 1e6:>9.3f} "
              f"{r['in_seconds']:>6.2f} {r['build_seconds']:>8.2f} {r['out_bytes'] / 1e6:>9.3f} "
              f"{r['out_seconds']:>6.2f} {r['peak_mib_above_start']:>9.0f} {r['rank_seconds']:>7.2f}")
    for shape in args.shapes:
        by_kind = {r["kind"]: r for r in rows if r["shape"] == shape}
        cpu = {kind: r["in_seconds"] + r["build_seconds"] + r["out_seconds"] for kind, r in by_kind.items()}
        lists = by_kind["lists"]
        for kind in ("arrays", "refs"):
            r = by_kind[kind]
            print(f"{shape}: {kind} / lists, driver CPU seconds {cpu[kind] / max(cpu['lists'], 1e-9):.3f}, "
                  f"peak memory {r['peak_mib_above_start'] / max(lists['peak_mib_above_start'], 1e-9):.3f}, "
                  f"bytes in {r['in_bytes'] / lists['in_bytes']:.4f}, bytes out {r['out_bytes'] / lists['out_bytes']:.4f}")


if __name__ == "__main__":
    main()
