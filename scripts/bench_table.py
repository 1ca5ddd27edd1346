"""Joins `ray microbenchmark` (+ ray_bench.py) output with `regatta bench` output into one
table: case, Ray, Regatta, ratio. Usage: bench_table.py RAY_OUTPUT REGATTA_OUTPUT."""
import re
import sys

LINE = re.compile(r"^(?P<case>.+?) (?P<unit>per second|milliseconds|seconds|megabytes) (?P<value>[0-9.]+) \+- (?P<spread>[0-9.]+)")


def parse(path):
    figures = {}
    with open(path, encoding="utf-8", errors="replace") as handle:
        for line in handle:
            match = LINE.match(line.strip())
            if match:
                figures[(match["case"], match["unit"])] = float(match["value"])
    return figures


def main():
    ray, regatta = parse(sys.argv[1]), parse(sys.argv[2])
    print("| case | unit | Ray | Regatta | Regatta vs Ray |")
    print("| --- | --- | ---: | ---: | ---: |")
    for key in sorted(set(ray) | set(regatta), key=lambda k: (k not in ray or k not in regatta, k)):
        case, unit = key
        r, g = ray.get(key), regatta.get(key)
        if r and g:
            # Higher is better for rates; lower is better for time and memory.
            ratio = g / r if unit == "per second" else r / g
            ratio_text = f"{ratio:,.1f}x"
        else:
            ratio_text = "-"
        fmt = lambda v: "-" if v is None else f"{v:,.2f}"
        print(f"| {case} | {unit} | {fmt(r)} | {fmt(g)} | {ratio_text} |")


if __name__ == "__main__":
    main()
