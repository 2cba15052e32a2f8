"""Heads trained here, written in the formats that serving engines load.

    python train_heads.py export my-eagle eagle-out --format eagle

EAGLE's format is the EAGLE authors' (eagle/model/cnets.py `Model`, loaded strictly): config.json
(a LlamaConfig of one layer, `bias` for fc) and the tensors embed_tokens, fc and layers.0.* under
HF Llama names, without the layer's input_layernorm. SGLang's EAGLE head has the same layout;
vLLM's has no fc bias (docs/ENGINES.md).
The reduced draft vocabulary is our drafting shortcut: the exported head predicts a feature,
which those engines project with the target's whole lm_head. --format eagle3 writes SpecForge's
layout (`eagle3_folder`), --format hf the distilled draft as a whole HF folder (`export_draft`).
"""
import os
import shutil
import time
from dataclasses import replace

import torch

from checkpoint import (borrowed_embeddings, folder_config, load_head, read_head_config, read_json,
                        read_safetensors, save_tensors, to_hf_names, write_json)
from heads import EAGLE_ROPE_THETA, Eagle3Head, EagleHead, HeadConfig, eagle3_taps
from model import LlamaConfig, LoadError

FORMATS = ("eagle", "eagle3", "hf")


def check_exportable(config: HeadConfig, folder: str, fmt: str) -> None:
    """LoadError naming what the format (eagle, eagle3) cannot express, before anything is
    written."""
    layer, why = config.layer, None
    if config.kind != fmt:
        why = f"it holds {config.kind} heads; --format {fmt} exports {fmt} heads"
    elif fmt == "eagle3":
        return
    elif layer["num_layers"] != 1:
        why = f"it has {layer['num_layers']} decoder layers; the EAGLE format has one"
    elif layer["rope_theta"] != EAGLE_ROPE_THETA or layer["rope_scaling"]:
        why = (f"its RoPE (theta {layer['rope_theta']}, scaling {layer['rope_scaling']}) is not "
               f"the EAGLE code's fixed base {EAGLE_ROPE_THETA:g}")
    elif layer["head_dim"] * layer["num_heads"] != layer["hidden_size"] or layer["attention_bias"]:
        why = "its attention's shape (head_dim, biases) is not one the EAGLE code builds"
    if why:
        raise LoadError(f"{folder}: cannot export as --format {fmt}: {why}")


def eagle_config(layer: LlamaConfig) -> dict:
    """config.json: the fields EConfig (a LlamaConfig) reads, and what engines read beside; the
    architecture is SGLang's name for this head (the EAGLE code reads none)."""
    return {"architectures": ["LlamaForCausalLMEagle"], "model_type": "llama", "bias": True,
            "hidden_size": layer.hidden_size, "intermediate_size": layer.intermediate_size,
            "num_attention_heads": layer.num_heads, "num_key_value_heads": layer.num_kv_heads,
            "head_dim": layer.head_dim, "num_hidden_layers": 1, "hidden_act": "silu",
            "max_position_embeddings": layer.max_positions, "rms_norm_eps": layer.rms_eps,
            "rope_theta": layer.rope_theta, "rope_scaling": None,
            "vocab_size": layer.vocab_size, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16"}


def eagle3_folder(head: Eagle3Head, target_layers: int) -> tuple:
    """(config.json, tensors) of an EAGLE-3 head as SpecForge writes it and SGLang, vLLM and
    the authors' code read it: `midlayer.` names, q/k/v and gate/up apart, no embedding (each
    engine uses the target's), d2t (target id = draft id + d2t) and t2d (its inverse, a mask).
    Taps other than the default are written in both conventions (docs/ENGINES.md)."""
    c, R, V = head.layer_config, head.vocab_ids.shape[0], head.layer_config.vocab_size
    config = eagle_config(c) | {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": R}
    config.pop("bias")
    if list(head.taps) != eagle3_taps(target_layers):
        config |= {"eagle_aux_hidden_state_layer_ids": list(head.taps),
                   "eagle_config": {"eagle_aux_hidden_state_layer_ids": [t - 1 for t in head.taps],
                                    "use_aux_hidden_state": True}}
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    s = {k: v.detach() for k, v in head.state_dict().items()}
    a, m = "midlayer.self_attn.", "midlayer.mlp."
    for name, part in zip("qkv", s.pop(a + "wqkv.weight").split([q, kv, kv])):
        s[a + name + "_proj.weight"] = part
    s[a + "o_proj.weight"] = s.pop(a + "wo.weight")
    s[m + "gate_proj.weight"], s[m + "up_proj.weight"] = s.pop(m + "w13.weight").chunk(2)
    s[m + "down_proj.weight"] = s.pop(m + "w2.weight")
    ids = s.pop("vocab_ids").cpu()
    tensors = {k: v.to(torch.bfloat16).contiguous().cpu() for k, v in s.items()}
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return config, tensors | {"d2t": ids - torch.arange(R), "t2d": t2d}


def eagle_tensors(head: EagleHead, embed: torch.Tensor) -> dict:
    """Our head's tensors under the EAGLE names; embed (V, C): the target's embedding, which
    their Model holds as embed_tokens."""
    layer = replace(head.layer_config, tie_embeddings=True)     # no lm_head of its own
    unused = torch.ones(layer.hidden_size)      # to_hf_names wants the norms a Llama has
    ours = {"embed.weight": embed, "norm.weight": unused, "layers.0.attn_norm.weight": unused}
    ours |= {"layers.0." + k: v for k, v in head.layers[0].state_dict().items()}
    dummies = ("model.norm.weight", "model.layers.0.input_layernorm.weight")
    tensors = {k.removeprefix("model."): v for k, v in to_hf_names(ours, layer).items()
               if k not in dummies} | {"fc.weight": head.fc.weight, "fc.bias": head.fc.bias}
    return {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in tensors.items()}


def check_export(head_dir: str, out: str, fmt: str, force: bool = False) -> None:
    """Everything that can be refused before the target is loaded (ValueError)."""
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt}: one of {', '.join(FORMATS)}")
    real = os.path.realpath(out)
    if os.path.islink(out):
        raise ValueError(f"{out}: is a symbolic link; give the folder itself")
    if os.path.commonpath([real, os.path.realpath(head_dir)]) == real or \
            os.path.commonpath([real, os.getcwd()]) == real:
        raise ValueError(f"{out}: holds the folder exported from or the current folder; write "
                         "the export elsewhere")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"{out}: exists and is not a folder")
    if os.path.isdir(out) and os.listdir(out) and not force:
        raise ValueError(f"{out}: exists and is not empty; pass --force to replace it")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise ValueError(f"{out}: cannot write there ({parent} is not a writable folder)")
    if fmt != "hf":
        check_exportable(read_head_config(head_dir), head_dir, fmt)
    else:
        kind = read_json(os.path.join(head_dir, "config.json"), "the draft's config").get("kind")
        if kind:
            raise LoadError(f"{head_dir}: holds {kind} heads; --format hf exports a distilled "
                            "draft model (an EAGLE head goes to --format eagle)")


def export_head(head_dir: str, target, out: str, fmt: str, force: bool = False) -> None:
    """Write the head in head_dir as `fmt` into out, whole or not at all; a non-empty out is
    replaced only with force."""
    check_export(head_dir, out, fmt, force)
    head, _ = load_head(head_dir, target, fmt)
    config, tensors = (eagle3_folder(head, target.config.num_layers) if fmt == "eagle3" else
                       (eagle_config(head.layer_config), eagle_tensors(head, target.embed.weight)))

    def fill(tmp: str) -> None:
        save_tensors(tensors, os.path.join(tmp, "model.safetensors"), {"format": "pt"})
        write_json(os.path.join(tmp, "config.json"), config)
    write_folder(out, fill)


def write_folder(out: str, fill) -> None:
    """fill(tmp) writes a folder beside out, which then replaces out: whole or not at all. An
    old out is moved aside first and deleted only once the new one is in place; if the new one
    cannot be put in place, the old one is put back (or, if even that fails, left aside)."""
    parent = os.path.dirname(os.path.abspath(out))
    tmp = os.path.join(parent, f".export-{os.getpid()}-{time.time_ns()}")
    os.mkdir(tmp)                        # a folder's usual mode (mkdtemp's is private, 0700)
    aside, placed = os.path.join(parent, f".replaced-{os.getpid()}-{time.time_ns()}"), False
    try:
        fill(tmp)
        moved = os.path.exists(out)
        if moved:
            os.replace(out, aside)
        try:
            os.replace(tmp, out)
            placed = True
        except BaseException:
            if moved:
                os.replace(aside, out)
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if placed:
            shutil.rmtree(aside, ignore_errors=True)


def export_draft(draft_dir: str, target_folder: str, out: str, force: bool = False) -> None:
    """The distilled draft in draft_dir as a whole HF folder in out (its embedding taken from
    the target where it shares it), whole or not at all."""
    check_export(draft_dir, out, "hf", force)
    draft, target = (read_json(os.path.join(f, "config.json"), "a config")
                     for f in (draft_dir, target_folder))
    shape = ("hidden_size", "vocab_size")
    if [draft.get(k) for k in shape] != [target.get(k) for k in shape]:
        raise LoadError(f"{draft_dir}: a draft of hidden size {draft.get('hidden_size')} and vocab "
                        f"{draft.get('vocab_size')}, but the target {target_folder} has "
                        f"{target.get('hidden_size')} and {target.get('vocab_size')}")
    tensors = read_safetensors([os.path.join(draft_dir, "model.safetensors")], None)  # as stored
    if "model.embed_tokens.weight" not in tensors:           # the target's, as it stores them
        tensors |= borrowed_embeddings(draft_dir, folder_config(draft_dir), target_folder)

    def fill(tmp):
        shutil.copytree(draft_dir, tmp, dirs_exist_ok=True)
        save_tensors(tensors, os.path.join(tmp, "model.safetensors"), {"format": "pt"})
    write_folder(out, fill)
