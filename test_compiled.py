"""--compile (kernel.Compiled): exactness inside the compiled configuration, the fixed-shape step's
rows, no recompiles, and a machine that cannot compile. Compiling costs seconds a graph even for
a tiny model, so the compiled tests share one target and its graphs (sizes 1 and TREE, widths
256 and 512)."""
import random

import pytest
import torch

from kernel import Compiled, check_rows, pad_inputs, step, with_prefix
from decode import GenConfig, generate_ar, generate_spec
from proposers import DraftModelProposer, MedusaProposer
from quantize import quantize
from test_heads import PATHS, random_medusa
from test_spec import random_tree, tiny_model
from tree import ancestor_mask, make_tree, positions, static_tree

TREE = 6
SHORT = [3, 4, 5, 6, 7, 8, 3, 4, 5, 6, 7, 8, 3, 4]
EDGE = [i % 40 + 2 for i in range(58)]      # its trees soon cross a block of 64 slots
LONG = list(range(1, 60)) * 4 + [7, 8]         # 238 tokens: its cache is the next width, 512


class KnownTrees:
    """Random trees of 1..TREE nodes with the target's own text along the path to a random
    node (often not the first path): trees of changing size whose accepted nodes are gathered
    from among other nodes' slots."""

    max_nodes = TREE

    def __init__(self, text: list, seed: int):
        self.text, self.rng = text, random.Random(seed)

    def start(self, prompt_ids, hidden=None):
        self.at = 0                          # the root is text[self.at]

    def propose(self, root, gen, generator):
        n = self.rng.randint(1, TREE)
        parents = [-1] + [self.rng.randrange(i) for i in range(1, n)]
        tokens = [root] + [self.rng.randrange(61) for _ in range(1, n)]
        node, path = n - 1, []
        while node > 0:
            path.append(node)
            node = parents[node]
        for depth, node in enumerate(reversed(path), 1):
            if self.at + depth < len(self.text):
                tokens[node] = self.text[self.at + depth]
        return make_tree(tokens, parents), None

    def commit(self, tree, accepted, hidden=None):
        self.at += accepted.shape[0]         # the accepted path, root included; the bonus next


@pytest.fixture(scope="module")
def target():
    # the default configuration's kernels: int4 matrices, an int8 head, bfloat16 activations;
    # tied, as the default model (a draft vocabulary's rows come from its embedding)
    model = tiny_model(6, intermediate_size=64, tie_embeddings=True).to(torch.bfloat16)
    return quantize(model, "int4", "int8")


def test_compiled_methods_write_compiled_plain_decodings_text(target):
    gen = GenConfig(max_new_tokens=40)
    fast = Compiled(target, (1, TREE))
    for prompt in (SHORT, EDGE, LONG):
        plain = generate_ar(fast, prompt, gen).token_ids
        for seed in range(2):
            spec = generate_spec(fast, KnownTrees(plain, seed), prompt, gen)
            assert spec.token_ids == plain, f"prompt of {len(prompt)}, seed {seed}"
            assert sum(spec.accepted) >= 10 and len(set(spec.drafted)) >= 3


def test_a_compiled_draft_model_drafts_what_it_drafts_eager(target):
    """The draft model's step compiled (without the vocabulary projection, which the proposer
    makes): the same chains as eager drafting, and compiled plain decoding's text. The target
    drafts for itself, so chains are accepted whole and the 2-token step (pending and root)
    runs too; as a parallel draft (a mask token), its steps of 2 and 4 tokens."""
    gen, slots = GenConfig(max_new_tokens=30), 128
    fast = Compiled(target, (1, TREE))
    plain = generate_ar(fast, SHORT, gen).token_ids
    for mask, sizes in ((None, (1, 2)), (3, (2, 4))):
        drafts = []
        for draft in (target, Compiled(target, sizes, slots, project=False).warm_up()):
            chains = []
            spec = generate_spec(fast, DraftModelProposer(draft, 2, slots, mask_id=mask), SHORT,
                                 gen, on_step=lambda tree, *_: chains.append(tree.tokens.tolist()))
            assert spec.token_ids == plain and sum(spec.accepted) >= (15 if mask is None else 1)
            drafts.append(chains)
        assert drafts[0] == drafts[1], f"mask {mask}"


def test_compiled_medusa_heads_draft_what_they_draft_eager(target):
    gen, heads = GenConfig(max_new_tokens=30), random_medusa(target, 3, 1).to(torch.bfloat16)
    fast = Compiled(target, (1, TREE))
    plain, trees = generate_ar(fast, SHORT, gen).token_ids, []
    for compile in (False, True):
        seen = []
        proposer = MedusaProposer(target, heads, static_tree(PATHS[:TREE - 1]), compile=compile)
        spec = generate_spec(fast, proposer, SHORT, gen,
                             on_step=lambda tree, *_: seen.append(tree.tokens.tolist()))
        assert spec.token_ids == plain
        trees.append(seen)
    assert trees[0] == trees[1] and len({t for tree in trees[0] for t in tree}) > 10


def test_compiled_sampling_equals_compiled_plain_sampling(target):
    gen = GenConfig(max_new_tokens=30, temperature=1.0, seed=5)
    fast = Compiled(target, (1, TREE))
    plain = generate_ar(fast, SHORT, gen).token_ids
    spec = generate_spec(fast, KnownTrees(plain, 0), SHORT, gen)
    assert spec.token_ids == plain and sum(spec.accepted) >= 5


def test_no_step_compiles_again_after_warm_up(target):
    from torch._dynamo.utils import counters
    gen = GenConfig(max_new_tokens=40)
    fast = Compiled(target, (1, TREE), len(LONG) + gen.max_new_tokens + TREE + 1)
    fast.warm_up()                                               # every size and width once
    graphs = counters["stats"]["unique_graphs"]
    for seed, prompt in enumerate([SHORT, LONG, EDGE, LONG[:200]]):   # EDGE: new lengths
        plain = generate_ar(fast, prompt, gen).token_ids
        spec = generate_spec(fast, KnownTrees(plain, seed + 7), prompt, gen)
        assert len(set(spec.drafted)) >= 3, "trees of several sizes"
    assert counters["stats"]["unique_graphs"] == graphs, "a step compiled again"


@pytest.mark.parametrize("dtype,weights,layers", [(torch.float32, ("float",), 3),
                                                    (torch.bfloat16, ("int4", "int8"), 4)])
def test_a_compiled_tree_row_equals_its_path_run_one_token_at_a_time(dtype, weights, layers):
    # row invariance: a node computed among TREE rows gets the bits of its path's last token
    # computed alone, in plain decoding's layout (the compiled graphs of 1 and TREE tokens).
    # float32: bfloat16 activations would round most of a difference in attention away.
    # bfloat16 with 4 layers: from a few layers on inductor fuses the two graphs differently,
    # and a fused kernel skipped a bfloat16 rounding (kernel.Compiled's emulate_precision_casts).
    # Trees across a block boundary: a node's ancestors fall into other blocks of 64 slots in
    # the tree's layout than in plain decoding's.
    target = quantize(tiny_model(3, hidden_size=128, num_heads=2, num_kv_heads=1,
                                 intermediate_size=128, num_layers=layers).to(dtype), *weights)
    check_rows(target)                                                     # as spec.py does
    if target.alone:
        pytest.skip("this machine's library makes attention's rows depend on the call, and "
                    "compiled attention has no route that computes them alone: --compile refuses")
    fast, rng = Compiled(target, (1, TREE)), random.Random(4)
    for n, start in ((TREE, 61), (4, 62), (TREE, 125), (5, 70)):
        tree = random_tree(rng, n)
        mask = ancestor_mask(tree.parents, tree.depths)
        cache = fast.new_cache(1, 200)
        with torch.inference_mode():
            fast(torch.tensor([[i % 50 + 5 for i in range(start)]]), torch.arange(start)[None],
                 cache)
            logits, _ = fast(tree.tokens[None], positions(tree.depths, start)[None], cache,
                             with_prefix(mask, start))
            for node in range(n):
                cache.length = start
                for j in mask[node].nonzero()[:, 0].tolist():     # its path, one at a time
                    alone, _ = fast(tree.tokens[None, j:j + 1], torch.tensor([[cache.length]]),
                                    cache)
                assert torch.equal(alone[0, -1], logits[0, node]), f"node {node} after {start}"


def test_the_fixed_step_equals_eager_attention_rows():
    # the step's static attention (a fixed window gathered per query, blocks added in order)
    # computes what kernel.attend computes; float64, where both are exact to rounding
    model = tiny_model(2)
    rng = random.Random(1)
    for n, start in ((5, 9), (7, 70), (3, 130)):
        tree = random_tree(rng, n)
        mask = ancestor_mask(tree.parents, tree.depths)
        pos = positions(tree.depths, start)
        ref_cache, cache = model.new_cache(1, 256), model.new_cache(1, 256)
        prompt = torch.tensor([[rng.randrange(61) for _ in range(start)]])
        with torch.no_grad():
            for c in (ref_cache, cache):
                model(prompt, torch.arange(start)[None], c)
            ref, _ = model(tree.tokens[None], pos[None], ref_cache, with_prefix(mask, start))
            ids, p, m = pad_inputs(tree.tokens, pos, mask, TREE + 2)
            got, _ = step(model, ids[None], p[None], cache.k.unbind(0), cache.v.unbind(0),
                          torch.tensor(start), m)
        assert torch.allclose(got[0, :n], ref[0], rtol=0, atol=1e-10), f"{n} after {start}"
        assert torch.allclose(cache.k[:, :, :, :start + n], ref_cache.k[:, :, :, :start + n],
                              rtol=0, atol=1e-10), "the new keys, in their slots"


def test_padding_a_tree_keeps_its_nodes_and_makes_pads_see_before_them():
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    tokens, pos, mask = pad_inputs(torch.arange(3), torch.arange(3), causal[:3, :3], 5)
    assert torch.equal(mask, causal), "a padded chain is still a chain"
    assert tokens.tolist() == [0, 1, 2, 0, 0] and pos.tolist() == [0, 1, 2, 0, 0]
    with pytest.raises(ValueError, match="does not fit"):
        pad_inputs(torch.arange(6), torch.arange(6), causal.new_ones(6, 6), 5)


def test_a_chain_takes_the_least_size_that_holds_it_and_a_tree_the_largest(target):
    fast, sizes = Compiled(target, (1, 2, 3, TREE)), []
    assert Compiled(target, slots=10_000).widths() == [256, 512], "none past the context (512)"
    fast.run = lambda tokens, *_: sizes.append(tokens.shape[0]) or (None, torch.zeros(1, TREE, 8))
    star = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)    # root, 2 children
    for n, mask in ((1, None), (2, None), (3, None), (3, star), (4, None)):
        cache = fast.new_cache()
        tree = None if mask is None else with_prefix(mask, 0)
        fast(torch.zeros(1, n, dtype=torch.long), torch.arange(n)[None], cache, tree, project=False)
    assert sizes == [1, 2, 3, TREE, TREE]


def test_chain_methods_keep_a_graph_per_power_of_two_and_tree_methods_pad(target):
    from types import SimpleNamespace
    from methods import compiled_verifier, method_config
    for method, most, sizes, trees in (("ngram", 4, [1, 2, 4], False),
                                       ("draft", 2, [1, 2], False),
                                       ("ngram", 6, [1, 2, 4, 6], False),
                                       ("eagle2", 4, [1, 4], True)):
        proposer = SimpleNamespace(max_nodes=most)
        fast = compiled_verifier(target, method_config(method), proposer, 64)
        assert (fast.sizes, fast.trees) == (sizes, trees), (method, most)


def test_a_machine_that_cannot_compile_is_told_in_one_line(capsys):
    import torch._inductor.config as inductor
    from spec import main
    torch._dynamo.reset()
    # no C++ compiler, and no kept build of the probe's graph to load instead
    with inductor.patch({"cpp.cxx": (None, "/no/such/compiler"), "fx_graph_cache": False}):
        with pytest.raises(SystemExit) as exit:
            main(["--compile", "--model", "no/such/folder"])
    err = capsys.readouterr().err.strip()
    assert exit.value.code == 2 and err.count("\n") == 0, err
    assert err.startswith("error: --compile: torch cannot compile") and "without --compile" in err
    torch._dynamo.reset()


def test_the_gpu_check_runs_in_its_small_mode_on_the_cpu(tmp_path):
    import json
    from gpu_check import main
    main(["--small", "--out", str(tmp_path / "check.json")])
    report = json.loads((tmp_path / "check.json").read_text())
    assert report["exact_float32"]["eager"]["equal"] and report["exact_bfloat16"]["eager"]["equal"]
    assert report["exact_bfloat16"]["compiled"]["equal"]
    plain = report["plain_smollm2-135m-thin"]
    assert plain["compiled_tokens_s"] > 0 and plain["limit_tokens_s"] > plain["eager_tokens_s"]
    assert sorted(report["curve_smollm2-135m-thin"]) == ["1", "2", "4"]     # (JSON keys)


def test_auto_under_compile_prices_the_compiled_passes(target, tmp_path):
    """--compile --tree-size auto: EAGLE-2's rule sizes each step from the compiled passes'
    prices, up to the padded size (the root alone among them), drafting no round deeper than
    that; the text stays compiled plain decoding's."""
    from costs import Priced
    from heads import HeadConfig, eagle_layer_config
    from methods import COMPILED_NODES, build_head, method_config
    from test_heads import random_eagle
    from train_heads import save_head
    c = target.config
    save_head(random_eagle(target, 7).float(), HeadConfig(
        "eagle", c.hidden_size, c.vocab_size, c.vocab_size, layer=eagle_layer_config(c),
        accuracy=[[0.8, 0.1, 0.05, 0.05]] * 3), str(tmp_path / "h"))
    mc = method_config("eagle2", heads=(str(tmp_path / "h"),), compile=True)
    proposer, sizer, _ = build_head(mc, target, 512)
    assert sizer.most == proposer.config.total == COMPILED_NODES and sizer.rule is not None
    assert proposer.max_nodes == COMPILED_NODES + 1 and proposer.config.depth == COMPILED_NODES
    # the graphs of the other tests (a tree padded to TREE: the same rows, fewer compiles)
    fast, gen = Compiled(target, (1, TREE)), GenConfig(max_new_tokens=40)
    for prompt in (SHORT, LONG):
        spec = generate_spec(fast, Priced(proposer, sizer), prompt, gen)
        assert spec.token_ids == generate_ar(fast, prompt, gen).token_ids
        assert max(spec.drafted) <= COMPILED_NODES
