"""The checkpoint's own chat template, rendered as transformers renders it: ids compared with
transformers' apply_chat_template on several templates, on a byte-level BPE vocabulary."""
import json

import pytest

from default_model import BYTE_LEVEL, bpe_tokenizer_json
from tokenizer import TokenizerError, gpt2_byte_decoder, load_tokenizer

transformers = pytest.importorskip("transformers")

SPECIALS = ["<|im_start|>", "<|im_end|>", "<s>", "</s>", "<|begin_of_text|>",
            "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<start_of_turn>",
            "<end_of_turn>"]

TEMPLATES = {
    # SmolLM2's: a default system message when the chat has none
    "chatml_default_system": (
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
        "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
        "<|im_start|>", "<|im_end|>"),
    # Llama 3's: the bos token written by the template, contents trimmed
    "llama3": (
        "{% set loop_messages = messages %}{% for message in loop_messages %}"
        "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
        " + message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
        "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
        "{% endif %}", "<|begin_of_text|>", "<|eot_id|>"),
    # Mistral's: roles must alternate, a system message is refused
    "mistral": (
        "{{ bos_token }}{% for message in messages %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/...') }}"
        "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + "
        "' [/INST]' }}{% elif message['role'] == 'assistant' %}"
        "{{ message['content'] + eos_token + ' ' }}{% endif %}{% endfor %}", "<s>", "</s>"),
    # Zephyr's: one block per line, which trim_blocks and lstrip_blocks remove
    "zephyr": (
        "{% for message in messages %}\n{% if message['role'] == 'user' %}\n"
        "{{ '<|user|>\n' + message['content'] + eos_token }}\n"
        "{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + "
        "eos_token }}\n{% elif message['role'] == 'assistant' %}\n"
        "{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n{% endif %}\n"
        "{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n"
        "{% endfor %}", "<s>", "</s>"),
    # Gemma's: the assistant is "model", a namespace, loop controls
    "gemma": (
        "{{ bos_token }}{% set ns = namespace(n=0) %}{% for message in messages %}"
        "{% if message['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
        "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
        "{% set ns.n = ns.n + 1 %}{% if ns.n > 8 %}{% break %}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}",
        "<s>", "<end_of_turn>"),
    # Mistral v0.3's: tools only when given (transformers passes tools=None)
    "tools": ("{% if tools is not none %}{{ '[AVAILABLE_TOOLS]' }}{% endif %}"
              "{% for message in messages %}{{ message['content'] + '\n' }}{% endfor %}",
              "<s>", "</s>"),
    # tool-calling templates write JSON: tojson keeps non-ASCII as it is
    "tojson": ("{% for message in messages %}{{ message | tojson }}\n{% endfor %}"
               "{{ {'next': 'assistant', 'ok': true} | tojson(indent=2) }}"
               "{{ messages[-1] | tojson(ensure_ascii=True) }}", "<s>", "</s>"),
}

CHATS = {
    "one turn": [("user", "What is the capital of France?  ")],
    "multi-turn": [("user", "Hi"), ("assistant", "Hello! How can I help?"),
                   ("user", "Write a haiku about ré-sumés.")],
}


def write_tokenizer(folder, template, bos, eos, where="config", specials=SPECIALS):
    """A byte-level BPE tokenizer.json (the 256 bytes, a few merges, the specials) and a
    tokenizer_config.json that transformers' AutoTokenizer loads as a fast tokenizer."""
    chars = list(gpt2_byte_decoder())                      # the 256 byte stand-ins, byte order
    vocab = {c: i for i, c in enumerate(sorted(chars, key=lambda c: gpt2_byte_decoder()[c]))}
    merges = []
    for a, b in [("t", "h"), ("th", "e"), ("Ġ", "a"), ("i", "n"), ("e", "r"), ("o", "u")]:
        merges.append(f"{a} {b}")
        vocab[a + b] = len(vocab)
    added = [{"id": len(vocab) + i, "content": t, "special": True, "single_word": False,
              "lstrip": False, "rstrip": False, "normalized": False}
             for i, t in enumerate(specials)]
    data = bpe_tokenizer_json(vocab, merges, added, BYTE_LEVEL)
    folder.mkdir()
    (folder / "tokenizer.json").write_text(json.dumps(data))
    specials = {"bos_token": bos,
                "eos_token": {"__type": "AddedToken", "content": eos, "special": True}}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False}
    if where == "special_tokens_map":     # the special tokens only there, as older folders have
        (folder / "special_tokens_map.json").write_text(json.dumps(specials))
        where = "config"
    else:
        config |= specials
    if where == "config":
        config["chat_template"] = template
    elif where == "named":
        config["chat_template"] = [{"name": "tool_use", "template": "{{ raise_exception('no') }}"},
                                   {"name": "default", "template": template}]
    else:
        (folder / "chat_template.jinja").write_text(template)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def reference_ids(folder, turns, system=None):
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": r, "content": t} for r, t in turns]
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_chat_ids_equal_transformers_apply_chat_template(tmp_path, name):
    template, bos, eos = TEMPLATES[name]
    write_tokenizer(tmp_path / "tok", template, bos, eos)
    ours = load_tokenizer(str(tmp_path / "tok"))
    assert ours.chat_format == "template"
    for chat, turns in CHATS.items():
        want = reference_ids(tmp_path / "tok", turns)
        assert ours.chat_ids(turns) == want, f"{name}, {chat}: {ours.decode(want)!r}"
    if name in ("mistral", "gemma"):           # their templates refuse a system message
        with pytest.raises(TokenizerError, match="refuses this chat"):
            ours.chat_prompt("Hi", system="Be brief.")
    else:
        want = reference_ids(tmp_path / "tok", CHATS["one turn"], system="Be brief.")
        assert ours.chat_ids(CHATS["one turn"], system="Be brief.") == want, name


@pytest.mark.parametrize("where", ["jinja_file", "named", "special_tokens_map"])
def test_the_template_is_found_where_transformers_finds_it(tmp_path, where):
    template, bos, eos = TEMPLATES["mistral"]
    write_tokenizer(tmp_path / "tok", template, bos, eos, where)
    ours = load_tokenizer(str(tmp_path / "tok"))
    assert ours.chat_ids(CHATS["multi-turn"]) == reference_ids(tmp_path / "tok",
                                                               CHATS["multi-turn"])


def test_a_folder_without_a_template_falls_back_to_its_special_tokens_format(tmp_path):
    write_tokenizer(tmp_path / "tok", "", "<|im_start|>", "<|im_end|>")
    ours = load_tokenizer(str(tmp_path / "tok"))
    assert ours.chat_format == "chatml"
    assert ours.decode(ours.chat_prompt("Hi")) == ("<|im_start|>user\nHi<|im_end|>\n"
                                                   "<|im_start|>assistant\n")


def test_a_broken_template_is_one_clear_error(tmp_path):
    write_tokenizer(tmp_path / "tok", "{% for m in messages %}{{ m['content'] }", "<s>", "</s>")
    with pytest.raises(TokenizerError, match="chat template failed"):
        load_tokenizer(str(tmp_path / "tok")).chat_prompt("Hi")


def test_the_stop_token_is_the_eos_transformers_reads(tmp_path):
    """A folder with neither ChatML's nor Llama 3's tokens stops at its eos token, also where
    only special_tokens_map.json names it (as an AddedToken dict), as transformers reads it."""
    write_tokenizer(tmp_path / "tok", "", "<s>", "</s>", "special_tokens_map", ["<s>", "</s>"])
    ours = load_tokenizer(str(tmp_path / "tok"))
    eos = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok")).eos_token_id
    assert eos is not None and ours.stop_ids == (eos,), (ours.stop_ids, eos)
