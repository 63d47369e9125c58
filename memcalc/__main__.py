"""`python -m memcalc`: the same CLI as the `memcalc` script, from a checkout."""

from memcalc.cli import main

main()
