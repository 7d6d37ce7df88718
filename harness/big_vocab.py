"""A held-out-style tokenizer with a real-sized vocabulary: Qwen2.5's shape, generated here.

The tiny model's tokenizer (``harness.tiny_model``) has 512 tokens; a served model has 128k-256k,
and both the memory a tokenizer holds and what a pre-tokenizer does with unicode show only at that
size. This builds a byte-level BPE of :data:`VOCAB_SIZE` tokens (Qwen2.5's 151,643 before its
added tokens), trained with the ``tokenizers`` trainer on a generated corpus (pseudo-words drawn
with Zipf frequencies, numbers, punctuation, accented, CJK and emoji text), laid out as Qwen2.5's
repository lays it out: Qwen2's normalizer (NFC), pre-tokenizer (its split regex, then byte-level)
and byte-level post-processor in ``tokenizer.json``; ``tokenizer_class: Qwen2Tokenizer`` with
``added_tokens_decoder``, ``<|endoftext|>`` as pad and eos (no bos) in ``tokenizer_config.json``;
a Qwen2.5/Qwen3-style chat template (tools, tool calls and results, ``reasoning_content``,
``enable_thinking``) in ``chat_template.jinja``; and a ``config.json``.

Nothing is downloaded. ``ensure_big_vocab_model()`` builds it once into the cache (about a
minute on two cores) and returns the directory; ``python -m harness.big_vocab DIR`` writes one.
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import random
import shutil
import sys
from pathlib import Path

#: Qwen2.5's base vocabulary (151,643) before its 22 added tokens.
VOCAB_SIZE = 151_643
#: Qwen2's pre-tokenizer split (transformers' ``tokenization_qwen2.PRETOKENIZE_REGEX``).
SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
ADDED = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
#: added but not special, as in Qwen2.5 (the model writes them as text)
ADDED_TEXT = [
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
]

CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and \
arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \
\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' }}
        {%- if message.reasoning_content is defined and message.reasoning_content %}
            {{- '<think>\\n' + message.reasoning_content | trim + '\\n</think>\\n\\n' }}
        {%- endif %}
        {%- if message.content %}
            {{- message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- elif message.role not in ["system"] %}
        {{- raise_exception("Unexpected message role: " + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

_ONSETS = "b c d f g h j k l m n p r s t v w z br ch cl cr dr fl gr kr pl pr sh st th tr".split()
_VOWELS = "a e i o u y ai ea ee ie io oa ou".split()
_CODAS = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "rk"]
_OTHER = [
    "naïve café résumé Ünïcödé über façade",
    "日本語のテキストと漢字 東京 大阪 京都",
    "中文文本 北京 上海 模型 缓存",
    "한국어 텍스트 서울",
    "emoji 🚀🔥✨👍🏽 done",
    "Ελληνικά κείμενο Αθήνα",
    "русский текст Москва",
    "def f(x):\n    return {'a': [1, 2, 3]}\n",
]


def _word(rng: random.Random) -> str:
    return "".join(
        rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
        for _ in range(rng.choice((1, 1, 2, 2, 2, 3, 3, 4)))
    )


def sample(words: int) -> str:
    """Text in the corpus's most frequent words (those the vocabulary holds whole)."""
    rng = random.Random(0)
    vocabulary = list(dict.fromkeys(_word(rng) for _ in range(words * 2)))[: max(words // 4, 1)]
    return " ".join(vocabulary[i % len(vocabulary)] for i in range(words))


def corpus(seed: int = 0, distinct: int = 400_000, lines: int = 120_000) -> list[str]:
    """Generated text whose words follow a Zipf law over ``distinct`` pseudo-words."""
    rng = random.Random(seed)
    words = list(dict.fromkeys(_word(rng) for _ in range(distinct * 2)))[:distinct]
    cumulative = list(itertools.accumulate(1.0 / (rank + 1) for rank in range(len(words))))
    out = []
    for i in range(lines):
        picked = rng.choices(words, cum_weights=cumulative, k=rng.randint(8, 40))
        text = " ".join(w.capitalize() if rng.random() < 0.1 else w for w in picked)
        if rng.random() < 0.3:
            text += f" {rng.randint(0, 10 ** rng.randint(1, 7))}"
        out.append(text + rng.choice([".", "?", "!", ",", ";", ":", "\n"]))
        if i % 50 == 0:
            out.append(rng.choice(_OTHER))
    # every word at least once, so that the trainer reaches the vocabulary size
    out.extend(" ".join(words[i : i + 30]) for i in range(0, len(words), 30))
    return out


def build(out: Path, vocab_size: int = VOCAB_SIZE) -> None:
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    from tokenizers import AddedToken

    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in ADDED])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TEXT])
    tok.save(str(out / "tokenizer.json"))
    decoder = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in ADDED,
        }
        for t in ADDED + ADDED_TEXT
    }
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": ADDED[1:],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    model = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": tok.get_vocab_size(),
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "eos_token_id": tok.token_to_id("<|im_end|>"),
        "bos_token_id": tok.token_to_id("<|endoftext|>"),
    }
    (out / "config.json").write_text(json.dumps(model, indent=2) + "\n")


def ensure_big_vocab_model() -> Path:
    """The generated 150k-vocabulary model directory (tokenizer and config, no weights), built
    once into the harness cache."""
    from harness.local import CACHE

    digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    out = CACHE / "models" / f"bigvocab-{digest}"
    if (out / "config.json").exists():
        return out
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "big-vocab.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "config.json").exists():
            tmp = out.with_name(out.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            build(tmp)
            tmp.rename(out)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m harness.big_vocab DIR", file=sys.stderr)
        raise SystemExit(2)
    build(Path(sys.argv[1]))
    print(f"written to {sys.argv[1]}")
