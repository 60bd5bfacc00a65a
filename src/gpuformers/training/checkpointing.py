"""The Trainer's side of checkpoints: what goes into checkpoint-N and what a resume takes back, across processes.

    save:    whole states gathered from every process (FSDP2 shards, tensor-parallel slices: a collective), and
             every process's RNG state -> process 0 writes checkpoint-N (checkpoint.py: atomically), rotates the
             old ones -> all wait
    resume:  weights, optimizer, scheduler, scaler -> each process keeps its part; the trainer state (step, log
             history, best checkpoint, callback states) -> this process's RNG state, restored by the loop before
             the next batch

checkpoint.py does the files; this mixin decides what goes in them. save_model writes the model alone (config +
safetensors, tokenizer, arguments).

Offers: CheckpointMixin.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from gpuformers import distributed
from gpuformers.training import callbacks as cb
from gpuformers.training import checkpoint as ckpt

logger = logging.getLogger(__name__)


class CheckpointMixin:
    """The Trainer's _save_checkpoint, _resume and save_model."""

    def _save_checkpoint(self) -> Path:
        args = self.args
        # Whole states are gathered (every process takes part); process 0 alone writes.
        gathered = self._gathers_states
        model_state = distributed.full_model_state_dict(self.model) if gathered else None
        optimizer_state = (distributed.full_optimizer_state_dict(self.model, self.optimizer)
                           if gathered and not args.save_only_model else None)
        path = Path(args.output_dir) / f"{ckpt.CHECKPOINT_PREFIX}-{self.state.global_step}"
        if self.state.best_global_step == self.state.global_step:  # recorded in this checkpoint's own state
            self.state.best_model_checkpoint = os.path.join(args.output_dir, path.name)
        self.state.stateful_callbacks = cb.callback_states(self.callback_handler.callbacks + [self.control])
        # every process's RNG state (a collective), not process 0's alone: each draws its own dropout masks from
        # its own generators, and a resume must give each process its own back
        rng_states = (distributed.gather_to_main(ckpt.capture_rng_state())
                      if distributed.world_size() > 1 and not args.save_only_model else None)
        if distributed.is_main_process():
            path = ckpt.save_training_checkpoint(args.output_dir, self.state.global_step, model=self.model,
                                                 state=self.state, args=args, optimizer=self.optimizer,
                                                 scheduler=self.lr_scheduler, scaler=self.scaler,
                                                 save_only_model=args.save_only_model, model_state_dict=model_state,
                                                 optimizer_state_dict=optimizer_state, rng_states=rng_states)
            if self.processing_class is not None and hasattr(self.processing_class, "save_pretrained"):
                self.processing_class.save_pretrained(path)
            ckpt.rotate_checkpoints(args.output_dir, args.save_total_limit,
                                    keep=(path, self.state.best_model_checkpoint))
        distributed.barrier()  # no process goes on (or resumes) before the checkpoint is complete
        self.control = self._call("on_save")
        return path

    def _resume(self, checkpoint: str | os.PathLike) -> Any:
        """The model's weights, the optimizer, scheduler and scaler states and the trainer state from `checkpoint`;
        returns its RNG state, which the loop restores just before the next batch."""
        gathered = self._gathers_states
        loaded = ckpt.load_training_state(checkpoint, model=None if gathered else self.model,
                                          optimizer=None if gathered else self.optimizer,
                                          scheduler=self.lr_scheduler, scaler=self.scaler,
                                          process_index=self.args.process_index)
        if self._tensor_parallel:  # every process reads the whole weights and keeps its slices
            distributed.load_full_model_state_dict(self.model, ckpt.read_model_weights(checkpoint))
        if gathered and (state := ckpt.load_optimizer_state(checkpoint)) is not None:
            # every process reads the whole state and keeps its shard
            distributed.load_full_optimizer_state_dict(self.model, self.optimizer, state)
        saved = cb.TrainerState.load_from_json(loaded["state_path"])
        self.state.global_step, self.state.log_history = saved.global_step, saved.log_history
        self.state.num_input_tokens_seen, self.state.epoch = saved.num_input_tokens_seen, saved.epoch
        self.state.best_metric, self.state.best_global_step = saved.best_metric, saved.best_global_step
        self.state.best_model_checkpoint = saved.best_model_checkpoint
        if self.args.restore_callback_states_from_checkpoint:
            cb.restore_callback_states(self.callback_handler.callbacks, saved.stateful_callbacks)
        best = saved.best_model_checkpoint
        if best is not None and (reason := ckpt.incomplete_reason(best)) is not None:  # gone, or half deleted
            logger.warning("the best checkpoint %s recorded in %s cannot be used (%s): it is not the best one in "
                           "this run", best, checkpoint, reason)
            self.state.best_model_checkpoint = None
        return loaded["rng"]

    def save_model(self, output_dir: str | os.PathLike | None = None) -> None:
        """The model (config + safetensors, loadable by from_pretrained and transformers), tokenizer, arguments."""
        output_dir = Path(output_dir or self.args.output_dir)
        state = distributed.full_model_state_dict(self.model) if self._gathers_states else None  # a collective
        if distributed.is_main_process():
            if state is None:
                self.model.save_pretrained(output_dir)
            else:
                self.model.save_pretrained(output_dir, state_dict=state)
            if self.processing_class is not None and hasattr(self.processing_class, "save_pretrained"):
                self.processing_class.save_pretrained(output_dir)
            (output_dir / "training_args.json").write_text(self.args.to_json_string(), encoding="utf-8")
        distributed.barrier()
