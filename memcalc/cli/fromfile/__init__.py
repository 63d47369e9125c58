"""`--from FILE`: a training recipe's file read into the options a command takes, as if they were typed.

A TRL or Transformers arguments file (trainer), an axolotl config (axolotl) or a torchtune recipe config
(torchtune) is read (loading), each of its keys accounted for in a ledger (ledger: used, not modelled,
ignored, not read), the kind's keys mapped onto memcalc's options (trainer, axolotl, torchtune, with what they
share in common), and the options merged under what the user typed (merge). The engine never sees the file:
it gets the option records the command builds from the merged options (memcalc.cli.groups).

May import: everything memcalc.cli may, and PyYAML (lazily: only a --from reads it).
"""

from .merge import FromFile, apply_file, blame, read_recipe, typed_names

__all__ = ["FromFile", "apply_file", "blame", "read_recipe", "typed_names"]
