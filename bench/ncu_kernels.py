"""Kernel times from an Nsight Compute CSV (`ncu --metrics gpu__time_duration.sum --csv`), as a
Markdown table, for the GPU scripts' kernel steps.

usage: python3 bench/ncu_kernels.py CSV [--by-launch] [--minus BASE_CSV]
  default      per kernel (name without template arguments or parameters): launches, total ms and
               share of all kernel time, largest first, with the sum above the table
  --by-launch  per kernel name, grid and block: launches and mean microseconds, largest total first
  --minus      less the launches and time of BASE_CSV, a run of the same program that stopped
               earlier (one training step fewer: the table is then that one step's kernels, the
               model's build and the warm-up left out)
"""
import argparse
import collections
import csv
import sys

# Nsight Compute names the unit in full or short by version.
SECONDS = {"nsecond": 1e-9, "ns": 1e-9, "usecond": 1e-6, "us": 1e-6, "msecond": 1e-3, "ms": 1e-3,
           "second": 1.0, "s": 1.0}


def durations(path):
    """(kernel name, grid, block, seconds) of every profiled launch."""
    lines = open(path, errors="replace").read().splitlines()
    head = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if head is None:
        sys.exit(f"{path}: no kernel rows (see ncu's own output beside it)")
    for row in csv.DictReader(lines[head:]):
        if row.get("Metric Name") == "gpu__time_duration.sum":
            seconds = float(row["Metric Value"].replace(",", "")) * SECONDS[row["Metric Unit"]]
            yield row["Kernel Name"], row["Grid Size"], row["Block Size"], seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("csv")
    parser.add_argument("--by-launch", action="store_true", help="per name, grid and block")
    parser.add_argument("--minus", metavar="BASE_CSV", help="subtract this run's launches")
    options = parser.parse_args()
    total, launches = collections.Counter(), collections.Counter()
    runs = [(options.csv, 1)] + ([(options.minus, -1)] if options.minus else [])
    for path, sign in runs:
        for name, grid, block, seconds in durations(path):
            key = (name, grid, block) if options.by_launch else (name.split("(")[0].split("<")[0],)
            total[key] += sign * seconds
            launches[key] += sign
    for key in [key for key, count in launches.items() if count <= 0]:
        del total[key], launches[key]
    if options.by_launch:
        print("| kernel | grid | block | launches | mean us |\n| --- | --- | --- | ---: | ---: |")
        for key, seconds in total.most_common():
            print(f"| {' | '.join(key)} | {launches[key]} | {seconds / launches[key] * 1e6:.2f} |")
        return
    all_s = sum(total.values())
    print(f"{sum(launches.values())} launches, {all_s * 1e3:.1f} ms of kernel time")
    print("| kernel | launches | ms | share |\n| --- | ---: | ---: | ---: |")
    for (name,), seconds in total.most_common(40):
        print(f"| {name} | {launches[(name,)]} | {seconds * 1e3:.2f} | {100 * seconds / all_s:.1f}% |")


if __name__ == "__main__":
    main()
