"""A character-level tokenizer built in code with the `tokenizers` library (nothing downloaded).

One token per byte (so one per character for ASCII text, and no unknown characters ever),
plus three special tokens: a byte-level BPE with no merges. It uses the same byte-level
pre-tokenizer and decoder as Qwen2's own tokenizer on purpose: `AutoTokenizer` (and so
vLLM) loads a checkpoint whose config says `qwen2` with the Qwen2 tokenizer class, which
imposes those components whatever tokenizer.json says. Matching them keeps the token ids
of training, rollouts and serving identical.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, EOS, UNK = "<|pad|>", "<|endoftext|>", "<|unk|>"
SPECIAL_TOKENS = (PAD, EOS, UNK)
BYTE_SYMBOLS = tuple(sorted(pre_tokenizers.ByteLevel.alphabet()))

# Questions and answers are framed as "Q: ...\nA: ...<eos>", a tool's output as "R: ...". The
# template renders a chat list the way the warm start saw it, so rollouts, training and
# serving agree.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n"
    "{% elif message['role'] == 'user' %}Q: {{ message['content'] }}\n"
    "{% elif message['role'] == 'tool' %}R: {{ message['content'] }}\n"
    "{% else %}A: {{ message['content'] }}" + EOS + "\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}A: {% endif %}"
)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + BYTE_SYMBOLS)}
    # Without merges, BPE leaves every byte symbol as its own token.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
