"""`k6fast bench`: A/B timing sessions with mirrored visits in fresh processes, peer rows, recorded results.

- `session.py`: the plan, the mirrored order, running each visit as a process under the GPU watch
- `visit.py`: what one visit process runs (`python -m k6fast.bench.visit`) and records
- `peers.py`: the diffusers peer arms (`diffusers`, `diffusers-offload`)
- `workload.py`: geometry and the synthetic inputs of `--component dit|block`
- `gpu.py`: nvidia-smi: idle wait and contamination
- `stats.py`: medians, spread, ratios, the no-difference rule
- `records.py`: the session folder, atomic writes; `report.py`: measurements/README.md and the plots
- `cli.py`: `register(subparsers)` for the k6fast command line

Nothing here is imported by the runtime; importing this package imports nothing heavy.
"""
