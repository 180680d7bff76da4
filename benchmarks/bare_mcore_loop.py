"""A bare megatron-core training loop, the baseline of the GPU check's step-time ratio (issue 25).

    torchrun --standalone --nproc-per-node 1 benchmarks/bare_mcore_loop.py --warmup 20 --steps 100 \
        --block 10 --json bare.json -- <pretrain.py's model and training flags>

The same GPT, DDP and optimizer as pretrain.py with those flags (built by the same functions, so the two
cannot differ in the model), stepped the way megatron-core's own examples step it: zero the gradient
buffers, its pipeline schedule's forward and backward with a plain mean loss on one fixed batch already on
the device, optimizer.step(), scheduler.step(). Nothing else: no result validation, data loading, logging,
event log, stop conditions or checkpoint checks. Timed in blocks of --block steps (the device synchronised
at each block's ends); the JSON holds each block's per-step milliseconds and their median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import harness


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--json", default=None)
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    opts = parser.parse_args(argv[:split])
    if opts.steps < opts.block or opts.block < 1:
        parser.error("--steps must be at least --block, and --block at least 1")

    from megatron_resil.arguments import parse_args

    args = parse_args(argv[split + 1:])
    harness.start_worker(args)  # what pretrain.py installs at start-up
    import torch

    from megatron_resil import parallel

    engine = harness.build(args, validation=False, data=False)
    device = parallel.device()
    tokens = torch.randint(0, engine.vocab_size, (args.micro_batch_size, args.seq_length), device=device)
    position_ids = torch.arange(args.seq_length, device=device).unsqueeze(0).expand_as(tokens)
    labels = torch.roll(tokens, -1, dims=1)
    step = harness.bare_step(engine, tokens, position_ids, labels)

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(opts.warmup):
        step()
    block_ms = []
    for _ in range(opts.steps // opts.block):
        synchronize()
        began = time.perf_counter()
        for _ in range(opts.block):
            step()
        synchronize()
        block_ms.append(1000.0 * (time.perf_counter() - began) / opts.block)
    parameters = engine.parameters
    median = statistics.median(block_ms)
    if parallel.is_rank0():
        print(f"bare megatron-core loop: {parameters / 1e6:.1f}M parameters, {median:.2f} ms per step "
              f"(median of {len(block_ms)} blocks of {opts.block})", flush=True)
        if opts.json:
            with open(opts.json, "w") as f:
                json.dump({"step_ms_median": median, "block_ms": [round(ms, 3) for ms in block_ms],
                           "parameters": parameters, "block": opts.block}, f)
    parallel.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
