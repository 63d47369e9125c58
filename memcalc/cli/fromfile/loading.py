"""A recipe file read into a mapping, and which kind of file it is.

`--from FILE` or `--from KIND:FILE` (KIND trainer, axolotl or torchtune, where the keys leave it open). The file
is read as memcalc reads a config.json (memcalc.model.jsonfile: a regular file, at most 1 MiB, UTF-8): JSON where
it ends in .json, else YAML through PyYAML's safe loader (no tags that build objects). Its values must be plain
data: mappings, lists, strings, numbers, booleans, null; a YAML alias that refers to itself or that repeats a
large part of the file is refused, so that no walk over it runs long.
"""

from __future__ import annotations

import math
from pathlib import Path

from memcalc.errors import InputError
from memcalc.model.jsonfile import read_json_object, read_text

KINDS = {"trainer": "TRL or Transformers arguments", "axolotl": "axolotl config", "torchtune": "torchtune recipe config"}
MAX_NODES = 20_000  # values in the file, aliases counted each time they are used: recipe files hold a few hundred
MAX_DEPTH = 32
# Keys that only one kind of file has (each kind's schema, as cited in its reader): the kind with more of them
# is the file's; a tie asks for KIND:FILE.
MARKS = {
    "trainer": ("per_device_train_batch_size", "model_name_or_path", "optim", "max_seq_length", "max_length",
                "use_peft", "num_train_epochs", "dataset_text_field", "packing", "model_init_kwargs",
                "gradient_checkpointing_kwargs", "per_device_eval_batch_size", "peft_config", "lora_config"),
    "axolotl": ("base_model", "sequence_len", "micro_batch_size", "adapter", "lora_target_linear", "sample_packing",
                "num_epochs", "optimizer", "datasets", "flash_attention", "sdp_attention", "base_model_config"),
    "torchtune": ("batch_size", "epochs", "enable_activation_checkpointing", "enable_activation_offloading",
                  "optimizer_in_bwd", "dtype", "checkpointer", "max_steps_per_epoch"),
}  # fmt: skip


def split_hint(spec: str) -> tuple[str | None, str]:
    """'axolotl:run.yml' -> ('axolotl', 'run.yml'); a path that exists as written is a path whatever it holds."""
    kind, sep, rest = spec.partition(":")
    if sep and kind.strip().lower() in KINDS and not Path(spec).exists():
        return kind.strip().lower(), rest
    return None, spec


def load(path: str) -> dict:
    """The file's top-level mapping, checked to be plain data of bounded size."""
    if path.lower().endswith(".json"):
        data = read_json_object(path, "recipe")
    else:
        data = parse_yaml(read_text(Path(path), "recipe"), path)
    check_plain(data, path, [0], 0, set())
    return data


def parse_yaml(text: str, path: str) -> dict:
    import yaml  # PyYAML: only --from needs it

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(e, "problem", None) or e.__class__.__name__
        raise InputError(f"recipe {path} is not valid YAML{where}: {problem}") from None
    except RecursionError:
        raise InputError(f"recipe {path} is nested too deeply to be a recipe file") from None
    except ValueError as e:  # an integer past Python's digit limit for int()
        raise InputError(f"recipe {path}: {str(e)[:80]}: not a number memcalc reads") from None
    if not isinstance(data, dict):
        what = "empty" if data is None else f"a {type(data).__name__}, not a mapping of keys"
        raise InputError(f"recipe {path} must hold a mapping of keys (YAML or JSON); it is {what}")
    return data


def check_plain(node: object, path: str, seen: list[int], depth: int, open_ids: set[int]) -> None:
    """Plain data only, at most MAX_NODES values (aliases counted where used) and MAX_DEPTH deep, no cycle."""
    seen[0] += 1
    if seen[0] > MAX_NODES or depth > MAX_DEPTH:
        raise InputError(f"recipe {path} holds more than {MAX_NODES:,} values or nests deeper than {MAX_DEPTH} "
                         "(YAML aliases repeat what they name): not a recipe file")  # fmt: skip
    if isinstance(node, (dict, list)):
        if id(node) in open_ids:
            raise InputError(f"recipe {path}: a YAML alias refers to itself: not a recipe file")
        open_ids.add(id(node))
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            if isinstance(node, dict) and not isinstance(key, str):
                raise InputError(f"recipe {path}: key {key!r} is not a name: not a recipe file")
            check_plain(value, path, seen, depth + 1, open_ids)
        open_ids.discard(id(node))
    elif isinstance(node, float) and not math.isfinite(node):
        raise InputError(f"recipe {path}: {node} is not a number memcalc accepts")
    elif not (node is None or isinstance(node, (str, int, float, bool))):
        raise InputError(f"recipe {path}: {type(node).__name__} values ({str(node)[:40]}) are not plain data: "
                         "write it as a string")  # fmt: skip


def kind_of(data: dict, path: str, hint: str | None) -> str:
    """The hint, else the kind whose marks the file has most of: torchtune wherever a `_component_` is."""
    if hint is not None:
        return hint
    if has_component(data):
        return "torchtune"
    scores = {kind: sum(key in data for key in marks) for kind, marks in MARKS.items()}
    best = max(scores.values())
    leaders = [kind for kind, n in scores.items() if n == best]
    if best == 0 or len(leaders) > 1:
        what = "none of their keys" if best == 0 else f"keys of {' and '.join(leaders)} alike"
        raise InputError(f"recipe {path}: cannot tell which kind of file it is ({what}); name it: --from "
                         f"trainer:{path}, axolotl:{path} or torchtune:{path}")  # fmt: skip
    return leaders[0]


def has_component(node: object) -> bool:
    """Whether a torchtune `_component_` key is anywhere in the file (its sections instantiate classes)."""
    if isinstance(node, dict):
        return "_component_" in node or any(has_component(v) for v in node.values())
    if isinstance(node, list):
        return any(has_component(v) for v in node)
    return False
