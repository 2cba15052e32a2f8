"""Each decoding method built from its configuration: the target, then one function per method
that makes its proposer (spec.py and bench.py map their flags onto these dataclasses).

    target = load_target(TargetConfig())                        # (path, Llama, Tokenizer)
    proposer, info = build_proposer(method_config("eagle2"), *target, slots)
"""
import argparse
import os
import sys
from dataclasses import dataclass, replace

import torch

from checkpoint import load_head, load_model, read_head_config, read_json
from costs import AUTO_MAX, Priced, Sizer
from default_model import WEIGHTS, default_model_path
from heads import best_paths, projection
from kernel import Compiled, check_rows
from model import Llama, LlamaConfig, LoadError, RopeScaling
from proposers import (DraftConfig, DraftModelProposer, EagleProposer, LookupEagleProposer,
                       MedusaProposer, PromptLookupProposer, SizeRule)
from quantize import convert, load_quantized, quantize
from tokenizer import load_tokenizer
from tree import static_tree

METHODS = ["ar", "draft", "draft-chain", "ngram", "medusa", "eagle", "eagle2", "eagle2+ngram",
           "eagle3", "block"]
PARALLEL_DEPTH = 3                     # a parallel draft's block: 4 rows verified, which the
                                       # int4 kernel charges little more than 2 (docs/RESULTS.md)
# (depth, top-k, tree size) per method, measured (docs/RESULTS.md): auto beat every fixed tree
# size tried for the head methods; with 5-node trees a 4th EAGLE-2 round rarely pays; ngram's 3
# is its most tokens (a match of n of ngram_max tokens drafts n / ngram_max of them); the
# distilled draft's second token is accepted in 9% of steps, for a forward of its own each
# (draft-chain, and draft where its folder names no mask token); a parallel draft drafts its
# block in one forward; a block head's block of 3 cut by auto beat its fixed block of 2
TREE_DEFAULTS = {"draft": (PARALLEL_DEPTH, 1, 0), "draft-chain": (1, 1, 0), "ngram": (3, 1, 0),
                 "medusa": (4, 1, "auto"), "eagle": (5, 1, "auto"), "eagle2": (3, 4, "auto"),
                 "eagle2+ngram": (3, 4, "auto"), "eagle3": (3, 4, "auto"), "block": (3, 1, "auto")}
HEAD_KIND = {"medusa": "medusa", "eagle": "eagle", "eagle2": "eagle", "eagle2+ngram": "eagle",
             "eagle3": "eagle3", "block": "block"}
# the head kinds each method's kind drafts with (the EAGLE methods: either layout); the last is
# the kind of the head weights/ ships for it
LAYOUTS = {"medusa": ("medusa",), "eagle": ("eagle", "eagle3"), "eagle3": ("eagle3",),
           "block": ("block",)}     # an EAGLE-3 head that names a mask token (folder_kind)
GROWN = ("eagle2", "eagle3")             # EAGLE-2's dynamic tree (eagle3: an EAGLE-3 head's)
# eagle2+ngram's lookup branch, scaled by the match (2, 4 or 6 tokens after a match of 1, 2 or
# 3): 6 measured best of 3, 6, 12 and 24 (docs/RESULTS.md)
LOOKUP_DEPTH = 6
# --compile --tree-size auto: the size trees are padded to, auto's largest (docs/RESULTS.md)
COMPILED_NODES = 2
RANDOM = "random:"                     # TargetConfig.model random:SHAPE: random weights (SHAPES)


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
    compile: bool = False          # the target's steps compiled (kernel.Compiled): fixed tree sizes
    verbose: bool = False          # print the prices --tree-size auto chose from


def method_config(method: str, depth=None, top_k=None, tree_size=None, **options) -> MethodConfig:
    """MethodConfig with the method's measured depth, top-k and tree size where None is given."""
    d, k, s = TREE_DEFAULTS.get(method, (4, 1, 0))
    if method == "draft" and check_draft_folder(draft_folder(options.get("draft"))) is None:
        d = TREE_DEFAULTS["draft-chain"][0]      # no mask token in its folder: it drafts a chain
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
    return ("cuda" if torch.cuda.is_available() else
            "mps" if torch.backends.mps.is_available() else "cpu")


def weight_forms(tc: TargetConfig) -> tuple:
    """(form of the decoder's matrices, of the lm_head), as --help says for --weights; a
    quantized model's lm_head in int8 (measured: docs/RESULTS.md)."""
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


def random_model(name: str, dtype=torch.float32, device="cpu", layers: int = 0) -> Llama:
    """A Llama of a known shape (SHAPES) with nn's default random init, built on the device;
    layers: cut to that many (0: all)."""
    if name not in SHAPES:
        raise LoadError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)          # built in dtype: 8B in fp32 first would need 32 GB
    try:
        with torch.device(device):
            model = Llama(replace(SHAPES[name], num_layers=layers or SHAPES[name].num_layers))
    finally:
        torch.set_default_dtype(default)
    return model.to(device).eval()                   # the RoPE tables were built on the CPU


# ---------------------------------------------------------------- one builder per method

def build_proposer(mc: MethodConfig, path: str, target, tokenizer, slots: int) -> tuple:
    """-> (proposer, info: what drafts and the memory it adds). path: the target's folder (a
    shipped draft takes its embeddings from it); slots: the caches' size."""
    if mc.method == "ngram":                # prompt lookup: up to depth tokens, by the match
        info = {"draft": f"prompt lookup, n <= {mc.ngram_max}", "draft_params": 0,
                "draft_memory_mb": 0.0}
        return PromptLookupProposer(mc.depth, mc.ngram_max), info
    if mc.method in ("draft", "draft-chain"):
        return build_draft(mc, path, target, tokenizer, slots)
    if mc.method in HEAD_KIND:      # eagle2+ngram: EAGLE-2's tree, the prompt-lookup chain one
        lookup = mc.method == "eagle2+ngram"    # more branch in every pass (auto prices it in)
        proposer, sizer, info = build_head(replace(mc, method="eagle2") if lookup else mc, target,
                                           slots, extra=LOOKUP_DEPTH * lookup)
        if lookup:
            proposer = LookupEagleProposer(proposer,
                                           PromptLookupProposer(LOOKUP_DEPTH, mc.ngram_max))
        return (Priced(proposer, sizer) if sizer else proposer), info
    raise ValueError(f"no proposer for method {mc.method!r}; methods: {', '.join(METHODS[1:])}")


def exact_routes(target, compiled: bool = False) -> list:
    """kernel.check_rows, the same whatever the method, so that plain decoding and every method
    take the same routes (prefills included) -> a line per kernel sent the safe route. Compiled
    attention has no such route: there a ValueError says so in one line."""
    lines = check_rows(target)
    if compiled and target.alone:
        raise ValueError("--compile: attention's rows depend on the call on this machine (the "
                         "check at start); run without --compile, which computes them alone")
    return lines


def check_compiler() -> None:
    """Compile a one-line function, so that a machine that cannot (no C++ compiler, no backend
    for the device) is told in one line before a model is loaded; never inductor's traceback."""
    try:
        torch.compile(lambda x: x * 2 + 1, fullgraph=True)(torch.ones(8))
    except Exception as e:                      # inductor raises many kinds; all mean the same
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise ValueError(f"--compile: torch cannot compile on this machine ({reason}); "
                           f"run without --compile: eager decoding works") from None


def compiled_verifier(target, mc: MethodConfig, proposer, slots: int) -> Compiled:
    """--compile's target: chain methods (ngram, draft) keep graphs of 1, 2, 4, ... tokens and
    their most; tree methods of 1 token and their trees' padded size (docs/RESULTS.md: why)."""
    most, chains = proposer.max_nodes, mc.method in ("ngram", "draft", "draft-chain", "block")
    sizes = {min(1 << i, most) for i in range(most.bit_length() + 1)} if chains else (1, most)
    return Compiled(target, sizes, slots, getattr(proposer, "taps", ()), trees=not chains)


def build_draft(mc: MethodConfig, path: str, target, tokenizer, slots: int) -> tuple:
    """A smaller Llama with the target's tokenizer; greedy drafts over its folder's reduced
    vocabulary (draft_vocab.json) where it has one; `draft` drafts its block in one forward
    where its config.json names a mask token (pard_token: a parallel draft), draft-chain a
    forward a token."""
    folder = draft_folder(mc.draft)
    mask_id = check_draft_folder(folder, target.config.vocab_size)
    mask_id = mask_id if mc.method == "draft" else None
    why = tokenizer.same_as(load_tokenizer(folder))
    if why:
        raise ValueError(f"draft and target tokenizers differ: {why}. A draft must share the "
                         "target's exact tokenizer, or its tokens mean other words")
    w = target.embed.weight
    draft = share_embeddings(load_model(folder, w.dtype, w.device, embeddings_from=path), target)
    own = {id(t) for t in [*target.parameters(), *target.buffers()]}
    params = sum(p.numel() for p in draft.parameters() if id(p) not in own)  # its own only
    draft = quantize(draft, draft_form(mc, draft), rows=False)  # the target's shared: skipped
    vocab = load_draft_vocab(folder, target.config.vocab_size)
    proj = None if vocab is None else draft_projection(mc, target, vocab)
    # compiled: a chain's steps of 1 token and of 2 (the root after a chain accepted whole);
    # a parallel one's of the root and its masks, after up to a whole block accepted
    sizes = (1, 2) if mask_id is None else (mc.depth, 2 * mc.depth)
    fast = (Compiled(draft, sizes, slots, project=False).warm_up("the draft model")
            if mc.compile else draft)
    proposer = DraftModelProposer(fast, mc.depth, slots, vocab, proj, mask_id)
    extra = module_bytes(draft, own) + module_bytes(proposer.proj)
    if vocab is not None:
        folder += f" (greedy drafts over {len(vocab):,} tokens)"
    return proposer, {"draft": folder, "draft_params": params, "parallel": mask_id is not None,
                      "draft_memory_mb": round(extra / 2**20, 1)}


def draft_folder(draft: str | None) -> str:
    return draft or os.path.join(WEIGHTS, "smollm2-135m-draft")      # None: the shipped draft


def check_draft_folder(folder: str, vocab_size: int | None = None):
    """A clear error for a folder that is no draft model (a head's folder, say) -> its mask
    token (pard_token) where it is a parallel draft, else None."""
    if not os.path.isdir(folder):
        raise LoadError(f"{folder}: not a folder (a draft is a HF Llama folder)")
    if not os.path.isfile(f"{folder}/model.safetensors"):
        raise LoadError(f"{folder}: no model.safetensors; is this a draft folder?")
    config = read_json(f"{folder}/config.json", "the draft's config")
    if "kind" in config:                    # a head folder of train_heads.py
        raise LoadError(f"{folder} holds {config['kind']} heads, not a draft model (a HF "
                        f"Llama folder); heads go to --head")
    mask = config.get("pard_token")
    if mask is not None and not (type(mask) is int and 0 <= mask < (vocab_size or mask + 1)):
        raise LoadError(f"{folder}/config.json: pard_token {mask!r} is no token id of the "
                        f"target's vocabulary")
    return mask


def build_head(mc: MethodConfig, target, slots: int, extra: int = 0) -> tuple:
    """Medusa / EAGLE / EAGLE-2 from a trained head folder (default: the shipped weights).
    extra: tokens verified beside the head's tree each step (a lookup chain), for auto's prices.
    -> (proposer, costs.Sizer for --tree-size auto or None, info)."""
    folder, kind = head_folder(mc.heads, HEAD_KIND[mc.method])
    kind = "eagle3" if kind == "block" else kind              # a block head's layout
    head, config = load_head(folder, target, kind)
    params = sum(p.numel() for p in head.parameters())
    head = quantize(head, draft_form(mc, head), rows=False)
    proj = (head.projection() if kind == "eagle3" else    # its own, else the target's rows
            draft_projection(mc, target, head.vocab_ids))
    # measured P(rank r right | path right) by depth; EAGLE-2 only ever drafts ranks < top_k
    accuracy = [row[:mc.top_k] if mc.method in (*GROWN, "block") else row for row in
                config.accuracy[:mc.depth]]
    auto = mc.tree_size == "auto"
    # most nodes a step may verify: all EAGLE-2 drafts (k root children, then k x k a round);
    # compiled, the tree size the verifier is padded to (auto prices the sizes up to it)
    cap = COMPILED_NODES if mc.compile and auto else AUTO_MAX
    most = min(mc.top_k + (mc.depth - 1) * mc.top_k * mc.top_k, cap)
    if auto and not accuracy:
        raise ValueError(f"{folder} records no measured accuracy, which --tree-size auto prices "
                         f"trees with; give --tree-size N")
    rule = SizeRule(most, accuracy) if auto and mc.method in (*GROWN, "block") else None  # per step
    if mc.method == "block":
        size = mc.depth
        proposer = EagleProposer(target, head, DraftConfig(mc.depth, rule=rule), slots, proj=proj,
                                 mask_id=config.mask_token)
    elif mc.method in GROWN:                # no round deeper than the nodes kept (a subtree)
        size = most if auto else min(mc.tree_size or mc.depth * mc.top_k, most)  # 0: as --help
        proposer = EagleProposer(target, head, DraftConfig(min(mc.depth, size), mc.top_k, size,
                                                           rule), slots, proj=proj)
    else:
        if not accuracy:
            raise ValueError(f"{folder}/config.json has no measured accuracy to build a tree from")
        size = cap if auto else mc.tree_size or mc.depth * mc.top_k
        tree = static_tree(best_paths(accuracy, size))
        proposer = (MedusaProposer(target, head, tree, proj, mc.compile) if kind == "medusa" else
                    EagleProposer(target, head, DraftConfig(mc.depth), slots, tree, proj=proj))
    sizer = (Sizer(mc.method, accuracy, min(mc.depth, size), extra, rule, mc.verbose, cap)
             if auto else None)              # depth: EAGLE-2's rounds, which it prices
    memory = module_bytes(head) + module_bytes(proposer.proj) * (kind != "eagle3")
    return proposer, sizer, {"draft": folder, "draft_params": params,
                             "draft_memory_mb": round(memory / 2**20, 1),
                             "tree_size": "auto" if auto else size}


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
    """Drafts run int8 where the kernel is fast (bfloat16 on CPU, docs/RESULTS.md): a draft
    decides what is proposed, never what is accepted, so its rounding never costs exactness."""
    p = next(module.parameters())
    usable = p.device.type == "cpu" and p.dtype == torch.bfloat16
    return "int8" if mc.draft_int8 and usable else "float"


def draft_projection(mc: MethodConfig, target, vocab_ids):
    """The target's lm_head rows of a draft vocabulary, as a module C -> R in the drafts' form."""
    proj = projection(target, vocab_ids)
    return convert(proj, draft_form(mc, proj), "the draft vocabulary's projection", rows=False)


def head_folder(heads, kind: str) -> tuple:
    """-> (folder, its head's kind): the head in `heads` of this kind, else of another of its
    LAYOUTS (eagle2 and eagle3 rows can so compare two heads), else the one in weights/: one
    EAGLE head is shipped, an EAGLE-3 one, which every EAGLE method drafts with."""
    given = [(f, folder_kind(f)) for f in heads]
    chosen = [g for g in given if g[1] == kind] or [g for g in given if g[1] in LAYOUTS[kind]]
    if len(chosen) > 1:
        raise ValueError(f"--head: {' and '.join(f for f, _ in chosen)} all hold heads for "
                         f"{kind}; give one")
    if kind == "block" and not chosen:
        raise ValueError("--method block needs --head DIR, a block head (none is shipped): "
                         "train_heads.py --method eagle3 --parallel K writes one")
    shipped = LAYOUTS[kind][-1]
    return chosen[0] if chosen else (os.path.join(WEIGHTS, f"smollm2-135m-{shipped}"), shipped)


def folder_kind(folder: str) -> str:
    """A head folder's kind, "block" for an EAGLE-3 head that names a mask token."""
    config = read_head_config(folder)
    return "block" if config.mask_token is not None else config.kind


def check_heads(heads, methods: list) -> None:
    """Each head folder must be read by one of the methods: a head given for nothing is a
    mistake (a typo in --methods, or the wrong folder), not something to ignore."""
    kinds = {HEAD_KIND[m] for m in methods if m in HEAD_KIND}
    for folder in heads:
        kind = folder_kind(folder)
        if not any(kind in LAYOUTS[k] for k in kinds):
            users = ", ".join(m for m, k in HEAD_KIND.items() if kind in LAYOUTS[k])
            raise ValueError(f"--head {folder} holds {kind} heads, which only {users} draft "
                             f"with, and no such method was chosen ({', '.join(methods)})")
    for kind in kinds:
        head_folder(heads, kind)                        # one head a kind


def room(mc: MethodConfig) -> int:
    """Cache slots a proposal may need beyond the committed tokens: the nodes it verifies (a
    lookup chain's too), and those a draft model feeds its own cache while growing them."""
    verified = (AUTO_MAX if mc.tree_size == "auto" else mc.tree_size) + \
        LOOKUP_DEPTH * (mc.method == "eagle2+ngram")
    return mc.depth * mc.top_k + verified + 1


def describe(mc: MethodConfig, info: dict) -> str:
    """The method's configuration in words, for the bench's tables."""
    size = info.get("tree_size") or mc.tree_size or mc.depth * mc.top_k
    grown, tree = f"{mc.depth} x top-{mc.top_k}, {size} nodes", f"{size}-node tree"
    return {"eagle2+ngram": f"{grown} + lookup <= {LOOKUP_DEPTH} (1 round after a full match)",
            "ngram": f"chain of <= {mc.depth}, by match", "medusa": tree, "eagle": tree,
            "eagle2": grown, "eagle3": grown,
            "draft": f"chain of {mc.depth}" + ", one forward" * info.get("parallel", False),
            "block": f"block of {mc.depth}, one forward{', cut by auto' * (size == 'auto')}"
            }.get(mc.method, f"chain of {mc.depth}")


# ---------------------------------------------------------------- the distilled draft's folder

DRAFT_VOCAB = "draft_vocab.json"


def load_draft_vocab(folder: str, vocab_size: int):
    """-> (R,) target ids from the draft folder's draft_vocab.json, or None where it has none."""
    path = os.path.join(folder, DRAFT_VOCAB)
    if not os.path.isfile(path):
        return None
    ids = read_json(path, DRAFT_VOCAB, object)
    if not (isinstance(ids, list) and ids and all(isinstance(i, int) and 0 <= i < vocab_size
                                                  for i in ids)):
        raise LoadError(f"{path}: expected a list of token ids below the vocabulary size {vocab_size}")
    return torch.tensor(sorted(set(ids)))


def module_bytes(module, skip=()) -> int:
    """Bytes of a module's parameters and buffers (0 for None), but those whose id is in skip."""
    tensors = [] if module is None else [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors if id(t) not in skip)
