"""Bytes of the tensors each problem's get_inputs() returns, measured on the meta device.

Arguments: problem file paths. stdout: a JSON array, one entry per path, in order:
{"bytes": N} or {"error": "why it could not be measured"}. Tensors nested in lists or tuples
count; anything else counts 0.
"""
import contextlib
import importlib.util
import json
import sys

import torch


def tensor_bytes(value):
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def measure(index, path):
    try:
        spec = importlib.util.spec_from_file_location(f"dice_problem_{index}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        # Meta tensors carry shape and dtype but no storage: nothing is allocated.
        with torch.device("meta"):
            inputs = module.get_inputs()
        return {"bytes": tensor_bytes(inputs)}
    except BaseException as e:
        return {"error": f"{type(e).__name__}: {e}".strip()}


def main():
    paths = sys.argv[1:]
    out = sys.stdout
    # Problems may print; only the JSON answer goes to stdout.
    with contextlib.redirect_stdout(sys.stderr):
        sizes = [measure(i, p) for i, p in enumerate(paths)]
    json.dump(sizes, out)


main()
