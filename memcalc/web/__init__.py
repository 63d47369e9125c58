"""`memcalc web`: the same answers on a local page. A standard-library HTTP server (server) serves the page's
files from the package (static/: HTML, one script, one style sheet; nothing from the network) and runs the
commands the page builds, as the command line runs them (calls), so every number on the page is one the
command line prints, and a refusal the same line.

May import: memcalc.model, memcalc.errors and memcalc.exact.base.cache (whether the disk cache is on). The
commands themselves come in as a function from the CLI (memcalc.cli.inprocess), which alone imports this package.
"""
