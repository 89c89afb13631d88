"""The embedded tiny policy: a small Qwen2 with a character tokenizer, warm-started on the task.

Built entirely by this code (no hub access): a random Qwen2, then a short supervised warm
start on worked solutions of the embedded arithmetic task's train split. The result is an
ordinary Hugging Face checkpoint directory that `transformers` and vLLM both load. The
policies of the presets ship built (`rayrep.models.recipe.SHIPPED`): `python -m
rayrep.models.tiny build` is for changing a recipe, not for first use.

The warm start is made to leave room for RL, the way a pretrained model leaves room for
RL on real reasoning: it first learns the arithmetic from clean solutions, then, in its
last steps, from solutions of which 40% carry a small slip in the last step (off by one
or two, a lost carry). The policy ends up knowing the right answer (greedy decoding is
often right) yet sampling a careless one much of the time; RL with a verifier can teach
it to stop slipping within minutes on a CPU. Without the slips, a policy this small sits
on a steep part of its learning curve, and what RL can gain in a few minutes is small.

The build runs in a Python process of its own with the kernels pinned (`PORTABLE_KERNELS`):
left to choose, torch takes AVX-512 kernels where the CPU has them, and two CPU models
build two policies from the first optimizer step on. Pinned, a build repeats byte for byte
on one CPU model, yet still not across all of them (an AMD EPYC and an Intel Xeon built
different weights): hence the shipped policies.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from rayrep.config import ConfigError, parse_cli
from rayrep.data.arithmetic import make_splits
from rayrep.machine import machine_name
from rayrep.models.recipe import (BUILD_RECORD, RECIPE_VERSION, TinyPolicySpec, padded_vocab_size, tiny_spec,
                                  weights_sha256)
from rayrep.models.tokenizer import build_char_tokenizer
from rayrep.models.tool_format import ToolFormat

PORTABLE_KERNELS = {
    "ATEN_CPU_CAPABILITY": "avx2",  # torch's own kernels: AVX2, also where the CPU has AVX-512
    "MKL_CBWR": "AVX2",  # MKL's conditional numerical reproducibility: AVX2 code paths on any CPU
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "OMP_NUM_THREADS": "2",  # a fixed thread count: parallel loops and reductions split the same way
    "MKL_NUM_THREADS": "2",
}
"""The environment of the build process: read when torch loads, hence a process of its own.
It costs about 1.2x the build time of AVX-512 kernels (measured on an AMD EPYC)."""


def qwen2_config(spec: TinyPolicySpec, vocab_size: int, tokenizer):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        torch_dtype="float32",
    )


SLIPS = (-10, -2, -1, 1, 2, 10)
"""Sizes of the arithmetic slips of the warm start: off by one or two, or a lost carry."""


def _warm_start_prompts(spec: TinyPolicySpec, tokenizer) -> list[tuple[list[int], object]]:
    """(prompt token ids, problem) for each train problem."""
    train, _ = make_splits(spec.num_train, 0, spec.task_seed, spec.levels, spec.test_reserve)
    return [
        (
            tokenizer.apply_chat_template(
                list(problem.to_prompt("train", 0).messages), add_generation_prompt=True, tokenize=True, return_dict=False
            ),
            problem,
        )
        for problem in train
    ]


def _warm_start_example(prompt_ids, problem, slip: int, tokenizer) -> tuple[list[int], list[bool]]:
    """(token ids of prompt + worked solution + eos, which of them are supervised: the answer's)."""
    answer_ids = tokenizer(problem.solution(slip), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt_ids + answer_ids, [False] * len(prompt_ids) + [True] * len(answer_ids)


def _tool_example(prompt_ids, problem, format: ToolFormat, tokenizer) -> tuple[list[int], list[bool]]:
    """(token ids of prompt + an answer that calls the calculator with the problem's expression,
    reads its output and boxes it, which of them are supervised: the policy's turns, not the
    tool's output, framed as the generators frame it)."""
    eos = tokenizer.eos_token_id
    call = tokenizer(f"{format.call_start}{problem.expression}{format.call_end}", add_special_tokens=False)["input_ids"]
    call = call + ([eos] if format.stop_token is None else [])  # (a one-token closing markup ends the turn itself)
    output = format.output_ids(tokenizer, str(problem.answer), call[-1])
    boxed = tokenizer(f"\\boxed{{{problem.answer}}}", add_special_tokens=False)["input_ids"] + [eos]
    ids = prompt_ids + call + output + boxed
    return ids, [False] * len(prompt_ids) + [True] * len(call) + [False] * len(output) + [True] * len(boxed)


def _collate(batch, pad_id: int):
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (ids, supervised) in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention[row, : len(ids)] = 1
        # Only the answer is supervised: the policy learns to solve, not to echo questions (nor
        # to write a tool's output).
        labels[row, : len(ids)] = torch.where(torch.tensor(supervised), torch.tensor(ids), -100)
    return input_ids, attention, labels


def train_tiny_policy(spec: TinyPolicySpec, out_dir: Path, log=print) -> dict:
    """Build, warm-start and save the tiny policy into `out_dir`; returns build stats."""
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    start = time.monotonic()
    torch.manual_seed(spec.seed)
    rng = random.Random(spec.seed)
    built = build_char_tokenizer()
    config = qwen2_config(spec, padded_vocab_size(built), built)
    config.save_pretrained(out_dir)
    built.save_pretrained(out_dir)
    # Train on exactly the tokenizer that vLLM and transformers will load from the checkpoint.
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    model = Qwen2ForCausalLM(config)
    prompts = _warm_start_prompts(spec, tokenizer)
    tool = ToolFormat.of(tokenizer, *spec.tool_markup, max_output_chars=64) if spec.tool_calls else None

    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.warm_start_lr, weight_decay=0.01)
    warmup = max(1, spec.warm_start_steps // 20)

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, spec.warm_start_steps - warmup)
        return 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    model.train()
    loss = torch.tensor(float("nan"))
    for step in range(spec.warm_start_steps):
        slips = spec.warm_start_slips if step >= spec.warm_start_steps - spec.warm_start_slip_steps else 0.0
        # Slips are drawn afresh on every visit, so the policy learns a slip *rate*, not
        # which problems to get wrong.
        batch = [
            _tool_example(ids, problem, tool, tokenizer) if tool is not None and rng.random() < spec.tool_calls else
            _warm_start_example(ids, problem, rng.choice(SLIPS) if rng.random() < slips else 0, tokenizer)
            for ids, problem in rng.sample(prompts, spec.warm_start_batch)
        ]
        input_ids, attention, labels = _collate(batch, tokenizer.pad_token_id)
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == spec.warm_start_steps - 1:
            log(f"tiny policy warm start: step {step + 1}/{spec.warm_start_steps} loss {loss.item():.4f}")

    model.eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    stats = {
        "spec": asdict(spec),
        "recipe_version": RECIPE_VERSION,
        "cache_key": spec.cache_key(),
        "weights_sha256": weights_sha256(out_dir),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": machine_name(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "final_loss": float(loss.item()),
        "build_seconds": round(time.monotonic() - start, 1),
    }
    (out_dir / "rayrep_build.json").write_text(json.dumps(stats, indent=2))
    return stats


def build_with_portable_kernels(spec: TinyPolicySpec, out_dir: Path, log=print, env: dict | None = None) -> dict:
    """`train_tiny_policy` in a new Python process with `PORTABLE_KERNELS` (and `env` on
    top); its lines go to `log`. Returns the build stats."""
    command = [sys.executable, "-m", "rayrep.models.tiny", "warm-start", json.dumps(asdict(spec)), str(out_dir)]
    process = subprocess.Popen(command, env={**os.environ, **PORTABLE_KERNELS, **(env or {})},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in process.stdout:
            lines.append(line.rstrip())
            if line.startswith("tiny policy"):
                log(line.rstrip())
    except BaseException:  # interrupted (a timeout, Ctrl-C): the build must not outlive its caller
        process.kill()
        process.wait()
        raise
    if process.wait():
        tail = "\n".join(lines[-20:])
        raise RuntimeError(f"building the tiny policy failed (exit {process.returncode}):\n{tail}")
    return json.loads((out_dir / "rayrep_build.json").read_text())


def build_policy(spec: TinyPolicySpec, out_dir: Path, log=print, record: dict | None = None) -> dict:
    """Build the policy of `spec` into `out_dir` (with `PORTABLE_KERNELS`), `record` added to
    its build record; returns the record.

    The build writes into a folder beside `out_dir` that replaces it only when complete: an
    interrupted build leaves nothing half-written, and an existing policy there (a shipped
    one being rebuilt) stays as it was until the new one is whole.
    """
    out_dir = Path(out_dir).resolve()
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / BUILD_RECORD).exists():
        raise FileExistsError(f"{out_dir}: not empty and not a tiny policy; choose a new folder")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        stats = build_with_portable_kernels(spec, staging, log=log)
        stats.update(record or {})
        (staging / BUILD_RECORD).write_text(json.dumps(stats, indent=2) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return stats


def main(argv: list[str]) -> None:
    """`python -m rayrep.models.tiny build --preset NAME --out DIR [--section.field VALUE ...]`:
    build the tiny policy the preset (with any overrides) describes. To change a shipped
    policy, build into its folder, `rayrep/models/policies/NAME`."""
    import argparse

    if argv[:1] == ["warm-start"]:  # the build process of `build_with_portable_kernels`
        spec_fields = json.loads(argv[1])
        spec_fields["levels"] = tuple(spec_fields["levels"])
        spec_fields["tool_markup"] = tuple(spec_fields.get("tool_markup", ()))
        train_tiny_policy(TinyPolicySpec(**spec_fields), Path(argv[2]), log=lambda line: print(line, flush=True))
        return
    parser = argparse.ArgumentParser(prog="python -m rayrep.models.tiny", description=main.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="build a tiny policy from a preset's recipe")
    build.add_argument("--out", required=True, help="folder of the built policy (replaced when complete)")
    build.add_argument("--preset", default="tiny-cpu", help="the preset whose model and data fields give the recipe")
    args, rest = parser.parse_known_args(argv)
    try:
        spec = tiny_spec(parse_cli(["--preset", args.preset, *rest]))
    except ConfigError as err:
        parser.exit(2, f"{parser.prog}: config error: {err}\n")

    def log(line: str) -> None:
        print(line, flush=True)

    log(f"building the tiny policy of {args.preset} (recipe {spec.cache_key()}) into {args.out}")
    stats = build_policy(spec, Path(args.out), log=log, record={"preset": args.preset, "built_with": " ".join(rest)})
    log(f"tiny policy ready: {stats['parameters']:,} parameters, weights sha256 {stats['weights_sha256'][:16]}, "
        f"built in {stats['build_seconds']} s on {stats['machine']}")


if __name__ == "__main__":
    main(sys.argv[1:])
