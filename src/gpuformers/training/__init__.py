"""Training: TrainingArguments, Trainer, collators and packing, optimizers and schedules, atomic checkpoints.

    from gpuformers.training import Trainer, TrainingArguments

Offers: TrainingArguments, Trainer, TrainerCallback, TrainerState, TrainerControl, EarlyStoppingCallback,
ExportableState, DataCollatorForCausalLM, DataCollatorForLanguageModeling, PackedCollator, tokenize_chat,
tokenize_text, get_last_checkpoint.
"""

from gpuformers.training.arguments import TrainingArguments
from gpuformers.training.callbacks import (EarlyStoppingCallback, ExportableState, TrainerCallback, TrainerControl,
                                          TrainerState)
from gpuformers.training.checkpoint import get_last_checkpoint
from gpuformers.training.data import (DataCollatorForCausalLM, DataCollatorForLanguageModeling, tokenize_chat,
                                      tokenize_text)
from gpuformers.training.packing import PackedCollator
from gpuformers.training.trainer import Trainer, TrainOutput

__all__ = ["TrainingArguments", "Trainer", "TrainOutput", "TrainerCallback", "TrainerControl", "TrainerState",
           "EarlyStoppingCallback", "ExportableState", "DataCollatorForCausalLM", "DataCollatorForLanguageModeling",
           "PackedCollator", "tokenize_chat", "tokenize_text", "get_last_checkpoint"]
