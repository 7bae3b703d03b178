"""`k6fast tune`: the fastest arm whose gate passes on the user's own prompts and weights.

Modules: `search` (the lattice and the budgeted search; pure Python), `space` (the lossy knobs, from the switch
registry), `speed` (the speed model from bench timings), `config` (settings and the checks that load nothing heavy),
`run` (bench and gate wiring, the record and the winning .env), `cli` (the command line). Importing this package
imports none of them.
"""
