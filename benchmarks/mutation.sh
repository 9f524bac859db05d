#!/usr/bin/env bash
# Mutation testing of the torch-free planner (autopipe/core, autopipe/solvers) and of
# executor/spec.py, against the tests that take milliseconds: mutmut (the dev extra) with
# [tool.mutmut] in pyproject.toml, one mutant at a time under `nice`, then the score per package.
# Not in CI: a whole run takes about a day on 2 cores (docs/benchmarks.md, "Mutation testing");
# name the modules to run a part.
#
#   bash benchmarks/mutation.sh                      # every mutant without a result (mutants/ keeps
#                                                    # them: an interrupted run resumes)
#   bash benchmarks/mutation.sh 'executor.spec.*'    # just these mutants, run again (mutmut's names:
#                                                    # 'autopipe.core.*', 'autopipe.solvers.dp.*')
#   bash benchmarks/mutation.sh --fresh [NAMES...]   # mutants/ deleted first (after editing the source)
#   bash benchmarks/mutation.sh --score              # the score of what mutants/ holds; runs nothing
#   mutmut results; mutmut show NAME                 # the survivors, and one survivor's diff
#
# MUTMUT_CHILDREN (default 1) mutants at once. The score: killed / (killed + survived + no tests),
# per package; mutants not yet run are counted apart.
set -uo pipefail
cd "$(dirname "$0")/.."
score() {
  python3 - <<'PY'
import collections, json, pathlib

names = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", None: "not run",
         36: "killed", 24: "killed", -24: "killed", 152: "killed", 255: "killed"}  # timeouts kill
rows = collections.defaultdict(collections.Counter)
for meta in sorted(pathlib.Path("mutants").glob("**/*.py.meta")):
    package = "executor/spec.py" if meta.parts[1] == "executor" else "/".join(meta.parts[1:3])
    for code in json.loads(meta.read_text())["exit_code_by_key"].values():
        rows[package][names.get(code, "other")] += 1
rows["all"] = sum(rows.values(), collections.Counter())
print(f"| {'package':<18} | killed | survived | no tests | other | not run | score |")
print(f"|{'-' * 20}|-------:|---------:|---------:|------:|--------:|------:|")
for package, c in rows.items():
    run = c["killed"] + c["survived"] + c["no tests"]
    pct = f"{100 * c['killed'] / run:.1f}%" if run else "-"
    print(f"| {package:<18} | {c['killed']:>6} | {c['survived']:>8} | {c['no tests']:>8} "
          f"| {c['other']:>5} | {c['not run']:>7} | {pct:>5} |")
PY
}
case "${1:-}" in
  --score) score; exit 0 ;;
  --fresh) shift; rm -rf mutants ;;
esac
command -v mutmut >/dev/null || { echo "mutation.sh: no mutmut; pip install -e '.[dev]'" >&2; exit 2; }
start=$(date +%s)
nice -n 10 mutmut run --max-children "${MUTMUT_CHILDREN:-1}" "$@"
rc=$?
echo "mutation.sh: mutmut run took $(( $(date +%s) - start )) s (exit $rc)"
score
exit $rc
