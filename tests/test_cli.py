"""The `gpuformers` command line: the verb table, --help, --gpus in a child process, env --json, doctor's exit code."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import types

import pytest

from gpuformers import cli
from gpuformers.doctor import Finding

GPU_VARIABLES = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "GPUFORMERS_GPUS")


def run_gpuformers(*args: str, script: str | None = None) -> subprocess.CompletedProcess:
    """`python -m gpuformers ARGS` (or `python -c SCRIPT ARGS`) with no GPU variable inherited from this shell."""
    env = {k: v for k, v in os.environ.items() if k not in GPU_VARIABLES}
    command = [sys.executable, "-c", script, *args] if script else [sys.executable, "-m", "gpuformers", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)


def test_env_json_in_a_subprocess():
    done = run_gpuformers("env", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert report["versions"]["gpuformers"] == cli.importlib.import_module("gpuformers").__version__
    assert report["environ"] == {"CUDA_VISIBLE_DEVICES": None, "CUDA_DEVICE_ORDER": None}
    assert report["device_count"] == len(report["gpus"])


@pytest.mark.parametrize("args", [["--gpus", "1,0", "env", "--json"], ["env", "--json", "--gpus", " 1, 0"]])
def test_gpus_reaches_the_child_before_or_after_the_verb(args):
    done = run_gpuformers(*args)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["environ"] == {"CUDA_VISIBLE_DEVICES": "1,0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert report["gpus_flag"] == "1,0"


def test_gpus_empty_runs_on_the_cpu():
    done = run_gpuformers("--gpus", "", "env", "--json")
    report = json.loads(done.stdout)
    assert report["environ"]["CUDA_VISIBLE_DEVICES"] == ""
    assert (report["cuda_available"], report["device_count"], report["gpus"]) == (False, 0, [])


# A verb added to the table from outside: it records what the process looked like when it started.
PROBE = textwrap.dedent("""
    import json, os, sys
    from gpuformers import cli

    def probe(args):
        torch = sys.modules.get("torch")
        print(json.dumps({"visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                          "order": os.environ.get("CUDA_DEVICE_ORDER"),
                          "torch_imported": torch is not None,
                          "cuda_initialized": bool(torch and torch.cuda.is_initialized()),
                          "model_code_imported": "gpuformers.models" in sys.modules,
                          "flag": args.flag}))

    def add_arguments(parser):
        parser.add_argument("--flag", default="none")

    cli.VERBS["probe"] = cli.Verb("print what the verb sees", "gpuformers probe", "__main__:probe",
                                  "__main__:add_arguments")
    sys.exit(cli.main(sys.argv[1:]))
""")


def test_gpus_is_applied_before_the_verb_and_before_cuda_starts():
    done = run_gpuformers("--gpus", "1,0", "probe", "--flag", "x", script=PROBE)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen == {"visible": "1,0", "order": "PCI_BUS_ID", "torch_imported": False, "cuda_initialized": False,
                    "model_code_imported": False, "flag": "x"}


def test_gpus_after_cuda_started_is_an_error(monkeypatch, capsys):
    class StartedCuda:
        def is_initialized(self):
            return True

    environ = {}
    monkeypatch.setattr(os, "environ", environ)  # select_gpus must not touch the real environment
    monkeypatch.setattr("torch.cuda", StartedCuda())
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--gpus", "0", "env"])
    assert exit_.value.code == 2 and "CUDA is already initialised" in capsys.readouterr().err
    assert environ == {}


def test_bad_gpus_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--gpus", "0,x", "env"])
    assert exit_.value.code == 2 and '--gpus "0,x" is not a comma-separated list' in capsys.readouterr().err


@pytest.mark.parametrize("verb", sorted(cli.VERBS))
def test_every_verb_has_help_with_an_example(verb, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([verb, "--help"])
    text = capsys.readouterr().out
    assert exit_.value.code == 0
    assert f"usage: gpuformers {verb}" in text and "--gpus" in text
    assert f"example:\n  {cli.VERBS[verb].example}" in text and cli.VERBS[verb].example.startswith("gpuformers ")


def test_top_level_help_lists_the_verbs(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps long summaries
    for name, verb in cli.VERBS.items():
        assert name in text and " ".join(verb.summary.split()) in text


def test_unknown_verb_lists_the_known_ones(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bogus"])
    assert exit_.value.code == 2 and "invalid choice: 'bogus'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, verb", [(["env"], "env"), (["--gpus", "0", "doctor"], "doctor"),
                                        (["--gpus", "", "env", "--json"], "env"), (["--gpus=1", "env"], "env"),
                                        (["--help"], None)])
def test_find_verb_skips_the_common_flags(argv, verb):
    assert cli._find_verb(argv) == verb


@pytest.mark.parametrize("findings, code", [
    ([Finding("ok", "torch", "fine"), Finding("warn", "CUDA_DEVICE_ORDER", "a\nb", "export it")], 0),
    ([Finding("fail", "CUDA", "broken", "update the driver")], 1),
])
def test_doctor_exit_code_is_one_only_on_a_failure(monkeypatch, capsys, findings, code):
    monkeypatch.setattr("gpuformers.doctor.env_report", lambda: {})
    monkeypatch.setattr("gpuformers.doctor.doctor", lambda report: findings)
    assert cli.main(["doctor"]) == code
    text = capsys.readouterr().out
    assert f"{sum(f.level == 'fail' for f in findings)} failed" in text
    assert all(f"{f.check}: {f.message.splitlines()[0]}" in text for f in findings)


def test_env_text_shows_the_gpu_table():
    report = {
        "versions": {"python": "3.11.7", "gpuformers": "0.1.0", "torch": "2.13.0", "torch_cuda": "12.6",
                     "driver": "550.54.15", "triton": None, "flash_attn": None, "bitsandbytes": None},
        "torch_error": None, "cuda_available": True, "device_count": 1, "cuda_error": None,
        "environ": {"CUDA_VISIBLE_DEVICES": "3", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, "gpus_flag": "3",
        "gpus": [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "capability": [9, 0], "total_memory": 80 * 2**30,
                  "free_memory": None, "bf16": True, "pci_bus_id": "00000000:AF:00.0", "nvidia_smi_index": 3}],
        "nvidia": {"source": "nvidia-smi", "gpus": []},
    }
    text = cli.format_env(report)
    assert "CUDA_VISIBLE_DEVICES='3'   CUDA_DEVICE_ORDER=PCI_BUS_ID   (set by --gpus '3')" in text
    row = next(line for line in text.splitlines() if line.startswith("cuda:0"))
    assert row.split() == ["cuda:0", "3", "NVIDIA", "H100", "80GB", "HBM3", "9.0", "80.00", "GiB", "?", "yes",
                           "00000000:AF:00.0"]
    assert "triton        not installed" in text and "NVIDIA driver 550.54.15" in text


# ------------------------------------------------------------------------ the library's errors in the CLI's words

PYTHON_ARGUMENT = re.compile(r"\b(device_map|dtype|gguf_file|local_files_only|tp_plan|bits|quantization_config)=")


def _error_of(call) -> str:
    try:
        call()
    except Exception as error:  # noqa: BLE001 (whichever the library raises, its text is what is translated)
        return str(error)
    raise AssertionError("no error")


def _offline_miss(tmp_path, monkeypatch):
    from gpuformers.hub import resolve_model_dir

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    return lambda: resolve_model_dir("acme/absent")


def _a_file(tmp_path, monkeypatch):
    from gpuformers.hub import resolve_model_dir

    (tmp_path / "model.bin").write_bytes(b"")
    return lambda: resolve_model_dir(tmp_path / "model.bin")


def _no_gpu(tmp_path, monkeypatch):
    from gpuformers.device import resolve_device

    return lambda: resolve_device("cuda", cuda=types.SimpleNamespace(is_available=lambda: False))


def _bad_device(tmp_path, monkeypatch):
    from gpuformers.device import resolve_device

    return lambda: resolve_device("gpu0")


def _bad_checkpoint_dtype(tmp_path, monkeypatch):
    from gpuformers.device import resolve_dtype

    return lambda: resolve_dtype("auto", checkpoint_dtype="int3")


def _spread_model_served(tmp_path, monkeypatch):
    from gpuformers.engine.config import check_one_device

    return lambda: check_one_device(types.SimpleNamespace(hf_device_map={"model": 0, "lm_head": "cpu"}))


def _odd_int4_layer(tmp_path, monkeypatch):
    import torch

    from gpuformers.quantization.weight_only import _check_settings

    return lambda: _check_settings(5, 4, None, torch.float32)


def _gguf_split_served(tmp_path, monkeypatch):
    from gpuformers.models.load_steps import _tensor_parallel_device

    return lambda: _tensor_parallel_device("auto", None, "m.gguf")


def _gguf_spread(tmp_path, monkeypatch):
    import torch

    from tests.fixtures.checkpoints import TINY

    from gpuformers.models.load_steps import _gguf_device
    from gpuformers.models.config import ModelConfig
    from gpuformers.models.modeling import skip_init
    from gpuformers.models.registry import model_class_for

    config = ModelConfig.from_dict({"model_type": "llama", "architectures": ["LlamaForCausalLM"], **TINY})
    with torch.device("meta"), skip_init():
        model = model_class_for(config)(config)
    return lambda: _gguf_device(model, "auto", {"cpu": 1000}, torch.float32)


def _engine_setting(tmp_path, monkeypatch):
    from gpuformers.engine.config import ContinuousBatchingConfig

    return lambda: ContinuousBatchingConfig(max_memory_percent=1.5)


@pytest.mark.parametrize("verb, error, python, flag", [
    ("fit", _offline_miss, "(HF_HUB_OFFLINE=1 or local_files_only=True) forbids", "(HF_HUB_OFFLINE=1) forbids"),
    ("generate", _a_file, "(or gguf_file= for a GGUF file)", "(or a path ending in .gguf for a GGUF file)"),
    ("train", _a_file, "(or gguf_file= for a GGUF file)", "pass the folder that holds config.json"),
    ("generate", _no_gpu, 'or run on the CPU with device_map="cpu"', "or run on the CPU with --device cpu"),
    ("train", _no_gpu, 'or run on the CPU with device_map="cpu"', "or run on the CPU with --cpu"),
    ("serve", _bad_device, "a torch.device", "accepted: cpu, cuda, cuda:N or auto"),
    ("chat", _bad_checkpoint_dtype, "pass dtype= one of: float32", "pass --dtype one of: float32"),
    ("serve", _spread_model_served, 'device_map="cuda" (one GPU), or over several GPUs with tp_plan="auto"',
     "--device cuda (one GPU), or over several GPUs with --tensor-parallel-size N under torchrun"),
    ("generate", _odd_int4_layer, "use bits=8 for this layer", "use --quantization int8 for this layer"),
    ("serve", _engine_setting, "max_memory_percent=1.5 must be", "--gpu-memory-utilization 1.5 must be in (0, 1]"),
    ("serve", _gguf_split_served, "tp_plan='auto' with a GGUF file", "--tensor-parallel-size N with a GGUF file"),
    ("chat", _gguf_spread, """device_map='auto' places this GGUF model on disk""",
     "--device auto places this GGUF model on disk, but a GGUF file loads whole onto one GPU or the CPU for now: "
     "pass one device (e.g. --device cuda:0), and --quantization if the model does not fit there"),
])
def test_cli_errors_name_the_verbs_flags_where_python_errors_name_arguments(tmp_path, monkeypatch, verb, error,
                                                                             python, flag):
    message = _error_of(error(tmp_path, monkeypatch))
    assert python in message  # the Python API keeps its own words
    shown = cli.for_cli(message, cli.VERBS[verb].flags)
    assert flag in shown and not PYTHON_ARGUMENT.search(shown), shown
    if verb == "train":
        assert "gguf" not in shown.lower()  # train takes no GGUF file: nothing offers one


def test_a_cli_user_is_told_the_flag(tmp_path, monkeypatch, capsys):
    pytest.importorskip("gguf")
    import torch

    from tests.test_gguf import write_tiny_llama

    from gpuformers import AutoModelForCausalLM

    write_tiny_llama(tmp_path / "m.gguf", layers=1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match='or run on the CPU with device_map="cpu"'):
        AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", device_map="cuda")
    assert cli.main(["generate", "hi", "--model", str(tmp_path / "m.gguf"), "--device", "cuda"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("gpuformers generate: error: device 'cuda' was asked for, but no CUDA GPU is visible")
    assert "or run on the CPU with --device cpu." in error and "device_map" not in error


def test_train_names_the_flag_for_a_gguf_file(tmp_path, capsys):
    assert cli.main(["train", "--model", str(tmp_path / "m.gguf"), "--data", str(tmp_path / "d.jsonl")]) == 2
    error = capsys.readouterr().err
    assert f"--model {tmp_path / 'm.gguf'}: `gpuformers train` fine-tunes a safetensors checkpoint, not a GGUF" in error
