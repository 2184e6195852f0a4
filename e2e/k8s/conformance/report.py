#!/usr/bin/env python3
"""The dated result of a run of Kubernetes' storage tests (e2e/k8s/conformance.sh):
ginkgo's JSON report in, Markdown out -- counts by test pattern and by
suite, every failure with its message, and every skip with its reason.

    report.py REPORT.json [TITLE] > bench/reference/conformance/DATE-NAME.md

Only this driver's External Storage specs count. A spec skipped with no
message was left out by the run's --skip labels; one skipped with a
message was skipped by the suite itself (a capability the driver does
not claim, or a second node it does not have).
"""
import collections
import json
import re
import sys

DRIVER = "External Storage [Driver: rbd-nbd-go.csi.io]"
PATTERN = re.compile(r"\[Testpattern: ([^\]]*)\]((\s*\[[^\]]*\])*)\s*(\S+)")


def specs(report):
    for suite in report:
        for s in suite.get("SpecReports") or []:
            if s.get("LeafNodeType") != "It":
                continue
            name = " ".join(s.get("ContainerHierarchyTexts") or []) + " " + s.get("LeafNodeText", "")
            if not name.startswith(DRIVER):
                continue
            yield name[len(DRIVER):].strip(), s


def kind(s):
    st = s.get("State", "")
    if st == "passed":
        return "passed"
    if st == "skipped":
        return "skipped" if (s.get("Failure") or {}).get("Message") else "left out"
    if st == "pending":
        return "left out"
    return "failed"


def first_line(msg, n=220):
    msg = " ".join((msg or "").split())
    return msg[:n] + ("…" if len(msg) > n else "")


def main():
    report = json.load(open(sys.argv[1]))
    title = sys.argv[2] if len(sys.argv) > 2 else "Kubernetes' storage tests"
    rows = collections.OrderedDict()
    suites = collections.defaultdict(collections.Counter)
    totals = collections.Counter()
    failures, skips = [], collections.Counter()
    runtime = 0.0
    cols = ("passed", "failed", "skipped", "left out")
    for name, s in sorted(specs(report)):
        m = PATTERN.match(name)
        pattern, suite = (m.group(1), m.group(4)) if m else ("-", name.split()[0])
        k = kind(s)
        rows.setdefault(pattern, collections.Counter())[k] += 1
        suites[suite][k] += 1
        totals[k] += 1
        runtime += s.get("RunTime", 0) / 1e9
        msg = (s.get("Failure") or {}).get("Message", "")
        if k == "failed":
            failures.append((name, s.get("State"), first_line(msg, 600)))
        elif k == "skipped":
            # One line per reason: the names and numbers in a message vary.
            reason = re.sub(r'"[^"]*"|\d+', "…", first_line(msg, 160))
            skips[reason] += 1
    # What failed outside a spec (a BeforeSuite, a timeout of the whole
    # run): then the specs it kept from running look left out, too.
    broken = [f"{s.get('LeafNodeType')} {s.get('LeafNodeText', '')}".strip() + ": " +
              first_line((s.get("Failure") or {}).get("Message", ""), 300)
              for r in report for s in r.get("SpecReports") or []
              if s.get("LeafNodeType") != "It" and s.get("State") not in ("passed", "skipped", "pending")]
    reasons = [x for r in report for x in r.get("SpecialSuiteFailureReasons") or []]
    ok = all(r.get("SuiteSucceeded") for r in report)
    start = min((r.get("StartTime", "") for r in report), default="")
    end = max((r.get("EndTime", "") for r in report), default="")
    out = [f"# {title}", ""]
    out.append(f"- started {start}, ended {end}; specs' own time {runtime / 60:.1f} min")
    out.append(f"- {DRIVER}: " + ", ".join(f"{totals[c]} {c}" for c in cols))
    out.append("- the suite " + ("succeeded" if ok else "failed") +
               "".join(f"; {r}" for r in reasons) + "".join(f"; {b}" for b in broken))
    out.append("- passed and failed specs ran; skipped ones the suite skipped itself, with the reason below;"
               " left out ones the run's --skip labels or focus excluded (docs/conformance.md says why)")
    out += ["", "## By test pattern", "", "| pattern | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for p, c in rows.items():
        out.append(f"| {p} | " + " | ".join(str(c[k]) for k in cols) + " |")
    out += ["", "## By suite", "", "| suite | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for p in sorted(suites):
        out.append(f"| {p} | " + " | ".join(str(suites[p][k]) for k in cols) + " |")
    out += ["", "## Failures", ""]
    out += [f"- **{n}** ({st}): {m}" for n, st, m in failures] or ["none"]
    out += ["", "## Why the suite skipped specs", "", "| specs | reason |", "|---:|---|"]
    for r, n in skips.most_common():
        out.append(f"| {n} | {r.replace('|', '/')} |")
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
