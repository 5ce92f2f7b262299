"""Build a tiny causal language model locally, in Hugging Face format, with nothing downloaded.

The tokenizer is a byte-level BPE trained with the ``tokenizers`` library on text that ships with
Python (the docstrings of a fixed list of standard-library modules, read from their source) plus a few hundred lines generated
from the seed, so the same seed on the same Python gives the same files. It is wrapped as a
``PreTrainedTokenizerFast`` with ChatML special tokens and a ChatML chat template. The model is a real
transformers architecture (``Qwen2ForCausalLM`` or ``LlamaForCausalLM``), a few hundred thousand
parameters, randomly initialised from the seed. Both are written with ``save_pretrained``, so the
engine (or anyone) loads them through ``AutoTokenizer`` / ``AutoModelForCausalLM.from_pretrained``.
The weights are random: the text is gibberish, but token ids, logprobs, batching, streaming and weight
reloads behave exactly as with a trained model.
"""

from __future__ import annotations

import ast
import importlib.util
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_grpc import logs
from lightning_grpc._extras import extra_imports

log = logs.get_logger(__name__)

ARCHITECTURES = ("qwen2", "llama")
ENDOFTEXT, IM_START, IM_END, PAD = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END, PAD]

#: ChatML with tools the way Qwen2.5's (hermes-style) template writes them: a system block listing the
#: tools (merged with a leading system message), an assistant's ``tool_calls`` as
#: ``<tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call>`` (ARGS: a string verbatim, a mapping
#: as JSON), and ``tool`` messages as ``<tool_response>`` blocks of one user turn. A call the model writes
#: after ``<|im_start|>assistant\n`` renders back to the same text when the agent sends it back. Text parts
#: of list contents are joined.
CHAT_TEMPLATE = """\
{%- macro text(content) %}
{%- if content is string %}{{- content }}
{%- elif content is iterable %}
{%- for part in content %}{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}{%- endfor %}
{%- endif %}
{%- endmacro %}
{%- set merged = tools and messages[0]['role'] == 'system' %}
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if merged %}{{- text(messages[0]['content']) + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments ' }}
{{- 'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' }}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if merged and loop.first %}
{%- elif message['role'] == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + text(message['content']) + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- elif message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] %}
{{- '<|im_start|>assistant' }}
{%- set content = text(message['content']) %}
{%- if content %}{{- '\\n' + content }}{%- endif %}
{%- for call in message['tool_calls'] %}
{%- set function = call['function'] if call['function'] is defined else call %}
{{- '\\n<tool_call>\\n{"name": ' + (function['name'] | tojson) + ', "arguments": ' }}
{%- if function['arguments'] is string %}{{- function['arguments'] }}
{%- else %}{{- function['arguments'] | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message['role'] + '\\n' + text(message['content']) }}
{%- if not (loop.last and continue_final_message is defined and continue_final_message) %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

#: Modules whose docstrings make the corpus: all ship with CPython.
CORPUS_MODULES = (  # noqa: SIM905 (a list literal would take 60 lines)
    "abc argparse ast asyncio base64 bisect calendar collections contextlib copy csv dataclasses datetime "
    "decimal difflib email enum fractions functools gzip hashlib heapq hmac html http.client inspect io "
    "ipaddress itertools json logging math operator os pathlib pickle pprint queue random re sched "
    "secrets shlex shutil socket sqlite3 statistics string struct subprocess tarfile tempfile textwrap "
    "threading tokenize typing unittest urllib.parse uuid zipfile"
).split()

WORDS = (  # noqa: SIM905
    "agent rollout reward policy tool call search answer question step task model token batch stream "
    "weight update version trainer proxy store span trace attempt result error retry done yes no"
).split()


@dataclass(frozen=True)
class TinyModelSpec:
    """The shape of the tiny model (the defaults give about 0.25M parameters)."""

    arch: str = "qwen2"
    vocab_size: int = 2048
    hidden_size: int = 64
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 2048
    seed: int = 0


def build_tiny_model(
    path: str | Path,
    *,
    arch: str = "qwen2",
    vocab_size: int = 2048,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
) -> Path:
    """Train the tokenizer, initialise the model and save both under ``path``; returns the path.

    ``num_heads`` attention heads of ``hidden_size / num_heads`` each (vLLM's CPU attention takes a head
    size of 32 or more: 64 wide with 2 heads, or 128 wide with 4); 2 key-value heads when they divide it.
    """
    if num_heads < 1 or hidden_size % num_heads:
        raise ValueError(f"the hidden size {hidden_size} must be a multiple of the {num_heads} heads")
    spec = TinyModelSpec(
        arch=arch,
        vocab_size=vocab_size,
        seed=seed,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=2 if num_heads % 2 == 0 else 1,
    )
    return save_tiny_model(Path(path), spec)


def save_tiny_model(path: Path, spec: TinyModelSpec) -> Path:
    if spec.arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {spec.arch!r}: choose one of {', '.join(ARCHITECTURES)}")
    if spec.vocab_size < 300:
        raise ValueError("vocab_size must be at least 300 (256 bytes, the special tokens, some merges)")
    with extra_imports("engine"):
        from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    started = time.monotonic()
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.vocab_size, spec.seed)
    tokenizer.save_pretrained(str(path))
    model = build_model(spec, tokenizer)
    model.save_pretrained(str(path))
    params = sum(p.numel() for p in model.parameters())
    log.info(
        "event=tiny_model_built path=%s arch=%s vocab=%d params=%d seed=%d seconds=%.2f",
        path,
        spec.arch,
        len(tokenizer),
        params,
        spec.seed,
        time.monotonic() - started,
    )
    return path


# ---------------------------------------------------------------- tokenizer
def corpus(seed: int) -> Iterator[str]:
    """Standard-library docstrings, then lines generated from the seed."""
    for name in CORPUS_MODULES:
        yield from _docstrings(name)
    rng = random.Random(seed)
    for _ in range(400):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
        yield f"{a} + {b} = {a + b}. The {words}."


def _docstrings(module_name: str) -> Iterator[str]:
    """The docstrings in the module's source, read statically (importing would show monkey-patches)."""
    spec = importlib.util.find_spec(module_name)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node)
            if doc:
                yield doc


def build_tokenizer(vocab_size: int, seed: int) -> Any:
    """A byte-level BPE wrapped as ``PreTrainedTokenizerFast`` with ChatML tokens and template."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    # The Qwen2 pipeline exactly: AutoTokenizer rebuilds a qwen2 model's tokenizer with it from the
    # vocabulary and merges, so any other pipeline would not survive the round trip.
    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus(seed), trainer)
    backend.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=PAD,
        unk_token=None,
        bos_token=None,
        additional_special_tokens=[IM_START, ENDOFTEXT],
        clean_up_tokenization_spaces=False,
        model_max_length=TinyModelSpec.max_position_embeddings,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


# ---------------------------------------------------------------- model
def build_model(spec: TinyModelSpec, tokenizer: Any) -> Any:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    classes: dict[str, tuple[Any, Any]] = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
    }
    config_class, model_class = classes[spec.arch]
    im_end, endoftext = tokenizer.convert_tokens_to_ids([IM_END, ENDOFTEXT])
    config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=im_end,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng():  # the caller's random state is left alone
        torch.manual_seed(spec.seed)
        model = model_class(config).eval()
    model.generation_config = GenerationConfig(
        eos_token_id=[im_end, endoftext], pad_token_id=tokenizer.pad_token_id, bos_token_id=None
    )
    return model
