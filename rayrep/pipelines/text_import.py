"""Another model's verified solutions into a replay pool: replay a stronger model's successes
(the off-policy guidance setting of LUFFY) through the same mechanisms as the policy's own.

Text traces (RLEP's released pools: verl/DAPO rows with `reward_model.candidates`) are
encoded with the policy's tokenizer, as the policy would have emitted them; each is checked
by the verifier against its question's ground truth (a wrong one is left out, counted);
the policy's own log-probs of each are recorded as its behaviour log-probs, so that the
replay's importance ratio starts at pi_theta / pi_base, not at the unknown writer's; and
each answer is marked as external, with the file and the writer named as its origin.

The forward passes run in this process (on a GPU if there is one), in batches whose fp32
logits take at most `LOGITS_BYTES`: seconds for the embedded tasks; a 7B policy and
DAPO-17k's candidates want a GPU. Not run on a GPU here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from rayrep.buffer.files import text_pool_rows
from rayrep.buffer.pool import Imported, import_into
from rayrep.buffer.replay import ReplayStore
from rayrep.config import Config
from rayrep.learner.logprobs import token_logprobs
from rayrep.models import config_overrides
from rayrep.types import Answer
from rayrep.verifier.math import verify_batch

LOGITS_BYTES = 1 << 30
"""The fp32 logits one forward pass may hold while scoring imported answers (tokens x vocabulary x 4)."""


def policy_logprobs(model, sequences: list[tuple[list[int], list[int]]], temperature: float) -> list[np.ndarray]:
    """The policy's log-prob of each answer token given its prompt and the tokens before
    it, at sampling temperature `temperature`, per (prompt ids, answer ids)."""
    device = next(model.parameters()).device
    budget = max(1, LOGITS_BYTES // (4 * model.config.vocab_size))  # tokens per pass
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i][0]) + len(sequences[i][1]))
    results: list[np.ndarray | None] = [None] * len(sequences)
    batch: list[int] = []

    def run(batch: list[int]) -> None:
        width = max(len(sequences[i][0]) + len(sequences[i][1]) for i in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, i in enumerate(batch):
            full = sequences[i][0] + sequences[i][1]
            ids[row, : len(full)], mask[row, : len(full)] = torch.tensor(full), 1
        with torch.no_grad():
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
            logp, _ = token_logprobs(logits, ids.to(device), temperature)
        for row, i in enumerate(batch):
            prompt, answer = sequences[i]
            results[i] = logp[row, len(prompt) : len(prompt) + len(answer)].float().cpu().numpy()

    for i in order:
        width = len(sequences[i][0]) + len(sequences[i][1])
        if batch and (len(batch) + 1) * max(width, 1) > budget:
            run(batch)
            batch = []
        batch.append(i)
    if batch:
        run(batch)
    return results


def scored(cfg: Config, policy: str, sequences: list[tuple[list[int], list[int]]]) -> list[np.ndarray]:
    """`policy_logprobs` of `policy` (fp32) at the run's temperature, in a Ray task that asks
    for what it uses: a GPU of a GPU run's cluster (Ray's to give, not whichever GPU the
    driver happens to see), a CPU otherwise; in this process where Ray is not up."""
    import ray

    def score(cfg: Config, policy: str, sequences: list[tuple[list[int], list[int]]]) -> list[np.ndarray]:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32, **config_overrides(cfg, policy))
        model.to("cuda" if torch.cuda.is_available() else "cpu").eval()
        return policy_logprobs(model, sequences, cfg.generator.temperature)

    if not ray.is_initialized():
        return score(cfg, policy, sequences)
    resources = {"num_gpus": 1} if cfg.placement.device == "gpu" else {"num_cpus": 1}
    return ray.get(ray.remote(**resources)(score).remote(cfg, policy, sequences))


def read_text(cfg: Config, policy: str, source: str | Path, writer: str = "", log=print) -> tuple[Imported, dict]:
    """The text pool `source`'s candidate answers that the verifier accepts, encoded and scored
    by `policy` (see the module docstring), ready for a buffer (`import_into`); `writer`: the
    model that wrote them, as their origin's checkpoint. Also what was read and kept.

    A candidate longer than `generator.max_response_tokens` is left out (counted): cut to
    that length it would no longer be the answer the verifier accepted."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(policy)
    rows, questions, without = text_pool_rows(source, tokenizer, 1.0, cfg.generator.max_response_tokens)
    whole = [row for row in rows if row["response_ids"][-1] == tokenizer.eos_token_id]  # a cut one lost its end
    verdicts = verify_batch([row["text"] for row in whole], [row["ground_truth"] for row in whole],
                            cfg.verifier.timeout_s)
    kept = [row for row, verdict in zip(whole, verdicts) if verdict.correct]
    log(f"{source}: {len(rows)} candidate answers of {questions - without} questions, {len(rows) - len(whole)} "
        f"longer than {cfg.generator.max_response_tokens} tokens; the verifier accepts {len(kept)}")
    logprobs = scored(cfg, policy, [(row["prompt_ids"], row["response_ids"]) for row in kept])
    origin = (f"imported:{Path(source).name}", writer or "unknown writer")
    items: dict[str, tuple[list[int], list[Answer]]] = {}
    for row, own in zip(kept, logprobs):
        answers = items.setdefault(row["uid"], (row["prompt_ids"], []))[1]
        answers.append(Answer.of_arrays(np.array(row["response_ids"], np.int32), own, 1.0, 0, "external", 0,
                                        cfg.generator.temperature, True, *origin))
    flat = [(uid, np.array(ids, np.int32), answers) for uid, (ids, answers) in items.items()]
    counts = {"source": str(source), "questions": questions, "questions_without_candidates": without,
              "candidates": len(rows), "too_long": len(rows) - len(whole), "verified": len(kept),
              "wrong": len(whole) - len(kept)}
    return Imported(str(source), flat, {}, []), counts


def import_text(cfg: Config, policy: str, source: str | Path, buffer: ReplayStore, writer: str = "",
                log=print) -> dict:
    """`read_text`'s answers added to `buffer`. Returns what was read, kept and stored."""
    read, counts = read_text(cfg, policy, source, writer, log)
    return {**import_into(buffer, read), **counts}
