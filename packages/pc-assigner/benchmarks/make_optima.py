"""Compute and store the optimal cost of every suite instance (run by hand; needs scipy).

    python packages/pc-assigner/benchmarks/make_optima.py [--time-limit 60] [--only NAME_SUBSTRING]

For ``m ** n <= 1e6`` the optimum comes from exhaustive search (``proof: "exhaustive"``) and the ILP is run
as a cross-check; above that HiGHS decides with a relative gap of 1e-7 (``proof: "ilp"`` when proven optimal,
``"incumbent"`` when the time limit stopped it with a feasible but unproven placement). Every record carries
``bound``, a proven lower bound on the optimal cost: the optimum itself after exhaustive search, HiGHS's dual
bound otherwise (within 1e-7 of the optimum when proven, lower when stopped by the time limit). The benchmark
divides by ``bound``, so its ratios never flatter us. Each instance is written to ``optima/NAME.json`` with
its parameters, the problem itself, the best cost and assignment, the bound and the proof, so CI needs no
solver.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from suite import suite  # noqa: E402

from pc_assigner import placement_cost  # noqa: E402
from pc_assigner._core import compile_problem  # noqa: E402
from pc_assigner._exact import exact_search  # noqa: E402
from pc_assigner._ilp import ilp_search  # noqa: E402

GAP = 1e-7  # HiGHS's relative gap: "proven" means within this of the optimum


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    out_dir = HERE / "optima"
    out_dir.mkdir(exist_ok=True)
    for name, params, problem in suite():
        if args.only not in name:
            continue
        c = compile_problem(problem)
        record: dict[str, object] = {"name": name, "params": params, "problem": problem.to_dict()}
        t0 = time.perf_counter()
        if sum(problem.sizes) > sum(problem.capacities):
            record.update(proof="infeasible", cost=None, assignment=None)
        elif c.m**c.n <= 1_000_000:
            found = exact_search(c)
            assert found is not None, name
            a = c.expand(found[0])
            ilp = ilp_search(c, time_limit=args.time_limit)
            ilp_cost = placement_cost(problem, c.expand(ilp.assignment)).total if ilp.assignment else math.nan
            cost = placement_cost(problem, a).total
            record.update(
                proof="exhaustive",
                cost=cost,
                bound=cost,
                assignment=list(a),
                ilp_cost=ilp_cost,
                ilp_proven=ilp.proven,
                ilp_agrees=bool(abs(ilp_cost - cost) <= 1e-4 * cost),  # HiGHS stops at a 1e-4 relative gap
            )
        else:
            ilp = ilp_search(c, time_limit=args.time_limit, mip_rel_gap=GAP)
            assert ilp.assignment is not None, (name, ilp.message)
            assert ilp.bound is not None, (name, ilp.message)
            a = c.expand(ilp.assignment)
            pc = placement_cost(problem, a)
            assert pc.feasible, name
            record.update(
                proof="ilp" if ilp.proven else "incumbent",
                cost=pc.total,
                bound=min(ilp.bound, pc.total),
                assignment=list(a),
            )
        record["seconds"] = round(time.perf_counter() - t0, 3)
        (out_dir / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
        print(
            f"{name:45} {record['proof']:11} {record['cost']!s:22} {record.get('bound')!s:22} "
            f"{record['seconds']:7.2f}s",
            flush=True,
        )


if __name__ == "__main__":
    main()
