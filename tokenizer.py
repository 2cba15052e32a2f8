"""A tiktoken tokenizer built from a Hugging Face checkpoint, plus chat formatting.

Byte-level BPE (GPT-2 style, as SmolLM2 and Llama 3 use) is the same algorithm tiktoken runs when
each token's rank is its id and ids grow in merge order: tiktoken merges the adjacent pair whose
concatenation has the lowest rank, HF merges the pair with the lowest merge index. We check that
order on load and refuse a file where it does not hold.
"""
import base64
import hashlib
import json
import os
from dataclasses import dataclass, field, replace
from datetime import datetime

import jinja2
import jinja2.ext
import tiktoken
from jinja2.sandbox import ImmutableSandboxedEnvironment

# HF's ByteLevel pre-tokenizer regex (GPT-2's).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Digits(individual_digits) then ByteLevel, as one regex: each digit alone, and a run of spaces
# before a digit stays whole because the digit was split off before ByteLevel saw it.
DIGITS_GPT2_PATTERN = (r"""\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+"""
                       r"""|\s+(?![^\s\p{N}])|\s+""")
LLAMA3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
                  r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
LLAMA3_SPECIALS = (["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                    "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
                    "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>",
                    "<|python_tag|>"] + [f"<|reserved_special_token_{i}|>" for i in range(2, 247)])


class TokenizerError(ValueError):
    """A tokenizer file this project cannot reproduce exactly."""


def gpt2_byte_decoder() -> dict:
    """GPT-2's table from the printable unicode stand-ins back to raw bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]        # stand-ins from 256 on
    return {chr(c): b for b, c in zip(printable + others,
                                      printable + list(range(256, 256 + len(others))))}


def pattern_from_pre_tokenizer(pre: dict | None) -> str:
    """The single regex equivalent to a HF pre_tokenizer, for the forms byte-level BPE uses."""
    steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") if s else None for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return GPT2_PATTERN
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") \
            and steps[1].get("use_regex", True):
        return DIGITS_GPT2_PATTERN
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        return steps[0]["pattern"]["Regex"]
    raise TokenizerError(f"unsupported pre_tokenizer {kinds}: expected ByteLevel, "
                         "Digits+ByteLevel or Split+ByteLevel")


@dataclass
class Tokenizer:
    encoding: tiktoken.Encoding
    vocab_size: int                      # ids >= this are placeholders for bytes with no token
    chat_format: str                     # "template", or without one "chatml", "llama3", "none"
    stop_ids: tuple                      # generation ends at any of these
    bos_id: int | None = None            # prepended to every raw prompt when set (Llama 3)
    chat_template: str = ""              # the checkpoint's own (jinja2), as transformers renders it
    template_tokens: dict = field(default_factory=dict)   # bos_token, eos_token, ... it may name
    pattern: str = ""                    # the pre-tokenizer regex
    merges_digest: str = field(default="", repr=False)   # sha256 of all ranks: draft vs target

    def encode(self, text: str) -> list:
        """Token ids of text; special-token strings in it become special tokens (as HF does)."""
        ids = self.encoding.encode(text, allowed_special="all")
        # Bytes with no token of their own were given placeholder ranks: drop them, as HF does.
        return [i for i in ids if i < self.vocab_size]

    def decode(self, ids) -> str:
        return self.encoding.decode_bytes(ids).decode("utf-8", errors="replace")

    def special(self, name: str) -> int:
        return self.encoding.encode_single_token(name)

    def chat_prompt(self, user: str, system: str | None = None) -> list:
        """Token ids of a one-turn chat, ending where the assistant starts to answer."""
        return self.chat_ids([("user", user)], system)

    def chat_ids(self, turns: list, system: str | None = None) -> list:
        """turns [(role, text)] -> ids, ending with the assistant's header. A checkpoint's own
        template inserts its default system message when none is given, as with transformers."""
        if system is not None:
            turns = [("system", system)] + list(turns)
        if self.chat_format == "template":       # its text holds the special tokens it wants
            return self.encode(render_chat(self.chat_template, turns, self.template_tokens))
        if self.chat_format == "chatml":
            text = "".join(f"<|im_start|>{r}\n{t}<|im_end|>\n" for r, t in turns)
            text += "<|im_start|>assistant\n"
        elif self.chat_format == "llama3":
            text = "".join(f"<|start_header_id|>{r}<|end_header_id|>\n\n{t}<|eot_id|>"
                           for r, t in turns)
            text += "<|start_header_id|>assistant<|end_header_id|>\n\n"
        else:
            raise TokenizerError("this checkpoint has no chat format: use --raw")
        return self.raw_ids(text)

    def raw_ids(self, text: str) -> list:
        return ([self.bos_id] if self.bos_id is not None else []) + self.encode(text)

    def same_as(self, other: "Tokenizer") -> str | None:
        """None if both tokenize identically, else what differs (for draft/target checks)."""
        if self.vocab_size != other.vocab_size:
            return f"vocabulary sizes differ ({self.vocab_size} vs {other.vocab_size})"
        if self.encoding.special_tokens_set != other.encoding.special_tokens_set or any(
                self.special(t) != other.special(t) for t in self.encoding.special_tokens_set):
            return "special tokens differ"
        if self.pattern != other.pattern:
            return "pre-tokenizer patterns differ"
        if self.merges_digest != other.merges_digest:
            return "token ranks (BPE merges) differ"
        return None


def build(ranks: dict, specials: dict, pattern: str, name: str) -> tuple:
    """Give bytes with no token placeholder ranks (tiktoken panics on them) and build."""
    vocab_size = max(list(ranks.values()) + list(specials.values())) + 1
    missing = [bytes([b]) for b in range(256) if bytes([b]) not in ranks]
    ranks |= {b: vocab_size + i for i, b in enumerate(missing)}
    enc = tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)
    digest = hashlib.sha256(b"".join(k + v.to_bytes(4, "little")
                                     for k, v in sorted(ranks.items()))).hexdigest()
    return enc, vocab_size, digest


def ranks_from_hf(model: dict, specials: dict) -> dict:
    """token bytes -> rank (= id) from a HF BPE model, checked against its merge order."""
    if model.get("type") != "BPE":
        raise TokenizerError(f"tokenizer model type {model.get('type')!r} is not BPE")
    table = gpt2_byte_decoder()
    tokens = {t: i for t, i in model["vocab"].items() if t not in specials}
    stray = set("".join(tokens)) - table.keys()
    if stray:
        token = next(t for t in tokens if stray & set(t))
        raise TokenizerError(f"token {token!r} (id {tokens[token]}) is not byte-level BPE")
    # each stand-in character to the code point of its byte: latin-1 then writes that byte
    to_bytes = {ord(ch): b for ch, b in table.items()}
    ranks = {t.translate(to_bytes).encode("latin-1"): i for t, i in tokens.items()}
    vocab, last = model["vocab"], -1
    for n, m in enumerate(model["merges"]):
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        rank = vocab.get(a + b)
        if rank is None or rank <= max(vocab[a], vocab[b]) or rank <= last:
            raise TokenizerError(f"merge {n} ({a!r} + {b!r}) does not follow id order: ranks "
                                 "must grow with merge order for tiktoken to match this file")
        last = rank
    return ranks


def render_chat(template: str, turns: list, tokens: dict) -> str:
    """A chat template rendered as transformers' apply_chat_template renders it: a sandboxed
    jinja2 environment that trims blocks, with loop controls, raise_exception, strftime_now
    and a tojson that keeps non-ASCII; the special tokens' strings as variables."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = refuse_chat
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    messages = [{"role": role, "content": text} for role, text in turns]
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                                tools=None, documents=None, **tokens)
    except jinja2.TemplateError as e:
        raise TokenizerError(f"the checkpoint's chat template failed: {e}") from None


def tojson(x, ensure_ascii=False, **options) -> str:     # indent, separators, sort_keys
    """transformers' tojson filter: non-ASCII kept unless asked (jinja2's own escapes HTML)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, **options)


def refuse_chat(message: str):
    raise TokenizerError(f"the checkpoint's chat template refuses this chat: {message}")


def chat_template(folder: str, config: dict) -> str:
    """The template transformers would use: chat_template.jinja, else tokenizer_config.json's
    (a string, or named templates of which "default")."""
    path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template") or ""
    if isinstance(template, list):
        template = next((t["template"] for t in template if t.get("name") == "default"), "")
    return template


def special_strings(folder: str, config: dict) -> dict:
    """The special tokens' strings by name (a string or {"content": ...}), from
    tokenizer_config.json and, as transformers reads older folders (no added_tokens_decoder),
    special_tokens_map.json over it."""
    path = os.path.join(folder, "special_tokens_map.json")
    if "added_tokens_decoder" not in config and os.path.isfile(path):
        config = config | read_json(path)
    names = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
             "mask_token")
    return {n: config[n]["content"] if isinstance(config[n], dict) else config[n]
            for n in names if config.get(n)}


def load_tokenizer(folder: str) -> Tokenizer:
    """From tokenizer.json (byte-level BPE), else Llama 3's original/tokenizer.model."""
    hf_path = os.path.join(folder, "tokenizer.json")
    meta_path = os.path.join(folder, "original", "tokenizer.model")
    config_path = os.path.join(folder, "tokenizer_config.json")
    config = read_json(config_path) if os.path.isfile(config_path) else {}
    if os.path.isfile(hf_path):
        data = read_json(hf_path)
        try:
            specials = {t["content"]: t["id"] for t in data.get("added_tokens", [])}
            ranks = ranks_from_hf(data["model"], specials)
        except (KeyError, TypeError, AttributeError) as e:
            raise TokenizerError(f"{hf_path}: not a Hugging Face tokenizer file (no {e})") from None
        pattern = pattern_from_pre_tokenizer(data.get("pre_tokenizer"))
    elif os.path.isfile(meta_path):
        with open(meta_path) as f:                  # a base64 token and its rank a line
            ranks = {base64.b64decode(t): int(r) for t, r in (ln.split() for ln in f if ln.strip())}
        specials = {name: len(ranks) + i for i, name in enumerate(LLAMA3_SPECIALS)}
        pattern = LLAMA3_PATTERN
    else:
        raise TokenizerError(f"no tokenizer.json or original/tokenizer.model in {folder}")
    enc, vocab_size, digest = build(ranks, specials, pattern, os.path.basename(folder))
    strings = special_strings(folder, config)
    tok = with_chat_format(enc, vocab_size, specials, strings.get("eos_token"), pattern, digest)
    template = chat_template(folder, config)
    if template:                   # the checkpoint's own; the hand-written formats a fallback
        tok = replace(tok, chat_format="template", chat_template=template, template_tokens=strings)
    return tok


def read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return data


def with_chat_format(enc, vocab_size, specials, eos, pattern, digest) -> Tokenizer:
    """Pick the stop tokens, and the chat format for a checkpoint without a template, from the
    special tokens the checkpoint has; eos: its end-of-sequence token's string (the stop token
    where neither format applies)."""
    common = dict(encoding=enc, vocab_size=vocab_size, pattern=pattern, merges_digest=digest)
    if "<|im_start|>" in specials:
        stops = [specials[t] for t in ("<|im_end|>", "<|endoftext|>") if t in specials]
        return Tokenizer(chat_format="chatml", stop_ids=tuple(stops), **common)
    if "<|start_header_id|>" in specials:
        stops = [specials[t] for t in ("<|eot_id|>", "<|end_of_text|>", "<|eom_id|>")
                 if t in specials]
        return Tokenizer(chat_format="llama3", stop_ids=tuple(stops),
                         bos_id=specials.get("<|begin_of_text|>"), **common)
    stops = [specials[eos]] if isinstance(eos, str) and eos in specials else []
    return Tokenizer(chat_format="none", stop_ids=tuple(stops), **common)
