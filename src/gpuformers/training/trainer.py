"""Trainer: transformers' Trainer API over a training loop that fits on one screen.

    for each optimizer step:
        micro-batches (gradient_accumulation_steps of them) -> forward under autocast -> loss / tokens of the step
        -> backward (scaled with fp16) -> unscale, clip -> optimizer.step -> scheduler.step -> zero_grad
        -> log / evaluate / save (checkpoint-N, atomic) as the strategies say

The loss of a step is the sum of token losses over all its micro-batches divided by the number of target tokens
in the step (transformers' `num_items_in_batch`), so accumulating 4 batches of 2 gives the gradients of one batch
of 8. The data order of each epoch comes from a generator seeded with (data_seed or seed) + epoch, never from the
global RNG, so a resumed run replays the same batches; the global RNG state is saved in each checkpoint and restored
where it was captured: before the next epoch's loader when the checkpoint ends an epoch, after it inside one.
The forward runs inside logits_not_needed() (compute_loss reads only the loss): a causal LM then fuses its LM head
and loss in chunks (layers/loss.py), never holding the (tokens, vocab) logits, with the same loss and gradients.

Beyond the loop, as transformers does them: label_smoothing_factor and neftune_noise_alpha (regularizers.py), and
load_best_model_at_end / metric_for_best_model (best_model.py: state.best_metric and best_model_checkpoint tracked
at each evaluation, the best checkpoint kept by the rotation and loaded at the end). The Trainer's other parts sit
beside it: model_setup.py (what cannot be trained is refused, gradient checkpointing, DDP / FSDP2 wrapping),
deepspeed_engine.py (the DeepSpeed strategy: its engine steps in place of backward / optimizer.step),
sampling.py (each epoch's batches), streaming.py (iterable datasets, read as streams), and two parts it owns, given
what they need when the Trainer makes them: its Evaluator (evaluation.py: evaluate, predict) and its Checkpointer
(checkpointing.py: save, resume, save_model).

Offers: Trainer, TrainOutput (and, from evaluation.py and optim.py: PredictionOutput, EvalPrediction,
clip_grad_norm).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import numpy as np
import torch

from gpuformers.layers.loss import logits_not_needed
from gpuformers import distributed
from gpuformers.training import callbacks as cb
from gpuformers.training import checkpoint as ckpt
from gpuformers.training.arguments import TrainingArguments
from gpuformers.training.best_model import (check_best_model_setup, keep_only_best_checkpoint, load_best_model,
                                           metric_key, update_best_metric)
from gpuformers.training.checkpointing import Checkpointer
from gpuformers.training import deepspeed_engine
from gpuformers.labels import IGNORE_INDEX
from gpuformers.training.data import DataCollatorForCausalLM
from gpuformers.training.evaluation import (EvalPrediction, Evaluator, PredictionOutput,  # noqa: F401 (offered)
                                            evaluation_batches)
from gpuformers.training.model_setup import check_trainable, enable_gradient_checkpointing, wrap_for_training
from gpuformers.training.optim import build_optimizer, build_scheduler, clip_grad_norm
from gpuformers.training.packing import document_attention
from gpuformers.training.regularizers import add_neftune_noise, label_smoothed_loss
from gpuformers.training.sampling import epoch_batches, length_grouped_batches, sequence_lengths
from gpuformers.training.schedules import steps_on_metric
from gpuformers.training.streaming import StreamBatches, is_stream


class TrainOutput(NamedTuple):
    global_step: int
    training_loss: float
    metrics: dict[str, float]


class _RunPlan(NamedTuple):
    """How long one train() runs, in optimizer steps: in all, per epoch (a stream: per pass), and epochs (passes)."""
    max_steps: int
    updates_per_epoch: int
    num_epochs: int
    stream: bool  # the train_dataset is a stream without a length


class _Start(NamedTuple):
    """Where one train() starts: the epoch, the optimizer step in it, and a resumed checkpoint's RNG state (or None)."""
    epoch: int
    update: int
    rng: Any


@dataclasses.dataclass
class _Progress:
    """What one train() sums from start_time on: loss since the last log and in all, steps, this process's tokens."""
    start_time: float
    since_log: dict = dataclasses.field(default_factory=lambda: {"loss": 0.0, "steps": 0})
    loss: Any = 0.0  # a tensor on the device after the first step: no sync until the end
    steps: int = 0
    tokens: int = 0


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _interval(value: float | None, max_steps: int) -> int:
    """logging/eval/save steps: an int, or a float < 1 meaning that fraction of max_steps."""
    if not value:
        return 0
    return max(1, math.ceil(max_steps * value)) if value < 1 else int(value)


class Trainer:
    def __init__(self, model=None, args: TrainingArguments | None = None, data_collator: Callable | None = None,
                 train_dataset=None, eval_dataset=None, processing_class=None, model_init=None,
                 compute_loss_func: Callable | None = None, compute_metrics: Callable | None = None,
                 callbacks: list | None = None, optimizers: tuple = (None, None),
                 preprocess_logits_for_metrics: Callable | None = None):
        if model is None:
            if model_init is None:
                raise ValueError("Trainer needs a model (or model_init, a function returning one)")
            model = model_init()
        self.args = args if args is not None else TrainingArguments()
        set_seed(self.args.seed)
        # under torchrun: join the process group (else a no-op); FSDP2's CPU offload also needs gloo for CPU tensors;
        # DeepSpeed needs a group even in one process
        offload = self.args.fsdp_options is not None and self.args.fsdp_options.cpu_offload
        if self._deepspeed:
            deepspeed_engine.init_process_group(self.args.device, self.args.ddp_timeout, self.args.ddp_backend)
        else:
            distributed.init_distributed(self.args.device, self.args.ddp_timeout, cpu_offload=offload,
                                         backend=self.args.ddp_backend)
        if self.args.tf32 is not None and torch.cuda.is_available():
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = bool(self.args.tf32)
        from gpuformers.tensor_parallel import is_tensor_parallel

        # A tensor-parallel model is split over the processes, which all train it on the same batches: no data
        # parallelism, so one data-parallel "process" (see _data_parallel).
        self._tensor_parallel = is_tensor_parallel(model)
        check_trainable(model, self.args, self._tensor_parallel)
        # FSDP2 moves each process's shards to the GPU itself (wrap_for_training, by the first train(), evaluate()
        # or predict()): the whole model stays where it was loaded, never whole on every GPU
        # (a model from_pretrained built partitioned under ZeRO-3 is where DeepSpeed put its partitions already)
        self._built_partitioned = any(hasattr(p, "ds_id") for p in model.parameters())
        self.model = model if self._sharded_later or self._built_partitioned else model.to(self.args.device)
        if self.args.gradient_checkpointing:
            enable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs)
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        if self.args.load_best_model_at_end or self.args.save_strategy == "best":
            check_best_model_setup(self.args, self.eval_dataset, self.model, self._gathers_states)
        self.processing_class = processing_class
        self.data_collator = data_collator or DataCollatorForCausalLM(processing_class)
        self.compute_loss_func, self.compute_metrics = compute_loss_func, compute_metrics
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self.optimizer, self.lr_scheduler = optimizers
        self.model_wrapped = None  # the model made data-parallel (DDP / FSDP2, DeepSpeed's engine) by the first train()
        self.scaler = None
        self._micro_batches = 1  # micro-batches in the current optimizer step
        self.state, self.control = cb.TrainerState(), cb.TrainerControl()
        defaults: list = [cb.JSONLLoggerCallback(), cb.PrinterCallback() if self.args.disable_tqdm
                          else cb.ProgressCallback()]
        if "tensorboard" in self.args.report_to:
            defaults.append(cb.TensorBoardCallback())
        if not distributed.is_main_process():  # one process prints and writes the logs
            defaults = []
        self.callback_handler = cb.CallbackHandler(defaults + list(callbacks or []), self.model, processing_class)
        forward = inspect.signature(self.model.forward).parameters
        self._forward_args = set(forward)
        self._model_counts_items = "num_items_in_batch" in forward
        # compute_loss as written here reads only the loss: the model may then skip the (tokens, vocab) logits
        # (layers/loss.py's chunked linear + cross-entropy); not under torch.compile, which reads no ContextVar
        # (label smoothing reads the logits); nor under ZeRO-3, which gathers a module's weights around its own
        # forward only, while the fused loss reads the LM head's weight without calling the head
        zero3 = self.args.deepspeed_config is not None and self.args.deepspeed_config.is_zero3
        self._skip_logits = (type(self).compute_loss is Trainer.compute_loss and not self.args.torch_compile
                             and not self.args.label_smoothing_factor and not zero3)
        self.evaluator = Evaluator(self.model, self.args.device, self._data_parallel[0], batches=self._eval_batches,
                                   step=self._eval_step, on_prediction_step=self._on_prediction_step,
                                   shard=self._wrap_model if self._sharded_later else None)
        self.checkpointer = Checkpointer(self.args, self.model, self._gathers_states, self._tensor_parallel)
        self.control = self._call("on_init_end")

    # --- processes ------------------------------------------------------------------------------------------

    def is_world_process_zero(self) -> bool:
        """Whether this is the main process of all (the one that logs and writes checkpoints)."""
        return self.args.process_index == 0

    def is_local_process_zero(self) -> bool:
        """Whether this is the main process of its machine."""
        return self.args.local_process_index == 0

    @property
    def _deepspeed(self) -> bool:
        """The DeepSpeed strategy (deepspeed=..., or accelerate launch --use_deepspeed)."""
        return self.args.distributed_strategy == "deepspeed"

    @property
    def _engine(self):
        """The DeepSpeed engine once train() made it, else None."""
        return self.model_wrapped if self._deepspeed else None

    # --- hooks ----------------------------------------------------------------------------------------------

    def add_callback(self, callback) -> None:
        self.callback_handler.add_callback(callback)

    def remove_callback(self, callback) -> None:
        self.callback_handler.remove_callback(callback)

    def _call(self, hook: str, **kwargs) -> cb.TrainerControl:
        return self.callback_handler.call(hook, self.args, self.state, self.control, **kwargs)

    def _on_prediction_step(self) -> None:
        self.control = self._call("on_prediction_step")

    # --- data -----------------------------------------------------------------------------------------------

    def _train_batches(self, epoch: int) -> list[list[int]]:
        """This process's index lists of one epoch (sampling.py): random, sequential or grouped by length."""
        args, (world, rank) = self.args, self._data_parallel
        seed = args.data_seed or args.seed
        if args.train_sampling_strategy == "group_by_length":
            if self._lengths is None:  # once per train(): it reads every row
                names = getattr(self.processing_class, "model_input_names", None) or ["input_ids"]
                self._lengths = sequence_lengths(self.train_dataset, args.length_column_name, names[0])
            return length_grouped_batches(self._lengths, args.train_batch_size,
                                          args.train_batch_size * args.gradient_accumulation_steps, seed, epoch,
                                          world, rank, args.dataloader_drop_last)
        return epoch_batches(self.train_dataset, args.train_batch_size, seed + epoch,
                             args.train_sampling_strategy == "random", world, rank, args.dataloader_drop_last)

    def _epoch_loader(self, epoch: int, skip: int):
        """This process's batches of one epoch, the first `skip` left out: a stream is read in its own order."""
        args = self.args
        if is_stream(self.train_dataset):
            return StreamBatches(self.train_dataset, args.train_batch_size, self.data_collator, *self._data_parallel,
                                 args.dataloader_drop_last, args.dataloader_num_workers, epoch, skip, args.device)
        return self._loader(self.train_dataset, self._train_batches(epoch)[skip:])

    def _eval_batches(self, dataset):
        """This process's evaluation batches (evaluation.py), with this Trainer's collator and loader."""
        return evaluation_batches(dataset, self.args, self.data_collator, self._loader, *self._data_parallel)

    @property
    def _data_parallel(self) -> tuple[int, int]:
        """(processes that split the data, this one's index among them): torchrun's world and rank, or (1, 0) for a
        tensor-parallel model, whose processes all take the same batches."""
        return (1, 0) if self._tensor_parallel else (self.args.world_size, self.args.process_index)

    @property
    def _sharded_later(self) -> bool:
        """FSDP2 shards the model (wrap_for_training) and puts the shards on the device: nothing is moved before."""
        return self.args.distributed_strategy == "fsdp" and not self._tensor_parallel

    def _wrap_model(self, resume_from_checkpoint=None) -> torch.nn.Module:
        """The model made data-parallel (DDP, FSDP2 shards) once, by the first train(), or by the first evaluate()
        or predict() under FSDP2 (the model is not on the device before; transformers shards it there too)."""
        if self.model_wrapped is None:
            self.model_wrapped = wrap_for_training(self.model, self.args, self._tensor_parallel,
                                                   resume_from_checkpoint)
        elif resume_from_checkpoint and self._sharded_later:
            # already sharded (an evaluate() before, or an earlier train()): each process keeps its part of the
            # whole weights
            if hasattr(self.model, "peft_config"):
                raise NotImplementedError("resuming a LoRA model under FSDP2 after it was sharded (by an evaluate() "
                                          "or train() before) is not supported: its checkpoint holds the adapters "
                                          "alone; call train(resume_from_checkpoint=...) on a new Trainer first")
            distributed.load_full_model_state_dict(self.model, ckpt.read_model_weights(resume_from_checkpoint))
        return self.model_wrapped

    @property
    def _gathers_states(self) -> bool:
        """Whether the model is split over the processes (FSDP2 shards, tensor-parallel slices): its checkpoints are
        then whole states gathered from every process (a collective), and each process loads back its part."""
        return self.args.distributed_strategy == "fsdp" or self._tensor_parallel

    def _loader(self, dataset, batches: list[list[int]]) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(
            dataset, batch_sampler=batches, collate_fn=self.data_collator,
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory and self.args.device.type == "cuda")

    def _prepare_inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        if self.args.remove_unused_columns:
            batch = {k: v for k, v in batch.items() if k in self._forward_args}
        return {k: v.to(self.args.device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}

    @staticmethod
    def _count_targets(batch: dict[str, Any]) -> int:
        """Tokens that have a target: labels after the shift (position t predicts label t+1) that are not -100."""
        return int((batch["labels"][..., 1:] != IGNORE_INDEX).sum()) if "labels" in batch else 0

    # --- one step -------------------------------------------------------------------------------------------

    def _autocast(self):
        dtype = self.args.mixed_precision
        if dtype is None or self._deepspeed:  # DeepSpeed holds the weights in the config's precision itself
            return contextlib.nullcontext()
        return torch.autocast(self.args.device.type, dtype=dtype)

    def compute_loss(self, model, inputs: dict[str, Any], num_items_in_batch: int | None = None,
                     return_outputs: bool = False):
        """The model's loss on one micro-batch (label-smoothed with label_smoothing_factor); packed rows
        (position_ids, no attention_mask) get the block-diagonal attention of their examples."""
        packed = "position_ids" in inputs and "attention_mask" not in inputs
        kwargs = dict(inputs)
        smoothing = self.compute_loss_func is None and self.args.label_smoothing_factor and "labels" in kwargs
        if self.compute_loss_func is not None or smoothing:
            labels = kwargs.pop("labels")
        elif num_items_in_batch is not None and self._model_counts_items:
            kwargs["num_items_in_batch"] = num_items_in_batch
        with document_attention(self.model, inputs["position_ids"]) if packed else contextlib.nullcontext():
            outputs = model(**kwargs)
        if self.compute_loss_func is not None:
            loss = self.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
        elif smoothing:
            # as transformers: over the step's target tokens where the model itself would count them, else a mean
            logits = outputs.logits if hasattr(outputs, "logits") else outputs[0]
            loss = label_smoothed_loss(logits, labels, self.args.label_smoothing_factor,
                                       num_items_in_batch if self._model_counts_items else None)
        else:
            loss = outputs.loss if hasattr(outputs, "loss") else outputs[0]
        return (loss, outputs) if return_outputs else loss

    def training_step(self, model, inputs: dict[str, Any], num_items_in_batch: int | None = None) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns its (detached) share of the step's loss."""
        inputs = self._prepare_inputs(inputs)
        with self._autocast(), logits_not_needed() if self._skip_logits else contextlib.nullcontext():
            loss = self.compute_loss(model, inputs, num_items_in_batch)
        if num_items_in_batch is None or not (self._model_counts_items or self.compute_loss_func):
            loss = loss / self._micro_batches  # a per-micro-batch mean: average over the step's micro-batches
        backward = loss
        world = self._data_parallel[0]
        if world > 1 and num_items_in_batch is not None and (self._model_counts_items or self.compute_loss_func):
            # The loss is already over the whole step's tokens (all processes): undo DDP's / FSDP2's average.
            backward = loss * world
        if self._deepspeed:  # the loss is over the step's tokens already: not divided by the accumulation again
            self.model_wrapped.backward(backward, scale_wrt_gas=False)
        else:
            (self.scaler.scale(backward) if self.scaler is not None else backward).backward()
        return loss.detach()

    def _eval_step(self, batch: dict[str, Any], keep_logits: bool):
        """One evaluation batch through compute_loss -> (its target tokens' summed loss, its number of target tokens,
        its logits through preprocess_logits_for_metrics when `keep_logits`, else None)."""
        targets = self._count_targets(batch)
        inputs = self._prepare_inputs(batch)
        with self._autocast():
            # num_items_in_batch=1 turns the model's mean into a sum, to weight batches by their tokens
            loss, outputs = self.compute_loss(self.model, inputs, 1 if targets else None, return_outputs=True)
        summed = None
        if targets:
            value = loss.detach().double() if torch.is_tensor(loss) else float(loss)
            summed = value if self._model_counts_items else value * targets
        logits = None
        if keep_logits:
            logits = outputs.logits
            if self.preprocess_logits_for_metrics is not None:
                logits = self.preprocess_logits_for_metrics(logits, inputs.get("labels"))
        return summed, targets, logits

    def _optimizer_step(self) -> torch.Tensor | None:
        """Unscale, clip, step; returns the gradient norm before clipping (a tensor; None without clipping)."""
        if self._deepspeed:
            return self._deepspeed_step()
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grad_norm = None
        if self.args.max_grad_norm and self.args.max_grad_norm > 0:
            grad_norm = clip_grad_norm(self.model.parameters(), self.args.max_grad_norm)
            if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor
                grad_norm = grad_norm.full_tensor()
        self.control = self._call("on_pre_optimizer_step")
        skipped = False
        if self.scaler is not None:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            skipped = self.scaler.get_scale() < scale  # inf/nan gradients: the step was skipped
        else:
            self.optimizer.step()
        self.control = self._call("on_optimizer_step")
        if not skipped and not steps_on_metric(self.lr_scheduler):  # those step after each evaluation
            self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _deepspeed_step(self) -> torch.Tensor | None:
        """DeepSpeed's step: clipping (the config's gradient_clipping), the optimizer and the scheduler (skipped on an
        fp16 overflow), gradients zeroed; returns the gradient norm before clipping (None without clipping)."""
        self.control = self._call("on_pre_optimizer_step")
        self.model_wrapped.step()
        self.control = self._call("on_optimizer_step")
        norm = self.model_wrapped.get_global_grad_norm()
        if not (self.args.max_grad_norm and self.args.max_grad_norm > 0) or norm is None:
            return None
        return torch.as_tensor(norm)

    def _update(self, model, micro: list[dict[str, Any]]):
        """One optimizer step over its micro-batches -> (loss tensor, this process's input tokens, grad norm, learning
        rate used)."""
        self._micro_batches = len(micro)
        self.control._new_step()
        self.control = self._call("on_step_begin")
        # target tokens and input tokens of the whole step (labels are still on the CPU: no device sync)
        items = sum(self._count_targets(b) for b in micro)
        tokens = sum(int(b["attention_mask"].sum()) if b.get("attention_mask") is not None else b["input_ids"].numel()
                     for b in micro)
        padded = sum(b["input_ids"].numel() for b in micro)
        counts_items = self._model_counts_items or self.compute_loss_func is not None
        seen = self.args.include_num_input_tokens_seen
        # ... over every process's share of the step: a collective and a host sync, so only when this step needs
        # them (the loss over the step's targets, tokens seen in the state); the tokens of this process alone are
        # returned, summed over the processes once at the end of train()
        global_items, global_tokens, global_padded = items, tokens, padded
        if self._data_parallel[0] > 1 and (counts_items or seen != "no"):
            global_items, global_tokens, global_padded = (
                int(v) for v in distributed.all_reduce_sum([items, tokens, padded], self.args.device).tolist())
        # include_num_input_tokens_seen: "all" counts the padding too, as transformers does
        self.state.num_input_tokens_seen += {"all": global_padded, "non_padding": global_tokens}.get(seen, 0)
        num_items = max(1, global_items) if counts_items else None
        loss = 0.0
        for i, batch in enumerate(micro):
            # DDP / FSDP2 exchange gradients in the last micro-batch's backward only (DeepSpeed: its boundary)
            with distributed.gradient_sync(getattr(model, "_orig_mod", model), enabled=i == len(micro) - 1):
                loss = loss + self.training_step(model, batch, num_items)
            if i < len(micro) - 1:
                self.control = self._call("on_substep_end")
        learning_rate = self.lr_scheduler.get_last_lr()[0]
        return loss, tokens, self._optimizer_step(), learning_rate

    # --- the loop -------------------------------------------------------------------------------------------

    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        if self.optimizer is None:
            self.optimizer = build_optimizer(self.model, self.args)
        if self.lr_scheduler is None:
            self.lr_scheduler = build_scheduler(self.optimizer, self.args.lr_scheduler_type,
                                                self.args.get_warmup_steps(num_training_steps), num_training_steps,
                                                **(self.args.lr_scheduler_kwargs or {}))
        self.callback_handler.optimizer, self.callback_handler.lr_scheduler = self.optimizer, self.lr_scheduler

    def train(self, resume_from_checkpoint: str | os.PathLike | bool | None = None, **kwargs) -> TrainOutput:
        """Train on train_dataset, resumed from a checkpoint-N when `resume_from_checkpoint` names one (True: the last
        one in output_dir). The steps, in order:

            _plan_run           how many optimizer steps: in all, per epoch (a stream's pass), epochs
            _set_up             the model wrapped, optimizer / scheduler / scaler / state made, a checkpoint loaded
            _begin_training     compile, train mode, NEFTune, on_train_begin
            _train_epoch        per epoch: _start_epoch (its loader, a checkpoint's RNG state restored), then
                                _train_step per optimizer step (_update: its micro-batches accumulated and one
                                optimizer step; then _log_save_evaluate), then the epoch-end hooks
            _finish             the run's metrics logged, the best model loaded, on_train_end
        """
        if kwargs:
            raise TypeError(f"train() got unexpected arguments: {', '.join(sorted(kwargs))}")
        if self.train_dataset is None:
            raise ValueError("Trainer.train() needs train_dataset")
        self._lengths = None  # group_by_length's row lengths: read once per train()
        plan = self._plan_run()
        start = self._set_up(resume_from_checkpoint, plan)
        model, neftune = self._begin_training()
        progress = _Progress(time.perf_counter())
        for epoch in range(start.epoch, plan.num_epochs):
            first = epoch == start.epoch
            skip = start.update if first and not self.args.ignore_data_skip else 0
            self._train_epoch(model, epoch, skip, start.rng if first else None, plan, progress)
            if self.control.should_training_stop:
                break
        return self._finish(progress, neftune)

    def _plan_run(self) -> _RunPlan:
        """The run's length from max_steps or num_train_epochs and the batches of an epoch (a stream: max_steps)."""
        args = self.args
        if is_stream(self.train_dataset):  # no length: as many passes over the stream as max_steps takes
            if args.max_steps <= 0:
                raise ValueError(f"train_dataset ({type(self.train_dataset).__name__}) is a stream without a length, so"
                                 f" the number of steps is unknown: set max_steps > 0 (it is {args.max_steps})")
            return _RunPlan(args.max_steps, args.max_steps, sys.maxsize, stream=True)
        batches_per_epoch = len(self._train_batches(0))
        if batches_per_epoch == 0:
            raise ValueError(f"train_dataset gives no batch ({len(self.train_dataset)} rows, batch size "
                             f"{args.train_batch_size}, dataloader_drop_last={args.dataloader_drop_last})")
        updates_per_epoch = math.ceil(batches_per_epoch / args.gradient_accumulation_steps)
        max_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * updates_per_epoch)
        return _RunPlan(max_steps, updates_per_epoch, math.ceil(max_steps / updates_per_epoch), stream=False)

    def _set_up(self, resume_from_checkpoint, plan: _RunPlan) -> _Start:
        """The model wrapped; optimizer, scheduler, scaler and state made, a checkpoint's loaded; -> where it starts."""
        args = self.args
        if resume_from_checkpoint is True:
            resume_from_checkpoint = ckpt.get_last_checkpoint(args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"resume_from_checkpoint=True but {args.output_dir} holds no complete checkpoint-N")
        if self._deepspeed:
            self._create_deepspeed_engine(plan.max_steps)
        else:
            self._wrap_model(resume_from_checkpoint)
            self.create_optimizer_and_scheduler(plan.max_steps)  # after sharding: FSDP2 replaces the parameters
        if args.mixed_precision == torch.float16 and self.scaler is None and not self._deepspeed:
            self.scaler = torch.amp.GradScaler(args.device.type)
        self.state = cb.TrainerState(max_steps=plan.max_steps, num_train_epochs=plan.num_epochs,
                                     train_batch_size=args.train_batch_size, logging_steps=args.logging_steps,
                                     eval_steps=args.eval_steps, save_steps=args.save_steps,
                                     is_local_process_zero=args.local_rank <= 0,
                                     is_world_process_zero=distributed.is_main_process())
        rng = None
        if resume_from_checkpoint:
            rng = self.checkpointer.resume(resume_from_checkpoint, self.state, self.optimizer, self.lr_scheduler,
                                           self.scaler, self.callback_handler.callbacks, engine=self._engine)
        # a stream's passes may end early: its place is in state.epoch = pass + updates in that pass / max_steps
        epoch, update = divmod(round(self.state.epoch * plan.max_steps) if plan.stream else self.state.global_step,
                               plan.updates_per_epoch)
        return _Start(epoch, update, rng)

    def _create_deepspeed_engine(self, max_steps: int) -> None:
        """DeepSpeed's engine around the model, once (a later train() goes on with it), with the optimizer and
        scheduler of the config or of the Trainer (deepspeed_engine.py)."""
        if self.model_wrapped is None:
            args = self.args
            warmup = args.get_warmup_steps(max_steps)

            def make_scheduler(optimizer):
                return build_scheduler(optimizer, args.lr_scheduler_type, warmup, max_steps,
                                       **(args.lr_scheduler_kwargs or {}))

            self.model_wrapped, self.optimizer, self.lr_scheduler = deepspeed_engine.initialize(
                self.model, args.deepspeed_config, self.optimizer, lambda: build_optimizer(self.model, args),
                make_scheduler, self.lr_scheduler, max_steps, warmup)
        self.callback_handler.optimizer, self.callback_handler.lr_scheduler = self.optimizer, self.lr_scheduler

    def _begin_training(self):
        """Train mode, NEFTune, on_train_begin; -> (the model the steps run, compiled under torch_compile; the hook)."""
        args = self.args
        model = self.model_wrapped
        model = torch.compile(model, mode=args.torch_compile_mode) if args.torch_compile else model
        self.model.train()
        neftune = add_neftune_noise(self.model, args.neftune_noise_alpha) if args.neftune_noise_alpha else None
        self.control.should_training_stop = False  # as transformers: a second train() on this Trainer trains again
        self.control = self._call("on_train_begin")
        return model, neftune

    def _train_epoch(self, model, epoch: int, skip: int, rng, plan: _RunPlan, progress: _Progress) -> None:
        """One epoch: its optimizer steps from the `skip`-th on, then on_epoch_end and the epoch's log / eval / save."""
        iterator = self._start_epoch(epoch, skip, rng)
        for update in range(skip, plan.updates_per_epoch):
            if not self._train_step(model, iterator, epoch, update, plan, progress):
                break
        self.control.should_epoch_stop = False
        self.control = self._call("on_epoch_end")
        self._log_save_evaluate(progress.since_log, None, self.lr_scheduler.get_last_lr()[0], epoch_end=True)

    def _start_epoch(self, epoch: int, skip: int, rng):
        """The epoch's batch iterator, on_epoch_begin called, a checkpoint's RNG state (`rng`) restored where saved."""
        if rng is not None and not skip:
            # A checkpoint at the end of an epoch was written before this epoch's loader (iter(DataLoader) draws
            # its workers' seed from the global generator) and its callbacks: restored before them, so that
            # they draw what they drew in the uninterrupted run (transformers restores here too).
            ckpt.restore_rng_state(rng)
            rng = None
        loader = self._epoch_loader(epoch, skip * self.args.gradient_accumulation_steps)
        self.callback_handler.train_dataloader = loader
        self.control = self._call("on_epoch_begin")
        iterator = iter(loader)
        if rng is not None:  # inside an epoch: written after that draw, so restored after it, before the next batch
            ckpt.restore_rng_state(rng)
        return iterator

    def _train_step(self, model, iterator, epoch: int, update: int, plan: _RunPlan, progress: _Progress) -> bool:
        """One optimizer step of the epoch and its log / eval / save; -> whether the epoch goes on."""
        if self.state.global_step >= plan.max_steps:  # resumed from the last checkpoint: nothing left
            self.control.should_training_stop = True
            return False
        micro = [b for _, b in zip(range(self.args.gradient_accumulation_steps), iterator)]
        if not micro:
            # a stream that gives nothing (not even after a resume's skip) would start over forever
            self.control.should_training_stop |= plan.stream and update == 0
            return False
        loss, step_tokens, grad_norm, learning_rate = self._update(model, micro)
        self.state.global_step += 1
        self.state.epoch = epoch + (update + 1) / plan.updates_per_epoch
        progress.tokens += step_tokens
        progress.since_log["loss"] += loss  # a tensor on the device: no sync until it is logged
        progress.since_log["steps"] += 1
        progress.loss, progress.steps = progress.loss + loss, progress.steps + 1
        self.control = self._call("on_step_end")
        self._log_save_evaluate(progress.since_log, grad_norm, learning_rate, epoch_end=False)
        if self.state.global_step >= plan.max_steps or self.control.should_training_stop:
            self.control.should_training_stop = True
            return False
        return not self.control.should_epoch_stop

    def _finish(self, progress: _Progress, neftune) -> TrainOutput:
        """The run's metrics logged, the best model loaded (and kept alone with save_total_limit=1), on_train_end."""
        args = self.args
        runtime = time.perf_counter() - progress.start_time
        tokens = progress.tokens
        if self._data_parallel[0] > 1:  # every process's input tokens
            tokens = int(distributed.all_reduce_sum(tokens, args.device))
        train_loss = self._global_loss(progress.loss) / max(1, progress.steps)
        metrics = {"train_runtime": round(runtime, 4), "train_loss": train_loss,
                   "train_tokens_per_second": round(tokens / max(runtime, 1e-9), 2), "epoch": self.state.epoch}
        self.log(metrics)
        if args.load_best_model_at_end and self.state.best_model_checkpoint is not None:
            if self._deepspeed:  # the best checkpoint's DeepSpeed states, into the engine's shards
                deepspeed_engine.load_checkpoint(self.model_wrapped, self.state.best_model_checkpoint)
            else:
                load_best_model(self.model, self.state, self._gathers_states)
        if args.save_total_limit == 1 and self.state.best_model_checkpoint is not None:
            keep_only_best_checkpoint(args.output_dir, self.state)
        self.control = self._call("on_train_end")
        if neftune is not None:
            neftune.remove()
        return TrainOutput(self.state.global_step, metrics["train_loss"], metrics)

    def _log_save_evaluate(self, since_log: dict, grad_norm, learning_rate: float, epoch_end: bool) -> None:
        args, step = self.args, self.state.global_step
        if epoch_end:
            self.control.should_log |= args.logging_strategy == "epoch"
            self.control.should_evaluate |= args.eval_strategy == "epoch"
            self.control.should_save |= args.save_strategy == "epoch"
        else:
            def every(value) -> bool:
                interval = _interval(value, self.state.max_steps)
                return interval > 0 and step % interval == 0

            self.control.should_log |= (args.logging_strategy == "steps" and every(args.logging_steps)) or (
                args.logging_first_step and step == 1)
            self.control.should_evaluate |= args.eval_strategy == "steps" and every(args.eval_steps)
            self.control.should_save |= args.save_strategy == "steps" and every(args.save_steps)
        if self.control.should_log and since_log["steps"]:
            logs = {"loss": self._global_loss(since_log["loss"]) / since_log["steps"], "learning_rate": learning_rate}
            if grad_norm is not None:
                logs["grad_norm"] = float(grad_norm)
            since_log["loss"], since_log["steps"] = 0.0, 0
            self.log(logs)
        if self.control.should_evaluate and self.eval_dataset is not None:
            # after evaluate()'s on_evaluate: EarlyStoppingCallback compares with the best before this evaluation
            metrics = self.evaluate()
            new_best = update_best_metric(args, self.state, metrics)
            if steps_on_metric(self.lr_scheduler):  # reduce_lr_on_plateau (the metric checked above; stepped
                # before the checkpoint is written, as in transformers)
                self.lr_scheduler.step(metrics[metric_key(args.metric_for_best_model)])
            if args.save_strategy == "best":
                self.control.should_save = new_best
            self.model.train()
        if self.control.should_save:
            self._save_checkpoint()
        self.control.should_log = self.control.should_evaluate = self.control.should_save = False

    def _global_loss(self, value) -> float:
        """A loss summed over this process's micro-batches -> the same over all processes (each holds its tokens'
        share of the step's loss; without token counting each holds a mean, so the processes are averaged)."""
        world = self._data_parallel[0]
        if world <= 1:
            return float(value)
        total = float(distributed.all_reduce_sum(value, self.args.device))
        return total if (self._model_counts_items or self.compute_loss_func) else total / world

    def log(self, logs: dict[str, float]) -> None:
        logs = {**logs, "epoch": self.state.epoch} if "epoch" not in logs else dict(logs)
        if self.args.include_num_input_tokens_seen != "no":
            logs["num_input_tokens_seen"] = self.state.num_input_tokens_seen
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.control = self._call("on_log", logs=logs)

    # --- evaluation and checkpoints: the Evaluator's and the Checkpointer's, with the Trainer's callbacks ---------

    def evaluate(self, eval_dataset=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Loss and perplexity over eval_dataset (plus compute_metrics' results when given)."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluate() needs eval_dataset (passed here or to the Trainer)")
        self._check_partitioned_evaluation("evaluate()")
        metrics = self.evaluator.evaluate(dataset, metric_key_prefix, self.compute_metrics)
        self.log(metrics)
        self.control = self._call("on_evaluate", metrics=metrics)
        return metrics

    def _check_partitioned_evaluation(self, what: str) -> None:
        """A model from_pretrained built partitioned (ZeRO-3) runs only once DeepSpeed's engine, made by train(),
        gathers its parameters around each module."""
        if self._built_partitioned and self.model_wrapped is None:
            raise NotImplementedError(f"{what} before train() on a model that from_pretrained built partitioned under "
                                      "ZeRO-3 is not supported yet (DeepSpeed's engine, made by train(), gathers its "
                                      "parameters); call train() first, or load the model before making the "
                                      "TrainingArguments")

    def predict(self, test_dataset, metric_key_prefix: str = "test") -> PredictionOutput:
        """Logits (samples, longest seq, vocab, padded with -100), labels and metrics over test_dataset."""
        self._check_partitioned_evaluation("predict()")
        output = self.evaluator.predict(test_dataset, metric_key_prefix, self.compute_metrics)
        self.control = self._call("on_predict", metrics=output.metrics)
        return output

    def _save_checkpoint(self) -> Path:
        """checkpoint-N of this step (written once every process is done with it), then the on_save callbacks."""
        path = self.checkpointer.save(self.state, self.optimizer, self.lr_scheduler, self.scaler,
                                      self.callback_handler.callbacks + [self.control], self.processing_class,
                                      engine=self._engine)
        self.control = self._call("on_save")
        return path

    def save_model(self, output_dir: str | os.PathLike | None = None) -> None:
        """The model (config + safetensors, loadable by from_pretrained and transformers), tokenizer, arguments."""
        self.checkpointer.save_model(output_dir, self.processing_class, engine=self._engine)
