"""Shared bits of the benchmarks: machine description, the JSON report format of DESIGN.md section 8, and the
repeats of the ratio benches (``add_repeat_args``, ``interleave``, ``summary``, ``report``'s ``sides``): every side
measured once per round, the sides alternating, the ratios of the sides' medians, noisy sides flagged."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

# Bytecode as Python writes it by default, and as `pip install` writes it for every package it installs. A shell
# that sets PYTHONDONTWRITEBYTECODE (this machine's does) made every process of a bench compile torch, SB3, TRL,
# vLLM and our services from source again on every run: seconds per process (torch._dynamo alone, imported by
# torch.optim, took ~2 s) that no installed system pays. The first run of a bench after an install writes the
# bytecode; every later one reads it, on every side.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


def machine() -> dict:
    info = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()}
    try:
        model = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
        info["cpu"] = model[0] if model else ""
    except OSError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = 1
    except ImportError:
        pass
    return info


# --------------------------------------------------------------------------------------------------- repeats
#
# A ratio bench measures its sides in rounds, each side once per round, the sides alternating (A B A B ...), so
# that drift of the machine (another process, thermal state, the page cache) hits every side alike. Its headline
# ratios are ratios of the sides' medians over the rounds; each side's min and max are kept, and a side whose
# spread (max - min) / median exceeds SPREAD_LIMIT is flagged NOISY in the printed report and in the JSON, with
# every ratio that compares it.

SPREAD_LIMIT = 0.2
"""A side whose (max - min) / median over the rounds exceeds this is noisy: a ratio from it is not to be trusted."""
DEFAULT_REPEATS = 3
"""Rounds a ratio bench runs by default (``--repeats``); fewer say little about the spread. ``--quick`` runs 1."""

Sample = float | None
"""One measurement of a side. None (or inf) where the side never reached its target (e.g. a run that never hit the
evaluation threshold): it sorts as infinitely slow, is counted in the summary's ``unreached``, written as null."""


def _repeats_type(text: str) -> int:
    n = int(text)
    if n < DEFAULT_REPEATS:
        raise argparse.ArgumentTypeError(f"at least {DEFAULT_REPEATS} rounds (use --quick for one)")
    return n


def add_repeat_args(parser: argparse.ArgumentParser, default: int = DEFAULT_REPEATS) -> None:
    """``--repeats N`` (rounds, each side once per round, at least 3) and ``--quick`` (one round: development)."""
    parser.add_argument("--repeats", type=_repeats_type, default=default,
                        help=f"rounds (default {default}, at least {DEFAULT_REPEATS}): every side once per round, the "
                             "sides alternating; ratios of medians, each side's min/max kept and its spread flagged "
                             f"above {SPREAD_LIMIT:.0%}% of its median")  # %% for argparse
    parser.add_argument("--quick", action="store_true", help="one round (development: no spread to judge)")


def repeat_count(args: argparse.Namespace) -> int:
    """The rounds to run: 1 with ``--quick``, else ``--repeats``."""
    return 1 if getattr(args, "quick", False) else args.repeats


def interleave(sides: Mapping[str, Callable[[], Sample | Mapping[str, Sample]]], repeats: int,
               label: str = "") -> dict[str, list[Sample]]:
    """Runs ``repeats`` rounds, each side's callable once per round in the mapping's order (A B A B ...), printing
    each sample as it comes; returns every side's samples in round order.

    A callable returns its side's sample (a float; None or inf where it never reached its target), or, where one
    run measures several sides at once (before and after a scale-up within one run, jitter and lateness of one
    loop), a mapping {side name: sample}: those names are the sides, in place of the callable's own key."""
    samples: dict[str, list[Sample]] = {}
    for r in range(repeats):
        for key, fn in sides.items():
            got = fn()
            for name, value in (got.items() if isinstance(got, Mapping) else [(key, got)]):
                samples.setdefault(name, []).append(value)
                print(f"{label}round {r + 1}/{repeats} {name}: {_fmt(value)}", flush=True)
    return samples


def _finite(value: Sample) -> bool:
    return value is not None and math.isfinite(value)


def seed_median(values: Iterable[Sample]) -> float:
    """Median over seeds of a time to a target; a seed that never reached it (None) counts as infinitely slow."""
    return statistics.median(float(v) if v is not None else math.inf for v in values)


def summary(values: Iterable[Sample], limit: float = SPREAD_LIMIT) -> dict:
    """A side's samples: {"n", "median", "min", "max", "spread", "noisy", "unreached", "values"}.

    spread = (max - min) / median; noisy = spread > ``limit``. Unreached samples (None, inf, nan) sort as
    infinitely slow: a median, min or max that is one is None, and a side reached in some rounds but not all is
    noisy (its spread unbounded, written None). A side never reached has no median and is not noisy (it is
    consistently failing). Every number is finite or None, so the summary is valid JSON."""
    vals = [None if v is None else float(v) for v in values]
    keyed = sorted(v if _finite(v) else math.inf for v in vals)
    n = len(keyed)
    unreached = sum(not _finite(v) for v in vals)
    out = {"n": n, "median": None, "min": None, "max": None, "spread": None, "noisy": False, "unreached": unreached,
           "values": [v if _finite(v) else None for v in vals]}
    if not n:
        return out
    median, lo, hi = statistics.median(keyed), keyed[0], keyed[-1]
    out.update(median=_or_none(median), min=_or_none(lo), max=_or_none(hi))
    if unreached == n:
        return out
    if unreached:
        out["noisy"] = True  # reached in some rounds, not in others: as inconsistent as a side gets
        return out
    spread = (hi - lo) / abs(median) if median else (0.0 if hi == lo else math.inf)
    out.update(spread=_or_none(spread), noisy=spread > limit + 1e-9)  # not for a rounding error at the limit
    return out


def ratio_of_medians(samples: Mapping[str, list[Sample]], numerator: str, denominator: str) -> float | None:
    """median(numerator) / median(denominator); None where either side has no finite median (never reached)."""
    a, b = summary(samples[numerator])["median"], summary(samples[denominator])["median"]
    return a / b if a is not None and b not in (None, 0) else None


def median_of(samples: list[Sample]) -> float | None:
    """The median of a side's samples (None where it is not finite)."""
    return summary(samples)["median"]


def report(name: str, metrics: dict, ratios: dict[str, float | None], targets: dict[str, str], out: str | None,
           sides: Mapping[str, list[Sample]] | None = None, compares: Mapping[str, Iterable[str]] | None = None,
           repeats: int | None = None) -> dict:
    """Prints and writes (``out``) the bench's JSON: {"name", "machine", "metrics", "ratios", "targets"}, and with
    ``sides`` (each side's samples over the rounds) also "repeats", "spread_limit", "sides" ({name: summary}),
    "compares" ({ratio: [the sides it is a ratio of]}), "noisy_sides" and "noisy_ratios" (the ratios with a
    noisy side). A ratio of None (a side never reached its target) is printed as not measured and written null;
    every inf or nan anywhere in the document is written null (the file stays valid JSON)."""
    doc: dict = {"name": name, "machine": machine()}
    summaries = {side: summary(values) for side, values in (sides or {}).items()}
    compared = {key: list(used) for key, used in (compares or {}).items()}
    for key, used in compared.items():
        missing = [s for s in used if s not in summaries]
        if missing:
            raise KeyError(f"ratio {key} compares unknown sides {missing}")
    noisy_sides = [s for s, m in summaries.items() if m["noisy"]]
    noisy_ratios = [k for k, used in compared.items() if any(summaries[s]["noisy"] for s in used)]
    if sides is not None or repeats is not None:
        doc["repeats"] = repeats if repeats is not None else max((m["n"] for m in summaries.values()), default=0)
        doc["spread_limit"] = SPREAD_LIMIT
    doc |= {"metrics": metrics, "ratios": ratios, "targets": targets}
    if sides is not None:
        doc |= {"sides": summaries, "compares": compared, "noisy_sides": noisy_sides, "noisy_ratios": noisy_ratios}
        width = max(map(len, summaries), default=0)
        for side, m in summaries.items():
            print(f"{side:<{width}}  {_side_line(m)}")
    for key, value in ratios.items():
        target = targets.get(key, "")
        ok = _meets(value, target)
        shown = "not measured (a side never reached its target)" if value is None else f"{value:.3f}"
        line = f"{key} = {shown}  (target {target or 'none'}{'' if ok is None else ', met' if ok else ', NOT met'})"
        if key in noisy_ratios:
            flagged = [s for s in compared[key] if summaries[s]["noisy"]]
            line += f"  NOISY: {', '.join(flagged)} spread > {SPREAD_LIMIT:.0%}"
        print(line)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(_jsonable(doc), indent=2, allow_nan=False))
        print(f"wrote {out}")
    return doc


def _side_line(m: dict) -> str:
    line = (f"median {_fmt(m['median'])}  min {_fmt(m['min'])}  max {_fmt(m['max'])}  (n {m['n']}"
            + (f", {m['unreached']} never reached" if m["unreached"] else "") + ")")
    if m["noisy"]:
        why = (f"spread {m['spread']:.0%} > {SPREAD_LIMIT:.0%}" if m["spread"] is not None
               else f"spread unbounded: {m['unreached']} of {m['n']} never reached")
        line += f"  NOISY ({why})"
    return line


def _fmt(value) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "not reached"
    return f"{value:.4g}"


def _or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _jsonable(value):
    """inf and nan (anywhere in the document) become None: JSON has no Infinity."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


_TARGET = re.compile(r"^\s*(?:(<=|>=|<|>)\s*(-?[\d.]+(?:e-?\d+)?)|(-?[\d.]+(?:e-?\d+)?)\s*(?:±|\+-|\+/-)\s*"
                     r"([\d.]+(?:e-?\d+)?))\s*$")


def _meets(value: float | None, target: str) -> bool | None:
    """Whether ``value`` meets ``target``: "<=x", ">=x", "<x", ">x", or "x±t" (also "x+-t"): within t of x. None
    where there is no target; a ratio that was not measured (None) does not meet one."""
    if not target:
        return None
    m = _TARGET.match(target)
    if not m:
        raise ValueError(f"unknown target {target!r}: use <=x, >=x, <x, >x or x±t")
    if value is None or not math.isfinite(value):
        return False
    if m.group(1):
        op, num = m.group(1), float(m.group(2))
        return {"<=": value <= num, ">=": value >= num, "<": value < num, ">": value > num}[op]
    center, tol = float(m.group(3)), float(m.group(4))
    return abs(value - center) <= tol + 1e-12


def python() -> str:
    return sys.executable


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def pi0_ode_recomputing_prefix(policy, obs: dict):
    """pi0's ODE from zero noise with the prefix (images and words) recomputed at every denoising step: what acting
    without the KV cache costs. ``policy.act(obs, deterministic=True)`` gives the same chunk from the cache."""
    import torch

    with torch.no_grad():
        x_in = policy.inputs(obs)
        B, K = x_in["state"].shape[0], policy.steps
        x = torch.zeros(B, policy.H, policy.A, device=x_in["state"].device)
        for k in range(K):
            tau = torch.full((B,), k / K, device=x.device)
            v = -policy.model(noise=x, timestep=1.0 - tau, **x_in).logits[:, :policy.H, :policy.A]
            x = x + v / K  # the ODE's Euler step (sigma 0)
        return x
