"""Train draft heads (EAGLE, Medusa) and a distilled draft model on the target's own outputs.

    python train_heads.py --method eagle3 --data prompts.jsonl --out my-eagle3
    python train_heads.py --method draft --data prompts.jsonl --out my-draft   # a HF Llama folder

Two stages, both resumable:
  1. features: the target reads (or, for prompt-only lines, first writes) each conversation; its
     tokens and final hidden states go to FEATURES/shard_*.safetensors in 16-bit.
  2. training: the proposer learns from those shards (EAGLE and Medusa: cross-entropy against the
     target's greedy token; the draft model: KL to the target's full distribution, computed from
     the cached feature through the target's lm_head); checkpoints every few minutes.
At the end tau is measured with the real decoding loop on held-out prompts and written, with the
data, steps, wall time and losses, to OUT/training.json.

    python train_heads.py export my-eagle OUT --format eagle

writes a trained EAGLE head in the EAGLE authors' format, for serving engines (export.py).
"""
import argparse
import copy
import hashlib
import json
import os
import shutil
import sys
from dataclasses import asdict, replace

import torch
from safetensors.torch import load_file
from torch import nn

from checkpoint import (load_head, load_model, read_head_config, read_json, save_tensors,
                        to_hf_names, write_json)
from default_model import default_model_path
from export import FORMATS, check_export, export_draft, export_head
from features import (draft_vocabulary, extract_features, load_features, make_batch,
                      read_conversations, templated_prompts)
from heads import HeadConfig, build_head, eagle3_taps, eagle_layer_config, projection_rows
from methods import (DRAFT_VOCAB, check_draft_folder, load_draft_vocab, parse_flags,
                     share_embeddings)
from model import Llama, LlamaConfig
from proposers import DraftModelProposer
from tokenizer import load_tokenizer
from training import (CHECKPOINT, UNROLL, TrainConfig, accuracy_table, block_loss, draft_loss,
                      eagle3_batch, eagle_loss, held_out_tau, measure_tau, medusa_loss,
                      record_fields, train)


# ---------------------------------------------------------------- command line

def parse_args(argv=None):
    return parse_flags(argv, __doc__, (data_flags, shape_flags, optimizer_flags), check_ranges)


def data_flags(p) -> None:
    """What to train, from which target and data, and where the features go."""
    p.add_argument("--method", choices=["eagle", "eagle3", "medusa", "draft"], required=True,
                   help="what to train: the EAGLE head (used by spec.py --method eagle and "
                        "eagle2), an EAGLE-3 head (three of the target's layers: spec.py "
                        "--method eagle3), Medusa heads, or a distilled draft model")
    p.add_argument("--data", required=True,
                   help="JSONL with `prompt` (the target writes the answer) or `messages`")
    p.add_argument("--out", required=True, help="folder for the trained weights")
    p.add_argument("--model", help="target HF folder (default: the embedded default model)")
    p.add_argument("--cache-dir", help="where the default model lives (default ~/.cache/spec-decode)")
    p.add_argument("--features", help="feature cache folder (default: beside the target model, "
                                      "named after the data file); training reads a comma-"
                                      "separated list of them, holding out the last folder's last "
                                      "sequences")
    p.add_argument("--stage", choices=["features", "train", "all"], default="all",
                   help="stop after feature extraction, or only train from existing features")
    p.add_argument("--limit", type=int, default=0, help="use the first N data lines (0: all)")
    p.add_argument("--sources", type=lambda s: tuple(s.split(",")), default=(), metavar="A,B",
                   help="use only --data lines whose 'source' field is one of these")
    p.add_argument("--template", action="append", default=[], metavar="TEXT",
                   help="rewrite every prompt as TEXT with {prompt} replaced (given several "
                        "times: one drawn at random per prompt), for the target to answer; "
                        "features go to a folder of their own")
    p.add_argument("--batch", type=int, default=64, help="sequences per target forward")
    p.add_argument("--max-new-tokens", type=int, default=192,
                   help="longest answer the target writes (or that is kept of a dataset answer)")
    p.add_argument("--max-prompt-tokens", type=int, default=384, help="skip longer prompts")
    p.add_argument("--device", help="cpu, cuda, ... for the target, the head and the batches "
                                    "(default: the best available); the shards stay on disk")


def shape_flags(p) -> None:
    """The head or draft trained: its vocabulary, size and start."""
    p.add_argument("--draft-vocab", type=int, default=8192,
                   help="R: the heads (and the draft model's greedy drafts) predict over the R most "
                        "frequent answer tokens")
    p.add_argument("--heads", type=int, default=4, help="Medusa: number of heads")
    p.add_argument("--layers", type=int, default=4,
                   help="draft: decoder layers, started from evenly spaced target layers")
    p.add_argument("--parallel", type=int, default=1, metavar="K",
                   help="draft, eagle3: train it to draft K tokens in one forward (mask tokens "
                        "after the last token: PARD's for spec.py --method draft, a block head's "
                        "for --method block); 1: a chain, a forward a token")
    p.add_argument("--without-embeddings", action="store_true",
                   help="draft: leave the (frozen, target-equal) embedding matrix out of the "
                        "saved folder; spec.py rebuilds it from the target at first use. This "
                        "is how the shipped draft is stored")
    p.add_argument("--init", metavar="FOLDER",
                   help="start from the head (EAGLE, Medusa) or draft model in FOLDER (this "
                        "script's), e.g. a shipped one, to train it on; its shape and draft "
                        "vocabulary are kept (--draft-vocab, --heads and --layers then do not "
                        "apply)")
    p.add_argument("--wise", type=float, default=1.0, metavar="ALPHA",
                   help="EAGLE, Medusa with --init: keep ALPHA of the way from the --init head to "
                        "the trained one, weight by weight (WiSE-FT; 1: as trained), before the "
                        "measurements; a rerun of a finished run applies it to its checkpoint")


def optimizer_flags(p) -> None:
    """How long and how it learns, and what is held out to measure it."""
    d = TrainConfig()
    p.add_argument("--held-out", type=int, default=128,
                   help="sequences kept out of training to measure accuracy and tau")
    p.add_argument("--tau-prompts", type=int, default=10, help="held-out prompts decoded for tau")
    p.add_argument("--epochs", type=float, default=d.epochs, help="passes over the training data")
    p.add_argument("--minutes", type=float, default=d.minutes,
                   help="stop training after this many minutes (0: no limit); rerun to resume")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    p.add_argument("--tokens-per-batch", type=int, default=d.tokens_per_batch,
                   help="padded tokens per optimizer step")
    p.add_argument("--seed", type=int, default=d.seed, help="shuffling and initialization seed")


def check_ranges(p, args) -> None:
    """Out-of-range numbers are named before any loading, not after minutes of extraction
    (or silently: --epochs 0 used to run a step)."""
    positive = ("epochs", "lr", "batch", "max_new_tokens", "max_prompt_tokens", "draft_vocab",
                "heads", "layers", "tokens_per_batch", "parallel")
    at_least_0 = ("minutes", "limit", "held_out", "tau_prompts")
    for name in positive + at_least_0:
        value = getattr(args, name)
        if value < 0 or (value == 0 and name in positive):
            flag = "--" + name.replace("_", "-")
            p.error(f"{flag} must be {'> 0' if name in positive else '>= 0'}, got {value}")


def default_features_dir(args, model_path: str) -> str:
    root = os.path.dirname(model_path.rstrip("/"))
    name = os.path.splitext(os.path.basename(args.data))[0] + "-taps" * (args.method == "eagle3")
    if args.sources or args.template:       # a different set of conversations: its own folder
        what = json.dumps([sorted(args.sources), args.template, args.seed]).encode()
        name += "-" + hashlib.sha1(what).hexdigest()[:8]
    return os.path.join(root, f"features-{name}")


def export_flags(p) -> None:
    """train_heads.py export HEAD_DIR OUT: a trained head in a serving engine's format."""
    p.prog = "train_heads.py export"
    p.add_argument("head", metavar="HEAD_DIR", help="a head (or distilled draft) folder written "
                                                     "by this script")
    p.add_argument("out", metavar="OUT", help="folder to write (new, or empty)")
    p.add_argument("--format", choices=FORMATS, required=True,
                   help="eagle: an EAGLE head in the EAGLE authors' layout (SGLang loads it); "
                        "eagle3: an EAGLE-3 head as SpecForge writes it (SGLang, vLLM); "
                        "hf: the distilled draft as a whole HF Llama folder")
    p.add_argument("--force", action="store_true", help="replace OUT if it is not empty")
    p.add_argument("--model", help="the target HF folder the head was trained for, whose "
                                   "embedding the export holds (default: the embedded model)")
    p.add_argument("--cache-dir", help="where the default model lives (default ~/.cache/spec-decode)")
    p.add_argument("--device", help=argparse.SUPPRESS)      # parse_flags resolves one; unused


def export_command(args) -> None:
    check_export(args.head, args.out, args.format, args.force)       # before the target loads
    model_path = args.model or default_model_path(args.cache_dir)
    if args.format == "hf":
        export_draft(args.head, model_path, args.out, args.force)
    else:
        export_head(args.head, load_model(model_path, torch.float32, "cpu"), args.out,
                    args.format, args.force)
    print(f"wrote {args.out} ({args.format} format)", file=sys.stderr)


def main(argv=None):
    """The command line: bad input is one `error:` line and exit code 2, Ctrl-C one line and
    130 (what a run finished stays: feature shards and checkpoints are whole files)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    exporting = argv[:1] == ["export"]
    args = (parse_flags(argv[1:], export_flags.__doc__, [export_flags], lambda p, a: None)
            if exporting else parse_args(argv))
    try:
        export_command(args) if exporting else train_command(args)
    except (ValueError, OSError) as e:       # bad data, a missing file, a head that does not fit
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)                          # spec.py's code for bad input too
    except KeyboardInterrupt:
        print("\ninterrupted: rerun the same command to resume", file=sys.stderr)
        sys.exit(130)


def train_command(args) -> None:
    if args.parallel > 1 and args.method not in ("draft", "eagle3"):
        raise ValueError(f"--parallel {args.parallel}: only a draft model and an EAGLE-3 head "
                         "(--method draft, eagle3) draft a block a forward")
    if not 0 <= args.wise <= 1 or (args.wise < 1 and not args.init):
        raise ValueError(f"--wise {args.wise}: a weight in [0, 1] between an --init head and "
                         "the one trained from it; it needs --init")
    if args.init and args.method == "draft":         # read now, as a head's below
        check_draft_folder(args.init)
    elif args.init:              # read now, not after an hour of self-distillation
        init = read_head_config(args.init)
        if init.kind != args.method:
            raise ValueError(f"--init {args.init} holds {init.kind} heads; --method "
                             f"{args.method} trains {args.method} heads")
    check_out(args.out)
    extracting = args.stage in ("features", "all")
    if extracting:               # the data first: a bad line is named before any loading
        rows = read_conversations(args.data, args.sources)
        rows = templated_prompts(rows, args.template, args.seed) if args.template else rows
        rows = rows[:args.limit] if args.limit else rows
    model_path = args.model or default_model_path(args.cache_dir)
    features = args.features or default_features_dir(args, model_path)
    tokenizer = load_tokenizer(model_path)
    if extracting:
        if "," in features:
            raise ValueError(f"--features {features}: the features stage writes one folder")
        target = load_model(model_path, torch.bfloat16, args.device)
        N = target.config.num_layers            # EAGLE-3: its taps, and N for the labels
        taps = eagle3_taps(N) + [N] if args.method == "eagle3" else ()
        extract_features(target, tokenizer, rows, features, args.batch, args.max_new_tokens,
                         args.max_prompt_tokens, taps)
    if args.stage in ("train", "all"):
        train_and_save(args, model_path, features, tokenizer)


def check_out(out: str) -> None:
    """--out must take files: found now, not after an hour of feature extraction."""
    made = not os.path.exists(out)
    try:
        os.makedirs(out, exist_ok=True)
        probe = os.path.join(out, ".write-test")
        open(probe, "w").close()
        os.remove(probe)
        if made:
            os.rmdir(out)                     # made again when there is something to write
    except OSError as e:
        raise ValueError(f"--out {out}: cannot write there ({e.strerror})") from None


def train_and_save(args, model_path: str, features: str, tokenizer) -> None:
    torch.manual_seed(args.seed)
    target = load_model(model_path, torch.float32, args.device).requires_grad_(False)
    seqs = [s for folder in features.split(",")            # "~" after a comma: the shell keeps it
            for s in load_features(os.path.expanduser(folder))]
    if args.method != "eagle3":         # an EAGLE-3 folder holds [taps; final hidden]: the final
        seqs = [replace(s, hidden=s.hidden[:, -target.config.hidden_size:]) for s in seqs]
    if len(seqs) <= args.held_out:
        raise ValueError(f"{len(seqs)} sequences in {features}: need more than --held-out "
                         f"{args.held_out}")
    train_seqs, held = seqs[:-args.held_out], seqs[-args.held_out:]
    os.makedirs(args.out, exist_ok=True)
    tc = TrainConfig(epochs=args.epochs, minutes=args.minutes, lr=args.lr,
                     tokens_per_batch=args.tokens_per_batch, seed=args.seed)
    run = train_draft if args.method == "draft" else train_head
    info = {"method": args.method, "data": os.path.abspath(args.data), "features": features,
            "train_sequences": len(train_seqs), "held_out_sequences": len(held),
            "train_tokens": sum(len(s.tokens) for s in train_seqs), "config": vars(args)}
    info |= run(args, tc, target, model_path, train_seqs, held, tokenizer, info)
    print(json.dumps({k: info[k] for k in ("steps", "wall_seconds", "final_ce", "held_out_tau")}))


def train_head(args, tc, target, model_path, train_seqs, held, tokenizer, info) -> dict:
    head, config = (init_head(args, target) if args.init
                    else new_head(args, target, train_seqs, tokenizer.stop_ids))
    block = args.parallel > 1                            # a block head (--method block)
    config.block, config.mask_token = (args.parallel, mask_token(tokenizer)) if block else (0, None)
    proj = projection_rows(target, head.vocab_ids)                         # (R, C)
    if args.init:                       # what the head had learned before: its own record
        record = os.path.join(args.init, "training.json")
        info = info | {"init": {"folder": os.path.abspath(args.init), "training": read_json(
            record, "training.json") if os.path.isfile(record) else None}}
    def loss_fn(seqs):
        b = make_batch(seqs).to(proj.device)
        if args.method == "medusa":
            return medusa_loss(head, proj, b)
        if args.method == "eagle":
            return eagle_loss(head, target.embed, proj, b)
        b = eagle3_batch(b, proj.shape[1])
        if args.parallel > 1:                           # a block head: no unroll
            return block_loss(head, target.embed, proj, b, args.parallel, config.mask_token)
        return eagle_loss(head, target.embed, proj, b, feature_weight=0)   # its recipe
    record = train(head, loss_fn, train_seqs, tc, args.out)
    if args.init and args.wise < 1:
        interpolate(head, init_head(args, target)[0], args.wise)
    head.eval()
    depth = args.heads if args.method == "medusa" else max(UNROLL, 6)
    config.accuracy = [[round(a, 4) for a in row]
                       for row in accuracy_table(target, head, args.method, held, depth)]
    tau = held_out_tau(args, target, head, config, held, tokenizer)
    info = info | record_fields(record) | {"accuracy_depth_rank": config.accuracy,
                                           "held_out_tau": tau}
    save_head(head, config, args.out, info)
    return info


def new_head(args, target, train_seqs: list, stop_ids) -> tuple:
    """-> (head, HeadConfig): residual blocks that start as the identity (Medusa) or a fresh
    EAGLE layer, over the draft vocabulary of these sequences (or of the run being resumed)."""
    ckpt = os.path.join(args.out, CHECKPOINT)   # resuming: the vocabulary the run started with
    vocab = (load_file(ckpt)["head.vocab_ids"] if os.path.exists(ckpt) else
             draft_vocabulary(train_seqs, args.draft_vocab, stop_ids))
    c = target.config
    config = HeadConfig(args.method, c.hidden_size, c.vocab_size, len(vocab), args.heads,
                        eagle_layer_config(c) if args.method != "medusa" else {},
                        taps=eagle3_taps(c.num_layers) if args.method == "eagle3" else [])
    head = build_head(config, vocab).to(target.embed.weight.device)
    if args.method == "eagle3":         # its lm_head and norm start as the target's (those rows)
        head.lm_head.weight.data.copy_(projection_rows(target, vocab))
        head.norm.weight.data.copy_(target.norm.weight)
    return head, config


def interpolate(head, start, alpha: float) -> None:
    """head <- alpha x head + (1 - alpha) x start, weight by weight (WiSE-FT, Wortsman et al.
    2022). Why: training a head further on one kind of text gains there and forgets elsewhere;
    part of the way back keeps most of the gain (measured: the sixth EAGLE run, see README)."""
    theirs = start.state_dict()
    with torch.no_grad():
        for name, w in head.state_dict().items():
            if w.is_floating_point():
                w.lerp_(theirs[name].to(w), 1 - alpha)


def init_head(args, target) -> tuple:
    """-> (head, HeadConfig) of the trained head in --init, to train further: its shape and
    draft vocabulary are kept (--draft-vocab and --heads do not apply)."""
    head, config = load_head(args.init, target, args.method)
    config.accuracy = []                                                   # measured again
    return head.float().train().requires_grad_(True), config


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


def init_draft(target, layers: int):
    """A `layers`-deep Llama starting from evenly spaced target layers (first and last included).

    Embedding and output head are the target's own, shared and frozen: the draft learns only its
    blocks and final norm, and its file needs no embedding matrix of its own."""
    N = target.config.num_layers
    if not 1 <= layers <= N:
        raise ValueError(f"draft layers must be in 1..{N}, got {layers}")
    picks = [round(i * (N - 1) / max(layers - 1, 1)) for i in range(layers)]
    config = LlamaConfig(**{**asdict(target.config), "num_layers": layers})
    with torch.device("meta"):
        draft = Llama(config, init=False)
    draft.layers = nn.ModuleList(copy.deepcopy(target.layers[i]) for i in picks)
    draft.norm = copy.deepcopy(target.norm)
    draft.embed, draft.lm_head, draft.rope = target.embed, target.lm_head, target.rope
    draft.embed.requires_grad_(False), draft.lm_head.requires_grad_(False)
    draft.layers.requires_grad_(True), draft.norm.requires_grad_(True)
    return draft


def save_head(head: nn.Module, config: HeadConfig, folder: str, info: dict | None = None) -> None:
    """model.safetensors (16-bit) + config.json (+ training.json); written atomically."""
    os.makedirs(folder, exist_ok=True)
    tensors = {k: (v.bfloat16() if v.is_floating_point() else v).contiguous().cpu()
               for k, v in head.state_dict().items()}
    save_tensors(tensors, f"{folder}/model.safetensors")
    write_json(f"{folder}/config.json", asdict(config))
    if info is not None:
        write_json(f"{folder}/training.json", info)


def save_draft(draft, target_folder: str, out: str, info: dict | None = None,
               embeddings: bool = True, vocab_ids=None, pard_token=None) -> None:
    """A standard HF Llama folder: config.json (the target's, fewer layers), model.safetensors
    (16-bit), the target's tokenizer files; written atomically. embeddings=False leaves the
    embedding matrix out (the shipped copy: load_model's embeddings_from takes the target's).
    vocab_ids (R,): the reduced vocabulary greedy drafts choose from, in draft_vocab.json (other
    tools ignore it). pard_token: the mask token of a parallel draft, in config.json."""
    c = draft.config
    tensors = to_hf_names({k: v.detach().cpu() for k, v in draft.state_dict().items()}, c)
    dropped = () if embeddings else ("model.embed_tokens.weight", "lm_head.weight")
    os.makedirs(out, exist_ok=True)
    save_tensors({k: v.bfloat16() for k, v in tensors.items() if k not in dropped},
                 f"{out}/model.safetensors", {"format": "pt"})
    hf = read_json(f"{target_folder}/config.json", "config.json")
    write_json(f"{out}/config.json", hf | {"num_hidden_layers": c.num_layers,
                                            "torch_dtype": "bfloat16"} |
               ({"pard_token": pard_token} if pard_token is not None else {}))
    for name in TOKENIZER_FILES:
        if os.path.isfile(f"{target_folder}/{name}"):
            shutil.copyfile(f"{target_folder}/{name}", f"{out}/{name}")
    if vocab_ids is not None:
        write_json(f"{out}/{DRAFT_VOCAB}", sorted(vocab_ids.tolist()), indent=None)
    if info is not None:
        write_json(f"{out}/training.json", info)


def train_draft(args, tc, target, model_path, train_seqs, held, tokenizer, info) -> dict:
    """The distilled draft: KL to the target from its cached features; a standard HF folder.
    With --parallel K > 1 it learns PARD's mask positions too, and its config.json names the
    mask token (`pard_token`, as vLLM reads it)."""
    if args.init:                       # its blocks trained on; the target's embedding shared
        draft = share_embeddings(load_model(args.init, torch.float32, args.device,
                                            embeddings_from=model_path), target)
        draft.layers.requires_grad_(True), draft.norm.requires_grad_(True)
        vocab = load_draft_vocab(args.init, target.config.vocab_size)
        info = info | {"init": os.path.abspath(args.init)}
    else:
        draft = init_draft(target, args.layers)
        vocab = draft_vocabulary(train_seqs, args.draft_vocab, tokenizer.stop_ids)
    k, mask_id = args.parallel, mask_token(tokenizer)
    record = train(draft, lambda seqs: draft_loss(draft, seqs, k, mask_id), train_seqs, tc,
                   args.out)
    draft.eval()
    with torch.no_grad():
        agree = [draft_loss(draft, held[i:i + 16], k, mask_id)[1][1:]
                 for i in range(0, len(held), 16)]
    seqs = held[:args.tau_prompts]

    def tau(depth: int, mask=None) -> float:
        proposer = DraftModelProposer(draft, depth, 512, vocab, mask_id=mask)
        return round(measure_tau(target, proposer, seqs, 64, tokenizer.stop_ids), 3)
    taus = {f"chain_{d}": tau(d) for d in (3, 5)} if seqs else {}     # {}: not measured
    if seqs and k > 1:
        taus[f"parallel_{k}"] = tau(k, mask_id)
    agreement = [round(sum(a) / len(a), 4) for a in zip(*agree)]     # tokens; masks
    info = info | record_fields(record) | {"held_out_top1_agreement": agreement,
                                           "held_out_tau": taus}
    save_draft(draft, model_path, args.out, info, embeddings=not args.without_embeddings,
               vocab_ids=vocab, pard_token=mask_id if k > 1 else None)
    return info


def mask_token(tokenizer) -> int:
    """PARD's mask: the tokenizer's last special token, one no chat writes (SmolLM2's
    <empty_output>, Llama 3's last reserved one), so that the draft keeps the target's
    embedding and its folder stays a standard one."""
    return max(tokenizer.special(t) for t in tokenizer.encoding.special_tokens_set)


if __name__ == "__main__":
    main()
