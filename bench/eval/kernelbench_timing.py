"""Times programs the way KernelBench's harness does (docs: KernelBench spec §3), with plain PyTorch
in this one process and no dice code: what `dice eval --timing kernelbench` is compared against.

    python3 bench/eval/kernelbench_timing.py --pairs PAIRS.json [--ids 3,17] [--out times.jsonl]
    python3 bench/eval/kernelbench_timing.py --problem PROBLEM.py --candidate CANDIDATE.py

Building is not timing, so it can be done first, in parallel: with --build-dir DIR every program's
extensions go to DIR/<id> (TORCH_EXTENSIONS_DIR), --build-only only executes the candidate (which
compiles it), and --shard K/N takes every N-th program from the K-th; a later run with the same
--build-dir loads the builds instead of compiling.

Options: --method kernelbench (HEAD's cuda_event, the default) or kernelbench-v0.1 (DICE's paper);
--device cuda (default) or cpu (the same loops around perf_counter); --trials N (100);
--precision fp32|fp16|bf16 (floating-point tensors only, as dice casts them).

Per program, as KernelBench's eval_kernel_against_ref and measure_ref_program_time do: the problem
is exec'd into a dict and the candidate into the same dict; set_seed(42) before the init inputs and
before each model; set_seed(42) before the timing inputs, the same tensors for every call. HEAD:
the candidate gets 3 warm-ups with autograd on, the baseline (a fresh Model) 5 under no_grad; a
synchronisation after each warm-up, torch.cuda.empty_cache(), then per trial synchronise, the
256 MiB L2 flush, events around the call, synchronise; the first trial is discarded. v0.1: 3
warm-ups on both sides, per trial only events around the call and a synchronisation. Means,
standard deviations, minima and maxima are rounded to 3 significant digits, and the speedup divides
the rounded means. Writes one JSON line per program: id, baseline_ms, candidate_ms, speedup, both
sides' statistics, or error.
"""

import argparse
import json
import os
import sys
import traceback
from time import perf_counter

import numpy as np
import torch
from torch.utils import cpp_extension

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
METHODS = {
    # candidate warm-ups, baseline warm-ups, L2 flush, synchronise before a trial, discarded, empty_cache
    "kernelbench": (3, 5, True, True, 1, True),
    "kernelbench-v0.1": (3, 3, False, False, 0, False),
}


def set_seed(seed):
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)


def place(values, device, dtype):
    placed = []
    for v in values:
        if isinstance(v, torch.Tensor):
            v = v.to(device)
            if v.is_floating_point():
                v = v.to(dtype)
        placed.append(v)
    return placed


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(model, args, warmups, trials, method, device):
    """KernelBench's time_execution_with_cuda_event (perf_counter on the CPU), in ms."""
    _, _, flush, sync_before, discard, empty_cache = METHODS[method]
    for _ in range(warmups):
        model(*args)
        sync(device)
    if device.type == "cuda" and empty_cache:
        torch.cuda.empty_cache()
    times = []
    for trial in range(trials + discard):
        if device.type != "cuda":
            start = perf_counter()
            _ = model(*args)
            ms = (perf_counter() - start) * 1e3
        else:
            if sync_before:
                torch.cuda.synchronize(device)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            if flush:
                dummy = torch.empty((32, 1024, 1024), dtype=torch.int64, device=device)
                dummy.fill_(42)
                del dummy
            start.record()
            _ = model(*args)
            end.record()
            torch.cuda.synchronize(device)
            ms = start.elapsed_time(end)
        if trial >= discard:
            times.append(ms)
    return times


def stats(times):
    """KernelBench's get_timing_stats."""
    return {
        "mean": float(f"{np.mean(times):.3g}"),
        "std": float(f"{np.std(times):.3g}"),
        "min": float(f"{np.min(times):.3g}"),
        "max": float(f"{np.max(times):.3g}"),
        "num_trials": len(times),
    }


def build_program(candidate_src):
    """Executes the candidate alone: its load_inline calls compile into TORCH_EXTENSIONS_DIR."""
    exec(compile(candidate_src, "<candidate>", "exec"), {})
    return {"built": True}


def time_program(problem_src, candidate_src, args):
    device, dtype = torch.device(args.device), DTYPES[args.precision]
    candidate_warmups, baseline_warmups = METHODS[args.method][:2]
    context = {}
    exec(compile(problem_src, "<problem>", "exec"), context)
    Model, get_init_inputs, get_inputs = context["Model"], context["get_init_inputs"], context["get_inputs"]
    set_seed(42)
    init_inputs = place(get_init_inputs(), device, dtype)
    exec(compile(candidate_src, "<candidate>", "exec"), context)
    sync(device)
    with torch.no_grad():
        set_seed(42)
        custom_model = context["ModelNew"](*init_inputs).to(device=device, dtype=dtype)
        sync(device)

    # eval_kernel_against_ref: the candidate, autograd on.
    sync(device)
    set_seed(42)
    inputs = place(get_inputs(), device, dtype)
    sync(device)
    candidate = stats(time_calls(custom_model, inputs, candidate_warmups, args.trials, args.method, device))
    del custom_model, inputs

    # measure_ref_program_time: a fresh reference model, under no_grad.
    with torch.no_grad():
        sync(device)
        set_seed(42)
        inputs = place(get_inputs(), device, dtype)
        set_seed(42)
        init_inputs = place(get_init_inputs(), device, dtype)
        model = Model(*init_inputs).to(device=device, dtype=dtype)
        sync(device)
        baseline = stats(time_calls(model, inputs, baseline_warmups, args.trials, args.method, device))
    return {
        "baseline_ms": baseline["mean"],
        "candidate_ms": candidate["mean"],
        "speedup": baseline["mean"] / candidate["mean"] if candidate["mean"] > 0 else None,
        "baseline": baseline,
        "candidate": candidate,
    }


def programs(args):
    """(id, problem source, candidate source) of every program to time."""
    if args.pairs:
        wanted = {int(i) for i in args.ids.split(",")} if args.ids else None
        for position, pair in enumerate(json.load(open(args.pairs))):
            pair_id = pair.get("id", position)
            if wanted is None or pair_id in wanted:
                yield pair_id, pair["pytorch_code"], pair["cuda_code"]
    else:
        yield args.candidate, open(args.problem).read(), open(args.candidate).read()


def sharded(items, shard):
    """The K-th of N interleaved shards ("K/N"), or everything."""
    if not shard:
        yield from items
        return
    k, n = (int(x) for x in shard.split("/"))
    for position, item in enumerate(items):
        if position % n == k:
            yield item


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs")
    parser.add_argument("--ids")
    parser.add_argument("--problem")
    parser.add_argument("--candidate")
    parser.add_argument("--method", choices=sorted(METHODS), default="kernelbench")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--precision", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--out")
    parser.add_argument("--build-dir")
    parser.add_argument("--build-only", action="store_true")
    parser.add_argument("--shard")
    args = parser.parse_args()
    if bool(args.pairs) == bool(args.problem and args.candidate):
        parser.error("give --pairs, or --problem and --candidate")
    out = open(args.out, "w") if args.out else sys.stdout
    for program_id, problem_src, candidate_src in sharded(programs(args), args.shard):
        if args.build_dir:
            os.environ["TORCH_EXTENSIONS_DIR"] = os.path.join(args.build_dir, str(program_id).replace("/", "_"))
            # torch numbers an extension name loaded before in this process with other sources
            # (fused_ops_v1, _v2, ...), counting across programs: the build shards and the timing
            # process see the programs in other orders, so the timing process asked for names the
            # shards never built and compiled them again inside its time (fused_ops_v4, _v5 in
            # session 37, whose step ran out of time with 13 of 32 programs untimed). Each program
            # has its own folder, so its names start afresh.
            cpp_extension.JIT_EXTENSION_VERSIONER.entries.clear()
        try:
            if args.build_only:
                row = {"id": program_id, **build_program(candidate_src)}
            else:
                row = {"id": program_id, "method": args.method, **time_program(problem_src, candidate_src, args)}
        except Exception as e:
            traceback.print_exc()
            row = {"id": program_id, "method": args.method, "error": f"{type(e).__name__}: {e}".splitlines()[0]}
        print(json.dumps(row), file=out, flush=True)


if __name__ == "__main__":
    main()
