"""Trainer callbacks with transformers' hooks, the state they see, and the loggers that ship with the Trainer.

A callback subclasses TrainerCallback and overrides any of the hooks below; each receives
`(args, state, control, **kwargs)` with kwargs model, optimizer, lr_scheduler, train_dataloader,
processing_class, and `logs` (on_log) or `metrics` (on_evaluate / on_predict). A hook may return a
TrainerControl (or set fields of the one it got) to ask for a log, save, evaluation or stop.

A callback that is an ExportableState (EarlyStoppingCallback, TrainerControl; transformers' too) has its state()
written into each checkpoint's trainer_state.json under "stateful_callbacks", in transformers' shape:

    "stateful_callbacks": {"EarlyStoppingCallback": {"args": {"early_stopping_patience": 2, ...},
                                                     "attributes": {"early_stopping_patience_counter": 1}},
                           "TrainerControl": {"args": {"should_training_stop": false, ...}, "attributes": {}}}

(a list of such entries when several callbacks share a class). With restore_callback_states_from_checkpoint=True
(default False, as in transformers) a resume sets the saved arguments and attributes back on the callbacks of the
same class, so that a resumed run stops early where an uninterrupted one does; else they start afresh.

Offers: TrainerState, TrainerControl, TrainerCallback, ExportableState, CallbackHandler, EarlyStoppingCallback,
ProgressCallback, JSONLLoggerCallback, TensorBoardCallback, PrinterCallback, callback_states,
restore_callback_states.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

HOOKS = ("on_init_end", "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_step_begin",
         "on_pre_optimizer_step", "on_optimizer_step", "on_substep_end", "on_step_end", "on_evaluate",
         "on_predict", "on_save", "on_log", "on_prediction_step")


@dataclass
class TrainerState:
    """What a checkpoint's trainer_state.json holds: where training is and what it logged so far. Its fields are
    transformers' (a resume derives the data position from global_step), so transformers reads the file too."""

    epoch: float = 0.0
    global_step: int = 0
    max_steps: int = 0
    num_train_epochs: int = 0
    logging_steps: float = 500
    eval_steps: float | None = None
    save_steps: float = 500
    train_batch_size: int | None = None
    num_input_tokens_seen: int = 0
    total_flos: float = 0.0
    log_history: list[dict[str, Any]] = field(default_factory=list)
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True
    # class name -> ExportableState.state() (or a list of them), written at each save: see the module docstring
    stateful_callbacks: dict[str, Any] = field(default_factory=dict)

    def save_to_json(self, path: str | os.PathLike) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(dataclasses.asdict(self), f, indent=2, sort_keys=True)

    @classmethod
    def load_from_json(cls, path: str | os.PathLike) -> "TrainerState":
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


class ExportableState:
    """A callback whose state a checkpoint keeps: state() returns {"args": the constructor's keyword arguments,
    "attributes": what changed since}, plain JSON values (transformers' ExportableState, the same contract)."""

    def state(self) -> dict[str, dict[str, Any]]:
        raise NotImplementedError(f"{type(self).__name__} is an ExportableState and must define state(), returning "
                                  '{"args": {...}, "attributes": {...}}')

    @classmethod
    def from_state(cls, state: dict[str, dict[str, Any]]):
        instance = cls(**state["args"])
        for name, value in state["attributes"].items():
            setattr(instance, name, value)
        return instance


@dataclass
class TrainerControl(ExportableState):
    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False

    def _new_step(self) -> None:
        self.should_save = self.should_evaluate = self.should_log = False

    def state(self) -> dict[str, dict[str, Any]]:
        return {"args": dataclasses.asdict(self), "attributes": {}}


class TrainerCallback:
    """Override any hook; the default of each does nothing."""


for _hook in HOOKS:
    setattr(TrainerCallback, _hook, lambda self, args, state, control, **kwargs: None)


class CallbackHandler:
    """Calls a hook on every callback in order; a callback's returned TrainerControl replaces the current one."""

    def __init__(self, callbacks, model=None, processing_class=None, optimizer=None, lr_scheduler=None):
        self.callbacks: list[TrainerCallback] = []
        for cb in callbacks:
            self.add_callback(cb)
        self.model, self.processing_class = model, processing_class
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self.train_dataloader = self.eval_dataloader = None

    def add_callback(self, callback) -> None:
        cb = callback() if isinstance(callback, type) else callback
        if not all(callable(getattr(cb, hook, None)) for hook in ("on_log", "on_step_end")):
            raise TypeError(f"callback {cb!r} is not a TrainerCallback: subclass "
                            "gpuformers.training.callbacks.TrainerCallback (or transformers' TrainerCallback)")
        self.callbacks.append(cb)

    def remove_callback(self, callback) -> None:
        self.callbacks = [cb for cb in self.callbacks if cb is not callback and type(cb) is not callback]

    def call(self, hook: str, args, state, control, **kwargs) -> TrainerControl:
        for cb in self.callbacks:
            fn = getattr(cb, hook, None)
            if fn is None:  # a transformers callback written for an older or newer set of hooks
                continue
            result = fn(args, state, control, model=self.model, processing_class=self.processing_class,
                        optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
                        train_dataloader=self.train_dataloader, eval_dataloader=self.eval_dataloader, **kwargs)
            if result is not None:
                control = result
        return control


class EarlyStoppingCallback(TrainerCallback, ExportableState):
    """Stops training once `metric_for_best_model` has failed `early_stopping_patience` evaluations in a row to beat
    the best so far by more than `early_stopping_threshold` (transformers' callback, the same rule).

    It compares each evaluation with state.best_metric before the Trainer updates it, so it needs
    metric_for_best_model (load_best_model_at_end=True sets it to "loss"). Its patience count is saved in each
    checkpoint and comes back on resume."""

    def __init__(self, early_stopping_patience: int = 1, early_stopping_threshold: float | None = 0.0):
        self.early_stopping_patience = early_stopping_patience
        self.early_stopping_threshold = early_stopping_threshold or 0.0
        self.early_stopping_patience_counter = 0  # evaluations in a row without improvement

    def check_metric_value(self, args, state, control, metric_value: float) -> None:
        best = state.best_metric
        improved = best is None or (
            (metric_value > best if args.greater_is_better else metric_value < best)
            and abs(metric_value - best) > self.early_stopping_threshold)
        self.early_stopping_patience_counter = 0 if improved else self.early_stopping_patience_counter + 1

    def on_train_begin(self, args, state, control, **kwargs):
        if args.metric_for_best_model is None:
            raise ValueError("EarlyStoppingCallback needs metric_for_best_model (e.g. 'loss'), or "
                             "load_best_model_at_end=True, which sets it to 'loss'")
        if args.eval_strategy == "no":
            raise ValueError('EarlyStoppingCallback needs evaluations: set eval_strategy to "steps" or "epoch" '
                             "(and pass an eval_dataset)")

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        key = args.metric_for_best_model
        key = key if key.startswith("eval_") else f"eval_{key}"
        value = (metrics or {}).get(key)
        if value is None:  # evaluate() called on another set (metric_key_prefix="test"): not a training evaluation
            logger.warning("EarlyStoppingCallback watches %r (metric_for_best_model), which this evaluation did not "
                           "return (it returned %s): not counted", key, sorted(metrics or {}))
            return
        self.check_metric_value(args, state, control, value)
        if self.early_stopping_patience_counter >= self.early_stopping_patience:
            control.should_training_stop = True

    def state(self) -> dict[str, dict[str, Any]]:
        return {"args": {"early_stopping_patience": self.early_stopping_patience,
                         "early_stopping_threshold": self.early_stopping_threshold},
                "attributes": {"early_stopping_patience_counter": self.early_stopping_patience_counter}}


def _is_exportable(callback) -> bool:
    # by name, so that transformers' ExportableState callbacks count without importing transformers
    return any(klass.__name__ == "ExportableState" for klass in type(callback).__mro__)


def callback_states(callbacks) -> dict[str, Any]:
    """TrainerState.stateful_callbacks for these callbacks (and the TrainerControl, when passed): class name ->
    state(), a list of them when several callbacks share a class (transformers' layout)."""
    states: dict[str, Any] = {}
    for callback in callbacks:
        if not _is_exportable(callback):
            continue
        name, value = type(callback).__name__, callback.state()
        if name not in states:
            states[name] = value
        elif isinstance(states[name], list):
            states[name].append(value)
        else:
            states[name] = [states[name], value]
    return states


def restore_callback_states(callbacks, saved: dict[str, Any]) -> None:
    """Set the arguments and attributes saved in a checkpoint's stateful_callbacks back on the callbacks of the same
    class, the n-th saved entry on the n-th such callback (transformers rebuilds each from them: the same for
    callbacks whose arguments are attributes, as EarlyStoppingCallback's). The TrainerControl is not restored: its
    flags belong to the step that saved them."""
    ignored = []
    for name, entries in saved.items():
        if name == "TrainerControl":
            continue
        matching = [callback for callback in callbacks if type(callback).__name__ == name]
        if not matching:
            ignored.append(name)
        for callback, entry in zip(matching, entries if isinstance(entries, list) else [entries]):
            for attribute, value in {**(entry.get("args") or {}), **(entry.get("attributes") or {})}.items():
                setattr(callback, attribute, value)
    if ignored:
        logger.warning("the checkpoint holds the state of callbacks this Trainer does not have: %s (ignored)",
                       ", ".join(ignored))


class ProgressCallback(TrainerCallback):
    """A tqdm bar over optimizer steps on the console; logs are written above it."""

    def __init__(self):
        self.bar = None

    def on_train_begin(self, args, state, control, **kwargs):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc="train", dynamic_ncols=True)

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.bar is not None and logs:
            shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in logs.items()}
            self.bar.write(str(shown))

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class PrinterCallback(TrainerCallback):
    """Logs as plain lines (disable_tqdm=True)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs:
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in logs.items()}, flush=True)


class JSONLLoggerCallback(TrainerCallback):
    """One JSON line per log in `output_dir/trainer_log.jsonl` (step, epoch and the logged values)."""

    file_name = "trainer_log.jsonl"

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or not state.is_world_process_zero:
            return
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, self.file_name), "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": state.global_step, "epoch": state.epoch, **logs}) + "\n")


class TensorBoardCallback(TrainerCallback):
    """Scalars to TensorBoard (report_to="tensorboard"; needs the tensorboard package) in logging_dir, else in
    $TENSORBOARD_LOGGING_DIR (transformers 5's setting), else in output_dir/runs."""

    def __init__(self):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise ImportError("report_to='tensorboard' needs the tensorboard package: pip install tensorboard") \
                from error
        self._writer_class, self.writer = SummaryWriter, None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.writer is None:
            folder = args.logging_dir or os.getenv("TENSORBOARD_LOGGING_DIR") or os.path.join(args.output_dir, "runs")
            self.writer = self._writer_class(log_dir=os.path.expanduser(folder))
        for key, value in (logs or {}).items():
            if isinstance(value, (int, float)):
                self.writer.add_scalar(key if "/" in key else f"train/{key}", value, state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        if self.writer is not None:
            self.writer.close()
