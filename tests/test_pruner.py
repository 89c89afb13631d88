"""The generation pruner (`rayrep.data.pruner`) inside the prompt sampler: which visits it
passes by, when it re-checks, how its pauses grow, and that its state resumes exactly."""

from rayrep.data import PromptSampler
from rayrep.data.pruner import GenerationPruner
from rayrep.types import Prompt

QUIET, SIGNAL = (True, True, True), (True, False, True)


def sampler(size: int, after: int = 1, skip: int = 1, growth: float = 2.0) -> PromptSampler:
    prompts = [Prompt(uid=f"q{i}", messages=({"role": "user", "content": str(i)},), ground_truth=str(i)) for i in range(size)]
    return PromptSampler(prompts, seed=0, pruner=GenerationPruner(after, skip, growth))


def test_pauses_in_visits_grow_and_a_group_with_signal_clears_the_record():
    pruner = GenerationPruner(after=2, skip=1, growth=2.0)
    assert [pruner.pause(c) for c in range(4)] == [1, 2, 4, 8]
    history = []
    pruner.observe([("a", QUIET)])
    history.append(pruner.passes_by("a"))  # one quiet visit: not yet (after = 2)
    pruner.observe([("a", QUIET)])
    history += [pruner.passes_by("a"), pruner.passes_by("a")]  # sits out 1, then a re-check
    assert history == [False, True, False]
    pruner.observe([("a", QUIET)])  # the re-check confirms: the next pause is 2 visits
    assert [pruner.passes_by("a") for _ in range(3)] == [True, True, False]
    pruner.observe([("a", QUIET)])
    assert [pruner.passes_by("a") for _ in range(5)] == [True] * 4 + [False]
    assert pruner.take_counts() == {"pruner_skipped": 7.0, "pruner_rechecks": 3.0, "pruner_sitting_out": 0.0}
    pruner.observe([("a", SIGNAL)])  # it teaches again: its record is gone
    assert "a" not in pruner.records and not pruner.passes_by("a")


def test_the_sampler_fills_the_batch_past_pruned_questions_and_resumes_exactly():
    s = sampler(10, after=1, skip=3)
    first = s.next(10)
    s.pruner.observe([(p.uid, QUIET if p.uid in {"q1", "q2", "q3"} else SIGNAL) for p in first])
    saved = s.state()
    batch = [p.uid for p in s.next(10)]
    # The next epoch's seven others, then three of the one after: the three sit out 3 visits.
    assert len(batch) == 10 and not {"q1", "q2", "q3"} & set(batch) and len(set(batch[:7])) == 7
    counts = s.pruner.take_counts()
    assert counts["pruner_skipped"] >= 3 and counts["pruner_sitting_out"] == 3

    again = sampler(10, after=1, skip=3)
    again.restore(saved)
    assert [p.uid for p in again.next(10)] == batch
    assert again.pruner.take_counts() == counts and again.state() == s.state()


def test_with_every_question_sitting_out_the_sampler_still_draws():
    s = sampler(3, after=1, skip=5)
    s.pruner.observe([(p.uid, QUIET) for p in s.next(3)])
    assert len(s.next(3)) == 3  # at most an epoch passed by per draw
