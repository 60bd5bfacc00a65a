"""The `gpuformers train` verb: supervised fine-tuning from a JSONL file.

    gpuformers train --model Qwen/Qwen3-0.6B --data chats.jsonl --output-dir out --epochs 1 --lr 2e-5

Each line of --data is {"text": "..."} (every token trained on) or {"messages": [{"role", "content"}, ...]}
(rendered with the model's chat template; only the assistant turns are trained on). The model is trained in
float32 weights with bf16 / fp16 autocast as the GPU allows (--bf16 auto), checkpoints go to
output_dir/checkpoint-N, and the final model (loadable by from_pretrained and transformers) to output_dir.

Offers: add_train_arguments, run_train.
"""

from __future__ import annotations

import argparse


def _flag(value: str) -> bool | str:
    lowered = value.strip().lower()
    if lowered in ("auto",):
        return "auto"
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f'"{value}" is not one of: auto, true, false')


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="Hub id or checkpoint folder to fine-tune")
    parser.add_argument("--data", required=True, help='JSONL file of {"text": ...} or {"messages": [...]} rows')
    parser.add_argument("--eval-data", default=None, help="JSONL file for the evaluation loss and perplexity")
    parser.add_argument("--output-dir", default="trainer_output", help="checkpoints and the final model go here")
    parser.add_argument("--epochs", type=float, default=3.0, help="passes over the data (default: 3)")
    parser.add_argument("--max-steps", type=int, default=-1, help="optimizer steps; overrides --epochs when > 0")
    parser.add_argument("--lr", type=float, default=5e-5, help="peak learning rate (default: 5e-5)")
    parser.add_argument("--batch-size", type=int, default=8, help="rows per micro-batch (default: 8)")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (default: 1)")
    parser.add_argument("--max-length", type=int, default=2048, help="truncate rows to this many tokens")
    parser.add_argument("--packing", action="store_true",
                        help="pack rows into --max-length sequences (attention stays within each row)")
    parser.add_argument("--scheduler", default="linear", help="linear, cosine, constant or constant_with_warmup")
    parser.add_argument("--warmup", type=float, default=0, help="warmup steps, or a ratio of all steps if < 1")
    parser.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (not on norms, biases)")
    parser.add_argument("--bf16", type=_flag, default="auto",
                        help="auto (bf16 on Ampere+, fp16 on older GPUs, float32 on the CPU), true or false")
    parser.add_argument("--dtype", default="float32", help="dtype of the trained weights (default: float32)")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations: less memory")
    parser.add_argument("--logging-steps", type=float, default=10, help="log every N steps (default: 10)")
    parser.add_argument("--save-steps", type=float, default=500, help="checkpoint every N steps (default: 500)")
    parser.add_argument("--save-total-limit", type=int, default=None, help="keep only the newest N checkpoints")
    parser.add_argument("--resume", nargs="?", const=True, default=None, metavar="CHECKPOINT",
                        help="continue from the newest checkpoint in --output-dir, or from CHECKPOINT")
    parser.add_argument("--seed", type=int, default=42, help="random seed (default: 42)")
    parser.add_argument("--cpu", action="store_true", help="train on the CPU even when a GPU is visible")
    from gpuformers.models.command_line import add_kernel_arguments

    add_kernel_arguments(parser)  # --attn-implementation, --use-kernels, --kernel-config (training-mode kernels)


def run_train(args: argparse.Namespace) -> int:
    from gpuformers.models.auto import AutoModelForCausalLM, AutoTokenizer
    from gpuformers.training.arguments import TrainingArguments
    from gpuformers.training.data import DataCollatorForCausalLM, load_jsonl, tokenize_rows
    from gpuformers.training.packing import PackedCollator
    from gpuformers.training.trainer import Trainer

    if str(args.model).lower().endswith(".gguf"):  # before the Hub lookup, whose error would only say "a file"
        raise ValueError(f"--model {args.model}: `gpuformers train` fine-tunes a safetensors checkpoint, not a GGUF "
                         "file; pass the folder or Hub id of the checkpoint it was converted from")
    from gpuformers.models.command_line import kernel_options

    kernels = kernel_options(args)  # an unknown backend or a bad --kernel-config fails before the data is read
    training_args = TrainingArguments(
        output_dir=args.output_dir, num_train_epochs=args.epochs, max_steps=args.max_steps, learning_rate=args.lr,
        per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum, lr_scheduler_type=args.scheduler, warmup_steps=args.warmup,
        weight_decay=args.weight_decay, bf16=args.bf16, gradient_checkpointing=args.gradient_checkpointing,
        logging_steps=args.logging_steps, save_steps=args.save_steps, save_total_limit=args.save_total_limit,
        eval_strategy="epoch" if args.eval_data else "no", seed=args.seed, use_cpu=args.cpu)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    train_rows = tokenize_rows(tokenizer, load_jsonl(args.data), args.max_length)
    eval_rows = tokenize_rows(tokenizer, load_jsonl(args.eval_data), args.max_length) if args.eval_data else None
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    collator = PackedCollator(pad, args.max_length) if args.packing else DataCollatorForCausalLM(pad_token_id=pad)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=args.dtype,
                                                 device_map=str(training_args.device), **kernels)
    trainer = Trainer(model, training_args, data_collator=collator, train_dataset=train_rows,
                      eval_dataset=eval_rows, processing_class=tokenizer)
    result = trainer.train(resume_from_checkpoint=args.resume)
    trainer.save_model()
    print(f"trained {result.global_step} steps, final mean loss {result.training_loss:.4f}; "
          f"model saved to {training_args.output_dir}")
    return 0
