"""The status page at ``GET /``: versions with their tiers, leases, watermark, memory per tier.

Self-contained HTML (no CDN, no script needed to read it); issue E adds live charts.
"""

from __future__ import annotations

import html

from oldlogit_service import __version__
from oldlogit_service.runtime import Runtime


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def render_status_page(rt: Runtime) -> str:
    info = rt.info()
    versions, watermark = rt.versions()
    state = rt.state()
    rows = "".join(
        f"<tr><td>{v.policy_version}</td><td><code>{html.escape(v.weight_sha256[:16])}…</code>"
        f"</td><td>{html.escape(', '.join(v.tiers))}</td><td>{_fmt_bytes(v.nbytes)}</td>"
        f"<td>{v.leases}</td></tr>"
        for v in versions
    )
    tiers = "".join(
        f"<tr><td>{html.escape(t)}</td><td>{_fmt_bytes(d.get('bytes', 0))}</td>"
        f"<td>{_fmt_bytes(d.get('budget', 0))}</td><td>{d.get('versions', 0)}</td></tr>"
        for t, d in state.get("tiers", {}).items()
    )
    cache = state.get("cache", {})
    hits, misses = cache.get("hits", 0), cache.get("misses", 0)
    rate = f"{100.0 * hits / (hits + misses):.1f} %" if hits + misses else "–"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>oldlogit</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; margin: .5em 0 1.5em; }}
td, th {{ border: 1px solid #ccc; padding: .25em .6em; text-align: left; }}
th {{ background: #f3f3f3; }}
</style></head><body>
<h1>oldlogit <small>{html.escape(__version__)}</small></h1>
<p>Model <b>{html.escape(info.architecture)}</b> ({info.num_parameters:,} parameters),
{html.escape(info.dtype)} on {html.escape(info.device)}, head {html.escape(info.head_dtype)},
mode <b>{html.escape(info.mode)}</b>. Ready: <b>{"yes" if rt.ready else "no"}</b>.
Watermark: <b>{watermark if watermark is not None else "none"}</b>.
Queue: {state.get("queue_depth", 0)} jobs. Cache hit rate: {rate}.</p>
<h2>Versions</h2>
<table id="versions"><tr><th>version</th><th>sha256</th><th>tiers</th><th>size</th>
<th>leases</th></tr>{rows}</table>
<h2>Memory per tier</h2>
<table id="tiers"><tr><th>tier</th><th>resident</th><th>budget</th><th>versions</th></tr>
{tiers}</table>
</body></html>"""
