"""Each decoding method built from its configuration: the target, then one function per method
that makes its proposer (spec.py and bench.py map their flags onto these dataclasses).

    target = load_target(TargetConfig())                        # (path, Llama, Tokenizer)
    proposer, info = build_proposer(method_config("eagle2"), *target, slots)
"""
import argparse
import copy
import hashlib
import inspect
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from attention import attend
from checkpoint import load_model, place_folder, read_json, save_tensors, write_json
from decode import GenConfig, generate_spec
from default_model import WEIGHTS, cache_dir, default_model_path
from heads import (best_paths, choose_tree_size, expected_length, load_head, projection,
                   read_head_config, verify_cost)
from model import Llama, LlamaConfig, LoadError, RopeScaling
from proposers import (DraftConfig, DraftModelProposer, EagleProposer, LookupEagleProposer,
                       MedusaProposer, PromptLookupProposer, SizeRule)
from quantize import compiled, convert, load_quantized, quantize, source_digest
from tokenizer import load_tokenizer
from tree import static_tree

METHODS = ["ar", "draft", "ngram", "medusa", "eagle", "eagle2", "eagle2+ngram"]
# (depth, top-k, tree size) per method, measured (docs/RESULTS.md): auto beat every fixed tree
# size tried for the head methods; with 5-node trees a 4th EAGLE-2 round rarely pays; ngram's 3
# is its most tokens (a match of n of ngram_max tokens drafts n / ngram_max of them); the
# distilled draft's second token is accepted in 9% of steps, for a forward of its own each
TREE_DEFAULTS = {"draft": (1, 1, 0), "ngram": (3, 1, 0), "medusa": (4, 1, "auto"),
                 "eagle": (5, 1, "auto"), "eagle2": (3, 4, "auto"),
                 "eagle2+ngram": (3, 4, "auto")}
HEAD_KIND = {"medusa": "medusa", "eagle": "eagle", "eagle2": "eagle", "eagle2+ngram": "eagle"}
# eagle2+ngram's lookup branch, scaled by the match (2, 4 or 6 tokens after a match of 1, 2 or
# 3): 6 measured best of 3, 6, 12 and 24 (docs/RESULTS.md)
LOOKUP_DEPTH = 6
AUTO_MAX = 48                                   # largest tree --tree-size auto considers
# measured sizes, linear between and proportional past the last (docs/RESULTS.md: 24 and 49
# rows measured within 1% of that); start-up pays for every size timed
COST_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 32)
RANDOM = "random:"                     # TargetConfig.model random:SHAPE: random weights (SHAPES)
TIMING_PROMPT = "Explain how a bicycle works."      # decoded to time drafting for auto


@dataclass
class TargetConfig:
    """Which target model, and in what form."""
    model: str | None = None       # a HF Llama folder, random:SHAPE; None: the default model
    cache_dir: str | None = None   # the default model's conversion and one-time work go here
    dtype: str = "bfloat16"        # activations, and the weights where they stay float
    device: str = "cpu"
    weights: str = "auto"          # float, int8, int4; auto: int4 for the default model, bf16, CPU


@dataclass
class MethodConfig:
    """How one method drafts (use method_config for the method's measured defaults)."""
    method: str = "ar"
    depth: int = 4                 # tokens drafted along each path
    top_k: int = 1                 # children per expanded draft node; 1 drafts a chain
    tree_size: int | str = 0       # nodes verified per step; 0: depth x top_k; "auto"
    ngram_max: int = 3             # prompt lookup: longest n-gram matched
    draft: str | None = None       # draft model folder; None: the distilled draft shipped
    heads: tuple = ()              # trained head folders; none: the heads shipped
    draft_int8: bool = True        # drafts run int8 where the kernel is fast (bf16, CPU)
    compile: bool = False          # torch.compile the decoder blocks (trees padded)
    verbose: bool = False          # print the prices --tree-size auto chose from


def method_config(method: str, depth=None, top_k=None, tree_size=None, **options) -> MethodConfig:
    """MethodConfig with the method's measured depth, top-k and tree size where None is given."""
    d, k, s = TREE_DEFAULTS.get(method, (4, 1, 0))
    return MethodConfig(method, depth or d, top_k or k, s if tree_size is None else tree_size,
                        **options)


# ---------------------------------------------------------------- the target

class Parser(argparse.ArgumentParser):
    """spec.py's and train_heads.py's flags: a bad one is one `error:` line and exit code 2."""

    def error(self, message):
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def parse_flags(argv, doc: str, groups, check):
    """Flags added by each of groups, checked by check(parser, args), --device resolved."""
    p = Parser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for add in groups:
        add(p)
    args = p.parse_args(argv)
    check(p, args)
    try:
        args.device = pick_device(args.device)
    except ValueError as e:
        p.error(str(e))
    return args


def pick_device(name: str | None) -> str:
    """The device named, checked to exist here (ValueError), or the best available."""
    if name:
        try:
            torch.empty(0, device=name)
        except (RuntimeError, AssertionError) as e:       # unknown name, or no such backend
            reason = (str(e).splitlines() or [""])[0].split(". ")[0]      # torch's first sentence
            raise ValueError(f"--device {name} is not available here ({reason})") from None
        return name
    if torch.cuda.is_available():
        return "cuda"
    return "mps" if torch.backends.mps.is_available() else "cpu"


def weight_forms(tc: TargetConfig) -> tuple:
    """(form of the decoder's matrices, of the lm_head). auto: the default model's matrices as
    the int4 blocks its file holds (bfloat16 on CPU), any other checkpoint as it is; a quantized
    model's lm_head in int8 (measured: docs/RESULTS.md). Not in float16 or float32: torch's
    int4 and int8 CPU kernels are vectorized for bfloat16 activations only; the others take a
    scalar loop many times slower than their own matmul (docs/RESULTS.md)."""
    form = tc.weights
    if form == "auto":
        default = tc.model is None or tc.model.startswith(RANDOM)
        form = ("int4" if default and tc.dtype == "bfloat16"
                and torch.device(tc.device).type == "cpu" else "float")
    return form, "int8" if form != "float" else "float"


def load_target(tc: TargetConfig) -> tuple:
    """-> (folder, Llama in its weight form, Tokenizer); random:SHAPE has no folder or tokenizer."""
    dtype = getattr(torch, tc.dtype)
    form, head_form = weight_forms(tc)
    if tc.model and tc.model.startswith(RANDOM):         # timing only: no files, no tokenizer
        target = random_model(tc.model.removeprefix(RANDOM), dtype, tc.device)
        return tc.model, quantize(target, form, head_form), None
    path = tc.model or default_model_path(tc.cache_dir)
    if tc.model is None and form != "float" and torch.device(tc.device).type == "cpu":
        keep = os.path.join(path, f"{form}-{head_form}-{tc.dtype}.safetensors")  # packed once
        target = load_quantized(path, dtype, form, head_form, keep)
    else:
        target = quantize(load_model(path, dtype, tc.device), form, head_form)
    tokenizer = load_tokenizer(path)
    if tokenizer.vocab_size > target.config.vocab_size:    # its ids would index past the table
        raise LoadError(f"{path}: the tokenizer has {tokenizer.vocab_size} tokens, the model's "
                        f"embedding {target.config.vocab_size}")
    return path, target, tokenizer


# Shapes for timing without a checkpoint (random:NAME): the cost of a forward depends only on them.
SHAPES = {
    "smollm2-135m": LlamaConfig(),
    "llama3.2-1b": LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                               num_layers=16, num_heads=32, num_kv_heads=8, rope_theta=500000.0,
                               rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192)),
    "llama3-8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                             num_layers=32, num_heads=32, num_kv_heads=8, rope_theta=500000.0,
                             rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192), tie_embeddings=False),
    # The default model's 30 layers and sequence of operations, with matrices too small to cost:
    # its forward times what a forward costs besides reading weights (per-operation overhead).
    "smollm2-135m-thin": LlamaConfig(vocab_size=512, hidden_size=96, intermediate_size=256,
                                     num_heads=3, num_kv_heads=1),
}


def random_model(name: str, dtype=torch.float32, device="cpu") -> Llama:
    """A Llama of a known shape (SHAPES) with nn's default random init, built on the device."""
    if name not in SHAPES:
        raise LoadError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)          # built in dtype: 8B in fp32 first would need 32 GB
    try:
        with torch.device(device):
            model = Llama(copy.deepcopy(SHAPES[name]))
    finally:
        torch.set_default_dtype(default)
    return model.to(device).eval()                   # the RoPE tables were built on the CPU


# ---------------------------------------------------------------- one builder per method

def build_proposer(mc: MethodConfig, path: str, target, tokenizer, slots: int,
                   cache: str | None = None) -> tuple:
    """-> (proposer, info: what drafts and the memory it adds). path: the target's folder (a
    shipped draft takes its embeddings from it); slots: the caches' size; cache: the folder
    for built files and --tree-size auto's timings (default: the default model's cache)."""
    if mc.method == "ngram":
        return build_ngram(mc)
    if mc.method == "draft":
        return build_draft(mc, path, target, tokenizer, slots, cache_dir(cache))
    if mc.method == "eagle2+ngram":
        return build_lookup_eagle(mc, target, tokenizer, slots, cache_dir(cache))
    if mc.method in HEAD_KIND:
        return build_head(mc, target, tokenizer, slots, cache=cache_dir(cache))
    raise ValueError(f"no proposer for method {mc.method!r}; methods: {', '.join(METHODS[1:])}")


def build_ngram(mc: MethodConfig) -> tuple:
    """Prompt lookup by match: up to depth tokens, scaled by how long a match was found."""
    proposer = PromptLookupProposer(mc.depth, mc.ngram_max, by_match=True)
    return proposer, {"draft": f"prompt lookup, n <= {mc.ngram_max}", "draft_params": 0,
                      "draft_memory_mb": 0.0}


def build_draft(mc: MethodConfig, path: str, target, tokenizer, slots: int, cache: str) -> tuple:
    """A smaller Llama with the target's tokenizer; greedy drafts over its folder's reduced
    vocabulary (draft_vocab.json) where it has one."""
    name = mc.draft or os.path.join(WEIGHTS, "smollm2-135m-draft")
    folder = draft_folder(name, path, cache)
    why = tokenizer.same_as(load_tokenizer(folder))
    if why:
        raise ValueError(f"draft and target tokenizers differ: {why}. A draft must share the "
                         "target's exact tokenizer, or its tokens mean other words")
    w = target.embed.weight
    draft = share_embeddings(load_model(folder, w.dtype, w.device), target)
    own = {id(t) for t in [*target.parameters(), *target.buffers()]}
    params = sum(p.numel() for p in draft.parameters() if id(p) not in own)  # its own only
    draft = quantize(draft, draft_form(mc, draft))       # skips what is the target's
    if mc.compile:
        draft = compiled(draft)
    vocab = load_draft_vocab(name, target.config.vocab_size)
    proj = None if vocab is None else draft_projection(mc, target, vocab)
    proposer = DraftModelProposer(draft, mc.depth, slots, vocab, proj)
    extra = sum(t.numel() * t.element_size() for t in [*draft.parameters(), *draft.buffers()]
                if id(t) not in own) + module_bytes(proposer.proj)
    if vocab is not None:
        name += f" (greedy drafts over {len(vocab):,} tokens)"
    return proposer, {"draft": name, "draft_params": params,
                      "draft_memory_mb": round(extra / 2**20, 1)}


def build_lookup_eagle(mc: MethodConfig, target, tokenizer, slots: int,
                       cache: str | None = None) -> tuple:
    """EAGLE-2's tree plus the prompt-lookup chain as one more branch; the chain rides along in
    every verify pass, so --tree-size auto prices it in."""
    eagle, info = build_head(replace(mc, method="eagle2"), target, tokenizer, slots,
                             extra=LOOKUP_DEPTH, cache=cache)
    lookup = PromptLookupProposer(LOOKUP_DEPTH, mc.ngram_max, by_match=True)
    return LookupEagleProposer(eagle, lookup), info


def build_head(mc: MethodConfig, target, tokenizer, slots: int, extra: int = 0,
               cache: str | None = None) -> tuple:
    """Medusa / EAGLE / EAGLE-2 from a trained head folder (default: the shipped weights).
    extra: tokens verified beside the head's tree each step (a lookup chain), for auto's costs;
    cache: the folder that keeps auto's verify and drafting timings (None: timed every time)."""
    kind = HEAD_KIND[mc.method]
    folder = head_folder(mc.heads, kind)
    head, config = load_head(folder, target, kind)
    params = sum(p.numel() for p in head.parameters())
    head = quantize(head, draft_form(mc, head))
    proj = draft_projection(mc, target, head.vocab_ids)
    if mc.compile:
        head = compiled(head)
    # measured P(rank r right | path right) by depth; EAGLE-2 only ever drafts ranks < top_k
    accuracy = [row[:mc.top_k] if mc.method == "eagle2" else row for row in
                config.accuracy[:mc.depth]]

    def make(size: int, rule=None):
        if mc.method == "eagle2":                 # with a rule: `size` is the most per step
            return EagleProposer(target, head, DraftConfig(mc.depth, mc.top_k, size, rule), slots,
                                 proj=proj)
        if not accuracy:
            raise ValueError(f"{folder}/config.json has no measured accuracy to build a tree from")
        tree = static_tree(best_paths(accuracy, size))
        return (MedusaProposer(target, head, tree, proj) if kind == "medusa" else
                EagleProposer(target, head, DraftConfig(mc.depth), slots, tree, proj=proj))

    rule = None
    if mc.tree_size == "auto":
        size, rule = auto_tree_size(mc, target, tokenizer, accuracy, make, extra, cache, folder)
    else:
        size = mc.tree_size or mc.depth * mc.top_k                    # 0: as --help says
    proposer = make(per_step_most(mc.depth, mc.top_k) if rule else size, rule)
    memory = module_bytes(head) + module_bytes(proposer.proj)
    return proposer, {"draft": folder, "draft_params": params,
                      "draft_memory_mb": round(memory / 2**20, 1), "tree_size": size,
                      "per_step": rule is not None}


def share_embeddings(draft, target):
    """Point the draft at the target's embedding (and tied head) when they are equal: a
    distilled draft keeps the target's frozen one, and a second copy would cost memory."""
    w = target.embed.weight
    if draft.embed.weight.shape == w.shape and torch.equal(draft.embed.weight, w):
        draft.embed = target.embed
        if draft.config.tie_embeddings and target.config.tie_embeddings:
            draft.lm_head = target.lm_head
    return draft


def draft_form(mc: MethodConfig, module) -> str:
    """Drafts (heads, the draft model, their projections) run int8 where the kernel is fast: a
    draft decides what is proposed, never what is accepted, so its rounding can cost acceptance
    but never exactness; their matrices are small and cold, and reading them is most of a
    drafting round. The kernel is vectorized for bfloat16 inputs only: float32 and float16
    drafts stay float (int8 would be several times slower there, docs/RESULTS.md)."""
    p = next(module.parameters())
    usable = p.device.type == "cpu" and p.dtype == torch.bfloat16
    return "int8" if mc.draft_int8 and usable else "float"


def draft_projection(mc: MethodConfig, target, vocab_ids):
    """The target's lm_head rows of a draft vocabulary, as a module C -> R in the drafts' form."""
    proj = projection(target, vocab_ids)
    return convert(proj, draft_form(mc, proj), "the draft vocabulary's projection")


def head_folder(heads, kind: str) -> str:
    """The folder of `heads` that holds a head of this kind, else the one shipped in weights/."""
    chosen = [f for f in heads if read_head_config(f).kind == kind]
    if len(chosen) > 1:
        raise ValueError(f"--head: {' and '.join(chosen)} all hold {kind} heads; give one")
    return chosen[0] if chosen else os.path.join(WEIGHTS, f"smollm2-135m-{kind}")


def check_heads(heads, methods: list) -> None:
    """Each head folder must be read by one of the methods: a head given for nothing is a
    mistake (a typo in --methods, or the wrong folder), not something to ignore."""
    kinds = {HEAD_KIND[m] for m in methods if m in HEAD_KIND}
    for folder in heads:
        kind = read_head_config(folder).kind
        if kind not in kinds:
            users = ", ".join(m for m, k in HEAD_KIND.items() if k == kind)
            raise ValueError(f"--head {folder} holds {kind} heads, which only {users} draft "
                             f"with, and no such method was chosen ({', '.join(methods)})")


def room(mc: MethodConfig) -> int:
    """Cache slots a proposal may need beyond the committed tokens: the nodes it verifies, and
    those a draft model feeds its own cache while growing them."""
    return mc.depth * mc.top_k + tree_budget(mc) + 1


def tree_budget(mc: MethodConfig) -> int:
    """Most nodes a proposal may verify: the cache needs room for them."""
    lookup = LOOKUP_DEPTH if mc.method == "eagle2+ngram" else 0
    return (AUTO_MAX if mc.tree_size == "auto" else mc.tree_size) + lookup


def describe(mc: MethodConfig, info: dict) -> str:
    """The method's configuration in words, for the bench's tables."""
    size = info.get("tree_size") or mc.tree_size or mc.depth * mc.top_k
    nodes = "size per step" if info.get("per_step") else f"{size} nodes"
    shape = f"{mc.depth} x top-{mc.top_k}"
    return {"eagle2+ngram": f"{shape}, {nodes} + lookup <= {LOOKUP_DEPTH} (1 round after a "
                            "full match)",
            "ngram": f"chain of <= {mc.depth}, by match", "eagle2": f"{shape}, {nodes}",
            "medusa": f"{size}-node tree", "eagle": f"{size}-node tree"}.get(
        mc.method, f"chain of {mc.depth}")


# ---------------------------------------------------------------- the distilled draft's folder

DRAFT_VOCAB = "draft_vocab.json"


def load_draft_vocab(folder: str, vocab_size: int):
    """-> (R,) target ids from the draft folder's draft_vocab.json, or None where it has none."""
    path = os.path.join(folder, DRAFT_VOCAB)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        try:
            ids = json.load(f)
        except json.JSONDecodeError as e:
            raise LoadError(f"{path}: not JSON ({e})") from None
    if not (isinstance(ids, list) and ids and all(isinstance(i, int) and 0 <= i < vocab_size
                                                  for i in ids)):
        raise LoadError(f"{path}: expected a list of token ids below the vocabulary size {vocab_size}")
    return torch.tensor(sorted(set(ids)))


def draft_folder(folder: str, target_folder: str, cache: str) -> str:
    """-> a complete HF folder for the draft in `folder`: itself when it holds its embeddings,
    else a copy under `cache` with the target's embedding matrix added (built once, atomically)."""
    weights = f"{folder}/model.safetensors"
    if not os.path.isfile(weights):
        raise LoadError(f"{folder}: no model.safetensors; is this a draft folder?")
    config = read_json(f"{folder}/config.json", "the draft's config")
    if "kind" in config:                    # a head folder of train_heads.py
        raise LoadError(f"{folder} holds {config['kind']} heads, not a draft model (a HF "
                        f"Llama folder); heads go to --head")
    try:
        with safe_open(weights, framework="pt") as f:
            if "model.embed_tokens.weight" in f.keys():
                return folder
    except SafetensorError as e:
        raise LoadError(f"{weights}: truncated or corrupt ({e})") from None
    with open(weights, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:12]
    out = os.path.join(cache, f"draft-{os.path.basename(folder.rstrip('/'))}-{digest}")
    if os.path.isfile(f"{out}/model.safetensors"):
        return out
    target_files = [f"{target_folder}/model.safetensors"]
    if not os.path.isfile(target_files[0]):
        raise LoadError(f"{target_folder}: need a single model.safetensors to take the draft's "
                        "embeddings from")
    tied = config.get("tie_word_embeddings", False)
    names = ["model.embed_tokens.weight"] + ([] if tied else ["lm_head.weight"])
    with safe_open(target_files[0], framework="pt") as f:
        missing = [n for n in names if n not in f.keys()]
        if missing:                         # an untied draft of a tied target, say
            raise LoadError(f"{folder}: its embeddings come from the target, whose "
                            f"{target_files[0]} has no {', '.join(missing)}")
        shared = {n: f.get_tensor(n).bfloat16() for n in names}
    tensors = load_file(weights) | shared
    os.makedirs(cache, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".draft-", dir=cache)    # built whole, then placed
    try:
        built = os.path.join(work, "draft")
        shutil.copytree(folder, built)
        save_tensors(tensors, f"{built}/model.safetensors", {"format": "pt"})
        place_folder(built, out, os.path.join(work, "old"))  # or keep another process's
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def module_bytes(module) -> int:
    """Bytes of a module's parameters and buffers (0 for None)."""
    if module is None:
        return 0
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


# ---------------------------------------------------------------- --tree-size auto

def per_step_most(depth: int, top_k: int) -> int:
    """Most nodes EAGLE-2's per-step size may verify: all it drafts (top_k children of the
    root, then top_k x top_k per round), at most AUTO_MAX."""
    return min(top_k + (depth - 1) * top_k * top_k, AUTO_MAX)


def auto_tree_size(mc: MethodConfig, target, tokenizer, accuracy, make, extra: int = 0,
                   cache: str | None = None, folder: str = "") -> tuple:
    """The tree size with the most expected tokens per second on this machine: the head's
    measured accuracies give the expected tokens per step of each size (as Medusa's tree
    search does), the verify costs and the draft time of the head in `folder`, measured on
    this machine (once: `verify_costs`, `draft_time`), give the seconds. extra tokens (a lookup
    chain) are priced into every verify pass, not into the tokens gained.

    -> (size, rule): for EAGLE-2 also a proposers.SizeRule that chooses the size again at every
    step from the draft's own scores, at the rate this size predicts; None for static trees."""
    if not accuracy:
        raise ValueError("--tree-size auto needs the head's measured accuracy table (config.json)")
    expected = {n: expected_length(accuracy, n) for n in range(1, AUTO_MAX + 1)}
    costs = verify_costs(target, cache)
    draft_ms = draft_time(make(mc.depth), target, tokenizer, draft_key(mc, target, folder),
                          cache)                                # timed at size = depth
    drafting = draft_costs(mc.method, accuracy, draft_ms, mc.depth, expected)
    size, speed, verify_ms = choose_tree_size(expected, costs, drafting, extra)
    rule = None
    if mc.method == "eagle2" and not mc.compile:    # compiled: one padded shape, no rule
        most = per_step_most(mc.depth, mc.top_k)
        rule = SizeRule([verify_cost(costs, k) for k in range(most + extra + 2)],
                        rate=speed[size] / 1000, round_ms=draft_ms / mc.depth)
    if mc.verbose:                                  # how the trees were sized
        print(size_table(mc.method, size, draft_ms, mc.depth, extra, drafting, verify_ms,
                         expected, speed, rule), file=sys.stderr)
    return size, rule


def size_table(method, size, draft_ms, measured, extra, drafting, verify_ms, expected, speed,
               rule) -> str:
    """--verbose: auto's prices of each tree size, and the per-step rule it sets."""
    shown = [n for n in COST_SIZES if n <= AUTO_MAX] + ([size] if size not in COST_SIZES else [])
    beside = f", verify includes {extra} lookup tokens" if extra else ""
    lines = [f"tree size auto ({method}): draft {draft_ms:.1f} ms per step at size {measured}"
             f"{beside}", f"{'size':>6}{'draft ms':>10}{'verify ms':>11}{'E[tokens]':>11}"
             f"{'tok/s':>8}"]
    for n in sorted(shown):
        mark = "  <- chosen" if n == size else ""
        lines.append(f"{n:6d}{drafting[n]:10.1f}{verify_ms[n]:11.1f}{expected[n]:11.2f}"
                     f"{speed[n]:8.1f}{mark}")
    if rule:
        lines.append(f"  per step: verify the n of up to {len(rule.verify_ms) - extra - 2} drafted "
                     f"nodes that maximize 1 + their summed probabilities - {rule.rate:.3f} "
                     f"tokens/ms x verify ms; stop drafting when a round cannot add "
                     f"{rule.rate * rule.round_ms:.2f} expected tokens")
    return "\n".join(lines)


def draft_costs(method: str, accuracy: list, measured_ms: float, measured_size: int,
                sizes) -> dict:
    """{n: ms of drafting a tree of n nodes}, from the time measured at one size. EAGLE's
    static tree feeds the head once per depth level, so its drafting grows with the depth of
    the tree chosen for n (measured: docs/RESULTS.md); Medusa drafts every depth in one pass
    and EAGLE-2 runs all its rounds whatever it keeps, so theirs does not depend on n."""
    if method != "eagle":
        return {n: measured_ms for n in sizes}
    levels = {n: max(map(len, best_paths(accuracy, n))) for n in [*sizes, measured_size]}
    return {n: measured_ms * levels[n] / levels[measured_size] for n in sizes}


def draft_time(proposer, target, tokenizer, key: str | None, cache: str | None) -> float:
    """Median ms of one propose() call while decoding a fixed prompt (after a short warm-up):
    a one-time measurement like the verify costs, kept under key (`draft_key`)."""
    costs = kept_costs(cache, key, lambda: measure_draft_time(proposer, target, tokenizer),
                       "the head's drafting")
    return costs[0]


def measure_draft_time(proposer, target, tokenizer) -> tuple:
    """-> ({0: median ms a step}, whether the steps' times agreed)."""
    ids = tokenizer.chat_prompt(TIMING_PROMPT)
    generate_spec(target, proposer, ids, GenConfig(8), tokenizer.stop_ids)
    # enough tokens for several steps whatever the head accepts (a step may take 4 or more)
    times = generate_spec(target, proposer, ids, GenConfig(48), tokenizer.stop_ids).draft_seconds
    ms = {0: round(statistics.median(times) * 1000, 3)}
    if len(times) < 4:                         # too few steps to tell a quiet machine
        return ms, False
    low, _, high = statistics.quantiles(times, n=4)
    return ms, high <= NOISY * low


def draft_key(mc: MethodConfig, target, folder: str) -> str | None:
    """What drafting's time depends on besides what a forward's does (`cost_key`): the method
    and its tree settings, the head's files (its weights; its config's accuracies shape static
    trees) and the code that builds, drafts and times (proposers, heads, trees, this file, the
    loop); None without that code's source or the files."""
    base = cost_key(target)
    code = source_digest([inspect.getmodule(f) for f in (EagleProposer, best_paths, static_tree,
                                                         draft_key, generate_spec)])
    files = [os.path.abspath(os.path.join(folder, name))
             for name in ("model.safetensors", "config.json")]
    if base is None or code is None or not all(map(os.path.isfile, files)):
        return None
    stamps = ", ".join(f"{f}:{st.st_size}:{st.st_mtime_ns}" for f, st in
                       zip(files, map(os.stat, files)))
    return (f"{base}; drafting {mc.method} depth {mc.depth} top-k {mc.top_k} int8 "
            f"{mc.draft_int8}, {stamps}, code {code}")


NOISY = 1.5          # repeats of one size further apart than this: a burst of load
COSTS_FILE = "verify-costs.json"
COSTS_KEPT = 64      # entries the file keeps, the latest written: each code change adds its own


def verify_costs(model, cache: str | None = None) -> dict:
    """{k: ms} of a target forward over k tokens on this machine. They choose tree sizes only
    (with kernels that give a row the same bits in any call, no timing changes a token), so
    they are a one-time measurement (`kept_costs`), per machine, code and model shape."""
    key = cost_key(model)
    sizes = cost_sizes(model)
    return kept_costs(cache, key and f"{key}; sizes {','.join(map(str, sizes))}",
                      lambda: measure_verify_costs(model), "this machine's verify passes")


def kept_costs(cache: str | None, key: str | None, measure, what: str) -> dict:
    """The costs {k: ms} that measure() -> (costs, quiet) takes: kept in cache/verify-costs.json
    under key when the machine was quiet, read back silently on later runs until COSTS_KEPT
    newer entries push them out (delete the file to time them again); cache or key None:
    measured every time. Timings taken on a busy machine are said in one line and serve this
    run only."""
    path = os.path.join(cache, COSTS_FILE) if cache and key else None
    kept = read_costs(path) if path else {}
    if key in kept:
        return kept[key]
    if path:
        print(f"--tree-size auto: timing {what}, once (kept in {path} if the machine is quiet)",
              file=sys.stderr)
    costs, quiet = measure()
    if not quiet:
        print(f"note: the machine is busy: --tree-size auto chose from noisy timings of {what} "
              "(the text is the same; the speed may not be the best)"
              + ("; they are taken again next run" if path else ""), file=sys.stderr)
    if path and quiet:                     # a busy moment's timings serve this run only
        try:
            os.makedirs(cache, exist_ok=True)
            write_json(path, dict(list(kept.items())[1 - COSTS_KEPT:]) | {key: costs})
        except OSError:                    # a cache that cannot be written: timed next time
            pass
    return costs


def cost_sizes(model) -> tuple:
    """The forward sizes timed: beyond the last the cost is taken as proportional, as on a CPU;
    a GPU's is flat much further, so there the largest size a tree may need is timed too."""
    if model.embed.weight.device.type == "cpu":
        return COST_SIZES
    return COST_SIZES + (AUTO_MAX + LOOKUP_DEPTH + 1,)


def measure_verify_costs(model, tries: int = 3) -> tuple:
    """-> ({k: median ms}, whether the repeats agreed). Timings whose repeats disagree are
    taken again, up to `tries` times."""
    tried = []
    for _ in range(tries):
        times = forward_times(model, cost_sizes(model), repeats=3)
        spread = max(max(t) / min(t) for t in times.values())
        tried.append((spread, times))
        if spread <= NOISY:
            break
    spread, times = min(tried, key=lambda st: st[0])              # the least noisy try
    return {k: round(statistics.median(t) * 1000, 3) for k, t in times.items()}, spread <= NOISY


def cost_key(model) -> str | None:
    """What a forward's cost depends on: the device and its threads, torch, the code a forward
    runs (model.py, attention.py, quantize.py), whether its layers are compiled, and the
    model's shape, dtype and weight forms (not its weights' values); None without that code's
    source."""
    w, c = model.embed.weight, model.config
    code = source_digest([inspect.getmodule(f) for f in (Llama, attend, quantize)])
    if code is None:
        return None
    forms = "/".join(type(m).__name__ for m in (model.layers[0], model.layers[0].mlp.w2,
                                                 model.lm_head))
    shape = (c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads,
             c.head_dim, c.vocab_size)
    return (f"{w.device.type}: {machine_name(str(w.device))}; torch {torch.__version__}; code "
            f"{code}; {str(w.dtype).removeprefix('torch.')} {forms}; {'x'.join(map(str, shape))}")


def machine_name(device: str) -> str:
    """The CPU's (or GPU's) name and the thread count; for a CPU also its family and model
    numbers, since a virtual machine may name very different Xeons alike."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            fields = dict(ln.split(":", 1) for ln in f.read().split("\n\n")[0].splitlines()
                          if ":" in ln)
    except OSError:
        fields = {}
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields:
        name += f" ({fields['cpu family']}/{fields.get('model', '?')})"
    return f"{name} x{torch.get_num_threads()}"


def read_costs(path: str) -> dict:
    """{key: {k: ms}} kept so far; an unreadable file counts as empty (it is written anew)."""
    try:
        with open(path) as f:
            kept = json.load(f)
        return {key: {int(k): float(ms) for k, ms in costs.items()} for key, costs in kept.items()}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}


def forward_costs(model, sizes, batch: int = 1, prefix: int = 128, repeats: int = 5) -> dict:
    """{k: median ms} of one forward over k new tokens per row (batch rows) after a prefix."""
    times = forward_times(model, sizes, batch, prefix, repeats)
    return {k: round(statistics.median(t) * 1000, 3) for k, t in times.items()}


@torch.inference_mode()                 # timed as decoding runs: without autograd's bookkeeping
def forward_times(model, sizes, batch: int = 1, prefix: int = 128, repeats: int = 5) -> dict:
    """{k: [seconds of each repeat]} of one forward over k new tokens per row after a prefix.

    The sizes take turns, one forward each per round: a burst of load on this shared machine
    then slows one round of every size, not all repeats of one."""
    device = model.embed.weight.device
    cache = model.new_cache(batch, prefix + max(sizes))
    pos = torch.arange(prefix, device=device)[None]
    model((pos % model.config.vocab_size).expand(batch, prefix), pos, cache)
    times = {k: [] for k in sizes}
    for _ in range(repeats):
        for k in sizes:
            cache.length = prefix
            new = torch.arange(k, device=device)[None]
            t0 = time.perf_counter()
            model((new % model.config.vocab_size).expand(batch, k), new + prefix, cache)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[k].append(time.perf_counter() - t0)
    return times
