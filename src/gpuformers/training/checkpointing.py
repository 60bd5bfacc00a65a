"""The Trainer's side of checkpoints: what goes into checkpoint-N and what a resume takes back, across processes.

    save:    whole states gathered from every process (FSDP2 shards, tensor-parallel slices: a collective), and
             every process's RNG state -> process 0 writes checkpoint-N (checkpoint.py: atomically), rotates the
             old ones -> all wait
    resume:  weights, optimizer, scheduler, scaler -> each process keeps its part; the trainer state (step, log
             history, best checkpoint, callback states) -> this process's RNG state, restored by the loop before
             the next batch

checkpoint.py does the files; the Checkpointer here, which the Trainer owns, decides what goes in them. save_model
writes the model alone (config + safetensors, tokenizer, arguments).

Under DeepSpeed (`engine` given to each call) every process writes its shards of the optimizer and model states
(deepspeed_engine.save_checkpoint) into a staging folder that process 0 moves into checkpoint-N as global_stepN/
before publishing it, in place of optimizer.pt and scheduler.pt; the weights are whole in model.safetensors under
ZeRO-1/2, and under ZeRO-3 when stage3_gather_16bit_weights_on_model_save gathers them. A resume hands global_stepN/
back to the engine (weights, optimizer shards, scheduler) and reads the trainer state and RNG as usual.

Offers: Checkpointer.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

from gpuformers import distributed
from gpuformers.training import callbacks as cb
from gpuformers.training import checkpoint as ckpt
from gpuformers.training import deepspeed_engine

logger = logging.getLogger(__name__)


class Checkpointer:
    """Writes checkpoint-N and the final model, and resumes from a checkpoint, for the Trainer that owns it.

    It holds what stays fixed for the Trainer's life (its arguments, its model and how that model is split over
    the processes); what a run replaces (the state, optimizer, scheduler, scaler, callbacks) comes with each call.
    """

    def __init__(self, args, model, gathers_states: bool, tensor_parallel: bool):
        self.args, self.model = args, model
        # the model split over the processes (FSDP2 shards, tensor-parallel slices): whole states are gathered
        self.gathers_states, self.tensor_parallel = gathers_states, tensor_parallel

    def save(self, state: cb.TrainerState, optimizer, lr_scheduler, scaler, callbacks: list,
             processing_class=None, engine=None) -> Path:
        """checkpoint-N for state.global_step, with `callbacks`' states (the Trainer's callbacks and its control);
        `engine`: the DeepSpeed engine of a DeepSpeed run (see the module docstring)."""
        args = self.args
        # Whole states are gathered (every process takes part); process 0 alone writes.
        gathered = self.gathers_states
        model_state = distributed.full_model_state_dict(self.model) if gathered else None
        optimizer_state = (distributed.full_optimizer_state_dict(self.model, optimizer)
                           if gathered and not args.save_only_model else None)
        staging = None
        if engine is not None:
            model_state = deepspeed_engine.whole_state_dict(engine, args.deepspeed_config)  # a collective
            optimizer = lr_scheduler = None  # in DeepSpeed's states
            if not args.save_only_model:
                staging = self._deepspeed_staging(engine, state.global_step)
        path = Path(args.output_dir) / f"{ckpt.CHECKPOINT_PREFIX}-{state.global_step}"
        if state.best_global_step == state.global_step:  # recorded in this checkpoint's own state
            state.best_model_checkpoint = os.path.join(args.output_dir, path.name)
        state.stateful_callbacks = cb.callback_states(callbacks)
        # every process's RNG state (a collective), not process 0's alone: each draws its own dropout masks from
        # its own generators, and a resume must give each process its own back
        rng_states = (distributed.gather_to_main(ckpt.capture_rng_state())
                      if distributed.world_size() > 1 and not args.save_only_model else None)
        if distributed.is_main_process():
            path = ckpt.save_training_checkpoint(args.output_dir, state.global_step, model=self.model,
                                                 state=state, args=args, optimizer=optimizer,
                                                 scheduler=lr_scheduler, scaler=scaler,
                                                 save_only_model=args.save_only_model, model_state_dict=model_state,
                                                 optimizer_state_dict=optimizer_state, rng_states=rng_states,
                                                 weights=engine is None or model_state is not None, moved_in=staging)
            if processing_class is not None and hasattr(processing_class, "save_pretrained"):
                processing_class.save_pretrained(path)
            ckpt.rotate_checkpoints(args.output_dir, args.save_total_limit, keep=(path, state.best_model_checkpoint))
        distributed.barrier()  # no process goes on (or resumes) before the checkpoint is complete
        return path

    def _deepspeed_staging(self, engine, step: int) -> Path:
        """Every process writes its DeepSpeed shards into a staging folder beside the checkpoints (not a .tmp- one,
        which a save removes as stale); process 0 moves them into checkpoint-N once all are written."""
        staging = Path(self.args.output_dir) / f".deepspeed-{ckpt.CHECKPOINT_PREFIX}-{step}"
        if distributed.is_main_process() and staging.exists():  # left by a save that crashed
            shutil.rmtree(staging)
        distributed.barrier()
        deepspeed_engine.save_checkpoint(engine, staging, step)
        distributed.barrier()
        return staging

    def resume(self, checkpoint: str | os.PathLike, state: cb.TrainerState, optimizer, lr_scheduler, scaler,
               callbacks: list, engine=None) -> Any:
        """The model's weights, the optimizer, scheduler and scaler states and the trainer state (into `state`, and
        `callbacks` when restore_callback_states_from_checkpoint) from `checkpoint`; returns its RNG state, which
        the loop restores just before the next batch. `engine`: a DeepSpeed run's engine, which loads the weights,
        optimizer and scheduler from the checkpoint's global_stepN/."""
        gathered = self.gathers_states or engine is not None
        if engine is not None:
            deepspeed_engine.load_checkpoint(engine, checkpoint)
        loaded = ckpt.load_training_state(checkpoint, model=None if gathered else self.model,
                                          optimizer=None if gathered else optimizer,
                                          scheduler=None if engine is not None else lr_scheduler, scaler=scaler,
                                          process_index=self.args.process_index, deepspeed=engine is not None)
        if self.tensor_parallel:  # every process reads the whole weights and keeps its slices
            distributed.load_full_model_state_dict(self.model, ckpt.read_model_weights(checkpoint))
        if gathered and (optimizer_state := ckpt.load_optimizer_state(checkpoint)) is not None:
            # every process reads the whole state and keeps its shard
            distributed.load_full_optimizer_state_dict(self.model, optimizer, optimizer_state)
        saved = cb.TrainerState.load_from_json(loaded["state_path"])
        state.global_step, state.log_history = saved.global_step, saved.log_history
        state.num_input_tokens_seen, state.epoch = saved.num_input_tokens_seen, saved.epoch
        state.best_metric, state.best_global_step = saved.best_metric, saved.best_global_step
        state.best_model_checkpoint = saved.best_model_checkpoint
        if self.args.restore_callback_states_from_checkpoint:
            cb.restore_callback_states(callbacks, saved.stateful_callbacks)
        best = saved.best_model_checkpoint
        if best is not None and (reason := ckpt.incomplete_reason(best)) is not None:  # gone, or half deleted
            logger.warning("the best checkpoint %s recorded in %s cannot be used (%s): it is not the best one in "
                           "this run", best, checkpoint, reason)
            state.best_model_checkpoint = None
        return loaded["rng"]

    def save_model(self, output_dir: str | os.PathLike | None = None, processing_class=None, engine=None) -> None:
        """The model (config + safetensors, loadable by from_pretrained and transformers), tokenizer, arguments.
        `engine` (DeepSpeed): the weights gathered under ZeRO-3, or DeepSpeed's sharded checkpoint when the config
        does not gather them (stage3_gather_16bit_weights_on_model_save off)."""
        output_dir = Path(output_dir or self.args.output_dir)
        state = distributed.full_model_state_dict(self.model) if self.gathers_states else None  # a collective
        sharded = False
        if engine is not None:
            state = deepspeed_engine.whole_state_dict(engine, self.args.deepspeed_config)  # a collective
            if sharded := state is None:
                deepspeed_engine.write_sharded_model(engine, output_dir)  # every process writes its shards
        if distributed.is_main_process():
            if sharded:
                self.model.config.save_pretrained(output_dir)
            elif state is None:
                self.model.save_pretrained(output_dir)
            else:
                self.model.save_pretrained(output_dir, state_dict=state)
            if processing_class is not None and hasattr(processing_class, "save_pretrained"):
                processing_class.save_pretrained(output_dir)
            (output_dir / "training_args.json").write_text(self.args.to_json_string(), encoding="utf-8")
        distributed.barrier()
