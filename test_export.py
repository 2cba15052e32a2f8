"""Tests of the export to the EAGLE format, against the EAGLE authors' own code (eagle-llm)."""
import json
import os
from dataclasses import replace

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from checkpoint import config_from_hf, load_head, to_our_names
from default_model import WEIGHTS
from export import check_export, export_head
from heads import EagleHead, HeadConfig, eagle_layer_config
from model import KVCache, LlamaConfig, LoadError
from test_spec import tiny_model

import train_heads

transformers = pytest.importorskip("transformers")


def read_eagle(folder: str) -> EagleHead:
    """A folder export_head wrote, as our EagleHead in float32 over the whole vocabulary
    (vocab_ids 0..V-1): the reload half of the round trip. (The EAGLE authors' own heads come
    as pytorch_model.bin, without embed_tokens, sometimes without fc.bias: not read here.)"""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            hf = json.load(f)
        tensors = load_file(os.path.join(folder, "model.safetensors"))
    except (OSError, json.JSONDecodeError, SafetensorError) as e:
        raise LoadError(f"{folder}: not an EAGLE folder ({e})") from None
    hf = hf | {"architectures": ["LlamaForCausalLM"]}          # a head of a Llama, all the same
    layer = replace(config_from_hf(hf), num_layers=1, tie_embeddings=True)
    hf_names = {"model." + k: v for k, v in tensors.items() if k != "fc.weight" and k != "fc.bias"}
    hf_names |= {"model.norm.weight": torch.ones(layer.hidden_size),
                 "model.layers.0.input_layernorm.weight": torch.ones(layer.hidden_size)}
    ours = to_our_names(hf_names, layer)
    head = EagleHead(layer, torch.arange(layer.vocab_size))
    state = {k: v for k, v in ours.items() if k.startswith("layers.0.") and "attn_norm" not in k}
    state |= {"fc.weight": tensors["fc.weight"], "fc.bias": tensors["fc.bias"],
              "vocab_ids": head.vocab_ids}
    head.load_state_dict(state)
    return head.float().eval()


def saved_head(folder, target, seed=0, **config) -> EagleHead:
    """A random EAGLE head (float32, bf16-exact weights) saved as train_heads.py saves one."""
    torch.manual_seed(seed)
    c = target.config
    hc = HeadConfig("eagle", c.hidden_size, c.vocab_size, c.vocab_size,
                    layer=eagle_layer_config(c))
    for k, v in config.items():
        setattr(hc, k, v)
    head = EagleHead(LlamaConfig(**hc.layer), torch.arange(c.vocab_size))
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn_like(p).mul(0.3).bfloat16())
    train_heads.save_head(head, hc, str(folder))
    return head.eval()


def their_model(folder):
    """The EAGLE authors' Model, strictly loaded from an exported folder (float32)."""
    try:
        from eagle.model.cnets import Model
        from eagle.model.configs import EConfig
    except ImportError as e:
        pytest.skip(f"eagle-llm is not installed ({e}); README's set-up installs it with "
                    "pip install --no-deps eagle-llm==1.2.1")
    config = EConfig.from_pretrained(folder)
    config.rope_scaling = None        # transformers 5 fills it in; their attention reads None
    model = Model(config, load_emb=False)
    model.load_state_dict(load_file(os.path.join(folder, "model.safetensors")), strict=True)
    return model.float().eval()


def ours(head, embed, feats, next_tokens):
    """Our head's predicted features (T, C) for features (T, C) and the tokens they precede."""
    T = feats.shape[0]
    cache = KVCache.allocate(head.layer_config, 1, 64, torch.zeros(0))      # float32, CPU
    out = head(feats[None], embed[next_tokens][None], torch.arange(T)[None], cache)
    return out[0]


@pytest.mark.parametrize("seed", [0, 1])
def test_the_eagle_authors_model_computes_our_features_and_drafts(tmp_path, seed):
    target = tiny_model(seed).float()
    head = saved_head(tmp_path / "head", target, seed)
    export_head(str(tmp_path / "head"), target, str(tmp_path / "eagle"), "eagle")
    theirs = their_model(str(tmp_path / "eagle"))
    torch.manual_seed(seed)
    tokens = torch.randint(0, target.config.vocab_size, (1, 25))
    _, hidden = target(tokens, torch.arange(25)[None], target.new_cache(1, 64))
    feats, next_tokens = hidden[0, :-1], tokens[0, 1:]                  # (24, C), (24,)
    embed = theirs.embed_tokens.weight                                  # the file's, bf16-exact
    with torch.no_grad():
        want = theirs(feats[None], next_tokens[None])[0]                # (24, C)
        got = ours(head, embed, feats, next_tokens)
    # float32 either way; their attention multiplies out a mask and softmaxes another order
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()
    lm_head = target.lm_head.weight
    assert torch.equal((got @ lm_head.T).topk(4).indices, (want @ lm_head.T).topk(4).indices)


def test_export_and_reload_round_trip(tmp_path):
    target = tiny_model(2).float()
    head = saved_head(tmp_path / "head", target, 2)
    export_head(str(tmp_path / "head"), target, str(tmp_path / "eagle"), "eagle")
    config = json.load(open(tmp_path / "eagle" / "config.json"))
    assert (config["num_hidden_layers"], config["bias"], config["rope_theta"]) == (1, True, 1e4)
    assert config["architectures"] == ["LlamaForCausalLMEagle"]          # SGLang's name
    names = set(load_file(str(tmp_path / "eagle" / "model.safetensors")))
    assert "layers.0.input_layernorm.weight" not in names
    assert {"embed_tokens.weight", "fc.bias", "layers.0.self_attn.k_proj.weight"} <= names
    back = read_eagle(str(tmp_path / "eagle"))
    for name, w in head.state_dict().items():
        if name != "vocab_ids":
            assert torch.equal(back.state_dict()[name], w), name
    feats = torch.randn(9, target.config.hidden_size)
    tokens = torch.randint(0, target.config.vocab_size, (9,))
    with torch.no_grad():
        assert torch.equal(ours(back, target.embed.weight, feats, tokens),
                           ours(head, target.embed.weight, feats, tokens))


@pytest.mark.parametrize("case, message", [
    ("rope", "RoPE"),
    ("medusa", "holds medusa heads")])
def test_a_head_the_format_cannot_express_is_refused_and_nothing_is_written(
        tmp_path, case, message):
    target = tiny_model(0).float()
    folder = tmp_path / "head"
    if case == "medusa":
        from heads import MedusaHeads
        c = target.config
        train_heads.save_head(MedusaHeads(c.hidden_size, 2, torch.arange(c.vocab_size)),
                  HeadConfig("medusa", c.hidden_size, c.vocab_size, c.vocab_size, 2), str(folder))
    else:
        layer = eagle_layer_config(target.config)
        saved_head(folder, target, layer=layer | {"rope_theta": 5e5})
    with pytest.raises(LoadError, match=message):
        export_head(str(folder), target, str(tmp_path / "out"), "eagle")
    assert not os.path.exists(tmp_path / "out")
    assert [n for n in os.listdir(tmp_path) if n.startswith(".export")] == []


def test_export_never_replaces_a_folder_with_files_unless_forced(tmp_path, capsys, monkeypatch):
    target = tiny_model(0).float()
    saved_head(tmp_path / "head", target)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    monkeypatch.setattr(train_heads, "load_model", lambda *a: target)
    argv = ["export", str(tmp_path / "head"), str(out), "--format", "eagle"]
    with pytest.raises(SystemExit) as e:
        train_heads.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "--force" in err[0], err
    assert os.listdir(out) == ["notes.txt"]
    train_heads.main(argv + ["--force"])
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["head", "out"], "a temporary or old folder left"
    assert os.stat(out / "model.safetensors").st_mode & 0o777 == os.stat(out).st_mode & 0o666
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(out).st_mode & 0o777 == 0o777 & ~umask, "mkdtemp's private mode was kept"


def test_a_replacement_that_fails_at_the_rename_keeps_the_old_folder(tmp_path, monkeypatch):
    """--force replaces an old export only once the new one is whole: a failure as the new
    folder is renamed in puts the old one back, and no temporary folder is left."""
    from export import write_folder
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    real_replace = os.replace

    def failing(src, dst):
        if os.path.basename(src).startswith(".export-"):
            raise OSError("disk full")
        real_replace(src, dst)
    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(OSError, match="disk full"):
        write_folder(str(out), lambda tmp: open(os.path.join(tmp, "new"), "w").close())
    assert os.listdir(out) == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    assert os.listdir(tmp_path) == ["out"], os.listdir(tmp_path)

    def both_fail(src, dst):                  # the new one cannot go in, nor the old one back
        if os.path.basename(src).startswith((".export-", ".replaced-")):
            raise OSError("disk full")
        real_replace(src, dst)
    monkeypatch.setattr(os, "replace", both_fail)
    with pytest.raises(OSError, match="disk full"):
        write_folder(str(out), lambda tmp: open(os.path.join(tmp, "new"), "w").close())
    aside = [n for n in os.listdir(tmp_path) if n.startswith(".replaced-")]
    assert len(aside) == 1 and os.listdir(tmp_path / aside[0]) == ["notes.txt"], \
        "the old folder was deleted with the new one"


def test_a_head_of_the_older_layout_is_refused_in_one_line(tmp_path):
    """This project's own older EAGLE layout (a norm before attention) was deleted: such a
    folder is named, not misread."""
    target = tiny_model(3).float()
    saved_head(tmp_path / "old", target)
    config = json.loads((tmp_path / "old" / "config.json").read_text())
    (tmp_path / "old" / "config.json").write_text(json.dumps(config | {"input_norm": True}))
    with pytest.raises(LoadError, match="not a head config .*input_norm"):
        load_head(str(tmp_path / "old"), target, "eagle")


def test_a_draft_without_its_embedding_exports_as_a_whole_folder_transformers_loads(tmp_path):
    from checkpoint import load_model
    from test_spec import hf_checkpoint
    hf = hf_checkpoint(tmp_path / "target")
    target = load_model(str(tmp_path / "target"), torch.float32)
    train_heads.save_draft(train_heads.init_draft(target, 1), str(tmp_path / "target"),
                           str(tmp_path / "draft"), embeddings=False, pard_token=3)
    argv = ["export", str(tmp_path / "draft"), str(tmp_path / "whole"), "--format", "hf",
            "--model", str(tmp_path / "target"), "--cache-dir", str(tmp_path / "cache")]
    train_heads.main(argv)
    whole = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "whole")).float()
    assert whole.config.pard_token == 3                     # a parallel draft's mask token travels
    embed = hf.model.embed_tokens.weight.float()            # the target's, as the target stores it
    assert torch.equal(whole.model.embed_tokens.weight, embed)
    ours = load_model(str(tmp_path / "whole"), torch.float32)
    ids = torch.randint(0, 97, (1, 12))
    with torch.no_grad():
        want = whole(ids).logits
        got, _ = ours(ids, torch.arange(12)[None], ours.new_cache(1, 16))
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    with pytest.raises(LoadError, match="--format hf exports a distilled draft"):
        check_export(f"{WEIGHTS}/smollm2-135m-eagle3", str(tmp_path / "x"), "hf")
