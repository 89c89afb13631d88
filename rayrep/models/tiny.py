"""The embedded tiny policy: a small Qwen2 with a character tokenizer, warm-started on the task.

Built entirely by this code (no hub access): a random Qwen2, then a short supervised warm
start on worked solutions of the embedded arithmetic task's train split. The result is an
ordinary Hugging Face checkpoint directory that `transformers` and vLLM both load. The
policies of the presets ship built (`SHIPPED`): `python -m rayrep.models.tiny build` is for
changing a recipe, not for first use.

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

import hashlib
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from rayrep.config import Config, ConfigError, parse_cli
from rayrep.data.arithmetic import DEFAULT_LEVELS, TEST_RESERVE, make_splits
from rayrep.errors import InputError
from rayrep.models.tokenizer import build_char_tokenizer

# Bump when the build recipe changes in a way the spec does not capture.
RECIPE_VERSION = 2
"""2: built with `PORTABLE_KERNELS` (1: with whatever kernels the CPU chose), past a test
reserve of 2,000 problems (1: 1,000)."""

PORTABLE_KERNELS = {
    "ATEN_CPU_CAPABILITY": "avx2",  # torch's own kernels: AVX2, also where the CPU has AVX-512
    "MKL_CBWR": "AVX2",  # MKL's conditional numerical reproducibility: AVX2 code paths on any CPU
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "OMP_NUM_THREADS": "2",  # a fixed thread count: parallel loops and reductions split the same way
    "MKL_NUM_THREADS": "2",
}
"""The environment of the build process: read when torch loads, hence a process of its own.
It costs about 1.2x the build time of AVX-512 kernels (measured on an AMD EPYC)."""


@dataclass(frozen=True)
class TinyPolicySpec:
    """Everything that determines the tiny policy's weights (`cache_key` names the recipe)."""

    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    max_positions: int = 256
    levels: tuple[str, ...] = DEFAULT_LEVELS
    num_train: int = 20000
    task_seed: int = 0
    test_reserve: int = TEST_RESERVE
    """The task's problems kept for test splits: the warm start uses those after them."""
    warm_start_steps: int = 1300
    warm_start_batch: int = 64
    warm_start_lr: float = 3e-3
    warm_start_slips: float = 0.4
    """Share of warm-start targets whose last step carries an arithmetic slip (see below)..."""
    warm_start_slip_steps: int = 250
    """...in the last this-many steps only: arithmetic is learned clean first."""
    seed: int = 0

    def cache_key(self) -> str:
        blob = json.dumps({"recipe": RECIPE_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def padded_vocab_size(tokenizer) -> int:
    """The embedding rows of the tiny policy: its tokenizer's size, rounded up to 8."""
    return 8 * math.ceil(len(tokenizer) / 8)


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


def _warm_start_example(prompt_ids, problem, slip: int, tokenizer) -> tuple[list[int], int]:
    """(token ids of prompt + worked solution + eos, prompt length)."""
    answer_ids = tokenizer(problem.solution(slip), add_special_tokens=False)["input_ids"]
    return prompt_ids + answer_ids + [tokenizer.eos_token_id], len(prompt_ids)


def _collate(batch, pad_id: int):
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (ids, prompt_len) in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention[row, : len(ids)] = 1
        # Only the answer is supervised: the policy learns to solve, not to echo questions.
        labels[row, prompt_len : len(ids)] = torch.tensor(ids[prompt_len:])
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


def weights_sha256(model_dir: Path) -> str:
    """SHA-256 of a checkpoint's tensors (each one's name, dtype, shape and bytes, in name
    order): equal exactly when the weights are, whatever the file's layout."""
    from safetensors import safe_open

    digest = hashlib.sha256()
    with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt") as weights:
        for name in sorted(weights.keys()):
            tensor = weights.get_tensor(name).contiguous()
            digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
            digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def machine_name() -> str:
    """The CPU model, as the build record names the machine a policy was built on."""
    import platform

    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return f"{line.partition(':')[2].strip()}, {os.cpu_count()} cores, {platform.machine()}"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


BUILD_RECORD = "rayrep_build.json"

SHIPPED = Path(__file__).parent / "policies"
"""The built policies that ship inside the package, one folder per preset: resolving
`model.path = "tiny"` uses these, so that every machine starts from the same weights (a
build repeats byte for byte on one CPU model only, even with `PORTABLE_KERNELS`)."""


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


def read_record(policy_dir: Path) -> dict:
    return json.loads((Path(policy_dir) / BUILD_RECORD).read_text())


def shipped_records(root: Path = SHIPPED) -> dict[str, dict]:
    """{folder name: build record} of the policies shipped in `root`."""
    if not root.is_dir():
        return {}
    return {entry.name: read_record(entry) for entry in sorted(root.iterdir()) if (entry / BUILD_RECORD).is_file()}


def tiny_spec(cfg: Config):
    """The tiny policy's build recipe: its size and warm start from `model.tiny_*`, its task
    (levels, seed) from `data`. The run's train and test sizes do not enter: train splits
    are prefixes of one sequence and test problems are never in one (see make_splits)."""
    hidden = cfg.model.tiny_hidden_size
    if hidden % 32:
        raise ConfigError(f"model.tiny_hidden_size: {hidden} must be a multiple of 32 (the head size)")
    return TinyPolicySpec(
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_layers=cfg.model.tiny_layers,
        num_heads=hidden // 32,
        num_kv_heads=max(1, hidden // 64),
        levels=cfg.data.arithmetic_levels,
        num_train=cfg.model.tiny_warm_start_problems,
        task_seed=cfg.data.arithmetic_seed,
        test_reserve=cfg.data.arithmetic_test_reserve,
        warm_start_steps=cfg.model.tiny_warm_start_steps,
        warm_start_slips=cfg.model.tiny_warm_start_slips,
        warm_start_slip_steps=cfg.model.tiny_warm_start_slip_steps,
    )


# The config field behind each field of the recipe that a config sets; the sizes derived from
# the hidden size follow it, and the other fields are fixed.
RECIPE_FIELDS = {
    "hidden_size": "model.tiny_hidden_size", "num_layers": "model.tiny_layers", "levels": "data.arithmetic_levels",
    "num_train": "model.tiny_warm_start_problems", "task_seed": "data.arithmetic_seed",
    "test_reserve": "data.arithmetic_test_reserve", "warm_start_steps": "model.tiny_warm_start_steps",
    "warm_start_slips": "model.tiny_warm_start_slips", "warm_start_slip_steps": "model.tiny_warm_start_slip_steps",
}
DERIVED = ("intermediate_size", "num_heads", "num_kv_heads")


def shipped_policy(spec, root: Path | None = None) -> Path:
    """The folder of the shipped policy built with `spec`'s recipe; an InputError when its
    files do not hash to its record, or when no shipped policy has that recipe (saying how
    to build one)."""
    root = Path(root or SHIPPED)
    records = shipped_records(root)
    for name, record in records.items():
        if record["cache_key"] == spec.cache_key():
            path = root / name
            found = weights_sha256(path)
            if found != record["weights_sha256"]:
                raise InputError(
                    f"{path}: its weights hash to {found[:16]}, not to the {record['weights_sha256'][:16]} of its "
                    f"build record: the files were changed; reinstall rayrep, or rebuild them with "
                    f"`python -m rayrep.models.tiny build --preset {name} --out {path}`")
            return path
    wanted = {key: list(value) if isinstance(value, tuple) else value for key, value in asdict(spec).items()}

    def differences(record: dict) -> list[str]:
        found = [f"{RECIPE_FIELDS.get(key, 'the fixed ' + key)} = {record['spec'].get(key)!r} there, {value!r} here"
                 for key, value in wanted.items() if record["spec"].get(key) != value and key not in DERIVED]
        if record.get("recipe_version") != RECIPE_VERSION:
            found.append(f"build recipe version {record.get('recipe_version')} there, {RECIPE_VERSION} here")
        return found

    if not records:
        raise InputError(f"model.path = 'tiny': no tiny policy is shipped in {root}; reinstall rayrep")
    closest = min(records, key=lambda name: len(differences(records[name])))
    raise InputError(
        f"model.path = 'tiny': no shipped tiny policy has the recipe this config describes; the closest, "
        f"{closest}, differs: {'; '.join(differences(records[closest]))}. Build one with the same config "
        f"arguments (`python -m rayrep.models.tiny build --preset {closest} ... --out DIR`, a few minutes) and "
        f"pass --model.path DIR; to rebuild the shipped one after changing its recipe, "
        f"--out {root / closest}")



def main(argv: list[str]) -> None:
    """`python -m rayrep.models.tiny build --preset NAME --out DIR [--section.field VALUE ...]`:
    build the tiny policy the preset (with any overrides) describes. To change a shipped
    policy, build into its folder, `rayrep/models/policies/NAME`."""
    import argparse

    if argv[:1] == ["warm-start"]:  # the build process of `build_with_portable_kernels`
        spec_fields = json.loads(argv[1])
        spec_fields["levels"] = tuple(spec_fields["levels"])
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
