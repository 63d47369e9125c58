"""A recipe file's options merged under the command line's: what the user typed wins, and each key of the file is
accounted for (used, default, overridden, not modelled, ignored, not read). The result is the command's options
by name, as if typed, so the command builds its option groups from them as it always does."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from memcalc.errors import InputError

from .axolotl import read_axolotl
from .ignored import irrelevant
from .ledger import NOT_MODELLED, NOT_READ, OVERRIDDEN, USED, KeyUse, KeyLedger, flag_of
from .loading import KINDS, kind_of, load, split_hint
from .torchtune import read_torchtune
from .trainer import read_trainer

READERS = {"trainer": read_trainer, "axolotl": read_axolotl, "torchtune": read_torchtune}
TYPED = ("COMMANDLINE", "ENVIRONMENT", "PROMPT")  # click's ParameterSource: what the user gave, not a default
MODEL = ("params", "model", "config")  # one names the model: a typed one stands in for the file's
SHARDING = ("offload", "offload_params", "hybrid")  # parts of the file's sharding, which a typed --zero replaces


@dataclass(frozen=True)
class FromFile:
    """What --from read: the file, its kind, each key's use, and which keys set each option."""

    path: str
    kind: str
    keys: tuple[KeyUse, ...]
    origin: dict[str, tuple[str, ...]]  # option -> the keys that set it
    remarks: tuple[str, ...]  # what the whole file is taken as (the stack, and why)
    typed: frozenset[str]  # the options the user typed, which the file's keys did not set

    @property
    def label(self) -> str:
        return f"{self.path} ({KINDS[self.kind]})"

    def unmodelled(self) -> list[str]:
        """The keys whose effect on memory the verdict leaves out, with why: for a warning on stderr."""
        return [f"{k.key}: {k.note if k.use == NOT_MODELLED else k.missing}" for k in self.keys
                if k.use == NOT_MODELLED or k.missing and k.use != OVERRIDDEN]  # fmt: skip


def typed_names(ctx, options: dict) -> set[str]:
    """The options the user typed (or set in the environment), by click's ParameterSource."""
    names = set()
    for name in options:
        source = ctx.get_parameter_source(name) if name != "ctx" else None
        if source is not None and source.name in TYPED:
            names.add(name)
    return names


def read_recipe(spec: str, typed: dict) -> tuple[KeyLedger, str]:
    """The file at spec (KIND:FILE or FILE) read by its kind's reader into a ledger, every key accounted for."""
    hint, path = split_hint(spec)
    data = load(path)
    kind = kind_of(data, path, hint)
    ledger = KeyLedger(path, data)
    READERS[kind](ledger, typed)
    account_rest(ledger, kind)
    return ledger, kind


def apply_file(options: dict, typed: set[str], command: str, listed: tuple[str, ...] = ()) -> tuple[dict, FromFile]:
    """The command's options with the file's under the typed ones; `listed` names the options the command takes
    as a list (estimate's --tricks, repeatable)."""
    ledger, kind = read_recipe(options["from_file"], {name: options[name] for name in typed})
    merged = dict(options)
    for option, value in ledger.options.items():
        keys = ledger.origin.get(option, [])
        by = typed_in_place(option, typed)
        if option not in options:
            for key in keys:
                ledger.uses[key] = replace(ledger.uses[key], use=NOT_MODELLED,
                                           note=f"memcalc {command} takes no {flag_of(option)}")  # fmt: skip
        elif by:
            overridden(ledger, keys, by, typed)
        else:
            merged[option] = [value] if option in listed else value
    for option, keys in ledger.origin.items():
        if option not in ledger.options and option in typed:  # a key left to memcalc's default, now typed
            overridden(ledger, keys, option, typed)
    for need in ledger.needs:
        by = next((o for o in need.options if o in typed), None)
        if by is None:
            raise InputError(need.refusal)
        if need.replaces:
            overridden(ledger, [need.key], by, typed)
    origin = {k: tuple(v) for k, v in ledger.origin.items()}
    remarks = tuple(ledger.remarks) if "stack" not in typed else ()
    return merged, FromFile(ledger.path, kind, ordered(ledger), origin, remarks, frozenset(typed))


def typed_in_place(option: str, typed: set[str]) -> str | None:
    """The typed option that stands in for the file's: the same one; for the model any of --params, --model,
    --config; for the file's offload and hybrid sharding, --zero."""
    if option in typed:
        return option
    if option in SHARDING and "zero" in typed:
        return "zero"
    return next((o for o in MODEL if o in typed), None) if option in MODEL else None


def overridden(ledger: KeyLedger, keys: list[str], option: str, typed: set[str]) -> None:
    """The keys behind a typed option: overridden where every option they set was typed, else noted."""
    for key in keys:
        old = ledger.uses.get(key) or KeyUse(key, ledger.shown(key), USED, "")
        options = [o for o, ks in ledger.origin.items() if key in ks]
        options += [n.options[0] for n in ledger.needs if n.key == key and n.replaces]
        if all(typed_in_place(o, typed) for o in options):
            ledger.uses[key] = replace(old, use=OVERRIDDEN, note=f"{flag_of(option)} typed in its place")
        elif flag_of(option) + " typed" not in old.note:
            ledger.uses[key] = replace(old, note=f"{old.note}; {flag_of(option)} typed in its place")


def account_rest(ledger: KeyLedger, kind: str) -> None:
    """Every key no reader noted: ignored where it does not change memory or is null or false (not set, off), else
    not read. A section some of whose keys were read is gone through key by key; any other is one entry."""

    def walk(node: dict, prefix: str) -> None:
        for name, value in node.items():
            key = prefix + name
            if key in ledger.uses:
                continue
            if isinstance(value, dict) and any(k.startswith(key + ".") for k in ledger.uses):
                walk(value, key + ".")
            elif irrelevant(kind, key):
                ledger.ignore(key, "does not change memory")
            elif value is None or value is False:
                ledger.ignore(key, "not set" if value is None else "off")
            else:
                ledger.note(key, NOT_READ, "not a key memcalc knows")

    walk(ledger.data, "")


def ordered(ledger: KeyLedger) -> tuple[KeyUse, ...]:
    """The keys as the file writes them, those it leaves out (the defaults) last."""
    place = {key: i for i, key in enumerate(dotted(ledger.data))}
    return tuple(sorted(ledger.uses.values(), key=lambda k: (place.get(k.key, len(place)), k.key)))


def dotted(node: dict, prefix: str = "") -> list[str]:
    out = []
    for name, value in node.items():
        out.append(prefix + name)
        if isinstance(value, dict):
            out += dotted(value, prefix + name + ".")
    return out


def blame(message: str, source: FromFile | None) -> str:
    """A refusal naming an option the file set (as --micro-batch, or micro-batch as the sizes' checks write it),
    with the file's keys behind it."""
    if source is None:
        return message
    named = []
    for option, keys in source.origin.items():
        name = option.replace("_", "-")
        bare = "" if option in MODEL + ("stack", "recipe") else "|(?<![\\w-])"
        if keys and option not in source.typed and re.search(rf"(--{bare}){name}(?![\w-])", message):
            named.append(f"--{name} from {', '.join(keys)}")
    return f"{message} ({source.path}: {'; '.join(named)})" if named else message
