"""gpu_check.sh's checks on one device, written to one JSON file (nothing fetched; random weights):

  exact    plain decoding against speculative decoding (the target as its own 4-token draft),
           eager and compiled, in float32 and bfloat16: equal token for token?
  curve    one forward of k new tokens after a 128-token prefix, ms, for the default model's
           shape and Llama-3.1-8B's (the verify curve: where verifying stops being free)
  plain    plain decoding's tokens/s on the 8B shape, eager and compiled, against the device's
           limit: the weights' bytes read once a token at the measured copy bandwidth

--small runs the same checks on the CPU with small shapes and few tokens (the suite runs it).
"""
import argparse
import sys
import time

import torch

from bench import machine_name
from checkpoint import write_json
from kernel import Compiled
from costs import forward_costs
from decode import GenConfig, generate_ar, generate_spec
from methods import random_model
from model import Llama
from proposers import DraftModelProposer

PROMPT = list(range(10, 60))


def exact(model: Llama, tokens: int, compiled: bool) -> dict:
    """Speculative decoding's text against plain decoding's, eager and compiled."""
    gen, out = GenConfig(max_new_tokens=tokens), {}
    targets = [("eager", model)] + [("compiled", Compiled(model, (1, 5)))] * compiled
    for name, target in targets:
        plain = generate_ar(target, PROMPT, gen).token_ids
        spec = generate_spec(target, DraftModelProposer(model, 4, 256), PROMPT, gen)
        out[name] = {"equal": spec.token_ids == plain, "tau": round(spec.tau, 2)}
    return out


def copy_bandwidth(device, mb: int) -> float:
    """GB/s of copying a buffer of `mb` MB (read once, written once), the best of 5."""
    x = torch.empty(mb * 2**20, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        y.copy_(x)
        if x.device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * x.numel() / best / 1e9


def plain_speed(model: Llama, tokens: int) -> dict:
    """Plain decoding's tokens/s, eager and compiled, and the bandwidth limit."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    device = model.embed.weight.device
    gbs = copy_bandwidth(device, max(64, int(2 * weights / 2**20)))    # past every cache
    out = {"weights_gb": round(weights / 1e9, 3), "copy_gb_s": round(gbs, 1),
           "limit_tokens_s": round(gbs * 1e9 / weights, 1)}
    gen = GenConfig(max_new_tokens=tokens)
    for kind, target in (("eager", model), ("compiled", Compiled(model))):
        generate_ar(target, PROMPT, GenConfig(max_new_tokens=4))             # warm-up
        r = generate_ar(target, PROMPT, gen)
        out[f"{kind}_tokens_s"] = round(len(r.token_ids) / r.seconds, 1)
    return out


def run(device: str, small: bool) -> dict:
    layers, tokens = (2, 12) if small else (0, 64)
    report = {"machine": machine_name(device), "torch": torch.__version__, "small": small}
    torch.manual_seed(0)                         # the same random weights every run
    for dtype in (torch.float32, torch.bfloat16):
        model = random_model("smollm2-135m-thin", dtype, device, layers)
        # --small compiles bfloat16's graphs only: the same code, half the suite's minute
        both = not small or dtype != torch.float32
        report[f"exact_{str(dtype)[6:]}"] = exact(model, tokens, both)
        print(f"exact, {dtype}: {report[f'exact_{str(dtype)[6:]}']}", file=sys.stderr)
    sizes = (1, 2, 4) if small else (1, 2, 4, 8, 16, 32, 64)
    # --small: the thin shape only (16 GB of random 8B weights are a GPU's check)
    for name in ("smollm2-135m-thin",) if small else ("smollm2-135m", "llama3-8b"):
        shaped = random_model(name, torch.bfloat16, device, layers)
        report[f"curve_{name}"] = forward_costs(shaped, sizes, repeats=3)
        print(f"verify curve, {name}: {report[f'curve_{name}']}", file=sys.stderr)
        del shaped                                   # the 8B's 16 GB, before the next
    big = "smollm2-135m-thin" if small else "llama3-8b"       # small: the graphs compiled above
    big_model = model if small else random_model(big, torch.bfloat16, device, layers)
    report[f"plain_{big}"] = plain_speed(big_model, tokens)
    print(f"plain decoding, {big}: {report[f'plain_{big}']}", file=sys.stderr)
    return report


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="small shapes on the CPU (the suite's)")
    p.add_argument("--out", default="gpu_check.json", help="the JSON report (default: %(default)s)")
    args = p.parse_args(argv)
    device = "cpu" if args.small else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device here; --small runs the checks on the CPU")
    report = run(device, args.small)
    write_json(args.out, report)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
