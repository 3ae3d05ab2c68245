"""A small byte-level BPE tokenizer, trained locally, that matches a model family's chat format.

Why: tests and the quickstart need a tokenizer that behaves like the real ones (byte-level BPE so
any text encodes, the family's special tokens and chat template) without downloading anything.

The BPE is trained on a built-in corpus of English, arithmetic and GSM8K-style phrases. Digits are
always split into single tokens, because the quickstart task is arithmetic. Training takes a few
milliseconds and is deterministic: the same family and vocab size give the same tokenizer.json.
"""
from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

BYTE_ALPHABET_SIZE = 256  # byte-level BPE always holds every byte as a base token


@dataclass(frozen=True)
class TokenizerStyle:
    """The special tokens and chat template of one model family's tokenizer."""

    special_tokens: tuple[str, ...]  # ids 0..n-1, in this order, before all learned tokens
    bos_token: str | None
    eos_token: str
    pad_token: str
    chat_template: str
    add_bos_on_encode: bool  # Llama/Mistral prepend BOS to every encode(); Qwen does not


# ChatML with Qwen2.5-style tool calling: with ``tools``, a system turn lists their schemas (the
# first system message's text first); an assistant message's ``tool_calls`` render as
# <tool_call>{json}</tool_call>; consecutive ``tool`` messages share one user turn of
# <tool_response> blocks. Without tools or tool messages it renders exactly as plain ChatML.
CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall a tool with <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set call = call['function'] if call['function'] is defined else call %}"
    "{{- '<tool_call>{\"name\": \"' + call['name'] + '\", \"arguments\": ' + (call['arguments'] | tojson) + '}</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# ChatML whose message content may be a list of parts, as Qwen2-VL/Qwen2.5-VL/Qwen3-VL's templates
# render it: {"type": "image"} -> <|vision_start|><|image_pad|><|vision_end|>, {"type": "text", "text": ...}
# -> the text. The processor then repeats <|image_pad|> once per image token (its grid's merged patches).
CHATML_VISION_TEMPLATE = (
    "{%- macro render(content) %}"
    "{%- if content is string %}{{- content }}"
    "{%- else %}{%- for part in content %}"
    "{%- if part['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'video' %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- else %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{%- endmacro %}"
) + CHATML_TEMPLATE.replace(
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}",
    "{{- '<|im_start|>' + message['role'] + '\\n' + render(message['content']) + '<|im_end|>\\n' }}",
)

LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

# Mistral-style: a system message is prepended to the first user turn; the generation prompt is
# implicit (the model answers right after "[/INST]"), so add_generation_prompt adds nothing.
INST_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{{- message['content'] + '\\n\\n' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST] ' + message['content'] + ' [/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token }}"
    "{%- else %}{{- raise_exception('unknown role: ' + message['role']) }}"
    "{%- endif %}"
    "{%- endfor %}"
)

# DeepSeek-V3's format: BOS, then <｜User｜>/<｜Assistant｜> turns, each answer closed by EOS.
DEEPSEEK_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{{- message['content'] }}"
    "{%- elif message['role'] == 'user' %}{{- '<｜User｜>' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' %}{{- '<｜Assistant｜>' + message['content'] + eos_token }}"
    "{%- else %}{{- raise_exception('unknown role: ' + message['role']) }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<｜Assistant｜>' }}{%- endif %}"
)

# Gemma's format: BOS, then <start_of_turn>user / model turns closed by <end_of_turn>; a system
# message opens the first user turn (Gemma has no system role).
GEMMA_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{{- '<start_of_turn>user\\n' + message['content'] + '\\n\\n' }}"
    "{%- elif message['role'] == 'user' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'system' %}{{- '<start_of_turn>user\\n' }}{%- endif %}"
    "{{- message['content'] + '<end_of_turn>\\n' }}"
    "{%- elif message['role'] == 'assistant' %}{{- '<start_of_turn>model\\n' + message['content'] + '<end_of_turn>\\n' }}"
    "{%- else %}{{- raise_exception('unknown role: ' + message['role']) }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)

CHATML = TokenizerStyle(
    special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    bos_token=None,
    eos_token="<|im_end|>",
    pad_token="<|endoftext|>",
    chat_template=CHATML_TEMPLATE,
    add_bos_on_encode=False,
)

CHATML_VISION = TokenizerStyle(
    special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>",
                    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"),
    bos_token=None,
    eos_token="<|im_end|>",
    pad_token="<|endoftext|>",
    chat_template=CHATML_VISION_TEMPLATE,
    add_bos_on_encode=False,
)

LLAMA3 = TokenizerStyle(
    special_tokens=(
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
        "<|finetune_right_pad_id|>",
    ),
    bos_token="<|begin_of_text|>",
    eos_token="<|eot_id|>",
    pad_token="<|finetune_right_pad_id|>",
    chat_template=LLAMA3_TEMPLATE,
    add_bos_on_encode=True,
)

MISTRAL_INST = TokenizerStyle(
    special_tokens=("<unk>", "<s>", "</s>", "[INST]", "[/INST]"),
    bos_token="<s>",
    eos_token="</s>",
    pad_token="<unk>",
    chat_template=INST_TEMPLATE,
    add_bos_on_encode=True,
)

DEEPSEEK_V3 = TokenizerStyle(
    special_tokens=("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜▁pad▁｜>"),
    bos_token="<｜begin▁of▁sentence｜>",
    eos_token="<｜end▁of▁sentence｜>",
    pad_token="<｜▁pad▁｜>",
    chat_template=DEEPSEEK_TEMPLATE,
    add_bos_on_encode=True,
)

GEMMA = TokenizerStyle(
    special_tokens=("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"),
    bos_token="<bos>",
    eos_token="<end_of_turn>",  # what closes an answer (Gemma's generation config stops on it)
    pad_token="<pad>",
    chat_template=GEMMA_TEMPLATE,
    add_bos_on_encode=True,
)

# A model family's ``FamilySpec.tiny_chat_format`` -> its style (families not in TOKENIZER_STYLES)
CHAT_FORMATS = {"chatml": CHATML, "chatml_vision": CHATML_VISION, "llama3": LLAMA3, "inst": MISTRAL_INST, "deepseek": DEEPSEEK_V3, "gemma": GEMMA}

TOKENIZER_STYLES = {
    "llama": LLAMA3,
    "qwen2": CHATML,
    "qwen3": CHATML,
    "qwen3_moe": CHATML,
    "mixtral": MISTRAL_INST,
    "deepseek_v3": DEEPSEEK_V3,
    "qwen2_5_vl": CHATML_VISION,
    "qwen3_vl": CHATML_VISION,
    "qwen3_vl_moe": CHATML_VISION,
}

_ENGLISH = """\
The quick brown fox jumps over the lazy dog. A model learns from the reward it gets.
Please answer the question and put the final answer after four hash marks.
Let's think step by step. First, we add the numbers. Then we subtract the rest.
She has some apples and he gives her more. How many apples does she have now?
The answer is correct. The answer is wrong. Try again and check the result.
You are a helpful assistant. The user asks a question and the assistant answers it.
There are many students in the class, and each student reads books every week.
What is the total cost of the tickets if each ticket costs the same amount of money?
John has three times as many marbles as his sister. Together they have sixty marbles.
A train leaves the station at noon and travels at a constant speed for two hours.
The farmer plants rows of trees in the field, and every row has the same number of trees.
If a number is doubled and then increased by five, the result is twenty one.
Mary bought a box of pencils, gave some to her friends, and kept the rest for school.
The store sells cookies in packs, and each pack costs less than the price of a cake.
Tom runs around the park every morning before work, and on weekends he runs twice as far.
In the morning the baker makes bread, and in the afternoon she sells it at the market.
Hello world! This is a small test of the tokenizer, with words, numbers and symbols.
We compute the sum, the difference, the product and the quotient of two numbers.
The reward is one when the final answer matches the ground truth, and zero otherwise.
"""

_GSM8K = """\
Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.
How many clips did Natalia sell altogether in April and May?
Natalia sold 48/2 = 24 clips in May. Natalia sold 48+24 = 72 clips altogether in April and May.
#### 72
Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting.
How much did she earn? Weng earns 12/60 = $0.2 per minute. She earned 0.2 x 50 = $10.
#### 10
Betty is saving money for a new wallet which costs $100. How much more money does she need?
The final answer is \\boxed{42}. So the answer is \\boxed{7}. Therefore \\boxed{x + 1}.
Let x be the number of eggs. Then 3 * x - 5 = 16, so x = 7. #### 7
"""


def training_corpus() -> list[str]:
    """The built-in BPE training text: English, GSM8K-style solutions and arithmetic lines."""
    lines = _ENGLISH.splitlines() + _GSM8K.splitlines()
    for a in range(0, 40, 3):
        for b in range(1, 30, 7):
            lines.append(f"{a} + {b} = {a + b}")
            lines.append(f"{a + b} - {b} = {a}")
            lines.append(f"{a} * {b} = {a * b}")
            lines.append(f"What is {a} plus {b}? The answer is {a + b}. #### {a + b}")
    return lines


def _train_bpe(vocab_size: int, special_tokens: tuple[str, ...]) -> Tokenizer:
    """Byte-level BPE with digits isolated, trained on the built-in corpus."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(), trainer=trainer)
    return tokenizer


def _post_processor(tokenizer: Tokenizer, style: TokenizerStyle) -> processors.PostProcessor:
    """ByteLevel offsets, plus a leading BOS for the families whose tokenizers add one."""
    byte_level = processors.ByteLevel(trim_offsets=False)
    if not style.add_bos_on_encode:
        return byte_level
    bos, bos_id = style.bos_token, tokenizer.token_to_id(style.bos_token)
    template = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0",
        pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
        special_tokens=[(bos, bos_id)],
    )
    return processors.Sequence([byte_level, template])


def min_vocab_size(family: str) -> int:
    """The smallest allowed vocab size: every byte, every special token, rounded up to 8."""
    needed = BYTE_ALPHABET_SIZE + len(_style(family).special_tokens)
    return (needed + 7) // 8 * 8


def _style(family: str) -> TokenizerStyle:
    """The family's style: its own entry, else its model family's ``tiny_chat_format``."""
    from megarl.models.families import FAMILIES as MODEL_FAMILIES

    if family in TOKENIZER_STYLES:
        return TOKENIZER_STYLES[family]
    spec = MODEL_FAMILIES.get(family)
    if spec is None or spec.tiny_config is None:
        known = ", ".join(sorted({*TOKENIZER_STYLES, *(n for n, f in MODEL_FAMILIES.items() if f.tiny_config)}))
        raise ValueError(f"unknown model family {family!r}; choose one of: {known}")
    return CHAT_FORMATS[spec.tiny_chat_format]


def build_tokenizer(family: str, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train the family's tokenizer. Its length is at most ``vocab_size`` (the model's vocab).

    The BPE trainer stops early once the corpus has no pair left to merge, so the tokenizer can be
    shorter than ``vocab_size``; the model's embedding is still ``vocab_size`` rows, as in real
    checkpoints whose embedding is padded beyond the tokenizer.
    """
    style = _style(family)
    if vocab_size % 8 != 0 or vocab_size < min_vocab_size(family):
        raise ValueError(
            f"vocab_size={vocab_size} must be a multiple of 8 and at least "
            f"{min_vocab_size(family)} (256 bytes + {len(style.special_tokens)} special tokens) "
            f"for family {family!r}; try 512"
        )
    tokenizer = _train_bpe(vocab_size, style.special_tokens)
    tokenizer.post_processor = _post_processor(tokenizer, style)
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=style.bos_token,
        eos_token=style.eos_token,
        pad_token=style.pad_token,
        additional_special_tokens=[
            token
            for token in style.special_tokens
            if token not in (style.bos_token, style.eos_token, style.pad_token)
        ],
        chat_template=style.chat_template,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    assert len(hf_tokenizer) <= vocab_size, (len(hf_tokenizer), vocab_size)
    return hf_tokenizer
