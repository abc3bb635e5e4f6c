"""Quality harnesses: census campaigns (settings arms x prompt batteries with acceptance gates), the smoketest
gate, and the programmatic and long-context batteries. docs/QUALITY.md describes the commands and formats.

Modules, lower to higher: arms (campaign files, settings validation), batteries (battery files), checkers
(reply -> outcome), sandbox (+ jail.py, run outside this package) for programs, runner (arms x prompts ->
results.jsonl), analyze (results -> per-arm table), gates (acceptance rules), smoketest, commands (the CLI).
"""
