"""Tests: EAGLE-3 heads in their published format. Oracles: SpecForge 0.2.0's
LlamaForCausalLMEagle3 (the trainer whose heads SGLang and vLLM serve: `pip install --no-deps
specforge==0.2.0`, Python 3.11 or later; where it is missing those tests skip and say why),
transformers' hidden_states for the layers a head reads, plain decoding for exactness."""
import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from decode import GenConfig, generate_ar, generate_spec
from checkpoint import load_head, load_model
from model import LlamaConfig, LoadError
from proposers import DraftConfig, EagleProposer, SizeRule
from test_spec import default_path, tiny_model  # noqa: F401 (a fixture)

C, V, R = 64, 256, 48        # the tiny head's hidden size, the target's vocabulary, its own


@pytest.fixture(scope="module")
def specforge():
    """SpecForge's draft class, with torch.compile off (its norms and RoPE are compiled)."""
    try:
        with warnings.catch_warnings():         # that flash_attn, a GPU kernel, is missing
            warnings.simplefilter("ignore")
            from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    except ImportError as e:
        pytest.skip(f"SpecForge 0.2.0, the EAGLE-3 oracle, is not installed ({e}); pip install "
                    "--no-deps specforge==0.2.0 (Python >= 3.11)")
    return LlamaForCausalLMEagle3


@pytest.fixture
def no_dynamo():
    import torch._dynamo
    with torch._dynamo.config.patch(disable=True):
        yield


def specforge_head(cls, folder, seed=0):
    """A random SpecForge head for a target of hidden size C and vocabulary V, its draft
    vocabulary R sorted target ids (d2t as SpecForge builds it), saved with save_pretrained."""
    import transformers
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=C, intermediate_size=96, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=1, vocab_size=V,
                                   draft_vocab_size=R, rms_norm_eps=1e-6, rope_theta=10000.0,
                                   max_position_embeddings=512, tie_word_embeddings=False)
    head = cls(cfg).eval()
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.normal_(1 if "norm" in name else 0, 0.3)
        used = torch.randperm(V)[:R].sort().values
        head.d2t.copy_(used - torch.arange(R))
        head.t2d.zero_()[used] = True
    head.save_pretrained(folder)
    return head


def target_for_head(layers=8):
    return tiny_model(3, vocab_size=V, hidden_size=C, num_layers=layers).float()


def test_a_specforge_head_drafts_here_what_it_drafts_there(specforge, no_dynamo, tmp_path):
    ref = specforge_head(specforge, tmp_path / "h")
    target = target_for_head()
    head, config = load_head(str(tmp_path / "h"), target, "eagle3")
    assert config.taps == [2, 4, 5]                     # 2, N/2, N - 3 for a target of 8 layers
    ref.embed_tokens.weight.data.copy_(target.embed.weight)     # drafting embeds with the target's
    g = torch.Generator().manual_seed(1)
    T = 7
    taps, tokens = torch.randn(1, T, 3 * C, generator=g), torch.randint(0, V, (1, T + 1), generator=g)
    with torch.no_grad():
        # depth 0 over T positions from the target's taps, then one token more fed the head's
        # own last feature (depth 1), each causal; SpecForge sees both as one sequence
        fed = ref.project_hidden_states(taps)
        first = ref.backbone(ref.embed_input_ids(tokens[:, :T]), fed, None, None,
                             torch.arange(T)[None])
        both = ref.backbone(ref.embed_input_ids(tokens), torch.cat([fed, first[:, -1:]], 1), None,
                            None, torch.arange(T + 1)[None])
        want = ref.compute_logits(both)                                  # (1, T + 1, R)
        cache = head.new_cache(64)
        out = head(taps, target.embed(tokens[:, :T]), torch.arange(T)[None], cache)
        out = torch.cat([out, head(out[:, -1:], target.embed(tokens[:, T:]),
                                   torch.tensor([[T]]), cache)], 1)
        got = head.projection()(out)
    torch.testing.assert_close(out, both, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    top = got[0].topk(3).indices                                         # (T + 1, 3) draft ids
    assert torch.equal(top, want[0].topk(3).indices)
    assert torch.equal(head.vocab_ids[top], top + ref.d2t[top])          # the target's ids


def test_the_layer_ids_of_each_convention_read_the_same_hidden_states(tmp_path):
    """A head's taps are the residual stream entering layers 2, N/2, N - 3: transformers'
    hidden_states[2], [N/2], [N - 3]; SpecForge's and SGLang's eagle_config ids name the layer
    whose output it is (one less), vLLM's top-level ids the same as ours. Off by one, the taps
    would be another layer's stream, and this fails."""
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=C, intermediate_size=96,
                                   num_hidden_layers=8, num_attention_heads=4,
                                   max_position_embeddings=256)
    hf = transformers.LlamaForCausalLM(cfg).to(torch.float64).eval()
    hf.save_pretrained(tmp_path / "t")
    target = load_model(str(tmp_path / "t"), torch.float64)
    ids = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        states = hf(ids, output_hidden_states=True).hidden_states
        _, taps = target(ids, torch.arange(9)[None], target.new_cache(1, 64), taps=(2, 4, 5))
    torch.testing.assert_close(taps, torch.cat([states[2], states[4], states[5]], -1))
    for n, fields in enumerate(({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4],
                                     "use_aux_hidden_state": True}},
                   {"eagle_aux_hidden_state_layer_ids": [2, 4, 5]})):
        folder = write_head(tmp_path / str(n), fields)
        assert load_head(folder, target.float(), "eagle3")[1].taps == [2, 4, 5], fields


def write_head(folder, config_fields=None, tensors=None):
    """A random head in the published format (the 15 tensors of the EAGLE-3 checklist)."""
    folder.mkdir(parents=True)
    torch.manual_seed(0)
    t = {"fc.weight": (C, 3 * C), "midlayer.self_attn.q_proj.weight": (C, 2 * C),
         "midlayer.self_attn.k_proj.weight": (C // 2, 2 * C),
         "midlayer.self_attn.v_proj.weight": (C // 2, 2 * C),
         "midlayer.self_attn.o_proj.weight": (C, C), "midlayer.mlp.gate_proj.weight": (96, C),
         "midlayer.mlp.up_proj.weight": (96, C), "midlayer.mlp.down_proj.weight": (C, 96),
         "midlayer.hidden_norm.weight": (C,), "midlayer.input_layernorm.weight": (C,),
         "midlayer.post_attention_layernorm.weight": (C,), "norm.weight": (C,),
         "lm_head.weight": (R, C)}
    t = {k: torch.randn(shape) * 0.3 for k, shape in t.items()}
    t |= {"d2t": torch.arange(R) * 2, "t2d": torch.zeros(V, dtype=torch.bool)}
    save_file(tensors(t) if tensors else t, str(folder / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
              "hidden_size": C, "intermediate_size": 96, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_hidden_layers": 1, "rms_norm_eps": 1e-6,
              "vocab_size": V, "draft_vocab_size": R, "tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps(config | (config_fields or {})))
    return str(folder)


def test_the_published_layouts_load_alike(tmp_path):
    """`midlayer.` or `layers.0.`, with or without `model.`, safetensors or a .bin; no rope_theta
    is 10,000 as the authors' code has it; no d2t is the identity."""
    target = target_for_head()
    base, _ = load_head(write_head(tmp_path / "base"), target, "eagle3")
    assert base.layer_config.rope_theta == 10000.0
    assert torch.equal(base.vocab_ids, torch.arange(R) * 3)             # i + d2t[i]
    renames = {"vllm": lambda t: {("model." + k.replace("midlayer.", "layers.0.")
                                   if k != "lm_head.weight" else k): v for k, v in t.items()},
               "prefixed": lambda t: {"model." + k: v for k, v in t.items()}}
    for name, rename in renames.items():
        head, _ = load_head(write_head(tmp_path / name, tensors=rename), target, "eagle3")
        assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(),
                                                      base.state_dict().values())), name
    folder = write_head(tmp_path / "bin")
    torch.save(load_file(f"{folder}/model.safetensors"), f"{folder}/pytorch_model.bin")
    (tmp_path / "bin" / "model.safetensors").unlink()
    head, _ = load_head(folder, target, "eagle3")
    assert torch.equal(head.fc.weight, base.fc.weight)
    folder = write_head(tmp_path / "full", {"draft_vocab_size": V},
                        lambda t: {k: v for k, v in t.items() if k not in ("d2t", "t2d")} |
                        {"lm_head.weight": torch.randn(V, C)})
    assert torch.equal(load_head(folder, target, "eagle3")[0].vocab_ids, torch.arange(V))


@pytest.mark.parametrize("case", ["missing", "extra", "shape", "no q", "k apart", "d2t", "variant",
                                  "bin", "corrupt", "target"])
def test_a_bad_published_head_is_one_line_naming_file_and_key(tmp_path, case):
    drop = lambda key: lambda t: {k: v for k, v in t.items() if k != key}   # noqa: E731
    folder, tensors, fields, want = tmp_path / "h", None, None, None
    if case == "missing":
        tensors, want = drop("midlayer.hidden_norm.weight"), "model.safetensors: no tensor 'midlayer.hidden_norm.weight'"
    elif case == "extra":
        tensors, want = lambda t: t | {"fc.bias": torch.zeros(C)}, "unexpected tensor 'fc.bias'"
    elif case == "shape":
        tensors, want = lambda t: t | {"norm.weight": torch.ones(C + 1)}, "size mismatch for norm.weight"
    elif case == "no q":
        tensors, want = drop("midlayer.self_attn.q_proj.weight"), "no tensor 'midlayer.self_attn.q_proj.weight'"
    elif case == "k apart":
        tensors = lambda t: t | {"midlayer.self_attn.k_proj.weight": torch.zeros(C // 2, 2 * C + 1)}
        want = "q/k/v or gate/up of shapes that do not join"
    elif case == "d2t":
        tensors, want = lambda t: t | {"d2t": torch.arange(R) * 9}, "d2t of shape (48,) does not map"
    elif case == "variant":
        fields, want = {"norm_before_residual": True}, "config.json: norm_before_residual=True"
    elif case == "target":
        fields, want = {"vocab_size": V + 1}, "head trained for hidden size 64 and vocab 257"
    path = write_head(folder, fields, tensors)
    if case in ("bin", "corrupt"):
        (folder / "model.safetensors").unlink()
        torch.save([1, 2], folder / "pytorch_model.bin")
        want = "pytorch_model.bin: not a state dict of tensors"
    if case == "corrupt":
        (folder / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not a zip")
        want = "pytorch_model.bin: unreadable ("
    with pytest.raises(LoadError) as e:
        load_head(path, target_for_head(), "eagle3")
    assert want in str(e.value) and path in str(e.value) and "\n" not in str(e.value)


def test_eagle3_writes_plain_decodings_tokens(tmp_path):
    """EAGLE-2's tree drafted by an EAGLE-3 head: greedy and seeded sampling give plain
    decoding's tokens, with the target's three taps fed to the head every step."""
    target = target_for_head().double()
    head, _ = load_head(write_head(tmp_path / "h"), target, "eagle3")
    prompt = [5, 17, 3, 99, 41, 8]
    fed = []                               # what fc fuses: the target's taps, every step
    head.fc.register_forward_hook(lambda m, x, y: fed.append(x[0].shape))
    for temperature in (0.0, 0.8):
        gen = GenConfig(max_new_tokens=40, temperature=temperature, seed=3)
        want = generate_ar(target, prompt, gen).token_ids
        proposer = EagleProposer(target, head, DraftConfig(3, 4, 8), 256, proj=head.projection())
        assert proposer.taps == (2, 4, 5)
        got = generate_spec(target, proposer, prompt, gen)
        assert got.token_ids == want, temperature
        assert got.target_forwards < len(want) or temperature > 0
    assert len(fed) > 20 and all(shape[-1] == 3 * C for shape in fed)


def test_the_command_line_runs_a_published_head_on_the_default_model(default_path, tmp_path,
                                                                     capsys):
    """`--method eagle3 --head DIR` with a random head of the default model's shape (its three
    taps, of 30 layers, 2, 15 and 27): plain decoding's very text, greedy and sampled."""
    import spec
    from checkpoint import folder_config
    c = folder_config(default_path)
    torch.manual_seed(0)
    H, Q, KV, F = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, 1536
    shapes = {"fc.weight": (H, 3 * H), "midlayer.self_attn.q_proj.weight": (Q, 2 * H),
              "midlayer.self_attn.k_proj.weight": (KV, 2 * H),
              "midlayer.self_attn.v_proj.weight": (KV, 2 * H),
              "midlayer.self_attn.o_proj.weight": (H, Q), "midlayer.mlp.gate_proj.weight": (F, H),
              "midlayer.mlp.up_proj.weight": (F, H), "midlayer.mlp.down_proj.weight": (H, F),
              "lm_head.weight": (1024, H)}
    t = {k: torch.randn(s) * 0.05 for k, s in shapes.items()}
    t |= {k: torch.ones(H) for k in ("midlayer.hidden_norm.weight", "norm.weight",
                                     "midlayer.input_layernorm.weight",
                                     "midlayer.post_attention_layernorm.weight")}
    t["d2t"] = torch.zeros(1024, dtype=torch.long)           # the first 1024 ids
    (tmp_path / "h").mkdir()
    save_file(t, str(tmp_path / "h" / "model.safetensors"))
    (tmp_path / "h" / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": H, "intermediate_size": F,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
        "num_hidden_layers": 1, "rms_norm_eps": c.rms_eps, "vocab_size": c.vocab_size,
        "draft_vocab_size": 1024}))
    argv = ["--max-new-tokens", "24", "--json", "-", "--prompt", "Name three rivers."]
    for sampling in ([], ["--temperature", "0.8", "--seed", "3"]):
        texts = {}
        for method, more in (("ar", []), *((m, ["--head", str(tmp_path / "h"), "--tree-size",
                                                "4"]) for m in ("eagle3", "eagle2"))):
            spec.main(["--method", method, *more, *argv, *sampling])
            texts[method] = json.loads(capsys.readouterr().out)["token_ids"]
        assert texts["eagle3"] == texts["eagle2"] == texts["ar"], sampling


def test_the_command_line_names_what_is_wrong_with_a_head(capsys):
    """A head of another kind given to eagle3, a missing folder: one `error:` line each, exit
    2, before the target loads."""
    import spec
    from default_model import WEIGHTS
    cases = ((["--head", f"{WEIGHTS}/smollm2-135m-medusa"], "holds medusa heads, which only "
              "medusa draft with"),
             (["--head", "/nonexistent"], "/nonexistent: no such folder"))
    for flags, want in cases:
        with pytest.raises(SystemExit) as e:
            spec.main(["--method", "eagle3", *flags])
        err = capsys.readouterr().err
        assert e.value.code == 2 and want in err and err.count("\n") == 1, (flags, err)


def test_an_eagle3_head_trains_on_taps_and_decodes_exactly(tmp_path):
    """train_heads.py --method eagle3's parts on a tiny target: shards of [three taps; final
    hidden], the EAGLE-3 recipe (training-time test, no feature loss) makes the loss fall, the
    measured accuracies read the taps, and the saved head loads back and drafts what it drafted,
    plain decoding's tokens."""
    from types import SimpleNamespace
    import features
    import train_heads as th
    import training
    from test_heads import TinyTokenizer
    torch.manual_seed(0)
    target = tiny_model(3, num_layers=8).float().requires_grad_(False)
    taps = [2, 4, 5, 8]                                   # EAGLE-3's three, and N: the labels'
    rows = [(f"q{i} {'ab' * (i % 5)}", None) for i in range(40)]
    features.extract_features(target, TinyTokenizer(), rows, str(tmp_path / "f"), 8, 24, 64, taps)
    seqs = features.load_features(str(tmp_path / "f"))
    C = target.config.hidden_size
    assert seqs[0].hidden.shape[1] == 4 * C
    args = SimpleNamespace(out=str(tmp_path / "o"), draft_vocab=40, method="eagle3", heads=3)
    head, config = th.new_head(args, target, seqs, (0,))
    assert config.taps == [2, 4, 5] and head.taps == (2, 4, 5)
    proj = th.projection_rows(target, head.vocab_ids)
    def loss(s):
        b = training.eagle3_batch(features.make_batch(s), C)
        return training.eagle_loss(head, target.embed, proj, b, 3, 0)
    record = training.train(head, loss, seqs, training.TrainConfig(epochs=30, tokens_per_batch=256,
                                                                    lr=3e-3), str(tmp_path / "t"))
    first, last = record["losses"][:5], record["losses"][-5:]
    mean = lambda rows: sum(sum(r) / len(r) for r in rows) / len(rows)     # noqa: E731
    assert mean(last) < mean(first) - 0.4, f"loss {mean(first)} -> {mean(last)}"
    config.accuracy = training.accuracy_table(target, head.eval(), "eagle3", seqs[:8], 3, 4)
    assert config.accuracy[0][0] > 0.3, config.accuracy
    th.save_head(head, config, str(tmp_path / "h"))
    loaded, _ = load_head(str(tmp_path / "h"), target, "eagle3")
    head = head.to(torch.bfloat16).float()                # the file holds 16-bit weights
    outs, prompt = [], seqs[0].tokens[:seqs[0].prompt_len].tolist()    # a prompt it learned
    for h in (head, loaded):
        proposer = EagleProposer(target, h, DraftConfig(3, 2, 5), 256, proj=h.projection())
        outs.append(generate_spec(target, proposer, prompt, GenConfig(20)))
    assert outs[0].token_ids == outs[1].token_ids == generate_ar(target, prompt,
                                                                 GenConfig(20)).token_ids
    assert outs[0].accepted == outs[1].accepted and sum(outs[0].accepted) > 0
    from methods import build_head, method_config
    for method in ("eagle", "eagle2"):       # EAGLE's static tree and EAGLE-2's take it too
        mc = method_config(method, tree_size=5, heads=(str(tmp_path / "h"),))
        out = generate_spec(target, build_head(mc, target, 256)[0], prompt, GenConfig(20))
        assert out.token_ids == outs[0].token_ids and sum(out.accepted) > 0, method


def test_the_compiled_step_returns_the_taps():
    """--compile with an EAGLE-3 head: a compiled step returns what Llama.forward does for the
    same taps (the streams entering those layers, and the final hidden for N)."""
    from kernel import Compiled
    target, taps = tiny_model(3, num_layers=4).float(), (1, 2, 4)
    tokens = torch.randint(0, target.config.vocab_size, (1, 20))
    fast = Compiled(target, (4,), 64, taps)
    outs = []
    with torch.inference_mode():                                    # as decoding runs
        for model, cache in ((target, target.new_cache(1, 64)), (fast, fast.new_cache())):
            model(tokens[:, :16], torch.arange(16)[None], cache)                 # eager prefill
            outs.append(model(tokens[:, 16:], torch.arange(16, 20)[None], cache, taps=taps)[1])
    C = target.config.hidden_size
    assert outs[1].shape == (1, 4, 3 * C) and torch.allclose(outs[1], outs[0], atol=1e-5)


def test_our_export_loads_strictly_in_specforge_and_drafts_the_same(specforge, no_dynamo,
                                                                    tmp_path):
    """`train_heads.py export --format eagle3`: SpecForge's class loads it with no key missing
    but the embedding (every engine uses the target's) and none unexpected, and from the same
    taps gives our head's logits and top-k drafts; our reader loads it back to the same head.
    Taps other than the default are written in both layer-id conventions."""
    import transformers
    from safetensors.torch import load_file
    import train_heads as th
    from export import export_head
    from heads import Eagle3Head, HeadConfig, eagle_layer_config
    target = target_for_head()
    c = target.config
    torch.manual_seed(5)
    vocab = torch.randperm(V)[:R].sort().values
    for taps in ([2, 4, 5], [1, 3, 6]):
        head = Eagle3Head(LlamaConfig(**eagle_layer_config(c)), vocab, taps)
        with torch.no_grad():
            for p in head.parameters():
                p.normal_(0, 0.3)
        config = HeadConfig("eagle3", C, V, R, layer=eagle_layer_config(c), taps=taps)
        th.save_head(head, config, str(tmp_path / f"h{taps[0]}"))
        out = tmp_path / f"e{taps[0]}"
        export_head(str(tmp_path / f"h{taps[0]}"), target, str(out), "eagle3")
        saved = json.loads((out / "config.json").read_text())
        assert ("eagle_config" in saved) == (taps != [2, 4, 5])
        ref = specforge(transformers.LlamaConfig.from_pretrained(out)).float().eval()
        missing, extra = ref.load_state_dict(load_file(out / "model.safetensors"), strict=False)
        assert missing == ["embed_tokens.weight"] and extra == [], (missing, extra)
        ref.embed_tokens.weight.data.copy_(target.embed.weight)
        ours, back = load_head(str(tmp_path / f"h{taps[0]}"), target, "eagle3")[0], \
            load_head(str(out), target, "eagle3")
        assert back[1].taps == taps
        assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(),
                                                      back[0].state_dict().values()))
        g = torch.Generator().manual_seed(2)
        feats, tokens = torch.randn(1, 6, 3 * C, generator=g), torch.randint(0, V, (1, 6), generator=g)
        with torch.no_grad():
            want = ref.compute_logits(ref.backbone(ref.embed_input_ids(tokens),
                                                   ref.project_hidden_states(feats), None, None,
                                                   torch.arange(6)[None]))
            got = ours.projection()(ours(feats, target.embed(tokens), torch.arange(6)[None],
                                         ours.new_cache(64)))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        top = got[0].topk(3).indices
        assert torch.equal(top, want[0].topk(3).indices)
        assert torch.equal(ours.vocab_ids[top], top + ref.d2t[top])


def test_export_eagle3_refuses_a_head_of_another_kind(tmp_path):
    from default_model import WEIGHTS
    from export import check_export
    with pytest.raises(LoadError, match="holds medusa heads; --format eagle3 exports eagle3"):
        check_export(f"{WEIGHTS}/smollm2-135m-medusa", str(tmp_path / "x"), "eagle3")


def test_each_method_takes_a_head_of_its_own_kind_first(tmp_path):
    """Given an EAGLE head and an EAGLE-3 one, eagle2 drafts with the former and eagle3 with the
    latter (a bench compares them); given the EAGLE-3 head alone, eagle2 takes it; given none,
    every EAGLE method takes the shipped EAGLE-3 head."""
    from default_model import WEIGHTS
    from methods import head_folder
    from test_export import saved_head
    e3, eagle = write_head(tmp_path / "h"), str(tmp_path / "eagle")
    saved_head(eagle, tiny_model(3).float())
    assert head_folder([e3, eagle], "eagle") == (eagle, "eagle")
    assert head_folder([e3, eagle], "eagle3") == (e3, "eagle3")
    assert head_folder([e3], "eagle") == (e3, "eagle3")
    shipped = (f"{WEIGHTS}/smollm2-135m-eagle3", "eagle3")
    assert head_folder([], "eagle") == head_folder([], "eagle3") == shipped


# held-out text for the shipped head's bar: prompts written here, none sharing the wording of a
# prompt it trained on (prompts.jsonl, searched)
HELD_OUT = ["Write a short email asking a colleague to move Friday's meeting to Monday.",
            "What are three differences between a virus and a bacterium?",
            "Write a shell command that counts the lines in every .txt file in a folder.",
            "A train leaves at 9:40 and arrives at 13:15. How long is the trip?",
            "Describe a quiet morning in a small fishing village.",
            "Give me some tips for learning to play the guitar as an adult.",
            "Summarize the causes of the French Revolution in a paragraph.",
            "You are a museum guide. Welcome a group of children to the dinosaur hall."]


@pytest.mark.slow
def test_the_shipped_head_loads_in_specforge_and_drafts_the_targets_next_token(
        specforge, no_dynamo, default_path, tmp_path):
    """Issue 53's bar: SpecForge's class loads `export --format eagle3` of the shipped head,
    no key unexpected and none missing but embed_tokens (the published format's 15 tensors:
    SpecForge's own export for SGLang drops it, every engine embeds with the target's); fed the
    taps transformers' LlamaForCausalLM computes for the default model on held-out text (its own
    greedy answers to the prompts above), its first-depth top-1 is the target's next token at
    half the answer positions or more."""
    import transformers
    from default_model import WEIGHTS
    from export import export_head
    from tokenizer import load_tokenizer
    target, tok = load_model(default_path, torch.float32, "cpu"), load_tokenizer(default_path)
    export_head(f"{WEIGHTS}/smollm2-135m-eagle3", target, str(tmp_path / "e3"), "eagle3")
    cfg = transformers.LlamaConfig.from_pretrained(tmp_path / "e3")
    ref = specforge(cfg).float().eval()
    missing, extra = ref.load_state_dict(load_file(tmp_path / "e3" / "model.safetensors"),
                                         strict=False)
    assert missing == ["embed_tokens.weight"] and not extra, (missing, extra)
    ref.embed_tokens.weight.data.copy_(target.embed.weight)
    N = target.config.num_layers
    assert "eagle_config" not in cfg.to_dict()       # the engines' default taps, as hidden_states:
    taps = (2, N // 2, N - 3)
    hf = transformers.LlamaForCausalLM.from_pretrained(default_path, dtype=torch.float32).eval()
    agree = total = 0
    with torch.no_grad():
        for prompt in HELD_OUT:
            ids = tok.chat_prompt(prompt)
            answer = generate_ar(target, ids, GenConfig(48), tok.stop_ids).token_ids
            seq = torch.tensor([ids + answer])                   # (1, L)
            L, P = seq.shape[1], len(ids)
            out = hf(seq, output_hidden_states=True)
            following = out.logits[0].argmax(-1)                  # (L,) the target's next token
            fused = ref.project_hidden_states(torch.cat([out.hidden_states[i] for i in taps], -1))
            g = ref.backbone(ref.embed_input_ids(seq[:, 1:]), fused[:, :-1], None, None,
                             torch.arange(L - 1)[None])
            top = ref.compute_logits(g)[0].argmax(-1)             # (L - 1,) draft ids
            # at i, from token i's taps and token i + 1's embedding: the token after i + 1; the
            # first at the prompt's next-to-last token, whose next but one is the answer's first
            drafted = (top + ref.d2t[top])[P - 2:]
            agree += int((drafted == following[P - 1:]).sum())
            total += len(drafted)
    assert agree >= total / 2, f"first-depth top-1 {agree / total:.3f} of {total} positions"


# ---------------------------------------------------------------- block heads (--method block)

MASK = 250                                  # the tiny block heads' mask token


def random_block_head(target, seed=5):
    from heads import Eagle3Head, eagle_layer_config
    torch.manual_seed(seed)
    vocab = torch.randperm(V)[:R].sort().values
    head = Eagle3Head(LlamaConfig(**eagle_layer_config(target.config)), vocab, (2, 4, 5))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)
    return head.to(target.embed.weight.dtype)


def block_oracle(target, head, prompt: list, root: int) -> tuple:
    """A block of 4 as one causal forward of a fresh head cache computes it: the prompt's taps
    (6, 3C), then the logits (4, R) of the root's row and of 3 masks reading the last row's taps."""
    with torch.no_grad():
        taps = target(torch.tensor([prompt]), torch.arange(6)[None], target.new_cache(1, 64),
                      taps=(2, 4, 5))[1][0]                                         # (6, 3C)
        feats = torch.cat([taps, taps[-1:].expand(3, -1)])[None]                    # (1, 9, 3C)
        ids = torch.tensor([prompt[1:] + [root] + [MASK] * 3])
        out = head(feats, target.embed(ids), torch.arange(9)[None], head.new_cache(64))
        return taps, head.projection()(out[0, -4:]).float()


def test_a_block_head_drafts_its_chain_in_one_forward_and_stays_exact():
    """The pending rows and depth - 1 masks (each reading the last row's taps) in ONE head
    forward: the root's output and the masks' are the chain, as one causal forward of a fresh
    cache over those rows computes them; the masks leave the cache; greedy and seeded sampling
    write plain decoding's tokens."""
    target = target_for_head().double()
    head = random_block_head(target)
    prompt, root = [5, 17, 3, 99, 41, 8], 77
    taps, logits = block_oracle(target, head, prompt, root)
    want = head.vocab_ids[logits.argmax(-1)].tolist()
    calls = []
    head.register_forward_hook(lambda *a: calls.append(1))
    proposer = EagleProposer(target, head, DraftConfig(4), 256, proj=head.projection(),
                             mask_id=MASK)
    proposer.start(prompt, taps)
    tree, q = proposer.propose(root, GenConfig(8), None)
    assert tree.tokens.tolist() == [root] + want and q is None
    assert len(calls) == 1, f"{len(calls)} head forwards for a block of 4"
    assert proposer.cache.length == 6, "the masks' entries stayed in the head's cache"
    for depth, temperature in ((1, 0.0), (3, 0.0), (4, 0.0), (3, 0.8)):
        gen = GenConfig(max_new_tokens=40, temperature=temperature, seed=3)
        proposer = EagleProposer(target, head, DraftConfig(depth), 256, proj=head.projection(),
                                 mask_id=MASK)
        got = generate_spec(target, proposer, prompt, gen)
        assert got.token_ids == generate_ar(target, prompt, gen).token_ids, (depth, temperature)


def test_auto_cuts_a_block_where_its_places_stop_paying_their_rows():
    """--tree-size auto on a block: EAGLE-2's rule on the chain. At a price of `rate` tokens a
    verified row, a place is kept while its chain's probability (the product of the places'
    own, up to it) is above the price: none at a high price, all at none; decoding stays
    plain decoding's whatever the cut."""
    target = target_for_head().double()
    head = random_block_head(target)
    prompt, root = [5, 17, 3, 99, 41, 8], 77
    taps, logits = block_oracle(target, head, prompt, root)
    full = head.vocab_ids[logits.argmax(-1)].tolist()
    chained = logits.softmax(-1).max(-1).values.cumprod(0)                          # (4,)
    for rate in (2.0, 0.0, float(chained[1] + chained[2]) / 2):
        rule = SizeRule(4, [[1.0]] * 4, verify_ms=lambda k: float(k), rate=rate)
        proposer = EagleProposer(target, head, DraftConfig(4, rule=rule), 256,
                                 proj=head.projection(), mask_id=MASK)
        proposer.start(prompt, taps)
        kept = int((chained > rate).sum())
        assert proposer.propose(root, GenConfig(8), None)[0].tokens.tolist() == \
            [root] + full[:kept], rate
        gen = GenConfig(max_new_tokens=40)
        got = generate_spec(target, proposer, prompt, gen)
        assert got.token_ids == generate_ar(target, prompt, gen).token_ids, rate
    assert 0 < kept < 4, "the middle price cut nothing, or everything"


def test_block_training_rows_see_what_the_masks_see_at_inference():
    """training.block_batch: each block of masks after anchor a computes, in the one training
    forward, what a block head computes after a root at a (the same rows seen, positions and
    taps), and learns the target's greedy tokens at a + 1, a + 2, ...; the rows keep theirs."""
    import features
    import training
    target = target_for_head()                         # make_batch's float32
    head = random_block_head(target)
    g = torch.Generator().manual_seed(3)
    seqs = [features.Seq(torch.randint(1, V, (n,), generator=g),
                         torch.randn(n - 1, 4 * C, generator=g), p)
            for n, p in [(17, 5), (12, 3), (9, 8)]]
    b = training.eagle3_batch(features.make_batch(seqs), C)
    k, L = 4, b.loss_mask.shape[1]
    feats, tokens, want_target, loss, pos, seen = training.block_batch(b, k, MASK)
    with torch.no_grad():
        out = training.block_forward(head, target.embed, feats, tokens, pos, seen)
    blocks = 0
    for r, s in enumerate(seqs):
        assert torch.equal(loss[r, :L], b.loss_mask[r]), "the rows' own loss moved"
        for m in range(L, tokens.shape[1], k - 1):
            a = int(pos[r, m]) - 1                                         # the block's anchor
            if not loss[r, m]:
                continue
            blocks += 1
            rows = torch.cat([b.feats[r, :a + 1], b.feats[r, a:a + 1].expand(k - 1, -1)])
            ids = torch.cat([b.next_tok[r, :a + 1], torch.full((k - 1,), MASK)])
            with torch.no_grad():
                alone = head(rows[None], target.embed(ids)[None], torch.arange(a + k)[None],
                             head.new_cache(64))[0, a + 1:]                       # (k - 1, C)
            valid = loss[r, m:m + k - 1]
            assert torch.allclose(out[r, m:m + k - 1][valid], alone[valid], atol=1e-5), (r, a)
            assert valid.tolist() == [bool(b.loss_mask[r, a + 1 + j]) if a + 1 + j < L else
                                      False for j in range(k - 1)], "a mask past the end"
            v = int(valid.sum())
            assert torch.equal(want_target[r, m:m + v], b.target[r, a + 1:a + 1 + v])
    assert blocks >= 4, f"only {blocks} blocks of masks drawn"


def test_a_block_head_trains_saves_and_drafts_under_method_block(tmp_path):
    """train_heads.py --method eagle3 --parallel 3's parts on a tiny target: the masks'
    cross-entropy falls, the saved folder names its block and mask token, only --method block
    takes it (folder_kind), and it drafts plain decoding's tokens there, in one forward a step."""
    from types import SimpleNamespace
    import features
    import train_heads as th
    import training
    from methods import build_head, folder_kind, head_folder, method_config
    from test_heads import TinyTokenizer
    torch.manual_seed(0)
    target = tiny_model(3, num_layers=8).float().requires_grad_(False)
    rows = [(f"q{i} {'ab' * (i % 5)}", None) for i in range(40)]
    features.extract_features(target, TinyTokenizer(), rows, str(tmp_path / "f"), 8, 24, 64,
                              [2, 4, 5, 8])
    seqs = features.load_features(str(tmp_path / "f"))
    C = target.config.hidden_size
    args = SimpleNamespace(out=str(tmp_path / "o"), draft_vocab=40, method="eagle3", heads=3)
    head, config = th.new_head(args, target, seqs, (0,))
    proj = th.projection_rows(target, head.vocab_ids)
    loss = lambda s: training.block_loss(head, target.embed, proj, training.eagle3_batch(  # noqa
        features.make_batch(s), C), 3, 60)
    record = training.train(head, loss, seqs, training.TrainConfig(epochs=12, tokens_per_batch=256,
                                                                    lr=3e-3), str(tmp_path / "t"))
    masks = [r[1] for r in record["losses"]]
    assert sum(masks[-5:]) < sum(masks[:5]) - 2.0, f"masks' ce {masks[:5]} -> {masks[-5:]}"
    config.block, config.mask_token = 3, 60
    config.accuracy = [[0.6], [0.2], [0.05]]     # by place, as training measures it: auto's prices
    th.save_head(head.eval(), config, str(tmp_path / "h"))
    assert folder_kind(str(tmp_path / "h")) == "block"
    assert head_folder([str(tmp_path / "h")], "eagle")[1] != "block", "eagle2 took a block head"
    from costs import Priced
    prompt = seqs[0].tokens[:seqs[0].prompt_len].tolist()           # a prompt it learned
    assert method_config("block").tree_size == "auto"              # the default: the chain cut
    for size, cut in ((0, False), ("auto", True)):
        mc = method_config("block", tree_size=size, heads=(str(tmp_path / "h"),))
        proposer, sizer, _ = build_head(mc, target, 256)
        assert proposer.mask_id == 60 and proposer.max_nodes == 4     # the default block of 3
        assert (proposer.config.rule is not None) == cut and (sizer is not None) == cut
        calls = []
        proposer.head.register_forward_hook(lambda *a: calls.append(1))  # noqa: B023
        out = generate_spec(target, Priced(proposer, sizer) if cut else proposer, prompt,
                            GenConfig(20))
        assert out.token_ids == generate_ar(target, prompt, GenConfig(20)).token_ids
        assert sum(out.accepted) > 0 and len(calls) == out.target_forwards - 1, size
    saved = json.loads((tmp_path / "h" / "config.json").read_text())
    (tmp_path / "h" / "config.json").write_text(json.dumps(saved | {"mask_token": 99999}))
    with pytest.raises(LoadError, match="mask_token 99999 is no token id of the target's"):
        build_head(method_config("block", heads=(str(tmp_path / "h"),)), target, 256)
