"""Hugging Face Llama checkpoints: config.json read into a LlamaConfig (refusing what the model
cannot run), safetensors loaded into our Llama (q/k/v and gate/up fused, every tensor's name
and shape checked), and our tensors named back as HF's for saving; the project's one writer of
whole files (a temporary name, then renamed); head folders (train_heads.py's, and published
EAGLE-3 heads in SpecForge's format) read into heads.py's modules.
"""
import json
import os
import uuid
from contextlib import suppress
from dataclasses import asdict

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from heads import HeadConfig, build_head, eagle3_taps
from model import Llama, LlamaConfig, LoadError, RopeScaling


def config_from_hf(hf: dict) -> LlamaConfig:
    """Read a Hugging Face config.json dict; refuse what this model cannot run."""
    if "kind" in hf:                                        # heads.HeadConfig's file
        raise LoadError(f"holds {hf['kind']} heads, not a model: give the folder to --head")
    arch = hf.get("architectures") or ["LlamaForCausalLM"]
    if hf.get("model_type", "llama") != "llama" or arch[0] != "LlamaForCausalLM":
        raise LoadError(f"unsupported architecture {arch[0]!r} (model_type "
                        f"{hf.get('model_type')!r}): only LlamaForCausalLM is supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise LoadError(f"unsupported hidden_act {hf['hidden_act']!r}: only silu")
    if hf.get("mlp_bias", False):
        raise LoadError("unsupported config: mlp_bias=true")
    # transformers 4 writes rope_theta and rope_scaling; transformers 5 one rope_parameters.
    rs = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = rs.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = None
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "llama3":
        fields = ("factor", "low_freq_factor", "high_freq_factor",
                  "original_max_position_embeddings")
        if any(f not in rs for f in fields):
            raise LoadError(f"rope_scaling llama3 needs {', '.join(fields)}")
        scaling = RopeScaling(*(rs[f] for f in fields))
    elif kind != "default":
        raise LoadError(f"unsupported rope_scaling type {kind!r}: only 'llama3' and none")
    try:
        return LlamaConfig(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
                           intermediate_size=hf["intermediate_size"],
                           num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
                           num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
                           head_dim=hf.get("head_dim") or 0, rms_eps=hf.get("rms_norm_eps", 1e-6),
                           rope_theta=theta, rope_scaling=scaling,
                           max_positions=hf.get("max_position_embeddings", 2048),
                           tie_embeddings=hf.get("tie_word_embeddings", False),
                           attention_bias=hf.get("attention_bias", False))
    except KeyError as e:
        raise LoadError(f"the field {e.args[0]!r} is missing") from None


def to_our_names(hf: dict, c: LlamaConfig) -> dict:
    """Rename HF tensors to this model's names, fusing q/k/v and gate/up."""
    sd = {"embed.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
    sd["lm_head.weight"] = hf["model.embed_tokens.weight" if c.tie_embeddings else "lm_head.weight"]
    for i in range(c.num_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        a = p + "self_attn."
        sd[o + "attn_norm.weight"] = hf[p + "input_layernorm.weight"]
        sd[o + "mlp_norm.weight"] = hf[p + "post_attention_layernorm.weight"]
        sd[o + "attn.wqkv.weight"] = torch.cat([hf[a + n + "_proj.weight"] for n in "qkv"])
        sd[o + "attn.wo.weight"] = wo = hf[a + "o_proj.weight"]
        if c.attention_bias:                            # o's optional: absent means zero
            sd[o + "attn.wqkv.bias"] = torch.cat([hf[a + n + "_proj.bias"] for n in "qkv"])
            sd[o + "attn.wo.bias"] = hf.get(a + "o_proj.bias", wo.new_zeros(c.hidden_size))
        sd[o + "mlp.w13.weight"] = torch.cat([hf[p + "mlp.gate_proj.weight"],
                                              hf[p + "mlp.up_proj.weight"]])
        sd[o + "mlp.w2.weight"] = hf[p + "mlp.down_proj.weight"]
    return sd


def to_hf_names(sd: dict, c: LlamaConfig) -> dict:
    """Inverse of to_our_names: this model's tensors -> HF Llama names (for saving drafts)."""
    D = c.head_dim
    q, kv = c.num_heads * D, c.num_kv_heads * D
    hf = {"model.embed_tokens.weight": sd["embed.weight"], "model.norm.weight": sd["norm.weight"]}
    if not c.tie_embeddings:
        hf["lm_head.weight"] = sd["lm_head.weight"]
    for i in range(c.num_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        a = p + "self_attn."
        hf[p + "input_layernorm.weight"] = sd[o + "attn_norm.weight"]
        hf[p + "post_attention_layernorm.weight"] = sd[o + "mlp_norm.weight"]
        for name, part in zip("qkv", sd[o + "attn.wqkv.weight"].split([q, kv, kv])):
            hf[a + name + "_proj.weight"] = part
        if c.attention_bias:
            for name, part in zip("qkv", sd[o + "attn.wqkv.bias"].split([q, kv, kv])):
                hf[a + name + "_proj.bias"] = part
            hf[a + "o_proj.bias"] = sd[o + "attn.wo.bias"]
        hf[a + "o_proj.weight"] = sd[o + "attn.wo.weight"]
        gate, up = sd[o + "mlp.w13.weight"].split([c.intermediate_size] * 2)
        hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"] = gate, up
        hf[p + "mlp.down_proj.weight"] = sd[o + "mlp.w2.weight"]
    return {k: v.contiguous() for k, v in hf.items()}


def read_json(path: str, what: str = "JSON file", kind=dict):
    """A JSON value of `kind` (object: any) from path; a missing file, invalid JSON or another
    kind names the file."""
    if not os.path.isfile(path):
        raise LoadError(f"{what} not found: {path}")
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise LoadError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, kind):
        raise LoadError(f"{path}: expected a JSON object")
    return data


def safetensors_files(folder: str) -> list:
    """The weight files of a HF folder: one model.safetensors, or the shards its index names."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        names = sorted(set(read_json(index, "shard index")["weight_map"].values()))
        return [os.path.join(folder, n) for n in names]
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise LoadError(f"no model.safetensors or model.safetensors.index.json in {folder}")


def read_safetensors(files: list, dtype) -> dict:
    """All tensors of the files, cast to dtype; a truncated or corrupt file names itself."""
    tensors = {}
    for path in files:
        if not os.path.isfile(path):
            raise LoadError(f"weight file not found: {path}")
        try:
            with safe_open(path, framework="pt") as f:
                tensors |= {name: f.get_tensor(name).to(dtype) for name in f.keys()}
        except (SafetensorError, OSError, RuntimeError) as e:
            raise LoadError(f"cannot read {path} (truncated or corrupt?): {e}") from None
    return tensors


def check_tensors(tensors: dict, c: LlamaConfig) -> None:
    """Every expected tensor present with its shape, nothing unexpected: else one clear error."""
    with torch.device("meta"):                  # the names and shapes, o_proj's bias optional
        hf = to_hf_names(Llama(c, init=False).state_dict(), c)
    expected = {k: tuple(v.shape) for k, v in hf.items() if not k.endswith("o_proj.bias")}
    tolerated = set(hf) - set(expected) | ({"lm_head.weight"} if c.tie_embeddings else set())
    missing = sorted(set(expected) - set(tensors))    # o_proj.bias: optional; lm_head: some tied
    extra = sorted(n for n in set(tensors) - set(expected) - tolerated   # checkpoints keep it
                   if not n.endswith("rotary_emb.inv_freq"))
    for names, what, why in ((missing, "lacks", ""), (extra, "has unexpected",
                                                      ": not a plain Llama for this config.json?")):
        if names:
            raise LoadError(f"checkpoint {what} tensor {names[0]}" + (
                f" (and {len(names) - 1} more)" if len(names) > 1 else "") + why)
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise LoadError(f"tensor {name} has shape {tuple(tensors[name].shape)}, "
                            f"config.json implies {shape}")


def load_model(folder: str, dtype=torch.float32, device="cpu", embeddings_from=None) -> Llama:
    """Load a Hugging Face Llama folder (config.json + safetensors, sharded or not).
    embeddings_from: a folder whose embedding (and untied lm_head) fill in the ones `folder`
    lacks (the distilled draft is saved without the target's frozen embedding)."""
    if not os.path.isdir(folder):
        raise LoadError(f"model folder not found: {folder}")
    config = folder_config(folder)
    tensors = read_safetensors(safetensors_files(folder), dtype)
    if embeddings_from and "model.embed_tokens.weight" not in tensors:
        tensors = borrowed_embeddings(folder, config, embeddings_from, dtype) | tensors
    check_tensors(tensors, config)
    with torch.device("meta"):
        model = Llama(config, init=False)
    model.load_state_dict(to_our_names(tensors, config), assign=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    return model.to(device).eval()


def folder_config(folder: str, hf: dict | None = None) -> LlamaConfig:
    """config_from_hf of the folder's config.json (or of hf, read from it), errors naming it."""
    path = os.path.join(folder, "config.json")
    hf = read_json(path, "config.json") if hf is None else hf   # its own errors name the file
    try:
        return config_from_hf(hf)
    except LoadError as e:
        raise LoadError(f"{path}: {e}") from None


def borrowed_embeddings(folder: str, config: LlamaConfig, source: str, dtype=None) -> dict:
    """{HF name: tensor}: the embedding (and an untied lm_head) of the model in `source`, for
    the model in `folder`, which was saved without them; cast to dtype (None: as stored)."""
    names = ["model.embed_tokens.weight"] + ([] if config.tie_embeddings else ["lm_head.weight"])
    tensors = {}
    for path in safetensors_files(source):
        with safe_open(path, framework="pt") as f:
            tensors |= {n: f.get_tensor(n) for n in names if n in f.keys()}
    missing = [n for n in names if n not in tensors]
    if missing:                             # an untied draft of a tied target, say
        raise LoadError(f"{folder}: its embeddings come from {source}, which has no "
                        f"{', '.join(missing)}")
    return {n: t if dtype is None else t.to(dtype) for n, t in tensors.items()}


def write_whole(path: str, write) -> None:
    """write(temporary path) then rename: path is whole or untouched, also when two processes
    write it at once (each its own temporary name, removed if the write fails)."""
    tmp = f"{path}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_json(path: str, obj, indent: int | None = 1) -> None:
    """obj as JSON in path, whole or not at all (write_whole)."""
    def dump(tmp):
        with open(tmp, "x") as f:
            json.dump(obj, f, indent=indent)
    write_whole(path, dump)


def save_tensors(tensors: dict, path: str, metadata: dict | None = None) -> None:
    """safetensors' save_file, whole or not at all, readable by whom its folder is (save_file
    makes files 0600, which another user of a shared cache, or an engine, cannot read)."""
    folder = os.stat(os.path.dirname(os.path.abspath(path))).st_mode

    def write(tmp):
        save_file(tensors, tmp, metadata=metadata)
        with suppress(OSError):            # a file system without modes: it stays as written
            os.chmod(tmp, folder & 0o444 | 0o600)
    write_whole(path, write)


def place_folder(built: str, folder: str, aside: str) -> bool:
    """Rename the finished folder `built` to `folder` -> whether it was placed. A complete one
    (with model.safetensors) another process placed meanwhile is kept (it may be in use); an
    incomplete one is first moved to `aside`, a path in the caller's work folder."""
    for attempt in range(3):
        try:
            os.rename(built, folder)
            return True
        except OSError:                    # folder exists and is not empty
            if os.path.isfile(os.path.join(folder, "model.safetensors")):
                return False
            with suppress(FileNotFoundError):      # another process moved it meanwhile
                os.rename(folder, f"{aside}{attempt}")
    raise OSError(f"{folder}: could not be replaced")


# ---------------------------------------------------------------- head folders (heads.py's)

def read_head_config(folder: str) -> HeadConfig:
    """A head folder's config.json (train_heads.py's, or a published EAGLE-3 head's); clear
    errors for a folder that is not one."""
    if not os.path.isfile(f"{folder}/config.json"):
        raise LoadError(f"{folder}: " + ("no config.json; is this a head folder (train_heads.py's, "
                        "or a published EAGLE-3 head)?" if os.path.isdir(folder) else
                        "a file, not a folder" if os.path.exists(folder) else "no such folder"))
    config = read_json(f"{folder}/config.json", "config.json")
    if set(config.get("architectures", [])) & set(EAGLE3_ARCHS):
        return eagle3_config(config, folder)
    try:
        if "kind" not in config:            # a whole model's HF config, a draft's say
            raise TypeError("no 'kind': a model's config? a draft model goes to --draft; an "
                            "exported EAGLE folder is for serving engines, --head takes the "
                            "folder it was exported from")
        config.pop("own_projection", None)      # older Medusa heads' (the shipped one's): false
        return HeadConfig(**config)
    except (TypeError, KeyError) as e:
        raise LoadError(f"{folder}/config.json: not a head config ({e})") from None


EAGLE3_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# flags of EAGLE-3's later variants, with the value that means the plain layer Eagle3Head computes
EAGLE3_PLAIN = {"fc_norm": False, "norm_before_residual": False, "norm_before_fc": False,
                "norm_output": True, "num_hidden_layers": 1}


def eagle3_config(hf: dict, folder: str) -> HeadConfig:
    """A published EAGLE-3 head's config.json (SpecForge's, vLLM's, SGLang's) -> HeadConfig."""
    for flag, plain in EAGLE3_PLAIN.items() | {("target_hidden_size", hf.get("hidden_size"))}:
        if hf.get(flag, plain) != plain:
            raise LoadError(f"{folder}/config.json: {flag}={hf[flag]}, an EAGLE-3 variant this "
                            f"code does not implement (only {flag}={plain})")
    layer = folder_config(folder, hf | {"architectures": ["LlamaForCausalLM"]})
    # SpecForge and SGLang name a layer by its output (hidden_states[L + 1]); vLLM's top-level
    # field, like `taps`, by the layer the stream enters (hidden_states[L])
    ids = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    taps = [i + 1 for i in ids] if ids else hf.get("eagle_aux_hidden_state_layer_ids") or []
    return HeadConfig("eagle3", layer.hidden_size, layer.vocab_size,
                      hf.get("draft_vocab_size", layer.vocab_size), layer=asdict(layer),
                      taps=list(taps))


def head_tensors(folder: str) -> tuple:
    """-> (path, {name: tensor}) of the folder's model.safetensors, else pytorch_model.bin."""
    path = f"{folder}/model.safetensors"
    try:
        if os.path.isfile(path) or not os.path.isfile(f"{folder}/pytorch_model.bin"):
            return path, load_file(path)
        path = f"{folder}/pytorch_model.bin"
        tensors = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:                      # safetensors, pickle and zip raise many kinds
        raise LoadError(f"{path}: unreadable ({(str(e).splitlines() or [''])[0][:160]})") from None
    if isinstance(tensors, dict) and all(isinstance(t, torch.Tensor) for t in tensors.values()):
        return path, tensors
    raise LoadError(f"{path}: not a state dict of tensors")


def eagle3_tensors(t: dict, config: HeadConfig, path: str) -> dict:
    """A published EAGLE-3 head's tensors (`midlayer.` or `layers.0.`, with or without `model.`;
    separate q/k/v and gate/up) -> Eagle3Head's. embed_tokens is left out: drafting embeds with
    the target's own (as SGLang does); t2d is d2t's inverse."""
    t = {k.removeprefix("model.").replace("layers.0.", "midlayer.", 1): v for k, v in t.items()
         if k.removeprefix("model.") not in ("embed_tokens.weight", "t2d")}
    R, V = config.draft_vocab, config.vocab_size
    d2t = t.pop("d2t", torch.zeros(R, dtype=torch.long))            # none: the identity
    ids = d2t.long() + torch.arange(R) if d2t.shape == (R,) else None  # (R,) target ids
    if ids is None or int(ids.min()) < 0 or int(ids.max()) >= V:
        raise LoadError(f"{path}: d2t of shape {tuple(d2t.shape)} does not map {R} draft ids "
                        f"into the vocabulary of {V}")
    a, m = "midlayer.self_attn.", "midlayer.mlp."
    try:
        t[a + "wqkv.weight"] = torch.cat([t.pop(a + n + "_proj.weight") for n in "qkv"])
        t[a + "wo.weight"] = t.pop(a + "o_proj.weight")
        t[m + "w13.weight"] = torch.cat([t.pop(m + n + "_proj.weight") for n in ("gate", "up")])
        t[m + "w2.weight"] = t.pop(m + "down_proj.weight")
    except (KeyError, RuntimeError) as e:
        raise LoadError(f"{path}: " + (f"no tensor {e.args[0]!r}" if isinstance(e, KeyError) else
                                       f"q/k/v or gate/up of shapes that do not join ({e})")) from None
    return t | {"vocab_ids": ids}


def load_head(folder: str, target, kind: str) -> tuple:
    """-> (head in the target's dtype and device, HeadConfig); clear errors for a bad folder."""
    config = read_head_config(folder)
    if config.kind != kind:
        raise LoadError(f"{folder}: holds a {config.kind} head, not {kind}")
    c = target.config
    if (config.hidden_size, config.vocab_size) != (c.hidden_size, c.vocab_size):
        raise LoadError(f"{folder}: head trained for hidden size {config.hidden_size} and vocab "
                        f"{config.vocab_size}, but the target has {c.hidden_size} and "
                        f"{c.vocab_size}; train a head for this target")
    path, tensors = head_tensors(folder)
    if kind == "eagle3":
        N = target.config.num_layers
        config.taps = config.taps or eagle3_taps(N)
        if max(config.taps) >= N or len(config.taps) != 3:
            raise LoadError(f"{folder}/config.json: taps {config.taps}: not three of the "
                            f"target's {N} layers")
        if not 0 <= (config.mask_token or 0) < c.vocab_size:          # a block head's mask
            raise LoadError(f"{folder}/config.json: mask_token {config.mask_token} is no token "
                            "id of the target's vocabulary")
        # a published head's names (train_heads.py's own have this module's, vocab_ids too)
        tensors = tensors if "vocab_ids" in tensors else eagle3_tensors(tensors, config, path)
    head = build_head(config, tensors.get("vocab_ids", torch.zeros(config.draft_vocab)))
    try:                                        # one line naming the first key that does not fit
        missing, extra = head.load_state_dict(tensors, strict=False)
    except RuntimeError as e:                   # a shape: torch's last line names the key
        raise LoadError(f"{path}: {str(e).strip().splitlines()[-1].strip()}") from None
    if missing or extra:
        raise LoadError(f"{path}: {'no tensor' if missing else 'unexpected tensor'} "
                        f"{(missing or extra)[0]!r} for its config.json")
    w = target.embed.weight
    return head.to(w.device, w.dtype).eval(), config
