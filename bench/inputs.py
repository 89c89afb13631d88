"""How fast large and pathological inputs are handled, each next to a plain baseline in the same run.

    python bench/inputs.py [--rows 17000] [--repeats 5]

- prompt files: `load_prompts` of a DAPO-Math-17k-sized parquet file (every row checked
  and turned into a `Prompt`) against pyarrow reading the same file into Python rows;
- answer extraction: `last_boxed_content` on megabyte texts built to make a naive scan
  quadratic (boxes that never close, a megabyte of braces) against one `str.count` pass
  over the same text (a linear scan of every character);
- the verifier's hard limit: `verify` of inputs that would keep math-verify busy for
  minutes, against the 1 s limit they run under.

Medians over `--repeats` runs; the ratios are the figures to compare across machines.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def median_seconds(work, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def prompt_file(path: Path, rows: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    pq.write_table(pa.table({
        "data_source": pa.array(["math_dapo"] * rows),
        "prompt": pa.array([[{"role": "user", "content": f"Question {i}: " + "x" * 300}] for i in range(rows)],
                           pa.list_(message)),
        "ability": pa.array(["MATH"] * rows),
        "reward_model": pa.array([{"ground_truth": str(i), "style": "rule"} for i in range(rows)]),
        "extra_info": pa.array([{"index": f"{i:08x}-uuid"} for i in range(rows)]),
    }), path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=17_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import pyarrow.parquet as pq

    from rayrep.data.loaders import load_prompts
    from rayrep.verifier import math as vm
    from rayrep.verifier.final_answer import MAX_ANSWER_CHARS, last_boxed_content

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "dapo-sized.parquet"
        prompt_file(path, args.rows)
        ours = median_seconds(lambda: load_prompts(path), args.repeats)
        raw = median_seconds(lambda: pq.read_table(path).to_pylist(), args.repeats)
    print(f"load_prompts, {args.rows} rows: {ours:.3f} s; pyarrow to Python rows: {raw:.3f} s; ratio {ours / raw:.2f}")

    texts = {
        "150k unclosed boxes": "\\boxed{" * 150_000,
        "a megabyte of braces": "\\boxed{" + "{" * 1_000_000,
        "a megabyte, then a box": "a" * 1_000_000 + r"\boxed{5}",
    }
    for name, text in texts.items():
        ours = median_seconds(lambda: last_boxed_content(text, max_chars=MAX_ANSWER_CHARS), args.repeats)
        scan = median_seconds(lambda: text.count("{"), args.repeats)
        print(f"last_boxed_content, {name} ({len(text) / 1e6:.1f} MB): {1e3 * ours:.2f} ms; "
              f"str.count over it: {1e3 * scan:.2f} ms; ratio {ours / scan:.1f}")

    vm.default_sandbox().start()
    for completion, truth in ((r"\boxed{9^{9^{9^{9}}}}", "9"), (r"\boxed{2^{10^{9}}}", "2")):
        start = time.perf_counter()
        verdict = vm.verify(completion, truth, timeout_s=1.0)
        seconds = time.perf_counter() - start
        print(f"verify {completion} at a 1 s limit: {verdict.status} after {seconds:.2f} s "
              f"({seconds / 1.0:.2f}x the limit)")


if __name__ == "__main__":
    main()
