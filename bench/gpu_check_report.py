"""The short markdown summary of ``bench/gpu_check.py`` (gpu_check.md): one table row per
section with its headline numbers, the A/B table, and the failures' last error lines."""

from __future__ import annotations

from gpu_check_bench import _calls


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _env(ch: dict) -> str:
    e = ch["env"]
    pin = "CI's pin" if e.get("torch_matches_pin") else f"not CI's pin {e.get('torch_pin')}"
    nccl = f", NCCL {e['nccl']}" if "nccl" in e else ""
    return f"torch {e.get('torch')} ({pin}), CUDA {e.get('cuda')}{nccl}; {e.get('device')}"


def _wait(ch: dict) -> str:
    w = ch["wait_probe"]
    per = f"{w['timed_us_per_wait']:.0f} vs {w['untimed_us_per_wait']:.0f} us per tiny wait"
    head = f"flatshard passes a timeout: {w['flatshard_passes_timeout']}; {per}"
    if "timed_host_ms_behind_100ms" not in w:
        return head + "; the 100 ms probe: CUDA only"
    timed, untimed = w["timed_host_ms_behind_100ms"], w["untimed_host_ms_behind_100ms"]
    return (
        f"host in wait(timeout) {timed:.1f} ms vs wait() {untimed:.2f} ms (100 ms kernel); {head}"
    )


def _one(name: str, r: dict) -> str:
    if r["status"] == "skip":
        return f"{name} skip ({r['skipped']})"
    extra = ""
    if "bit_identical" in r:
        extra = f", bit-identical {r['bit_identical']}"
    if "collectives" in r:
        extra += f", {_calls(r['collectives'])}"
    return f"{name} {r['status']}{extra}"


def _forced(ch: dict) -> str:
    return "; ".join(_one(n, r) for n, r in ch.items())


def _checks(ch: dict) -> str:
    count = {s: sum(r["status"] == s for r in ch.values()) for s in ("pass", "fail", "skip")}
    line = f"{count['pass']}/{len(ch)} passed"
    line += f", {count['skip']} skipped" if count["skip"] else ""
    failed = [n for n, r in ch.items() if r["status"] == "fail"]
    return line + (f"; FAILED: {', '.join(failed)}" if failed else "")


def _sync(ch: dict) -> str:
    s, parts = ch["sync_audit"], []
    for variant in ("bf16", "bf16_offload"):
        v = s[variant]
        ours = [f"{site} x{n}" for site, n in v["sites"].items() if site.startswith("flatshard/")]
        top = f" ({'; '.join(ours[:3])})" if ours else ""
        parts.append(
            f"{variant}: {v['syncs']} syncs/step, {v['flatshard_syncs']} in flatshard{top}"
        )
    tail = f" [{s['skipped']}]" if "skipped" in s else ""
    return "; ".join(parts) + tail


def _ab(ch: dict) -> str:
    parts = []
    for precision, row in ch.items():
        if row["status"] == "fail":
            parts.append(f"{precision}: FAILED")
            continue
        ratio = row["ratios"].get("flatshard_forced/fsdp2", {}).get("paired_median")
        vs = f" flatshard_forced/fsdp2 {ratio:.3f}" if ratio else ""
        parts.append(f"{precision}, GPT {row['model']} ({row['params'] / 1e6:.0f}M):{vs}")
    return "; ".join(parts) + " (table below)"


def _profile(ch: dict) -> str:
    p, parts = ch["profiler"], []
    for mode in ("flatshard_forced", "fsdp2"):
        m, fields = p.get(mode, {}), []
        if "compute_stream_idle_share" in m:
            fields.append(f"compute stream idle {_pct(m['compute_stream_idle_share'])}")
            fields.append(f"NCCL {m['nccl_ms']:.1f} ms")
        if mode.startswith("flatshard") and "host_wait_ms_per_step" in m:
            fields.append(f"host in waits {m['host_wait_ms_per_step']:.2f} ms/step")
        if "step_ms" in m:
            fields.append(f"step {m['step_ms']:.1f} ms")
        parts.append(f"{mode}: {', '.join(fields)}")
    return "; ".join(parts) + (f" [{p['skipped']}]" if "skipped" in p else "")


HEADLINES = {"env": _env, "wait_probe": _wait, "forced": _forced, "checks_forced": _checks}
HEADLINES.update(
    checks_plain=_checks, sync_audit=_sync, ab=_ab, profiler=_profile, torch_cp=_forced
)
HEADLINES.update(sanitizer=_forced)  # TORCH_CUDA_SANITIZER=1: gpu_check_sanitizer.py


def _headline(name: str, section: dict) -> str:
    if "checks" not in section:
        return section.get("skipped", "")
    try:
        return HEADLINES[name](section["checks"])
    except Exception as err:  # a summary must never hide the JSON
        return f"(no summary: {type(err).__name__}: {err}; see gpu_check.json)"


def _ab_table(section: dict) -> list[str]:
    lines = []
    for precision, row in section.get("checks", {}).items():
        if "modes" not in row:
            continue
        lines += ["", f"A/B, {precision}, batch {row['batch']}x{row['seq']}:", ""]
        lines += ["| mode | median ms | peak MB | collectives/step |", "|---|---:|---:|---|"]
        for mode, m in row["modes"].items():
            calls = _calls(m.get("collectives_per_step", {}))
            lines.append(f"| {mode} | {m['median_s'] * 1e3:.1f} | {m['peak_mb']:.0f} | {calls} |")
    return lines


def _failures(report: dict) -> list[str]:
    lines = []
    for name, section in report["sections"].items():
        for check, r in section.get("checks", {}).items():
            if r.get("status") == "fail":
                last = (r.get("error") or "").strip().splitlines()[-1:] or ["(a check was false)"]
                lines.append(f"- {name}/{check}: {last[0]}")
    return ["", "Failures:", "", *lines] if lines else []


def markdown(report: dict) -> str:
    mode = "DRY RUN on the CPU (Gloo, tiny sizes)" if report["dry_run"] else report["device"]
    verdict = {True: "PASSED", False: "FAILED"}.get(report.get("ok"), "INCOMPLETE")
    lines = [f"# flatshard gpu_check: {verdict}", ""]
    lines.append(f"{mode}; torch {report['torch']}; {report.get('seconds', 0):.0f} s in all.")
    lines += ["", "| section | status | result | s |", "|---|---|---|---:|"]
    for name, section in report["sections"].items():
        head = _headline(name, section).replace("|", "/")
        seconds = section.get("seconds", 0)
        lines.append(f"| {name} | {section['status'].upper()} | {head} | {seconds:.0f} |")
    lines += _ab_table(report["sections"].get("ab", {}))
    lines += _failures(report)
    if report["dry_run"]:
        lines += [
            "",
            "Dry run: the CUDA-only parts are skipped with the reason; times mean nothing.",
        ]
    return "\n".join(lines) + "\n"
