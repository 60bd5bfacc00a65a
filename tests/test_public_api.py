"""Every public name resolves: `from gpuformers import X` works for all of __all__, lazily."""

import subprocess
import sys


def test_every_public_name_imports():
    import gpuformers

    for name in gpuformers.__all__:
        assert getattr(gpuformers, name) is not None, name


def test_import_is_light():
    # `import gpuformers` must not import torch or the model code (the CLI's env verb relies on it).
    code = "import sys, gpuformers; print('torch' in sys.modules, 'gpuformers.models.llama' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]
