"""Builds chatml-bpe8k from bpe8k-sharegpt: the same BPE plus ChatML's turn markers as added
special tokens (ids 8000 and 8001), and a tokenizer_config.json whose chat_template renders
exactly what `kvbench sim` renders (bench/src/sim/text/prompt.rs: render_chat), as a ChatML model
(Qwen, for one) ships them. Standard library only: python3 make.py"""
import json
import pathlib

here = pathlib.Path(__file__).parent
src = json.loads((here.parent / "bpe8k-sharegpt" / "tokenizer.json").read_text())
base = len(src["model"]["vocab"])
for i, content in enumerate(["<|im_start|>", "<|im_end|>"]):
    src["added_tokens"].append({
        "id": base + i, "content": content, "single_word": False, "lstrip": False,
        "rstrip": False, "normalized": False, "special": True,
    })
(here / "tokenizer.json").write_text(json.dumps(src, ensure_ascii=False, separators=(",", ":")))

# Content parts other than text are rendered by the simulator as a hash the template cannot
# compute; only string (and text-part) content is rendered identically.
# Tools open the prompt as a turn of their own and an assistant's tool calls follow its text,
# both as compact JSON, as the simulator renders them (JSON with no '<', '>', '&' or "'", which
# a template's tojson escapes).
template = (
    "{% if tools %}<|im_start|>tools\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is not none %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}"
    "{% if message['tool_calls'] %}{{ message['tool_calls'] | tojson }}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
config = {
    "bos_token": "<|endoftext|>",
    "eos_token": "<|im_end|>",
    "unk_token": "<|endoftext|>",
    "model_max_length": 1000000,
    "tokenizer_class": "PreTrainedTokenizerFast",
    "chat_template": template,
}
(here / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
