"""A real Hugging Face fast tokenizer for the chat-data tests: byte-level BPE trained here with
the ``tokenizers`` library on a small corpus, with Qwen3-style special tokens and a Qwen3-style
chat template written for these tests (thinking blocks, enable_thinking, reasoning_content)."""

from __future__ import annotations

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

# Qwen3-like behaviour: <|im_start|>role\ncontent<|im_end|>\n; the generation prompt is
# <|im_start|>assistant\n (+ an empty think block with enable_thinking=false); an assistant turn
# after the last user message shows its reasoning_content in <think>...</think> (the final turn
# always has a think block, empty when it has no reasoning); earlier turns drop their reasoning.
QWEN3_STYLE_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- set reasoning = m.reasoning_content if m.reasoning_content is defined and m.reasoning_content else '' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if loop.index0 > ns.last_user and (loop.last or reasoning) -%}"
    "{{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{{- m.content -}}{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)

# A template that ignores add_generation_prompt (refused: turns cannot be located).
NO_GENERATION_PROMPT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
)

CORPUS = [
    "hello world, how are you today? I am fine, thanks for asking.",
    "Let me think about this step by step. First, add the numbers: 2 + 3 = 5.",
    "The answer is 5. Is there anything else you would like to know?",
    "You are a helpful assistant. The user asks a question and the assistant answers.",
    "What is the capital of France? The capital of France is Paris.",
    "def add(a, b):\n    return a + b\n",
]


def build_tokenizer(template: str = QWEN3_STYLE_TEMPLATE, vocab_size: int = 400):
    """A transformers fast tokenizer (byte-level BPE, ``vocab_size`` ids) with ``template``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = template
    return hf
