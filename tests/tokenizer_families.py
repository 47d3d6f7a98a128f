"""Tokenizers of other families than SmolLM2's, built offline (no hub): trained with the `tokenizers` library on
Python's own documentation text, wrapped in transformers' classes, and saved twice through `save_pretrained` as
`fxllm compile` does (source directory → artifact tokenizer directory). Plus the strings and conversations the parity
tests compare on."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

# Written for these tests to exercise what templates written for transformers use: the BOS text, a namespace,
# loop controls, raise_exception, tojson of tools, strftime_now, whitespace control with trim/lstrip_blocks, and a
# {% generation %} block.
RICH_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(system="", turns=0) %}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}
        {%- set ns.system = message['content'] %}
        {%- continue %}
    {%- endif %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception("unknown role: " + message['role']) }}
    {%- endif %}
    {%- set ns.turns = ns.turns + 1 %}
{%- endfor %}
{%- if tools %}<tools>{{ tools | tojson }}</tools>
{% endif %}
{%- if ns.system %}<system year={{ strftime_now('%Y') }}>{{ ns.system }}</system>
{% endif %}
{% for message in messages if message['role'] != 'system' %}
    {% if message['role'] == 'assistant' %}
<assistant>{% generation %}{{ message['content'] | trim }}{% endgeneration %}{{ eos_token }}
    {% else %}
<user n={{ loop.index }}/{{ ns.turns }}>{{ message['content'] }}
    {% endif %}
    {% if loop.index > 20 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}<assistant>{% endif %}"""

# Mistral-style: user/assistant must alternate, enforced with raise_exception.
ALTERNATING_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ message['content'] + eos_token + ' ' }}{% endif %}{% endfor %}")

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime number."}],
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "And 3+3?"}],
    [{"role": "system", "content": "Système: réponds en français 🇫🇷"}, {"role": "user", "content": "Bonjour\n\n  ça va ?"},
     {"role": "assistant", "content": "  Très bien, merci.  "}, {"role": "user", "content": "<|im_end|> <s> [MASK]"}],
    [{"role": "user", "content": "def f(x):\n\treturn x ** 2\n"}, {"role": "assistant", "content": "It squares x."}],
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": "tool time", "name": None}, {"role": "assistant", "content": "ok", "tool_calls": None}],
]


def parity_strings() -> list[str]:
    """About 330 strings: hand-picked edge cases, then seeded random mixtures of the same kinds of pieces."""
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<s>", "</s>", "<unk>", "[CLS]", "[SEP]", "[MASK]",
                "<tool>", "<image>", "<extra_a>", "<|im_start", "im_end|>", "<<|im_end|>>", "<|im_end|><|im_end|>"]
    unicode = ["naïve café", "Ünïcödé", "日本語のテキスト", "한국어 문장", "Ελληνικά", "русский язык", "עברית",
               "العربية", "हिन्दी", "ภาษาไทย", "Z̤͔ͧ̑̓ä͖̭̈̇lͮ̒ͫǧ̗͚̚o̙̔ͮ̇͐̇", "ﬁ ﬂ Å Å Ω Ω", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "½ ² ⅷ ①"]
    emoji = ["😀", "👍🏽", "👨‍👩‍👧‍👦", "🇫🇷🇯🇵", "❤️", "🧑🏿‍💻", "🫠", "🏳️‍🌈", "😀😀😀"]
    spaces = [" ", "  ", "   ", "\n", "\n\n", "\t", "\t\t", "\r\n", "\u00a0", "\u3000", "\u200b", " \n \t ", "\x0b\x0c"]
    code = ["def f(x):\n    return x ** 2\n", "for (int i = 0; i < n; ++i) { a[i] = i; }", '{"key": [1, 2.5, null]}',
            "<div class=\"x\">&amp;</div>", "SELECT * FROM t WHERE a >= 10;", "x = lambda y: y if y else None",
            "#include <stdio.h>", "    indented\n        more", "a_b-c.d/e\\f", "$HOME && echo $?"]
    numbers = ["0", "7", "42", "3.14159", "-273.15", "1e-10", "6.022e23", "12345678901234567890", "1,000,000",
               "2026-12-01", "10:30:00", "0x1F", "100%", "$9.99", "1/3", "٣٤٥", "１２３"]
    words = ["hello", "Hello", "HELLO", "world", "don't", "it's", "I'm", "we've", "they're", "Hello , world .",
             "The quick brown fox jumps over the lazy dog.", "a", "ab", "supercalifragilisticexpialidocious"]
    fixed = ["", *specials, *unicode, *emoji, *spaces, *code, *numbers, *words,
             "Hello world", " leading space", "trailing space ", "  both  ", "multiple   inner    spaces",
             "line1\nline2\r\nline3", "tab\tseparated\tvalues", "<|im_start|>user\nhi<|im_end|>\n",
             "text<|im_end|>text", " <s> x </s> ", "[CLS] a [SEP] b [MASK]", "emoji😀inside", "mixed 中文 and English",
             "ALL CAPS SENTENCE!", "?!.,;:'\"()[]{}", "----====____", "a" * 200, "ab " * 60, "\n" * 12, " " * 33]
    pieces = [*specials, *unicode, *emoji, *spaces, *code, *numbers, *words]
    rng = random.Random(20261201)
    mixed = []
    for _ in range(330 - len(fixed)):
        count = rng.randint(1, 8)
        mixed.append("".join(rng.choice(pieces) + rng.choice(["", " ", "", "\n", " "]) for _ in range(count)))
    return fixed + mixed


def _trained(model: models.Model, trainer: trainers.Trainer, setup) -> dict:
    """A tokenizer trained on Python's documentation topics, as its tokenizer.json document."""
    from pydoc_data.topics import topics

    tokenizer = Tokenizer(model)
    setup(tokenizer)
    tokenizer.train_from_iterator(list(topics.values()), trainer)
    return json.loads(tokenizer.to_str())


def _merges(document: dict) -> list[tuple[str, str]]:
    return [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in document["model"]["merges"]]


def build_family(name: str, root: Path) -> tuple[Path, Path]:
    """Build tokenizer family `name`: its source directory and the artifact-style copy transformers saves from it."""
    from transformers import AutoTokenizer, GPT2Tokenizer, LlamaTokenizer

    source, artifact = root / f"{name}-source", root / f"{name}-artifact"
    if name == "gpt2-bpe":  # byte-level BPE, a BOS-adding post-processor, a rich template
        def setup(t):
            t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            t.decoder = decoders.ByteLevel()
        document = _trained(models.BPE(), trainers.BpeTrainer(
            vocab_size=1500, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
            setup)
        tokenizer = GPT2Tokenizer(vocab=document["model"]["vocab"], merges=_merges(document), add_bos_token=True)
        tokenizer.chat_template = RICH_TEMPLATE
        tokenizer.save_pretrained(source)
    elif name == "llama-spm":  # SentencePiece-style BPE: '▁' for spaces, byte fallback, BOS, alternating template
        byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
        document = _trained(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True), trainers.BpeTrainer(
            vocab_size=1500, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens]),
            lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.Metaspace(prepend_scheme="first", split=True)))
        tokenizer = LlamaTokenizer(vocab=document["model"]["vocab"], merges=_merges(document), add_bos_token=True)
        tokenizer.chat_template = ALTERNATING_TEMPLATE
        tokenizer.save_pretrained(source)
    elif name == "wordpiece-raw":  # hand-written config: special tokens not in the vocabulary, flags, named templates
        def setup(t):
            t.normalizer = normalizers.BertNormalizer(lowercase=True)
            t.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
            t.decoder = decoders.WordPiece()
            t.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B")
        document = _trained(models.WordPiece(unk_token="[UNK]"),
                            trainers.WordPieceTrainer(vocab_size=1200, special_tokens=["[UNK]"]), setup)
        source.mkdir(parents=True)
        (source / "tokenizer.json").write_text(json.dumps(document))
        added = {"content": "<tool>", "lstrip": True, "rstrip": True, "normalized": False, "single_word": False,
                 "special": False}
        mask = {"content": "[MASK]", "lstrip": True, "rstrip": False, "normalized": False, "single_word": False,
                "special": True, "__type": "AddedToken"}
        (source / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "cls_token": "[CLS]", "sep_token": "[SEP]",
            "mask_token": mask, "unk_token": "[UNK]", "image_token": "<image>", "clean_up_tokenization_spaces": True,
            "added_tokens_decoder": {"1200": added}, "extra_special_tokens": ["<extra_a>", "<extra_b>"],
            "chat_template": [
                {"name": "default", "template": "{% for m in messages %}{{ cls_token }}{{ m['role'] }}: "
                                                "{{ m['content'] }}{{ image_token }}{{ sep_token }}{% endfor %}"},
                {"name": "tool_use", "template": "{{ tools | tojson }}{{ messages | length }}"}]}))
    else:
        raise ValueError(name)
    AutoTokenizer.from_pretrained(source).save_pretrained(artifact)  # what `fxllm compile` writes
    return source, artifact
