"""Tests of the feature-reading heads (EAGLE, EAGLE-2, Medusa): losslessness, the head's tree
cache against per-path runs, static trees against brute force, files, and training."""
import itertools
import json
import re
import os
from types import SimpleNamespace

import pytest
import torch

import features
import training

from checkpoint import load_head, load_model
from heads import EagleHead, HeadConfig, MedusaHeads, best_paths, eagle_layer_config
from model import LoadError
from proposers import DraftConfig, DraftModelProposer, EagleProposer, MedusaProposer
from decode import GenConfig, acceptance_by_position, generate_ar, generate_spec
from test_spec import default_path, tiny_model  # noqa: F401 (default_path is a fixture)
from train_heads import save_head
from tree import static_tree


def random_eagle(target, seed=0, vocab=None) -> EagleHead:
    torch.manual_seed(seed)
    V = target.config.vocab_size
    ids = torch.arange(V) if vocab is None else torch.randperm(V)[:vocab].sort().values
    head = EagleHead(target.config.__class__(**eagle_layer_config(target.config)), ids)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)
    return head.to(torch.float64).eval()


def random_medusa(target, heads=3, seed=0) -> MedusaHeads:
    torch.manual_seed(seed)
    m = MedusaHeads(target.config.hidden_size, heads, torch.arange(target.config.vocab_size))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    return m.to(torch.float64).eval()


PATHS = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0]]


def deepest(tree) -> int:
    """A tree's depth from its parents alone (parents come before children)."""
    depth = [0] * tree.size
    for i, p in enumerate(tree.parents.tolist()):
        depth[i] = depth[p] + 1 if p >= 0 else 0
    return max(depth)


@pytest.mark.parametrize("kind", ["eagle2", "eagle2_reduced_vocab", "eagle", "medusa"])
def test_greedy_with_random_heads_equals_plain_greedy(kind):
    gen = GenConfig(max_new_tokens=40)
    for seed in range(3):
        target = tiny_model(seed)
        if kind == "medusa":
            proposer = MedusaProposer(target, random_medusa(target, 3, seed), static_tree(PATHS))
        else:
            head = random_eagle(target, seed, vocab=40 if "reduced" in kind else None)
            static = static_tree(PATHS) if kind == "eagle" else None
            proposer = EagleProposer(target, head, DraftConfig(4, 3, 8), 256, static)
        for prompt in ([1, 2, 3], [7], [11, 5, 9, 30, 2, 8]):
            plain = generate_ar(target, prompt, gen).token_ids
            trees = []
            spec = generate_spec(target, proposer, prompt, gen,
                                 on_step=lambda tree, path, bonus: trees.append(tree))
            assert spec.token_ids == plain, f"{kind}, seed {seed}, prompt {prompt}"
            assert max(spec.drafted) == proposer.max_nodes - 1
            assert spec.depths == [deepest(t) for t in trees]
            assert len(acceptance_by_position(spec)) == max(spec.depths), "positions drafted"


def test_int8_drafts_use_the_quantized_weights_and_stay_lossless():
    """--draft-int8: every Linear of an EAGLE or Medusa head and the proposer's projection run
    torch's int8 kernel on per-row-quantized weights (float32 here: the kernel accepts
    it too; --draft-int8 uses it only in bfloat16, where it is fast); greedy output still equals plain decoding."""
    from heads import projection
    from quantize import Int8Linear, convert, quantize
    w = torch.nn.Linear(32, 48)
    layer = Int8Linear.of(w)
    deq = layer.q.float() * layer.scales[:, None]
    assert layer.q.dtype == torch.int8
    assert (w.weight - deq).abs().le(layer.scales[:, None] / 2 + 1e-7).all()
    gen, accepted = GenConfig(max_new_tokens=40), 0
    for seed in range(2):
        target = tiny_model(seed).float()
        head = quantize(random_eagle(target, seed).float(), "int8")
        linears = [m for m in head.modules() if isinstance(m, Int8Linear)]
        assert linears and not any(isinstance(m, torch.nn.Linear) for m in head.modules())
        x = torch.randn(3, linears[0].q.shape[1])
        deq = linears[0].q.float() * linears[0].scales[:, None]
        assert torch.allclose(linears[0](x), x @ deq.T + linears[0].bias, atol=1e-4)
        proj = convert(projection(target, head.vocab_ids), "int8", "projection")
        proposer = EagleProposer(target, head, DraftConfig(4, 3, 8), 256, proj=proj)
        feats = torch.randn(2, target.config.hidden_size)
        pq, ps = proj.q, proj.scales
        assert torch.allclose(proposer.logp(feats),
                              torch.log_softmax(feats @ (pq.float() * ps[:, None]).T, -1), atol=1e-4)
        medusa = quantize(random_medusa(target, 3, seed).float(), "int8")
        assert all(isinstance(b, Int8Linear) for b in medusa.blocks)
        drafter = MedusaProposer(target, medusa, static_tree(PATHS), proj)
        h = torch.randn(target.config.hidden_size)
        blocks = torch.stack([h + torch.nn.functional.silu(
            h @ (b.q.float() * b.scales[:, None]).T + b.bias) for b in medusa.blocks])
        assert torch.allclose(drafter.proj(medusa(h)),
                              blocks @ (pq.float() * ps[:, None]).T, atol=1e-3), \
            "Medusa drafts through the int8 blocks and projection"
        for prompt in ([1, 2, 3], [11, 5, 9, 30, 2, 8]):
            for p in (proposer, drafter):
                spec = generate_spec(target, p, prompt, gen)
                assert spec.token_ids == generate_ar(target, prompt, gen).token_ids
                accepted += sum(spec.accepted)
    assert accepted > 0, "some int8 drafts were accepted, so accepted paths were checked too"


@pytest.mark.parametrize("static", [False, True])
def test_eagle_tree_features_equal_each_path_fed_alone(static):
    """Every tree node's predicted feature equals feeding its path one entry at a time into a
    fresh head cache: the tree mask in the head's own cache is right."""
    target, head = tiny_model(1), random_eagle(tiny_model(1), 3)
    proposer = EagleProposer(target, head, DraftConfig(4, 3, 10), 256,
                             static_tree(PATHS) if static else None)
    prompt = [3, 14, 15, 9, 2]
    logits, hidden = target(torch.tensor([prompt]), torch.arange(5)[None], target.new_cache(1, 64))
    root = int(logits[0, -1].argmax())
    proposer.start(prompt, hidden[0])
    seen = []
    expand = proposer.expand
    proposer.expand = lambda frontier, tree: seen.append(tree) or expand(frontier, tree)
    proposer.propose(root, GenConfig(), None)
    grown, grown_out = seen[-1], proposer.node_out     # the last tree expanded holds all fed nodes
    # rebuild the full grown tree's shape from what was fed (node_slot >= 0 marks fed nodes)
    fed = (proposer.node_slot >= 0).nonzero().squeeze(1)
    assert len(fed) > 4, "the tree should have several fed nodes"
    for node in fed.tolist():
        path = []
        j = node
        while j != 0:
            path.append(j)
            j = int(grown.parents[j])
        cache = head.new_cache(64)
        feats = torch.cat([hidden[0]])
        tok = torch.tensor(prompt[1:] + [root])
        out = head(feats[None], target.embed(tok)[None], torch.arange(5)[None], cache)[0, -1]
        for d, j in enumerate(reversed(path), 1):
            t = grown.tokens[j]
            out = head(out[None, None], target.embed(t.view(1, 1)), torch.tensor([[4 + d]]),
                       cache)[0, -1]
        assert torch.allclose(out, grown_out[node], rtol=0, atol=1e-10), f"node {node}, path {path} {(out - grown_out[node]).abs().max()}"


def test_best_paths_equal_brute_force():
    torch.manual_seed(0)
    acc = [sorted(torch.rand(3).tolist(), reverse=True) for _ in range(3)]
    universe = [p for n in (1, 2, 3) for p in itertools.product(range(3), repeat=n)]

    def value(paths):
        return sum(torch.tensor([acc[d][r] for d, r in enumerate(p)]).prod().item() for p in paths)

    for size in (1, 3, 5):
        closed = [s for s in itertools.combinations(universe, size)
                  if all(p[:-1] in s or len(p) == 1 for p in s)]
        best = max(value(s) for s in closed)
        got = best_paths(acc, size)
        assert len(got) == size and all(p[:-1] in got or len(p) == 1 for p in got)
        assert abs(value(got) - best) < 1e-9, f"size {size}: {value(got)} < optimum {best}"


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_head_save_load_round_trip_and_bad_config(tmp_path, kind):
    target = tiny_model(2)
    head = random_eagle(target) if kind == "eagle" else random_medusa(target)
    config = HeadConfig(kind, target.config.hidden_size, target.config.vocab_size,
                        len(head.vocab_ids), 3, eagle_layer_config(target.config) if kind == "eagle" else {})
    head = head.to(torch.bfloat16).to(torch.float64)        # what a 16-bit file can hold
    save_head(head, config, str(tmp_path / "h"), {"steps": 1})
    loaded, _ = load_head(str(tmp_path / "h"), target, kind)
    for (name, a), b in zip(head.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    other = kind == "eagle" and "medusa" or "eagle"
    with pytest.raises(LoadError, match=f"holds a {kind} head"):
        load_head(str(tmp_path / "h"), target, other)
    with pytest.raises(LoadError, match="hidden size"):
        load_head(str(tmp_path / "h"), tiny_model(0, hidden_size=16, num_heads=2,
                                                   num_kv_heads=1), kind)
    with pytest.raises(LoadError, match="no config.json"):
        load_head(str(tmp_path), target, kind)
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    cfg["draft_vocab"] = 7
    cfg["num_heads"] = 5
    cfg["layer"] = {**cfg["layer"], "intermediate_size": 8} if kind == "eagle" else {}
    (tmp_path / "h" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoadError, match="model.safetensors: (size mismatch|no tensor)"):
        load_head(str(tmp_path / "h"), target, kind)


# ---------------------------------------------------------------- training

class TinyTokenizer:
    """Enough of tokenizer.Tokenizer for feature extraction on a tiny model."""
    stop_ids = (0,)

    def chat_prompt(self, text):
        return [5] + [1 + ord(c) % 50 for c in text]

    def encode(self, text):
        return [1 + ord(c) % 50 for c in text]


def test_batched_greedy_equals_plain_greedy_per_prompt():
    import train_heads as th
    target = tiny_model(4)
    prompts = [[1, 2, 3], [7], [11, 5, 9, 30, 2, 8], [4, 4]]
    for (tokens, hidden), p in zip(features.batched_greedy(target, prompts, 12, (0,)), prompts):
        plain = generate_ar(target, p, GenConfig(12), (0,)).token_ids
        assert tokens == p + plain, f"prompt {p}"
        full = target(torch.tensor([tokens[:-1]]), torch.arange(len(tokens) - 1)[None],
                      target.new_cache(1, 64))[1][0]
        assert torch.allclose(hidden, full, atol=1e-9), "features must equal a full forward's"


def test_training_code_makes_its_tensors_on_the_targets_device(tmp_path):
    # No GPU here, so the default device "meta" stands in for one: a tensor made without naming
    # its device lands there, and the first operation that mixes it with the (CPU) target's
    # fails, as a CPU tensor would beside CUDA ones. Every number must equal the plain run's.
    import train_heads as th
    from heads import build_head, projection_rows
    from train_heads import init_draft
    torch.manual_seed(0)
    target = tiny_model(3).float().requires_grad_(False)
    prompts = [[1, 2, 3], [7], [11, 5, 9, 30, 2, 8], [4, 4]]
    rows = [(f"q{i} {'ab' * (i % 5)}", None) for i in range(12)]
    features.extract_features(target, TinyTokenizer(), rows, str(tmp_path / "f"), 4, 8, 64)
    seqs = features.load_features(str(tmp_path / "f"))[:4]
    vocab, c = features.draft_vocabulary(seqs, 40, (0,)), target.config
    heads = {kind: build_head(HeadConfig(kind, c.hidden_size, c.vocab_size, len(vocab), 3,
                                         eagle_layer_config(c) if kind == "eagle" else {}), vocab)
             for kind in ("eagle", "medusa")}
    proj, draft = projection_rows(target, vocab), init_draft(target, 1)

    def everything():
        answers = features.batched_greedy(target, prompts, 6, (0,))
        forced = features.teacher_forced(target, [tokens for tokens, _ in answers])
        b = features.make_batch(seqs).to("cpu")
        losses = [training.eagle_loss(heads["eagle"], target.embed, proj, b, 3, 0.1)[0],
                  training.medusa_loss(heads["medusa"], proj, b)[0], training.draft_loss(draft, seqs)[0]]
        sum(losses).backward()
        accuracy = [training.accuracy_table(target, h, kind, seqs, 3, 4) for kind, h in heads.items()]
        return answers, forced, [float(x.detach()) for x in losses], accuracy
    plain = everything()
    with torch.device("meta"):
        elsewhere = everything()
    assert [t for t, _ in plain[0]] == [t for t, _ in elsewhere[0]]
    assert all(torch.equal(a, b) for a, b in zip(plain[1], elsewhere[1]))
    assert plain[2:] == elsewhere[2:]


def test_tau_prompts_0_measures_nothing_rather_than_a_tau_of_0():
    # --tau-prompts 0 skips the decoding loop (the GPU kit keeps it out of its one call);
    # training.json must then say nothing was measured, not that tau was 0
    import train_heads as th
    from heads import build_head
    target = tiny_model(3)
    vocab, c = torch.arange(20), target.config
    config = HeadConfig("eagle", c.hidden_size, c.vocab_size, 20, 3, eagle_layer_config(c))
    head = build_head(config, vocab).double()
    held = [features.Seq(torch.tensor([1, 2, 3, 4]), torch.zeros(3, c.hidden_size), 2)]
    args = SimpleNamespace(tau_prompts=0, method="eagle")
    assert training.held_out_tau(args, target, head, config, held, TinyTokenizer()) == {}
    args.tau_prompts = 1
    assert set(training.held_out_tau(args, target, head, config, held, TinyTokenizer())) == \
        {"eagle2_d5_k4_16", "chain_5"}


def test_training_smoke_loss_falls_and_saved_head_decodes_the_same(tmp_path):
    import train_heads as th
    from heads import build_head, projection_rows
    torch.manual_seed(0)
    target = tiny_model(3).float().requires_grad_(False)
    rows = [(f"q{i} {'ab' * (i % 5)}", None) for i in range(40)]
    features.extract_features(target, TinyTokenizer(), rows, str(tmp_path / "f"), 8, 24, 64)
    seqs = features.load_features(str(tmp_path / "f"))
    assert len(seqs) == 40 and all(len(s.hidden) == len(s.tokens) - 1 for s in seqs)
    for method in ("eagle", "medusa"):
        vocab = features.draft_vocabulary(seqs, 40, (0,))
        c = target.config
        config = HeadConfig(method, c.hidden_size, c.vocab_size, len(vocab), 3,
                            eagle_layer_config(c) if method == "eagle" else {})
        head = build_head(config, vocab)
        proj = projection_rows(target, vocab)
        def loss_of(h):
            return ((lambda s: training.eagle_loss(h, target.embed, proj, features.make_batch(s), 3, 0.1))
                    if method == "eagle" else (lambda s: training.medusa_loss(h, proj, features.make_batch(s))))
        record = training.train(head, loss_of(head), seqs, training.TrainConfig(epochs=30, tokens_per_batch=256,
                                                                    lr=3e-3), str(tmp_path / method))
        first, last = record["losses"][:5], record["losses"][-5:]
        mean = lambda rows: sum(sum(r) / len(r) for r in rows) / len(rows)
        assert mean(last) < mean(first) - 0.4, f"{method}: loss {mean(first)} -> {mean(last)}"
        config.accuracy = training.accuracy_table(target, head, method, seqs[:8], 3, 4)
        save_head(head, config, str(tmp_path / f"{method}_out"), {"steps": record["step"]})

        # --init: training goes on from the saved head, not from a fresh one
        again, _ = th.init_head(SimpleNamespace(init=str(tmp_path / f"{method}_out"),
                                                method=method), target)
        assert all(p.requires_grad for p in again.parameters())
        more = training.train(again, loss_of(again), seqs[:8], training.TrainConfig(epochs=1, lr=1e-9,
                                                                        tokens_per_batch=256),
                        str(tmp_path / f"{method}_more"))
        assert mean(more["losses"][:1]) < mean(first) - 0.4, f"{method}: --init starts afresh"
        loaded, _ = load_head(str(tmp_path / f"{method}_out"), target, method)
        head = head.to(torch.bfloat16).float()           # the file holds 16-bit weights
        paths = best_paths(config.accuracy, 6)
        for h in (head, loaded):
            prop = (EagleProposer(target, h, DraftConfig(3, 2, 5), 256) if method == "eagle"
                    else MedusaProposer(target, h, static_tree(paths)))
            out = generate_spec(target, prop, [5, 9, 3], GenConfig(20)).token_ids
            if h is head:
                expect = out
        assert out == expect == generate_ar(target, [5, 9, 3], GenConfig(20)).token_ids


# ---------------------------------------------------------------- the benchmark

def test_bench_reads_both_formats_and_names_bad_lines(tmp_path):
    from bench import read_bench
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hi", "category": "a"}\n\n'
                 '{"question_id": 81, "category": "b", "turns": ["one", "two"]}\n')
    got = read_bench(str(f))
    assert [(p.id, p.category, p.turns) for p in got] == [("1", "a", ["hi"]), ("81", "b", ["one", "two"])]
    assert [p.id for p in read_bench(str(f), categories="b")] == ["81"]
    assert [p.id for p in read_bench(str(f), per_category=1, limit=1)] == ["1"]
    f.write_text('{"prompt": "hi"}\n{"turns": "not a list"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: expected a JSON object"):
        read_bench(str(f))
    f.write_text('{"prompt": "hi"}\n{oops\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2"):
        read_bench(str(f))


def test_bench_per_category_is_not_capped_by_the_default_limit(tmp_path):
    from spec import bench_config, parse_args
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    # 5 categories x 3 prompts: all 15 run unless --limit says otherwise
    bench = ["--bench", str(tmp_path / "p.jsonl"), "--categories", "a,b,c,d,e", "--per-category", "3"]
    assert bench_config(parse_args(bench)).limit == 0
    assert bench_config(parse_args(bench + ["--limit", "4"])).limit == 4
    assert bench_config(parse_args(["--bench", str(tmp_path / "p.jsonl")])).limit == 10


@pytest.mark.slow
def test_bench_end_to_end(default_path, tmp_path, monkeypatch, capfd):
    # (--compile's rows compile for a minute; the compiled decoder is tested on a tiny model;
    # --peers: transformers' decoders on the same prompts)
    import spec
    import transformers
    loads = []
    load = transformers.LlamaForCausalLM.from_pretrained
    monkeypatch.setattr(transformers.LlamaForCausalLM, "from_pretrained",
                        lambda folder, **kw: loads.append(folder) or load(folder, **kw))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Repeat: red green blue red green blue", "category": "a"}\n'
                       '{"question_id": 7, "category": "b", "turns": ["Name a fruit.", "Another."]}\n')
    out = tmp_path / "bench.json"
    spec.main(["--bench", str(prompts), "--methods", "ngram", "--max-new-tokens", "5",
               "--peers", "--json", str(out), "--temperature", "0,0.7", "--plot",
               str(tmp_path / "plots")])
    report = json.loads(out.read_text())
    err = capfd.readouterr().err
    assert f"plots written to {tmp_path / 'plots'}" in err
    assert "Loading weights" not in err and "[transformers]" not in err, "transformers' own lines"
    pictures = sorted(os.listdir(tmp_path / "plots"))
    assert pictures == ["acceptance.png", "tau_by_temperature.png", "verify_cost.png"]
    assert all((tmp_path / "plots" / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pictures)
    summary = report["runs"][0]["summary"]
    methods = ["ar", "ngram", "hf", "hf-ngram", "hf-assisted"]   # the baseline first, unasked
    assert list(summary["methods"]) == methods and set(summary["categories"]) == {"a", "b"}
    assert len(report["records"]) == 2 * 3 * len(methods)   # 2 temperatures x 3 turns, each
    assert summary["methods"]["ar"]["identical"] == [3, 3] and summary["methods"]["ar"]["tau"] == 1
    assert all(summary["methods"][m]["tau"] >= 1 for m in methods)
    assert summary["methods"]["hf-assisted"]["tau"] > 1, "the assistant's drafts were accepted"
    assert all(len(r["token_ids"]) <= 5 for r in report["records"])
    assert len(loads) == 1 + 2, "the target loaded once for every peer and temperature"


def test_bench_table_arithmetic_on_a_synthetic_run():
    from bench import Record, format_tables, format_temperatures, summarize
    R = Record
    records = [R("ar", "1", "x", 0, [1, 2, 3, 4], 4, 2.0), R("ar", "2", "y", 0, [5, 6], 2, 1.0),
               R("e", "1", "x", 0, [1, 2, 3, 4], 2, 0.5, [2, 1]),
               R("e", "2", "y", 0, [5, 7], 1, 1.0, [1])]
    s = summarize(records, ["ar", "e"], {"e": 5.0}, 100.0, {"e": "chain of 2"})
    e = s["methods"]["e"]
    assert e["tau"] == 6 / 3 and e["tokens_per_s"] == 6 / 1.5
    assert e["speedup"] == (6 / 1.5) / (6 / 3.0)
    assert e["memory_pct"] == 5.0 and e["identical"] == [1, 2]
    assert e["acceptance_by_position"] == [1.0, 1 / 3]
    drafted = [R("e", "1", "x", 0, [1, 2, 3, 4], 2, 0.5, [2, 1], 0.0, {}, [3, 2]),
               R("e", "2", "y", 0, [5, 7], 1, 1.0, [1], 0.0, {}, [2])]
    by_position = summarize(records[:2] + drafted, ["ar", "e"], {}, 100.0)["methods"]["e"]
    assert by_position["acceptance_by_position"] == [1.0, 1 / 3, 0.0], "every position drafted"
    fast = [R("ar+compile", "1", "x", 0, [1, 2, 9], 3, 1.0),       # not eager ar's bits
            R("e+compile", "1", "x", 0, [1, 2, 9], 2, 0.5)]
    both = summarize(records + fast, ["ar", "e", "ar+compile", "e+compile"], {}, 100.0)["methods"]
    assert both["e+compile"]["identical"] == [1, 1] and both["e"]["identical"] == [1, 2], \
        "a compiled method is held against compiled plain decoding"
    assert s["categories"]["x"]["e"] == {"tau": 2.0, "speedup": (4 / 0.5) / (4 / 2.0)}
    assert s["categories"]["y"]["e"]["speedup"] == 1.0
    text = format_tables(s, ["ar", "e"])
    row = "e" + " " * 20 + "chain of 2" + " " * 20 + "2.00      4.0    2.00x     5.0   5.0%     1/2"
    assert row in text, text
    long = summarize(records, ["ar", "e"], {"e": 5.0}, 100.0, {"e": "x" * 40})
    head, _, e_row = format_tables(long, ["ar", "e"]).splitlines()[:3]
    # tau is right-aligned under its heading, however long the label
    assert e_row.index("2.00") + 4 == head.index("tau") + 3, "a long label pushes its row along"
    runs = [{"temperature": 0.0, "summary": s}, {"temperature": 0.7, "summary": s}]
    assert "e" + " " * 26 + "2.00 2.00x" + " " * 6 + "2.00 2.00x" in format_temperatures(runs, ["e"])
    # the time per forward: 2 s over 3 forwards, 0.8 s of it drafting in 2 steps; base 0.5 s
    slow = records[:2] + [R("f", "1", "x", 0, [1, 2, 3, 4], 2, 1.5, [3], 0.0,
                            {"draft": 0.6, "forward": 0.8}),
                          R("f", "2", "y", 0, [5, 6], 1, 0.5, [1], 0.0, {"draft": 0.2})]
    f = summarize(slow, ["ar", "f"], {}, 100.0)["methods"]
    assert f["f"]["ms_per_forward"] == pytest.approx(2000 / 3)
    assert f["f"]["draft_ms_per_step"] == pytest.approx(400.0) and f["ar"]["draft_ms_per_step"] is None
    assert f["f"]["tau_for_2x"] == pytest.approx(2 * (2000 / 3) / 500)
    assert f["f"]["speedup"] == pytest.approx(f["f"]["tau"] * 500 / f["f"]["ms_per_forward"]), \
        "speedup must be tau times the baseline's ms per forward over the method's"
    text = format_tables(summarize(slow, ["ar", "f"], {}, 100.0), ["ar", "f"])
    assert "f" + " " * 20 + "   666.7        2.67    400.0      0.0    400.0      0.0" in text, text
    assert "ar" + " " * 19 + "   500.0        2.00" + "        -" * 6 in text, text


# ---------------------------------------------------------------- the shipped weights

@pytest.fixture(scope="module")
def default_target():
    """The default model in its default configuration (int4, bf16): what users run."""
    from methods import TargetConfig, load_target
    _, target, tokenizer = load_target(TargetConfig())
    return target, tokenizer


def test_training_time_test_unroll_equals_drafting_at_inference():
    """Step j of the training unroll at entry i equals what drafting does at inference: the true
    entries up to the root i - j in the head's cache, then j entries fed with the head's own
    predicted features (ttt_mask and the feature shift are right)."""
    import train_heads as th
    target = tiny_model(6)
    head = random_eagle(target, 2)
    tokens = torch.tensor([3, 17, 4, 40, 9, 21, 8, 33, 12, 5])
    hidden = target(tokens[None], torch.arange(10)[None], target.new_cache(1, 16))[1][0]
    b = features.make_batch([features.Seq(tokens, hidden[:-1], 2)])
    b.feats = hidden[None, :-1].detach()                   # float64, not make_batch's float32
    outs = training.eagle_unroll(head, target.embed, b, 4)
    for j in range(4):
        for i in range(j, 9):
            root = i - j
            cache = head.new_cache(16)
            out = head(hidden[None, :root + 1], target.embed(tokens[1:root + 2])[None],
                       torch.arange(root + 1)[None], cache)[0, -1]
            for m in range(1, j + 1):
                out = head(out[None, None], target.embed(tokens[root + m + 1]).view(1, 1, -1),
                           torch.tensor([[root + m]]), cache)[0, -1]
            assert torch.allclose(out, outs[j][0, i], rtol=0, atol=1e-10), f"step {j}, entry {i}"


def test_show_tree_renders_a_known_tree():
    from tree import make_tree, render_tree
    tree = make_tree([10, 11, 12, 13, 14], [-1, 0, 0, 1, 1],
                     torch.tensor([0.0, -0.1, -2.0, -0.5, -3.0]))
    text = render_tree(tree, lambda t: chr(ord("a") + t - 10), [0, 1, 3], 15)
    assert text == ("'a' (root)\n"
                    "|-- 'b' 0.90 *\n"
                    "|   |-- 'd' 0.61 *  -> 'f'\n"
                    "|   `-- 'e' 0.05\n"
                    "`-- 'c' 0.14"), text
    nothing = render_tree(tree, lambda t: chr(ord("a") + t - 10), [0], 15)
    assert nothing.endswith("nothing accepted  -> 'f'") and "*" not in nothing
    root_alone = make_tree([10], [-1], torch.zeros(1))
    assert render_tree(root_alone, lambda t: "a", [0], 15) == "'a' (root)\nnothing drafted  -> 'a'"
    cut = render_tree(tree, lambda t: chr(ord("a") + t - 10), [0, 1], None)
    assert "'b' 0.90 *\n" in cut and "->" not in cut, "decoding stopped before the target's token"


def test_show_tree_draws_the_tokens_taken_and_no_more():
    # a step whose accepted chunk crosses --max-new-tokens (or an end of turn): the drawing
    # marks only what was returned, and no target token after the cut
    target = tiny_model(5)
    steps, first = [], generate_ar(target, [1, 2, 3], GenConfig(1)).token_ids
    for limit in (7, 8, 9):
        out = generate_spec(target, DraftModelProposer(target, 4, 256), [1, 2, 3],
                            GenConfig(limit), on_step=lambda *a: steps.append(a))
        drawn = [t for tree, accepted, bonus in steps
                 for t in tree.tokens[accepted[1:]].tolist() + ([] if bonus is None else [bonus])]
        assert first + drawn == out.token_ids, limit
        steps.clear()


def test_training_data_reads_both_formats_and_names_bad_lines(tmp_path):
    import train_heads as th
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "hi"}\n{"messages": [{"role": "user", "content": "q"}, '
                 '{"role": "assistant", "content": "a"}]}\n')
    assert features.read_conversations(str(f)) == [("hi", None), ("q", "a")]
    f.write_text('{"prompt": "hi"}\n{"messages": [{"role": "user", "content": "q"}]}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:2: expected 'prompt' or 'messages'"):
        features.read_conversations(str(f))
    f.write_text('{"prompt": "hi"}\n\n{broken\n')
    with pytest.raises(ValueError, match=r"d.jsonl:3: not JSON"):
        features.read_conversations(str(f))
    with pytest.raises(FileNotFoundError, match=r"JSONL file not found: .*missing.jsonl"):
        features.read_conversations(str(tmp_path / "missing.jsonl"))


def test_training_flags_out_of_range_fail_before_any_loading(capsys):
    import train_heads as th
    base = ["--method", "eagle", "--data", "d.jsonl", "--out", "o"]
    with pytest.raises(SystemExit):
        th.parse_args(base + ["--epochs", "0"])         # used to run one step regardless
    assert "--epochs must be > 0, got 0.0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        th.parse_args(base + ["--held-out", "-1"])
    assert "--held-out must be >= 0, got -1" in capsys.readouterr().err
    assert th.parse_args(base + ["--minutes", "0"]).minutes == 0     # 0: no limit, allowed
    # --init is read before any data is: a wrong folder used to surface after the features
    from default_model import WEIGHTS
    for init, message in (("/nonexistent", "/nonexistent: no such folder"),
                          (f"{WEIGHTS}/smollm2-135m-medusa", "holds medusa heads; --method eagle"),
                          (f"{WEIGHTS}/smollm2-135m-draft", "not a head config")):
        with pytest.raises(SystemExit) as e:
            th.main(["--method", "eagle", "--data", "/nonexistent.jsonl", "--out", "o",
                     "--init", init])
        assert e.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(ValueError, match="no feature shards; run with --stage features first"):
        features.load_features("/nonexistent")                    # not an OSError from os.listdir


def test_draft_over_a_reduced_vocabulary_drafts_its_best_token_and_stays_lossless(tmp_path):
    from methods import load_draft_vocab
    from train_heads import save_draft
    from test_spec import hf_checkpoint
    target, draft = tiny_model(3), tiny_model(4, num_layers=1)
    V = target.config.vocab_size
    vocab = torch.randperm(V, generator=torch.Generator().manual_seed(1))[:V // 3].sort().values
    prompt, root = [5, 9, 3], 11
    chain_of = DraftModelProposer(draft, 4, 256, vocab)
    chain_of.start(prompt)
    tree, q = chain_of.propose(root, GenConfig(8), None)
    ids = prompt + [root]                    # oracle: full forwards, argmax over the kept rows
    for _ in range(4):
        logits = draft(torch.tensor([ids]), torch.arange(len(ids))[None], draft.new_cache(1, 32))[0]
        ids.append(int(vocab[logits[0, -1, vocab].argmax()]))
    assert q is None and tree.tokens.tolist() == ids[len(prompt):]
    for depth in (4, 2):
        proposer = DraftModelProposer(draft, depth, 256, vocab)
        out = generate_spec(target, proposer, prompt, GenConfig(24))
        assert out.token_ids == generate_ar(target, prompt, GenConfig(24)).token_ids
    sampled = DraftModelProposer(draft, 3, 256, vocab)    # draws from all V
    sampled.start(prompt)
    _, q = sampled.propose(root, GenConfig(8, temperature=1.0), torch.Generator().manual_seed(0))
    assert q.shape == (3, V)

    hf_checkpoint(tmp_path / "target", tie_word_embeddings=True)
    save_draft(draft.float(), str(tmp_path / "target"), str(tmp_path / "d"), vocab_ids=vocab)
    assert torch.equal(load_draft_vocab(str(tmp_path / "d"), V), vocab)
    assert load_draft_vocab(str(tmp_path / "target"), V) is None
    (tmp_path / "d" / "draft_vocab.json").write_text(f"[1, 2, {V}]")
    with pytest.raises(LoadError, match="below the vocabulary size"):
        load_draft_vocab(str(tmp_path / "d"), V)
    (tmp_path / "d" / "draft_vocab.json").write_text("[1, 2,")             # cut off mid-write
    with pytest.raises(LoadError, match="draft_vocab.json is not valid JSON"):
        load_draft_vocab(str(tmp_path / "d"), V)


def test_sources_filter_lines_and_templates_rewrite_prompts(tmp_path):
    import train_heads as th
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"source": "nq", "prompt": "who wrote it?"},
        {"source": "math", "prompt": "2 + 2?"},
        {"source": "nq", "messages": [{"role": "user", "content": "when?"},
                                      {"role": "assistant", "content": "1999"}]},
        {"prompt": "no source"}]) + "\n")
    assert features.read_conversations(str(path), ("nq",)) == [("who wrote it?", None), ("when?", "1999")]
    assert len(features.read_conversations(str(path))) == 4
    with pytest.raises(ValueError, match="no training lines from sources qa"):
        features.read_conversations(str(path), ("qa",))
    rows = [(f"question {i}?", "an answer") for i in range(40)]
    templates = ["Explain: {prompt}", "{prompt} In detail."]
    out = features.templated_prompts(rows, templates, seed=1)
    assert all(a is None for _, a in out), "the target writes the answers"
    assert all(p in (f"Explain: question {i}?", f"question {i}? In detail.")
               for i, (p, _) in enumerate(out))
    assert {p.startswith("Explain") for p, _ in out} == {True, False}, "both templates drawn"
    assert features.templated_prompts(rows, templates, seed=1) == out
    assert features.templated_prompts(rows, templates, seed=2) != out
    with pytest.raises(ValueError, match="must contain {prompt}"):
        features.templated_prompts(rows, ["Explain:"], seed=0)


@pytest.mark.parametrize("kind", ["eagle2", "medusa"])
def test_sampling_with_heads_runs_through_tree_verification_and_is_seeded(kind):
    target = tiny_model(7)
    if kind == "medusa":
        proposer = MedusaProposer(target, random_medusa(target, 3, 7), static_tree(PATHS))
    else:
        proposer = EagleProposer(target, random_eagle(target, 7), DraftConfig(3, 3, 6), 256)
    gen = GenConfig(max_new_tokens=30, temperature=0.9, seed=3)
    a = generate_spec(target, proposer, [1, 2, 3], gen).token_ids
    b = generate_spec(target, proposer, [1, 2, 3], gen).token_ids
    c = generate_spec(target, proposer, [1, 2, 3], GenConfig(30, 0.9, seed=4)).token_ids
    assert a == b and len(a) == 30, "same seed, same sample"
    assert a != c, "another seed should give another sample"


# ---------------------------------------------------------------- the distilled draft model

@pytest.mark.parametrize("case", ["attention_bias", "gqa_untied"])
def test_hf_names_round_trip_to_the_checkpoint(tmp_path, case):
    from safetensors.torch import load_file
    from checkpoint import load_model, to_hf_names
    from test_spec import HF_CASES, hf_checkpoint
    hf_checkpoint(tmp_path, **HF_CASES[case])
    ours = load_model(str(tmp_path), torch.float64)
    saved = load_file(str(tmp_path / "model.safetensors"))
    back = to_hf_names(ours.state_dict(), ours.config)
    assert set(back) == set(saved)
    for name, t in saved.items():
        assert torch.equal(back[name].float(), t.float()), name


MASK = 60                                    # the tiny models' mask token (their last id)


def test_a_parallel_draft_drafts_its_block_in_one_forward_and_stays_lossless():
    target, draft = tiny_model(3), tiny_model(4, num_layers=1)
    V = target.config.vocab_size
    vocab = torch.randperm(V, generator=torch.Generator().manual_seed(1))[:V // 3].sort().values
    prompt, root = [5, 9, 3], 11
    ids = torch.tensor([prompt + [root] + [MASK] * 3])       # oracle: one causal forward
    logits = draft(ids, torch.arange(7)[None], draft.new_cache(1, 32))[0][0, -4:]   # (4, V)
    calls = []
    draft.register_forward_hook(lambda *a: calls.append(1))
    for ids_, want in [(None, logits.argmax(-1)), (vocab, vocab[logits[:, vocab].argmax(-1)])]:
        proposer = DraftModelProposer(draft, 4, 256, ids_, mask_id=MASK)
        proposer.start(prompt)
        calls.clear()
        tree, q = proposer.propose(root, GenConfig(8), None)
        assert tree.tokens.tolist() == [root] + want.tolist() and q is None
        assert len(calls) == 1, f"{len(calls)} draft forwards for a block of 4"
        assert proposer.cache.length == 4, "the masks' entries stayed in the draft's cache"
    sampled = DraftModelProposer(draft, 4, 256, vocab, mask_id=MASK)
    sampled.start(prompt)
    _, q = sampled.propose(root, GenConfig(8, temperature=0.7), torch.Generator().manual_seed(0))
    assert torch.allclose(q.double(), (logits / 0.7).softmax(-1), atol=1e-6), \
        "q is not what each token was drawn from"
    for depth, v in [(4, None), (2, vocab), (3, vocab)]:
        proposer = DraftModelProposer(draft, depth, 256, v, mask_id=MASK)
        out = generate_spec(target, proposer, prompt, GenConfig(30))
        assert out.token_ids == generate_ar(target, prompt, GenConfig(30)).token_ids, depth
    gen = GenConfig(30, temperature=0.8, top_p=0.9, seed=5)           # Leviathan's rule
    runs = [generate_spec(target, DraftModelProposer(draft, 3, 256, mask_id=MASK), prompt,
                          gen).token_ids for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 30


def test_pard_training_rows_see_what_the_masks_see_at_inference():
    # each training block of masks after anchor a must compute what a parallel draft computes
    # after a root at a: the same attention, positions and so the same features
    draft = tiny_model(4, num_layers=2)
    C = draft.config.hidden_size
    seqs = [features.Seq(torch.randint(1, 60, (n,), generator=torch.Generator().manual_seed(n)),
                         torch.randn(n - 1, C, dtype=torch.float64), p)
            for n, p in [(17, 5), (12, 3), (9, 8)]]
    k = 4
    tokens, positions, mask, feats, loss = training.pard_batch(seqs, k, MASK)
    hidden = training.draft_hidden(draft, tokens, positions, mask)          # (B, T, C)
    L = max(len(s.hidden) for s in seqs)
    blocks = 0
    for r, s in enumerate(seqs):
        n = len(s.hidden)
        assert loss[r, :L].sum() == n - s.prompt_len + 1, "the tokens' own loss rows moved"
        for m in range(L, tokens.shape[1], k - 1):
            a = int(positions[r, m]) - 1                                   # the block's anchor
            if not loss[r, m]:
                continue
            blocks += 1
            assert s.prompt_len - 1 <= a < n - 1, f"anchor {a} outside the answer"
            ids = torch.cat([s.tokens[:a + 1], torch.full((k - 1,), MASK)])[None]
            want = training.draft_hidden(draft, ids)[0, a + 1:]                # (k - 1, C)
            got = hidden[r, m:m + k - 1]
            rows = loss[r, m:m + k - 1]
            assert torch.allclose(got[rows], want[rows], atol=1e-10), (r, a)
            assert rows.tolist() == [a + 1 + j < n for j in range(k - 1)], "a mask past the end"
            v = int(rows.sum())               # mask j learns the target's feature at a + 1 + j
            assert torch.equal(feats[r, m:m + v], s.hidden[a + 1:a + 1 + v].float())
    assert blocks >= 4, f"only {blocks} blocks of masks drawn"


def test_a_folder_naming_a_mask_token_drafts_blocks_under_draft_and_chains_under_draft_chain(
        tmp_path, capsys):
    import shutil
    import spec
    from test_cli import TOKENIZER
    from test_spec import hf_checkpoint
    for name in ("target", "draft"):
        hf_checkpoint(tmp_path / name, vocab_size=49152)
        shutil.copy(TOKENIZER, tmp_path / name / "tokenizer.json")
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    (tmp_path / "draft" / "config.json").write_text(json.dumps(config | {"pard_token": 16}))
    runs = {}
    for method in ("ar", "draft", "draft-chain"):
        spec.main(["--model", str(tmp_path / "target"), "--method", method, "--raw", "--prompt",
                   "a b c", "--max-new-tokens", "12", "--json"] +
                  ["--draft", str(tmp_path / "draft")] * (method != "ar"))
        runs[method] = json.loads(capsys.readouterr().out)
    assert runs["draft"]["parallel"] and not runs["draft-chain"]["parallel"]
    from methods import PARALLEL_DEPTH
    assert runs["draft"]["drafted_per_step"] == PARALLEL_DEPTH
    assert runs["draft-chain"]["drafted_per_step"] == 1
    assert runs["draft"]["token_ids"] == runs["draft-chain"]["token_ids"] == runs["ar"]["token_ids"]
    (tmp_path / "draft" / "config.json").write_text(json.dumps(config))   # no mask token: a chain
    spec.main(["--model", str(tmp_path / "target"), "--method", "draft", "--raw", "--prompt",
               "a b c", "--max-new-tokens", "12", "--json", "--draft", str(tmp_path / "draft")])
    chain = json.loads(capsys.readouterr().out)
    assert not chain["parallel"] and chain["drafted_per_step"] == 1


def test_pard_training_teaches_the_masks_and_saves_the_mask_token(tmp_path):
    from methods import check_draft_folder
    from train_heads import init_draft, save_draft
    from test_spec import hf_checkpoint
    hf_checkpoint(tmp_path / "target", tie_word_embeddings=True)
    target = load_model(str(tmp_path / "target"), torch.float64).requires_grad_(False)
    with torch.no_grad():                    # peaky target: something for the draft to learn
        for p in target.layers.parameters():
            p.mul_(4.0) if p.dim() == 2 else None
    rows = [(f"q{i} {'ab' * (i % 5)}", None) for i in range(40)]
    features.extract_features(target, TinyTokenizer(), rows, str(tmp_path / "f"), 8, 24, 64)
    seqs = features.load_features(str(tmp_path / "f"))
    draft = init_draft(target.float(), 1)
    record = training.train(draft, lambda s: training.draft_loss(draft, s, 3, 96), seqs,
                            training.TrainConfig(epochs=10, tokens_per_batch=256, lr=3e-3),
                            str(tmp_path / "ck"))
    kl, masks = [r[0] for r in record["losses"]], [r[2] for r in record["losses"]]
    assert sum(kl[-5:]) < 0.7 * sum(kl[:5]), f"KL {kl[:5]} -> {kl[-5:]}"
    assert sum(masks[-5:]) > sum(masks[:5]), f"mask agreement {masks[:5]} -> {masks[-5:]}"
    save_draft(draft, str(tmp_path / "target"), str(tmp_path / "out"), pard_token=96)
    assert check_draft_folder(str(tmp_path / "out"), 97) == 96
    save_draft(draft, str(tmp_path / "target"), str(tmp_path / "chain"))
    assert check_draft_folder(str(tmp_path / "chain"), 97) is None


def test_distilled_draft_trains_and_saves_a_folder_transformers_loads(tmp_path):
    import copy
    import transformers
    import train_heads as th
    from export import export_draft
    from train_heads import init_draft, save_draft
    from checkpoint import load_model
    from proposers import DraftModelProposer
    from test_spec import hf_checkpoint
    hf_checkpoint(tmp_path / "target", tie_word_embeddings=True)
    target = load_model(str(tmp_path / "target"), torch.float64).requires_grad_(False)
    with torch.no_grad():                    # peaky target: something for the draft to learn
        for p in target.layers.parameters():  # (embeddings stay as on disk: the draft shares them)
            p.mul_(4.0) if p.dim() == 2 else None
    rows = [(f"q{i} {'ab' * (i % 5)}", None) for i in range(40)]
    features.extract_features(target, TinyTokenizer(), rows, str(tmp_path / "f"), 8, 24, 64)
    seqs = features.load_features(str(tmp_path / "f"))
    target = target.float()                  # what train_heads.py trains against
    draft = init_draft(target, 1)
    assert [n for n, p in draft.named_parameters() if p.requires_grad and "embed" in n] == []
    record = training.train(draft, lambda s: training.draft_loss(draft, s), seqs,
                      training.TrainConfig(epochs=20, tokens_per_batch=256, lr=3e-3), str(tmp_path / "ck"))
    kl = [r[0] for r in record["losses"]]
    assert sum(kl[-5:]) / 5 < 0.7 * sum(kl[:5]) / 5, f"KL {kl[:5]} -> {kl[-5:]}"

    save_draft(draft, str(tmp_path / "target"), str(tmp_path / "out"), {"steps": 1},
               embeddings=False)
    folder = str(tmp_path / "whole")             # for transformers: with the target's embedding
    export_draft(str(tmp_path / "out"), str(tmp_path / "target"), folder)
    ours = load_model(str(tmp_path / "out"), torch.float64, embeddings_from=str(tmp_path / "target"))
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    rounded = copy.deepcopy(draft).double()
    with torch.no_grad():                    # the file holds 16-bit weights; the embedding is
        for name, p in rounded.named_parameters():             # the target's own
            p.copy_(p if "embed" in name else p.bfloat16())
    ids = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = ours(ids, torch.arange(20)[None], ours.new_cache(1, 32))[0]
        want = rounded(ids, torch.arange(20)[None], rounded.new_cache(1, 32))[0]
        assert torch.allclose(got, hf(ids).logits, atol=1e-6), "transformers reads another model"
    assert torch.allclose(got, want, atol=1e-6), "the saved draft is not the trained one"
    target = target.double()
    prop = DraftModelProposer(ours, 3, 256)
    assert (generate_spec(target, prop, [5, 9, 3], GenConfig(20)).token_ids ==
            generate_ar(target, [5, 9, 3], GenConfig(20)).token_ids)


# ---------------------------------------------------------------- --tree-size auto

def test_expected_length_of_a_known_table():
    from heads import expected_length
    accuracy = [[0.5, 0.2], [0.6, 0.1]]
    # best 2 nodes: (0,) 0.5 and (0, 0) 0.3; the 3rd: (1,) 0.2 beats (0, 1) 0.05
    assert expected_length(accuracy, 2) == pytest.approx(1 + 0.5 + 0.3)
    assert expected_length(accuracy, 3) == pytest.approx(1 + 0.5 + 0.3 + 0.2)


def test_auto_tree_size_picks_the_optimum_of_a_synthetic_curve():
    import numpy as np
    from heads import choose_tree_size
    expected = {n: 1 + 2.2 * (1 - 0.85 ** n) for n in range(1, 49)}      # saturating acceptance
    measured = {1: 20.0, 4: 21.0, 8: 24.0, 16: 34.0, 32: 58.0, 49: 90.0}  # flat, then linear
    ks = sorted(measured)
    def curve(k):
        return float(np.interp(k, ks, [measured[k] for k in ks]))

    def flat(ms):
        return {n: ms for n in expected}

    for draft_ms, extra in ((flat(0.0), 0), (flat(9.0), 0), (flat(40.0), 0), (flat(9.0), 8),
                            ({n: 2.0 * n for n in expected}, 0)):
        n, speed = choose_tree_size(expected, curve, draft_ms, extra)
        brute = {m: e / (draft_ms[m] + np.interp(m + 1 + extra, ks, [measured[k] for k in ks]))
                 for m, e in expected.items()}
        assert n == max(brute, key=brute.get)
        assert speed[n] == pytest.approx(1000 * brute[n])
    # a costlier draft makes bigger trees pay: the choice must move up
    assert (choose_tree_size(expected, curve, flat(40.0))[0] >
            choose_tree_size(expected, curve, flat(0.0))[0])


def test_static_eagle_trees_pay_a_drafting_round_per_depth_level():
    # EAGLE's static tree feeds the head once per level, so --tree-size auto prices its drafting
    # by the depth of the tree each size gets; Medusa (one pass) and EAGLE-2 (all its rounds
    # always) pay the time measured, whatever the size
    from costs import draft_costs
    from heads import best_paths, choose_tree_size, expected_length
    accuracy = [[0.6, 0.2, 0.1, 0.05], [0.6, 0.15, 0.05], [0.55, 0.1], [0.55, 0.1], [0.55, 0.1]]
    sizes = range(1, 17)
    levels = {n: max(map(len, best_paths(accuracy, n))) for n in sizes}
    assert levels[1] == 1 and levels[16] == 5, levels
    eagle = draft_costs("eagle", accuracy, 6.0, 5, sizes)
    assert eagle[5] == pytest.approx(6.0), "the measured size costs what was measured"
    for n in sizes:
        assert eagle[n] == pytest.approx(6.0 * levels[n] / levels[5]), n
    for method in ("medusa", "eagle2"):
        assert draft_costs(method, accuracy, 6.0, 5, sizes) == {n: 6.0 for n in sizes}
    # deeper trees cost more rounds, so the static tree chosen is no bigger than at a flat price
    expected = {n: expected_length(accuracy, n) for n in sizes}
    import numpy as np
    def costs(k):
        return float(np.interp(k, [1, 4, 8, 17], [16.0, 16.5, 18.0, 24.0]))
    by_depth = choose_tree_size(expected, costs, eagle)[0]
    assert by_depth < choose_tree_size(expected, costs, {n: 6.0 for n in sizes})[0]


@pytest.mark.slow
def test_tree_size_auto_runs_end_to_end_and_stays_lossless(default_target, capsys):
    import methods
    target, tokenizer = default_target
    ids = tokenizer.chat_prompt("Name three rivers.")
    plain = generate_ar(target, ids, GenConfig(40), tokenizer.stop_ids).token_ids
    for method in ("eagle2", "medusa"):
        quiet = methods.method_config(method, tree_size="auto")
        methods.build_proposer(quiet, None, target, tokenizer, 1024)
        assert capsys.readouterr().err == "", "the prices are shown with --verbose only"
        shown = methods.method_config(method, tree_size="auto", verbose=True)
        proposer, info = methods.build_proposer(shown, None, target, tokenizer, 1024)
        assert info["tree_size"] == "auto"
        out = generate_spec(target, proposer, ids, GenConfig(40), tokenizer.stop_ids)
        assert out.token_ids == plain, method
        err = capsys.readouterr().err
        assert f"tree size auto ({method}):" in err and " + " in err, err
        assert len(proposer.prices.verify) >= 2, "the steps' passes were timed"


def random_batch(seed: int) -> tuple:
    """Two random sequences (tokens, float64 features) and their training batch."""
    import train_heads as th
    g = torch.Generator().manual_seed(seed)
    seqs = [features.Seq(torch.randint(1, 61, (n,), generator=g), torch.randn(n - 1, 32, generator=g,
                   dtype=torch.float64), p) for n, p in ((9, 3), (7, 2))]
    b = features.make_batch(seqs)
    b.feats, b.target = b.feats.double(), b.target.double()       # make_batch gives float32
    return seqs, b


def test_medusa_loss_equals_a_per_position_loop():
    import train_heads as th
    from heads import projection_rows
    target = tiny_model(4)
    heads = random_medusa(target, heads=2)
    seqs, b = random_batch(5)
    proj = projection_rows(target, heads.vocab_ids)
    got = training.medusa_loss(heads, proj, b)[1]
    for m in range(2):                   # head m at entry i: token i + 2 + m, from feature i + 1 + m
        terms = []
        for s in seqs:
            for i in range(max(s.prompt_len - 2 - m, 0), len(s.hidden) - 1 - m):
                log_q = (heads(s.hidden[i])[m] @ proj.T).log_softmax(-1)
                label = (s.hidden[i + 1 + m] @ proj.T).argmax()
                terms.append(-log_q[label])
        assert got[m] == pytest.approx(float(sum(terms).detach() / len(terms)), rel=1e-6), m


def test_eagle_loss_at_the_first_step_equals_a_per_position_loop():
    import train_heads as th
    from heads import projection_rows
    target = tiny_model(4)
    head = random_eagle(target)
    _, b = random_batch(6)
    proj = projection_rows(target, head.vocab_ids)
    got = training.eagle_loss(head, target.embed, proj, b, 2, 0.0)[1][0]
    out = training.eagle_unroll(head, target.embed, b, 1)[0]                  # (B, L, C)
    rows = b.loss_mask.nonzero().tolist()
    want = sum(-(out[r, i] @ proj.T).log_softmax(-1)[(b.target[r, i] @ proj.T).argmax()]
               for r, i in rows) / len(rows)
    assert got == pytest.approx(float(want.detach()), rel=1e-6)


# ---------------------------------------------------------------- EAGLE-2 plus prompt lookup

def test_add_chain_shares_the_prefix_the_tree_has():
    from tree import add_chain, make_tree
    tree = make_tree([9, 1, 2, 3], [-1, 0, 0, 1])               # 9 -> 1 -> 3, 9 -> 2
    grown = add_chain(tree, [1, 3, 5, 6])                      # shares 1 -> 3, adds 5 -> 6
    assert grown.tokens.tolist() == [9, 1, 3, 5, 6, 2], "the chain's nodes come first"
    assert grown.parents.tolist() == [-1, 0, 1, 2, 3, 0]
    assert grown.depths.tolist() == [0, 1, 2, 3, 4, 1]
    branch = add_chain(tree, [4, 1])                           # a new branch from the root
    assert branch.tokens.tolist() == [9, 4, 1, 1, 2, 3]
    assert branch.parents.tolist() == [-1, 0, 1, 0, 0, 3]
    assert add_chain(tree, [1, 3]).size == 4 and add_chain(tree, []).size == 4


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_eagle2_plus_lookup_is_lossless_greedy_and_seeded_when_sampling(temperature):
    from proposers import LookupEagleProposer, PromptLookupProposer
    target = tiny_model(2)
    proposer = LookupEagleProposer(EagleProposer(target, random_eagle(target, 2),
                                                 DraftConfig(3, 3, 5), 256),
                                   PromptLookupProposer(6, 3))   # as spec.py
    prompt = [4, 8, 15, 16, 23, 42, 4, 8, 15]                  # repeats: lookup has matches
    gen = GenConfig(40, temperature, seed=1)
    out = generate_spec(target, proposer, prompt, gen)
    if temperature == 0:
        assert out.token_ids == generate_ar(target, prompt, gen).token_ids
        assert max(out.drafted) > 5, "the lookup branch should have added nodes"
    else:
        assert out.token_ids == generate_spec(target, proposer, prompt, gen).token_ids


def test_each_steps_depth_counts_a_lookup_chain_placed_first():
    """Result.depths (the positions the summary lists) holds each tree's deepest node, also
    where the lookup chain comes first and the head's shallower nodes after it."""
    from proposers import LookupEagleProposer, PromptLookupProposer
    target = tiny_model(2)
    proposer = LookupEagleProposer(EagleProposer(target, random_eagle(target, 2),
                                                 DraftConfig(3, 3, 5), 256),
                                   PromptLookupProposer(6, 3))
    trees = []
    out = generate_spec(target, proposer, list(range(3, 40)) * 2, GenConfig(40),
                        on_step=lambda tree, path, bonus: trees.append(tree))
    assert any(int(t.depths[-1]) < deepest(t) for t in trees), "a deep chain placed first"
    assert out.depths == [deepest(t) for t in trees]


def test_eagle2_plus_lookup_drafts_one_round_after_a_full_match():
    # A chain found by matching all max_ngram tokens leaves the head one round (the root's
    # alternatives); a shorter match leaves it all of its rounds.
    from proposers import LookupEagleProposer, PromptLookupProposer
    target = tiny_model(2)
    head = random_eagle(target, 2)

    def draft(prompt, root):   # -> (matched n, deepest node off the lookup chain)
        proposer = LookupEagleProposer(EagleProposer(target, head, DraftConfig(3, 3), 256),
                                       PromptLookupProposer(6, 3))
        cache = target.new_cache(1, 64)
        _, hidden = target(torch.tensor([prompt]), torch.arange(len(prompt))[None], cache)
        proposer.start(prompt, hidden[0])
        chain, n = proposer.lookup.continuation(root)
        tree, _ = proposer.propose(root, GenConfig(), None)
        on_chain, node = {0}, 0
        for token in chain.tolist():          # walk the chain's path down from the root
            node = next(c for c in range(tree.size)
                        if tree.parents[c] == node and tree.tokens[c] == token)
            on_chain.add(node)
        return n, max(int(tree.depths[c]) for c in range(tree.size) if c not in on_chain)

    assert draft([4, 8, 15, 16, 23, 42, 4, 8], root=15) == (3, 1), "(4, 8, 15): full match"
    assert draft([4, 8, 15, 16, 23, 42, 9, 8], root=15) == (2, 3), "(8, 15): 2 of 3"


def test_size_rule_takes_the_best_priced_size_and_stops_unpaid_rounds():
    from proposers import SizeRule
    verify = [0.0, 16.0, 22.0, 22.5, 23.0, 24.0, 26.0, 28.0, 31.0, 34.0, 38.0, 42.0]   # [k] ms
    rule = SizeRule(len(verify) - 2, [[0.5]], verify.__getitem__, rate=0.08, round_ms=2.0)
    for probs, riders in [([0.9, 0.8, 0.5, 0.2, 0.1], 0), ([0.3, 0.1, 0.05], 0),
                          ([0.45, 0.4, 0.3, 0.2], 0), ([0.9] * 12, 0), ([0.6, 0.5, 0.1], 4)]:
        p = torch.tensor(probs, dtype=torch.float64)
        rule.most = len(verify) - 2 - riders          # as far as the curve goes
        fits = min(len(probs), rule.most)
        brute = max(range(fits + 1),
                    key=lambda n: 1 + sum(probs[:n]) - 0.08 * verify[n + 1 + riders])
        assert rule.size(p, riders) == brute, (probs, riders)
    rule.most = 10
    assert rule.size(torch.tensor([0.3, 0.1, 0.05]), 0) == 0         # unsure: the root alone
    assert rule.size(torch.tensor([0.9] * 12), 0) == 10               # capped at its most
    # a round pays when its predicted nodes (frontier x accuracy) raise the best objective by
    # more than 0.08 x 2 ms = 0.16 tokens. Drafted 0.9, 0.9: best n = 2, 1.8 - 0.08 x 22.5 = 0.
    # A child of 0.9 x 0.5 makes n = 3 worth 2.25 - 0.08 x 23 = 0.41: it pays; 0.9 x 0.1 gives
    # 1.89 - 1.84 = 0.05: it does not
    drafted, frontier = torch.tensor([0.9, 0.9]).log(), torch.tensor([0.9]).log()
    rule.most, rule.accuracy = 10, [[0.5]]
    assert rule.keep_growing(drafted, frontier, 1)
    rule.accuracy = [[0.1]]
    assert not rule.keep_growing(drafted, frontier, 1)


def test_rounds_rule_drafts_the_round_count_a_brute_force_finds_best():
    """EAGLE-2's rounds per step: with children whose probabilities the accuracy table predicts
    exactly, stopping at the first round that does not pay gives the round count that
    maximizes the best verify objective less the rounds' price (brute force over counts)."""
    from proposers import SizeRule
    from tree import grow_tree
    accuracy = [[0.8, 0.15], [0.6, 0.2], [0.5, 0.2], [0.4, 0.2], [0.3, 0.2]]
    V, top_k, depth = 8, 2, 5

    def expand(frontier, tree):                   # children at depth d + 1: accuracy[d]
        rounds.append(1)
        d = int(tree.depths[frontier[0]])
        p = torch.full((len(frontier), V), 1e-6, dtype=torch.float64)
        p[:, 0], p[:, 1] = accuracy[d]
        return p.log()
    seen = set()
    for slope, rate, round_ms in [(0.2, 0.08, 1.0), (1.0, 0.08, 1.0), (0.2, 0.08, 4.0),
                                  (0.05, 0.2, 0.5), (3.0, 0.02, 2.0), (0.5, 0.05, 8.0)]:
        rule = SizeRule(40, accuracy, lambda k: 20.0 + slope * k, rate, round_ms)
        rounds = []
        grow_tree(expand, 0, depth, top_k, 40, keep_growing=rule.keep_growing)
        chosen = len(rounds)

        def value(R):                              # R rounds drafted, whatever they give
            rounds.clear()
            tree = grow_tree(expand, 0, R, top_k, 40)
            scores = tree.scores[1:].sort(descending=True).values.exp()
            return float(rule.objective(scores).max()) - rate * round_ms * R
        best = max(range(1, depth + 1), key=value)
        assert chosen == best, (slope, rate, round_ms, chosen, [value(R) for R in range(1, 6)])
        seen.add(chosen)
    assert len(seen) >= 3, f"the cases must need different round counts: {seen}"


def test_grow_tree_stops_when_told_and_per_step_sizes_stay_lossless():
    from proposers import SizeRule
    from tree import grow_tree
    rounds = []

    def expand(frontier, tree):
        rounds.append(len(frontier))
        return torch.log_softmax(torch.arange(6.0).repeat(len(frontier), 1), -1)
    tree = grow_tree(expand, 0, 4, 2, 20, keep_growing=lambda *scores: len(rounds) < 2)
    assert len(rounds) == 2 and int(tree.depths.max()) == 2

    # random float64 heads: sizes vary step to step (root alone included), output stays plain greedy
    gen = GenConfig(max_new_tokens=40)
    for seed in range(3):
        target = tiny_model(seed)
        rule = SizeRule(20, [[0.5, 0.2, 0.1]] * 3, lambda k: 10.0 + k, rate=0.5, round_ms=1.0)
        proposer = EagleProposer(target, random_eagle(target, seed), DraftConfig(3, 3, 20, rule),
                                 256)
        for prompt in ([1, 2, 3], [11, 5, 9, 30, 2, 8]):
            out = generate_spec(target, proposer, prompt, gen)
            assert out.token_ids == generate_ar(target, prompt, gen).token_ids
            assert min(out.drafted) == 0 < max(out.drafted), f"seed {seed}: {out.drafted}"


def test_wise_interpolates_every_weight_between_the_init_and_the_trained_head(tmp_path):
    """train_heads --wise ALPHA: each float weight becomes ALPHA x trained + (1 - ALPHA) x the
    --init head's; the draft vocabulary (integer ids) is left alone; bad ALPHA is refused."""
    import train_heads as th
    target = tiny_model(0)
    start, trained = random_eagle(target, 1, vocab=40), random_eagle(target, 2, vocab=40)
    before = {k: v.clone() for k, v in trained.state_dict().items()}
    th.interpolate(trained, start, 0.25)
    ends = start.state_dict()
    for name, w in trained.state_dict().items():
        want = (0.25 * before[name] + 0.75 * ends[name]) if w.is_floating_point() else before[name]
        assert torch.allclose(w, want, atol=1e-12), name
    assert torch.equal(trained.vocab_ids, before["vocab_ids"])
    for bad in (["--wise", "0.5"], ["--wise", "1.5", "--init", str(tmp_path)]):
        with pytest.raises(ValueError, match="--wise"):
            th.train_command(th.parse_args(["--method", "eagle", "--data", "x.jsonl", "--out",
                                            str(tmp_path)] + bad))


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_no_method_decodes_past_the_context(temperature):
    """Prompts a few tokens short of the context: every proposer stops where plain decoding
    stops (its last token comes from the context's last position), with the same tokens (a
    sampled draft chain, accepted by Leviathan's rule, keeps the distribution, not the text)."""
    from proposers import PromptLookupProposer
    target = tiny_model(7, max_positions=64)
    draft = tiny_model(8, num_layers=1)
    gen = GenConfig(max_new_tokens=40, temperature=temperature, seed=3)
    makers = {"draft chain": lambda: DraftModelProposer(draft, 4, 256),
              "lookup": lambda: PromptLookupProposer(4),
              "eagle2": lambda: EagleProposer(target, random_eagle(target), DraftConfig(4, 3, 8),
                                              256),
              "eagle2, deeper than kept": lambda: EagleProposer(
                  target, random_eagle(target), DraftConfig(8, 1, 1), 256),
              "medusa": lambda: MedusaProposer(target, random_medusa(target), static_tree(PATHS))}
    for n in (50, 58, 61, 63):
        prompt = [(7 * i) % 50 + 1 for i in range(n)]            # repeats: lookup drafts
        plain = generate_ar(target, prompt, gen).token_ids
        assert len(plain) == 64 - n + 1, "plain decoding's last token comes from position 63"
        for name, make in makers.items():
            got = generate_spec(target, make(), prompt, gen).token_ids
            same = (len(got) == len(plain) if name == "draft chain" and temperature > 0 else
                    got == plain)
            assert same, f"{name}, prompt of {n} in a context of 64: {got} against {plain}"


def test_a_checkpoint_restores_head_and_optimizer_without_pickle(tmp_path):
    import train_heads as th
    torch.manual_seed(0)

    def stepped(model, opt, x):
        model(x).square().sum().backward()
        opt.step(), opt.zero_grad()

    x = torch.randn(5, 6)
    model = torch.nn.Linear(6, 3)
    model.register_buffer("vocab_ids", torch.arange(3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    stepped(model, opt, x)
    training.save_checkpoint(str(tmp_path), model, opt, {"step": 1, "losses": [[0.5]]})
    again = torch.nn.Linear(6, 3)
    again.register_buffer("vocab_ids", torch.zeros(3, dtype=torch.long))
    again_opt = torch.optim.AdamW(again.parameters(), lr=0.7)
    assert training.load_checkpoint(str(tmp_path), again, again_opt) == {"step": 1, "losses": [[0.5]]}
    stepped(model, opt, x), stepped(again, again_opt, x)    # the moments came back too
    for a, b in zip(model.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)
    assert os.listdir(tmp_path) == ["checkpoint.safetensors"]
    (tmp_path / "checkpoint.safetensors").write_bytes(b"cut")
    with pytest.raises(ValueError, match="checkpoint.safetensors: not a checkpoint of this run"):
        training.load_checkpoint(str(tmp_path), again, again_opt)


def test_no_source_file_unpickles():
    """torch.load without weights_only runs whatever code a file carries."""
    import glob
    here = os.path.dirname(os.path.abspath(__file__))
    for path in glob.glob(os.path.join(here, "*.py")):
        if os.path.basename(path).startswith("test_"):
            continue
        text = open(path).read()
        for bad in ("weights_only=False", "import pickle"):
            assert bad not in text, f"{os.path.basename(path)} uses {bad}"
        for call in re.findall(r"torch\.load\(([^)]*)\)", text):     # a published .bin head
            assert "weights_only=True" in call, f"{os.path.basename(path)}: torch.load({call})"
