"""Where the int4 decode-step kernel's time goes, stage by stage: `python -m evals.step_profile`.

Runs the patched model's decode steps eagerly with the step kernel's timeline on (every block's thread 0 reads
%globaltimer at each phase of each stage: patcher/decode/step.py, timeline_summary) and prints, per kind of stage
(averaged over layers), the span and its phases. Needs a GPTQ int4 model on a Hopper GPU; with no model argument it
runs Pythia-2.8B-shaped random int4 g128 weights.
"""

from __future__ import annotations

import argparse
import sys

import torch

from . import common

COLUMNS = [
    ("stage", "stage", ""),
    ("span_us", "span us", ".2f"),
    ("attention_us", "attention", ".2f"),
    ("staging_us", "staging", ".2f"),
    ("units_us", "linears", ".2f"),
    ("weight_wait_us", "of which weight wait", ".2f"),
    ("meeting_us", "meetings", ".2f"),
    ("barrier_us", "barrier wait", ".2f"),
    ("slowest_us", "slowest block", ".2f"),
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m evals.step_profile", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    common.add_model_args(parser)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8, help="decode steps before the one the table reads")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not (args.model or args.gguf_file or args.random_config or args.gptq):
        args.random_config, args.int4_random = "pythia-2.8b", args.int4_random or 128
    device, dtype = common.resolve(args)
    if device.type != "cuda":
        parser.error("the step kernel runs on a CUDA GPU")

    import patcher
    from patcher.decode import DecodeRunner, Sampling
    from patcher.decode import step as step_kernel

    model, _, name = common.load_model(args, device, dtype)
    patcher.patch_model(model)
    runner = DecodeRunner(model, use_graphs=False, use_step_kernel=True, step_timeline=True)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt_len), generator=g).to(device)
    runner.generate(prompt, torch.ones_like(prompt), args.steps + 1, Sampling(), eos=[], pad_token_id=0)
    reason = runner.step_kernel_reason(args.batch)
    if reason is not None:
        print(f"the step kernel does not run this model: {reason}", file=sys.stderr)
        return 1
    rows = step_kernel.timeline_summary(runner.states[args.batch].step_kernel)
    print(f"{name}, {str(dtype).replace('torch.', '')}, batch {args.batch}, context {args.prompt_len + args.steps}")
    print(common.table(rows, COLUMNS))
    common.write_json(
        args.json,
        {
            "tool": "evals.step_profile",
            "model": name,
            "settings": {k: v for k, v in vars(args).items() if k != "default_random"},
            "environment": common.environment(device, "evals.step_profile"),
            "stages": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
