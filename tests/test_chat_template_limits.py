"""Chat templates come from checkpoints (untrusted code): the sandbox bounds what a template may make
(gpuformers/chat_sandbox.py) and a syntax error names the file it is in, with its line."""

from __future__ import annotations

import json

import jinja2
import jinja2.ext
import jinja2.sandbox
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from gpuformers import chat_sandbox
from gpuformers.chat_sandbox import ChatTemplateLimitError
from gpuformers.tokenizer import PreTrainedTokenizerFast

CHAT = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "the cat sat"}]


@pytest.fixture
def tokenizer() -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.train_from_iterator(["hello world", "the cat sat"], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    return PreTrainedTokenizerFast(backend, unk_token="[UNK]", chat_template="{{ messages[0]['content'] }}")


def _render(tokenizer, template: str) -> str:
    return tokenizer.apply_chat_template(CHAT, chat_template=template, tokenize=False)


def test_a_syntax_error_in_chat_template_jinja_names_the_file_and_line(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    broken = "{% for m in messages %}\n{{ m['content'] }}\n{% if m.role == 'user' %}\n{% endfor %}\n"
    (tmp_path / "chat_template.jinja").write_text(broken, encoding="utf-8")
    (tmp_path / "chat_templates").mkdir()
    (tmp_path / "chat_templates" / "tool_use.jinja").write_text("{{ messages | }}", encoding="utf-8")
    loaded = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    with pytest.raises(jinja2.TemplateSyntaxError) as info:  # still jinja's type, as transformers raises
        loaded.apply_chat_template(CHAT, tokenize=False)
    message = str(info.value)
    assert f'File "{tmp_path / "chat_template.jinja"}", line 4' in message
    assert "Encountered unknown tag 'endfor'" in message and "{% endfor %}" in message  # the line itself
    with pytest.raises(jinja2.TemplateSyntaxError, match="chat_templates/tool_use.jinja"):
        loaded.apply_chat_template(CHAT, tokenize=False, chat_template="tool_use")
    # a template given as a string says so
    with pytest.raises(jinja2.TemplateSyntaxError, match='File "<chat_template string>", line 1'):
        _render(loaded, "{% if %}")


def test_the_issues_template_is_refused_before_it_allocates_a_gigabyte(tokenizer):
    with pytest.raises(ChatTemplateLimitError, match=r"str \* 1000000000 would make about 1,000,000,000 characters"
                                                     r".*at most 16,777,216 \(gpuformers.chat_sandbox.MAX_LENGTH\)"):
        _render(tokenizer, "{{ ('a' * 10**9)|length }}")
    with pytest.raises(ChatTemplateLimitError, match="a 4-bit integer \\*\\* 1000000 would make about 3,000,000 bits"):
        _render(tokenizer, "{{ (10 ** 1000000) > 0 }}")


# Each renders the same text as jinja's own sandbox at n = 3, and is refused at n = 600 with MAX_LENGTH = 1000.
TEMPLATES = {
    "str * n": ("{{ 'ab' * n }}", r"str \* 600"),
    "list * n, printed": ("{{ ['abcd'] * n }}", "printing this value"),
    "+ doubling": ("{% set ns = namespace(s='ab') %}{% for i in range(n) %}{% set ns.s = ns.s + ns.s %}{% endfor %}"
                   "{{ ns.s|length }}", r"str \+ str"),
    "~ doubling": ("{% set ns = namespace(s='ab') %}{% for i in range(n) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
                   "{{ ns.s|length }}", "the ~ operator"),
    "ljust": ("{{ 'a'.ljust(n * 2) }}|", r"str.ljust\(\)"),
    "str.format width": ("{{ '{:>{w}}'.format('a', w=n * 2) }}|", r"str.format\(\)"),
    "% width": ("{{ '%*s' % (n * 2, 'a') }}|", "the % string format"),
    "center": ("{{ 'a'|center(n * 2) }}|", "the center filter"),
    "indent": ("{{ 'a\nb\nc'|indent(n) }}", "the indent filter"),
    "join": ("{{ (['abcd'] * n)|join(', ') }}", "the join filter"),
    "replace": ("{{ ('ab' * 100)|replace('a', 'x' * n) }}", "the replace filter"),
    "batch": ("{{ [1]|batch(n * 2, 0)|list|length }}", "the batch filter"),
    "tojson indent": ("{{ messages|tojson(indent=n) }}", "the tojson filter"),
    "set block": ("{% set s %}{% for i in range(n) %}abcd{% endfor %}{% endset %}{{ s|length }}",
                  "the text this template renders"),
    "output": ("{% for i in range(n) %}{{ messages[0]['content'] }}{% endfor %}", "the text this template renders"),
}


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_what_passes_the_limit_is_refused_and_what_does_not_renders_as_jinja_does(tokenizer, monkeypatch, name):
    template, refused = TEMPLATES[name]
    jinja = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                         extensions=[jinja2.ext.loopcontrols])
    jinja.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    expected = jinja.from_string("{% set n = 3 %}" + template).render(messages=CHAT)
    assert _render(tokenizer, "{% set n = 3 %}" + template) == expected
    monkeypatch.setattr(chat_sandbox, "MAX_LENGTH", 1000)
    with pytest.raises(ChatTemplateLimitError, match=f"chat template refused: {refused} would make about"):
        _render(tokenizer, "{% set n = 600 %}" + template)
