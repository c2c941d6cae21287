"""The status page at ``GET /``: versions with tiers and leases, watermark, memory per tier
against budget, cache hit rate, and charts of the last minutes (queue, wait, tokens/s).

One self-contained HTML response (no CDN: it must work offline): the server renders all of it,
charts as inline SVG from ``Runtime.history``; ``static/status.js`` only re-fetches and swaps.
"""

from __future__ import annotations

import html
import math
import time
from collections.abc import Callable
from functools import cache
from importlib import resources

from oldlogit_service import __version__
from oldlogit_service.history import Sample
from oldlogit_service.metrics import ServiceState
from oldlogit_service.runtime import StatusView

REFRESH_S = 2.0
_W, _H = 260, 100  # chart size in SVG units = CSS pixels


@cache
def _asset(name: str) -> str:
    return (resources.files("oldlogit_service") / "static" / name).read_text(encoding="utf-8")


def _esc(x: object) -> str:
    return html.escape(str(x))


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _fmt_num(x: float) -> str:
    if not math.isfinite(x):
        return "–"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _nice_ceiling(x: float) -> float:
    """The smallest 1, 2 or 5 × 10^k at or above ``x`` (1 for an all-zero chart)."""
    if x <= 0:
        return 1.0
    mag = 10.0 ** math.floor(math.log10(x))
    return next(m * mag for m in (1, 2, 5, 10) if m * mag >= x)


def _chart(
    cid: str,
    title: str,
    unit: str,
    samples: list[Sample],
    value: Callable[[Sample], float],
    now: float,
    window_s: float,
    top: float | None = None,
) -> str:
    """A line chart of ``value`` over the last ``window_s``; NaN values break the line, and
    the newest point gets a dot (a line of one point would not show)."""
    pts = [(s.t, value(s)) for s in samples if s.t >= now - window_s]
    finite = [v for _, v in pts if math.isfinite(v)]
    top = top or _nice_ceiling(max(finite, default=0.0))
    runs: list[list[str]] = [[]]
    for t, v in pts:
        if not math.isfinite(v):
            runs.append([])
            continue
        x = _W * (t - (now - window_s)) / window_s
        y = _H - (_H - 12) * min(v, top) / top  # 12 units of headroom for the top label
        runs[-1].append(f"{x:.1f},{y:.1f}")
    lines = "".join(f'<polyline points="{" ".join(r)}"/>' for r in runs if r)
    if runs[-1]:
        cx, cy = runs[-1][-1].split(",")
        lines += f'<circle cx="{cx}" cy="{cy}" r="2"/>'
    latest = finite[-1] if finite and math.isfinite(pts[-1][1]) else math.nan
    return (
        f'<figure class="chart"><figcaption>{_esc(title)}: <b>{_fmt_num(latest)}</b> '
        f"{_esc(unit)}</figcaption>"
        f'<svg id="chart-{cid}" viewBox="0 0 {_W} {_H}" role="img" '
        f'aria-label="{_esc(title)}, last {_fmt_span(window_s)}" '
        f'data-samples="{len(finite)}" data-max="{max(finite, default=0.0):g}">'
        f'<line x1="0" y1="12" x2="{_W}" y2="12"/><text x="3" y="10">{_fmt_num(top)}</text>'
        f"{lines}</svg>"
        f'<div class="axis"><span>−{_fmt_span(window_s)}</span><span>now</span></div></figure>'
    )


def _fmt_span(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def _window(rt: StatusView, now: float) -> float:
    """What the charts span: the history so far, at least a minute, at most all it keeps."""
    samples = rt.history.samples()
    return min(rt.history.keep_s, max(60.0, now - samples[0].t if samples else 0.0))


def _charts(rt: StatusView, now: float) -> str:
    samples = rt.history.samples()
    window = _window(rt, now)
    if not samples:
        return '<p class="empty">Collecting samples…</p>'
    return "".join(
        (
            _chart("queue", "Queue", "jobs", samples, lambda s: s.queue_depth, now, window),
            _chart(
                "wait", "Mean queue wait", "ms", samples, lambda s: s.queue_wait_ms, now, window
            ),
            _chart(
                "tokens", "Throughput", "tokens/s", samples, lambda s: s.tokens_per_s, now, window
            ),
            _chart(
                "hits",
                "Cache hit rate",
                "%",
                samples,
                lambda s: 100 * s.cache_hit_rate,
                now,
                window,
                top=100.0,
            ),
        )
    )


def _tiers_table(state: ServiceState) -> str:
    rows = []
    for name, t in state.store.tiers.items():
        used, budget = float(t.bytes), float(t.budget)
        rows.append(
            f"<tr><td>{_badges([name])}</td>"
            f'<td class="num">{_fmt_bytes(used)}</td><td class="num">{_fmt_bytes(budget)}</td>'
            f'<td><meter min="0" max="{max(budget, 1):g}" high="{0.9 * budget:g}" '
            f'value="{used:g}"></meter></td>'
            f'<td class="num">{t.versions}</td>'
            f'<td class="num">{t.evictions}</td></tr>'
        )
    cache = state.cache
    used, budget = float(cache.bytes), float(cache.max_bytes)
    rows.append(
        f"<tr><td>result cache</td><td class='num'>{_fmt_bytes(used)}</td>"
        f"<td class='num'>{_fmt_bytes(budget)}</td><td><meter min='0' "
        f"max='{max(budget, 1):g}' value='{used:g}'></meter></td>"
        f"<td class='num'>{cache.entries} entries</td>"
        f"<td class='num'>{cache.evictions}</td></tr>"
    )
    return (
        '<table id="tiers"><tr><th>tier</th><th>resident</th><th>budget</th><th></th>'
        "<th>versions</th><th>evictions</th></tr>" + "".join(rows) + "</table>"
    )


def _badges(tiers: list[str]) -> str:
    return "".join(f'<span class="tier {_esc(t)}">{_esc(t)}</span>' for t in tiers)


def _versions_table(rt: StatusView, now: float) -> str:
    versions = rt.versions
    if not versions:
        return '<p class="empty" id="versions">No version published yet.</p>'
    rows = "".join(
        f'<tr data-version="{v.policy_version}"><td class="num">{v.policy_version}</td>'
        f"<td>{_esc(v.kind)}{'' if v.parent is None else f' of {v.parent}'}</td>"
        f"<td>{_badges(v.tiers)}</td>"
        f'<td class="num">{_fmt_bytes(v.nbytes)}</td><td class="num">{v.leases}</td>'
        f'<td class="num">{_fmt_age(now - v.created_at) if v.created_at else "–"}</td>'
        f'<td><code title="{_esc(v.weight_sha256)}">{_esc(v.weight_sha256[:16])}…</code></td></tr>'
        for v in reversed(versions)  # newest first: that is what an operator looks for
    )
    return (
        '<table id="versions"><tr><th>version</th><th>kind</th><th>tiers</th><th>size</th>'
        f"<th>leases</th><th>age</th><th>weight sha256</th></tr>{rows}</table>"
    )


def _fmt_age(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 120:
        return f"{s} s"
    return f"{s // 60} min" if s < 7200 else f"{s // 3600} h"


def render_status_page(rt: StatusView) -> str:
    now = time.time()
    info, state = rt.info, rt.state
    hits, misses = state.cache.hits, state.cache.misses
    rate = f"{100.0 * hits / (hits + misses):.1f} %" if hits + misses else "–"
    newest, watermark = state.store.newest, state.store.watermark
    facts = (
        ("ready", "yes" if state.ready else "no"),
        ("newest version", "none" if newest is None else newest),
        ("watermark", "none" if watermark is None else watermark),
        ("versions", state.store.versions),
        ("leases", state.store.leases),
        ("queue", f"{state.queue_depth} jobs / {state.queue_tokens} tokens"),
        ("cache hit rate", rate),
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>oldlogit status</title><link rel="icon" href="data:,">
<style>{_asset("status.css")}</style></head>
<body data-refresh-s="{REFRESH_S:g}">
<header><h1>oldlogit <small>{_esc(__version__)}</small></h1>
<span id="updated">rendered {time.strftime("%H:%M:%S", time.localtime(now))}</span></header>
<main id="live">
<p>Model <b>{_esc(info.architecture)}</b> ({info.num_parameters:,} parameters),
{_esc(info.dtype)} on {_esc(info.device)}, head {_esc(info.head_dtype)},
mode <b>{_esc(info.mode)}</b>.</p>
<ul class="facts" id="facts">{"".join(f"<li>{k}: <b>{_esc(v)}</b></li>" for k, v in facts)}</ul>
<h2>Last {_fmt_span(_window(rt, now))}</h2>
<div class="charts" id="charts">{_charts(rt, now)}</div>
<h2>Memory per tier</h2>
{_tiers_table(state)}
<h2>Versions</h2>
{_versions_table(rt, now)}
</main>
<script>{_asset("status.js")}</script>
</body></html>"""
