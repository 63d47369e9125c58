"""What `--from FILE` read, shown before the answer: the keys that set options (or whose library default did),
those the command line overrode, those whose effect on memory the verdict leaves out, and, as notes, those
ignored (they do not change memory) and those memcalc does not know. JSON carries every key under "from".

The object is memcalc.cli.fromfile's FromFile (path, kind, label, keys: key, value, use, note, missing)."""

from __future__ import annotations

from .render import Section

SHOWN = ("used", "default", "overridden", "not modelled")
LISTED = 12  # names in a note before "and N more"


def from_file_section(source) -> Section:
    rows = [[k.key, k.value, cell(k)] for k in source.keys if k.use in SHOWN]
    notes = list(source.remarks)
    for use, say in (("not read", "not read (no key memcalc knows)"), ("ignored", "ignored, as they do not change "
                                                                                 "memory")):  # fmt: skip
        names = [k.key for k in source.keys if k.use == use]
        if names:
            more = f" and {len(names) - LISTED} more (--format json lists them)" if len(names) > LISTED else ""
            notes.append(f"{say}: {', '.join(names[:LISTED])}{more}")
    title = f"From {source.label}: the options its keys set, under those typed"
    return Section(title, ["key", "value", "memcalc"], rows, notes, align="lll")


def cell(k) -> str:
    """A shown key's use: the option it set, its default, what overrode it, or what the verdict leaves out."""
    text = {"used": k.note, "default": f"default: {k.note}", "overridden": f"overridden: {k.note}",
            "not modelled": f"not modelled: {k.note}"}[k.use]  # fmt: skip
    return f"{text}; not modelled: {k.missing}" if k.missing and k.use != "overridden" else text


def from_file_json(source) -> dict:
    return {"file": source.path, "kind": source.kind, "remarks": list(source.remarks),
            "keys": [{"key": k.key, "value": k.value, "use": k.use, "note": k.note, "not_modelled": k.missing}
                     for k in source.keys]}  # fmt: skip
