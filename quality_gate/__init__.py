"""The quality gate: generate the reference and each arm's clips, score what users get (the decoded MP4s) with
LPIPS per frame and two spectral audio distances, measure the noise floor, and write JSON, Markdown and PNGs.

Modules: `lpips_metric` (video), `audio_metric` (audio), `clips` (prompts, arms, the clip cache, generation),
`scoring` (per-clip scores, set aggregates, thresholds), `figures` (contact sheets, per-frame plots), `report`
(JSON + Markdown), `gate` (the `k6fast gate` command). Importing this package imports none of them.
"""


class GateError(Exception):
    """The gate cannot run as asked (missing backbone weights, bad prompt file, mismatched clips); the message says
    what was expected and what was found. `k6fast gate` prints it and exits with status 2."""
